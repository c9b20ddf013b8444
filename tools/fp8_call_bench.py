"""The fused fp8 call at TP = 1 against XLA's path, with operands quantized before the call or
in it (fp8=, where XLA can write w's K-major layout inside the quantizing fusion).

Not a test module; run on a GPU machine:

  python tools/fp8_call_bench.py [--shapes MxKxN,...] [--rounds 7] [--json OUT.json]

Per shape and scaling, four programs (each jax.jit of all_gather_matmul under jax.shard_map on a
one-device mesh, bf16 output): "pre" takes fp8 operands and scales made by jax_distgemm.quantize,
"fp8=" takes bf16 operands and quantizes in the call; each with implementation="ffi" (ours) and
"reference" (XLA's fp8 path: a cuBLASLt fp8 GEMM per tensor, a dequantized fp32 dot per block).
Inputs are two sets of random normals, alternated; a round runs 20 back-to-back calls of each
program in a shuffled order and the host times them (one block_until_ready); the median round is
reported.  Also the relative Frobenius difference of ours from XLA's output.
"""

import argparse
import json
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_distgemm as jd

CALLS = 20


def program(mesh, kind: str, implementation: str, scaling: str):
  def body(*a):
    if kind == "pre":
      xq, sx, wq, sw = a
      return jd.all_gather_matmul(xq, wq, axis_name="tp", x_scale=sx, w_scale=sw,
                                  out_dtype=jnp.bfloat16, implementation=implementation)
    return jd.all_gather_matmul(*a, axis_name="tp", fp8=scaling, implementation=implementation)
  n = 4 if kind == "pre" else 2
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(),) * n, out_specs=P(),
                               check_vma=False))


def measure(mesh, m: int, k: int, n: int, scaling: str, rounds: int) -> dict:
  sets = []
  for s in range(2):
    kx, kw = jax.random.split(jax.random.key(100 * s + 7))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.bfloat16) * 0.05
    (xq, sx), (wq, sw) = jd.quantize(x, scaling, operand="x"), jd.quantize(w, scaling, operand="w")
    sets.append({"pre": (xq, sx, wq, sw), "fp8=": (x, w)})
  progs, rows = {}, {}
  for kind in ("pre", "fp8="):
    for impl in ("ffi", "reference"):
      f = program(mesh, kind, impl, scaling)
      progs[(kind, impl)] = f
      rows[(kind, impl)] = {"out": np.asarray(f(*sets[0][kind]), np.float64), "ms": []}
  for r in range(rounds):
    for key in random.Random(r).sample(list(progs), len(progs)):
      f, kind = progs[key], key[0]
      jax.block_until_ready(f(*sets[1][kind]))
      t0, out = time.perf_counter(), None
      for i in range(CALLS):
        out = f(*sets[i % 2][kind])
      jax.block_until_ready(out)
      rows[key]["ms"].append((time.perf_counter() - t0) / CALLS * 1e3)
  result = {}
  for kind in ("pre", "fp8="):
    ours, xla = rows[(kind, "ffi")], rows[(kind, "reference")]
    result[kind] = {
        "ours_ms": statistics.median(ours["ms"]), "xla_ms": statistics.median(xla["ms"]),
        "diff": float(np.linalg.norm(ours["out"] - xla["out"]) / np.linalg.norm(xla["out"]))}
  return result


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", default="4096x8192x14336,2048x8192x4096", help="MxKxN,...")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--json", help="write the results here")
  args = p.parse_args()
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  print(f"device: {jax.devices()[0].device_kind}")
  out = []
  for shape in args.shapes.split(","):
    m, k, n = (int(d) for d in shape.split("x"))
    for scaling in ("tensor", "block"):
      for kind, r in measure(mesh, m, k, n, scaling, args.rounds).items():
        tflops = 2 * m * k * n / r["ours_ms"] / 1e9
        print(f"{m}x{k}x{n} {scaling:6s} {kind:4s}  ours {r['ours_ms']:.4f} ms "
              f"({tflops:.0f} TFLOP/s)  XLA {r['xla_ms']:.4f} ms  XLA/ours "
              f"{r['xla_ms'] / r['ours_ms']:.2f}  diff {r['diff']:.1e}", flush=True)
        out.append(dict(m=m, k=k, n=n, scaling=scaling, operands=kind, **r))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()

#!/usr/bin/env python3
"""Distributed GEMM with jax_distgemm: the JAX counterpart of CUTLASS example 65.

Runs one tensor-parallel GEMM, out = alpha * x @ w + beta * c, with one of CUTLASS's four 1-D
schedules over TP devices, inside jax.jit(jax.shard_map(...)):

  AllGather1D_TilingCD_RotatingA      x rows-sharded, w cols-sharded  -> out cols-sharded
  AllGather1D_TilingCD_RotatingB      x rows-sharded, w cols-sharded  -> out rows-sharded
  ReduceScatter1D_TilingA_RotatingC   x, w sharded on K               -> out rows-sharded
  ReduceScatter1D_TilingB_RotatingC   x, w sharded on K               -> out cols-sharded

It checks the result against a single-device fp32 GEMM (max |out - ref| / max |ref| <= eps),
prints "Disposition: Passed" or "Disposition: Failed" (exit code 1), then reports the average
runtime of `--iterations` back-to-back calls after `--warmup-iterations` warm-up calls, and the
TFLOP/s per device, 2*M*N*K*L / TP / time.

Devices: TP GPUs when there are at least --tp of them; otherwise TP fake CPU devices of this
process (the CPU executor runs the same schedule).  Default shape: 8192 x 8192 x 8192 on GPUs
(the CUTLASS example's 16384 x 106496 x 16384 needs `--m=16384 --n=106496 --k=16384`), and a
small 512 x 1024 x 256 on CPU devices.

  python examples/distributed_gemm.py
  python examples/distributed_gemm.py --schedule=ReduceScatter1D_TilingA_RotatingC --tp=4
  python examples/distributed_gemm.py --m=16384 --n=106496 --k=16384 --tp=8   # 8 Hopper GPUs
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SCHEDULES = (
    "AllGather1D_TilingCD_RotatingA",
    "AllGather1D_TilingCD_RotatingB",
    "ReduceScatter1D_TilingA_RotatingC",
    "ReduceScatter1D_TilingB_RotatingC",
)
DTYPES = ("bf16", "fp16", "fp32")
# eps: max |out - ref| / max |ref|; the output rounding dominates (fp32 allows TF32 on GPU).
DEFAULT_EPS = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-3}
GPU_DEFAULT_SHAPE = (8192, 8192, 8192)
CPU_DEFAULT_SHAPE = (512, 1024, 256)
DEFAULT_TP = 8  # as in the CUTLASS example
FLOAT32_MAX = 3.4028234663852886e38  # alpha and beta are the kernels' float32 epilogue scalars


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description="Tensor-parallel GEMM with one of CUTLASS's Distributed GEMM schedules.")
  p.add_argument("--m", type=int, default=None,
                 help="M extent of the GEMM (default: 8192 on GPUs, 512 on CPU devices)")
  p.add_argument("--n", type=int, default=None,
                 help="N extent of the GEMM (default: 8192 on GPUs, 1024 on CPU devices)")
  p.add_argument("--k", type=int, default=None,
                 help="K extent of the GEMM (default: 8192 on GPUs, 256 on CPU devices)")
  p.add_argument("--l", type=int, default=1, help="L extent (batch) of the GEMM (default: 1)")
  p.add_argument("--alpha", type=float, default=1.0,
                 help="epilogue scalar alpha; alpha and beta must be finite as a float32 "
                      "(default: 1.0)")
  p.add_argument("--beta", type=float, default=0.0, help="epilogue scalar beta; c is random when != 0 (default: 0.0)")
  p.add_argument("--iterations", type=int, default=100, help="profiling iterations (default: 100)")
  p.add_argument("--warmup-iterations", type=int, default=10,
                 help="warm-up iterations before profiling (default: 10)")
  p.add_argument("--eps", type=float, default=None,
                 help="bound on max|out - ref| / max|ref| vs a single-device fp32 GEMM "
                      f"(default per dtype: {DEFAULT_EPS})")
  p.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULES[0],
                 help=f"the Distributed GEMM schedule (default: {SCHEDULES[0]})")
  p.add_argument("--tp", type=int, default=None,
                 help=f"tensor-parallel size (default: all GPUs if there are >= 2, else "
                      f"{DEFAULT_TP} fake CPU devices)")
  p.add_argument("--dtype", choices=DTYPES, default="bf16", help="dtype of x, w, c and out (default: bf16)")
  p.add_argument("--implementation", choices=("ffi", "xla", "reference", "auto"),
                 default="auto",
                 help="ffi: the fused custom call; xla: a ppermute ring; reference: XLA "
                      "all-gather/reduce-scatter + dot; auto: implementation=None, i.e. ffi where "
                      "it can run and is expected to be faster, reference where XLA's own "
                      "path is expected to be (CUDA decode shapes), else xla (default: auto)")
  p.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
  args = p.parse_args(argv)
  for name in ("m", "n", "k", "tp"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  if args.l < 1 or args.iterations < 1 or args.warmup_iterations < 0:
    p.error("--l and --iterations must be >= 1, --warmup-iterations >= 0")
  if args.eps is not None and not args.eps >= 0:  # also nan
    p.error(f"--eps must be a number >= 0 (0: the check must match exactly), got {args.eps}")
  for name in ("alpha", "beta"):  # the library's rule, as a usage error, not a trace-time error
    if not abs(getattr(args, name)) <= FLOAT32_MAX:  # also nan
      p.error(f"--{name}: must be finite as a float32, got {getattr(args, name)}")
  args.parser = p
  return args


def pick_devices(args):
  """TP GPUs if there are enough, else TP fake CPU devices (requested before JAX starts)."""
  import jax  # noqa: PLC0415  (after the jax_num_cpu_devices request below)

  try:
    jax.config.update("jax_num_cpu_devices", max(args.tp or DEFAULT_TP, 1))
  except RuntimeError:
    pass  # JAX already started (main() called in-process): use the CPU devices it has.
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:  # no GPU backend (no GPU, no CUDA jaxlib, or JAX_PLATFORMS=cpu)
    gpus = []
  tp = args.tp or (len(gpus) if len(gpus) >= 2 else DEFAULT_TP)
  if len(gpus) >= tp:
    return gpus[:tp], tp, "gpu"
  cpus = jax.devices("cpu")
  if len(cpus) < tp:
    sys.exit(f"error: need {tp} devices, found {len(gpus)} GPUs and {len(cpus)} CPU devices")
  why = "no GPU found" if not gpus else f"only {len(gpus)} GPUs for --tp={tp}"
  print(f"Note: {why}; running on {tp} fake CPU device{'s' * (tp > 1)} of this process.")
  return cpus[:tp], tp, "cpu"


def divisibility_error(schedule: str, m: int, n: int, k: int, tp: int) -> str | None:
  if schedule.startswith("AllGather"):
    need = {"M": m, "N": n}
  elif schedule == "ReduceScatter1D_TilingA_RotatingC":
    need = {"M": m, "K": k}
  else:
    need = {"N": n, "K": k}
  bad = [f"{name}={v}" for name, v in need.items() if v % tp]
  return f"{', '.join(bad)} must be divisible by TP={tp} for {schedule}" if bad else None


def main(argv=None) -> int:
  args = parse_args(argv)
  devices, tp, platform = pick_devices(args)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding

  import jax_distgemm

  user_shape = (args.m, args.n, args.k)
  default = GPU_DEFAULT_SHAPE if platform == "gpu" else CPU_DEFAULT_SHAPE
  m, n, k = (given if given is not None else d for given, d in zip(user_shape, default))
  if platform == "cpu" and None in user_shape:
    print(f"Note: using the small CPU default shape for the extents not given "
          f"(M={m} N={n} K={k}; GPU default {GPU_DEFAULT_SHAPE}).")
  if (err := divisibility_error(args.schedule, m, n, k, tp)):
    args.parser.error(err)
  batch_count = args.l
  dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[args.dtype]
  eps = DEFAULT_EPS[args.dtype] if args.eps is None else args.eps
  seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
  schedule = jax_distgemm.Schedule[args.schedule]
  implementation = None if args.implementation == "auto" else args.implementation

  # -- Global problem, sharded as the schedule wants it ------------------------------------------
  mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
  x_spec, w_spec, out_spec = schedule.partition_specs(
      "tp", batch=(None,) if batch_count > 1 else (), w_batched=True)
  batch = (batch_count,) if batch_count > 1 else ()
  x_shape, w_shape, out_shape = batch + (m, k), batch + (k, n), batch + (m, n)

  def random(key, shape, spec, scale=1.0):
    # Generated in place, already sharded: no host copy of the global problem.
    gen = jax.jit(lambda key: (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype),
                  out_shardings=NamedSharding(mesh, spec))
    return gen(key)

  kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
  x = random(kx, x_shape, x_spec)
  w = random(kw, w_shape, w_spec, scale=1.0 / np.sqrt(k))
  use_c = args.beta != 0.0
  c = random(kc, out_shape, out_spec) if use_c else None

  def body(x, w, c=None):
    return jax_distgemm.distributed_matmul(
        x, w, c, axis_name="tp", schedule=schedule, alpha=args.alpha, beta=args.beta,
        implementation=implementation)

  in_specs = (x_spec, w_spec, out_spec) if use_c else (x_spec, w_spec)
  operands = (x, w, c) if use_c else (x, w)
  gemm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
  try:
    compiled = gemm.lower(*operands).compile()
  except NotImplementedError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  hlo = compiled.as_text()
  # What auto picked: our custom call, the ring (collective-permutes) or XLA's own collective.
  used = ("ffi" if "jax_distgemm_v1" in hlo else "xla" if "collective-permute" in hlo
          else "reference")

  print(f"Distributed GEMM: {schedule.name}, TP={tp} on {len(devices)} x "
        f"{devices[0].device_kind}, implementation={args.implementation}"
        + (f" ({used})" if args.implementation == "auto" else ""))
  print(f"  Problem: M={m} N={n} K={k} L={batch_count}, {args.dtype}, alpha={args.alpha:g} "
        f"beta={args.beta:g}, seed={seed}")

  # -- Reference check against a single-device fp32 GEMM -----------------------------------------
  dev0 = devices[0]

  @jax.jit
  def max_rel_error(x, w, c, out):
    ref = args.alpha * jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32),
                                  precision=jax.lax.Precision.HIGHEST)
    if c is not None:
      ref = ref + args.beta * c.astype(jnp.float32)
    # An all-zero reference (alpha=0, no C) is exact only for an all-zero output (as in bench).
    scale = jnp.maximum(jnp.max(jnp.abs(ref)), jnp.float32(1e-30))
    return jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / scale

  on_one = lambda a: None if a is None else jax.device_put(a, dev0)
  try:
    out = compiled(*operands)
    error = float(max_rel_error(on_one(x), on_one(w), on_one(c), on_one(out)))
  except Exception as e:  # noqa: BLE001  (a runtime error of the call, e.g. a peer timeout)
    print("  Disposition: Failed (the checked call raised an error)")
    print(f"error: the checked call failed: {e}", file=sys.stderr)
    return 1
  passed = bool(error <= eps)  # False for NaN
  print(f"  Disposition: {'Passed' if passed else 'Failed'} "
        f"(max relative error {error:.3e}, eps {eps:g})")
  if not passed:
    return 1

  # -- Profiling --------------------------------------------------------------------------------
  # Fake CPU devices wait for each call: XLA:CPU can stall with many multi-device runs in
  # flight on few cores.  GPUs run the calls back to back, as the CUTLASS example does.
  wait_each = platform == "cpu"
  # Keep the outputs (when they fit in 1 GiB per device) so that a failed call cannot hide
  # behind the last one: an error surfaces only through the output of the failing call.
  out_bytes = out.addressable_shards[0].data.nbytes
  keep = args.iterations * out_bytes <= (1 << 30)

  def run(iterations):
    outs = []
    for _ in range(iterations):
      result = compiled(*operands)
      if wait_each:
        result.block_until_ready()
      if keep or not outs:
        outs.append(result)
      else:
        outs[-1] = result
    return outs

  try:
    print(f"  Warming up for {args.warmup_iterations} iterations.")
    jax.block_until_ready(run(args.warmup_iterations))
    print(f"  Profiling for {args.iterations} iterations"
          + (" (each call waited for on CPU devices)." if wait_each else "."))
    start = time.perf_counter()
    outs = run(args.iterations)
    outs[-1].block_until_ready()
    elapsed = time.perf_counter() - start
    jax.block_until_ready(outs)
  except Exception as e:  # noqa: BLE001  (a runtime error of any call, e.g. a peer timeout)
    print(f"error: a profiled call failed: {e}", file=sys.stderr)
    return 1
  seconds = elapsed / args.iterations
  tflops = 2.0 * m * n * k * batch_count / tp / seconds / 1e12
  print(f"  Avg runtime: {seconds * 1e3:.4f} ms")
  print(f"  TFLOP/s per device: {tflops:.4g}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

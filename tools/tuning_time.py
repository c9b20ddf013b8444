"""What the first call of a new shape costs: compile, then the call that tunes, then a tuned call.

Our stage GEMM alone (the op at TP=1 on device 0, bench_lib.local_stage_fn: one stage launch,
tuned as every stage is) for each (m, k, n) given.  Per shape: the seconds to lower and compile,
the seconds of the first call (it tunes the shape on this device), and the median of later calls
in ms; the first call less one tuned call is the tuning time.  Each shape in a fresh process
state for the tuner (a new shape), operands fresh normal bf16.  JSON with --json.

  python tools/tuning_time.py --shapes 1024,8192,4096 8192,16384,53248 --json tuning.json

Run it under JAX_DISTGEMM_TUNE=... to compare the tuning modes (one process per mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
from jax.sharding import SingleDeviceSharding

from jax_distgemm import Schedule
from jax_distgemm._src import bench_lib as bl
from jax_distgemm._src import runtime


def shape_arg(text: str) -> tuple[int, int, int]:
  try:
    m, k, n = (int(v) for v in text.split(","))
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"want M,K,N, got {text!r}") from e
  if min(m, k, n) < 1:
    raise argparse.ArgumentTypeError(f"M, K, N must be >= 1, got {text!r}")
  return m, k, n


def measure(shape, device, calls: int, seed: int) -> dict:
  m, k, n = shape
  # At TP=1 the op's one stage is the whole (M, K, N) problem.
  case = bl.Case(Schedule.AllGather1D_TilingCD_RotatingA, m, k, n, tp=1)
  single = SingleDeviceSharding(device)
  x, w = bl.make_sets(jax.random.key(seed), 1, (m, k), (k, n), None, case.jdtype,
                      (single,) * 3)[0][:2]
  t0 = time.perf_counter()
  fn = jax.jit(bl.local_stage_fn(case, device)).lower(x, w).compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  fn(x, w).block_until_ready()
  first_s = time.perf_counter() - t0
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    fn(x, w).block_until_ready()
    times.append((time.perf_counter() - t0) * 1e3)
  call_ms = statistics.median(times)
  return {"shape": [m, k, n], "compile_s": compile_s, "first_call_s": first_s,
          "call_ms": call_ms, "tuning_s": first_s - call_ms / 1e3}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", nargs="+", required=True, type=shape_arg, metavar="M,K,N",
                  help="stage GEMM shapes: x [M, K] @ w [K, N]")
  ap.add_argument("--calls", type=int, default=20, help="tuned calls timed after the first")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json")
  args = ap.parse_args(argv)
  if args.calls < 1:
    ap.error(f"--calls must be >= 1, got {args.calls}")
  devices, _, note = bl.select_devices(1)
  if note:
    print(note, file=sys.stderr)
  mode = os.environ.get("JAX_DISTGEMM_TUNE") or "sustained (default)"
  results = []
  for i, shape in enumerate(args.shapes):
    r = measure(shape, devices[0], args.calls, args.seed + i)
    results.append(r)
    print(f"{tuple(r['shape'])}: compile {r['compile_s']:.2f} s, first call "
          f"{r['first_call_s']:.2f} s, tuned call {r['call_ms']:.3f} ms -> tuning "
          f"{r['tuning_s']:.2f} s ({mode})", flush=True)
  print(runtime.describe_tuning())
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"argv": sys.argv, "tune_mode": mode, "results": results}, f, indent=1)


if __name__ == "__main__":
  main()

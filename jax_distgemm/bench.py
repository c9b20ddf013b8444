"""Benchmark of jax_distgemm against the ideal and XLA's own ways: `python -m jax_distgemm.bench`.

Examples (2x H200):
  python -m jax_distgemm.bench                                  # the seed's shape, AG-RotA
  python -m jax_distgemm.bench --m=8192 --n=28672 --k=8192 --schedule=RS-TilA
  python -m jax_distgemm.bench --suite --json out.json --plot out.png
  python -m jax_distgemm.bench --suite --schedule=RS-TilA       # one schedule's part of it
  python -m jax_distgemm.bench --suite --list                   # the cases, nothing run
  python -m jax_distgemm.bench --suite small                    # decode / small-batch shapes

Per case, all measured in this run: ideal (an XLA dot of one device's share of the FLOPs, no
communication), ffi (ours), auto (implementation=None), reference (XLA all_gather + dot /
dot + psum_scatter), xla (the ppermute ring), jit_auto (the reference formulation left to XLA's
SPMD partitioner) and XLA's windowed einsum (the same, in a child process with
--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true).
Efficiency = ideal / ours; speedup = best of (reference, xla ring, windowed einsum) / ours.
ffi, auto and xla are checked against reference (relative Frobenius error <= --eps, else the
case FAILs and the exit status is 1).  An implementation that cannot run a case (e.g. 'ffi'
without the CUDA executor) is reported with its reason, not fatal.

Without a GPU it runs on fake CPU devices with tiny shapes: a smoke test, not a measurement.
Progress goes to stderr; the tables to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from jax_distgemm._src import bench_lib as bl
from jax_distgemm._src import cli, gpu_monitor, runtime, validation

# The small suite's calls run 20-100 us: 16 per dispatch keeps the host out of the timing.
SMALL_SUITE_CALLS_PER_PROGRAM = 16


def _positive_int(s: str) -> int:
  v = int(s)
  if v < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
  return v


def _non_negative_int(s: str) -> int:
  v = int(s)
  if v < 0:
    raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {s}")
  return v


def _positive_float(s: str) -> float:
  v = float(s)
  if not 0 < v < float("inf"):  # also rejects nan
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
  return v


def _non_negative_float(s: str) -> float:
  v = float(s)
  if not v >= 0:  # also rejects nan
    raise argparse.ArgumentTypeError(f"must be a number >= 0, got {s}")
  return v


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m jax_distgemm.bench", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="\n\n".join(__doc__.split("\n\n")[1:]))
  g = p.add_argument_group("problem (the seed's flags)")
  g.add_argument("--m", type=_positive_int, help="global M (GPU default 16384; CPU 256)")
  g.add_argument("--n", type=_positive_int, help="global N (GPU default 106496; CPU 512)")
  g.add_argument("--k", type=_positive_int, help="global K (GPU default 16384; CPU 128)")
  g.add_argument("--l", type=_positive_int, default=1,
                 help="batch L: x [L, M, K] @ w [L, K, N] (default 1: no batch dim)")
  g.add_argument("--alpha", type=float, default=1.0,
                 help="out = alpha * x @ w + beta * c (alpha, beta: finite as a float32)")
  g.add_argument("--beta", type=float, default=0.0, help="beta != 0 adds a random fp32 c")
  g.add_argument("--schedule", default="AllGather1D_TilingCD_RotatingA",
                 help="schedule name, short name (AG-RotA, AG-RotB, RS-TilA, RS-TilB), wire "
                 "value, or 'all' (default AllGather1D_TilingCD_RotatingA)")
  g.add_argument("--tp", type=_positive_int, default=2,
                 help="tensor-parallel size: the first TP devices of jax.devices() (default 2)")
  g.add_argument("--dtype", default="bf16", choices=sorted(bl.DTYPES),
                 help="input and output dtype (default bf16)")
  g.add_argument("--suite", nargs="?", const="standard", choices=bl.SUITES, default=None,
                 help="a suite of cases: 'standard' (the default; the issue's TP=2 shapes, on "
                 f"CPU divided by {bl.CPU_SUITE_SCALE}) or 'small' (decode and small-batch "
                 f"shapes, on CPU divided by {bl.CPU_SMALL_SUITE_SCALE}); excludes "
                 "--m/--n/--k; --schedule filters it")
  g = p.add_argument_group("timing")
  g.add_argument("--iterations", type=_positive_int, default=None,
                 help="back-to-back calls per repeat (default: enough for --target-repeat-ms, "
                 "10 to 500)")
  g.add_argument("--warmup-iterations", type=_non_negative_int, default=5,
                 help="calls before timing, after compilation (default 5)")
  g.add_argument("--repeats", type=_positive_int, default=7,
                 help="repeats; the median is reported (default 7)")
  g.add_argument("--target-repeat-ms", type=_positive_float, default=30.0,
                 help="with no --iterations: calls per repeat ~ this / time per call")
  g.add_argument("--heat-ms", type=_non_negative_float, default=30.0,
                 help="untimed calls of the same row (~ this many ms, at least one) before "
                 "each timed repeat, so that a repeat sees the row's own sustained clocks, not "
                 "the previous row's; 0: none (default 30)")
  g.add_argument("--eps", type=_non_negative_float, default=None,
                 help="max relative Frobenius error of ffi/auto/xla vs reference (default "
                 "1e-2 for bf16, 2e-3 for fp16, 1e-3 for fp32)")
  g.add_argument("--l2-mb", type=_non_negative_float, default=60.0,
                 help="L2 size in MiB; input sets rotate so their total exceeds twice it "
                 "(default 60, H200)")
  g.add_argument("--rotation-budget-gb", type=_positive_float, default=8.0,
                 help="max GiB per device for one implementation's rotating input sets")
  g.add_argument("--max-sets", type=_positive_int, default=32,
                 help="max rotating input sets (default 32)")
  g.add_argument("--calls-per-program", type=_positive_int, default=None,
                 help="calls chained in one dispatched program (each after the previous "
                 "one's output): below ~0.1 ms a call, one dispatch per call times the host, "
                 "not the GPU (default 16 with --suite small, else 1)")
  g.add_argument("--max-in-flight", type=_non_negative_int, default=None,
                 help="block_until_ready after this many calls within a repeat (0: only at "
                 "the end; default 0 on GPU, 1 on CPU, where XLA:CPU deadlocks otherwise)")
  g.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs")
  g = p.add_argument_group("what to run and report")
  g.add_argument("--impls", default=",".join(bl.ROWS),
                 help=f"comma-separated rows to measure (default all: {','.join(bl.ROWS)})")
  g.add_argument("--no-windowed-einsum", action="store_true",
                 help="skip the windowed-einsum child process")
  g.add_argument("--windowed-einsum-flags", default=" ".join(bl.WINDOWED_EINSUM_FLAGS),
                 help="XLA_FLAGS added for the windowed-einsum child (write it as "
                 "--windowed-einsum-flags='--flag=... --flag=...')")
  g.add_argument("--local-gemm", action="store_true",
                 help="also time one stage's local GEMM, XLA's dot and ours (the fused op "
                 "at TP=1), in the same rounds as the rows, and report the XLA/ours ratio; "
                 "the JSON's local_gemm keeps ours under 'cutlass' and 'cutlass_ms' whatever "
                 "ran it, and 'executor' names that: 'cutlass' on GPU, 'cpu executor' on CPU")
  g.add_argument("--no-gpu-monitor", action="store_true",
                 help="GPU: do not sample SM clock and power through NVML (by default each "
                      "row reports its medians over its timed repeats)")
  g.add_argument("--tuning-file", metavar="PATH",
                 help="GPU: load the stage-GEMM choices saved in PATH, if it exists, before "
                      "timing (those shapes skip tuning; every GPU runs the same variant), and "
                      "save this run's choices to it at the end, merged: the file's choices "
                      "this run did not settle (other GPU models', other shapes) are kept, and "
                      "this run's win on the same key (GPU model, types, shape, tuning mode)")
  g.add_argument("--json", metavar="PATH", help="write all results as JSON")
  g.add_argument("--plot", metavar="PATH",
                 help="write a PNG bar chart to PATH, which must end in .png (needs matplotlib); "
                 "--json, --plot and --tuning-file must name different files")
  g.add_argument("--list", action="store_true", help="print the cases and exit")
  p.add_argument(bl.CHILD_FLAG, dest="child_out", help=argparse.SUPPRESS)
  return p


def _check_output_path(p: argparse.ArgumentParser, flag: str, path: str) -> None:
  cli.check_output_path(p, flag, path)
  if flag == "--plot" and os.path.splitext(path)[1].lower() != ".png":
    p.error(f"{flag}: {path}: must end in .png (the chart is written as a PNG)")


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = build_parser()
  args = p.parse_args(argv)
  if args.suite and (args.m or args.n or args.k):
    p.error("--suite runs its own shapes: drop --m/--n/--k")
  args.schedule_given = any(a.startswith("--schedule") for a in argv)
  args.dtype = bl.DTYPES[args.dtype]
  wanted = [s.strip() for s in args.impls.split(",") if s.strip()]
  unknown = [s for s in wanted if s not in bl.ROWS]
  if unknown:
    p.error(f"--impls: unknown {unknown}; choose from {list(bl.ROWS)}")
  if args.no_windowed_einsum and "windowed_einsum" in wanted:
    wanted.remove("windowed_einsum")
  if not wanted:
    p.error(f"--impls: no rows left to measure; choose from {list(bl.ROWS)}")
  args.want = frozenset(wanted)
  if args.schedule != "all":
    try:
      args.schedules = [bl.parse_schedule(args.schedule)]
    except ValueError as e:
      p.error(str(e))
  else:
    args.schedules = list(bl.Schedule)
  if args.suite and args.schedule_given:  # the suite's schedules do not depend on the platform
    have = [s for s in bl.Schedule if any(c[0] == s for c in bl.suite(args.suite, "gpu"))]
    if not set(have) & set(args.schedules):
      p.error(f"--schedule {args.schedule}: no case of --suite {args.suite} has it, so there "
              f"is nothing to run (its schedules: {', '.join(bl.SHORT_NAMES[s] for s in have)})")
  try:  # the library's rule, checked here rather than as a FAIL of every case
    validation.check_scalars(alpha=args.alpha, beta=args.beta)
  except ValueError as e:
    p.error(f"--{e}")
  if not args.child_out:  # before anything is measured, not when the results are written
    seen = {}
    for flag, path in (("--json", args.json), ("--plot", args.plot),
                       ("--tuning-file", args.tuning_file)):
      if path is not None:
        _check_output_path(p, flag, path)
        real = os.path.realpath(path)
        if real in seen:
          p.error(f"{seen[real]} and {flag} name the same file {path}: give each its own")
        seen[real] = flag
  if args.plot and not args.child_out:
    try:
      import matplotlib  # noqa: F401
    except ImportError:
      p.error("--plot needs matplotlib (pip install matplotlib)")
  return args


def resolve_cases(args: argparse.Namespace, platform: str) -> list[bl.Case]:
  """The cases of this run; the defaults depend on the platform (tiny on CPU)."""
  common = dict(l=args.l, tp=args.tp, dtype=args.dtype, alpha=args.alpha, beta=args.beta)
  if args.suite:
    cases = [bl.Case(s, m, k, n, **common) for s, m, k, n in bl.suite(args.suite, platform)
             if not args.schedule_given or s in args.schedules]
  else:
    dm, dk, dn = bl.CPU_DEFAULT_SHAPE if platform == "cpu" else bl.SEED_SHAPE
    m, k, n = args.m or dm, args.k or dk, args.n or dn
    cases = [bl.Case(s, m, k, n, **common) for s in args.schedules]
  if not cases:  # parse_args rejects the filters that leave none; this is the backstop
    build_parser().error(f"--suite {args.suite} --schedule {args.schedule}: no case to run")
  bad = [f"{c.label}: {c.invalid_reason()}" for c in cases if c.invalid_reason()]
  if bad:
    raise SystemExit("jax_distgemm.bench: invalid case(s):\n  " + "\n  ".join(bad))
  return cases


def options(args: argparse.Namespace) -> bl.Options:
  return bl.Options(
      iterations=args.iterations, warmup=args.warmup_iterations, repeats=args.repeats,
      target_repeat_ms=args.target_repeat_ms, heat_ms=args.heat_ms, eps=args.eps,
      l2_bytes=int(args.l2_mb * 2**20),
      rotation_budget_bytes=int(args.rotation_budget_gb * 2**30), max_sets=args.max_sets,
      seed=args.seed, local_gemm=args.local_gemm, want=args.want,
      max_in_flight=args.max_in_flight,
      calls_per_program=(args.calls_per_program or
                         (SMALL_SUITE_CALLS_PER_PROGRAM if args.suite == "small" else 1)))


def _progress(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _write_json(path: str, payload: dict) -> None:
  tmp = path + ".tmp"
  try:
    with open(tmp, "w") as f:
      json.dump(bl.sanitize(payload), f, indent=1)
    os.replace(tmp, path)
  except OSError as e:  # parse_args checked the path; it can still go (a full disk, rm -r)
    raise SystemExit(f"jax_distgemm.bench: --json: cannot write {path}: {e}") from None


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  opts = options(args)

  if args.child_out:  # the windowed-einsum child (see bench_lib.run_windowed_child)
    bl.child_main(lambda platform: resolve_cases(args, platform), args.tp, opts, args.child_out)
    return 0

  # A tuning file that will not load stops the run before the child times anything (the
  # load itself waits for the backend, below).
  if args.tuning_file and os.path.exists(args.tuning_file) and not args.list:
    try:
      runtime._read_tuning(args.tuning_file, "jax_distgemm.load_tuning")
    except ValueError as e:
      raise SystemExit(f"jax_distgemm.bench: --tuning-file: {e}") from None

  # The child runs first, before this process initializes a backend (and preallocates memory).
  child_rows, child_failure, child_flags = {}, None, None
  if "windowed_einsum" in opts.want and not args.list:
    child_rows, child_failure, child_flags = bl.run_windowed_child(
        argv, tuple(args.windowed_einsum_flags.split()), _progress)

  devices, platform, note = bl.select_devices(args.tp)
  opts = bl.resolve_in_flight(opts, platform)
  cases = resolve_cases(args, platform)
  if note:
    print(f"NOTE: {note}")
    if args.suite:
      scale = bl.CPU_SMALL_SUITE_SCALE if args.suite == "small" else bl.CPU_SUITE_SCALE
      print(f"NOTE: suite shapes divided by {scale} on CPU")
  if opts.max_in_flight:
    print(f"NOTE: block_until_ready after every {opts.max_in_flight} call(s) "
          "(--max-in-flight), not only at the end of a repeat")
  if args.list:
    for c in cases:
      print(f"{c.label:<32} {c.key}")
    return 0

  env = bl.environment(devices, platform, note)
  tuning_loaded = None
  if args.tuning_file and os.path.exists(args.tuning_file):
    try:
      tuning_loaded = runtime.load_tuning(args.tuning_file)
    except (ValueError, OSError) as e:
      raise SystemExit(f"jax_distgemm.bench: --tuning-file: {e}") from None
    print(f"--tuning-file: loaded {tuning_loaded} saved choice(s) x GPU from {args.tuning_file}")
  meta = {
      **env, "argv": argv, "tp": args.tp, "dtype": args.dtype,
      "timing": {"iterations": args.iterations, "warmup_iterations": opts.warmup,
                 "repeats": opts.repeats, "target_repeat_ms": opts.target_repeat_ms,
                 "max_in_flight": opts.max_in_flight, "heat_ms": opts.heat_ms,
                 "statistic": "median over repeats of (wall time of N back-to-back calls + one "
                              "block_until_ready) / N; repeats interleaved across rows in a "
                              "seeded shuffled order, each after ~heat_ms of untimed calls "
                              "of the same row (their times: ms_after_switch)"},
      "l2_bytes": opts.l2_bytes, "rotation_budget_bytes": opts.rotation_budget_bytes,
      "rows": list(bl.ROWS), "ours": bl.OURS, "baselines": list(bl.BASELINES),
      "gated": list(bl.GATED), "windowed_einsum_xla_flags": child_flags,
      "ideal": "XLA dot of one device's share (AG-RotA x[M,K]@w[K,N/TP], AG-RotB "
               "x[M/TP,K]@w[K,N], RS x[M,K/TP]@w[K/TP,N]) on device 0, no communication",
      "efficiency": "ideal_ms / ms", "speedup": "best baseline ms / ms",
      "efficiency_per_round": "median and quartiles over rounds of ideal / ours within the "
                              "same round (less clock drift than the ratio of medians)",
      "tuning_file": args.tuning_file, "tuning_loaded": tuning_loaded,
  }
  print(f"jax_distgemm.bench: {len(cases)} case(s) on {args.tp} x {env['device_kind']} "
        f"({platform}); jax {env['jax']}; CUDA executor built: {env['cuda_executor_built']}")
  here = dataclasses.replace(opts, want=opts.want - {"windowed_einsum"})
  monitor = gpu_monitor.GpuMonitor()
  if platform != "gpu":
    monitor.off(f"platform {platform}")
  elif args.no_gpu_monitor:
    monitor.off("--no-gpu-monitor")
  else:
    monitor.start()
  meta["gpu_monitor"] = monitor.describe()
  results = []
  t_start = time.perf_counter()
  try:
    for i, case in enumerate(cases):
      def progress(msg, i=i, case=case):
        _progress(f"[{i + 1}/{len(cases)} {time.perf_counter() - t_start:7.1f}s] "
                  f"{case.label}: {msg}")
      progress("start")
      # Windowed einsum was timed by the child (other XLA_FLAGS); not here.
      got = bl.run_case(case, i, devices, here, progress, monitor)
      if "local_gemm" in got["data"]:  # our side: the CUTLASS kernels only on GPU
        got["data"]["local_gemm"]["executor"] = (
            "cutlass" if platform == "gpu" else f"{platform} executor")
      rows = got["rows"]
      if "windowed_einsum" in opts.want:
        rows["windowed_einsum"] = child_rows.get(case.key) or {
            "status": "error",
            "reason": child_failure or "the windowed-einsum child produced no result"}
      else:
        rows["windowed_einsum"] = {"status": "skipped",
                                   "reason": "not requested (--no-windowed-einsum / --impls)"}
      result = bl.finalize_case(case, rows, got["data"], opts)
      results.append(result)
      print(bl.case_block(result, i + 1, len(cases)), flush=True)
      if args.json:
        _write_json(args.json, {"meta": meta, "cases": results, "complete": False})
  finally:
    monitor.stop()  # no sampling thread or NVML session left behind, whatever happened
  print()
  print(bl.summary_table(results))
  passed = all(r["passed"] for r in results)
  meta["gpu_monitor"] = monitor.describe()
  meta["copy_streams"] = runtime.copy_stream_reports()
  errors = []  # after the measurements: reported, and the exit status 1, but the JSON written
  if args.tuning_file:
    try:
      meta["tuning_saved"], meta["tuning_kept"] = runtime._save_tuning(args.tuning_file,
                                                                       keep_existing=True)
    except (ValueError, OSError) as e:
      meta["tuning_error"] = str(e)
      errors.append(f"--tuning-file: {e}")
    else:
      print(f"--tuning-file: saved {meta['tuning_saved']} choice(s) this process holds "
            f"(loaded from the file or tuned here) to {args.tuning_file}, kept "
            f"{meta['tuning_kept']} other(s) from the file")
  for c in meta["copy_streams"]:
    print(runtime.describe_copy_stream(c))
  if args.json:
    _write_json(args.json, {"meta": meta, "cases": results, "complete": True,
                            "passed": passed})
    print(f"wrote {args.json}")
  if args.plot:
    title = f"jax_distgemm TP={args.tp} {args.dtype} on {env['device_kind']}"
    try:
      bl.plot(results, args.plot, title)
      print(f"wrote {args.plot}")
    except (OSError, ValueError) as e:  # parse_args checked the path and the suffix
      errors.append(f"--plot: cannot write {args.plot}: {e}")
  for e in errors:
    print(f"jax_distgemm.bench: {e}", file=sys.stderr)
  if not passed:
    print("FAILED: " + "; ".join(f"{r['case']['short']} {r['case']['m']},{r['case']['k']},"
                                 f"{r['case']['n']}: {', '.join(r['failures'])}"
                                 for r in results if not r["passed"]))
  return 0 if passed and not errors else 1


if __name__ == "__main__":
  sys.exit(main())

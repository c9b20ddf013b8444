"""Which stage-GEMM variant is fastest *under sustained load*, and does the tuner find it?

For each case, in one process and in interleaved rounds (bench_lib's timing): the ideal (XLA's
dot of one device's share), our call with the tuner's choice in each tuning mode
(JAX_DISTGEMM_TUNE=sustained / coarse / burst), our call with every variant forced
(JAX_DISTGEMM_GEMM_CONFIG=config:raster:swizzle) and, for ReduceScatter, with each
JAX_DISTGEMM_RS_FUSED mode.  The environment is set before each entry's
repeat; the handler reads it per call, so one compiled executable serves every variant.

  python3 tools/config_sweep.py --cases AG-RotA:8192,4096,4096 RS-TilA:8192,4096,4096 \
      --json sweep.json

Run with JAX_DISTGEMM_LOG_TUNING=1 to log every tuning trial (stderr).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jax_distgemm import bench as bench_cli
from jax_distgemm._src import bench_lib
from jax_distgemm._src import gpu_monitor, runtime

# GemmConfig values (cc/cuda/gemm_kernels.h) and which have a fused (ptr-array) kernel.
CONFIG_NAMES = {0: "coop128x256_c2x1", 1: "coop256x128_c1x2", 2: "pingpong128x128_c1x2",
                3: "pingpong128x128_c2x1", 4: "coop256x128_c2x1", 5: "coop128x256_c1x2",
                6: "coop128x256_c1x1", 7: "coop256x192_c1x1"}
FUSED_CONFIGS = (0, 4, 6, 2, 7)
RASTERS = {1: "M", 2: "N"}


# Every environment key some row sets: each row starts from none of them set.
_ROW_KEYS = {"JAX_DISTGEMM_GEMM_CONFIG", "JAX_DISTGEMM_TUNE", "JAX_DISTGEMM_RS_FUSED"}


@dataclasses.dataclass
class EnvTimed(bench_lib.Timed):
  env: dict = dataclasses.field(default_factory=dict)

  def run(self, count: int, max_in_flight: int = 0):
    _ROW_KEYS.update(self.env)
    for k in _ROW_KEYS:
      os.environ.pop(k, None)
    os.environ.update(self.env)
    super().run(count, max_in_flight)


def variants(args, *, fused_kernel: bool, reduce_scatter: bool) -> list[tuple[str, dict]]:
  """(row name, environment) of every variant timed for one case.  `fused_kernel`: the call
  runs the fused grid, so only fused configs can be forced; `reduce_scatter`: add the
  JAX_DISTGEMM_RS_FUSED rows."""
  out = [(f"auto_{m}", {"JAX_DISTGEMM_TUNE": m}) for m in args.tune_modes.split(",") if m]
  if reduce_scatter:
    out += [(f"rs_fused_{m}", {"JAX_DISTGEMM_RS_FUSED": m})
            for m in args.rs_fused_modes.split(",") if m]
  for spec in args.row:  # NAME:KEY=VALUE[,KEY=VALUE...]
    name, _, env = spec.partition(":")
    out.append((name, dict(kv.split("=", 1) for kv in env.split(",") if kv)))
  if args.forced:
    for c in (FUSED_CONFIGS if fused_kernel else sorted(CONFIG_NAMES)):
      for r, rname in RASTERS.items():
        for s in (int(v) for v in args.swizzles.split(",")):
          out.append((f"{CONFIG_NAMES[c]}/r{rname}/s{s}",
                      {"JAX_DISTGEMM_GEMM_CONFIG": f"{c}:{r}:{s}"}))
  return out


def time_rows(label, baseline, baseline_sets, ours, sets, ref, named_envs, opts, log,
              monitor=None):
  """Times the baseline ("ideal" row) and `ours` once per (name, environment), in interleaved
  rounds; each row's error against `ref` on set 0, and baseline / ours as "efficiency"; with a
  started gpu_monitor.GpuMonitor, each row's median SM clock and power per GPU ("gpu")."""
  entries = [EnvTimed("ideal", baseline, baseline_sets)]
  errors = {}
  ref_out = ref(*sets[0])
  for name, env in named_envs:
    e = EnvTimed(name, ours, sets, env=env)
    e.run(1)  # tunes (auto rows) before the timed rounds
    errors[name] = bench_lib.rel_err(ours(*sets[0]), ref_out)
    entries.append(e)
  del ref_out  # the seed shape's output is GiBs per device: not kept while timing
  bench_lib.time_interleaved(entries, opts, lambda msg: log(f"{label}: {msg}"))
  rows = {e.name: {**bench_lib._timing_row(e),
                   "gpu": monitor.stats(e.windows) if monitor is not None else None}
          for e in entries}
  ideal_ms = rows["ideal"].get("ms")
  ideal_repeats = rows["ideal"].get("ms_repeats") or []
  for name, row in rows.items():
    if name in errors:
      row["rel_err"] = errors[name]
    if ideal_ms and row.get("ms"):
      row["efficiency"] = ideal_ms / row["ms"]
      # Paired by round (bench_lib.per_round_ratio): spared the rounds' GPU-wide clock dips.
      row["efficiency_per_round"] = bench_lib.per_round_ratio(ideal_repeats,
                                                              row.get("ms_repeats") or [])
  return rows


def sweep_case(case, index, devices, opts, args, log, monitor=None):
  """Whole calls at TP=2 against the ideal (XLA's dot of one device's share, on device 0)."""
  mesh = Mesh(np.array(devices), ("tp",))
  shardings = tuple(NamedSharding(mesh, s) for s in case.specs())
  xg, wg, _ = case.global_shapes()
  key = jax.random.fold_in(jax.random.key(opts.seed), index)
  sets = bench_lib.rotating_sets(jax.random.fold_in(key, 0), xg, wg, case.jdtype, shardings, opts)
  ref = bench_lib.distributed_fn(case, mesh, "reference").lower(*sets[0]).compile()
  ours = bench_lib.distributed_fn(case, mesh, "ffi").lower(*sets[0]).compile()
  xi, wi, _ = case.ideal_shapes()
  ideal_sets = bench_lib.rotating_sets(jax.random.fold_in(key, 1), xi, wi, case.jdtype,
                             (SingleDeviceSharding(devices[0]),) * 3, opts)
  ideal = bench_lib.ideal_fn(case).lower(*ideal_sets[0]).compile()
  # AllGather calls run the fused grid (TP <= 8, L = 1); ReduceScatter has its path switch.
  named_envs = variants(args, fused_kernel=case.schedule.is_all_gather,
                        reduce_scatter=not case.schedule.is_all_gather)
  rows = time_rows(case.label, ideal, ideal_sets, ours, sets, ref, named_envs, opts, log, monitor)
  return {"case": case.as_dict(), "rows": rows, "tuning": runtime.describe_tuning()}


def sweep_local_case(case, index, devices, opts, args, log, monitor=None):
  """--local: one stage of `case` on one GPU (the op at TP=1, bench_lib.local_stage_fn) against
  XLA's dot of the same shape: the benchmark's local-GEMM ratio, per variant ("efficiency" is
  XLA dot / ours).  Stage kernels (not the fused grid), so every compiled config is a
  candidate."""
  sm, sk, sn = case.stage_shape()
  key = jax.random.fold_in(jax.random.key(opts.seed), index)
  # The benchmark's own stage operands (batched when case.l > 1), so the rows are its ratio's.
  sets = bench_lib.stage_rotating_sets(jax.random.fold_in(key, 2), case, devices[0], opts)
  xla = bench_lib.stage_dot_fn(case).lower(*sets[0]).compile()
  ours = jax.jit(bench_lib.local_stage_fn(case, devices[0])).lower(*sets[0]).compile()
  named_envs = variants(args, fused_kernel=False, reduce_scatter=False)
  rows = time_rows(f"{case.label} stage", xla, sets, ours, sets, xla, named_envs, opts, log,
                   monitor)
  return {"case": case.as_dict(), "stage_shape": [sm, sk, sn], "rows": rows,
          "tuning": runtime.describe_tuning()}


def sweep_all_devices_case(case, index, devices, opts, args, log, monitor=None):
  """--all-devices: one device's share of `case` (ideal_shapes) on every GPU at once, as our op
  at TP=1 (stage kernels, bench_lib.local_all_devices_fn) against XLA's dot the same way
  (ideal_all_devices_fn): both GPUs under load as in a whole call, with none of its
  communication.  alpha = 1, beta = 0."""
  case = dataclasses.replace(case, alpha=1.0, beta=0.0)
  mesh = Mesh(np.array(devices), ("tp",))
  key = jax.random.fold_in(jax.random.key(opts.seed), index)
  sets = bench_lib.stacked_rotating_sets(jax.random.fold_in(key, 4), case, mesh, opts)
  xla = bench_lib.ideal_all_devices_fn(case, mesh).lower(*sets[0]).compile()
  ours = bench_lib.local_all_devices_fn(case, mesh).lower(*sets[0]).compile()
  named_envs = variants(args, fused_kernel=False, reduce_scatter=False)
  rows = time_rows(f"{case.label} share on all", xla, sets, ours, sets, xla, named_envs, opts,
                   log, monitor)
  xi, wi, _ = case.ideal_shapes()
  return {"case": case.as_dict(), "share_shape": [xi[-2], xi[-1], wi[-1]], "rows": rows,
          "tuning": runtime.describe_tuning()}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", nargs="+", required=True, type=bench_lib.case_arg,
                  metavar="SCHEDULE:M,K,N",
                  help="global shape")
  ap.add_argument("--swizzles", default="1,4")
  ap.add_argument("--tune-modes", default="sustained,coarse",
                  help="JAX_DISTGEMM_TUNE values, one auto row each")
  ap.add_argument("--rs-fused-modes", default="",
                  help="JAX_DISTGEMM_RS_FUSED values (ReduceScatter cases), one row each")
  ap.add_argument("--no-forced", dest="forced", action="store_false",
                  help="skip the forced config:raster:swizzle rows")
  ap.add_argument("--row", action="append", default=[],
                  help="an extra row NAME:KEY=VALUE[,KEY=VALUE...] (environment of our call)")
  ap.add_argument("--local", action="store_true",
                  help="time each case's stage GEMM alone on one GPU against XLA's dot")
  ap.add_argument("--all-devices", action="store_true",
                  help="time one device's share of each case on every GPU at once, our op at "
                       "TP=1 against XLA's dot, no communication")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--target-repeat-ms", type=float, default=30.0)
  ap.add_argument("--heat-ms", type=bench_cli._non_negative_float, default=30.0,
                  help="untimed calls of a row before each of its repeats (bench's --heat-ms)")
  ap.add_argument("--max-sets", type=int, default=bench_lib.Options.max_sets,
                  help="input sets rotated among at most; 1: every call reads the same, L2-warm "
                       "operands (as the tuner's own launches do)")
  ap.add_argument("--json")
  args = ap.parse_args(argv)
  if args.max_sets < 1:
    ap.error(f"--max-sets must be >= 1, got {args.max_sets}")
  if args.local and args.all_devices:
    ap.error("--local and --all-devices are exclusive")
  devices, platform, note = bench_lib.select_devices(1 if args.local else 2)
  if note:
    print(note, file=sys.stderr)
  opts = bench_lib.resolve_in_flight(
      bench_lib.Options(repeats=args.repeats, target_repeat_ms=args.target_repeat_ms,
                        heat_ms=args.heat_ms, warmup=2, max_sets=args.max_sets), platform)
  t0 = time.time()
  log = lambda msg: print(f"[sweep {time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
  results = []
  # SM clock and power per row (GPU): under the power cap they tell a kernel that does more
  # work per cycle from one that is left more clock (docs/performance.md M3).
  monitor = gpu_monitor.GpuMonitor()
  if platform == "gpu":
    monitor.start()
  else:
    monitor.off(f"platform {platform}")
  clocks = lambda g: f"  | {gpu_monitor.format_stats(g)}" if g else ""
  try:
    for i, case in enumerate(bench_lib.parse_case(text) for text in args.cases):
      sweep = (sweep_local_case if args.local else
               sweep_all_devices_case if args.all_devices else sweep_case)
      results.append(sweep(case, i, devices, opts, args, log, monitor))
      rows = results[-1]["rows"]
      ranked = sorted((r["ms"], n) for n, r in rows.items() if r.get("ms") and n != "ideal")
      print(f"\n{case.label}: ideal {rows['ideal'].get('ms', float('nan')):.4f} ms"
            f"{clocks(rows['ideal'].get('gpu'))}")
      for ms, n in ranked:
        r = rows[n]
        pr = (r.get("efficiency_per_round") or {}).get("median", float("nan"))
        print(f"  {n:32s} {ms:9.4f} ms  eff {r.get('efficiency', float('nan')):.3f}  "
              f"per round {pr:.3f}  "
              f"spread {r['spread']:.3f}  err {r.get('rel_err', float('nan')):.1e}"
              f"{clocks(r.get('gpu'))}")
      print(results[-1]["tuning"])
      if args.json:
        with open(args.json, "w") as f:
          json.dump({"argv": sys.argv, "results": results,
                     "gpu_monitor": monitor.describe()}, f, indent=1)
      jax.clear_caches()
  finally:
    monitor.stop()


if __name__ == "__main__":
  main()

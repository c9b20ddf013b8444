"""Per GPU: kernel time and idle time per call, from CUPTI, for the ideal on each GPU and ours.

The benchmark times a row by wall clock over back-to-back calls; this splits that time, per
GPU, into time some kernel of the process was running and time the GPU ran nothing (launch and
dispatch gaps between calls, waits outside kernels).  CUPTI, through torch.profiler, records
every kernel and copy of the process, XLA's and ours included.  Rows, in one process, each
warmed up and then profiled over --calls back-to-back calls with fresh inputs:

  ideal@0, ideal@1   XLA's dot of the per-device problem on GPU 0 alone, on GPU 1 alone
  ideal_all          the same on both GPUs at once (one shard_map program)
  ffi                ours (implementation="ffi"), with the process's JAX_DISTGEMM_* settings
  ffi[ENV=V]         ours again with an extra setting that the handler reads per call
                     (--ours-env, e.g. JAX_DISTGEMM_AG_JOIN=event)
  ideal_all+copy     with --copy-load: ideal_all while the copy engines move the case's
                     rotating shard between the GPUs in both directions, back to back, for the
                     whole row (torch peer copies on side streams): what the communication
                     itself costs a GEMM that shares the GPU with it.  Ours moves that shard
                     once per call, so its copy engine is busy for part of a call only.

With --local (one GPU is enough), only the stage GEMM, as the benchmark's local-GEMM row:

  local_xla_dot      XLA's dot of the case's stage shape on GPU 0
  local_ffi          our op at TP=1 on the same operands (bench_lib.local_stage_fn)
  local_ffi[ENV=V]   the same with an extra setting (--ours-env JAX_DISTGEMM_GEMM_CONFIG=7:1:1)

which tells a kernel's own duration from what a call adds around it (launch gaps, other
kernels), for a call whose benchmark time exceeds the tuner's time of its kernel.

For each row and GPU: wall ms per call of the profiled loop, kernel-busy us per call (the union
of kernel intervals), idle us per call (span minus busy), the median gap between consecutive
kernels, and the busiest kernels' median durations.  GPU only; needs torch (for CUPTI).

  python tools/kernel_gaps.py --cases AG-RotA:8192,4096,4096 RS-TilA:8192,4096,4096 \
      --ours-env JAX_DISTGEMM_AG_JOIN=event --json gaps.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory for torch


def _case_arg(text: str) -> str:
  from jax_distgemm._src import bench_lib as bl  # noqa: PLC0415 - imports jax
  return bl.case_arg(text)


def _env_arg(text: str) -> tuple[str, str]:
  name, eq, value = text.partition("=")
  if not eq or not name.startswith("JAX_DISTGEMM_"):
    raise argparse.ArgumentTypeError(f"expected JAX_DISTGEMM_NAME=VALUE, got {text!r}")
  return name, value


def intervals_summary(events: list[tuple[float, float, str]], calls: int) -> dict:
  """One GPU's kernels (start_us, end_us, name) over `calls` calls: busy/idle per call."""
  if not events:
    return {"kernels": 0}
  events = sorted(events)
  busy, cur_s, cur_e = 0.0, events[0][0], events[0][1]
  gaps = []
  for s, e, _ in events[1:]:
    if s > cur_e:
      busy += cur_e - cur_s
      gaps.append(s - cur_e)
      cur_s, cur_e = s, e
    else:
      cur_e = max(cur_e, e)
  busy += cur_e - cur_s
  span = max(e for _, e, _ in events) - events[0][0]
  by_name = collections.defaultdict(list)
  for s, e, name in events:
    by_name[name].append(e - s)
  top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:3]
  gaps_sorted = sorted(gaps)
  pct = lambda q: gaps_sorted[min(len(gaps_sorted) - 1, int(q * len(gaps_sorted)))] if gaps else 0.0
  return {
      "kernels": len(events),
      "busy_us_per_call": busy / calls,
      "idle_us_per_call": (span - busy) / calls,
      "median_gap_us": statistics.median(gaps) if gaps else 0.0,
      # Whether idle time is spread evenly (every gap alike) or a few long stalls.
      "p90_gap_us": pct(0.9),
      "max_gap_us": gaps_sorted[-1] if gaps else 0.0,
      "gaps_over_20us": sum(1 for g in gaps if g > 20.0),
      "top_kernels": [{"name": n[:120], "count": len(d), "median_us": statistics.median(d)}
                      for n, d in top],
  }


def kernels_by_device(trace_path: str) -> dict[int, list[tuple[float, float, str]]]:
  """Kernel events of a torch.profiler chrome trace, per device (args.device)."""
  with open(trace_path) as f:
    trace = json.load(f)
  out = collections.defaultdict(list)
  for ev in trace.get("traceEvents", []):
    if ev.get("cat") != "kernel" or "dur" not in ev:
      continue
    dev = ev.get("args", {}).get("device")
    if dev is None:
      continue
    out[int(dev)].append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]), ev.get("name", "")))
  return out


def shard_bytes(case) -> int:
  """Bytes of the shard one device pushes per call (AllGather: x's or w's shard; ReduceScatter:
  one running sum, the partial output)."""
  from jax_distgemm._src import bench_lib as bl  # noqa: PLC0415 - imports jax
  xg, wg, og = case.global_shapes()
  shape = {"AllGather1D_TilingCD_RotatingA": xg, "AllGather1D_TilingCD_RotatingB": wg}.get(
      case.schedule.name, og)
  return bl._nbytes(shape, case.jdtype) // case.tp


def _start_copy_load(torch, nbytes: int, duration_ms: float, gbps: float = 395.0):
  """Peer copies of `nbytes` between GPUs 0 and 1 in both directions, back to back on a side
  stream of each source GPU, enough for ~duration_ms at the copy engine's ~gbps GB/s."""
  count = max(1, int(duration_ms * 1e-3 * gbps * 1e9 / max(nbytes, 1)))
  elems = max(1, nbytes // 2)
  bufs = []
  for src, dst in ((0, 1), (1, 0)):
    a = torch.randn(elems, device=f"cuda:{src}", dtype=torch.bfloat16)
    b = torch.empty(elems, device=f"cuda:{dst}", dtype=torch.bfloat16)
    stream = torch.cuda.Stream(device=src)
    with torch.cuda.stream(stream):
      for _ in range(count):
        b.copy_(a, non_blocking=True)
    bufs.append((a, b, stream))
  return bufs


def distributed_rows(jax, bl, case, key, devices, mesh, opts, args):
  """(label, fn, sets, env) of the two-GPU rows, and the call's own input sets."""
  from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: PLC0415
  shardings = tuple(NamedSharding(mesh, s) for s in case.specs())
  xg, wg, _ = case.global_shapes()
  sets = bl.rotating_sets(jax.random.fold_in(key, 0), xg, wg, case.jdtype, shardings, opts)
  xi, wi, _ = case.ideal_shapes()
  rows = []
  for d in (0, 1):
    single = SingleDeviceSharding(devices[d])
    isets = bl.make_sets(jax.random.fold_in(key, 1 + d), len(sets), xi, wi, None, case.jdtype,
                         (single, single, single))
    rows.append((f"ideal@{d}", bl.ideal_fn(case), isets, {}))
  asets = bl.stacked_ideal_sets(jax.random.fold_in(key, 3), len(sets), case, mesh)
  ideal_all = bl.ideal_all_devices_fn(case, mesh)  # one jit for both rows
  rows.append(("ideal_all", ideal_all, asets, {}))
  if args.copy_load:
    rows.append(("ideal_all+copy", ideal_all, asets, {}))
  ours = bl.distributed_fn(case, mesh, "ffi")
  rows.append(("ffi", ours, sets, {}))
  for name, value in args.ours_env:
    rows.append((f"ffi[{name}={value}]", ours, sets, {name: value}))
  return rows, sets


def local_rows(jax, bl, case, key, device, opts, ours_env):
  """The --local rows: the stage shape on `device`, XLA's dot and ours at TP=1, one set of
  stage-shaped operands for all (as the benchmark's local-GEMM ratio)."""
  sets = bl.stage_rotating_sets(jax.random.fold_in(key, 2), case, device, opts)
  rows = [("local_xla_dot", bl.stage_dot_fn(case), sets, {})]
  ours = jax.jit(bl.local_stage_fn(case, device))
  rows.append(("local_ffi", ours, sets, {}))
  for name, value in ours_env:
    rows.append((f"local_ffi[{name}={value}]", ours, sets, {name: value}))
  return rows, sets


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", nargs="+", required=True, type=_case_arg, metavar="SCHEDULE:M,K,N")
  ap.add_argument("--ours-env", action="append", default=[], type=_env_arg,
                  metavar="JAX_DISTGEMM_NAME=VALUE",
                  help="also profile ours with this setting (one handler reads per call)")
  ap.add_argument("--calls", type=int, default=60, help="profiled calls per row")
  ap.add_argument("--heat-ms", type=float, default=200.0,
                  help="untimed calls of the row right before it is profiled")
  ap.add_argument("--copy-load", action="store_true",
                  help="add the ideal_all+copy row (see above)")
  ap.add_argument("--local", action="store_true",
                  help="the stage GEMM alone on GPU 0: XLA's dot against our op at TP=1")
  ap.add_argument("--json")
  args = ap.parse_args(argv)
  if args.local and args.copy_load:
    ap.error("--copy-load needs two GPUs' rows; --local has one GPU's")
  if args.calls < 2:
    ap.error("--calls must be at least 2")
  if args.heat_ms < 0:
    ap.error("--heat-ms must be >= 0")

  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415
  from jax_distgemm._src import bench_lib as bl  # noqa: PLC0415
  from jax_distgemm._src import runtime  # noqa: PLC0415
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    sys.exit("tools/kernel_gaps.py needs torch (for CUPTI through torch.profiler)")
  devices, platform, _ = bl.select_devices(1 if args.local else 2)
  if platform != "gpu" or not torch.cuda.is_available():
    sys.exit("tools/kernel_gaps.py needs " + ("a GPU" if args.local else "two GPUs"))
  mesh = Mesh(np.array(devices), ("tp",))
  opts = bl.Options()
  results = []
  for index, text in enumerate(args.cases):
    case = bl.parse_case(text)
    key = jax.random.fold_in(jax.random.key(0), index)
    if args.local:
      rows, sets = local_rows(jax, bl, case, key, devices[0], opts, args.ours_env)
    else:
      rows, sets = distributed_rows(jax, bl, case, key, devices, mesh, opts, args)

    case_rows = {}
    for label, fn, row_sets, env in rows:
      saved = {k: os.environ.get(k) for k in env}
      os.environ.update(env)
      try:
        timed = bl.Timed(label, fn, row_sets)
        timed.run(5)  # compile, tune
        est = timed.timed_run(3)
        timed.run(max(1, int(args.heat_ms / max(est, 1e-3))))
        copies = None
        if label.endswith("+copy"):
          copies = _start_copy_load(torch, shard_bytes(case), est * args.calls * 1.2)
        with tempfile.TemporaryDirectory() as tmp:
          path = os.path.join(tmp, "trace.json")
          with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            epoch_start = time.time()  # wall clock, to line up with nvidia-smi samples
            t0 = time.perf_counter()
            timed.run(args.calls)
            wall = (time.perf_counter() - t0) * 1e3 / args.calls
            if copies is not None:
              for d in range(len(devices)):
                torch.cuda.synchronize(d)
          prof.export_chrome_trace(path)
          per_dev = kernels_by_device(path)
      finally:
        for k, v in saved.items():
          if v is None:
            os.environ.pop(k, None)
          else:
            os.environ[k] = v
      row = {"wall_ms_per_call": wall,
             "profiled_unix_s": [epoch_start, epoch_start + wall * args.calls / 1e3],
             "devices": {str(d): intervals_summary(ev, args.calls)
                         for d, ev in sorted(per_dev.items())}}
      case_rows[label] = row
      print(f"{case.label} {label}: {wall:.4f} ms/call (profiled)")
      for d, s in row["devices"].items():
        if s.get("kernels"):
          tops = "; ".join(f"{k['count']}x {k['median_us']:.1f} us {k['name'][:60]}"
                           for k in s["top_kernels"])
          print(f"    GPU {d}: busy {s['busy_us_per_call']:.1f} us/call, idle "
                f"{s['idle_us_per_call']:.1f} us/call, gaps median {s['median_gap_us']:.1f} / "
                f"p90 {s['p90_gap_us']:.1f} / max {s['max_gap_us']:.1f} us, "
                f"{s['gaps_over_20us']} over 20 us | {tops}")
      sys.stdout.flush()
    results.append({"case": case.label, "calls": args.calls, "rows": case_rows,
                    "tuning": runtime.describe_tuning().splitlines(),
                    "copy_streams": runtime.copy_stream_reports()})  # cc/cuda/copy_stream.h
    print("\n".join(f"    tuned: {t}" for t in results[-1]["tuning"]))
    print("\n".join(f"    {runtime.describe_copy_stream(r)}" for r in results[-1]["copy_streams"]))
    del sets, rows
    jax.clear_caches()
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()

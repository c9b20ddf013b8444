"""Where a fused call's time goes: per-stage GPU timelines next to the ideal, per variant.

For each case and each variant (a set of JAX_DISTGEMM_* environment overrides, each in its own
child process, since the executor reads them once), in one process: the ideal (XLA's dot of
the per-device problem) and ours (implementation="ffi") timed in interleaved repeats as
`python -m jax_distgemm.bench` does, then one traced repeat of ours (JAX_DISTGEMM_TRACE=1:
every stage GEMM stamps %globaltimer when its first CTA starts, when its last CTA is past its
flag wait, and when its last CTA is done; cc/cuda/stage_trace.h).  Printed per stage launch,
as medians over the traced calls, in microseconds from the call's first CTA start:

  start   first CTA of the launch began
  ready   last CTA past its flag wait (ready - start large: it waited for a peer's data)
  end     last CTA finished

plus the call's span (first start to last end) and the gap to the next call's first start
(host or launch overhead: the GPU ran nothing of ours).  GPU only.

  python tools/stage_timeline.py --cases AG-RotA:8192,4096,4096 RS-TilA:8192,4096,4096 \
      --variant default: --variant no_overlap:JAX_DISTGEMM_STAGE_OVERLAP=0 --json t.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys


def _case_arg(text: str) -> str:
  """--cases entries are checked before any child starts (the children get the text)."""
  from jax_distgemm._src import bench_lib as bl  # noqa: PLC0415 - imports jax
  return bl.case_arg(text)


def _summarize(records, calls_wanted: int) -> dict:
  """Medians over calls of each launch's (start, ready, end) offsets, per device.

  Records of stage -1 are the handler's host time (steady clock): reported as the median time
  inside the handler and the median period between handler entries (host-bound when that
  period is as long as a call's span plus gap).  Offsets are per device: %globaltimer is not
  synchronized across GPUs (2x H200: the "same" call's starts differed by up to 14 ms), so
  devices are not placed on one time axis.
  """
  by_dev = collections.defaultdict(lambda: collections.defaultdict(list))
  host = collections.defaultdict(list)
  for dev, call, stage, chunk, start, ready, end in records:
    if stage < 0:
      host[dev].append((start, end))
    elif start and end:
      by_dev[dev][call].append((stage, chunk, start, ready, end))
  out = {}
  for dev, calls in sorted(by_dev.items()):
    keys = sorted(calls)[-calls_wanted:]
    rows = collections.defaultdict(lambda: {"start": [], "ready": [], "end": []})
    spans, gaps = [], []
    for i, c in enumerate(keys):
      launches = calls[c]
      t0 = min(l[2] for l in launches)
      t_end = max(l[4] for l in launches)
      spans.append((t_end - t0) / 1e3)
      if i + 1 < len(keys) and keys[i + 1] == c + 1:
        gaps.append((min(l[2] for l in calls[keys[i + 1]]) - t_end) / 1e3)
      for stage, chunk, start, ready, end in launches:
        r = rows[(stage, chunk)]
        r["start"].append((start - t0) / 1e3)
        r["ready"].append((max(ready, start) - t0) / 1e3)
        r["end"].append((end - t0) / 1e3)
    med = lambda v: statistics.median(v) if v else None
    h = host.get(dev, [])[-calls_wanted:]
    out[str(dev)] = {
        "calls": len(keys),
        "span_us": med(spans),
        "gap_us": med(gaps),
        "host_us": med([(e - b) / 1e3 for b, e in h]),
        "host_period_us": med([(h[i + 1][0] - h[i][0]) / 1e3 for i in range(len(h) - 1)]),
        "launches": [{"stage": s, "chunk": c, **{k: med(v) for k, v in r.items()}}
                     for (s, c), r in sorted(rows.items())],
    }
  return out


def child(args) -> None:
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
  from jax_distgemm import ffi as ffi_modules
  from jax_distgemm._src import bench_lib as bl

  devices, platform, _ = bl.select_devices(2)
  if platform != "gpu" or not ffi_modules.has_cuda():
    raise SystemExit("stage_timeline needs 2 GPUs and the CUDA module")
  if args.reverse_devices:  # rank 0 (and the ideal) on the second GPU
    devices = list(reversed(devices))
  cuda = ffi_modules.module_for("cuda")
  opts = bl.Options(repeats=args.repeats, warmup=args.warmup)
  results = []
  for index, text in enumerate(args.cases):
    case = bl.parse_case(text)
    mesh = Mesh(np.array(devices), ("tp",))
    shardings = tuple(NamedSharding(mesh, s) for s in case.specs())
    xg, wg, _ = case.global_shapes()
    key = jax.random.fold_in(jax.random.key(args.seed), index)
    sets = bl.rotating_sets(jax.random.fold_in(key, 0), xg, wg, case.jdtype, shardings, opts)
    ours = bl.distributed_fn(case, mesh, "ffi").lower(*sets[0]).compile()
    if args.ideal == "all":  # every GPU runs its share at once: both get the same heat
      ideal_sets = bl.stacked_ideal_sets(jax.random.fold_in(key, 1), len(sets), case, mesh)
      ideal_f = bl.ideal_all_devices_fn(case, mesh)
    else:
      xi, wi, _ = case.ideal_shapes()
      single = SingleDeviceSharding(devices[0])
      ideal_sets = bl.make_sets(jax.random.fold_in(key, 1), len(sets), xi, wi, None,
                                case.jdtype, (single, single, single))
      ideal_f = bl.ideal_fn(case)
    ideal = ideal_f.lower(*ideal_sets[0]).compile()
    entries = [bl.Timed("ideal", ideal, ideal_sets), bl.Timed("ffi", ours, sets)]
    bl.time_interleaved(entries, opts, lambda msg: None)
    t_ideal, t_ours = (statistics.median(e.times) for e in entries)
    cuda.trace_records(True)  # drop warm-up and timed calls
    entries[1].run(args.traced_calls)
    summary = _summarize(cuda.trace_records(True), args.traced_calls)
    results.append({"case": case.label, "ranks": [d.id for d in devices], "ideal": args.ideal,
                    "ideal_ms": t_ideal, "ours_ms": t_ours,
                    "eff": t_ideal / t_ours, "ideal_repeats": entries[0].times,
                    "ours_repeats": entries[1].times, "timeline": summary})
    del sets, ideal_sets, ours, ideal, entries
    jax.clear_caches()
  with open(args.child_out, "w") as f:
    json.dump(results, f)


def report(variant: str, results: list[dict]) -> str:
  lines = []
  for r in results:
    ranks = r.get("ranks")
    lines.append(f"[{variant}] {r['case']}: ideal {r['ideal_ms']:.3f} ms, ours "
                 f"{r['ours_ms']:.3f} ms, eff {r['eff']:.3f}"
                 + (f" (ranks 0..: devices {ranks}; the ideal on "
                    + ("every device" if r.get("ideal") == "all" else f"device {ranks[0]}")
                    + ")" if ranks else ""))
    for dev, t in r["timeline"].items():
      f = lambda v: "n/a" if v is None else f"{v:.1f}"
      lines.append(f"    device {dev}: span {f(t['span_us'])} us, gap to next call "
                   f"{f(t['gap_us'])} us, host "
                   f"{f(t.get('host_us'))} us in the handler every "
                   f"{f(t.get('host_period_us'))} us ({t['calls']} calls)")
      for l in t["launches"]:
        lines.append(f"      stage {l['stage']} chunk {l['chunk']}: start {l['start']:7.1f}  "
                     f"ready {l['ready']:7.1f}  end {l['end']:7.1f}")
  return "\n".join(lines)


def main() -> None:
  from jax_distgemm.bench import _positive_int  # the benchmark's own flag rule
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cases", nargs="+", required=True, metavar="SCHED:M,K,N", type=_case_arg,
                 help="e.g. AG-RotA:8192,4096,4096 (short or full schedule names)")
  p.add_argument("--variant", action="append", metavar="NAME:ENV=V[,ENV=V]",
                 help="environment overrides of one child run (repeatable; default: one "
                      "run with the defaults)")
  p.add_argument("--repeats", type=_positive_int, default=9)
  p.add_argument("--warmup", type=_positive_int, default=5)
  p.add_argument("--traced-calls", type=_positive_int, default=50)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", metavar="PATH")
  p.add_argument("--timeout", type=float, default=300.0, help="seconds per variant")
  p.add_argument("--ideal", choices=("device0", "all"), default="device0",
                 help="the ideal on rank 0's GPU alone (as the benchmark's ideal row) or on "
                      "every GPU at once (as its ideal_all row)")
  p.add_argument("--reverse-devices", action="store_true",
                 help="mesh order GPU 1, GPU 0: rank 0 and the ideal on GPU 1 (does a slower "
                      "device follow the rank or the GPU?)")
  p.add_argument("--_child", dest="child_out", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child_out:
    child(args)
    return
  variants = args.variant or ["default:"]
  all_results = {}
  for v in variants:
    name, _, assigns = v.partition(":")
    env = dict(os.environ, JAX_DISTGEMM_TRACE="1")
    for a in filter(None, assigns.split(",")):
      k, _, val = a.partition("=")
      env[k] = val
    out = f"/tmp/stage_timeline_{os.getpid()}_{name}.json"
    cmd = [sys.executable, __file__, "--_child", out, "--cases", *args.cases,
           "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--traced-calls", str(args.traced_calls), "--seed", str(args.seed)]
    if args.reverse_devices:
      cmd.append("--reverse-devices")
    cmd += ["--ideal", args.ideal]
    try:
      proc = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
      print(f"[{name}] timed out after {args.timeout:.0f} s", flush=True)
      all_results[name] = {"status": "timeout"}
      continue
    if args.json:  # the child's log (e.g. JAX_DISTGEMM_LOG_TUNING=1) next to the JSON
      with open(f"{args.json}.{name}.stderr", "w") as f:
        f.write(proc.stderr)
    if proc.returncode != 0:
      print(f"[{name}] child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
      all_results[name] = {"status": "error", "stderr": proc.stderr[-3000:]}
      continue
    with open(out) as f:
      results = json.load(f)
    os.remove(out)
    all_results[name] = {"status": "ok", "env": assigns, "results": results}
    print(report(name, results), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(all_results, f, indent=1)


if __name__ == "__main__":
  main()

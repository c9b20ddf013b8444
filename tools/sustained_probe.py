"""How a row's time per call evolves under sustained load, next to each GPU's power and clock.

The suite (docs/performance.md, I1) reads our call 5-10% slower in a repeat that follows ~30 ms
of the same row than in those first 30 ms, where XLA's dot changes by ~1%.  This probe runs each
row alone for --seconds after --idle seconds of idle GPUs, in segments of ~--segment-ms, and
after each segment (once the calls are done, so that NVML never stalls a CUDA host call) reads
every GPU's power draw and SM clock.  Rows: ideal (XLA's dot on device 0), ideal_all (the same
on every device at once) and ours (implementation="ffi"), on fresh random inputs rotated as in
the bench.  GPU only; JSON with --json.

  python tools/sustained_probe.py --case AG-RotA:8192,8192,28672 --json probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jax_distgemm._src import bench_lib as bl


def _nvml():
  try:
    import pynvml  # noqa: PLC0415 - nvidia-ml-py, optional
    pynvml.nvmlInit()
    return pynvml
  except Exception as e:  # noqa: BLE001 - the probe still times without it
    print(f"no NVML ({e}): times only", file=sys.stderr)
    return None


def _sample(nvml, n_dev: int) -> list[dict]:
  if nvml is None:
    return []
  out = []
  for i in range(n_dev):
    h = nvml.nvmlDeviceGetHandleByIndex(i)
    out.append({"power_w": nvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                "sm_mhz": nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
                "temp_c": nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)})
  return out


def _rows(case: bl.Case, devices):
  mesh = Mesh(np.array(devices), ("tp",))
  key = jax.random.key(0)
  opts = bl.Options()  # the bench's L2 size, rotation budget and set cap
  tp, dt = case.tp, case.jdtype
  xg, wg, _ = case.global_shapes()
  x_spec, w_spec, _ = case.specs()
  sets = bl.rotating_sets(key, xg, wg, dt,
                          (NamedSharding(mesh, x_spec), NamedSharding(mesh, w_spec), None), opts)
  ours = bl.distributed_fn(case, mesh, "ffi").lower(*sets[0]).compile()
  xi, wi, _ = case.ideal_shapes()
  isets = bl.rotating_sets(jax.random.fold_in(key, 1), xi, wi, dt,
                           (SingleDeviceSharding(devices[0]),) * 3, opts)
  ideal = bl.ideal_fn(case).lower(*isets[0]).compile()
  stacked = NamedSharding(mesh, P("tp"))
  asets = bl.rotating_sets(jax.random.fold_in(key, 2), (tp,) + tuple(xi), (tp,) + tuple(wi), dt,
                           (stacked,) * 3, opts)
  ideal_all = bl.ideal_all_devices_fn(case, mesh).lower(*asets[0]).compile()
  return [bl.Timed("ideal", ideal, isets), bl.Timed("ideal_all", ideal_all, asets),
          bl.Timed("ours", ours, sets)]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--case", required=True, help="SCHEDULE:M,K,N (global shape), TP=2")
  ap.add_argument("--seconds", type=float, default=1.5)
  ap.add_argument("--idle", type=float, default=1.0)
  ap.add_argument("--segment-ms", type=float, default=50.0)
  ap.add_argument("--json")
  args = ap.parse_args(argv)
  for name in ("seconds", "segment_ms"):
    if not getattr(args, name) > 0:
      ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
  if not args.idle >= 0:
    ap.error(f"--idle must be >= 0, got {args.idle}")
  try:
    case = bl.parse_case(args.case)
  except ValueError as e:
    ap.error(f"--case {e}")
  devices, platform, note = bl.select_devices(2)
  if platform == "cpu":
    raise SystemExit(f"GPU only ({note})")
  nvml = _nvml()
  rows = _rows(case, devices)
  results = {}
  for e in rows:
    e.run(3)  # compile-time work and tuning out of the way
    per_call = e.timed_run(3)
    calls = max(1, math.ceil(args.segment_ms / per_call))
    time.sleep(args.idle)
    segs = []
    t_start = time.perf_counter()
    while time.perf_counter() - t_start < args.seconds:
      t0 = time.perf_counter()
      ms = e.timed_run(calls)
      segs.append({"t_s": t0 - t_start, "ms_per_call": ms, "gpus": _sample(nvml, len(devices))})
    results[e.name] = {"calls_per_segment": calls, "segments": segs}
    first, last = segs[0]["ms_per_call"], np.median([s["ms_per_call"] for s in segs[-5:]])
    print(f"{case.label} {e.name:<9}: first segment {first:.4f} ms/call, last five (median) "
          f"{last:.4f} ({last / first - 1:+.1%}); {len(segs)} segments of {calls} calls")
    for s in segs[:: max(1, len(segs) // 8)]:
      g = " | ".join(f"{d['power_w']:.0f} W {d['sm_mhz']} MHz {d['temp_c']} C" for d in s["gpus"])
      print(f"    t={s['t_s']:.2f}s {s['ms_per_call']:.4f} ms  {g}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"case": case.as_dict(), "args": vars(args), "rows": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

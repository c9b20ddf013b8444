"""Hardware counters of one stage GEMM: ours (the op at TP=1) against XLA's dot, under ncu.

For each case: its stage problem (or, with --problem share, one device's whole share, the
benchmark's ideal) on one GPU, both executables compiled and warmed up (our tuner settles its
choice first), then `--launches` calls of XLA's dot, of ours and of ours forced to each
--ours-configs variant, inside one profiler range (cuProfilerStart/Stop), so that ncu, started
with `--profile-from-start off`, sees only those and none of XLA's autotuning or our tuning
trials:

  ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
      --csv --page details --log-file ncu.csv \
      python3 tools/ncu_stage.py --cases RS-TilA:8192,8192,28672 > ncu.log
  python3 tools/ncu_stage.py --summarize ncu.csv --log ncu.log   # one row per profiled kernel

(tools/gpu_check.sh --ncu-only runs the first with every section the summary reads.)

NOTE: ncu replays each kernel once per counter pass on an otherwise idle GPU, so its times are
a cool GPU's (no power cap); compare cycles and bytes, not milliseconds, with the benchmark.
"""
from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import dataclasses
import json
import os
import re
import sys


class _ProfilerRange:
  """cuProfilerStart/Stop through the driver API on the device's primary context (the one XLA
  uses), so the range needs no CUDA runtime of its own."""

  def __init__(self, ordinal: int):
    self._cuda = ctypes.CDLL("libcuda.so.1")
    dev, self._ctx = ctypes.c_int(), ctypes.c_void_p()
    self._check(self._cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    self._check(self._cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev),
                "cuDevicePrimaryCtxRetain")

  @staticmethod
  def _check(rc: int, what: str):
    if rc != 0:
      raise RuntimeError(f"{what} failed: CUresult {rc}")

  def _call(self, name: str):
    # NOTE: the _v2 entry points are what cuda.h's names resolve to; the unversioned symbols are
    # the old ABI (cuCtxPushCurrent returned CUDA_ERROR_INVALID_CONTEXT on the primary context).
    self._check(self._cuda.cuCtxPushCurrent_v2(self._ctx), "cuCtxPushCurrent_v2")
    try:
      self._check(getattr(self._cuda, name)(), name)
    finally:
      self._cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

  def __enter__(self):
    self._call("cuProfilerStart")

  def __exit__(self, *exc):
    self._call("cuProfilerStop")


# -- Summary of ncu's CSV (--page details) ---------------------------------------------------
# (column title, section, metric): what the summary prints per kernel, where ncu reported it.
_COLUMNS = (
    ("us", "GPU Speed Of Light Throughput", "Duration"),
    ("Mcycles", "Command line profiler metrics", "sm__cycles_elapsed.max"),
    ("SM MHz", "GPU Speed Of Light Throughput", "SM Frequency"),
    ("SM %", "GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("mem %", "GPU Speed Of Light Throughput", "Memory Throughput"),
    ("DRAM rd MB", "Command line profiler metrics", "dram__bytes_read.sum"),
    ("DRAM wr MB", "Command line profiler metrics", "dram__bytes_write.sum"),
    ("L2 hit %", "Command line profiler metrics", "lts__t_sector_hit_rate.pct"),
    ("regs", "Launch Statistics", "Registers Per Thread"),
    ("grid", "Launch Statistics", "Grid Size"),
    ("block", "Launch Statistics", "Block Size"),
    ("smem KB", "Launch Statistics", "Dynamic Shared Memory Per Block"),
    ("issue %", "Compute Workload Analysis", "Issue Slots Busy"),
    ("warp cyc/inst", "Warp State Statistics", "Warp Cycles Per Issued Instruction"),
)
_SCALE = {"DRAM rd MB": 1e-6, "DRAM wr MB": 1e-6, "Mcycles": 1e-6, "us": 1e-3,
          "smem KB": 1 / 1024, "SM MHz": 1e-6}


def _short_name(kernel: str) -> str:
  """ours:stage / ours:fused (our kernels live in namespace jax_distgemm), else xla:<name>."""
  if "jax_distgemm" in kernel:
    return "ours:" + ("fused" if "FusedStageKernel" in kernel else "stage")
  return "xla:" + re.split(r"[<(]", kernel.removeprefix("void "))[0][:48]


def _read(path: str) -> "collections.OrderedDict[str, dict]":
  """ncu's details CSV as {kernel id: {"name": kernel name, (section, metric): (value, unit)}};
  lines that are not CSV (ncu's ==PROF== messages, the program's own output) are skipped."""
  kernels = collections.OrderedDict()
  with open(path, newline="") as f:
    for row in csv.DictReader(line for line in f if line.startswith('"')):
      k = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
      k[(row["Section Name"], row["Metric Name"])] = (row["Metric Value"], row["Metric Unit"])
  return kernels


_ORDER = re.compile(r"^\[ncu_stage\] (?P<case>.+?): (?P<problem>stage|share) m=(?P<m>\d+) "
                    r"k=(?P<k>\d+) n=(?P<n>\d+); profiled in order, (?P<launches>\d+) "
                    r"launch\(es\) each: (?P<rows>.*)$")


def launch_labels(log_path: str) -> list[dict]:
  """(case, problem, shape, row) of every profiled launch, in order, from the program's own
  "profiled in order" lines (main prints one per case)."""
  out = []
  with open(log_path) as f:
    for line in f:
      m = _ORDER.match(line.rstrip("\n"))
      if not m:
        continue
      shape = [int(m["m"]), int(m["k"]), int(m["n"])]
      for row in m["rows"].split(", "):
        out += [{"case": m["case"], "problem": m["problem"], "mkn": shape, "row": row}
                ] * int(m["launches"])
  return out


def with_labels(rows: list[dict], log_path: str | None) -> list[dict]:
  """Attaches launch_labels to rows (kernel_rows or compact records) when the counts agree: XLA's
  dot is one kernel on the shapes measured so far, but may not be everywhere."""
  if not log_path:
    return rows
  labels = launch_labels(log_path)
  if len(labels) != len(rows):
    print(f"NOTE: {len(rows)} kernels but {len(labels)} launches in {log_path}; not labelled",
          file=sys.stderr)
    return rows
  return [{**lab, **row} for lab, row in zip(labels, rows)]


def compact(path: str) -> list[dict]:
  """Every metric of every kernel, one record per kernel with the short name (ncu repeats the
  whole templated kernel name on every row, ~6 MB for 40 kernels; this keeps ~1/30 of it)."""
  return [{"id": kid, "kernel": _short_name(k.pop("name")),
           "metrics": {f"{sec} / {met}": f"{v} {u}".strip() for (sec, met), (v, u) in k.items()}}
          for kid, k in _read(path).items()]


def kernel_rows(path: str) -> list[dict]:
  """One dict per profiled kernel of ncu's details CSV (--print-units base): "id", "kernel"
  (ours:stage / ours:fused / xla:<name>) and each _COLUMNS title that ncu reported, as a float
  in the title's unit where it parses, else ncu's text."""
  out = []
  for kid, k in _read(path).items():
    row = {"id": kid, "kernel": _short_name(k["name"])}
    for title, section, metric in _COLUMNS:
      if (section, metric) not in k:
        continue
      value = k[(section, metric)][0]
      try:
        row[title] = float(value.replace(",", "")) * _SCALE.get(title, 1.0)
      except ValueError:
        row[title] = value
    out.append(row)
  return out


def summarize(path: str, log_path: str | None = None) -> None:
  titles = ["id", "kernel"] + (["case", "row"] if log_path else []) + [t for t, _, _ in _COLUMNS]
  print("\t".join(titles))
  for row in with_labels(kernel_rows(path), log_path):
    cells = [row.get(t, "") for t in titles]
    print("\t".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells))


def _calls(fn, x, w, config: str | None, count: int) -> None:
  """`count` blocking calls of fn, with JAX_DISTGEMM_GEMM_CONFIG set to `config` (unset for
  None); the handler reads it per call."""
  if config is None:
    os.environ.pop("JAX_DISTGEMM_GEMM_CONFIG", None)
  else:
    os.environ["JAX_DISTGEMM_GEMM_CONFIG"] = config
  for _ in range(count):
    fn(x, w).block_until_ready()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", nargs="+", metavar="SCHEDULE:M,K,N",
                  help="global shape; its stage problem is profiled")
  # NOTE: ncu failed to profile our second launch in a row ("Failed to profile device_kernel",
  # then the process hung; 2026-12-01, one H200), so each is one launch by default.
  ap.add_argument("--launches", type=int, default=1, help="profiled calls of each (default 1)")
  ap.add_argument("--ours-configs", nargs="*", default=[], metavar="CONFIG[:RASTER[:SWIZZLE]]",
                  help="also profile ours with JAX_DISTGEMM_GEMM_CONFIG forced to each (after "
                       "the tuner's choice)")
  ap.add_argument("--warmup", type=int, default=5)
  ap.add_argument("--problem", choices=("stage", "share"), default="stage",
                  help="stage: one stage GEMM of the case (default); share: one device's whole "
                       "share (the benchmark's ideal), ours as one stage kernel of that shape")
  ap.add_argument("--summarize", metavar="CSV", help="print ncu's CSV as one row per kernel")
  ap.add_argument("--json", metavar="PATH",
                  help="with --summarize: also write every metric, one record per kernel")
  ap.add_argument("--log", metavar="PATH",
                  help="with --summarize: the profiled program's output, to name each kernel's "
                       "case and row")
  args = ap.parse_args(argv)
  if args.summarize:
    summarize(args.summarize, args.log)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(with_labels(compact(args.summarize), args.log), f, indent=1)
    return
  if not args.cases:
    ap.error("--cases or --summarize is required")
  if args.launches < 1:
    ap.error("--launches: must be >= 1")
  if args.warmup < 1:
    ap.error("--warmup: must be >= 1 (the tuner must settle before the profiled range)")

  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import SingleDeviceSharding  # pylint: disable=import-outside-toplevel
  from jax_distgemm._src import bench_lib, runtime  # pylint: disable=import-outside-toplevel
  for text in args.cases:  # a usage error before any device starts
    try:
      bench_lib.case_arg(text)
    except argparse.ArgumentTypeError as e:
      ap.error(f"--cases: {e}")

  device = jax.devices()[0]
  if device.platform != "gpu":
    sys.exit("ncu_stage: needs a GPU")
  profiler = _ProfilerRange(device.local_hardware_id)
  for index, text in enumerate(args.cases):
    case = dataclasses.replace(bench_lib.parse_case(text), alpha=1.0, beta=0.0)
    if args.problem == "stage":
      sm, sk, sn = case.stage_shape()
    else:
      (sm, sk), (_, sn), _ = case.ideal_shapes()
    (x, w), = bench_lib.make_sets(jax.random.key(index), 1, (sm, sk), (sk, sn), None,
                                  case.jdtype, (SingleDeviceSharding(device),) * 3)
    xla = bench_lib.ideal_fn(case).lower(x, w).compile()
    ours = jax.jit(bench_lib.local_stage_fn(case, device)).lower(x, w).compile()
    # (label, executable, forced JAX_DISTGEMM_GEMM_CONFIG or None); every row warms up outside
    # the range, the tuner's row first (a forced config skips the tuner).
    rows = [("xla", xla, None), ("ours (tuner)", ours, None)]
    rows += [(f"ours {c}", ours, c) for c in args.ours_configs]
    for _, fn, config in rows:
      _calls(fn, x, w, config, args.warmup if config is None else 1)
    print(f"[ncu_stage] {case.label}: {args.problem} m={sm} k={sk} n={sn}; profiled in order, "
          f"{args.launches} launch(es) each: " + ", ".join(r[0] for r in rows), flush=True)
    with profiler:
      for _, fn, config in rows:
        _calls(fn, x, w, config, args.launches)
    os.environ.pop("JAX_DISTGEMM_GEMM_CONFIG", None)
  print(runtime.describe_tuning())


if __name__ == "__main__":
  main()

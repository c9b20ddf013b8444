"""Hardware counters of one stage GEMM: ours (the op at TP=1) against XLA's dot, under ncu.

For each case: its stage problem (or, with --problem share, one device's whole share, the
benchmark's ideal) on one GPU, both executables compiled and warmed up (our
tuner settles its choice first), then `--launches` calls of each inside one profiler range
(cuProfilerStart/Stop), so that ncu, started with `--profile-from-start off`, sees only those
and none of XLA's autotuning or our tuning trials:

  ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
      --csv --page details --log-file ncu.csv python3 tools/ncu_stage.py --cases RS-TilA:8192,8192,28672
  python3 tools/ncu_stage.py --summarize ncu.csv      # one row per profiled kernel

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
    self._check(self._cuda.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
    try:
      self._check(getattr(self._cuda, name)(), name)
    finally:
      self._cuda.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p()))

  def __enter__(self):
    self._call("cuProfilerStart")

  def __exit__(self, *exc):
    self._call("cuProfilerStop")


# -- Summary of ncu's CSV (--page details) ----------------------------------------------------------
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


def kernel_rows(path: str) -> list[dict]:
  """One dict per profiled kernel of ncu's details CSV (--print-units base): "id", "kernel"
  (ours:stage / ours:fused / xla:<name>) and each _COLUMNS title that ncu reported, as a float
  in the title's unit where it parses, else ncu's text.  Lines that are not CSV (ncu's ==PROF==
  messages, the program's own output) are skipped."""
  kernels = collections.OrderedDict()
  with open(path, newline="") as f:
    for row in csv.DictReader(line for line in f if line.startswith('"')):
      k = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
      k[(row["Section Name"], row["Metric Name"])] = row["Metric Value"]
  out = []
  for kid, k in kernels.items():
    row = {"id": kid, "kernel": _short_name(k["name"])}
    for title, section, metric in _COLUMNS:
      if (section, metric) not in k:
        continue
      value = k[(section, metric)]
      try:
        row[title] = float(value.replace(",", "")) * _SCALE.get(title, 1.0)
      except ValueError:
        row[title] = value
    out.append(row)
  return out


def summarize(path: str) -> None:
  titles = ["id", "kernel"] + [t for t, _, _ in _COLUMNS]
  print("\t".join(titles))
  for row in kernel_rows(path):
    cells = [row.get(t, "") for t in titles]
    print("\t".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", nargs="+", metavar="SCHEDULE:M,K,N",
                  help="global shape; its stage problem is profiled")
  ap.add_argument("--launches", type=int, default=2, help="profiled calls of each (default 2)")
  ap.add_argument("--warmup", type=int, default=5)
  ap.add_argument("--problem", choices=("stage", "share"), default="stage",
                  help="stage: one stage GEMM of the case (default); share: one device's whole "
                       "share (the benchmark's ideal), ours as one stage kernel of that shape")
  ap.add_argument("--summarize", metavar="CSV", help="print ncu's CSV as one row per kernel")
  args = ap.parse_args(argv)
  if args.summarize:
    summarize(args.summarize)
    return
  if not args.cases:
    ap.error("--cases or --summarize is required")
  if args.launches < 1:
    ap.error("--launches: must be >= 1")

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
    for _ in range(args.warmup):
      xla(x, w).block_until_ready()
      ours(x, w).block_until_ready()
    print(f"[ncu_stage] {case.label}: {args.problem} m={sm} k={sk} n={sn}; profiling {args.launches} "
          "XLA dot launch(es), then ours", flush=True)
    with profiler:
      for _ in range(args.launches):
        xla(x, w).block_until_ready()
      for _ in range(args.launches):
        ours(x, w).block_until_ready()
  print(runtime.describe_tuning())


if __name__ == "__main__":
  main()

"""Benchmark of jax_distgemm's collective matmuls against the ideal and XLA's own ways.

A case is a schedule and a global x [L, M, K] @ w [L, K, N] over TP devices. Rows: ideal (an XLA
dot of one device's share of the FLOPs, no communication), ffi (ours), auto (implementation=None,
what users get), reference (all_gather + dot / dot + psum_scatter), xla (the ppermute ring),
windowed_einsum (the reference formulation left to XLA's SPMD partitioner with
WINDOWED_EINSUM_FLAGS, in a child process; GPU only). Efficiency = ideal / ours; speedup = best
of (reference, xla, windowed_einsum) / ours. ffi, auto and xla are checked against reference
(relative Frobenius error <= --eps, else the case FAILs, exit status 1); a row that cannot run
says why. --local-gemm also times one stage's GEMM: XLA's dot / ours (the op at TP=1).
--dtype fp8: each device quantizes its shards (--scaling, bf16 output) before timing; the ideal
is XLA's scaled fp8 dot.

Timing: compile, warm up, then --repeats rounds in which every row runs N back-to-back calls
(N for ~30 ms, or --iterations) in a new shuffled order; the median is reported. Inputs are
fresh normal data rotated over enough sets to exceed twice the L2 (--l2-mb). Without a GPU it
runs tiny shapes on fake CPU devices: a smoke test. Progress goes to stderr, the table to stdout.

Usage (by default the seed's shape, AG-RotA):
  python -m jax_distgemm.bench --m 8192 --n 28672 --k 8192 --schedule RS-TilA
  python -m jax_distgemm.bench --suite --local-gemm --json out.json --plot out.png
  python -m jax_distgemm.bench --suite small --list  # decode and small-batch cases, not run
  python -m jax_distgemm.bench --suite --dtype fp8 --scaling block
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_distgemm
from jax_distgemm import ffi as ffi_modules
from jax_distgemm._src import cli, fp8, validation
from jax_distgemm._src.schedules import Schedule
from jax_distgemm.bench_cases import CPU_SCALE, CPU_SHAPE, SEED_SHAPE, SHORT_NAMES, SUITES
from jax_distgemm.bench_cases import Case, suite
from jax_distgemm.bench_cases import distributed_fn, dot_fn, draw_inputs

AG_A, AG_B, RS_A, RS_B = Schedule

ROWS = ("ideal", "ffi", "auto", "reference", "xla", "windowed_einsum")  # the child's is last
IMPLEMENTATIONS = {"ffi": "ffi", "auto": None, "reference": "reference", "xla": "xla"}
BASELINES = ("reference", "xla", "windowed_einsum")
CHECKED = ("ffi", "auto", "xla")
WINDOWED_EINSUM_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0",
                         "--xla_gpu_multi_streamed_windowed_einsum=true")
CHILD_FLAG = "--_windowed-einsum-child"

# The small suite's calls take 20-100 us: one dispatch per call would time the host, not the GPU.
SMALL_CALLS_PER_PROGRAM = 16
TARGET_REPEAT_MS = 30.0
# --dtype: the array dtype and the default --eps.
DTYPES = {"bf16": ("bfloat16", 1e-2), "fp16": ("float16", 2e-3), "fp32": ("float32", 1e-3),
          "fp8": ("float8_e4m3fn", 1e-2)}


@jax.jit
def _rel_err(out, ref):
  o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.linalg.norm(o - r) / jnp.maximum(jnp.linalg.norm(r), 1e-30)


def guarded(fn):
  """(fn(), None), or (None, a row saying why fn raised): NotImplementedError is 'unsupported'."""
  try:
    return fn(), None
  except Exception as e:  # noqa: BLE001 - one implementation's failure is reported, not fatal
    first = (str(e).strip().splitlines() or [""])[0][:400]
    status = "unsupported" if isinstance(e, NotImplementedError) else "error"
    return None, {"status": status, "reason": f"{type(e).__name__}: {first}"}


@dataclasses.dataclass
class Timed:
  """A compiled program of `per_program` calls and the argument groups it rotates over."""

  call: object
  groups: list
  per_program: int
  programs: int = 0  # per repeat
  pos: int = 0
  times: list = dataclasses.field(default_factory=list)  # ms per call, one per round
  failure: dict | None = None

  def run_ms(self, programs: int, sync_each: bool) -> float:
    t0, out = time.perf_counter(), None
    for _ in range(programs):
      out = self.call(*self.groups[self.pos % len(self.groups)])
      self.pos += 1
      if sync_each:
        jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) * 1e3

  def first_output(self):  # that of the first call, on the first input set
    return self.call(*self.groups[0])[0]


def compile_timed(fn, sets: list, k: int) -> Timed:
  """`fn` compiled k calls to a program, each on its own input set."""
  groups = [tuple(sets[(j * k + i) % len(sets)] for i in range(k))
            for j in range(max(1, len(sets) // k))]
  # NOTE: the k calls are independent, so a baseline's collectives may overlap another call's
  # dot; that can only flatter the baselines (our custom calls run one after another anyway).
  program = jax.jit(lambda *group: [fn(*s) for s in group])
  return Timed(program.lower(*groups[0]).compile(), groups, k)


def time_interleaved(timed: list[Timed], args, sync_each: bool, log) -> None:
  """Warm-up, then args.repeats rounds of one repeat per row, in a seeded shuffled order per
  round, so that no row always follows the same one (clocks, power and caches)."""
  def warm(t):
    t.run_ms(max(1, math.ceil(args.warmup_iterations / t.per_program)), sync_each)
    if args.iterations:
      return math.ceil(args.iterations / t.per_program)
    n, ms = 1, t.run_ms(1, sync_each)
    while ms < 5 and n < 4096:  # long enough that one dispatch and sync hardly count
      n, ms = n * 4, t.run_ms(n * 4, sync_each)
    return int(min(500, max(10, math.ceil(TARGET_REPEAT_MS * n / ms))))

  for t in timed:
    t.programs, t.failure = guarded(lambda t=t: warm(t))
  for r in range(args.repeats):
    log(f"round {r + 1}/{args.repeats}")
    order = random.Random(args.seed * 1_000_003 + r).sample(timed, len(timed))
    for t in (t for t in order if not t.failure):
      ms, t.failure = guarded(lambda t=t: t.run_ms(t.programs, sync_each))
      if ms is not None:
        t.times.append(ms / (t.programs * t.per_program))


def measure_case(case: Case, index: int, devices, names, args, log) -> dict:
  """{row: its dict} of the rows `names`: of ROWS, and local_xla and local_ours (--local-gemm)."""
  key = jax.random.fold_in(jax.random.key(args.seed), index)
  rows, timed, k = {}, {}, SMALL_CALLS_PER_PROGRAM if args.suite == "small" else 1

  def add(salt, case, which, shardings, makers):  # rows that time the same inputs
    if not (makers := {n: f for n, f in makers.items() if n in names}):
      return
    sets, fail = guarded(lambda: draw_inputs(case, jax.random.fold_in(key, salt), which,
                                             shardings, int(args.l2_mb * 2**20)))
    for name, make in makers.items():
      log(f"compiling {name}")
      t, rows[name] = (None, fail) if fail else guarded(
          lambda make=make: compile_timed(make(), sets, k))
      if t:
        rows[name], timed[name] = {"status": "ok"}, t

  mesh, one = Mesh(np.array(devices), ("tp",)), Mesh(np.array(devices[:1]), ("tp",))
  single = (NamedSharding(one, P()),) * 3
  on_mesh = [NamedSharding(mesh, s) for s in case.specs()]
  add(0, case, "global", on_mesh, {
      **{n: functools.partial(distributed_fn, case, mesh, i) for n, i in IMPLEMENTATIONS.items()},
      "windowed_einsum": lambda: dot_fn(case, on_mesh[2])})
  add(1, case, "ideal", single, {"ideal": lambda: dot_fn(case)})
  # Our stage GEMM alone: the fused op at TP=1 on one device, whose schedule is then exactly
  # one stage GEMM (tuned like every stage), with no peers to wait for.
  stage = dataclasses.replace(case, alpha=1.0, beta=0.0)
  add(2, stage, "stage", single, {"local_xla": lambda: dot_fn(stage), "local_ours": lambda: (
      distributed_fn(dataclasses.replace(stage, schedule=AG_A),
                      one, "ffi"))})
  hlo = {n: timed[n].call.as_text() for n in ("auto", "windowed_einsum") if n in timed}
  if "auto" in hlo:  # which implementation auto chose, from the compiled program
    rows["auto"]["resolved"] = ("ffi" if 'custom_call_target="jax_distgemm' in hlo["auto"] else
                                "xla" if "collective-permute" in hlo["auto"] else "reference")
  if "windowed_einsum" in hlo:  # False: XLA did not rewrite it
    rows["windowed_einsum"]["windowed_loop"] = "windowed_dot_general" in hlo["windowed_einsum"]
  ref_out, ref_fail = (guarded(timed["reference"].first_output) if "reference" in timed else
                       (None, rows.get("reference")))
  no_ref = {"status": "error", "reason": f"not checked: no reference output: "
            f"{(ref_fail or {}).get('reason')}"}
  for name in (n for n in CHECKED if n in timed):
    err, fail = (None, no_ref) if ref_out is None else guarded(
        lambda name=name: float(_rel_err(timed[name].first_output(), ref_out)))
    rows[name].update(fail or {"rel_err": err if math.isfinite(err) else None,  # NaN: not JSON
                               "correct": err <= args.eps})
    if fail:  # nothing to time: it does not run, or it cannot be checked
      del timed[name]
  del ref_out  # the seed shape's output takes GiBs per device
  time_interleaved(list(timed.values()), args, devices[0].platform == "cpu", log)
  for name, t in timed.items():
    rows[name].update(t.failure or {"ms": float(np.median(t.times)), "ms_repeats": t.times,
                                    "calls_per_repeat": t.programs * t.per_program,
                                    "input_sets": len(t.groups) * t.per_program})
  return rows


def finalize(case: Case, rows: dict, eps: float, platform: str) -> dict:
  """A case's result: TFLOP/s and ratios of its rows, the --eps check, the local GEMM's."""
  ok = {n: r["ms"] for n, r in rows.items() if "ms" in r}
  flops = 2 * case.l * case.m * case.k * case.n / case.tp  # per device
  best = min((n for n in BASELINES if n in ok), key=ok.get, default=None)
  for name, ms in ok.items():
    rows[name].update(tflops_per_device=flops / (ms * 1e9),
                      efficiency=ok["ideal"] / ms if "ideal" in ok else None,
                      speedup=ok[best] / ms if best else None)
  failures = [f"{n}: {r['reason']}" if r["status"] == "error" else
              f"{n}: rel_err {_fmt(r['rel_err'], '.3g')} > eps {eps:g}"
              for n in CHECKED if (r := rows[n])["status"] == "error" or r.get("correct") is False]
  result = {"case": {**dataclasses.asdict(case), "schedule": case.schedule.name},
            "label": case.label, "rows": {n: rows[n] for n in ROWS},
            "efficiency": rows["ffi"].get("efficiency"), "speedup": rows["ffi"].get("speedup"),
            "best_baseline": best, "eps": eps, "passed": not failures, "failures": failures}
  if "local_xla" in rows:
    (xs, ws, _), xla, ours = case.shapes("stage"), rows["local_xla"], rows["local_ours"]
    result["local_gemm"] = {
        "stage_shape": [*xs[-2:], ws[-1]], "xla_ms": xla.get("ms"), "ours_ms": ours.get("ms"),
        "executor": "cutlass" if platform == "gpu" else f"{platform} executor",
        "ratio": xla["ms"] / ours["ms"] if "ms" in xla and "ms" in ours else None,
        "reason": "; ".join(f"{r['status']}: {r['reason']}" for r in (xla, ours)
                            if "ms" not in r) or None}
  return result


def run_windowed_child(argv: list[str], log) -> dict:
  """This benchmark again in a child process with WINDOWED_EINSUM_FLAGS added to XLA_FLAGS,
  timing only windowed_einsum: {case label: row} or {"": a row saying why none was timed}.
  Run before this process starts a backend, so that the child has the GPUs' whole memory."""
  flags = " ".join([os.environ.get("XLA_FLAGS", ""), *WINDOWED_EINSUM_FLAGS]).strip()
  log(f"windowed einsum: child process with XLA_FLAGS={flags!r}")
  proc = subprocess.run([sys.executable, "-m", "jax_distgemm.bench", *argv, CHILD_FLAG],
                        env=dict(os.environ, XLA_FLAGS=flags), stdout=subprocess.PIPE,
                        text=True, check=False)  # its progress goes to our stderr
  try:
    return json.loads(proc.stdout.strip().splitlines()[-1])
  except (IndexError, ValueError):
    return {"": {"status": "error", "reason": f"the child process exited with status "
                 f"{proc.returncode} and no result (its output is on stderr)"}}


def _at_least(kind, low):
  def parse(s):
    if not (math.isfinite(v := kind(s)) and v >= low):
      raise argparse.ArgumentTypeError(f"must be a number >= {low}, got {s}")
    return v
  return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jax_distgemm.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  positive, count, nonneg = _at_least(int, 1), _at_least(int, 0), _at_least(float, 0.0)
  p.add_argument("--m", type=positive, help="global M (GPU default 16384, CPU 256)")
  p.add_argument("--n", type=positive, help="global N (GPU default 106496, CPU 512)")
  p.add_argument("--k", type=positive, help="global K (GPU default 16384, CPU 128)")
  p.add_argument("--l", type=positive, default=1, help="batch L (default 1: no batch dim)")
  p.add_argument("--alpha", type=float, default=1.0, help="out = alpha * x @ w + beta * c")
  p.add_argument("--beta", type=float, default=0.0, help="beta != 0 adds a random fp32 c")
  p.add_argument("--schedule", help="a full name, AG-RotA, AG-RotB, RS-TilA, RS-TilB or 'all' "
                 "(default AG-RotA; with --suite, that schedule's cases of the suite)")
  p.add_argument("--tp", type=positive, default=2, help="tensor-parallel size (default 2)")
  p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="default bf16")
  p.add_argument("--scaling", choices=fp8.SCALINGS, help="fp8 scales: per tensor (default) or "
                 "in blocks (1x128 of x, 128x128 of w)")
  p.add_argument("--suite", nargs="?", const="standard", choices=SUITES, help="a suite of "
                 "shapes: 'standard' (default) or 'small' (decode, small batches); smaller on CPU")
  p.add_argument("--warmup-iterations", type=count, default=5, help="warm-up calls (default 5)")
  p.add_argument("--iterations", type=positive,
                 help=f"calls per repeat (default: ~{TARGET_REPEAT_MS:g} ms of calls)")
  p.add_argument("--repeats", type=positive, default=7, help="rounds; the median is reported")
  p.add_argument("--eps", type=nonneg, help="max relative Frobenius error of ffi/auto/xla "
                 "against reference (default 1e-2 for bf16, 2e-3 for fp16, 1e-3 for fp32)")
  p.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs")
  p.add_argument("--l2-mb", type=nonneg, default=60.0,
                 help="L2 size in MiB; input sets rotate past twice it (default 60)")
  p.add_argument("--local-gemm", action="store_true",
                 help="also time one stage's GEMM, XLA's dot and ours (the fused op at TP=1)")
  p.add_argument("--tuning-file", metavar="PATH", help="load the stage-GEMM choices saved in "
                 "PATH (if it exists) before timing, save this run's there (replacing it) after")
  p.add_argument("--json", metavar="PATH", help="write the results as JSON")
  p.add_argument("--plot", metavar="PATH", help="write a bar chart as PNG (needs matplotlib)")
  p.add_argument("--list", action="store_true", help="print the cases and exit")
  p.add_argument(CHILD_FLAG, dest="child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.suite and (args.m or args.n or args.k):
    p.error("--suite runs its own shapes: drop --m/--n/--k")
  if args.scaling and args.dtype != "fp8":
    p.error("--scaling: only with --dtype fp8")
  args.scaling = (args.scaling or "tensor") if args.dtype == "fp8" else None
  args.dtype, eps = DTYPES[args.dtype]
  args.eps = eps if args.eps is None else args.eps
  names = ({s.name.lower(): [s] for s in Schedule} | {"all": list(Schedule)} |
           {v.lower(): [s] for s, v in SHORT_NAMES.items()})
  args.schedules = names.get((args.schedule or "AG-RotA").lower())
  if args.schedules is None:
    p.error(f"--schedule: unknown {args.schedule!r}: give a full name, one of "
            f"{', '.join(SHORT_NAMES.values())}, or 'all'")
  try:  # the library's rule and the shapes', as usage errors rather than a FAIL of every case
    validation.check_scalars(**{"--alpha": args.alpha, "--beta": args.beta})
    if not resolve_cases(args, "gpu"):
      p.error(f"--schedule {args.schedule}: --suite {args.suite} has no case of it")
  except ValueError as e:
    p.error(str(e))
  outputs = {"--json": args.json, "--plot": args.plot, "--tuning-file": args.tuning_file}
  seen = {}  # output files: each writable, none named twice; the child writes none
  for flag, path in ((f, v) for f, v in outputs.items() if v is not None and not args.child):
    cli.check_output_path(p, flag, path)
    if flag == "--plot" and not path.lower().endswith(".png"):
      p.error(f"--plot: {path}: must end in .png")
    if seen.setdefault(os.path.realpath(path), flag) != flag:
      p.error(f"{seen[os.path.realpath(path)]} and {flag} name the same file {path}")
  if args.plot and not args.child and importlib.util.find_spec("matplotlib") is None:
    p.error("--plot needs matplotlib (pip install matplotlib)")
  return args


def resolve_cases(args, platform: str) -> list[Case]:
  """The suite's cases (of --schedule, if given) or one per schedule; scaled down on CPU."""
  common = dict(l=args.l, tp=args.tp, dtype=args.dtype, alpha=args.alpha, beta=args.beta,
                scaling=args.scaling)
  if args.suite:
    scale = CPU_SCALE[args.suite] if platform == "cpu" else 1
    cases = [Case(s, m, k, n, **common) for s, m, k, n in suite(args.suite, scale)
             if not args.schedule or s in args.schedules]
  else:
    m, k, n = CPU_SHAPE if platform == "cpu" else SEED_SHAPE
    cases = [Case(s, args.m or m, args.k or k, args.n or n, **common) for s in args.schedules]
  if bad := [f"{c.label}: {c.invalid_reason()}" for c in cases if c.invalid_reason()]:
    raise ValueError("invalid case(s): " + "; ".join(bad))
  return cases


def select_devices(tp: int):
  """(the first `tp` devices, their platform): GPUs if any, else fake CPU devices."""
  with contextlib.suppress(RuntimeError):  # the backends are up already: use what they have
    jax.config.update("jax_num_cpu_devices", max(8, tp))
  devices = jax.devices()
  if len(devices) < tp:
    raise SystemExit(f"jax_distgemm.bench: --tp {tp} needs {tp} devices, there are {len(devices)}")
  return devices[:tp], devices[0].platform


def _fmt(v, spec: str) -> str:
  return "-" if v is None else format(v, spec)


TABLE_HEADER = (f"{'case':<26}" + "".join(f"{h:>10}" for h in (
    "ideal", "ffi", "auto", "ref", "ring", "win.ein")) +
                f"{'TFLOP/s':>9}{'eff':>6}{'speedup':>8}  {'best':<16}{'rel.err':>8}  check")


def table_lines(result: dict, notes: dict) -> str:
  """A case's ms per call of every row (n/a[i]: footnote i says why), and ours' numbers."""
  cells = ""
  for name, row in result["rows"].items():
    why = f"{name}: {row['status']}: {row.get('reason')}"
    cells += (f"{row['ms']:>10.4f}" if "ms" in row else
              f"{f'n/a[{notes.setdefault(why, len(notes) + 1)}]':>10}")
  ours = result["rows"]["ffi"]
  rate = ours.get("tflops_per_device")  # one decimal on GPUs, three digits when tiny (CPU)
  rate = _fmt(rate, ".1f" if rate and rate >= 10 else ".3g")
  line = (f"{result['label']:<26}{cells}{rate:>9}"
          f"{_fmt(result['efficiency'], '.2f'):>6}{_fmt(result['speedup'], '.2f'):>8}  "
          f"{result['best_baseline'] or '-':<16}{_fmt(ours.get('rel_err'), '.1e'):>8}  "
          f"{'ok' if result['passed'] else 'FAIL'}")
  if lg := result.get("local_gemm"):
    line += (f"\n{'':<4}local GEMM, stage {','.join(map(str, lg['stage_shape']))}: XLA dot "
             f"{_fmt(lg['xla_ms'], '.4f')} ms, ours ({lg['executor']}) "
             f"{_fmt(lg['ours_ms'], '.4f')} ms, XLA/ours {_fmt(lg['ratio'], '.3f')}"
             + (f" ({lg['reason']})" if lg["reason"] else ""))
  return line


def plot(results: list[dict], path: str, title: str) -> None:
  """Grouped bars: TFLOP/s per device of every row, per case; ffi's bars carry efficiency."""
  from matplotlib.figure import Figure  # noqa: PLC0415 - only for --plot
  names = [n for n in ROWS if any("ms" in r["rows"][n] for r in results)]
  width, xs = 0.8 / max(len(names), 1), np.arange(len(results))
  ax = Figure(figsize=(max(8, 1.6 * len(results) + 3), 5), layout="tight").subplots()
  for j, name in enumerate(names):
    vals = [r["rows"][name].get("tflops_per_device") or 0.0 for r in results]
    bars = ax.bar(xs + (j - (len(names) - 1) / 2) * width, vals, width, label=name)
    if name == "ffi":
      ax.bar_label(bars, [_fmt(r["efficiency"], ".2f") for r in results], fontsize=7)
  ax.set_xticks(xs, [r["label"].replace(" ", "\n", 1) for r in results], fontsize=8)
  ax.set_ylabel("TFLOP/s per device")
  ax.set_title(f"{title}  (on ffi: efficiency = ideal / ours)", fontsize=9)
  ax.legend(fontsize=7, ncol=min(6, len(names)))
  ax.grid(axis="y", alpha=0.3)
  ax.figure.savefig(path, dpi=120, format="png")


def _write(path: str | None, write) -> str | None:
  try:
    if path is not None:
      write(path)
  except (OSError, ValueError) as e:  # the path was checked up front; a disk can still fill up
    return f"cannot write {path}: {e}"
  return None


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
  if args.child:  # the windowed-einsum child's side: one JSON line on stdout
    devices, platform = select_devices(args.tp)
    why = f"no GPU ({platform}): windowed einsum is an XLA:GPU rewrite"
    out = {} if platform == "gpu" else {"": {"status": "skipped", "reason": why}}
    for i, case in enumerate(resolve_cases(args, platform) if platform == "gpu" else ()):
      out[case.label] = measure_case(case, i, devices, ("windowed_einsum",), args,
                                     lambda msg: log(f"[child] {msg}"))["windowed_einsum"]
    print(json.dumps(out))
    return 0
  try:
    loaded = (jax_distgemm.runtime.load_tuning(args.tuning_file) if args.tuning_file
              and not args.list and os.path.exists(args.tuning_file) else None)
  except ValueError as e:
    raise SystemExit(f"jax_distgemm.bench: --tuning-file: {e}") from None
  child = {} if args.list else run_windowed_child(argv, log)
  devices, platform = select_devices(args.tp)
  try:
    cases = resolve_cases(args, platform)
  except ValueError as e:  # the suite scaled down for CPU
    raise SystemExit(f"jax_distgemm.bench: {e}") from None
  if platform == "cpu":
    print(f"NOTE: no GPU: TP={args.tp} on fake CPU devices, tiny shapes: a smoke test only")
  if args.list:
    print("\n".join(c.label for c in cases))
    return 0
  kind = devices[0].device_kind
  meta = {"argv": argv, "platform": platform, "devices": [str(d) for d in devices],
          "device_kind": kind, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "jax_distgemm": jax_distgemm.__version__, "cuda_built": ffi_modules.has_cuda(),
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "windowed_einsum_flags":
          WINDOWED_EINSUM_FLAGS, "baselines": BASELINES, "checked": CHECKED,
          "tuning_file": args.tuning_file, "tuning_loaded": loaded}
  if loaded is not None:
    print(f"--tuning-file: loaded {loaded} saved choice(s) x GPU from {args.tuning_file}")
  print(f"jax_distgemm.bench: {len(cases)} case(s), TP={args.tp} {args.dtype} on {kind}; ms "
        "per call (median); TFLOP/s per device, eff (ideal/ours), speedup (best baseline/ours) "
        "and rel.err are ffi's\n" + TABLE_HEADER, flush=True)
  results, notes, t0 = [], {}, time.perf_counter()
  names = ROWS[:-1] + (("local_xla", "local_ours") if args.local_gemm else ())
  report = {"meta": meta, "cases": results}
  save = lambda path: pathlib.Path(path).write_text(json.dumps(report, indent=1))  # noqa: E731
  for i, case in enumerate(cases):
    rows = measure_case(case, i, devices, names, args, lambda msg, i=i, c=case: log(
        f"[{i + 1}/{len(cases)} {time.perf_counter() - t0:6.1f}s] {c.label}: {msg}"))
    rows["windowed_einsum"] = child.get(case.label) or child.get("") or {
        "status": "error", "reason": "the windowed-einsum child did not time it"}
    results.append(finalize(case, rows, args.eps, platform))
    print(table_lines(results[-1], notes), flush=True)
    _write(args.json, save)  # after every case, so that a run cut short leaves its results
    gc.collect()  # the case's arrays and executables: GiBs at the seed's shape
    jax.clear_caches()
  print("".join(f"  [{mark}] {why}\n" for why, mark in notes.items()), end="")
  errors = []
  if args.tuning_file:
    try:
      saved = meta["tuning_saved"] = jax_distgemm.runtime.save_tuning(args.tuning_file)
      print(f"--tuning-file: saved {saved} choice(s) to {args.tuning_file}")
    except ValueError as e:
      errors.append(f"--tuning-file: {e}")
  report.update(complete=True, passed=all(r["passed"] for r in results))
  errors += [_write(args.json, save), _write(args.plot, lambda p: plot(
      results, p, f"jax_distgemm TP={args.tp} {args.dtype} on {kind}"))]
  for e in filter(None, errors):
    log(f"jax_distgemm.bench: {e}")
  print("".join(f"FAIL {r['label']}: {'; '.join(r['failures'])}\n" for r in results
                if not r["passed"]), end="")
  return 0 if report["passed"] and not any(errors) else 1


if __name__ == "__main__":
  sys.exit(main())

#!/usr/bin/env python3
"""Test harness: N processes on this host as one jax.distributed job, every schedule checked.

examples/launch_multiprocess.py is the short program a user copies; this is what
tests/multiprocess_test.py and tools/gpu_check.sh run.  Each process (a "worker", this file with
--worker) initializes jax.distributed with the coordinator on 127.0.0.1:<free port>, calls
jax_distgemm.initialize_multiprocess(), builds a mesh over the devices of ALL processes, and
runs the four schedules plus a two-op MLP block (RotatingA then TilingA) with --implementation
(default "ffi") on global arrays.  Every result is checked against implementation="reference"
compiled in the same program and against a float64 numpy product; each worker prints one
`JDG_RESULT {json}` line per check and iteration.  The launcher prefixes each worker's output
with [p<i>], kills the others when one fails or the time runs out, checks that the job left no
shared-memory segment in /dev/shm (and removes any it finds), and prints "Disposition: Passed"
or "Disposition: Failed" (exit code 1).

--timing-only skips the checks: operands are drawn on the devices (jax.random, no host copy of
the seed shape's 3.5 GB weight), and each check is timed as the benchmark does: after warm-up,
the median over --timing-repeats of --timing-iterations back-to-back calls and one block
(JDG_TIME lines; --json writes them with the run's settings).

  python tests/multiprocess_launcher.py                          # 2 processes x 1 CPU device
  python tests/multiprocess_launcher.py -n 2 --devices-per-process 2        # TP=4 over both
  python tests/multiprocess_launcher.py -n 2 --devices-per-process 2 --tp 2    # 2 TP groups,
                                                                 # each spanning both processes
  python tests/multiprocess_launcher.py --platform gpu -n 2      # one GPU per process
  python tests/multiprocess_launcher.py --platform gpu -n 2 --timing-only \
      --m 16384 --k 16384 --n 106496 --checks AllGather1D_TilingCD_RotatingA   # seed shape
  python tests/multiprocess_launcher.py --platform gpu -n 1 --devices-per-process 2 \
      --timing-only ...                                          # the same in one process

Platforms: cpu (JAX_PLATFORMS=cpu, --devices-per-process fake CPU devices per process) or gpu
(JAX_PLATFORMS=cuda, process i sees GPUs i*D .. i*D+D-1 via CUDA_VISIBLE_DEVICES, D =
--devices-per-process; a TP group spanning processes needs D = 1 on CUDA).  The mesh is
(dp, tp) over the devices ordered (local index, process), so consecutive TP ranks sit in
different processes; a leading batch dim of size dp is sharded over dp.

Test hooks: --fault P:I[:PHASE] makes the CPU handler on the I-th local device of process P
skip its peers (from barrier PHASE on; -1: the whole call) in one call of the first check, after
the healthy ones: its peers must time out with DEADLINE_EXCEEDED and the call after it must be
correct again (JDG_FAULT lines; the run fails otherwise, also when the fault never fired).
--no-exit-cleanup ends the workers with os._exit (no atexit: like a crash), leaving their
segments behind.  --skip-initialize leaves out jax_distgemm.initialize_multiprocess(): the FFI
path must then be refused with a message that says what to call, and --implementation=auto
(None) must run the XLA ring instead, with a warning.  --checks ...@repeat12 (REPEATED, not in
the default set): 12 calls of one shard_map'd op in one program, which share a call_id, must
each meet the same call in the other processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

SCHEDULES = (
    "AllGather1D_TilingCD_RotatingA",
    "AllGather1D_TilingCD_RotatingB",
    "ReduceScatter1D_TilingA_RotatingC",
    "ReduceScatter1D_TilingB_RotatingC",
)
MLP = "MLP_RotatingA_then_TilingA"
# "<schedule>@x4": the schedule again with M, N and K four times larger, after the others: the
# same call site (channel) then needs a larger shared-memory segment, which must grow.
GROWN = ("AllGather1D_TilingCD_RotatingA@x4", "ReduceScatter1D_TilingA_RotatingC@x4")
CHECKS = SCHEDULES + (MLP,) + GROWN
# "<schedule>@repeat12": one jitted op called on 12 independent inputs in one program (the
# output is their sum with weights 1..12).  JAX lowers the op once, so the 12 calls share one
# call_id; each process's executor must still meet each with the same call in the peers
# (docs/design.md, "CPU executor").  Not in the default set.
REPEATED = ("AllGather1D_TilingCD_RotatingA@repeat12", "ReduceScatter1D_TilingA_RotatingC@repeat12")
KNOWN_CHECKS = CHECKS + REPEATED
DTYPES = ("bf16", "fp16", "fp32")
# Relative Frobenius error bounds vs float64 (products are exact in fp32 accumulation; the
# output rounding dominates; fp32 allows TF32 on GPUs).
TOL = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-3}
MAX_CALL_TIMEOUT_MS = 2**31 - 1  # the library's bound on timeout_ms (~24.8 days)
MAX_TIMEOUT_S = 1e6  # --timeout: half of it bounds initialize_multiprocess (at most ~24.8 days)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("-n", "--num-processes", type=int, default=2, help="processes (default 2)")
  p.add_argument("--devices-per-process", type=int, default=1,
                 help="devices per process (default 1)")
  p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
  p.add_argument("--tp", type=int, default=None,
                 help="TP group size (default: all devices of all processes)")
  p.add_argument("--tp-within-process", action="store_true",
                 help="each TP group inside one process and \"dp\" across processes (the "
                      "multi-host layout; needs --tp dividing --devices-per-process); default: "
                      "consecutive TP ranks in different processes")
  p.add_argument("--m", type=int, default=None, help="global M (default 64*TP CPU, 4096 GPU)")
  p.add_argument("--n", type=int, default=None, help="global N (default 48*TP CPU, 4096 GPU)")
  p.add_argument("--k", type=int, default=None, help="global K (default 32*TP CPU, 4096 GPU)")
  p.add_argument("--dtype", choices=DTYPES, default=None,
                 help="dtype (default fp32 on CPU, bf16 on GPU)")
  p.add_argument("--implementation", choices=("ffi", "xla", "reference", "auto"), default="ffi",
                 help='"auto": implementation=None (the default of the API); default "ffi"')
  p.add_argument("--iterations", type=int, default=3,
                 help="calls per check, each blocked on and checked (default 3)")
  p.add_argument("--timing-iterations", type=int, default=0,
                 help="also time this many back-to-back calls per check (default 0: no timing)")
  p.add_argument("--timing-repeats", type=int, default=5,
                 help="timed repeats per check; the median is reported (default 5)")
  p.add_argument("--timing-warmup", type=int, default=3,
                 help="untimed calls per check before timing (default 3; every process runs "
                      "the same count: a call is collective).  A fused AllGather grid of "
                      ">= 20 ms runs a call trial over its first ~120 calls (design.md), which "
                      "timing should not see: give it more there")
  p.add_argument("--timing-only", action="store_true",
                 help="no correctness checks: random operands on the devices, timing only")
  p.add_argument("--json", default=None,
                 help="launcher: write the JDG_TIME records and the final verdict (ok) here, "
                      "after every check (its directory must exist)")
  p.add_argument("--checks", default=",".join(CHECKS),
                 help="comma-separated subset of: " + ", ".join(KNOWN_CHECKS) +
                 " (default: all but the @repeat ones)")
  p.add_argument("--call-timeout-ms", type=int, default=None,
                 help="timeout_ms of every distgemm call (default: JAX_DISTGEMM_TIMEOUT_MS/30000)")
  p.add_argument("--timeout", type=float, default=120.0,
                 help="seconds for the whole job; workers are killed after (default 120)")
  p.add_argument("--fault", default=None, help="P:I[:PHASE] (test hook, see the docstring)")
  p.add_argument("--no-exit-cleanup", action="store_true",
                 help="workers end with os._exit, leaving their segments (test hook)")
  p.add_argument("--skip-initialize", action="store_true",
                 help="do not call jax_distgemm.initialize_multiprocess() (test hook)")
  p.add_argument("--seed", type=int, default=0)
  # Worker mode (set by the launcher).
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.num_processes < 1 or args.devices_per_process < 1:
    p.error("--num-processes and --devices-per-process must be >= 1")
  if args.iterations < 1:
    p.error(f"--iterations must be >= 1, got {args.iterations}")
  if args.timing_iterations < 0 or args.timing_repeats < 1 or args.timing_warmup < 0:
    p.error("--timing-iterations and --timing-warmup must be >= 0 and --timing-repeats >= 1")
  if not 0 < args.timeout <= MAX_TIMEOUT_S:  # also nan
    p.error(f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {args.timeout}")
  if args.call_timeout_ms is not None and not 1 <= args.call_timeout_ms <= MAX_CALL_TIMEOUT_MS:
    p.error(f"--call-timeout-ms must be in [1, {MAX_CALL_TIMEOUT_MS}], got {args.call_timeout_ms}")
  if not 0 <= args.seed < 2**31:
    p.error(f"--seed must be in [0, 2**31), got {args.seed}")
  if args.timing_only and not args.timing_iterations:
    args.timing_iterations = 10
  total = args.num_processes * args.devices_per_process
  args.tp = total if args.tp is None else args.tp
  if args.tp < 1 or total % args.tp:
    p.error(f"--tp={args.tp} must be >= 1 and divide the {total} devices")
  if args.tp_within_process and args.devices_per_process % args.tp:
    p.error(f"--tp-within-process: --tp={args.tp} must divide --devices-per-process="
            f"{args.devices_per_process}")
  gpu = args.platform == "gpu"
  defaults = {"m": 4096 if gpu else 64 * args.tp, "n": 4096 if gpu else 48 * args.tp,
              "k": 4096 if gpu else 32 * args.tp}
  for name, default in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, default)
    elif getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  args.dtype = args.dtype or ("bf16" if gpu else "fp32")
  for name in ("m", "n", "k"):
    if getattr(args, name) % args.tp:
      p.error(f"--{name}={getattr(args, name)} must be divisible by TP={args.tp}")
  args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
  unknown = [c for c in args.checks if c not in KNOWN_CHECKS]
  if unknown or not args.checks:
    p.error(f"--checks: unknown {unknown}; choose from {KNOWN_CHECKS}")
  if args.fault is not None:
    args.fault = parse_fault(p, args)
  if args.json is not None and not args.worker:  # before the run, not after it
    from jax_distgemm._src import cli  # noqa: PLC0415  (imports JAX, starts no backend)
    cli.check_output_path(p, "--json", args.json)
  return args


def parse_fault(p, args) -> tuple[int, int, int]:
  """--fault P:I[:PHASE] as (P, I, PHASE), each checked against the job (usage errors)."""
  parts = args.fault.split(":")
  if len(parts) not in (2, 3) or not all(x.lstrip("-").isdigit() for x in parts):
    p.error(f"--fault must be P:I or P:I:PHASE (integers), got {args.fault!r}")
  fault, index, phase = tuple(int(x) for x in parts) + ((-1,) if len(parts) == 2 else ())
  if args.platform != "cpu" or args.implementation not in ("ffi", "auto") or args.timing_only:
    p.error("--fault is a hook of the CPU executor: it needs --platform cpu, --implementation "
            "ffi (or auto) and the checks (not --timing-only)")
  if args.tp < 2:
    p.error("--fault needs --tp >= 2 (the faulty device's peers must time out)")
  if not 0 <= fault < args.num_processes:
    p.error(f"--fault P={fault}: must be a process index in [0, {args.num_processes})")
  if not 0 <= index < args.devices_per_process:
    p.error(f"--fault I={index}: must be a local device index in [0, {args.devices_per_process})")
  # Barriers of the first check (the faulted one): AllGather 0..1, the ReduceScatter ring
  # 0..TP (its gather path only 0..1: such a fault never fires, which the launcher reports).
  first = args.checks[0]
  last = 1 if first.startswith("AllGather") else args.tp
  if not -1 <= phase <= last:
    p.error(f"--fault PHASE={phase}: {first} has barriers 0..{last} (-1: skip the whole call)")
  return fault, index, phase


# -- Worker -----------------------------------------------------------------------------------------

def emit(tag: str, **record) -> None:
  print(f"{tag} {json.dumps(record, sort_keys=True)}", flush=True)


def worker(args) -> int:
  import faulthandler  # noqa: PLC0415
  faulthandler.dump_traceback_later(args.timeout, exit=True)  # a hang dies with tracebacks

  import jax  # noqa: PLC0415
  if args.platform == "cpu":
    jax.config.update("jax_num_cpu_devices", args.devices_per_process)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the reference's collectives
  jax.distributed.initialize(
      args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
      initialization_timeout=max(int(args.timeout), 1),
      shutdown_timeout_seconds=max(int(args.timeout / 4), 5))

  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import jax_distgemm as jd  # noqa: PLC0415
  from jax_distgemm._src import multiprocess  # noqa: PLC0415

  try:
    me = jax.process_index()
  except (RuntimeError, AssertionError) as e:  # no backend of the platform (JAX_PLATFORMS)
    print(f"process {args.process_id}: no {args.platform} device visible "
          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
          f"{type(e).__name__} {e}", file=sys.stderr, flush=True)
    return 2
  if not args.skip_initialize:
    jd.initialize_multiprocess(timeout_s=args.timeout / 2)
    emit("JDG_TOKEN", process=me, token=multiprocess.state().token)

  devices = jax.devices()
  local = len(jax.local_devices())
  if len(devices) != args.num_processes * args.devices_per_process or local != args.devices_per_process:
    raise SystemExit(f"process {me}: expected {args.devices_per_process} local devices of "
                     f"{args.num_processes * args.devices_per_process}, got {local} of "
                     f"{len(devices)}")
  # (local index, process) order: consecutive TP ranks live in different processes; or, with
  # --tp-within-process, (process, local index): each TP group in one process.
  by_process = sorted(devices, key=lambda d: (d.process_index, d.id))
  per = args.devices_per_process
  ordered = by_process if args.tp_within_process else [
      by_process[p * per + i] for i in range(per) for p in range(args.num_processes)]
  tp, dp = args.tp, len(ordered) // args.tp
  mesh = jax.sharding.Mesh(np.array(ordered).reshape(dp, tp), ("dp", "tp"))
  groups = [[d.id for d in row] for row in mesh.devices]
  emit("JDG_MESH", process=me, groups=groups, local=[d.id for d in jax.local_devices()])

  dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[args.dtype]
  tol = TOL[args.dtype]
  timeout_ms = args.call_timeout_ms

  def specs(schedule):
    # The leading batch dim (size dp) is sharded over "dp"; w is shared.
    return jd.Schedule[schedule].partition_specs("tp", batch=("dp",))

  def global_array(data, spec):
    # Every process holds the same numpy data (same seed) and hands each device its block.
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx])

  def rand(rng, shape, scale=1.0):
    return np.asarray(jnp.asarray(rng.standard_normal(shape) * scale, dtype))

  def build(check, implementation):
    """(jitted fn, global operands, ref(batch slice, rows) -> float64 rows of the global output).

    The output's rows are independent, so the float64 reference is computed only for the rows
    checked (local_errors); x4 checks at GPU sizes would take minutes in numpy otherwise."""
    rng = np.random.default_rng(args.seed + KNOWN_CHECKS.index(check))
    m, n, k = args.m, args.n, args.k
    if check.endswith("@x4"):
      check, m, n, k = check[:-len("@x4")], 4 * m, 4 * n, 4 * k
    if "@repeat" in check:
      check, count = check.split("@repeat")[0], int(check.split("@repeat")[1])
      xs = rand(rng, (count, dp, m, k))
      w = rand(rng, (k, n), 1 / np.sqrt(k))
      x_spec, w_spec, out_spec = specs(check)
      op = jax.shard_map(
          lambda x, w, check=check: jd.distributed_matmul(
              x, w, axis_name="tp", schedule=check, implementation=implementation,
              timeout_ms=timeout_ms),
          mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
      weights = np.arange(1.0, count + 1.0)

      def program(xs, w):  # on global arrays: `count` calls of one shard_map'd op
        acc = sum(float(c) * op(xs[i], w).astype(jnp.float32) for i, c in enumerate(weights))
        return acc.astype(dtype)

      in_specs = (P(None, *x_spec), w_spec)

      def ref(b, rows):
        x_sum = np.tensordot(weights, np.asarray(xs[:, b][:, :, rows], np.float64), axes=1)
        return x_sum @ np.asarray(w, np.float64)
      arrays = tuple(global_array(a, s) for a, s in zip((xs, w), in_specs))
      return jax.jit(program), arrays, ref
    if check == MLP:
      hidden = n
      x = rand(rng, (dp, m, k))
      w1 = rand(rng, (k, hidden), 1 / np.sqrt(k))
      w2 = rand(rng, (hidden, n), 1 / np.sqrt(hidden))

      def body(x, w1, w2):
        h = jd.all_gather_matmul(x, w1, axis_name="tp", gathered="x",
                                 implementation=implementation, timeout_ms=timeout_ms)
        return jd.matmul_reduce_scatter(h, w2, axis_name="tp", scatter="rows",
                                        implementation=implementation, timeout_ms=timeout_ms)

      in_specs = (P("dp", "tp", None), P(None, "tp"), P("tp", None))
      out_spec = P("dp", "tp", None)
      operands = (x, w1, w2)

      def ref(b, rows):
        h = np.asarray(x[b][:, rows], np.float64) @ np.asarray(w1, np.float64)
        h = np.asarray(jnp.asarray(h, dtype), np.float64)  # the op rounds h to dtype
        return h @ np.asarray(w2, np.float64)
    else:
      x = rand(rng, (dp, m, k))
      w = rand(rng, (k, n), 1 / np.sqrt(k))
      x_spec, w_spec, out_spec = specs(check)

      def body(x, w):
        return jd.distributed_matmul(x, w, axis_name="tp", schedule=check,
                                     implementation=implementation, timeout_ms=timeout_ms)

      in_specs = (x_spec, w_spec)
      operands = (x, w)
      ref = lambda b, rows: np.asarray(x[b][:, rows], np.float64) @ np.asarray(w, np.float64)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
    arrays = tuple(global_array(a, s) for a, s in zip(operands, in_specs))
    return fn, arrays, ref

  def local_errors(out, ref_out, ref64):
    """Relative Frobenius errors of this process's output blocks: vs the reference
    implementation (every element) and vs float64 numpy (every row when the problem is small,
    else one row of every 128-row tile row, its position varying between tile rows)."""
    num_r = num_n = den_r = den = 0.0
    ref_blocks = {s.device.id: s for s in ref_out.addressable_shards}
    for s in out.addressable_shards:
      got = np.asarray(s.data, np.float64)
      want_r = np.asarray(ref_blocks[s.device.id].data, np.float64)
      num_r += float(np.sum((got - want_r) ** 2))
      den_r += float(np.sum(want_r ** 2))
      b, r, c = s.index
      lo, hi, _ = r.indices(out.shape[1])
      rows = np.arange(lo, hi)
      if out.shape[1] * out.shape[2] > 2**22:  # sample: one row per 128-row tile row
        rows = np.array([t + (t // 128 * 37) % min(128, hi - t) for t in range(lo, hi, 128)])
      want = ref64(b, rows)[..., c]
      num_n += float(np.sum((got[:, rows - lo] - want) ** 2))
      den += float(np.sum(want ** 2))
    return (num_r / max(den_r, 1e-300)) ** 0.5, (num_n / max(den, 1e-300)) ** 0.5

  ok = True
  def build_random(check, implementation):
    """(jitted fn, global operands drawn on the devices) of a single-schedule check."""
    m, n, k = args.m, args.n, args.k
    if check.endswith("@x4"):
      check, m, n, k = check[:-len("@x4")], 4 * m, 4 * n, 4 * k
    if check == MLP:
      raise SystemExit("--timing-only times the four schedules, not the MLP check")
    x_spec, w_spec, out_spec = specs(check)
    key = jax.random.key(args.seed + KNOWN_CHECKS.index(check))
    kx, kw = jax.random.split(key)
    draw = lambda key, shape, spec, scale: jax.jit(
        lambda: (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype),
        out_shardings=NamedSharding(mesh, spec))()
    x = draw(kx, (dp, m, k), x_spec, 1.0)
    w = draw(kw, (k, n), w_spec, 1 / np.sqrt(k))

    def body(x, w):
      return jd.distributed_matmul(x, w, axis_name="tp", schedule=check,
                                   implementation=implementation, timeout_ms=timeout_ms)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))
    return fn, (x, w)

  impl = None if args.implementation == "auto" else args.implementation
  if args.timing_only:
    for check in args.checks:
      fn, arrays = build_random(check, impl)
      emit("JDG_TIME", process=me, check=check, **time_calls(args, fn, arrays),
           hlo_fused_calls=fn.lower(*arrays).compile().as_text().count(
               'custom_call_target="jax_distgemm_v1"'))
    args.checks = []

  for check in args.checks:
    fn, arrays, ref64 = build(check, impl)
    ref_fn, _, _ = build(check, "reference")
    ref_out = ref_fn(*arrays)
    jax.block_until_ready(ref_out)
    hlo = fn.lower(*arrays).compile().as_text()
    fused = hlo.count('custom_call_target="jax_distgemm_v1"')
    for it in range(args.iterations):
      out = fn(*arrays)
      jax.block_until_ready(out)  # one call in flight at a time (XLA:CPU)
      err_ref, err_np = local_errors(out, ref_out, ref64)
      passed = bool(err_ref <= tol and err_np <= tol)
      ok &= passed
      emit("JDG_RESULT", process=me, check=check, iteration=it, rel_err_ref=err_ref,
           rel_err_np=err_np, tol=tol, ok=passed, fused_calls=fused,
           implementation=args.implementation)
    if args.fault and check == args.checks[0]:
      ok &= run_fault(args, me, fn, arrays, ref_out, ref64, local_errors, tol)
    if args.timing_iterations:
      emit("JDG_TIME", process=me, check=check, **time_calls(args, fn, arrays))

  # Nobody leaves (or tears down the coordinator) before everyone is done.
  from jax._src import distributed  # noqa: PLC0415
  client = distributed.global_state.client
  client.key_value_set(f"jdg_launch/pid/{me}", str(os.getpid()))
  client.wait_at_barrier("jdg_launch_done", int(args.timeout * 1000))
  sizes = {}
  modules = [jd.ffi._distgemm_cpu] + ([jd.ffi._distgemm_cuda] if jd.ffi._distgemm_cuda else [])
  for name in [n for module in modules for n in module.shm_segments()]:
    try:
      sizes[name] = os.stat("/dev/shm" + name).st_size
    except OSError:
      sizes[name] = -1
  emit("JDG_DONE", process=me, ok=ok, segments=len(sizes), segment_bytes=sizes)
  if args.no_exit_cleanup:
    # No atexit (no segment unlinking, no jax.distributed.shutdown), as after a crash.  Process 0
    # hosts the coordinator: it goes last, or the others' coordination agents see it vanish
    # and abort.
    if me == 0:
      peers = [int(client.blocking_key_value_get(f"jdg_launch/pid/{p}", 10_000))
               for p in range(1, args.num_processes)]
      deadline = time.monotonic() + 10
      while time.monotonic() < deadline and any(alive(pid) for pid in peers):
        time.sleep(0.02)
    sys.stdout.flush()
    os._exit(0 if ok else 1)
  return 0 if ok else 1


def time_calls(args, fn, arrays) -> dict:
  """Median ms per call over repeats of back-to-back calls and one block (after warm-up)."""
  import jax  # noqa: PLC0415
  for i in range(args.timing_warmup):
    out = fn(*arrays)
    if i % 20 == 19 or i + 1 == args.timing_warmup:  # never more than 20 calls in flight
      jax.block_until_ready(out)
  per_call = []
  for _ in range(args.timing_repeats):
    start = time.perf_counter()
    out = None
    for _ in range(args.timing_iterations):
      out = fn(*arrays)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / args.timing_iterations * 1e3)
  return {"median_ms": sorted(per_call)[len(per_call) // 2], "repeats_ms": per_call,
          "iterations": args.timing_iterations, "warmup": args.timing_warmup, "m": args.m,
          "n": args.n, "k": args.k, "dtype": args.dtype, "implementation": args.implementation}


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:  # a child the launcher has not reaped yet is gone too
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except OSError:
    return False


def run_fault(args, me, fn, arrays, ref_out, ref64, local_errors, tol) -> bool:
  """One call with the fault hook set in process P, then one healthy call."""
  import jax  # noqa: PLC0415
  from jax_distgemm.ffi import _distgemm_cpu  # noqa: PLC0415

  fault_process, index, phase = args.fault
  device = jax.local_devices()[index].id if me == fault_process else None
  if device is not None:
    _distgemm_cpu.set_fault_device(device, phase)
  start = time.monotonic()
  error = None
  try:
    jax.block_until_ready(fn(*arrays))
  except (jax.errors.JaxRuntimeError, ValueError) as e:  # multi-process CPU raises ValueError
    error = f"{type(e).__name__}: {e}"
  finally:
    _distgemm_cpu.set_fault_device(-1)
  elapsed = time.monotonic() - start
  out = fn(*arrays)
  jax.block_until_ready(out)
  err_ref, err_np = local_errors(out, ref_out, ref64)
  recovered = bool(err_ref <= tol and err_np <= tol)
  emit("JDG_FAULT", process=me, faulty_process=fault_process, fault_device=device, error=error,
       elapsed_s=elapsed, recovered=recovered, rel_err_ref=err_ref, rel_err_np=err_np)
  return recovered


# -- Launcher -------------------------------------------------------------------------------------

def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_args(args, process_id: int, coordinator: str) -> list[str]:
  out = [sys.executable, os.path.abspath(__file__), "--worker", f"--process-id={process_id}",
         f"--coordinator={coordinator}", f"--num-processes={args.num_processes}",
         f"--devices-per-process={args.devices_per_process}", f"--platform={args.platform}",
         f"--tp={args.tp}", f"--m={args.m}", f"--n={args.n}", f"--k={args.k}",
         f"--dtype={args.dtype}", f"--implementation={args.implementation}",
         f"--iterations={args.iterations}", f"--timing-iterations={args.timing_iterations}",
         f"--timing-repeats={args.timing_repeats}", f"--timing-warmup={args.timing_warmup}",
         f"--checks={','.join(args.checks)}", f"--timeout={args.timeout}", f"--seed={args.seed}"]
  if args.call_timeout_ms is not None:
    out.append(f"--call-timeout-ms={args.call_timeout_ms}")
  if args.fault:
    out.append("--fault=" + ":".join(str(v) for v in args.fault))
  if args.no_exit_cleanup:
    out.append("--no-exit-cleanup")
  if args.skip_initialize:
    out.append("--skip-initialize")
  if args.tp_within_process:
    out.append("--tp-within-process")
  if args.timing_only:
    out.append("--timing-only")
  return out


def kill(procs) -> None:
  """SIGTERM, then SIGKILL after 5 s, to each child's process group (children only)."""
  for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
      try:
        os.killpg(p.pid, sig)  # each child leads its own session (start_new_session)
      except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
      time.sleep(0.05)


def records(lines, tag):
  out = []
  for line in lines:
    if line.startswith(tag + " "):
      out.append(json.loads(line[len(tag) + 1:]))
  return out


def fault_failures(args, lines) -> list[str]:
  """What the --fault run did not do (empty: all of it): a JDG_FAULT record from every process,
  DEADLINE_EXCEEDED in every process that holds a TP peer of the faulty device, and a correct
  call after it everywhere."""
  faults = {f["process"]: f for f in records(lines, "JDG_FAULT")}
  missing = sorted(set(range(args.num_processes)) - set(faults))
  if missing:
    return [f"no fault record from processes {missing}"]
  device = faults[args.fault[0]]["fault_device"]
  meshes = {m["process"]: m for m in records(lines, "JDG_MESH")}
  group = next((g for m in meshes.values() for g in m["groups"] if device in g), None)
  if group is None:
    return [f"the faulty device {device} is in no TP group of the mesh"]
  peers = sorted(p for p, m in meshes.items() if set(m["local"]) & (set(group) - {device}))
  out = [f"process {p} holds a TP peer of device {device} but saw no DEADLINE_EXCEEDED (the "
         "fault did not fire)" for p in peers if "DEADLINE_EXCEEDED" not in (
             faults[p]["error"] or "")]
  out += [f"process {p}: the call after the fault was wrong" for p, f in sorted(faults.items())
          if not f["recovered"]]
  return out


def visible_gpus() -> int | None:
  """GPUs nvidia-smi lists (CUDA_VISIBLE_DEVICES aside), or None where it cannot tell."""
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30,
                         check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if (
      out.returncode == 0) else 0


def launch(args) -> int:
  if args.platform == "gpu":
    need, have = args.num_processes * args.devices_per_process, visible_gpus()
    if have is not None and have < need:
      print(f"--platform gpu: {args.num_processes} process(es) x {args.devices_per_process} "
            f"GPU(s) need {need} GPUs, nvidia-smi lists {have}; nothing launched",
            file=sys.stderr)
      return 2
  coordinator = f"127.0.0.1:{free_port()}"
  env = dict(os.environ)
  env["PYTHONUNBUFFERED"] = "1"
  print(f"Launching {args.num_processes} processes ({args.platform}, "
        f"{args.devices_per_process} device(s) each), coordinator {coordinator}, TP={args.tp}, "
        f"M={args.m} N={args.n} K={args.k} {args.dtype}, implementation={args.implementation}",
        flush=True)
  procs, outputs, readers = [], [], []
  print_lock = threading.Lock()
  start = time.monotonic()
  try:
    for i in range(args.num_processes):
      cenv = dict(env)
      if args.platform == "cpu":
        cenv["JAX_PLATFORMS"] = "cpu"
      else:
        cenv["JAX_PLATFORMS"] = "cuda"
        per = args.devices_per_process
        cenv["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * per + j) for j in range(per))
      p = subprocess.Popen(child_args(args, i, coordinator), env=cenv, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
      procs.append(p)
      lines: list[str] = []
      outputs.append(lines)

      def pump(p=p, lines=lines, i=i):
        for line in p.stdout:
          line = line.rstrip("\n")
          lines.append(line)
          with print_lock:  # whole lines: the test parses them
            sys.stdout.write(f"[p{i}] {line}\n")
            sys.stdout.flush()

      t = threading.Thread(target=pump, daemon=True)
      t.start()
      readers.append(t)
    failure = None
    while True:
      codes = [p.poll() for p in procs]
      bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if bad:
        failure = f"process {bad[0][0]} exited with code {bad[0][1]}"
        break
      if all(c == 0 for c in codes):
        break
      if time.monotonic() - start > args.timeout:
        failure = f"timed out after {args.timeout:g} s"
        break
      time.sleep(0.05)
  finally:
    kill(procs)  # no-op for children that have exited
    for t in readers:
      t.join(timeout=5)
  elapsed = time.monotonic() - start
  if failure:
    print(f"FAILED: {failure}; killed the remaining processes", flush=True)

  all_lines = [line for lines in outputs for line in lines]
  results = records(all_lines, "JDG_RESULT")
  ok = failure is None
  if not args.timing_only:
    print(f"\n{'check':38s} {'max rel err vs reference':>25s} {'vs float64':>12s}  processes")
  for check in ([] if args.timing_only else args.checks):
    rs = [r for r in results if r["check"] == check]
    seen = sorted({r["process"] for r in rs})
    complete = seen == list(range(args.num_processes)) and len(rs) == (
        args.num_processes * args.iterations)
    check_ok = complete and all(r["ok"] for r in rs)
    ok &= check_ok
    if rs:
      print(f"{check:38s} {max(r['rel_err_ref'] for r in rs):25.3e} "
            f"{max(r['rel_err_np'] for r in rs):12.3e}  {seen} {'ok' if check_ok else 'FAILED'}")
    else:
      print(f"{check:38s} {'(no result)':>25s}")
  times = records(all_lines, "JDG_TIME")
  for t in times:
    print(f"time: process {t['process']} {t['check']}: {t['median_ms']:.3f} ms/call (median of "
          f"{len(t['repeats_ms'])} x {t['iterations']} calls)")
  if args.timing_only:
    for check in args.checks:
      seen = sorted({t["process"] for t in times if t["check"] == check})
      if seen != list(range(args.num_processes)):
        print(f"FAILED: {check}: no time from processes {sorted(set(range(args.num_processes)) - set(seen))}")
        ok = False
  for f in records(all_lines, "JDG_FAULT"):
    print(f"fault: process {f['process']}: error={'yes' if f['error'] else 'no'} after "
          f"{f['elapsed_s']:.2f} s, next call {'correct' if f['recovered'] else 'WRONG'}")
  if args.fault and failure is None:
    for why in fault_failures(args, all_lines):
      print(f"FAILED: --fault: {why}")
      ok = False

  # Shared memory: a clean exit leaves nothing; remove whatever is left either way.
  tokens = sorted({r["token"] for r in records(all_lines, "JDG_TOKEN")})
  leftovers = []
  for token in tokens:
    prefix = f"jdg_{token}_"
    try:
      leftovers += [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except FileNotFoundError:
      pass
  if args.no_exit_cleanup:
    kept = "kept: --no-exit-cleanup, for a stale-segment sweep"
  else:
    kept = "removed"
    for name in leftovers:
      try:
        os.unlink(os.path.join("/dev/shm", name))
      except FileNotFoundError:
        pass
  print(f"job token(s): {tokens}; shared-memory segments left by the workers: {len(leftovers)} "
        f"({kept})")
  if leftovers and not args.no_exit_cleanup and failure is None:
    print("FAILED: the workers exited cleanly but left shared-memory segments")
    ok = False
  if args.json:  # after every check: the final verdict
    try:
      with open(args.json, "w") as f:
        json.dump({"num_processes": args.num_processes, "devices_per_process":
                   args.devices_per_process, "tp": args.tp, "platform": args.platform,
                   "times": times, "ok": ok}, f, indent=1)
    except OSError as e:  # parse_args checked the path; it can still go (a full disk, rm -r)
      print(f"FAILED: --json: cannot write {args.json}: {e}")
      ok = False
  print(f"elapsed: {elapsed:.1f} s")
  print(f"Disposition: {'Passed' if ok else 'Failed'}")
  return 0 if ok else 1


def main(argv=None) -> int:
  args = parse_args(argv)
  return worker(args) if args.worker else launch(args)


if __name__ == "__main__":
  sys.exit(main())

"""Multi-process CPU runs: TP groups spanning processes, through tests/multiprocess_launcher.py.

Each case launches a jax.distributed job of several processes on this machine (coordinator on
127.0.0.1, JAX_PLATFORMS=cpu), in which every process calls jax_distgemm.initialize_multiprocess()
and runs the four schedules, a two-op MLP block and two schedules again at 4x the size (their
shared-memory segments must grow) with implementation="ffi" on a mesh over the devices of all
processes; the CPU executor meets the members of each TP group through POSIX
shared memory (cc/common/shm_exchange.h).  Every process checks its output blocks against
implementation="reference" (same program) and float64 numpy; this test re-checks what each
process reports, that the program really holds our custom call, and that the job leaves no
shared-memory segment behind.

Bounded: the launcher kills its workers after --timeout (and each worker dies with tracebacks
at the same bound); this test kills the launcher after a larger one.  A job that cannot start
(jax.distributed, ports, /dev/shm) fails the test with the launcher's output.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import struct
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import jax_distgemm as jd
from jax_distgemm.ffi import _distgemm_cpu

try:
  from tests import multiprocess_launcher as _launcher
except ImportError:
  import multiprocess_launcher as _launcher

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
LAUNCHER = os.path.abspath(_launcher.__file__)
# The check names the launcher understands (one source of truth: the launcher).
SCHEDULES, MLP, GROWN = _launcher.SCHEDULES, _launcher.MLP, _launcher.GROWN
REPEATED = _launcher.REPEATED
SEGMENT_GRANULE = 4096 + (64 << 10)  # header + the first data step of a segment
LAUNCH_TIMEOUT_S = 90   # the launcher's own bound on its workers
TEST_TIMEOUT_S = 120    # this test's bound on the launcher
LINE = re.compile(r"^\[p(\d+)\] (JDG_[A-Z]+) (\{.*\})$")

# Multi-process jobs: the slow tier (`-m "not slow"` leaves the module out).
pytestmark = pytest.mark.slow


def launch(*args: str, env_extra: dict[str, str] | None = None):
  """Runs the launcher (with `env_extra` added to a JAX_DISTGEMM_-free environment); returns
  (returncode, output, {tag: [records]})."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_DISTGEMM_")}
  env.update(env_extra or {})
  env["PYTHONSAFEPATH"] = "1"  # workers import the installed package, not the source tree
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, LAUNCHER, f"--timeout={LAUNCH_TIMEOUT_S}", *args], cwd=REPO, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TEST_TIMEOUT_S,
      check=False)
  records: dict[str, list[dict]] = {}
  for line in proc.stdout.splitlines():
    m = LINE.match(line)
    if m:
      records.setdefault(m.group(2), []).append(json.loads(m.group(3)))
  return proc.returncode, proc.stdout, records


def shm_files(token: str) -> list[str]:
  return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"jdg_{token}_"))


class MultiprocessTest(parameterized.TestCase):

  def token_of(self, records, out) -> str:
    tokens = {r["token"] for r in records.get("JDG_TOKEN", [])}
    self.assertLen(tokens, 1, out[-4000:])  # one job token, agreed by every process
    return tokens.pop()

  def assert_passed(self, rc, out, records, *, num_processes, iterations, checks, tol,
                    grown=False, cross_process=True):
    tail = out[-6000:]
    self.assertEqual(rc, 0, tail)
    self.assertIn("Disposition: Passed", out)
    results = records.get("JDG_RESULT", [])
    for check in checks:
      for p in range(num_processes):
        rs = [r for r in results if r["check"] == check and r["process"] == p]
        self.assertLen(rs, iterations, f"{check}, process {p}:\n{tail}")
        for r in rs:
          self.assertTrue(r["ok"], r)
          self.assertLessEqual(r["rel_err_ref"], tol, r)
          self.assertLessEqual(r["rel_err_np"], tol, r)
          # The FFI custom call is in the program (not a fallback): one per op.
          want = 2 if check == MLP else int(check.split("@repeat")[1]) if "@repeat" in check else 1
          self.assertEqual(r["fused_calls"], want, r)
    done = records.get("JDG_DONE", [])
    self.assertLen(done, num_processes, tail)
    for d in done:
      self.assertTrue(d["ok"], d)
      # The cross-process path ran (shm segments), or with process-local groups none did.
      if cross_process:
        self.assertGreater(d["segments"], 0, d)
      else:
        self.assertEqual(d["segments"], 0, d)
      if grown:  # the 4x problems made a segment of a reused call site grow
        self.assertGreater(max(d["segment_bytes"].values()), SEGMENT_GRANULE, d)
    # Clean exit: every worker unlinked its segments (the launcher found none to remove).
    self.assertIn("shared-memory segments left by the workers: 0 ", out)
    if cross_process:
      self.assertEqual(shm_files(self.token_of(records, out)), [])

  def assert_groups_span_processes(self, records, out, expected_groups):
    meshes = records.get("JDG_MESH", [])
    self.assertNotEmpty(meshes, out[-4000:])
    locals_ = {m["process"]: set(m["local"]) for m in meshes}
    for m in meshes:
      self.assertEqual(m["groups"], expected_groups)
      for group in m["groups"]:
        owners = {p for p, ids in locals_.items() for d in group if d in ids}
        self.assertLen(owners, len(locals_), f"group {group} does not span every process")

  @parameterized.named_parameters(
      # (processes, CPU devices per process, TP, dtype, expected TP groups (global ids))
      ("2_processes_x_1_device", 2, 1, None, "fp32", [[0, 2048]]),
      ("2_processes_x_2_devices_tp4", 2, 2, None, "fp32", [[0, 2048, 1, 2049]]),
      ("2_processes_x_2_devices_two_tp2_groups", 2, 2, 2, "fp32", [[0, 2048], [1, 2049]]),
      ("3_processes_bf16", 3, 1, None, "bf16", [[0, 2048, 4096]]),
  )
  def test_every_schedule_matches_reference(self, processes, per, tp, dtype, groups):
    args = [f"--num-processes={processes}", f"--devices-per-process={per}", f"--dtype={dtype}",
            "--iterations=2"]
    if tp:
      args.append(f"--tp={tp}")
    rc, out, records = launch(*args)
    self.assert_groups_span_processes(records, out, groups)
    self.assert_passed(rc, out, records, num_processes=processes, iterations=2,
                       checks=SCHEDULES + (MLP,) + GROWN, tol=1e-2 if dtype == "bf16" else 1e-3,
                       grown=True)

  def test_repeated_op_call_sites_meet_across_processes(self):
    # 12 calls of one shard_map'd op in one program share a call_id (JAX lowers the op once);
    # each process keys them by the index of the instruction's instantiate-stage state, which
    # must agree between the processes (both build the same executables in the same order).
    rc, out, records = launch("--num-processes=2", "--devices-per-process=2",
                              f"--checks={','.join(REPEATED)}", "--iterations=3")
    self.assert_passed(rc, out, records, num_processes=2, iterations=3, checks=REPEATED,
                       tol=1e-3)

  def test_peer_process_skips_a_call_times_out_then_recovers(self):
    """Process 1's device skips one call: process 0 fails at the timeout naming the phase and
    the missing rank (and its device), never hangs, and the next call is correct everywhere.
    The workers then end like a crash (no atexit): their segments stay, and the stale-segment
    sweep removes them.

    1 s rather than 300 ms: the skipping process races ahead into the next call, whose start
    waits up to twice the timeout for process 0 to leave the skipped one; process 0 must reach
    the skipped call within one timeout of process 1, which a loaded 2-core box may stretch."""
    timeout_ms = 1000
    rc, out, records = launch("--num-processes=2", "--fault=1:0", f"--call-timeout-ms={timeout_ms}",
                              f"--checks={SCHEDULES[0]}", "--iterations=1", "--no-exit-cleanup")
    tail = out[-6000:]
    self.assertEqual(rc, 0, tail)
    self.assertIn("Disposition: Passed", out)
    faults = {f["process"]: f for f in records.get("JDG_FAULT", [])}
    self.assertEqual(sorted(faults), [0, 1], tail)
    err = faults[0]["error"]
    self.assertIsNotNone(err, tail)
    self.assertIn("DEADLINE_EXCEEDED: jax_distgemm: CPU executor, device 0: rank 0 of 2", err)
    self.assertIn(f"timed out after {timeout_ms} ms waiting for peers at pointer exchange", err)
    self.assertRegex(err, r"missing ranks: 1\.")
    self.assertIn("the missing ranks are devices [2048]", err)
    self.assertIn("JAX_DISTGEMM_TIMEOUT_MS", err)
    self.assertGreaterEqual(faults[0]["elapsed_s"], timeout_ms / 1000 * 0.9)
    self.assertLess(faults[0]["elapsed_s"], 20.0)
    self.assertIsNone(faults[1]["error"])  # the skipping device itself returns at once
    for f in faults.values():
      self.assertTrue(f["recovered"], f)  # the next call is correct in both processes
    # os._exit left the segments; their owners are gone, so the sweep removes them all.
    token = self.token_of(records, out)
    left = shm_files(token)
    self.assertNotEmpty(left, "--no-exit-cleanup should have left the workers' segments")
    swept = _distgemm_cpu.sweep_stale_shm_segments()
    self.assertContainsSubset(["/" + n for n in left], swept)
    self.assertEqual(shm_files(token), [])

  def test_peer_lost_mid_schedule_both_processes_see_the_timeout(self):
    """TP=4 over 2 processes x 2 devices: device 2049 (rank 3) stops before the ReduceScatter
    stage-1 barrier; the waiting ranks, in both processes, name stage 1 and rank 3."""
    timeout_ms = 300
    rc, out, records = launch("--num-processes=2", "--devices-per-process=2", "--fault=1:1:2",
                              f"--call-timeout-ms={timeout_ms}", f"--checks={SCHEDULES[3]}",
                              "--iterations=1")
    tail = out[-6000:]
    self.assertEqual(rc, 0, tail)
    faults = {f["process"]: f for f in records.get("JDG_FAULT", [])}
    self.assertEqual(sorted(faults), [0, 1], tail)
    for f in faults.values():
      self.assertIsNotNone(f["error"], f)
      self.assertIn("DEADLINE_EXCEEDED", f["error"])
      self.assertIn(f"timed out after {timeout_ms} ms waiting for peers at stage 1", f["error"])
      self.assertRegex(f["error"], r"missing ranks: 3\.")
      self.assertIn("the missing ranks are devices [2049]", f["error"])
      self.assertLess(f["elapsed_s"], 20.0)
      self.assertTrue(f["recovered"], f)
    self.assertIn("shared-memory segments left by the workers: 0 ", out)
    self.assertEqual(shm_files(self.token_of(records, out)), [])

  def test_rs_gather_across_processes(self):
    """JAX_DISTGEMM_RS_PATH=gather (ReduceScatter TilingA by gathering operands) with TP=4 over
    2 processes x 2 devices: device 2049 (rank 3) stops before the path's closing barrier (its
    second of two), so the waiting ranks in both processes name that barrier, whose message
    says the path ran; the call after it is correct everywhere, as are the healthy ones."""
    timeout_ms = 300
    rc, out, records = launch("--num-processes=2", "--devices-per-process=2", "--fault=1:1:1",
                              f"--call-timeout-ms={timeout_ms}", f"--checks={SCHEDULES[2]}",
                              "--iterations=2", env_extra={"JAX_DISTGEMM_RS_PATH": "gather"})
    tail = out[-6000:]
    self.assertEqual(rc, 0, tail)
    self.assertIn("Disposition: Passed", out)
    faults = {f["process"]: f for f in records.get("JDG_FAULT", [])}
    self.assertEqual(sorted(faults), [0, 1], tail)
    for f in faults.values():
      self.assertIsNotNone(f["error"], f)
      self.assertIn(f"timed out after {timeout_ms} ms waiting for peers at the closing barrier "
                    "(peers still reading this x and w)", f["error"])
      self.assertRegex(f["error"], r"missing ranks: 3\.")
      self.assertTrue(f["recovered"], f)

  def test_timing_only_mode_times_every_schedule_in_every_process(self):
    """--timing-only (what gpu_check.sh runs at the seed shape): operands drawn on the devices,
    no checks, a JDG_TIME record per schedule and process with the median of the repeats, and
    the same records in --json."""
    with tempfile.TemporaryDirectory() as tmp:
      json_path = os.path.join(tmp, "times.json")
      rc, out, records = launch("--num-processes=2", "--timing-only", "--timing-iterations=3",
                                "--timing-repeats=3", "--timing-warmup=21",
                                f"--checks={','.join(SCHEDULES)}", f"--json={json_path}")
      saved = None
      if os.path.exists(json_path):
        with open(json_path) as f:
          saved = json.load(f)
    self.assertEqual(rc, 0, out[-4000:])
    self.assertIn("Disposition: Passed", out)
    self.assertNotIn("JDG_RESULT", out)  # no correctness checks in this mode
    times = records.get("JDG_TIME", [])
    self.assertCountEqual([(t["check"], t["process"]) for t in times],
                          [(c, p) for c in SCHEDULES for p in range(2)])
    for t in times:
      self.assertLen(t["repeats_ms"], 3)
      self.assertEqual(t["warmup"], 21)  # passed on to every worker
      self.assertEqual(t["median_ms"], sorted(t["repeats_ms"])[1])
      self.assertEqual(t["hlo_fused_calls"], 1, t)  # our custom call was timed
    self.assertIsNotNone(saved, "--json wrote nothing")
    self.assertTrue(saved["ok"])
    self.assertEqual(saved["num_processes"], 2)
    self.assertCountEqual([json.dumps(t, sort_keys=True) for t in saved["times"]],
                          [json.dumps(t, sort_keys=True) for t in times])

  def test_fault_that_never_fires_fails_the_run(self):
    # The gather path of ReduceScatter TilingA has barriers 0..1 only: a fault before barrier 2
    # never fires, so no peer times out, which must fail the run, not pass it.
    rc, out, records = launch("--num-processes=2", "--fault=1:0:2", "--call-timeout-ms=1000",
                              f"--checks={SCHEDULES[2]}", "--iterations=1",
                              env_extra={"JAX_DISTGEMM_RS_PATH": "gather"})
    self.assertEqual(rc, 1, out[-4000:])
    self.assertLen(records.get("JDG_FAULT", []), 2, out[-4000:])
    self.assertIn("FAILED: --fault: process 0 holds a TP peer of device 2048 but saw no "
                  "DEADLINE_EXCEEDED (the fault did not fire)", out)
    self.assertIn("Disposition: Failed", out)

  def test_without_initialize_multiprocess_the_ffi_path_is_refused(self):
    rc, out, _ = launch("--num-processes=2", f"--checks={SCHEDULES[0]}", "--skip-initialize")
    self.assertNotEqual(rc, 0, out[-4000:])
    self.assertIn("Disposition: Failed", out)
    self.assertIn("spans processes (devices [2048] are not addressable by this process)", out)
    self.assertIn("needs jax_distgemm.initialize_multiprocess() after "
                  "jax.distributed.initialize()", out)

  @parameterized.parameters("ffi", "auto")
  def test_tp_within_each_process_needs_no_initialize(self, implementation):
    # The multi-host layout: each TP group inside one process, "dp" across processes (XLA's
    # collectives there).  The executor meets a process-local group in-process: the fused call
    # runs (None picks it too) without initialize_multiprocess() and without shared memory.
    rc, out, records = launch("--num-processes=2", "--devices-per-process=2", "--tp=2",
                              "--tp-within-process", "--skip-initialize", "--iterations=2",
                              f"--implementation={implementation}")
    self.assertEqual([m["groups"] for m in records.get("JDG_MESH", [])],
                     [[[0, 1], [2048, 2049]]] * 2, out[-4000:])
    self.assert_passed(rc, out, records, num_processes=2, iterations=2,
                       checks=SCHEDULES + (MLP,) + GROWN, tol=1e-3, cross_process=False)

  def test_without_initialize_multiprocess_auto_runs_the_ring(self):
    # implementation=None where the executor cannot meet the group: the XLA ring is lowered in
    # place of the custom call (with a warning naming the reason), and the results are right.
    rc, out, records = launch("--num-processes=2", f"--checks={','.join(SCHEDULES)}",
                              "--skip-initialize", "--implementation=auto")
    self.assertEqual(rc, 0, out[-4000:])
    self.assertIn("Disposition: Passed", out)
    self.assertIn("implementation=None runs the XLA ring here, not the fused call: "
                  "axis_name: the TP group", out)
    results = records.get("JDG_RESULT", [])
    self.assertCountEqual({(r["check"], r["process"]) for r in results},
                          {(c, p) for c in SCHEDULES for p in range(2)})
    for r in results:
      self.assertTrue(r["ok"], r)
      self.assertEqual(r["fused_calls"], 0, r)  # the ring, not our custom call


class LauncherJsonTest(absltest.TestCase):
  """--json is checked up front and holds the final verdict (gpu_check.sh reads it)."""

  def launch(self, *args):
    return launch("--checks=AllGather1D_TilingCD_RotatingA", *args)

  def test_bad_json_path_is_a_usage_error_before_the_run(self):
    with tempfile.TemporaryDirectory() as d:
      for path, why in ((os.path.join(d, "missing", "mp.json"), "does not exist"),
                        (d, "is a directory")):
        with self.subTest(path=path):
          rc, out, _ = self.launch("--timing-iterations=2", f"--json={path}")
          self.assertEqual(rc, 2, out)
          self.assertIn(f"--json: {path}", out)
          self.assertIn(why, out)
          self.assertNotIn("Traceback", out)
          self.assertNotIn("Launching", out)  # nothing ran

  def test_json_holds_the_final_verdict(self):
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "mp.json")
      # A fault that never fires (no shared-memory exchange without initialize_multiprocess:
      # auto runs the ring) fails the run only after the checks: the JSON must say so.
      rc, out, _ = self.launch("--skip-initialize", "--implementation=auto", "--fault=1:0",
                               "--timing-iterations=2", "--call-timeout-ms=2000",
                               f"--json={path}")
      self.assertEqual(rc, 1, out[-4000:])
      self.assertIn("FAILED: --fault:", out)
      self.assertIn("Disposition: Failed", out)
      with open(path) as f:
        self.assertIs(json.load(f)["ok"], False)
      rc, out, _ = self.launch("--timing-iterations=2", f"--json={path}")
      self.assertEqual(rc, 0, out[-4000:])
      self.assertIn("Disposition: Passed", out)
      with open(path) as f:
        saved = json.load(f)
      self.assertIs(saved["ok"], True)
      self.assertLen(saved["times"], 2)  # one per process


class LauncherFlagsTest(parameterized.TestCase):
  """Flags out of range are usage errors (exit 2) naming the flag, before anything runs."""

  @parameterized.parameters(
      ("--call-timeout-ms=0", "--call-timeout-ms must be in [1, 2147483647], got 0"),
      ("--tp-within-process", "--tp-within-process: --tp=2 must divide --devices-per-process=1"),
      ("--call-timeout-ms=-5", "--call-timeout-ms must be in [1, 2147483647], got -5"),
      ("--fault=5:0", "--fault P=5: must be a process index in [0, 2)"),
      ("--fault=0:7", "--fault I=7: must be a local device index in [0, 1)"),
      ("--fault=1:0:99", "--fault PHASE=99: AllGather1D_TilingCD_RotatingA has barriers 0..1"),
      ("--fault=1:x", "--fault must be P:I or P:I:PHASE (integers), got '1:x'"),
      ("--timeout=nan", "--timeout must be a number of seconds in (0, 1e+06], got nan"),
      ("--timeout=0", "--timeout must be a number of seconds in (0, 1e+06], got 0.0"),
      ("--timeout=-1", "--timeout must be a number of seconds in (0, 1e+06], got -1.0"),
      ("--iterations=0", "--iterations must be >= 1, got 0"),
      ("--tp=0", "--tp=0 must be >= 1 and divide the 2 devices"),
      ("--m=0", "--m must be >= 1, got 0"),
      ("--k=-3", "--k must be >= 1, got -3"),
      ("--seed=-1", "--seed must be in [0, 2**31), got -1"),
  )
  def test_bad_flag_is_a_usage_error(self, flag, message):
    rc, out, _ = launch("--num-processes=2", f"--checks={SCHEDULES[0]}", "--iterations=1", flag)
    self.assertEqual(rc, 2, out[-4000:])
    self.assertIn(f"error: {message}", out)
    self.assertNotIn("Launching", out)


# A 2-process job (1 CPU device each) for SetupTest: process 0 calls initialize_multiprocess()
# (again after a failure, in mode "late") and prints a JDG_SETUP record; process 1 never calls it
# ("absent"), answers only the key-value exchange and never starts its backend ("no_backend"),
# or calls it once process 0's first attempt has failed ("late").
_SETUP_WORKER = r"""
import json, os, sys, time
import jax
mode, me, coordinator = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_num_cpu_devices", 1)
jax.distributed.initialize(coordinator, num_processes=2, process_id=me, initialization_timeout=60)
from jax._src import distributed
import jax_distgemm as jd
from jax_distgemm._src import multiprocess
client = distributed.global_state.client
if me == 1:
  if mode == "no_backend":
    client.key_value_set(multiprocess._KEY + "/host/1", "elsewhere")
  if mode == "late":
    client.blocking_key_value_get("setup_test/retry", 60_000)
    jd.initialize_multiprocess(timeout_s=60)
    print("JDG_SETUP", json.dumps({"process": 1, "token": multiprocess.state().token}), flush=True)
  client.blocking_key_value_get("setup_test/done", 60_000)
  os._exit(0)
attempts = []
for timeout_s in (1, 60) if mode == "late" else (2,):
  start, error = time.monotonic(), None
  try:
    jd.initialize_multiprocess(timeout_s=timeout_s)
  except RuntimeError as e:
    error = str(e)
  attempts.append({"timeout_s": timeout_s, "elapsed_s": time.monotonic() - start, "error": error})
  if error is None:
    break
  client.key_value_set("setup_test/retry", "1")
state = multiprocess.state()
print("JDG_SETUP", json.dumps({"process": 0, "attempts": attempts, "token": state and state.token}),
      flush=True)
client.key_value_set("setup_test/done", "1")
time.sleep(1)  # process 1 leaves first: this one hosts the coordinator
os._exit(0)
"""


class SetupTest(parameterized.TestCase):

  def test_initialize_multiprocess_needs_jax_distributed(self):
    with self.assertRaisesRegex(RuntimeError, re.escape("call jax.distributed.initialize() first")):
      jd.initialize_multiprocess()

  @parameterized.parameters(float("nan"), float("inf"), -float("inf"), 0, -1, 0.0, 1e30)
  def test_initialize_multiprocess_rejects_a_bad_timeout(self, timeout_s):
    with self.assertRaisesRegex(ValueError, r"initialize_multiprocess: timeout_s: must be "):
      jd.initialize_multiprocess(timeout_s=timeout_s)

  @parameterized.parameters((True,), ("60",), (None,), ([60],))
  def test_initialize_multiprocess_rejects_a_timeout_of_another_type(self, timeout_s):
    with self.assertRaisesRegex(TypeError, r"initialize_multiprocess: timeout_s: must be a number "
                                r"of seconds, got "):
      jd.initialize_multiprocess(timeout_s=timeout_s)

  @parameterized.parameters(1e-6, 1, 2147483.647)
  def test_initialize_multiprocess_accepts_a_timeout_in_range(self, timeout_s):
    # Past the check: the next requirement is jax.distributed.
    with self.assertRaisesRegex(RuntimeError, re.escape("call jax.distributed.initialize() first")):
      jd.initialize_multiprocess(timeout_s=timeout_s)

  def run_setup_job(self, mode):
    """Runs _SETUP_WORKER's 2 processes; process 0's JDG_SETUP record (and process 1's)."""
    coordinator = f"127.0.0.1:{_launcher.free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_DISTGEMM_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONSAFEPATH="1")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-c", _SETUP_WORKER, mode, str(i), coordinator],
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for i in range(2)]
    outs = []
    for p in procs:
      try:
        outs.append(p.communicate(timeout=60)[0])  # the old unbounded wait was 2 min
      except subprocess.TimeoutExpired:
        for q in procs:
          if q.poll() is None:
            os.killpg(q.pid, 9)
        outs.append(p.communicate()[0])
        self.fail(f"mode {mode}: the setup job hung:\n" + "\n".join(outs)[-4000:])
    found = {}
    for line in "\n".join(outs).splitlines():
      if line.startswith("JDG_SETUP "):
        record = json.loads(line[len("JDG_SETUP "):])
        found[record["process"]] = record
    self.assertIn(0, found, "\n".join(outs)[-4000:])
    return found

  @parameterized.parameters(
      ("absent", "could not agree on the job token with the other processes within 2 s "
       "(does every process call initialize_multiprocess()?): DEADLINE_EXCEEDED"),
      ("no_backend", "process 0 of 2: JAX's backend did not start within 2 s (its start waits "
       "for every process of the job"))
  def test_initialize_multiprocess_bounds_its_wait_for_a_missing_process(self, mode, message):
    # Every step, the start of JAX's backend too (an exchange with every process, which JAX
    # bounds only by 2 min), is bounded by timeout_s.
    (attempt,) = self.run_setup_job(mode)[0]["attempts"]
    self.assertIsNotNone(attempt["error"], attempt)
    self.assertIn("jax_distgemm.initialize_multiprocess: ", attempt["error"])
    self.assertIn(message, attempt["error"])
    self.assertGreaterEqual(attempt["elapsed_s"], 2 * 0.9)
    self.assertLess(attempt["elapsed_s"], 15.0)

  def test_initialize_multiprocess_retried_meets_a_late_process(self):
    found = self.run_setup_job("late")
    first, second = found[0]["attempts"]
    self.assertIn("within 1 s", first["error"] or "", first)
    self.assertIsNone(second["error"], second)
    self.assertIn(1, found)
    self.assertEqual(found[0]["token"], found[1]["token"])  # the nonce of the first attempt


class StaleSweepTest(absltest.TestCase):
  """sweep_stale_shm_segments removes a segment only when it is ours (magic), from this PID
  namespace, and its owner process is gone.  Headers are written by hand here, with the layout
  of cc/common/shm_exchange.cc (magic u64, version u32, owner pid i32, pid namespace u64)."""

  MAGIC = 0x316d68736d67646a

  def make(self, *, magic=MAGIC, pid, pid_ns=None) -> str:
    name = f"jdg_sweeptest{secrets.token_hex(6)}_0_1_r0"
    ns = os.stat("/proc/self/ns/pid").st_ino if pid_ns is None else pid_ns
    with open(os.path.join("/dev/shm", name), "wb") as f:
      f.write(struct.pack("<QIiQ", magic, 1, pid, ns).ljust(4096, b"\0"))
    self.addCleanup(lambda: os.path.exists(f"/dev/shm/{name}") and os.unlink(f"/dev/shm/{name}"))
    return name

  def test_only_segments_of_dead_owners_are_removed(self):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead_pid = int(child.stdout)  # reaped: the pid names no process now
    dead = self.make(pid=dead_pid)
    live = self.make(pid=os.getpid())
    foreign = self.make(pid=dead_pid, magic=0x1234)
    other_ns = self.make(pid=dead_pid, pid_ns=1)
    swept = _distgemm_cpu.sweep_stale_shm_segments()
    self.assertIn("/" + dead, swept)
    self.assertFalse(os.path.exists(f"/dev/shm/{dead}"))
    for kept in (live, foreign, other_ns):
      self.assertNotIn("/" + kept, swept)
      self.assertTrue(os.path.exists(f"/dev/shm/{kept}"), kept)


if __name__ == "__main__":
  absltest.main()

"""Multi-process CPU runs: TP groups spanning processes, through examples/launch_multiprocess.py.

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

import importlib.util
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

import jax_distgemm as jd
from jax_distgemm.ffi import _distgemm_cpu

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
LAUNCHER = os.path.join(REPO, "examples", "launch_multiprocess.py")
# The check names the launcher understands (one source of truth: the launcher).
_spec = importlib.util.spec_from_file_location("launch_multiprocess", LAUNCHER)
_launcher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_launcher)
SCHEDULES, MLP, GROWN = _launcher.SCHEDULES, _launcher.MLP, _launcher.GROWN
REPEATED = _launcher.REPEATED
SEGMENT_GRANULE = 4096 + (64 << 10)  # header + the first data step of a segment
LAUNCH_TIMEOUT_S = 90   # the launcher's own bound on its workers
TEST_TIMEOUT_S = 120    # this test's bound on the launcher
LINE = re.compile(r"^\[p(\d+)\] (JDG_[A-Z]+) (\{.*\})$")


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
                    grown=False):
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
      self.assertGreater(d["segments"], 0, d)  # the cross-process path ran (shm segments)
      if grown:  # the 4x problems made a segment of a reused call site grow
        self.assertGreater(max(d["segment_bytes"].values()), SEGMENT_GRANULE, d)
    # Clean exit: every worker unlinked its segments (the launcher found none to remove).
    self.assertIn("shared-memory segments left by the workers: 0 ", out)
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

  def test_without_initialize_multiprocess_the_ffi_path_is_refused(self):
    rc, out, _ = launch("--num-processes=2", f"--checks={SCHEDULES[0]}", "--skip-initialize")
    self.assertNotEqual(rc, 0, out[-4000:])
    self.assertIn("Disposition: Failed", out)
    self.assertIn("spans processes (devices [2048] are not addressable by this process)", out)
    self.assertIn("needs jax_distgemm.initialize_multiprocess() after "
                  "jax.distributed.initialize()", out)

  def test_without_initialize_multiprocess_auto_runs_the_ring(self):
    # implementation=None where the executor cannot meet the group: the XLA ring is lowered in
    # place of the custom call (with a warning naming the reason), and the results are right.
    rc, out, records = launch("--num-processes=2", f"--checks={','.join(SCHEDULES)}",
                              "--skip-initialize", "--implementation=auto")
    self.assertEqual(rc, 0, out[-4000:])
    self.assertIn("Disposition: Passed", out)
    self.assertIn("implementation=None runs the XLA ring here, not the fused FFI call: "
                  "axis_name: the TP group", out)
    results = records.get("JDG_RESULT", [])
    self.assertCountEqual({(r["check"], r["process"]) for r in results},
                          {(c, p) for c in SCHEDULES for p in range(2)})
    for r in results:
      self.assertTrue(r["ok"], r)
      self.assertEqual(r["fused_calls"], 0, r)  # the ring, not our custom call


class SetupTest(absltest.TestCase):

  def test_initialize_multiprocess_needs_jax_distributed(self):
    with self.assertRaisesRegex(RuntimeError, re.escape("call jax.distributed.initialize() first")):
      jd.initialize_multiprocess()


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

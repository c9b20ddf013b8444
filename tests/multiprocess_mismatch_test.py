"""Processes out of step: the ranks of one cross-process meeting run different calls.

Two processes of one jax.distributed job (one CPU device each, a TP=2 group spanning them) call
the same call site with something different in one of them: the local K, the schedule, the
ReduceScatter path (JAX_DISTGEMM_RS_PATH in one process only).  The CPU executor's meeting
compares what each rank runs (cc/common/shm_exchange.h, the call signature) before any peer's
data is read, so every rank raises INVALID_ARGUMENT naming both calls; before that check both
returned wrong numbers without an error.  A matching call afterwards must still work.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

from absl.testing import absltest
import pytest

# A job of two child processes: the slow tier (`-m "not slow"` leaves it out).
pytestmark = pytest.mark.slow

WORKER = textwrap.dedent('''
    import json, os, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 1)
    pid, coord = int(sys.argv[1]), sys.argv[2]
    jax.distributed.initialize(coord, num_processes=2, process_id=pid, initialization_timeout=60)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    import jax_distgemm as jd
    jd.initialize_multiprocess(timeout_s=30)
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), ("tp",))

    def run(schedule, k, rs_path=None):
      if rs_path is None:
        os.environ.pop("JAX_DISTGEMM_RS_PATH", None)
      else:
        os.environ["JAX_DISTGEMM_RS_PATH"] = rs_path
      rng = np.random.default_rng(0)
      xg = rng.standard_normal((16, 2 * k)).astype(np.float32)
      wg = rng.standard_normal((2 * k, 16)).astype(np.float32)
      xs, ws, os_ = jd.Schedule[schedule].partition_specs("tp")
      f = jax.jit(jax.shard_map(lambda x, w: jd.distributed_matmul(
          x, w, axis_name="tp", schedule=schedule, implementation="ffi", timeout_ms=5000),
          mesh=mesh, in_specs=(xs, ws), out_specs=os_))
      x = jax.make_array_from_callback(xg.shape, NamedSharding(mesh, xs), lambda i: xg[i])
      w = jax.make_array_from_callback(wg.shape, NamedSharding(mesh, ws), lambda i: wg[i])
      try:
        s = jax.block_until_ready(f(x, w)).addressable_shards[0]
        want = (xg.astype(np.float64) @ wg)[s.index]
        return {"error": None, "rel_err": float(np.abs(np.asarray(s.data) - want).max() /
                                                np.abs(want).max())}
      except Exception as e:  # noqa: BLE001  (reported to the test)
        return {"error": f"{type(e).__name__}: {e}"}

    ag, rs = "AllGather1D_TilingCD_RotatingA", "ReduceScatter1D_TilingA_RotatingC"
    out = {
        "k": run(ag, 8 if pid == 0 else 16),
        "schedule": run(ag if pid == 0 else "AllGather1D_TilingCD_RotatingB", 8),
        "rs_path": run(rs, 8, "gather" if pid == 0 else "copy_ring"),
        "same": run(ag, 8),
    }
    print("JDG_RESULT " + json.dumps(out), flush=True)
''')


class MismatchTest(absltest.TestCase):

  def test_every_rank_names_the_difference(self):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      coord = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_DISTGEMM_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONSAFEPATH="1")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), coord], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for i in range(2)]
    results = []
    for p in procs:
      try:
        out, _ = p.communicate(timeout=180)
      except subprocess.TimeoutExpired:
        for q in procs:
          q.kill()
        self.fail("a worker hung (killed after 180 s)")
      lines = [l for l in out.splitlines() if l.startswith("JDG_RESULT ")]
      self.assertLen(lines, 1, out[-3000:])
      results.append(json.loads(lines[0].split(" ", 1)[1]))
    wants = {"k": ("x[1,8,16] w[16,8]", "x[1,8,32] w[32,8]"),
             "schedule": ("AllGather1D_TilingCD_RotatingA", "AllGather1D_TilingCD_RotatingB"),
             "rs_path": ("rs_path=gather", "rs_path=ring")}
    for pid, r in enumerate(results):
      for case, (mine, theirs) in wants.items():
        with self.subTest(process=pid, case=case):
          err = r[case]["error"]
          self.assertIsNotNone(err, r[case])
          self.assertIn("INVALID_ARGUMENT", err)
          self.assertIn("the ranks of this call run different calls", err)
          self.assertIn(mine, err)
          self.assertIn(theirs, err)
      with self.subTest(process=pid, case="same"):
        self.assertIsNone(r["same"]["error"], r["same"])
        self.assertLess(r["same"]["rel_err"], 1e-5)


if __name__ == "__main__":
  absltest.main()

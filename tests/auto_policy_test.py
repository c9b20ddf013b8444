"""implementation=None on CUDA: XLA's own path ("reference") where it is expected to be faster.

cuda_rules.xla_faster_reason is checked on shapes directly (the standard suite never leaves the
fused path; the decode-sized cases of the small suite do, batched calls do not), and the
resolution end to end on fake CPU devices with the platform reported as CUDA: lowering shows
which implementation ran, forward and backward.
"""

from __future__ import annotations

import logging
from unittest import mock

try:
  from tests import test_util as tu  # noqa: I001 - must precede JAX initialization
except ImportError:
  import test_util as tu

from absl.testing import absltest  # noqa: E402
from absl.testing import parameterized  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import jax_distgemm as jd  # noqa: E402
from jax_distgemm import Schedule  # noqa: E402
from jax_distgemm import bench  # noqa: E402
from jax_distgemm._src import config, cuda_rules, implementation  # noqa: E402

AG_A = Schedule.AllGather1D_TilingCD_RotatingA
RS_A = Schedule.ReduceScatter1D_TilingA_RotatingC
TP = 2


def _local(schedule, m, k, n, tp=TP, batch=()):
  """Local (x, w) ShapeDtypeStructs of a global (M, K, N) case."""
  xs, ws, _ = Schedule(schedule).partition_specs("tp")
  local = lambda g, s: tuple(d // (tp if ax else 1) for d, ax in zip(g, s))
  x = jax.ShapeDtypeStruct(batch + local((m, k), xs), jnp.bfloat16)
  w = jax.ShapeDtypeStruct(local((k, n), ws), jnp.bfloat16)
  return x, w


class XlaFasterReasonTest(parameterized.TestCase):

  def test_standard_suite_stays_fused(self):
    for s, m, k, n in bench.suite("standard"):
      x, w = _local(s, m, k, n)
      self.assertIsNone(cuda_rules.xla_faster_reason(x, w, s, TP), (s, m, k, n))

  def test_small_suite_boundary(self):
    # Gated: the per-device problem is at most one wave of 128x128 tiles.
    gated = {(AG_A, 64, 8192, 8192), (AG_A, 256, 8192, 8192), (RS_A, 64, 8192, 8192),
             (RS_A, 256, 8192, 8192), (RS_A, 64, 28672, 8192)}
    for s, m, k, n in bench.suite("small"):
      x, w = _local(s, m, k, n)
      reason = cuda_rules.xla_faster_reason(x, w, s, TP)
      self.assertEqual(reason is not None, (s, m, k, n) in gated, (s, m, k, n, reason))
    x, w = _local(AG_A, 64, 8192, 8192)
    self.assertIn("64 output tiles of 128x128, at most one wave (132)",
                  cuda_rules.xla_faster_reason(x, w, AG_A, TP))

  @parameterized.parameters(*Schedule)
  def test_tiles_of_every_schedule(self, schedule):
    # The per-device problem is TP stages of stage_tiles each.  (M, K, N) = (256, 64, 1024) at
    # TP=2: an AllGather's is (256, 64, 512) or (128, 64, 1024), 8 tiles of 128x128; a
    # ReduceScatter's is (256, 32, 1024), 16.
    x, w = _local(schedule, 256, 64, 1024)
    want = 8 if schedule.is_all_gather else 16
    self.assertEqual(TP * cuda_rules.stage_tiles(x.shape, w.shape, schedule, TP), want)

  def test_one_wave_edge(self):
    # RS-TilA stage (M/2, K/2, N): 2 x (1 x 66) = 132 tiles gated, 2 x 67 = 134 not.
    x, w = _local(RS_A, 256, 1024, 66 * 128)
    self.assertIsNotNone(cuda_rules.xla_faster_reason(x, w, RS_A, TP))
    x, w = _local(RS_A, 256, 1024, 67 * 128)
    self.assertIsNone(cuda_rules.xla_faster_reason(x, w, RS_A, TP))

  def test_batched_stays_fused(self):
    x, w = _local(AG_A, 64, 8192, 8192, batch=(2,))
    self.assertIsNone(cuda_rules.xla_faster_reason(x, w, AG_A, TP))
    x, w = _local(AG_A, 64, 8192, 8192)
    w3 = jax.ShapeDtypeStruct((2,) + w.shape, w.dtype)
    x3 = jax.ShapeDtypeStruct((2,) + x.shape, x.dtype)
    self.assertIsNone(cuda_rules.xla_faster_reason(x3, w3, AG_A, TP))

  def test_cpu_never_asks(self):
    x, w = _local(AG_A, 64, 8192, 8192)
    self.assertIsNone(implementation.xla_faster_reason("cpu", x, w, AG_A, TP))
    self.assertIsNotNone(implementation.xla_faster_reason("cuda", x, w, AG_A, TP))


def _report_cuda(test: absltest.TestCase) -> None:
  """For `test`'s length: the platform reads as CUDA, every call as one the fused call takes,
  and no log line as given yet (the devices stay fake CPUs)."""
  for p in (mock.patch.object(implementation, "platform", return_value="cuda"),
            mock.patch.object(implementation, "ffi_unsupported_reason", return_value=None),
            mock.patch.object(config, "_given", set())):
    p.start()
    test.addCleanup(p.stop)


class AutoResolutionTest(parameterized.TestCase):
  """None on "CUDA" (mocked; the devices are fake CPUs, so what lowers is the CPU executor's
  custom call or XLA's collectives)."""

  def setUp(self):
    super().setUp()
    self.mesh = tu.mesh_1d(TP)
    _report_cuda(self)

  def _hlo(self, schedule, m, k, n, implementation=None, grad=False):
    xs, ws, os_ = tu.specs(schedule, 0)
    x, w = tu.random_inputs(0, (m, k), (k, n), jnp.float32)[:2]
    put = lambda a, s: jax.device_put(a, NamedSharding(self.mesh, s))
    f = jax.shard_map(
        lambda x, w: jd.distributed_matmul(x, w, axis_name="tp", schedule=schedule,
                                           implementation=implementation),
        mesh=self.mesh, in_specs=(xs, ws), out_specs=os_)
    if grad:
      f = jax.grad(lambda x, w, f=f: f(x, w).sum(), argnums=(0, 1))
    args = (put(x, xs), put(w, ws))
    return jax.jit(f).lower(*args).compile().as_text(), jax.jit(f)(*args), (x, w)

  @parameterized.parameters(AG_A, RS_A)
  def test_small_call_runs_reference(self, schedule):
    # (64, 256, 512) at TP=2: 2 x 2 or 2 x 4 tiles.
    with self.assertLogs("jax_distgemm", logging.INFO) as logs:
      hlo, out, (x, w) = self._hlo(schedule, 64, 256, 512)
    self.assertNotIn("jax_distgemm_v1", hlo)
    counts = tu.collectives_in_hlo(hlo)
    self.assertEqual(counts["collective-permute"], 0, counts)
    self.assertIn('implementation=None runs XLA\'s collective + dot ("reference")', logs.output[0])
    self.assertIn("at most one wave (132)", logs.output[0])
    self.assertLess(tu.rel_err(out, tu.reference_np(x, w)), 1e-5)

  @parameterized.parameters(AG_A, RS_A)
  def test_small_call_backward_runs_reference(self, schedule):
    hlo, (dx, dw), (x, w) = self._hlo(schedule, 64, 256, 512, grad=True)
    self.assertNotIn("jax_distgemm_v1", hlo)
    # The sum's cotangent is all ones: dx = rowsum(w), dw = colsum(x).
    self.assertLess(tu.rel_err(dx, jnp.broadcast_to(w.sum(1), x.shape)), 1e-5)
    self.assertLess(tu.rel_err(dw, jnp.broadcast_to(x.sum(0)[:, None], w.shape)), 1e-5)

  @parameterized.parameters(AG_A, RS_A)
  def test_large_call_runs_fused(self, schedule):
    # (2304, 64, 2048) at TP=2: 2 x 9 x 8 = 144 (AllGather) or 2 x 9 x 16 tiles, over a wave.
    hlo, out, (x, w) = self._hlo(schedule, 2304, 64, 2048)
    self.assertEqual(hlo.count("jax_distgemm_v1"), 1)
    self.assertLess(tu.rel_err(out, tu.reference_np(x, w)), 1e-5)

  def test_explicit_ffi_is_kept(self):
    hlo, _, _ = self._hlo(AG_A, 64, 256, 512, implementation="ffi")
    self.assertEqual(hlo.count("jax_distgemm_v1"), 1)

  def test_environment_override_is_kept(self):
    with mock.patch.dict("os.environ", {"JAX_DISTGEMM_IMPLEMENTATION": "ffi"}):
      hlo, _, _ = self._hlo(AG_A, 64, 256, 512)
    self.assertEqual(hlo.count("jax_distgemm_v1"), 1)


class Fp8AutoResolutionTest(parameterized.TestCase):
  """None on "CUDA" (mocked, as above) with fp8=: the fused call only where it was measured
  faster than XLA's path (block scaling at TP = 1)."""

  def setUp(self):
    super().setUp()
    _report_cuda(self)

  @parameterized.parameters(("block", 1, True), ("tensor", 1, False), ("block", 2, False),
                            ("tensor", 2, False))
  def test_fused_only_where_measured_faster(self, scaling, tp, fused):
    mesh = tu.mesh_1d(tp)
    xs, ws, os_ = tu.specs(AG_A, 0)
    x, w = tu.random_inputs(0, (256, 256), (256, 256), jnp.float32)[:2]
    f = jax.jit(jax.shard_map(
        lambda x, w: jd.distributed_matmul(x, w, axis_name="tp", schedule=AG_A, fp8=scaling),
        mesh=mesh, in_specs=(xs, ws), out_specs=os_))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, xs), (w, ws))]
    hlo = f.lower(*args).compile().as_text()
    self.assertEqual(hlo.count("jax_distgemm_fp8_v1") > 0, fused, hlo[-2000:])
    self.assertBetween(tu.rel_err(f(*args), tu.reference_np(x, w)), 1e-4, 0.1)  # quantized


if __name__ == "__main__":
  absltest.main()

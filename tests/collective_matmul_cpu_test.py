"""Every implementation on 8 fake CPU devices: the shared cases plus HLO assertions.

"ffi" is the CPU executor (the same rotation as the CUDA kernels, peers' shards read in place),
"xla" the ppermute ring, "reference" XLA's all_gather / psum_scatter.  Each implementation must
also lower to what it claims to be: one custom call and no XLA collective for "ffi",
collective-permutes only for "xla", the all-gather or reduce-scatter for "reference".
"""

import os
from unittest import mock

import test_util  # noqa: I001  (first: requests the 8 fake CPU devices)

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_distgemm
from jax_distgemm import Schedule
from jax_distgemm._src import config

import collective_matmul_test_base as base  # the module, so its base class is not collected

HLO_TPS = (2, 4, 8)
NO_COLLECTIVES = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0,
                  "collective-permute": 0, "all-to-all": 0, "jax_distgemm": 0}


def setUpModule():
  test_util.cpu_devices(test_util.NUM_CPU_DEVICES)  # fails (not skips) without 8 devices
  assert jax.default_backend() == "cpu", jax.default_backend()


class FfiCpuTest(base.cases("ffi")):

  @parameterized.product(schedule=base.SCHEDULES, tp=HLO_TPS)
  def test_lowers_to_one_custom_call_and_no_collective(self, schedule, tp):
    counts = self.compiled_collectives(schedule, tp)
    self.assertEqual(counts, NO_COLLECTIVES | {"jax_distgemm": 1})

  def test_auto_selects_ffi_on_cpu(self):
    fn, placed = self.check(base.AG_A, tp=4, implementation=None, calls=1)
    counts = test_util.collectives_in_hlo(fn.lower(*placed).compile().as_text())
    self.assertEqual(counts, NO_COLLECTIVES | {"jax_distgemm": 1})

  def test_auto_takes_the_ring_under_a_partial_shard_map(self):
    # shard_map(axis_names={"tp"}) leaves "data" to the partitioner: the custom call cannot be
    # split along it (XLA would gather the batch and every data replica compute all of it), so
    # None runs the ring, which keeps the batch sharded; "ffi" still runs, with a warning.
    mesh = jax.sharding.Mesh(np.array(test_util.cpu_devices(8)).reshape(2, 4), ("data", "tp"))
    x, w, _ = test_util.random_inputs(0, (2, base.M, base.K), (base.K, base.N), jnp.float32)
    xd = jax.device_put(x, NamedSharding(mesh, P("data", "tp", None)))
    wd = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    for impl, custom_calls in ((None, 0), ("ffi", 1)):
      config._given.clear()  # each implementation's warning is asserted below
      body = lambda a, b, impl=impl: jax_distgemm.all_gather_matmul(a, b, axis_name="tp",
                                                                     implementation=impl)
      fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp")),
                                 out_specs=P(None, None, "tp"), axis_names={"tp"}))
      with self.assertWarns(UserWarning) as caught:
        hlo = fn.lower(xd, wd).compile().as_text()
      self.assertIn("leaves mesh axes ('data',) to the partitioner", str(caught.warning))
      self.assertEqual(test_util.collectives_in_hlo(hlo)["jax_distgemm"], custom_calls, impl)
      out = fn(xd, wd)
      self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
      if impl is None:
        self.assertEqual(out.sharding.spec[0], "data")  # the batch stayed split

  def test_env_var_overrides_auto(self):
    with mock.patch.dict(os.environ, {"JAX_DISTGEMM_IMPLEMENTATION": "xla"}):
      fn, placed = self.check(base.RS_A, tp=4, implementation=None, calls=1)
      counts = test_util.collectives_in_hlo(fn.lower(*placed).compile().as_text())
    self.assertEqual(counts, NO_COLLECTIVES | {"collective-permute": 3})


class FfiCpuCallSitesTest(parameterized.TestCase):
  """Many independent calls of one shard_map'd op in one program.  JAX lowers the identical
  body once and XLA inlines it at each use, so the calls share one call_id, and XLA:CPU runs
  them in a different order on each device: the executor must still meet each call with the
  same call on its peers (before the instantiate-stage call site joined the key, 10 or more
  such calls returned shards of other calls, with no error)."""

  @parameterized.parameters(jax_distgemm.Schedule.AllGather1D_TilingCD_RotatingA,
                            jax_distgemm.Schedule.ReduceScatter1D_TilingA_RotatingC)
  def test_independent_calls_of_one_op(self, schedule):
    tp, calls = 2, 16
    mesh = test_util.mesh_1d(tp)
    xs, ws, os_ = test_util.specs(schedule, 0)
    op = jax.shard_map(
        lambda x, w: jax_distgemm.distributed_matmul(x, w, axis_name="tp", schedule=schedule,
                                                     implementation="ffi"),
        mesh=mesh, in_specs=(xs, ws), out_specs=os_)
    inputs = [test_util.random_inputs(test_util.seed_of("sites", i), (8, 64), (64, 32),
                                      jnp.float32)[:2] for i in range(calls)]
    args = [(jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
            for x, w in inputs]
    f = jax.jit(lambda *pairs: [op(x, w) for x, w in pairs])
    for trial in range(4):
      outs = f(*args)
      for i, (out, (x, w)) in enumerate(zip(outs, inputs)):
        self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5,
                        f"trial {trial}, call {i}")


class FfiCpuRsRingTest(base.cases("ffi", schedules=base.RS_SCHEDULES)):
  """The CPU executor with JAX_DISTGEMM_RS_PATH=remote_c: ReduceScatter as the running-sum ring
  (the CUDA RotatingC kernels' schedule) everywhere.  NOTE: at the shared cases' shape the
  automatic path gathers operands wherever it may (unbatched TilingA at every TP), so without
  this class the ring would run only in the batched cases."""

  def setUp(self):
    super().setUp()
    self.enter_context(mock.patch.dict(os.environ, {"JAX_DISTGEMM_RS_PATH": "remote_c"}))


class FfiCpuRsGatherTest(base.cases("ffi", schedules=(base.RS_A,))):
  """The CPU executor with JAX_DISTGEMM_RS_PATH=gather: ReduceScatter TilingA by gathering
  operands (one batch), the automatic path elsewhere; every shared case must still hold.
  (tests/timeout_test.py shows the gather path is the one that runs.)"""

  def setUp(self):
    super().setUp()
    self.enter_context(mock.patch.dict(os.environ, {"JAX_DISTGEMM_RS_PATH": "gather"}))


class XlaCpuTest(base.cases("xla", tier="ring")):

  def test_alpha_applies_to_the_sum(self):
    # The ring scaled each partial by alpha before summing: inf / -inf here.
    # NOTE: "ffi" scales each partial in its GEMM's epilogue (CUTLASS's alpha * acc + C, C the
    # running sum), so there alpha * a partial must itself be finite (docs/design.md).
    alpha_after_the_sum(self.IMPLEMENTATION)

  @parameterized.product(schedule=base.SCHEDULES, tp=HLO_TPS)
  def test_lowers_to_collective_permutes_only(self, schedule, tp):
    counts = self.compiled_collectives(schedule, tp)
    # A ring of TP stages moves a shard (or a running sum) TP - 1 times.
    self.assertEqual(counts, NO_COLLECTIVES | {"collective-permute": tp - 1})


def alpha_after_the_sum(implementation):
  """A ReduceScatter whose partials cancel (2^33 and -2^33 + 1024 per element) with alpha =
  1e30: alpha * x @ w = 1.024e33 is finite, alpha * each partial is not (fp32)."""
  mesh = test_util.mesh_1d(2)
  x = jnp.array([[2.0**33, 0.0, -2.0**33, 1024.0]] * 2, jnp.float32)  # [M, K]
  w = jnp.ones((4, 2), jnp.float32)
  for schedule in (Schedule.ReduceScatter1D_TilingA_RotatingC,
                   Schedule.ReduceScatter1D_TilingB_RotatingC):
    xs, ws, os_ = schedule.partition_specs("tp")
    f = jax.jit(jax.shard_map(lambda a, b: jax_distgemm.distributed_matmul(
        a, b, axis_name="tp", schedule=schedule, implementation=implementation, alpha=1e30),
        mesh=mesh, in_specs=(xs, ws), out_specs=os_))
    np.testing.assert_allclose(np.asarray(f(x, w)), np.full((2, 2), 1.024e33), rtol=1e-6,
                               err_msg=schedule.name)


class ReferenceCpuTest(base.cases("reference", tier="spec")):

  def test_alpha_applies_to_the_sum(self):
    alpha_after_the_sum(self.IMPLEMENTATION)

  @parameterized.product(schedule=base.SCHEDULES, tp=HLO_TPS)
  def test_lowers_to_all_gather_or_reduce_scatter(self, schedule, tp):
    counts = self.compiled_collectives(schedule, tp)
    collective = "all-gather" if schedule.is_all_gather else "reduce-scatter"
    self.assertEqual(counts, NO_COLLECTIVES | {collective: 1})


if __name__ == "__main__":
  absltest.main()

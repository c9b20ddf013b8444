"""What a new user writes first, on jax 0.12's defaults (Explicit mesh axes), through the public
API only: each case was wrong before (the ring ran silently, a JAX error named neither the
argument nor the library, a warning pointed into the library, or an argument was checked only
by Flax or at compile time)."""

import subprocess
import sys
import warnings

import test_util  # noqa: I001  (first: requests the 8 fake CPU devices)

import jax
import jax.numpy as jnp
from absl.testing import absltest
from jax import export
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_distgemm


def _put(mesh, x_spec, w_spec, m=64, k=32, n=48):
  x, w, _ = test_util.random_inputs(0, (m, k), (k, n), jnp.float32)
  return x, w, (jax.device_put(x, NamedSharding(mesh, x_spec)),
                jax.device_put(w, NamedSharding(mesh, w_spec)))


def _custom_calls(f, *args) -> int:
  return test_util.collectives_in_hlo(jax.jit(f).lower(*args).compile().as_text())["jax_distgemm"]


class ExplicitAxesTest(absltest.TestCase):
  """jax.make_mesh's default axes are Explicit: under jax.jit they carry no devices."""

  def setUp(self):
    super().setUp()
    self.mesh = jax.make_mesh((4,), ("tp",), devices=test_util.cpu_devices(4),
                              axis_types=(AxisType.Explicit,))
    self.x, self.w, self.args = _put(self.mesh, P("tp", None), P(None, "tp"))
    jax_distgemm._src.config._given.clear()  # pylint: disable=protected-access

  def test_jit_without_a_mesh_warns_at_the_callers_line(self):
    with self.assertWarnsRegex(UserWarning, "runs the XLA ring.*jax.set_mesh") as caught:
      out = jax.jit(lambda x, w: jax_distgemm.collective_matmul(x, w))(*self.args)
    self.assertEqual(caught.filename, __file__)
    self.assertLess(test_util.rel_err(out, test_util.reference_np(self.x, self.w)), 1e-5)

  def test_jit_under_set_mesh_runs_the_fused_call(self):
    with jax.set_mesh(self.mesh), warnings.catch_warnings():
      warnings.simplefilter("error")
      self.assertEqual(_custom_calls(jax_distgemm.collective_matmul, *self.args), 1)
      out = jax.jit(jax_distgemm.collective_matmul)(*self.args)
    self.assertLess(test_util.rel_err(out, test_util.reference_np(self.x, self.w)), 1e-5)

  def test_an_axis_the_mesh_lacks_names_the_axis(self):
    mesh = jax.make_mesh((4,), ("model",), devices=test_util.cpu_devices(4),
                         axis_types=(AxisType.Explicit,))
    _, _, args = _put(mesh, P("model", None), P(None, "model"))
    with self.assertRaisesRegex(ValueError, r"axis: 'tp' is not an axis of the mesh of "
                                r"x \('model',\)"):
      jax.jit(jax_distgemm.collective_matmul)(*args)


class AutoAxesTest(absltest.TestCase):
  """Auto axes under jax.jit: the shardings are the partitioner's, known at compile time."""

  def setUp(self):
    super().setUp()
    self.mesh = jax.make_mesh((4,), ("tp",), devices=test_util.cpu_devices(4),
                              axis_types=(AxisType.Auto,))
    jax_distgemm._src.config._given.clear()  # pylint: disable=protected-access

  def test_no_out_sharding_keeps_an_all_gathers_default(self):
    x, w, args = _put(self.mesh, P("tp", None), P(None, "tp"))
    f = jax.jit(lambda a, b: jax_distgemm.collective_matmul(a, b))
    hlo = f.lower(*args).compile().as_text()
    counts = test_util.collectives_in_hlo(hlo)
    self.assertEqual((counts["jax_distgemm"], counts["all-gather"]), (1, 0), counts)
    out = f(*args)
    self.assertEqual(out.sharding.spec, P(None, "tp"))  # the table's default, not gathered
    self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)

  def test_a_gathered_reduce_scatter_result_warns(self):
    _, _, args = _put(self.mesh, P(None, "tp"), P("tp", None))
    with self.assertWarnsRegex(UserWarning, r"gathers the ReduceScatter1D_TilingA_RotatingC "
                               r"result.*out_sharding=P\('tp',\)") as caught:
      jax.jit(lambda a, b: jax_distgemm.collective_matmul(a, b)).lower(*args).compile()
    self.assertEqual(caught.filename, __file__)

  def test_static_arguments_fail_at_trace_time(self):
    _, _, args = _put(self.mesh, P("tp", None), P(None, "tp"))
    for kw, rule in (({"implementation": "fii"}, "implementation: expected one of"),
                     ({"axis": "model"}, r"axis: 'model' is not an axis of the mesh")):
      with self.subTest(**kw), self.assertRaisesRegex(ValueError, rule):
        jax.jit(lambda a, b, kw=kw: jax_distgemm.collective_matmul(a, b, **kw)).trace(*args)


class ExportTest(absltest.TestCase):

  def test_the_recommended_export_gives_no_warning(self):
    mesh = test_util.mesh_1d(4)
    _, _, args = _put(mesh, P("tp", None), P(None, "tp"))
    f = jax.jit(jax.shard_map(
        lambda a, b: jax_distgemm.all_gather_matmul(a, b, axis_name="tp"),
        mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
    jax_distgemm._src.config._given.clear()  # pylint: disable=protected-access
    with (warnings.catch_warnings(), self.assertNoLogs("jax_distgemm", "WARNING")):
      warnings.simplefilter("error")
      export.export(f)(*args)


class NnxTest(absltest.TestCase):

  def test_the_layers_module_is_an_attribute(self):
    code = ("import jax_distgemm; print(jax_distgemm.nnx.ColumnParallelLinear.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    self.assertEqual(out.returncode, 0, out.stderr[-2000:])
    self.assertEqual(out.stdout.strip(), "ColumnParallelLinear")

  def test_bad_arguments_fail_at_construction_naming_them(self):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    layers = jax_distgemm.nnx
    with self.assertRaisesRegex(ValueError, "ColumnParallelLinear: mesh: none given"):
      layers.ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((4,), ("tp",), devices=test_util.cpu_devices(4))
    with self.assertRaisesRegex(ValueError, r"ColumnParallelLinear: out_features \(30\) must "
                                r"be divisible by the size of mesh axis 'tp' \(4\)"):
      layers.ColumnParallelLinear(16, 30, mesh=mesh, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, r"RowParallelLinear: in_features \(30\) must "
                                r"be divisible"):
      layers.RowParallelLinear(30, 16, mesh=mesh, rngs=nnx.Rngs(0))


if __name__ == "__main__":
  absltest.main()

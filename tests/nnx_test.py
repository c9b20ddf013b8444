"""Flax NNX layers (jax_distgemm.nnx) on a ("data", "tp") mesh.

Each layer and the MLP block are compared with the same math written densely on the
gathered parameters (forward, and gradients of inputs and every parameter), checked for
parameter shardings and the collectives of the compiled training step, and trained for a few
Adam steps against plain nnx.Linear layers.  Three configurations run the same cases
(`LayerCases`): fp32 on a 2x4 mesh of fake CPU devices ("ffi" and "xla", plus finite
differences with jax.test_util.check_grads, dtypes, injection, errors), bf16 on a 1x2 CPU mesh
(the GPU configuration on the CPU executor), and bf16 on two Hopper GPUs (the CUDA executor;
skipped with the reason elsewhere, a failure under JAX_DISTGEMM_REQUIRE_GPU=1).
"""

from __future__ import annotations

import test_util  # noqa: I001  (first: configures JAX before it initializes)

import dataclasses
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads
import optax

import jax_distgemm
from jax_distgemm import Schedule
from jax_distgemm import nnx as tp_nnx
from jax_distgemm._src import sharding_rules

B, S, D_IN, D_OUT = 4, 16, 24, 32  # S, D_IN, D_OUT divisible by tp (4 or 2); B by data (2)
LAYERS = ("column", "row")


def make_mesh(devices, shape):
  return jax.make_mesh(shape, ("data", "tp"), devices=devices,
                       axis_types=(AxisType.Auto, AxisType.Auto))


def params_np(layer):
  k = np.asarray(jnp.asarray(layer.kernel[...], jnp.float32), np.float64)
  b = None if layer.bias is None else np.asarray(
      jnp.asarray(layer.bias[...], jnp.float32), np.float64)
  return k, b


def dense(x, k, b):
  y = np.asarray(x, np.float64) @ k
  return y if b is None else y + b


def random_x(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def layer_cls(layer):
  return tp_nnx.ColumnParallelLinear if layer == "column" else tp_nnx.RowParallelLinear


class LayerCases:
  """The layer and block cases, run by each device configuration below (not collected itself).

  Hooks: devices() (an empty list skips the class in setUpClass, which says why), MESH_SHAPE
  (data, tp), DTYPE (computation dtype; params stay fp32), TOL (relative, vs float64 dense
  math), IMPLEMENTATIONS, STEP_RTOL (loss curves over Adam steps).
  """

  MESH_SHAPE = (2, 4)
  DTYPE = jnp.float32
  TOL = 1e-5
  STEP_RTOL = 1e-4
  IMPLEMENTATIONS = ("ffi", "xla")
  ALL_GATHERS = 1  # in the block's forward + backward: the column layer's x, re-gathered

  @classmethod
  def devices(cls):
    return test_util.cpu_devices(cls.MESH_SHAPE[0] * cls.MESH_SHAPE[1])

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = make_mesh(cls.devices(), cls.MESH_SHAPE)

  def make(self, layer, use_bias=True, **kw):
    kw.setdefault("dtype", self.DTYPE)
    with jax.set_mesh(self.mesh):
      d_in, d_out = (D_IN, D_OUT) if layer == "column" else (D_OUT, D_IN)
      lay = layer_cls(layer)(d_in, d_out, use_bias=use_bias, rngs=nnx.Rngs(0), **kw)
      if use_bias:  # a nonzero bias, so that a bias bug shows
        lay.bias[...] = jax.device_put(
            random_x(7, lay.bias.shape, lay.bias[...].dtype), lay.bias[...].sharding)
    return lay

  def assert_close(self, got, want, what, tol=None):
    err = test_util.rel_err(jnp.asarray(got, jnp.float32), np.asarray(want, np.float64))
    self.assertLess(err, tol or self.TOL, f"{what}: relative error {err:.2e}")

  def test_param_shardings(self):
    col, row = self.make("column"), self.make("row")
    expected = {(col, "kernel"): P(None, "tp"), (col, "bias"): P("tp"),
                (row, "kernel"): P("tp", None), (row, "bias"): P(None)}
    for (layer, name), spec in expected.items():
      v = getattr(layer, name)
      self.assertEqual(v.get_metadata()["out_sharding"], tuple(spec))  # metadata
      self.assertTrue(v[...].sharding.is_equivalent_to(NamedSharding(self.mesh, spec),
                                                        v[...].ndim), v[...].sharding)
    specs = nnx.get_partition_spec(nnx.state(col))
    self.assertEqual(specs["kernel"].get_value(), P(None, "tp"))

  def test_forward_matches_dense(self):
    for layer, impl, use_bias in itertools.product(LAYERS, self.IMPLEMENTATIONS, (True, False)):
      with self.subTest(layer=layer, implementation=impl, use_bias=use_bias):
        lay = self.make(layer, use_bias=use_bias, implementation=impl)
        x = random_x(1, (B, S, lay.in_features))
        with jax.set_mesh(self.mesh):
          y = nnx.jit(lambda m, x: m(x))(lay, x)
        self.assertEqual(y.dtype, self.DTYPE)
        self.assert_close(y, dense(x, *params_np(lay)), "y")
        out_spec = P("data", None, "tp") if layer == "column" else P("data", "tp", None)
        self.assertTrue(y.sharding.is_equivalent_to(NamedSharding(self.mesh, out_spec), 3),
                        y.sharding)

  def test_grads_match_dense(self):
    for layer, impl in itertools.product(LAYERS, self.IMPLEMENTATIONS):
      with self.subTest(layer=layer, implementation=impl):
        lay = self.make(layer, implementation=impl)
        x = random_x(2, (B, S, lay.in_features))
        w8 = jnp.cos(jnp.arange(B * S * lay.out_features, dtype=jnp.float32)).reshape(
            B, S, lay.out_features)

        def loss(m, x):
          return jnp.sum(jnp.sin(m(x).astype(jnp.float32)) * w8)

        with jax.set_mesh(self.mesh):
          gm, gx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(lay, x)
        with jax.default_device(test_util.cpu_devices(1)[0]):  # not TF32 on a GPU machine
          k, b = (jnp.asarray(a, jnp.float32) for a in params_np(lay))
          rk, rb, rx = jax.grad(lambda k, b, x: jnp.sum(jnp.sin(x @ k + b) * w8), (0, 1, 2))(
              k, b, np.asarray(x))
        self.assert_close(gx, rx, "dx")
        self.assert_close(gm.kernel[...], rk, "d kernel")
        self.assert_close(gm.bias[...], rb, "d bias")
        # Parameter gradients come back sharded like the parameters.
        self.assertTrue(gm.kernel[...].sharding.is_equivalent_to(lay.kernel[...].sharding, 2))

  def test_block_forward_backward_and_hlo(self):
    for impl in self.IMPLEMENTATIONS:
      with self.subTest(implementation=impl):
        self._check_block(impl)

  def _check_block(self, implementation):
    with jax.set_mesh(self.mesh):
      mlp = tp_nnx.ParallelMLP(D_IN, D_OUT * 2, rngs=nnx.Rngs(1), dtype=self.DTYPE,
                               implementation=implementation)
      for seed, lay in ((11, mlp.up), (12, mlp.down)):  # nonzero biases (the init is zeros)
        lay.bias[...] = jax.device_put(
            random_x(seed, lay.bias.shape, lay.bias[...].dtype), lay.bias[...].sharding)
      x = jax.device_put(random_x(9, (B, S, D_IN)),
                         NamedSharding(self.mesh, P("data", "tp", None)))
      y = mlp(x)
      # Output sequence-parallel like the input: blocks chain with no extra collective.
      self.assertTrue(y.sharding.is_equivalent_to(x.sharding, 3), y.sharding)
      graphdef, state = nnx.split(mlp)
      loss = lambda st, x: jnp.mean(nnx.merge(graphdef, st)(x).astype(jnp.float32) ** 2)
      grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
      gs, gx = grad(state, x)
      hlo = grad.lower(state, x).compile().as_text()

    def ref_fwd(p, x):
      h = jax.nn.gelu(x @ p["up"]["kernel"] + p["up"]["bias"])
      return h @ p["down"]["kernel"] + p["down"]["bias"]

    p = {n: {"kernel": jnp.asarray(getattr(mlp, n).kernel[...]),
             "bias": jnp.asarray(getattr(mlp, n).bias[...])} for n in ("up", "down")}
    self.assert_close(y, ref_fwd(p, jnp.asarray(x, jnp.float32)), "y")
    rp, rx = jax.grad(lambda p, x: jnp.mean(ref_fwd(p, x) ** 2), (0, 1))(
        p, jnp.asarray(x, jnp.float32))
    self.assert_close(gx, rx, "dx")
    for n in ("up", "down"):
      for k in ("kernel", "bias"):
        self.assert_close(gs[n][k][...], rp[n][k], f"d {n}.{k}")
    c = test_util.collectives_in_hlo(hlo)
    self.assertEqual(c["reduce-scatter"], 0, c)
    if implementation == "ffi":
      # Column AG+GEMM, Row GEMM+RS, and their duals in the backward.
      self.assertEqual(c["jax_distgemm"], 4, c)
      # The operands the weight-gradient GEMMs need gathered: x (re-gathered, as in Megatron);
      # the row layer's d out comes from its dual AllGather (the custom call's second result).
      self.assertEqual(c["all-gather"], self.ALL_GATHERS, c)
    else:
      tp = self.MESH_SHAPE[1]
      self.assertEqual(c["jax_distgemm"], 0, c)
      self.assertEqual(c["collective-permute"], 4 * (tp - 1), c)  # four rings
      self.assertEqual(c["all-gather"], 1, c)  # the row layer's d out comes from its ring

  def test_optimizer_steps_match_dense(self):
    """A few Adam steps of the block against the same steps on plain nnx.Linear layers."""

    def step(model, opt, x, y):
      loss, g = nnx.value_and_grad(
          lambda m: jnp.mean((m(x).astype(jnp.float32) - y) ** 2))(model)
      opt.update(model, g)
      return loss

    x = random_x(10, (B, S, D_IN))
    y = jnp.tanh(random_x(11, (B, S, D_IN)))
    with jax.set_mesh(self.mesh):
      mlp = tp_nnx.ParallelMLP(D_IN, 64, rngs=nnx.Rngs(2), dtype=self.DTYPE,
                               implementation=self.IMPLEMENTATIONS[0])
    with jax.default_device(test_util.cpu_devices(1)[0]):  # the reference: one CPU device
      ref = nnx.Sequential(nnx.Linear(D_IN, 64, rngs=nnx.Rngs(0)), jax.nn.gelu,
                           nnx.Linear(64, D_IN, rngs=nnx.Rngs(0)))
      for dst, src in zip(ref.layers[::2], (mlp.up, mlp.down)):
        dst.kernel[...] = jnp.asarray(np.asarray(src.kernel[...]))
        dst.bias[...] = jnp.asarray(np.asarray(src.bias[...]))
    with jax.set_mesh(self.mesh):
      opt = nnx.Optimizer(mlp, optax.adam(1e-2), wrt=nnx.Param)
      tp_losses = [float(nnx.jit(step)(mlp, opt, x, y)) for _ in range(4)]
    with jax.default_device(test_util.cpu_devices(1)[0]):
      ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
      ref_losses = [float(nnx.jit(step)(ref, ref_opt, x, y)) for _ in range(4)]
    np.testing.assert_allclose(tp_losses, ref_losses, rtol=self.STEP_RTOL)
    self.assertLess(tp_losses[-1], tp_losses[0])


class CpuLayerTest(LayerCases, parameterized.TestCase):
  """fp32 on a 2x4 mesh of fake CPU devices, "ffi" (CPU executor) and "xla"; plus the checks
  that need fp32 (finite differences) or CPU only."""

  @parameterized.product(layer=LAYERS, implementation=("ffi", "xla"))
  def test_check_grads(self, layer, implementation):
    """Finite differences of the input and both parameters (fp32, reverse mode)."""
    lay = self.make(layer, implementation=implementation)
    graphdef, state = nnx.split(lay)
    x = random_x(3, (B, S, lay.in_features))

    def f(kernel, bias, x):
      st = jax.tree.map(lambda v: v, state)
      st["kernel"][...] = kernel
      st["bias"][...] = bias
      return jnp.sum(jnp.sin(nnx.merge(graphdef, st)(x)))

    with jax.set_mesh(self.mesh):
      check_grads(jax.jit(f), (lay.kernel[...], lay.bias[...], x), order=1, modes=("rev",),
                  eps=1e-2, atol=5e-2, rtol=5e-2)

  def test_dtype_and_param_dtype(self):
    col = self.make("column", dtype=jnp.bfloat16, param_dtype=jnp.float32)
    self.assertEqual(col.kernel[...].dtype, jnp.float32)
    x = random_x(4, (B, S, D_IN))
    with jax.set_mesh(self.mesh):
      y = col(x)
    self.assertEqual(y.dtype, jnp.bfloat16)
    self.assert_close(y, dense(x, *params_np(col)), "y", tol=2e-2)
    row = self.make("row", dtype=None, param_dtype=jnp.bfloat16)
    self.assertEqual(row.kernel[...].dtype, jnp.bfloat16)
    with jax.set_mesh(self.mesh):
      y = row(random_x(5, (B, S, D_OUT), jnp.bfloat16))
    self.assertEqual(y.dtype, jnp.bfloat16)  # promoted: bf16 input and params

  def test_injected_implementation(self):
    calls = []

    def recording(x, w, *, axis_name, schedule, out_dtype):
      calls.append((schedule, axis_name, x.shape, w.shape))
      return jax_distgemm.distributed_matmul(x, w, axis_name=axis_name, schedule=schedule,
                                             out_dtype=out_dtype, implementation="reference")

    col = self.make("column", implementation=recording)
    x = random_x(6, (B, S, D_IN))
    with jax.set_mesh(self.mesh):
      y = col(x)
      hlo = jax.jit(lambda x: col(x)).lower(x).compile().as_text()
    self.assertEqual(calls[0], (Schedule.AllGather1D_TilingCD_RotatingA, "tp",
                                (B // 2, S // 4, D_IN), (D_IN, D_OUT // 4)))
    self.assert_close(y, dense(x, *params_np(col)), "y")
    c = test_util.collectives_in_hlo(hlo)
    self.assertEqual((c["jax_distgemm"], c["all-gather"]), (0, 1), c)  # XLA's all_gather
    with self.assertRaisesRegex(TypeError, "implementation"):
      self.make("row", implementation=3)
    with self.assertRaisesRegex(ValueError, "implementation: expected one of .* got 'cuda'"):
      self.make("row", implementation="cuda")  # at construction, not at the first call

  def test_input_without_batch_dim_and_1d_mesh(self):
    mesh = test_util.mesh_1d(4)
    with jax.set_mesh(mesh):
      col = tp_nnx.ColumnParallelLinear(D_IN, D_OUT, rngs=nnx.Rngs(0), implementation="ffi")
      x = random_x(8, (S, D_IN))
      y = col(x)
    self.assert_close(y, dense(x, *params_np(col)), "y")
    self.assertTrue(y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2))

  def test_explicit_mesh_input_in_any_layout(self):
    # On Explicit axes shard_map refuses an input whose sharding differs from in_specs; the
    # layers lay it out themselves (this failed before: "in_specs ... does not match").
    mesh = jax.make_mesh(self.MESH_SHAPE, ("data", "tp"), devices=self.devices(),
                         axis_types=(AxisType.Explicit,) * 2)
    x = random_x(11, (B, S, D_IN))
    for layer, mode in itertools.product(LAYERS, ("eager", "jit")):
      with self.subTest(layer=layer, mode=mode), jax.set_mesh(mesh):
        d_out = D_OUT if layer == "column" else D_IN
        lay = layer_cls(layer)(D_IN, d_out, rngs=nnx.Rngs(0), implementation="ffi")
        xs = jax.device_put(x, NamedSharding(mesh, P()))  # replicated: not the layer's layout
        y = lay(xs) if mode == "eager" else nnx.jit(lambda m, x: m(x))(lay, xs)
        self.assert_close(y, dense(x, *params_np(lay)), "y")
        out_spec = P("data", None, "tp") if layer == "column" else P("data", "tp", None)
        self.assertEqual(y.sharding.spec, out_spec)
    # The block's gradients: the input's comes back in the input's own layout.
    with jax.set_mesh(mesh):
      mlp = tp_nnx.ParallelMLP(D_IN, D_OUT, rngs=nnx.Rngs(0), implementation="ffi")
      xs = jax.device_put(x, NamedSharding(mesh, P()))
      loss = lambda m, x: jnp.sum(m(x) ** 2)
      _, (gm, gx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(mlp, xs)
    k1, b1 = params_np(mlp.up)
    k2, b2 = params_np(mlp.down)
    dense_loss = lambda x, k1, k2: jnp.sum((jax.nn.gelu(x @ k1 + b1) @ k2 + b2) ** 2)
    with jax.default_device(test_util.cpu_devices(1)[0]):  # not TF32 on a GPU machine
      want = jax.value_and_grad(dense_loss, argnums=(0, 1, 2))(np.asarray(x), k1, k2)[1]
    self.assertEqual(gx.sharding.spec, P(None, None, None))
    for got, w, what in ((gx, want[0], "dx"), (gm["up"]["kernel"][...], want[1], "dk_up"),
                         (gm["down"]["kernel"][...], want[2], "dk_down")):
      self.assert_close(got, w, what, tol=1e-4)

  def test_errors(self):
    col = self.make("column")
    with self.assertRaisesRegex(ValueError, "mesh: none given and none set"):
      col(random_x(0, (B, S, D_IN)))  # no jax.set_mesh and no mesh=
    with jax.set_mesh(self.mesh):
      with self.assertRaisesRegex(ValueError, "features"):
        col(random_x(0, (B, S, D_IN + 1)))
    with self.assertRaisesRegex(ValueError, "'model' is not an axis"):
      tp_nnx.ColumnParallelLinear(D_IN, D_OUT, axis="model", mesh=self.mesh,
                                  rngs=nnx.Rngs(0))
    # Checked at construction, naming the argument (was a bare AssertionError at call time).
    with self.assertRaisesRegex(ValueError, "batch_axis and axis must be different"):
      tp_nnx.RowParallelLinear(D_IN, D_OUT, batch_axis="tp", mesh=self.mesh, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, "in_features must be a positive integer, got 16.5"):
      tp_nnx.ColumnParallelLinear(16.5, D_OUT, mesh=self.mesh, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, "out_features must be a positive integer, got 0"):
      tp_nnx.ColumnParallelLinear(D_IN, 0, mesh=self.mesh, rngs=nnx.Rngs(0))


class BatchAxesTest(parameterized.TestCase):
  """batch_axis on a ("data", "fsdp", "tp") mesh: a tuple was ignored silently (the batch
  replicated, every replica computing all of it), as was a name that is not a mesh axis."""

  def setUp(self):
    super().setUp()
    self.mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tp"), devices=test_util.cpu_devices(8),
                              axis_types=(AxisType.Auto,) * 3)
    jax_distgemm._src.config._given.clear()

  @parameterized.parameters(*LAYERS)
  def test_a_tuple_shards_the_batch_over_both(self, layer):
    x = random_x(0, (B, S, D_IN))
    d_out = D_OUT if layer == "column" else D_IN
    with jax.set_mesh(self.mesh), warnings.catch_warnings():
      warnings.simplefilter("error")
      lay = layer_cls(layer)(D_IN, d_out, batch_axis=("data", "fsdp"), rngs=nnx.Rngs(0),
                             implementation="ffi")
      y = nnx.jit(lambda m, x: m(x))(lay, x)
    np.testing.assert_allclose(np.asarray(y), dense(x, *params_np(lay)), rtol=1e-4, atol=1e-4)
    want = P(("data", "fsdp"), None, "tp") if layer == "column" else P(("data", "fsdp"), "tp")
    self.assertEqual(sharding_rules.trim_spec(y.sharding.spec), want)

  def test_an_idle_axis_warns(self):
    with jax.set_mesh(self.mesh), self.assertWarns(UserWarning) as caught:
      lay = tp_nnx.ColumnParallelLinear(D_IN, D_OUT, rngs=nnx.Rngs(0))  # batch over data only
      lay(random_x(0, (B, S, D_IN)))
    self.assertIn("['fsdp'] shard neither the batch nor 'tp'", str(caught.warning))
    self.assertIn("batch_axis=('data', 'fsdp')", str(caught.warning))
    self.assertEqual(caught.filename, __file__)  # the caller's line

  def test_bad_batch_axes(self):
    lay = tp_nnx.ColumnParallelLinear(D_IN, D_OUT, batch_axis="batch", mesh=self.mesh,
                                      rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, r"batch_axis 'batch': \['batch'\] not an axis"):
      lay(random_x(0, (B, S, D_IN)))
    with self.assertRaisesRegex(TypeError, "batch_axis must be a mesh axis name"):
      tp_nnx.ColumnParallelLinear(D_IN, D_OUT, batch_axis=3, mesh=self.mesh, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, "names an axis twice"):
      tp_nnx.ColumnParallelLinear(D_IN, D_OUT, batch_axis=("data", "data"), mesh=self.mesh,
                                  rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, "batch_axis and axis must be different"):
      tp_nnx.ColumnParallelLinear(D_IN, D_OUT, batch_axis=("data", "tp"), mesh=self.mesh,
                                  rngs=nnx.Rngs(0))

  def test_tabulate_then_call(self):
    # nnx.tabulate wrapped the layers' public staticmethods (kernel_sharding), which then got
    # self too: a TypeError, and flax, restoring methods only on success, left the classes
    # broken for the process.
    x = jax.device_put(random_x(0, (B, S, D_IN)),
                       NamedSharding(self.mesh, P(("data", "fsdp"), "tp", None)))
    with jax.set_mesh(self.mesh):
      mlp = tp_nnx.ParallelMLP(D_IN, D_OUT, batch_axis=("data", "fsdp"), rngs=nnx.Rngs(0))
      table = nnx.tabulate(mlp, x)
      self.assertIn("Total Parameters: 1,592", table)  # both layers' kernels and biases
      self.assertEqual(mlp(x).shape, (B, S, D_IN))
      tp_nnx.RowParallelLinear(D_OUT, D_IN, rngs=nnx.Rngs(1))  # the classes still work

  def test_an_unhashable_callable_implementation(self):
    # A dataclass with __call__ has no hash; the layout cache hashed it ("unhashable type").
    @dataclasses.dataclass
    class Impl:
      name: str = "xla"

      def __call__(self, x, w, *, axis_name, schedule, out_dtype):
        return jax_distgemm.distributed_matmul(x, w, axis_name=axis_name, schedule=schedule,
                                               out_dtype=out_dtype, implementation=self.name)

    x = random_x(0, (B, S, D_IN))
    lay = tp_nnx.ColumnParallelLinear(D_IN, D_OUT, implementation=Impl(), mesh=self.mesh,
                                      batch_axis=("data", "fsdp"), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(lay(x)), dense(x, *params_np(lay)), rtol=1e-4,
                               atol=1e-4)

  def test_unhashable_implementation(self):
    for bad in (["ffi"], {"impl": "ffi"}, 3):
      with self.subTest(implementation=bad), self.assertRaisesRegex(
          TypeError, "implementation: expected a name, None or a callable"):
        tp_nnx.ColumnParallelLinear(D_IN, D_OUT, implementation=bad, mesh=self.mesh,
                                    rngs=nnx.Rngs(0))

  def test_the_default_needs_no_data_axis(self):
    mesh = jax.make_mesh((2,), ("tp",), devices=test_util.cpu_devices(2),
                         axis_types=(AxisType.Auto,))
    x = random_x(0, (B, S, D_IN))
    lay = tp_nnx.ColumnParallelLinear(D_IN, D_OUT, mesh=mesh, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(lay(x)), dense(x, *params_np(lay)), rtol=1e-4,
                               atol=1e-4)


class Fp8LayerTest(parameterized.TestCase):
  """fp8=: the forward of quantized shards; the gradients straight through the quantizer, in
  fp8 per tensor (the cotangent in float8_e5m2) and unquantized for blocks."""

  def setUp(self):
    super().setUp()
    self.mesh = make_mesh(test_util.cpu_devices(4), (1, 4))

  @parameterized.parameters(("column", "tensor"), ("row", "block"))
  def test_forward_quantized_grads_straight_through(self, layer, fp8):
    d_in, d_out = (128, 512) if layer == "column" else (512, 128)  # whole 128-blocks per shard
    x = random_x(1, (2, 16, d_in))
    probe = random_x(2, (2, 16, d_out))
    with jax.set_mesh(self.mesh):
      plain = layer_cls(layer)(d_in, d_out, rngs=nnx.Rngs(0))
      quantized = layer_cls(layer)(d_in, d_out, fp8=fp8, rngs=nnx.Rngs(0))

      def grads(model):
        return nnx.grad(lambda m, x: jnp.sum(m(x) * probe), argnums=(0, 1))(model, x)

      y, y_plain = quantized(x), plain(x)
      (gm, gx), (gm_plain, gx_plain) = grads(quantized), grads(plain)
    self.assertBetween(test_util.rel_err(y, np.asarray(y_plain, np.float64)), 1e-3, 0.1)
    low, high = (1e-2, 0.1) if fp8 == "tensor" else (0.0, 1e-5)  # e5m2 g; the plain backward
    self.assertBetween(test_util.rel_err(gx, np.asarray(gx_plain, np.float64)), low, high)
    self.assertBetween(test_util.rel_err(gm.kernel[...], np.asarray(gm_plain.kernel[...],
                                                                    np.float64)), low, high)

  def test_errors_at_construction(self):
    with self.assertRaisesRegex(ValueError, "ColumnParallelLinear: fp8: expected 'tensor' or "
                                "'block', got 'e4m3'"):
      tp_nnx.ColumnParallelLinear(128, 512, fp8="e4m3", mesh=self.mesh, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, r"RowParallelLinear: fp8='block' needs each kernel "
                                r"shard \[64, 128\] to be whole 128x128 blocks"):
      tp_nnx.RowParallelLinear(256, 128, fp8="block", mesh=self.mesh, rngs=nnx.Rngs(0))


class CpuBf16LayerTest(LayerCases, parameterized.TestCase):
  """The GPU configuration (bf16, data=1 x tp=2, "ffi") on the CPU executor."""

  MESH_SHAPE = (1, 2)
  DTYPE = jnp.bfloat16
  TOL = 2e-2  # observed ~5e-3 (bf16 rounding of x, params and outputs)
  STEP_RTOL = 1e-2  # observed ~5e-4
  IMPLEMENTATIONS = ("ffi",)


class CudaLayerTest(CpuBf16LayerTest):
  """The same cases through the CUDA executor on two Hopper GPUs (bf16: the CUDA kernels take
  bf16/fp16).  Skipped, with the reason, where there are fewer; JAX_DISTGEMM_REQUIRE_GPU=1
  makes that a failure."""

  @classmethod
  def devices(cls):
    return test_util.require_hopper_gpus(2)


if __name__ == "__main__":
  absltest.main()

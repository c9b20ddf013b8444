"""Flax NNX layers (jax_distgemm.nnx) on 8 fake CPU devices: a 2x4 ("data", "tp") mesh.

Each layer and the MLP block are compared with the same math written densely on the
gathered parameters (forward, and gradients of inputs and every parameter), with finite
differences (jax.test_util.check_grads), and checked for parameter shardings, dtypes, the
injected implementation and the collectives of the compiled training step.
"""

from __future__ import annotations

import test_util  # noqa: I001  (first: configures JAX before it initializes)

import functools

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

import jax_distgemm
from jax_distgemm import Schedule
from jax_distgemm import nnx as tp_nnx

B, S, D_IN, D_OUT = 4, 16, 24, 32  # S, D_OUT, D_IN divisible by tp = 4; B by data = 2
IMPLEMENTATIONS = ("ffi", "xla")


def mesh_2x4():
  return jax.make_mesh((2, 4), ("data", "tp"), devices=test_util.cpu_devices(8),
                       axis_types=(AxisType.Auto, AxisType.Auto))


def params_np(layer):
  k = np.asarray(layer.kernel[...], np.float64)
  b = None if layer.bias is None else np.asarray(layer.bias[...], np.float64)
  return k, b


def dense(x, k, b):
  y = x @ k
  return y if b is None else y + b


def random_x(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def as_grads(tree):
  """nnx state of gradients -> {path: array}."""
  return {"/".join(map(str, p)): np.asarray(v[...] if hasattr(v, "get_value") else v)
          for p, v in nnx.to_flat_state(tree)}


class LayerTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = mesh_2x4()

  def make(self, cls, use_bias=True, **kw):
    with jax.set_mesh(self.mesh):
      d_in, d_out = (D_IN, D_OUT) if cls is tp_nnx.ColumnParallelLinear else (D_OUT, D_IN)
      layer = cls(d_in, d_out, use_bias=use_bias, rngs=nnx.Rngs(0), **kw)
      if use_bias:  # a nonzero bias, so that a bias bug shows
        layer.bias[...] = jax.device_put(
            random_x(7, layer.bias.shape, layer.bias[...].dtype), layer.bias[...].sharding)
    return layer

  def test_param_shardings(self):
    col, row = self.make(tp_nnx.ColumnParallelLinear), self.make(tp_nnx.RowParallelLinear)
    expected = {(col, "kernel"): P(None, "tp"), (col, "bias"): P("tp"),
                (row, "kernel"): P("tp", None), (row, "bias"): P(None)}
    for (layer, name), spec in expected.items():
      v = getattr(layer, name)
      self.assertEqual(v.get_metadata()["out_sharding"], tuple(spec))  # metadata
      self.assertTrue(v[...].sharding.is_equivalent_to(NamedSharding(self.mesh, spec),
                                                        v[...].ndim), v[...].sharding)
    specs = nnx.get_partition_spec(nnx.state(col))
    self.assertEqual(specs["kernel"].get_value(), P(None, "tp"))

  @parameterized.product(layer=("column", "row"), implementation=IMPLEMENTATIONS,
                         use_bias=(True, False))
  def test_forward_matches_dense(self, layer, implementation, use_bias):
    cls = tp_nnx.ColumnParallelLinear if layer == "column" else tp_nnx.RowParallelLinear
    lay = self.make(cls, use_bias=use_bias, implementation=implementation)
    x = random_x(1, (B, S, lay.in_features))
    with jax.set_mesh(self.mesh):
      y = nnx.jit(lambda m, x: m(x))(lay, x)
    ref = dense(np.asarray(x, np.float64), *params_np(lay))
    self.assertLess(test_util.rel_err(y, ref), 1e-5)
    out_spec = P("data", None, "tp") if layer == "column" else P("data", "tp", None)
    self.assertTrue(y.sharding.is_equivalent_to(NamedSharding(self.mesh, out_spec), 3),
                    y.sharding)

  @parameterized.product(layer=("column", "row"), implementation=IMPLEMENTATIONS)
  def test_grads_match_dense(self, layer, implementation):
    cls = tp_nnx.ColumnParallelLinear if layer == "column" else tp_nnx.RowParallelLinear
    lay = self.make(cls, implementation=implementation)
    x = random_x(2, (B, S, lay.in_features))
    w8 = jnp.cos(jnp.arange(B * S * lay.out_features, dtype=jnp.float32)).reshape(
        B, S, lay.out_features)

    def loss(m, x):
      return jnp.sum(jnp.sin(m(x)) * w8)

    with jax.set_mesh(self.mesh):
      (gm, gx) = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(lay, x)
    k, b = (jnp.asarray(a, jnp.float32) for a in params_np(lay))
    rk, rb, rx = jax.grad(lambda k, b, x: jnp.sum(jnp.sin(x @ k + b) * w8), (0, 1, 2))(k, b, x)
    self.assertLess(test_util.rel_err(gx, np.asarray(rx)), 1e-5)
    self.assertLess(test_util.rel_err(gm.kernel[...], np.asarray(rk)), 1e-5)
    self.assertLess(test_util.rel_err(gm.bias[...], np.asarray(rb)), 1e-5)
    # Parameter gradients come back sharded like the parameters.
    self.assertTrue(gm.kernel[...].sharding.is_equivalent_to(lay.kernel[...].sharding, 2))

  @parameterized.product(layer=("column", "row"), implementation=IMPLEMENTATIONS)
  def test_check_grads(self, layer, implementation):
    """Finite differences of the input and both parameters (fp32, reverse mode)."""
    cls = tp_nnx.ColumnParallelLinear if layer == "column" else tp_nnx.RowParallelLinear
    lay = self.make(cls, implementation=implementation)
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
    col = self.make(tp_nnx.ColumnParallelLinear, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    self.assertEqual(col.kernel[...].dtype, jnp.float32)
    x = random_x(4, (B, S, D_IN))
    with jax.set_mesh(self.mesh):
      y = col(x)
    self.assertEqual(y.dtype, jnp.bfloat16)
    self.assertLess(test_util.rel_err(y, dense(np.asarray(x, np.float64), *params_np(col))),
                    2e-2)
    row = self.make(tp_nnx.RowParallelLinear, param_dtype=jnp.bfloat16)
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

    col = self.make(tp_nnx.ColumnParallelLinear, implementation=recording)
    x = random_x(6, (B, S, D_IN))
    with jax.set_mesh(self.mesh):
      y = col(x)
      hlo = jax.jit(lambda x: col(x)).lower(x).compile().as_text()
    self.assertEqual(calls[0], (Schedule.AllGather1D_TilingCD_RotatingA, "tp",
                                (B // 2, S // 4, D_IN), (D_IN, D_OUT // 4)))
    self.assertLess(test_util.rel_err(y, dense(np.asarray(x, np.float64), *params_np(col))),
                    1e-5)
    c = test_util.collectives_in_hlo(hlo)
    self.assertEqual((c["jax_distgemm"], c["all-gather"]), (0, 1), c)  # XLA's all_gather
    with self.assertRaisesRegex(TypeError, "implementation"):
      self.make(tp_nnx.RowParallelLinear, implementation=3)

  def test_input_without_batch_dim_and_1d_mesh(self):
    mesh = test_util.mesh_1d(4)
    with jax.set_mesh(mesh):
      col = tp_nnx.ColumnParallelLinear(D_IN, D_OUT, rngs=nnx.Rngs(0), implementation="ffi")
      x = random_x(8, (S, D_IN))
      y = col(x)
    self.assertLess(test_util.rel_err(y, dense(np.asarray(x, np.float64), *params_np(col))),
                    1e-5)
    self.assertTrue(y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2))

  def test_errors(self):
    col = self.make(tp_nnx.ColumnParallelLinear)
    with self.assertRaisesRegex(ValueError, "no mesh"):
      col(random_x(0, (B, S, D_IN)))  # no jax.set_mesh and no mesh=
    with jax.set_mesh(self.mesh):
      with self.assertRaisesRegex(ValueError, "features"):
        col(random_x(0, (B, S, D_IN + 1)))
    with self.assertRaisesRegex(ValueError, "'model' is not an axis"):
      tp_nnx.ColumnParallelLinear(D_IN, D_OUT, axis="model", mesh=self.mesh,
                                  rngs=nnx.Rngs(0))


class MLPBlockTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = mesh_2x4()

  def reference(self, mlp, x):
    uk, ub = params_np(mlp.up)
    dk, db = params_np(mlp.down)
    return dense(np.asarray(jax.nn.gelu(dense(np.asarray(x, np.float64), uk, ub))), dk, db)

  @parameterized.parameters(*IMPLEMENTATIONS)
  def test_forward_backward_and_hlo(self, implementation):
    with jax.set_mesh(self.mesh):
      mlp = tp_nnx.ParallelMLP(D_IN, D_OUT * 2, rngs=nnx.Rngs(1), implementation=implementation)
      x = jax.device_put(random_x(9, (B, S, D_IN)),
                         NamedSharding(self.mesh, P("data", "tp", None)))
      y = mlp(x)
      self.assertLess(test_util.rel_err(y, self.reference(mlp, x)), 1e-5)
      # Output sequence-parallel like the input: blocks chain with no extra collective.
      self.assertTrue(y.sharding.is_equivalent_to(x.sharding, 3), y.sharding)

      graphdef, state = nnx.split(mlp)
      loss = lambda st, x: jnp.mean(nnx.merge(graphdef, st)(x) ** 2)
      grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
      gs, gx = grad(state, x)
      hlo = grad.lower(state, x).compile().as_text()

    def ref_loss(p, x):
      h = jax.nn.gelu(x @ p["up"]["kernel"] + p["up"]["bias"])
      return jnp.mean((h @ p["down"]["kernel"] + p["down"]["bias"]) ** 2)

    p = {n: {"kernel": jnp.asarray(getattr(mlp, n).kernel[...]),
             "bias": jnp.asarray(getattr(mlp, n).bias[...])} for n in ("up", "down")}
    rp, rx = jax.grad(ref_loss, (0, 1))(p, jnp.asarray(x))
    self.assertLess(test_util.rel_err(gx, np.asarray(rx)), 1e-5)
    for n in ("up", "down"):
      for k in ("kernel", "bias"):
        self.assertLess(test_util.rel_err(gs[n][k][...], np.asarray(rp[n][k])), 1e-5, (n, k))
    c = test_util.collectives_in_hlo(hlo)
    self.assertEqual(c["reduce-scatter"], 0, c)
    if implementation == "ffi":
      # Column AG+GEMM, Row GEMM+RS, and their duals in the backward.
      self.assertEqual(c["jax_distgemm"], 4, c)
      # The operands the weight-gradient GEMMs need gathered: x (re-gathered, as in Megatron)
      # and d out of the row layer (the custom call does not return it).
      self.assertEqual(c["all-gather"], 2, c)
    else:
      self.assertEqual(c["jax_distgemm"], 0, c)
      self.assertEqual(c["collective-permute"], 4 * 3, c)  # four rings of TP - 1 shifts
      self.assertEqual(c["all-gather"], 1, c)  # the row layer's d out comes from its ring

  def test_optimizer_steps_match_dense(self):
    """A few Adam steps of the block against the same steps on plain nnx.Linear layers."""
    import optax

    def step(model, opt, x, y):
      loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
      opt.update(model, g)
      return loss

    x = random_x(10, (B, S, D_IN))
    y = jnp.tanh(random_x(11, (B, S, D_IN)))
    with jax.set_mesh(self.mesh):
      mlp = tp_nnx.ParallelMLP(D_IN, 64, rngs=nnx.Rngs(2), implementation="ffi")
    ref = nnx.Sequential(nnx.Linear(D_IN, 64, rngs=nnx.Rngs(0)), jax.nn.gelu,
                         nnx.Linear(64, D_IN, rngs=nnx.Rngs(0)))
    for dst, src in zip(ref.layers[::2], (mlp.up, mlp.down)):
      dst.kernel[...] = jnp.asarray(np.asarray(src.kernel[...]))
      dst.bias[...] = jnp.asarray(np.asarray(src.bias[...]))
    with jax.set_mesh(self.mesh):
      opt = nnx.Optimizer(mlp, optax.adam(1e-2), wrt=nnx.Param)
      tp_losses = [float(nnx.jit(step)(mlp, opt, x, y)) for _ in range(4)]
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    ref_losses = [float(nnx.jit(step)(ref, ref_opt, x, y)) for _ in range(4)]
    np.testing.assert_allclose(tp_losses, ref_losses, rtol=1e-4)
    self.assertLess(tp_losses[-1], tp_losses[0])


if __name__ == "__main__":
  absltest.main()

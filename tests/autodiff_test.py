"""Gradients of the collective matmuls (jax_distgemm/_src/autodiff.py) on 8 fake CPU devices.

Every schedule, implementations "ffi" (the CPU executor) and "xla" (ppermute ring; "reference"
and None too where the gradient is compared with JAX's), with and without batch dims: the custom VJP is compared with jax.grad of the reference (XLA all_gather +
dot / dot + psum_scatter, differentiated by JAX itself) and with finite differences
(jax.test_util.check_grads).  The HLO of the backward shows which collectives it runs.  Layers
stacked with lax.scan, with and without jax.checkpoint, too.
"""

from __future__ import annotations

import test_util  # noqa: I001  (first: configures JAX before it initializes)

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_distgemm
from jax_distgemm import Schedule
from jax_distgemm._src import autodiff
from jax_distgemm._src import reference

AG_A, AG_B, RS_A, RS_B = tuple(Schedule)
TP = 8
# Global sizes: M, N divisible by TP; K (unsharded) is not a multiple of TP for the AllGather
# schedules, K_RS (sharded) is for the ReduceScatter ones.
M, K, K_RS, N = 16, 24, 64, 32
BATCHES = {"2d": (), "batched": (3,), "batched_w": (2,)}  # batched_w: w carries the batch too
GRAD_TOL = 2e-5  # relative (Frobenius), fp32 vs the fp32 XLA reference


def _shapes(schedule: Schedule, batch: tuple, w_batched: bool):
  k = K if schedule.is_all_gather else K_RS
  w_batch = batch if w_batched else ()
  return batch + (M, k), w_batch + (k, N), batch + (M, N)


def _sharded(mesh, schedule, batch, w_batched, seed=0, with_c=False, dtype=jnp.float32):
  x_spec, w_spec, out_spec = test_util.specs(schedule, len(batch), w_batched=w_batched)
  xs, ws, cs = _shapes(schedule, batch, w_batched)
  x, w, c = test_util.random_inputs(seed, xs, ws, dtype, c_shape=cs if with_c else None)
  put = lambda a, s: None if a is None else jax.device_put(a, NamedSharding(mesh, s))
  return (put(x, x_spec), put(w, w_spec), put(c, out_spec)), (x_spec, w_spec, out_spec)


def _loss(mesh, schedule, specs, op, **kwargs):
  """A scalar of the sharded output that weights every element differently (not just a sum)."""
  x_spec, w_spec, out_spec = specs

  def f(x, w, c=None):
    in_specs = (x_spec, w_spec) + (() if c is None else (out_spec,))
    body = lambda *a: op(*a, axis_name="tp", schedule=schedule, **kwargs)
    out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(
        *((x, w) + (() if c is None else (c,))))
    return jnp.sum(jnp.sin(out.astype(jnp.float32)) * jnp.cos(jnp.arange(out.size).reshape(
        out.shape)))
  return f


def _ours(impl):
  return lambda *a, **kw: jax_distgemm.distributed_matmul(*a, implementation=impl, **kw)


def _reference(*args, **kw):
  """The reference, differentiated by JAX (no custom VJP involved)."""
  return reference.distributed_matmul(*args, **kw)


class AutodiffTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = test_util.mesh_1d(TP)

  def assertClose(self, got, want, tol=GRAD_TOL, what=""):
    self.assertEqual(got.shape, want.shape, what)
    self.assertEqual(got.dtype, want.dtype, what)
    err = test_util.rel_err(got, np.asarray(want, np.float64))
    self.assertLess(err, tol, f"{what}: relative error {err:.2e}")

  # Every implementation's custom VJP against JAX's own gradient (None is "ffi" on CPU).
  @parameterized.product(schedule=tuple(Schedule), implementation=("ffi", "xla", "reference"),
                         batch=tuple(BATCHES))
  def test_grad_matches_reference(self, schedule, implementation, batch):
    (x, w, _), specs = _sharded(self.mesh, schedule, BATCHES[batch], batch == "batched_w")
    ours = jax.jit(jax.grad(_loss(self.mesh, schedule, specs, _ours(implementation)), (0, 1)))
    ref = jax.jit(jax.grad(_loss(self.mesh, schedule, specs, _reference), (0, 1)))
    for seed in range(2):  # a second call with fresh data: no state kept between calls
      (x, w, _), _ = _sharded(self.mesh, schedule, BATCHES[batch], batch == "batched_w", seed)
      (dx, dw), (rx, rw) = ours(x, w), ref(x, w)
      self.assertClose(dx, rx, what="dx")
      self.assertClose(dw, rw, what="dw")
      # Gradients come back with the operands' shardings.
      self.assertTrue(dx.sharding.is_equivalent_to(x.sharding, x.ndim), dx.sharding)
      self.assertTrue(dw.sharding.is_equivalent_to(w.sharding, w.ndim), dw.sharding)

  @parameterized.product(schedule=tuple(Schedule), implementation=("ffi", "xla"))
  def test_epilogue_grads(self, schedule, implementation):
    """alpha scales dx and dw; dc = beta * d out (in c's dtype)."""
    (x, w, c), specs = _sharded(self.mesh, schedule, (2,), False, with_c=True)
    kw = dict(alpha=-0.75, beta=1.5)
    ours = jax.jit(jax.grad(_loss(self.mesh, schedule, specs, _ours(implementation), **kw),
                            (0, 1, 2)))
    ref = jax.jit(jax.grad(_loss(self.mesh, schedule, specs, _reference, **kw), (0, 1, 2)))
    for got, want, what in zip(ours(x, w, c), ref(x, w, c), ("dx", "dw", "dc")):
      self.assertClose(got, want, what=what)

  # One implementation: the rule is the same for all (test_grad_matches_reference runs each).
  @parameterized.product(schedule=tuple(Schedule), implementation=("ffi",))
  def test_check_grads(self, schedule, implementation):
    """Finite differences (jax.test_util.check_grads, reverse mode) of x and w together."""
    (x, w, _), specs = _sharded(self.mesh, schedule, (2,), False)
    f = jax.jit(_loss(self.mesh, schedule, specs, _ours(implementation), alpha=0.5))
    # fp32 central differences: eps and tolerances sized for float32 round-off.
    check_grads(f, (x, w), order=1, modes=("rev",), eps=1e-2, atol=5e-2, rtol=5e-2)

  @parameterized.product(schedule=tuple(Schedule), implementation=("ffi",))
  def test_second_order(self, schedule, implementation):
    """The backward runs the dual op through the same custom VJP: grad of grad works."""
    (x, w, _), specs = _sharded(self.mesh, schedule, (), False)
    v = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)),
                     (x, w))

    def hvp(loss):
      g = jax.grad(loss, (0, 1))
      return jax.jit(lambda x, w: jax.grad(
          lambda x, w: sum(jnp.vdot(a, b) for a, b in zip(g(x, w), v)), (0, 1))(x, w))

    ours = hvp(_loss(self.mesh, schedule, specs, _ours(implementation)))(x, w)
    ref = hvp(_loss(self.mesh, schedule, specs, _reference))(x, w)
    for got, want, what in zip(ours, ref, ("d2x", "d2w")):
      self.assertClose(got, want, tol=1e-4, what=what)

  @parameterized.product(schedule=tuple(Schedule), implementation=("ffi", "xla"))
  def test_data_parallel_2x4_mesh(self, schedule, implementation):
    """("data", "tp") mesh, batch data-sharded, w replicated over data: dw is psum'd over data."""
    mesh = jax.sharding.Mesh(np.array(test_util.cpu_devices(8)).reshape(2, 4), ("data", "tp"))
    batch = (4,)
    x_spec, w_spec, out_spec = test_util.specs(schedule, 1)
    specs = (P("data", *x_spec[1:]), w_spec, P("data", *out_spec[1:]))
    k = K if schedule.is_all_gather else K_RS
    x, w, _ = test_util.random_inputs(3, batch + (M, k), (k, N), jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, specs[0]))
    w = jax.device_put(w, NamedSharding(mesh, specs[1]))
    ours = jax.jit(jax.grad(_loss(mesh, schedule, specs, _ours(implementation)), (0, 1)))
    ref = jax.jit(jax.grad(_loss(mesh, schedule, specs, _reference), (0, 1)))
    for got, want, what in zip(ours(x, w), ref(x, w), ("dx", "dw")):
      self.assertClose(got, want, what=what)
    hlo = ours.lower(x, w).compile().as_text()
    self.assertEqual(test_util.collectives_in_hlo(hlo)["all-reduce"], 1, "psum of dw over data")

  @parameterized.parameters(*Schedule)
  def test_mixed_precision_dtypes(self, schedule):
    """bf16 operands, fp32 output: cotangents come back in the operands' dtype."""
    (x, w, _), specs = _sharded(self.mesh, schedule, (2,), False, dtype=jnp.bfloat16)
    kw = dict(out_dtype=jnp.float32)
    dx, dw = jax.jit(jax.grad(_loss(self.mesh, schedule, specs, _ours("ffi"), **kw), (0, 1)))(
        x, w)
    rx, rw = jax.jit(jax.grad(_loss(self.mesh, schedule, specs, _reference, **kw), (0, 1)))(
        x, w)
    self.assertEqual((dx.dtype, dw.dtype), (jnp.bfloat16, jnp.bfloat16))
    # The reference's transpose keeps the fp32 cotangent; ours rounds it to bf16 first.
    self.assertClose(dx, rx, tol=2e-2, what="dx")
    self.assertClose(dw, rw, tol=2e-2, what="dw")

  def test_public_wrappers_are_differentiable(self):
    """all_gather_matmul / matmul_reduce_scatter go through the same custom VJP."""
    for schedule, op in ((AG_A, lambda x, w, **kw: jax_distgemm.all_gather_matmul(
        x, w, gathered="x", **kw)), (RS_B, lambda x, w, **kw: jax_distgemm.matmul_reduce_scatter(
            x, w, scatter="cols", **kw))):
      (x, w, _), specs = _sharded(self.mesh, schedule, (), False)
      wrapped = lambda x, w, *, schedule, **kw: op(x, w, implementation="ffi", **kw)
      got = jax.jit(jax.grad(_loss(self.mesh, schedule, specs, wrapped), (0, 1)))(x, w)
      want = jax.jit(jax.grad(_loss(self.mesh, schedule, specs, _reference), (0, 1)))(x, w)
      for g, r in zip(got, want):
        self.assertClose(g, r, what=schedule.name)

  @parameterized.product(implementation=("ffi", "xla"), remat=(False, True))
  def test_scan_over_layers(self, implementation, remat):
    """A sequence-parallel MLP block stacked with lax.scan (optionally jax.checkpoint'ed), as
    models stack layers: value and gradients equal JAX's own through the reference."""
    layers, m, d, f = 3, 32, 16, 64
    rng = np.random.default_rng(7)
    h = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((layers, d, f)) / 4, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((layers, f, d)) / 8, jnp.float32)
    specs = (P("tp", None), P(None, None, "tp"), P(None, "tp", None))
    args = [jax.device_put(a, NamedSharding(self.mesh, s)) for a, s in zip((h, w1, w2), specs)]

    def loss(op):
      def layer(x, ws):  # AllGather up projection, ReduceScatter down projection
        up = op(x, ws[0], axis_name="tp", schedule=AG_A)
        return x + op(jnp.tanh(up), ws[1], axis_name="tp", schedule=RS_A), None
      step = jax.checkpoint(layer) if remat else layer
      body = lambda x, a, b: jax.lax.scan(step, x, (a, b))[0]
      out = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=P("tp", None))
      return lambda *a: jnp.sum(jnp.sin(out(*a)))

    got = jax.jit(jax.value_and_grad(loss(_ours(implementation)), (0, 1, 2)))(*args)
    want = jax.jit(jax.value_and_grad(loss(_reference), (0, 1, 2)))(*args)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for g, r, what in zip(got[1], want[1], ("dh", "dw1", "dw2")):
      self.assertClose(g, r, what=what)

  def test_forward_mode_is_refused(self):
    (x, w, _), specs = _sharded(self.mesh, AG_A, (), False)
    f = jax.jit(_loss(self.mesh, AG_A, specs, _ours("xla")))
    with self.assertRaisesRegex(TypeError, "forward-mode autodiff.*custom_vjp"):
      jax.jvp(f, (x, w), (x, w))


def _loss_with_operand(mesh, schedule, specs, op, use_operand=True):
  """Like _loss, of (out, gathered operand) = op(x, w); the operand (every device's copy)
  weighted too unless use_operand is False."""
  x_spec, w_spec, out_spec = specs

  def f(x, w):
    def body(x, w):
      out, g = op(x, w, axis_name="tp", schedule=schedule)
      return out, g[None]

    out, g = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec),
                           out_specs=(out_spec, P("tp")))(x, w)
    weigh = lambda a, f: jnp.sum(f(a.astype(jnp.float32)) *
                                 jnp.cos(jnp.arange(a.size).reshape(a.shape) * 0.37))
    return weigh(out, jnp.sin) + (weigh(g, jnp.tanh) if use_operand else 0.0)
  return f


class GatheredOperandGradTest(parameterized.TestCase):
  """return_gathered=True: the operand's cotangent reaches x (RotatingA) or w (RotatingB)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = test_util.mesh_1d(TP)

  @parameterized.product(schedule=(AG_A, AG_B), implementation=("ffi", "xla", "reference"),
                         batch=tuple(BATCHES))
  def test_grad_matches_reference(self, schedule, implementation, batch):
    w_batched = batch == "batched_w"
    (x, w, _), specs = _sharded(self.mesh, schedule, BATCHES[batch], w_batched)
    ours = lambda *a, **kw: jax_distgemm.distributed_matmul(
        *a, implementation=implementation, alpha=0.75, return_gathered=True, **kw)
    ref = lambda *a, **kw: reference.distributed_matmul(*a, alpha=0.75, with_operand=True, **kw)
    got = jax.jit(jax.grad(_loss_with_operand(self.mesh, schedule, specs, ours), (0, 1)))(x, w)
    want = jax.jit(jax.grad(_loss_with_operand(self.mesh, schedule, specs, ref), (0, 1)))(x, w)
    for name, g, r in zip(("dx", "dw"), got, want):
      self.assertEqual(g.shape, r.shape, name)
      err = test_util.rel_err(g, np.asarray(r, np.float64))
      self.assertLess(err, GRAD_TOL, f"{name}: relative error {err:.2e}")

  @parameterized.parameters(AG_A, AG_B)
  def test_unused_operand_costs_no_reduce_scatter(self, schedule):
    # Its cotangent is a symbolic zero (custom_vjp symbolic_zeros): the backward is the plain
    # one, the dual fused op and one re-gather, as without return_gathered.
    (x, w, _), specs = _sharded(self.mesh, schedule, (2,), False)
    ours = lambda *a, **kw: jax_distgemm.distributed_matmul(
        *a, implementation="ffi", return_gathered=True, **kw)
    f = jax.grad(_loss_with_operand(self.mesh, schedule, specs, ours, use_operand=False), (0, 1))
    counts = test_util.collectives_in_hlo(jax.jit(f).lower(x, w).compile().as_text())
    self.assertEqual(counts["jax_distgemm"], 2, counts)
    self.assertEqual(counts["reduce-scatter"] + counts["all-reduce"], 0, counts)
    self.assertEqual(counts["all-gather"], 1, counts)
    # Used, it is one reduce-scatter more.
    f = jax.grad(_loss_with_operand(self.mesh, schedule, specs, ours), (0, 1))
    counts = test_util.collectives_in_hlo(jax.jit(f).lower(x, w).compile().as_text())
    self.assertEqual(counts["reduce-scatter"], 1, counts)


class BackwardHloTest(parameterized.TestCase):
  """Which collectives each backward runs (see the table in autodiff.py)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = test_util.mesh_1d(TP)

  def _counts(self, schedule, implementation, grad=True):
    (x, w, _), specs = _sharded(self.mesh, schedule, (2,), False)
    f = _loss(self.mesh, schedule, specs, _ours(implementation))
    f = jax.grad(f, (0, 1)) if grad else f
    return test_util.collectives_in_hlo(jax.jit(f).lower(x, w).compile().as_text())

  @parameterized.parameters(*Schedule)
  def test_ffi_backward_is_the_dual_fused_op(self, schedule):
    fwd = self._counts(schedule, "ffi", grad=False)
    self.assertEqual(fwd["jax_distgemm"], 1)
    self.assertEqual(fwd["all-gather"] + fwd["reduce-scatter"], 0)
    both = self._counts(schedule, "ffi")
    # Forward + the dual fused op; no XLA reduce-scatter anywhere.  AllGather forwards: one
    # all-gather, the forward's operand re-gathered for the local GEMM.  ReduceScatter
    # forwards: none, the dual AllGather returns the gathered d out (its second result).
    self.assertEqual(both["jax_distgemm"], 2, both)
    self.assertEqual(both["reduce-scatter"], 0, both)
    self.assertEqual(both["all-gather"], 1 if schedule.is_all_gather else 0, both)
    self.assertEqual(both["collective-permute"] + both["all-reduce"], 0, both)

  @parameterized.parameters(RS_A, RS_B)
  def test_xla_ring_reuses_the_gathered_cotangent(self, schedule):
    both = self._counts(schedule, "xla")
    # Forward ring + backward ring, TP - 1 shifts each; AG(d out) comes from the backward ring.
    self.assertEqual(both["collective-permute"], 2 * (TP - 1), both)
    self.assertEqual(both["all-gather"] + both["reduce-scatter"] + both["jax_distgemm"], 0, both)

  @parameterized.parameters(AG_A, AG_B)
  def test_xla_ring_regathers_the_forward_operand(self, schedule):
    both = self._counts(schedule, "xla")
    self.assertEqual(both["collective-permute"], 2 * (TP - 1), both)
    self.assertEqual(both["all-gather"], 1, both)  # x (RotatingA) or w (RotatingB), re-gathered

  def test_op_sets_pair_each_schedule_with_its_dual(self):
    for s, op in autodiff.OP_SETS.items():
      self.assertEqual(op.forward, s)
      self.assertNotEqual(op.backward.is_all_gather, s.is_all_gather)
      self.assertEqual(autodiff.OP_SETS[op.backward].backward, s)  # the pairing is symmetric


class GradUnderVmapTest(absltest.TestCase):

  def test_vmap_of_grad_runs_the_ring(self):
    # jax.vmap(jax.grad(f)): the vmap's tracer sits under the JVP's, and must still be seen
    # (else None picked the fused call, which has no rule outside a mesh).
    x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (2, 128, 256), jnp.float32)
    probe = jax.random.normal(jax.random.key(3), (2, 128, 256), jnp.float32)

    def grads(op):
      return jax.vmap(jax.grad(lambda x, w, p: jnp.sum(op(x, w) * p), (0, 1)),
                      axis_name="v")(x, w, probe)

    got = grads(lambda x, w: jax_distgemm.all_gather_matmul(x, w, axis_name="v"))
    want = grads(lambda x, w: jax.lax.all_gather(x, "v", axis=0, tiled=True) @ w)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


if __name__ == "__main__":
  absltest.main()

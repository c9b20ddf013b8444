"""jit-level entry point (jax_distgemm.collective_matmul) on 8 fake CPU devices.

The rule table (jax_distgemm/_src/sharding_rules.py) on PartitionSpecs alone; then every
schedule end to end on a 1-D "tp" mesh and a 2x4 ("data", "tp") mesh, through the explicit
shard_map path (concrete NamedSharding'd arrays, in_specs=, Explicit mesh axes) and the
automatic one (custom_partitioning with a Shardy rule inside jax.jit), with HLO assertions,
errors and the plain-dot fallback, and gradients.
"""

from __future__ import annotations

import test_util  # noqa: I001  (first: configures JAX before it initializes)

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_distgemm
from jax_distgemm import Schedule
from jax_distgemm._src import config
from jax_distgemm._src import sharding_rules as rules

AG_A, AG_B, RS_A, RS_B = tuple(Schedule)
B, M, K, N = 4, 16, 32, 24  # global; M, N, K divisible by 8; B by 2


def mesh_2x4(axis_types=(AxisType.Auto, AxisType.Auto)):
  return jax.make_mesh((2, 4), ("data", "tp"), devices=test_util.cpu_devices(8),
                       axis_types=axis_types)


def layout(schedule: Schedule, data: bool):
  """(x_spec, w_spec, out_spec) of [B, M, K] @ [K, N] for `schedule`; B over "data" if data."""
  b = "data" if data else None
  if schedule.is_all_gather:
    x, w = P(b, "tp", None), P(None, "tp")
  else:
    x, w = P(b, None, "tp"), P("tp", None)
  out = {AG_A: P(b, None, "tp"), AG_B: P(b, "tp", None), RS_A: P(b, "tp", None),
         RS_B: P(b, None, "tp")}[schedule]
  return x, w, out


def put(mesh, x_spec, w_spec, seed=0, x_shape=(B, M, K), w_shape=(K, N)):
  x, w, _ = test_util.random_inputs(seed, x_shape, w_shape, jnp.float32)
  return (x, w), (jax.device_put(x, NamedSharding(mesh, x_spec)),
                  jax.device_put(w, NamedSharding(mesh, w_spec)))


def counts(f, *args):
  return test_util.collectives_in_hlo(jax.jit(f).lower(*args).compile().as_text())


class RuleTableTest(parameterized.TestCase):
  """rules.plan on PartitionSpecs only."""

  def check(self, x, w, out, schedule, out_spec=None, psum=(), x_ndim=3, w_ndim=2):
    p = rules.plan(x, w, out, x_ndim=x_ndim, w_ndim=w_ndim)
    self.assertEqual(p.schedule, schedule, p.reason)
    if out_spec is not None:
      self.assertEqual(rules.trim_spec(p.out_spec), rules.trim_spec(out_spec))
    self.assertEqual(p.psum_axes, psum)
    return p

  @parameterized.product(schedule=tuple(Schedule), data=(False, True))
  def test_the_four_rows(self, schedule, data):
    x, w, out = layout(schedule, data)
    self.check(x, w, out, schedule, out_spec=out)

  def test_defaults_when_out_is_not_given(self):
    self.check(P(None, "tp", None), P(None, "tp"), None, AG_A, out_spec=P(None, None, "tp"))
    self.check(P(None, None, "tp"), P("tp", None), None, RS_A, out_spec=P(None, "tp", None))

  def test_other_axes_pass_through(self):
    # Rows sharded over ("data", "tp"): the gather is over tp only, out rows stay on data.
    self.check(P(("data", "tp"), None), P(None, "tp"), P("data", "tp"), AG_A, x_ndim=2)
    self.check(P(("data", "tp"), None), P(None, "tp"), P(("data", "tp"), None), AG_B,
               x_ndim=2)
    # w columns over ("pipe", "tp") for RotatingB: out columns keep "pipe".
    self.check(P("tp", None), P(None, ("pipe", "tp")), P("tp", "pipe"), AG_B, x_ndim=2)
    # ReduceScatter rows: out rows are x's rows then tp.
    self.check(P("data", None, "tp"), P("tp", None), P("data", "tp", None), RS_A)
    self.check(P(None, "data", "tp"), P("tp", None), P(None, ("data", "tp"), None), RS_A)
    # A batched w sharded like x on the batch dims.
    self.check(P("data", "tp", None), P("data", None, "tp"), P("data", None, "tp"), AG_A,
               w_ndim=3)

  def test_contraction_over_other_axes_is_psummed(self):
    self.check(P(None, ("data", "tp")), P(("data", "tp"), None), P("tp", None), RS_A,
               psum=("data",), x_ndim=2)
    self.check(P("tp", "data"), P("data", "tp"), P(None, "tp"), AG_A, psum=("data",),
               x_ndim=2)

  @parameterized.named_parameters(
      ("tp_on_batch", P("tp", None, None), P(None, "tp"), None, "x's batch 0"),
      ("x_rows_w_contraction", P(None, "tp", None), P("tp", None), None, "x's M and w's K"),
      ("x_contraction_w_cols", P(None, None, "tp"), P(None, "tp"), None, "x's K and w's N"),
      ("replicated", P(), P(), None,
       "on x (not sharded over it) and w (not sharded over it)"),
      ("out_not_on_tp", P(None, "tp", None), P(None, "tp"), P(None, None, None),
       "out_sharding P(None, None, None) has it nowhere"),
      ("tp_not_minor", P(None, ("tp", "data"), None), P(None, "tp"), None, "minor"),
      ("contraction_differs", P(None, None, ("data", "tp")), P("tp", None), None,
       "sharded alike on the contraction"),
      ("out_replicated", P(None, "tp", None), P(None, "tp"), P(), "out_sharding"),
      ("out_on_batch", P(None, None, "tp"), P("tp", None), P("tp", None, None), "out_sharding"),
      ("out_other_axes_differ", P(None, "tp", None), P(None, "tp"), P("data", None, "tp"),
       "pass through"),
      ("axis_used_twice", P(None, ("data", "tp"), None), P(None, ("data", "tp")),
       P(None, "tp", "data"), "twice"),
  )
  def test_no_rule(self, x, w, out, message):
    p = rules.plan(x, w, out, x_ndim=3, w_ndim=2)
    self.assertIsNone(p.schedule)
    self.assertIn(message, p.reason)

  def test_fsdp_weight_is_gathered_over_its_other_axes(self):
    # w's K carries "fsdp", x's does not: the plan lays w out without it (XLA all-gathers w
    # over "fsdp" first, as FSDP does); the contraction was refused before.
    p = self.check(P("data", "tp", None), P("fsdp", "tp"), None, AG_A)
    self.assertEqual(rules.trim_spec(p.w_spec), P(None, "tp"))
    p = self.check(P("data", None, "tp"), P(("fsdp", "tp"), None), None, RS_A)
    self.assertEqual(rules.trim_spec(p.w_spec), P("tp"))

  @parameterized.named_parameters(
      ("on_n", P(None, None, "tp"), AG_A, P("data", None, "tp")),
      ("on_m", P(None, "tp", None), AG_B, P("data", "tp")),
      ("on_batch", P("tp", None, None), AG_A, P("data", None, "tp")),
      ("not_minor", P(None, ("tp", "data"), None), AG_A, P("data", None, "tp")),
  )
  def test_out_hint_only_places_tp(self, hint, schedule, out):
    # What Shardy propagates back from the result's users says where "tp" goes, at most;
    # other axes are the plan's (XLA reshards), and an unusable hint gives the default.
    p = rules.plan(P("data", "tp", None), P(None, "tp"), hint, x_ndim=3, w_ndim=2,
                          out_is_hint=True)
    self.assertEqual(p.schedule, schedule, p.reason)
    self.assertEqual(rules.trim_spec(p.out_spec), out)

  def test_batched_w_must_match_x(self):
    p = rules.plan(P("data", "tp", None), P(None, None, "tp"), None, x_ndim=3, w_ndim=3)
    self.assertIsNone(p.schedule)
    self.assertIn("batched w", p.reason)

  def test_dot_plan_gathers_only_what_the_dot_needs(self):
    # Backward of RotatingA, dw = xT @ g: x re-gathered over tp, partial sums over data.
    d = rules.dot_plan(P(None, ("data", "tp")), P("data", "tp"), 2, 2)
    self.assertEqual(d.x_spec, P(None, "data"))
    self.assertEqual(d.w_spec, P("data", "tp"))
    self.assertEqual(d.out_spec, P(None, "tp"))
    self.assertEqual(d.psum_axes, ("data",))


class ExplicitPathTest(parameterized.TestCase):
  """Shardings known at trace time: one jax.shard_map over the whole mesh."""

  @parameterized.product(schedule=tuple(Schedule), mesh_kind=("1d", "2x4"),
                         implementation=("ffi", "xla"))
  def test_concrete_arrays(self, schedule, mesh_kind, implementation):
    mesh = test_util.mesh_1d(8) if mesh_kind == "1d" else mesh_2x4()
    x_spec, w_spec, out_spec = layout(schedule, data=mesh_kind == "2x4")
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    out = jax_distgemm.collective_matmul(xd, wd, out_sharding=NamedSharding(mesh, out_spec),
                                         implementation=implementation)
    self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
    self.assertTrue(out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 3),
                    out.sharding)
    # The same call under jit with in_specs: HLO holds the fused op and no XLA gather/scatter.
    f = lambda a, b: jax_distgemm.collective_matmul(
        a, b, in_specs=(x_spec, w_spec), out_sharding=NamedSharding(mesh, out_spec),
        implementation=implementation)
    c = counts(f, xd, wd)
    self.assertEqual(c["all-gather"] + c["reduce-scatter"] + c["all-reduce"], 0, c)
    if implementation == "ffi":
      self.assertEqual(c["jax_distgemm"], 1, c)
    else:
      tp = mesh.shape["tp"]
      self.assertEqual(c["collective-permute"], tp - 1, c)  # the ring: TP - 1 shifts
      self.assertEqual(c["jax_distgemm"], 0, c)

  def test_pspec_out_sharding_and_default(self):
    mesh = test_util.mesh_1d(8)
    (x, w), (xd, wd) = put(mesh, P(None, None, "tp"), P("tp", None))
    ref = test_util.reference_np(x, w)
    out = jax_distgemm.collective_matmul(xd, wd, out_sharding=P(None, None, "tp"))
    self.assertTrue(out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "tp")), 3))
    self.assertLess(test_util.rel_err(out, ref), 1e-5)
    out = jax_distgemm.collective_matmul(xd, wd)  # default for the ReduceScatter family: rows
    self.assertTrue(out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 3))
    self.assertLess(test_util.rel_err(out, ref), 1e-5)

  def test_alpha_out_dtype_and_batched_w(self):
    mesh = mesh_2x4()
    (x, w), (xd, wd) = put(mesh, P("data", "tp", None), P("data", None, "tp"),
                           w_shape=(B, K, N))
    out = jax_distgemm.collective_matmul(xd, wd, alpha=-0.5, out_dtype=jnp.bfloat16)
    self.assertEqual(out.dtype, jnp.bfloat16)
    self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w, alpha=-0.5)), 1e-2)

  def test_no_rule_raises_a_clear_error(self):
    mesh = test_util.mesh_1d(8)
    _, (xd, wd) = put(mesh, P(None, "tp", None), P("tp", None))
    with self.assertRaisesRegex(ValueError, r"x's M and w's K.*fallback='dot'"):
      jax_distgemm.collective_matmul(xd, wd)
    with self.assertRaisesRegex(ValueError, "fallback: expected"):
      jax_distgemm.collective_matmul(xd, wd, fallback="psum")

  @parameterized.parameters("1d", "2x4")
  def test_fallback_dot(self, mesh_kind):
    mesh = test_util.mesh_1d(8) if mesh_kind == "1d" else mesh_2x4()
    (x, w), (xd, wd) = put(mesh, P(None, "tp", None), P("tp", None))
    out_sharding = NamedSharding(mesh, P(None, None, "tp"))
    out = jax_distgemm.collective_matmul(xd, wd, out_sharding=out_sharding, fallback="dot")
    self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
    self.assertTrue(out.sharding.is_equivalent_to(out_sharding, 3), out.sharding)
    c = counts(lambda a, b: jax_distgemm.collective_matmul(
        a, b, in_specs=(P(None, "tp", None), P("tp", None)), out_sharding=out_sharding,
        fallback="dot"), xd, wd)
    self.assertEqual(c["jax_distgemm"], 0, c)
    # The fused path's rules on alpha and dtypes hold for the plain dot too: no NaN alpha,
    # no integer output, no int8 dot saturating in its own dtype.
    with self.assertRaisesRegex(ValueError, "alpha: must be finite"):
      jax_distgemm.collective_matmul(xd, wd, alpha=float("nan"), fallback="dot")
    with self.assertRaisesRegex(TypeError, "out_dtype: int32 is not supported"):
      jax_distgemm.collective_matmul(xd, wd, out_dtype=jnp.int32, fallback="dot")
    xi, wi = (jax.device_put(np.asarray(a, np.int8), a.sharding) for a in (xd, wd))
    with self.assertRaisesRegex(TypeError, "x: dtype int8 is not supported"):
      jax_distgemm.collective_matmul(xi, wi, fallback="dot")

  def test_mesh_errors(self):
    mesh = test_util.mesh_1d(8)
    x, w, _ = test_util.random_inputs(0, (M, K), (K, N), jnp.float32)
    with self.assertRaisesRegex(ValueError, "mesh: not given .*operands are not sharded"):
      jax_distgemm.collective_matmul(np.asarray(x), np.asarray(w))
    with self.assertRaisesRegex(ValueError, r"mesh: not given .*in_specs= names mesh axes but "
                                "not the mesh.*pass mesh="):
      jax_distgemm.collective_matmul(np.asarray(x), np.asarray(w),
                                     in_specs=(P("tp", None), P(None, "tp")))
    _, (xd, wd) = put(mesh, P("tp", None), P(None, "tp"), x_shape=(M, K))
    with self.assertRaisesRegex(ValueError, "'model' is not an axis"):
      jax_distgemm.collective_matmul(xd, wd, axis="model")
    # out_sharding on another mesh: refused, not silently placed on the operands' devices.
    other = jax.sharding.Mesh(np.array(test_util.cpu_devices(8)[::-1]), ("tp",))
    with self.assertRaisesRegex(ValueError, r"out_sharding: its mesh \(axes \('tp',\), devices "
                                r"\[7, 6, 5, 4, 3, 2, 1, 0\]\) is not the mesh the op runs on"):
      jax_distgemm.collective_matmul(xd, wd, out_sharding=NamedSharding(other, P(None, "tp")))
    with self.assertRaisesRegex(ValueError, r"in_specs: expected \(x_spec, w_spec\), two "
                                "PartitionSpecs"):
      jax_distgemm.collective_matmul(xd, wd, in_specs=(P("tp", None),))

  @parameterized.parameters(*Schedule)
  def test_explicit_mesh_axes(self, schedule):
    """Inside jit with Explicit axes the tracers carry their shardings: shard_map path."""
    mesh = mesh_2x4(axis_types=(AxisType.Explicit,) * 2)
    x_spec, w_spec, out_spec = layout(schedule, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    with jax.set_mesh(mesh):
      f = jax.jit(lambda a, b: jax_distgemm.collective_matmul(a, b, out_sharding=out_spec))
      out = f(xd, wd)
      self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
      self.assertEqual(rules.trim_spec(out.sharding.spec), rules.trim_spec(out_spec))
      c = counts(f, xd, wd)
      self.assertEqual((c["jax_distgemm"], c["all-gather"], c["reduce-scatter"]), (1, 0, 0), c)
      # out_sharding as a NamedSharding on the concrete mesh, the operands' being abstract.
      out = jax.jit(lambda a, b: jax_distgemm.collective_matmul(
          a, b, out_sharding=NamedSharding(mesh, out_spec)))(xd, wd)
      self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
      # The plain-dot fallback in Explicit mode (replicated output requested).
      out = jax.jit(lambda a, b: jax_distgemm.collective_matmul(
          a, b, out_sharding=P("data"), fallback="dot"))(xd, wd)
      self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)


  def test_explicit_mesh_without_set_mesh(self):
    # The mesh comes from the operands: fallback="dot" resharded with bare PartitionSpecs
    # (JAX: "Using PartitionSpec when you are not under a mesh context is not allowed"), and
    # in_specs= were not applied (shard_map: "in_specs ... does not match").
    mesh = mesh_2x4(axis_types=(AxisType.Explicit,) * 2)
    (x, w), (xd, wd) = put(mesh, P("data", "tp", None), P("tp", None))  # no schedule fits
    (_, _), (xr, wr) = put(mesh, P(), P())  # replicated: not the in_specs below
    ref = test_util.reference_np(x, w)
    for wrap in (lambda f: f, jax.jit):
      with self.subTest(jit=wrap is jax.jit):
        out = wrap(lambda a, b: jax_distgemm.collective_matmul(a, b, fallback="dot"))(xd, wd)
        self.assertLess(test_util.rel_err(out, ref), 1e-5)
        out = wrap(lambda a, b: jax_distgemm.collective_matmul(
            a, b, mesh=mesh, in_specs=(P("data", "tp", None), P(None, "tp"))))(xr, wr)
        self.assertLess(test_util.rel_err(out, ref), 1e-5)
        self.assertEqual(rules.trim_spec(out.sharding.spec), P("data", None, "tp"))

  @parameterized.parameters("ffi", None)
  def test_jit_without_set_mesh_takes_out_shardings_concrete_mesh(self, implementation):
    # Under jit the operands' mesh is abstract; it won over out_sharding's concrete mesh, so
    # 'ffi' failed at lowering ("must be lowered inside jax.shard_map over a concrete Mesh")
    # and None ran the XLA ring.
    mesh = mesh_2x4(axis_types=(AxisType.Explicit,) * 2)
    x_spec, w_spec, out_spec = layout(AG_A, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    f = lambda a, b: jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, out_spec), implementation=implementation)
    self.assertLess(test_util.rel_err(jax.jit(f)(xd, wd), test_util.reference_np(x, w)), 1e-5)
    c = counts(f, xd, wd)
    self.assertEqual((c["jax_distgemm"], c["collective-permute"]), (1, 0), c)

  def test_jit_with_only_an_abstract_mesh(self):
    # No concrete mesh anywhere (out_sharding a PartitionSpec, no jax.set_mesh): 'ffi' says how
    # to give one at trace time; None runs the XLA ring and says why.
    mesh = mesh_2x4(axis_types=(AxisType.Explicit,) * 2)
    x_spec, w_spec, out_spec = layout(AG_A, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    f = lambda impl: jax.jit(lambda a, b: jax_distgemm.collective_matmul(
        a, b, out_sharding=out_spec, implementation=impl))
    with self.assertRaisesRegex(ValueError, "mesh is abstract.*pass mesh=, an out_sharding "
                                "NamedSharding, or call under jax.set_mesh"):
      f("ffi")(xd, wd)
    config._given.clear()
    with self.assertWarns(UserWarning) as caught:
      out = f(None)(xd, wd)
    self.assertIn("runs the XLA ring", str(caught.warning))
    self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
    self.assertEqual(counts(f(None), xd, wd)["jax_distgemm"], 0)


class AutoPartitioningTest(parameterized.TestCase):
  """Inside jax.jit with Auto axes: custom_partitioning + Shardy sharding_rule."""

  @parameterized.product(schedule=tuple(Schedule), mesh_kind=("1d", "2x4"),
                         implementation=("ffi", "xla"))
  def test_partitions_into_the_fused_op(self, schedule, mesh_kind, implementation):
    mesh = test_util.mesh_1d(8) if mesh_kind == "1d" else mesh_2x4()
    x_spec, w_spec, out_spec = layout(schedule, data=mesh_kind == "2x4")
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)

    # No shard_map in user code: NamedSharding'd inputs and a constraint on the output.
    def f(a, b):
      y = jax_distgemm.collective_matmul(a, b, implementation=implementation)
      return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, out_spec))

    jf = jax.jit(f)
    hlo = jf.lower(xd, wd).as_text()
    self.assertIn("CustomSPMDPartitioning", hlo)  # the partitioner's callback decides
    self.assertIn("sdy.sharding_rule", hlo)
    c = counts(f, xd, wd)
    self.assertEqual(c["all-gather"] + c["reduce-scatter"] + c["all-reduce"], 0, c)
    self.assertEqual(c["jax_distgemm"], 1 if implementation == "ffi" else 0, c)
    for seed in range(2):
      (x, w), (xd, wd) = put(mesh, x_spec, w_spec, seed=seed)
      out = jf(xd, wd)
      self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
      self.assertEqual(rules.trim_spec(out.sharding.spec), rules.trim_spec(out_spec))

  @parameterized.parameters(None, "ffi")
  def test_under_set_mesh(self, implementation):
    # With jax.set_mesh(Auto mesh) the partition body saw that mesh's Auto axes as "left to the
    # partitioner": None lowered the ring and both warned that every replica computes the
    # whole call.  The body is per shard: the fused op, no warning.
    mesh = mesh_2x4()
    x_spec, w_spec, out_spec = layout(Schedule.AllGather1D_TilingCD_RotatingA, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    f = lambda a, b: jax_distgemm.collective_matmul(a, b, out_sharding=out_spec,
                                                    implementation=implementation)
    with jax.set_mesh(mesh), mock.patch.object(config, "warn") as warn:
      c = counts(f, xd, wd)
      out = jax.jit(f)(xd, wd)
    self.assertEqual((c["jax_distgemm"], c["collective-permute"]), (1, 0), c)
    self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
    self.assertFalse([a for a in warn.call_args_list if "partitioner" in str(a)],
                     warn.call_args_list)

  def test_out_sharding_argument(self):
    mesh = test_util.mesh_1d(8)
    (x, w), (xd, wd) = put(mesh, P(None, "tp", None), P(None, "tp"))
    f = lambda a, b: jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, P(None, "tp", None)))
    c = counts(f, xd, wd)
    self.assertEqual((c["jax_distgemm"], c["all-gather"]), (1, 0), c)  # RotatingB
    self.assertLess(test_util.rel_err(jax.jit(f)(xd, wd), test_util.reference_np(x, w)), 1e-5)

  def test_no_rule_fails_compilation_with_the_reason(self):
    mesh = test_util.mesh_1d(8)
    _, (xd, wd) = put(mesh, P(None, "tp", None), P("tp", None))
    f = jax.jit(lambda a, b: jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, P(None, None, "tp"))))
    with self.assertRaisesRegex(Exception, "no collective matmul for 'tp' on x's M and w's K"):
      f(xd, wd)

  def test_fallback_dot(self):
    mesh = mesh_2x4()
    (x, w), (xd, wd) = put(mesh, P("data", "tp", None), P("tp", None))
    f = lambda a, b: jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, P("data", None, "tp")), fallback="dot")
    self.assertLess(test_util.rel_err(jax.jit(f)(xd, wd), test_util.reference_np(x, w)), 1e-5)
    self.assertEqual(counts(f, xd, wd)["jax_distgemm"], 0)

  @parameterized.product(axis_type=(AxisType.Auto, AxisType.Explicit), mode=("eager", "jit"))
  def test_a_size_one_axis_named_or_not_is_the_same_layout(self, axis_type, mode):
    # x names "data" (size 1), out_sharding does not, or the reverse: the same layout, which the
    # shard_map path (eager, Explicit axes) refused ("asks for ... but that gives").
    mesh = jax.make_mesh((1, 8), ("data", "tp"), devices=test_util.cpu_devices(8),
                         axis_types=(axis_type,) * 2)
    for x_spec, out_spec in ((P("data", "tp", None), P(None, None, "tp")),
                             (P(None, "tp", None), P("data", None, "tp"))):
      (x, w), (xd, wd) = put(mesh, x_spec, P(None, "tp"))
      f = lambda a, b, o=out_spec: jax_distgemm.collective_matmul(
          a, b, out_sharding=NamedSharding(mesh, o), implementation="ffi")
      out = (f if mode == "eager" else jax.jit(f))(xd, wd)
      self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)

  @parameterized.product(schedule=tuple(Schedule), shape=((1, 8), (4, 1)))
  def test_mesh_axes_of_size_one(self, schedule, shape):
    # Shardy drops axes of size 1 from the shardings it propagates: a requested out_sharding
    # naming "data" of size 1 never matched (compile error), and with "tp" of size 1 no rule
    # applied.  Now those axes are ignored, and TP = 1 is a plain dot.
    mesh = jax.make_mesh(shape, ("data", "tp"), devices=test_util.cpu_devices(np.prod(shape)),
                         axis_types=(AxisType.Auto,) * 2)
    x_spec, w_spec, out_spec = layout(schedule, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    f = lambda a, b: jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, out_spec), implementation="ffi")
    self.assertLess(test_util.rel_err(jax.jit(f)(xd, wd), test_util.reference_np(x, w)), 1e-5)
    self.assertEqual(counts(f, xd, wd)["jax_distgemm"], 1 if shape[1] > 1 else 0)

  @parameterized.parameters("dot", "error")
  def test_an_axis_the_mesh_lacks(self, fallback):
    # A static argument's mistake is a ValueError at trace time, as on the eager path (it was
    # a KeyError or ~3 KB of custom_partitioner traceback at compile time).
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=test_util.cpu_devices(8),
                         axis_types=(AxisType.Auto,) * 2)
    (x, w), (xd, wd) = put(mesh, P("data", "model", None), P(None, "model"))
    f = jax.jit(lambda a, b: jax_distgemm.collective_matmul(a, b, fallback=fallback))
    with self.assertRaisesRegex(ValueError, r"axis: 'tp' is not an axis of the mesh of x "
                                r"\('data', 'model'\)"):
      f.trace(xd, wd)
    y = jax.jit(lambda a, b: jax_distgemm.collective_matmul(a, b, axis="model"))(xd, wd)
    self.assertLess(test_util.rel_err(y, test_util.reference_np(x, w)), 1e-5)

  def test_a_bad_implementation_is_a_trace_time_error(self):
    mesh = mesh_2x4()
    (_, _), (xd, wd) = put(mesh, P("data", "tp", None), P(None, "tp"))
    f = jax.jit(lambda a, b: jax_distgemm.collective_matmul(a, b, implementation="fii"))
    with self.assertRaisesRegex(ValueError, r"implementation: expected one of \('ffi', 'xla', "
                                r"'reference'\) or None, got 'fii'"):
      f.trace(xd, wd)

  @parameterized.named_parameters(("on_n", P(None, None, "tp")), ("on_batch", P("tp", None, None)),
                                  ("on_m", P(None, "tp", None)))
  def test_a_downstream_layout_is_not_a_requirement(self, downstream):
    # No out_sharding: what Shardy propagated back from a later constraint was taken as the
    # output's required layout, and any other than the plan's failed the compile.
    mesh = mesh_2x4()
    x_spec, w_spec, _ = layout(AG_A, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    f = lambda a, b: jax.lax.with_sharding_constraint(
        jax_distgemm.collective_matmul(a, b, implementation="ffi"),
        NamedSharding(mesh, downstream))
    out = jax.jit(f)(xd, wd)
    self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
    self.assertEqual(rules.trim_spec(out.sharding.spec), rules.trim_spec(downstream))
    self.assertEqual(counts(f, xd, wd)["jax_distgemm"], 1)

  def test_two_ops_get_distinct_rendezvous_keys(self):
    mesh = test_util.mesh_1d(8)
    (x, w), (xd, wd) = put(mesh, P(None, "tp", None), P(None, "tp"))
    out = NamedSharding(mesh, P(None, None, "tp"))
    f = jax.jit(lambda a, b: (jax_distgemm.collective_matmul(a, b, out_sharding=out),
                              jax_distgemm.collective_matmul(a, 2 * b, out_sharding=out)))
    ids = re.findall(r"call_id = (\d+)", f.lower(xd, wd).compile().as_text())
    self.assertLen(ids, 2)
    self.assertLen(set(ids), 2, ids)
    y1, y2 = f(xd, wd)
    ref = test_util.reference_np(x, w)
    self.assertLess(test_util.rel_err(y1, ref), 1e-5)
    self.assertLess(test_util.rel_err(y2, 2 * ref), 1e-5)


class FsdpWeightTest(parameterized.TestCase):
  """A weight sharded over "fsdp" on K as well: XLA gathers it over "fsdp", then the fused op
  (the contraction was refused: "x and w must be sharded alike")."""

  @parameterized.product(schedule=tuple(Schedule), axis_type=(AxisType.Auto, AxisType.Explicit))
  def test_forward_and_gradients(self, schedule, axis_type):
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tp"), devices=test_util.cpu_devices(8),
                         axis_types=(axis_type,) * 3)
    if schedule.is_all_gather:
      x_spec, w_spec = P(("data", "fsdp"), "tp", None), P("fsdp", "tp")
    else:
      x_spec, w_spec = P(("data", "fsdp"), None, "tp"), P(("fsdp", "tp"), None)
    out_spec = {AG_A: P(("data", "fsdp"), None, "tp"), AG_B: P(("data", "fsdp"), "tp", None),
                RS_A: P(("data", "fsdp"), "tp", None), RS_B: P(("data", "fsdp"), None, "tp")}[
                    schedule]
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    f = lambda a, b: jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, out_spec), implementation="ffi")
    out = jax.jit(f)(xd, wd)
    self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 1e-5)
    c = counts(f, xd, wd)
    self.assertEqual((c["jax_distgemm"], c["all-gather"]), (1, 1), c)  # w over "fsdp"
    r = jnp.cos(jnp.arange(B * M * N, dtype=jnp.float32)).reshape(B, M, N)
    got = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * r), (0, 1)))(xd, wd)
    want = jax.grad(lambda a, b: jnp.sum(jnp.matmul(a, b) * r), (0, 1))(x, w)
    for g, ref, primal in zip(got, want, (xd, wd)):
      self.assertLess(test_util.rel_err(g, np.asarray(ref, np.float64)), 1e-5)
      self.assertEqual(g.shape, primal.shape)


class GradientTest(parameterized.TestCase):

  def loss(self, mesh, out_spec, **kw):
    def f(a, b):
      y = jax_distgemm.collective_matmul(a, b, out_sharding=NamedSharding(mesh, out_spec), **kw)
      return jnp.sum(jnp.sin(y) * jnp.cos(jnp.arange(y.size).reshape(y.shape)))
    return f

  def reference_grads(self, x, w):
    f = lambda a, b: jnp.sum(jnp.sin(a @ b) * jnp.cos(jnp.arange(B * M * N).reshape(B, M, N)))
    return jax.grad(f, (0, 1))(x, w)

  @parameterized.product(schedule=tuple(Schedule), path=("in_specs", "auto"))
  def test_grads_2x4(self, schedule, path):
    mesh = mesh_2x4()
    x_spec, w_spec, out_spec = layout(schedule, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    kw = dict(in_specs=(x_spec, w_spec)) if path == "in_specs" else {}
    g = jax.jit(jax.grad(self.loss(mesh, out_spec, implementation="ffi", **kw), (0, 1)),
                out_shardings=(xd.sharding, wd.sharding))
    for got, want in zip(g(xd, wd), self.reference_grads(x, w)):
      self.assertLess(test_util.rel_err(got, np.asarray(want)), 1e-5)
    c = counts(g, xd, wd)
    # Forward and the backward's dual fused (on the auto path the partitioner finds the dual
    # from the primals' shardings); the all-gather is the operand the other GEMM needs, except
    # where in_specs= runs the shard_map VJP after a ReduceScatter: its dual AllGather returns
    # d out gathered (autodiff.py).
    self.assertEqual(c["jax_distgemm"], 2, c)
    self.assertEqual(c["reduce-scatter"], 0, c)
    reused = path == "in_specs" and not schedule.is_all_gather
    self.assertEqual(c["all-gather"], 0 if reused else 1, c)
    self.assertEqual(c["all-reduce"], 1, c)  # dw summed over "data"

  @parameterized.parameters(*Schedule)
  def test_grads_keep_primal_layouts_without_out_shardings(self, schedule):
    # The backward's ops tie their result to `like` (the primal) in the sharding rule, so the
    # partitioner leaves each gradient where its primal lives; with independent factors it
    # gathered dx over "tp" and all-gathered dw (3 all-gathers instead of 1, seen on AG_A).
    mesh = mesh_2x4()
    x_spec, w_spec, out_spec = layout(schedule, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    g = jax.jit(jax.grad(self.loss(mesh, out_spec, implementation="ffi"), (0, 1)))
    got = g(xd, wd)
    for a, primal, want in zip(got, (xd, wd), self.reference_grads(x, w)):
      self.assertLess(test_util.rel_err(a, np.asarray(want)), 1e-5)
      self.assertTrue(a.sharding.is_equivalent_to(primal.sharding, a.ndim),
                      (a.sharding, primal.sharding))
    c = counts(g, xd, wd)
    self.assertEqual((c["jax_distgemm"], c["all-gather"], c["all-reduce"],
                      c["reduce-scatter"]), (2, 1, 1, 0), c)

  @parameterized.parameters(*Schedule)
  def test_fp16_grads_with_an_fp32_output_and_a_large_cotangent_auto(self, schedule):
    # The jit-level VJP cast the fp32 cotangent (1e5 here) to fp16: inf, then NaN gradients.
    mesh = mesh_2x4()
    x_spec, w_spec, out_spec = layout(schedule, data=True)
    x, w, _ = test_util.random_inputs(0, (B, M, K), (K, N), jnp.float16)
    x, w = x * 1e-2, w * 1e-2
    xd = jax.device_put(x, NamedSharding(mesh, x_spec))
    wd = jax.device_put(w, NamedSharding(mesh, w_spec))
    f = lambda a, b: 1e5 * jnp.sum(jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, out_spec), out_dtype=jnp.float32,
        implementation="ffi"))
    got = jax.jit(jax.grad(f, (0, 1)), out_shardings=(xd.sharding, wd.sharding))(xd, wd)
    want = jax.grad(lambda a, b: 1e5 * jnp.sum(jnp.matmul(
        a, b, preferred_element_type=jnp.float32)), (0, 1))(x, w)
    for g, ref in zip(got, want):
      self.assertTrue(bool(jnp.isfinite(g).all()))
      self.assertLess(test_util.rel_err(g, np.asarray(ref, np.float64)), 2e-3)

  @parameterized.parameters(*Schedule)
  def test_fp16_grads_with_an_inf_in_the_cotangent_auto(self, schedule):
    # An inf in the fp32 cotangent made the scale 0 and every gradient NaN; only the rows and
    # columns that meet it may be non-finite, as in the dense gradient.
    mesh = mesh_2x4()
    x_spec, w_spec, out_spec = layout(schedule, data=True)
    x, w, _ = test_util.random_inputs(0, (B, M, K), (K, N), jnp.float16)
    xd = jax.device_put(x, NamedSharding(mesh, x_spec))
    wd = jax.device_put(w, NamedSharding(mesh, w_spec))
    r = np.ones((B, M, N), np.float32)
    r[0, 1, 2] = np.inf
    f = lambda a, b: jnp.sum(r * jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, out_spec), out_dtype=jnp.float32,
        implementation="ffi"))
    got = jax.jit(jax.grad(f, (0, 1)), out_shardings=(xd.sharding, wd.sharding))(xd, wd)
    want = jax.grad(lambda a, b: jnp.sum(r * jnp.matmul(
        a, b, preferred_element_type=jnp.float32)), (0, 1))(x, w)
    for g, ref in zip(got, want):
      g, ref = np.asarray(g, np.float64), np.asarray(ref, np.float64)
      finite = np.isfinite(ref)
      self.assertTrue(0 < finite.sum() < finite.size)
      np.testing.assert_array_equal(np.isfinite(g), finite)
      self.assertLess(test_util.rel_err(g[finite], ref[finite]), 2e-3)

  @parameterized.parameters(*Schedule)
  def test_eager_grads_take_the_shard_map_path(self, schedule):
    # jax.grad without jit: the autodiff tracers' primals are concrete arrays whose shardings
    # pick the plan, so the gradients come from the shard_map VJP, in their primals' layouts
    # (through the partitioner op by op, dw came back replicated).
    mesh = mesh_2x4()
    x_spec, w_spec, out_spec = layout(schedule, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    got = jax.grad(self.loss(mesh, out_spec, implementation="ffi"), (0, 1))(xd, wd)
    for a, primal, want in zip(got, (xd, wd), self.reference_grads(x, w)):
      self.assertLess(test_util.rel_err(a, np.asarray(want)), 1e-5)
      self.assertTrue(a.sharding.is_equivalent_to(primal.sharding, a.ndim),
                      (a.sharding, primal.sharding))
    hvp = jax.grad(lambda a, b: jnp.sum(jax.grad(self.loss(mesh, out_spec, implementation="ffi"),
                                                 0)(a, b) ** 2), 1)
    ref = jax.grad(lambda a, b: jnp.sum(jax.grad(lambda u, v: jnp.sum(jnp.sin(u @ v) * jnp.cos(
        jnp.arange(B * M * N).reshape(B, M, N))), 0)(a, b) ** 2), 1)
    self.assertLess(test_util.rel_err(hvp(xd, wd), np.asarray(ref(x, w))), 1e-5)

  @parameterized.parameters(*Schedule)
  def test_grad_of_grad_auto(self, schedule):
    mesh = mesh_2x4()
    x_spec, w_spec, out_spec = layout(schedule, data=True)
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec)
    vx = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)
    vw = jnp.sin(jnp.arange(w.size, dtype=jnp.float32)).reshape(w.shape)

    def hvp(f):
      g = jax.grad(f, (0, 1))
      return jax.jit(jax.grad(lambda a, b: jnp.vdot(g(a, b)[0], vx) + jnp.vdot(g(a, b)[1], vw),
                              (0, 1)))

    ours = hvp(lambda a, b: jnp.sum(jnp.sin(jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, out_spec), implementation="ffi"))))(xd, wd)
    ref = hvp(lambda a, b: jnp.sum(jnp.sin(a @ b)))(x, w)
    for got, want in zip(ours, ref):
      self.assertLess(test_util.rel_err(got, np.asarray(want)), 1e-5)

  @parameterized.product(schedule=tuple(Schedule), batched=(False, True))
  def test_grads_1d_auto(self, schedule, batched):
    mesh = test_util.mesh_1d(8)
    x_spec, w_spec, out_spec = layout(schedule, data=False)
    if not batched:
      x_spec, out_spec = P(*x_spec[1:]), P(*out_spec[1:])
    (x, w), (xd, wd) = put(mesh, x_spec, w_spec, x_shape=(B, M, K) if batched else (M, K))
    f = lambda a, b: jnp.sum(jnp.sin(jax_distgemm.collective_matmul(
        a, b, out_sharding=NamedSharding(mesh, out_spec), implementation="ffi")))
    g = jax.jit(jax.grad(f, (0, 1)), out_shardings=(xd.sharding, wd.sharding))
    want = jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), (0, 1))(x, w)
    for got, ref in zip(g(xd, wd), want):
      self.assertLess(test_util.rel_err(got, np.asarray(ref)), 1e-5)
    c = counts(g, xd, wd)
    self.assertEqual(c["jax_distgemm"], 2, c)  # forward + its dual, picked by the partitioner
    self.assertEqual(c["reduce-scatter"], 0, c)


if __name__ == "__main__":
  absltest.main()

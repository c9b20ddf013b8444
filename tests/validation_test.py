"""Bad inputs are refused before launch with a message naming the argument and the rule.

One test per row of the bad-input table in docs/reliability.md (`test_docs_table_matches_tests`
keeps the two in sync).  Python-side checks are driven through the public API inside
jax.shard_map (jax.eval_shape: tracing is where they run).  The C++ handler's own checks
(cc/common/problem.cc) are reached by binding the primitive directly, bypassing the Python
checks, and must come back as an error from the call, not a crash; the process then runs the
next call correctly.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
from unittest import mock

try:
  from tests import test_util as tu  # noqa: I001 - must precede JAX initialization
except ImportError:
  import test_util as tu

from absl.testing import absltest  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_distgemm as jd  # noqa: E402
from jax_distgemm import Schedule  # noqa: E402
from jax_distgemm._src import config, cuda_rules, implementation  # noqa: E402
from jax_distgemm._src import multiprocess, primitives  # noqa: E402
from jax_distgemm._src import validation  # noqa: E402
from jax_distgemm import ffi as ffi_modules  # noqa: E402

AG_A = Schedule.AllGather1D_TilingCD_RotatingA
AG_B = Schedule.AllGather1D_TilingCD_RotatingB
RS_A = Schedule.ReduceScatter1D_TilingA_RotatingC
RS_B = Schedule.ReduceScatter1D_TilingB_RotatingC
TP = 4
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "reliability.md"


def _sds(shape, dtype, mesh=None, spec=None):
  sharding = None if mesh is None else NamedSharding(mesh, spec)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def trace(body, schedule, x_shape, w_shape, dtype=jnp.float32, *, c_shape=None,
          c_dtype=jnp.float32, batch_ndim=0, tp=TP, w_dtype=None):
  """Traces body(x, w[, c]) inside shard_map over a 1-D mesh 'tp' (global shapes in)."""
  mesh = tu.mesh_1d(tp)
  xs, ws, os_ = tu.specs(schedule, batch_ndim, w_batched=len(w_shape) > 2)
  args = [_sds(x_shape, dtype, mesh, xs), _sds(w_shape, w_dtype or dtype, mesh, ws)]
  in_specs = [xs, ws]
  if c_shape is not None:
    args.append(_sds(c_shape, c_dtype, mesh, os_))
    in_specs.append(os_)
  f = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=os_)
  return jax.eval_shape(f, *args)


def dm(schedule, **kw):
  """body(x, w[, c]) calling the public distributed_matmul with `kw`."""
  return lambda x, w, *c: jd.distributed_matmul(x, w, *c, axis_name=kw.pop("axis_name", "tp"),
                                                schedule=schedule, **kw)


class ValidationTest(absltest.TestCase):
  """Python checks (jax_distgemm/_src/validation.py, api.py, config.py, cuda_rules.py)."""

  def assertRaisesMsg(self, exc, excerpt):
    return self.assertRaisesRegex(exc, re.escape(excerpt))

  # -- shapes ------------------------------------------------------------------------------------

  def test_mismatched_contraction_dim(self):
    with self.assertRaisesMsg(ValueError, "x, w: contraction dims must match: x has K=8"):
      trace(dm(AG_A), AG_A, (16, 8), (12, 16))
    with self.assertRaisesMsg(ValueError, "but w has K=12"):
      trace(dm(RS_A), RS_A, (16, 32), (48, 8))  # local K: x 8, w 12

  def test_x_rank_below_two(self):
    body = lambda x, w: jd.distributed_matmul(x[0], w, axis_name="tp", schedule=AG_A)
    with self.assertRaisesMsg(ValueError, "x: must have rank >= 2"):
      trace(body, AG_A, (16, 8), (8, 16))

  def test_w_rank(self):
    body = lambda x, w: jd.distributed_matmul(x, w[None, None], axis_name="tp", schedule=AG_A)
    with self.assertRaisesMsg(ValueError, "w: must have rank 2 ([contraction, columns]) or the "
                              "rank of x (2)"):
      trace(body, AG_A, (16, 8), (8, 16))

  def test_w_batch_dims_differ_from_x(self):
    body = lambda x, w: jd.distributed_matmul(x, w[:2], axis_name="tp", schedule=AG_A)
    with self.assertRaisesMsg(ValueError, "w: batch dims (2,) must equal those of x (3,)"):
      trace(body, AG_A, (3, 16, 8), (3, 8, 16), batch_ndim=1)

  def test_rs_tiling_a_rows_not_divisible_by_tp(self):
    with self.assertRaisesMsg(ValueError, "x: rows M=6 must be divisible by the TP size 4 for "
                              "ReduceScatter1D_TilingA_RotatingC"):
      trace(dm(RS_A), RS_A, (6, 16), (16, 8))

  def test_rs_tiling_b_columns_not_divisible_by_tp(self):
    with self.assertRaisesMsg(ValueError, "w: columns N=6 must be divisible by the TP size 4 for "
                              "ReduceScatter1D_TilingB_RotatingC"):
      trace(dm(RS_B), RS_B, (8, 16), (16, 6))

  def test_global_dim_not_divisible_by_mesh_axis(self):
    # No transparent padding: shard_map itself refuses a global dim the mesh cannot split.
    with self.assertRaisesMsg(ValueError, "not evenly divisible by the corresponding mesh axis"):
      trace(dm(AG_A), AG_A, (18, 8), (8, 16))

  def test_c_wrong_shape(self):
    # AG RotatingA: local out [16, 16/4]; c given as global [16, 8] -> local [16, 2].
    with self.assertRaisesMsg(ValueError, "c: must have the per-device output shape (16, 4) for "
                              "AllGather1D_TilingCD_RotatingA with TP=4, got (16, 2)"):
      trace(dm(AG_A, beta=1.0), AG_A, (16, 8), (8, 16), c_shape=(16, 8))

  def test_c_not_floating(self):
    with self.assertRaisesMsg(TypeError, "c: must be a floating-point array, got int32"):
      trace(dm(AG_A, beta=1.0), AG_A, (16, 8), (8, 16), c_shape=(16, 16), c_dtype=jnp.int32)

  def test_beta_without_c(self):
    with self.assertRaisesMsg(ValueError, "c: beta != 0 needs c"):
      trace(dm(RS_B, beta=0.5), RS_B, (8, 16), (16, 8))

  # -- dtypes ------------------------------------------------------------------------------------

  def test_x_w_dtypes_differ(self):
    with self.assertRaisesMsg(TypeError, "x, w: dtypes must match, got bfloat16 and float32"):
      trace(dm(AG_B), AG_B, (16, 8), (8, 16), jnp.bfloat16, w_dtype=jnp.float32)

  def test_unsupported_dtype_int8(self):
    with self.assertRaisesMsg(TypeError, "x: dtype int8 is not supported; use bfloat16, float16 "
                              "or float32"):
      trace(dm(AG_A), AG_A, (16, 8), (8, 16), jnp.int8)

  def test_unsupported_dtype_float64(self):
    with jax.enable_x64(True):
      with self.assertRaisesMsg(TypeError, "x: dtype float64 is not supported"):
        trace(dm(RS_A), RS_A, (16, 8), (8, 16), jnp.float64)

  def test_unsupported_out_dtype(self):
    with self.assertRaisesMsg(TypeError, "out_dtype: int32 is not supported"):
      trace(dm(AG_A, out_dtype=jnp.int32), AG_A, (16, 8), (8, 16))
    # Not a dtype, or a falsy non-None value (which used to mean x's dtype): named, refused.
    for bad in ("nonsense", 0, False):
      with self.assertRaisesMsg(TypeError, f"out_dtype: {bad!r} is not supported"):
        trace(dm(AG_A, out_dtype=bad), AG_A, (16, 8), (8, 16))

  # -- axis / mesh -------------------------------------------------------------------------------

  def test_unknown_axis_name(self):
    with self.assertRaisesMsg(ValueError, "axis_name: 'model' is not bound; call this inside "
                              "jax.shard_map"):
      trace(dm(AG_A, axis_name="model"), AG_A, (16, 8), (8, 16))

  def test_axis_name_outside_shard_map(self):
    with self.assertRaisesMsg(ValueError, "axis_name: 'tp' is not bound"):
      jd.all_gather_matmul(jnp.ones((4, 4)), jnp.ones((4, 4)), axis_name="tp")

  def test_ffi_under_a_vmap_bound_axis(self):
    # jax.vmap(axis_name=...) binds the name but no mesh: 'ffi' says so at trace time (it
    # failed with "Evaluation rule for 'jax_distgemm' not implemented", or, under None in
    # jit, with an unbound-axis NameError at lowering); None runs the XLA ring, exactly.
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 4)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 4, 6)), jnp.float32)
    f = lambda impl: jax.vmap(lambda a, b: jd.all_gather_matmul(
        a, b, axis_name="tp", implementation=impl), axis_name="tp")
    for wrap in (lambda g: g, jax.jit):
      with self.assertRaisesMsg(ValueError, "implementation='ffi': axis_name 'tp' is bound by "
                                "jax.vmap, not by jax.shard_map"):
        wrap(f("ffi"))(x, w)
      with mock.patch.dict(os.environ, {"JAX_DISTGEMM_IMPLEMENTATION": "ffi"}):
        with self.assertRaisesMsg(ValueError, "implementation='ffi': axis_name 'tp' is bound "
                                  "by jax.vmap"):  # the escape hatch is an explicit choice
          wrap(f(None))(x, w)
      got = wrap(f(None))(x, w)
      np.testing.assert_array_equal(got, wrap(f("xla"))(x, w))
      want = np.concatenate(list(np.asarray(x)), 0) @ np.asarray(w[1])
      np.testing.assert_allclose(got[1], want, rtol=1e-5, atol=1e-5)
      # Differentiable there too (a custom VJP's backward ran outside the vmap: "unbound axis
      # name: tp"): against jax.grad of the same math with XLA's all_gather.
      math = jax.vmap(lambda a, b: jax.lax.all_gather(a, "tp", tiled=True) @ b, axis_name="tp")
      for impl in (None, "xla", "reference"):
        g = wrap(jax.grad(lambda a, b: jnp.sum(jnp.sin(f(impl)(a, b))), (0, 1)))(x, w)
        r = jax.grad(lambda a, b: jnp.sum(jnp.sin(math(a, b))), (0, 1))(x, w)
        for gi, ri in zip(g, r):
          np.testing.assert_allclose(gi, ri, rtol=1e-5, atol=1e-5)

  def test_collective_matmul_inside_a_manual_shard_map(self):
    # Auto axes under a shard_map manual over "data": the partitioner's callback met GSPMD
    # shardings without a spec (AttributeError deep in XLA's compile); named at trace time.
    mesh = jax.make_mesh((2, 4), ("data", "tp"), devices=tu.cpu_devices(8),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.device_put(jnp.ones((2, 8, 16)), NamedSharding(mesh, P("data", "tp", None)))
    w = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(None, "tp")))
    f = jax.jit(jax.shard_map(lambda a, b: jd.collective_matmul(a, b), mesh=mesh,
                              in_specs=(P("data"), P()), out_specs=P("data"),
                              axis_names={"data"}))
    with self.assertRaisesMsg(ValueError, "jax_distgemm.collective_matmul: called inside "
                              "jax.shard_map (manual over ('data',)) on operands whose sharding "
                              "is not known at trace time"):
      f(x, w)

  def test_collective_matmul_on_a_mesh_mixing_explicit_and_auto_axes(self):
    # Under jit a traced spec names only the Explicit axes: a valid out_sharding was refused
    # by the table, or the ring failed inside the partitioner.  Named; eager still runs.
    types = (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit)
    mesh = jax.make_mesh((2, 4), ("data", "tp"), devices=tu.cpu_devices(8), axis_types=types)
    x = jax.device_put(jnp.ones((2, 8, 16)), NamedSharding(mesh, P("data", "tp", None)))
    w = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(None, "tp")))
    with jax.set_mesh(mesh):
      with self.assertRaisesMsg(ValueError, "jax_distgemm.collective_matmul: under jax.jit the "
                                "mesh mixes Explicit and Auto axes {'data': 'Auto', 'tp': "
                                "'Explicit'}"):
        jax.jit(lambda a, b: jd.collective_matmul(a, b))(x, w)
      np.testing.assert_allclose(jd.collective_matmul(x, w), np.full((2, 8, 8), 16.0))

  def test_partial_shard_map_leaving_an_explicit_axis_that_shards_x(self):
    # axis_names={"tp"} on an Explicit mesh, x sharded over "data": the ring failed in JAX
    # ("dynamic_update_slice operand sharding must be equal to update sharding"), and every
    # implementation's backward too.  Named for all of them, before anything is traced.
    mesh = jax.make_mesh((2, 4), ("data", "tp"), devices=tu.cpu_devices(8),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((2, 16, 8)), NamedSharding(mesh, P("data", "tp", None)))
    w = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "tp")))
    for impl in ("ffi", "xla", "reference", None):
      f = jax.jit(jax.shard_map(
          lambda a, b: jd.all_gather_matmul(a, b, axis_name="tp", implementation=impl),
          mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp")),
          out_specs=P(None, None, "tp"), axis_names={"tp"}))
      with self.assertRaisesMsg(ValueError, "x, w: sharded over the Explicit mesh axes "
                                "('data',), which the enclosing shard_map leaves free"):
        f(x, w)

  def test_axis_name_wrong_type(self):
    with self.assertRaisesMsg(TypeError, "axis_name: expected a mesh axis name or a tuple of "
                              "them, got 3"):
      trace(dm(AG_A, axis_name=3), AG_A, (16, 8), (8, 16))

  def test_axis_name_repeated(self):
    # Under every implementation (the reference's XLA collective aborted the process on it).
    for impl in ("ffi", "xla", "reference", None):
      with self.assertRaisesMsg(ValueError, "axis_name: ('tp', 'tp') names 'tp' more than once; "
                                "name each mesh axis once"):
        trace(dm(AG_A, axis_name=("tp", "tp"), implementation=impl), AG_A, (16, 8), (8, 16))

  def test_tp_differs_from_mesh_axis_size(self):
    # The primitive bound for TP=2 (or 3) on a 4-device axis: refused at lowering, before the
    # handlers are built with wrong groups (TP=2) or groups that cannot be formed (TP=3).
    mesh = tu.mesh_1d(TP)
    xs, ws, os_ = tu.specs(AG_A, 0)
    for tp in (2, 3):
      body = lambda x, w, tp=tp: primitives.bind(
          x, w, None, schedule=AG_A, axis_name=("tp",), tp=tp, alpha=1.0, beta=0.0,
          out_dtype=jnp.float32, timeout_ms=1000)
      f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=os_))
      with self.assertRaisesMsg(ValueError, f"tp: the call was traced for TP={tp} but mesh axis "
                                "'tp' has 4 devices"):
        f.lower(_sds((16, 8), jnp.float32, mesh, xs), _sds((8, 16), jnp.float32, mesh, ws))

  def test_tp_group_spans_processes(self):
    groups = primitives.device_groups(tu.mesh_1d(TP), ("tp",), TP)
    np.testing.assert_array_equal(groups, [[d.id for d in tu.cpu_devices(TP)]])
    validation.check_groups_local(groups, [d.id for d in tu.cpu_devices(TP)])  # all local: ok
    with self.assertRaisesMsg(ValueError, "axis_name: the TP group [0, 1, 2, 3] spans processes "
                              "(devices [2, 3] are not addressable by this process)"):
      validation.check_groups_local(groups, [0, 1])
    with self.assertRaisesMsg(ValueError, "needs jax_distgemm.initialize_multiprocess() after "
                              "jax.distributed.initialize()"):
      validation.check_groups_local(groups, [0, 1])  # CPU, multi-process setup not run
    validation.check_groups_local(groups, [4, 5])  # a group wholly elsewhere is not ours

  def test_unreachable_group_auto_lowers_the_ring(self):
    # A group the executor cannot meet (here by decree): None lowers the XLA ring in place of
    # the custom call, forward and backward, with the right values; "ffi" raises the reason.
    def unreachable(*a, **k):
      raise validation.GroupUnreachableError("axis_name: the TP group spans hosts (test)")

    mesh = tu.mesh_1d(TP)
    with mock.patch.object(validation, "check_groups_local", unreachable):
      for schedule in (AG_A, AG_B, RS_A, RS_B):
        xs, ws, os_ = tu.specs(schedule, 0)
        xg, wg, cg = tu.random_inputs(1, (16, 8), (8, 16), jnp.float32, c_shape=(16, 16))[:3]
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
        args = (put(xg, xs), put(wg, ws), put(cg, os_))
        for impl in (None, "ffi"):
          f = jax.jit(jax.shard_map(dm(schedule, alpha=0.5, beta=2.0, implementation=impl),
                                    mesh=mesh, in_specs=(xs, ws, os_), out_specs=os_))
          if impl == "ffi":
            with self.assertRaisesMsg(validation.GroupUnreachableError, "spans hosts (test)"):
              f(*args)
            continue
          with (mock.patch.object(config, "_given", set()),
                self.assertWarns(UserWarning) as caught):
            hlo = f.lower(*args).compile().as_text()
          self.assertIn("implementation=None runs the XLA ring here, not the fused call: "
                        "axis_name: the TP group spans hosts (test)", str(caught.warning))
          self.assertEqual(caught.filename, __file__)  # the caller's line, not the library's
          self.assertNotIn("jax_distgemm_v1", hlo)
          want = tu.reference_np(xg, wg, cg, alpha=0.5, beta=2.0)
          self.assertLess(tu.rel_err(f(*args), want), 1e-5, schedule)
          dx, dw = jax.grad(lambda x, w: f(x, w, args[2]).sum(), argnums=(0, 1))(*args[:2])
          # d/dx sum(0.5 x @ w) = 0.5 * rowsum(w), d/dw = 0.5 * colsum(x)
          np.testing.assert_allclose(dx, np.broadcast_to(0.5 * wg.sum(1), (16, 8)), rtol=1e-5)
          np.testing.assert_allclose(dw, np.broadcast_to(0.5 * xg.sum(0)[:, None], (8, 16)),
                                     rtol=1e-5)

  def test_tp_group_spans_processes_cuda(self):
    # CUDA across processes (CUDA IPC): needs the setup call, one host, one GPU per process.
    same = multiprocess.State(token="t", process_index=0, hosts=("h", "h", "h", "h"))
    one_each = np.array([[0, 1, 2, 3]])
    process_of = {0: 0, 1: 1, 2: 2, 3: 3}
    with self.assertRaisesMsg(ValueError, "needs jax_distgemm.initialize_multiprocess()"):
      validation.check_groups_local(one_each, [0], platform="cuda", process_of=process_of)
    validation.check_groups_local(one_each, [0], platform="cuda", process_of=process_of,
                                  multiprocess=same)
    other = multiprocess.State(token="t", process_index=0, hosts=("h", "h", "g", "g"))
    with self.assertRaisesMsg(ValueError, "devices [2, 3] are on another host, which the CUDA "
                              "executor cannot reach (it maps peers' workspaces through CUDA IPC"):
      validation.check_groups_local(one_each, [0], platform="cuda", process_of=process_of,
                                    multiprocess=other)
    two_each = {0: 0, 1: 0, 2: 1, 3: 1}
    with self.assertRaisesMsg(ValueError, "on CUDA a TP group that spans processes must have one "
                              "GPU per process (this process holds [0, 1])"):
      validation.check_groups_local(one_each, [0, 1], platform="cuda", process_of=two_each,
                                    multiprocess=same)
    validation.check_groups_local(one_each, [0, 1, 2, 3], platform="cuda")  # all local: ok

  def test_tp_group_spans_hosts(self):
    # After initialize_multiprocess(): CPU groups across processes of this host are accepted,
    # a member on another host is refused.
    groups = np.array([[0, 1, 2048, 2049]])
    process_of = {0: 0, 1: 0, 2048: 1, 2049: 1}
    same = multiprocess.State(token="t", process_index=0, hosts=("h|boot", "h|boot"))
    validation.check_groups_local(groups, [0, 1], process_of=process_of, multiprocess=same)
    other = multiprocess.State(token="t", process_index=0, hosts=("h|boot", "g|boot"))
    with self.assertRaisesMsg(ValueError, "devices [2048, 2049] are on another host, which the "
                              "CPU executor cannot reach"):
      validation.check_groups_local(groups, [0, 1], process_of=process_of, multiprocess=other)

  # -- names -------------------------------------------------------------------------------------

  # -- fp8 ---------------------------------------------------------------------------------------

  def test_fp8_with_a_bf16_operand(self):
    body = dm(AG_A, x_scale=jnp.float32(1), w_scale=jnp.float32(1))
    with self.assertRaisesMsg(TypeError, "w: with fp8 operands or scales both x and w must be "
                              "float8_e4m3fn or float8_e5m2"):
      trace(body, AG_A, (128, 256), (256, 512), jnp.float8_e4m3fn, w_dtype=jnp.bfloat16)

  def test_fp8_missing_scale(self):
    with self.assertRaisesMsg(ValueError, "w_scale: fp8 operands need their scales"):
      trace(dm(AG_A, x_scale=jnp.float32(1)), AG_A, (128, 256), (256, 512), jnp.float8_e4m3fn)

  def test_fp8_scale_not_float32(self):
    body = dm(AG_A, x_scale=jnp.bfloat16(1), w_scale=jnp.float32(1))
    with self.assertRaisesMsg(TypeError, "x_scale: must be float32, got bfloat16"):
      trace(body, AG_A, (128, 256), (256, 512), jnp.float8_e4m3fn)

  def test_fp8_block_scale_shapes(self):
    # Local x [32, 256], w [256, 128]: block scales [32, 2] and [2, 1].
    body = dm(AG_A, x_scale=jnp.ones((32, 3)), w_scale=jnp.ones((2, 1)))
    with self.assertRaisesMsg(ValueError, "x_scale, w_scale: expected both scalars (per-tensor "
                              "scaling) or block scales of shapes (32, 2)"):
      trace(body, AG_A, (128, 256), (256, 512), jnp.float8_e4m3fn)

  def test_fp8_block_stage_slice(self):
    # TilingB: each stage takes N/TP of w's 256 local columns; 64 is not a whole block.
    with self.assertRaisesMsg(ValueError, "w: block scaling with ReduceScatter1D_TilingB_RotatingC "
                              "needs N/TP = 256/4 to be a multiple of 128"):
      trace(dm(RS_B, fp8="block"), RS_B, (64, 2048), (2048, 256))

  def test_fp8_fp16_output(self):
    body = dm(AG_A, x_scale=jnp.float32(1), w_scale=jnp.float32(1), out_dtype=jnp.float16)
    with self.assertRaisesMsg(TypeError, "out_dtype: an fp8 call writes bfloat16 or float32"):
      trace(body, AG_A, (128, 256), (256, 512), jnp.float8_e4m3fn)

  def test_fp8_ffi_on_cuda(self):
    # The CUDA executor's fp8 kernels: block scaling of float8_e4m3fn only.
    self.enter_context(mock.patch.object(implementation, "platform", return_value="cuda"))
    self.enter_context(mock.patch.object(ffi_modules, "has_cuda", return_value=True))
    body = dm(AG_A, x_scale=jnp.ones((32, 2), jnp.float32), implementation="ffi",
              w_scale=jnp.ones((2, 1), jnp.float32))
    with self.assertRaisesMsg(NotImplementedError, "x, w: float8_e5m2 x float8_e4m3fn is not "
                              "built on CUDA"):
      trace(body, AG_A, (128, 256), (256, 512), jnp.float8_e5m2, w_dtype=jnp.float8_e4m3fn)

  def test_bad_fp8(self):
    with self.assertRaisesMsg(ValueError, "fp8: expected 'tensor' or 'block', got 'rows'"):
      trace(dm(AG_A, fp8="rows"), AG_A, (128, 256), (256, 512))

  def test_fp8_of_fp8_operands(self):
    body = dm(AG_A, fp8="tensor", x_scale=jnp.float32(1), w_scale=jnp.float32(1))
    with self.assertRaisesMsg(ValueError, "fp8: quantizes bf16, fp16 or fp32 operands in the call"):
      trace(body, AG_A, (128, 256), (256, 512), jnp.float8_e4m3fn)

  def test_fp8_return_gathered(self):
    with self.assertRaisesMsg(ValueError, "return_gathered: not with fp8 operands"):
      trace(dm(AG_A, fp8="tensor", return_gathered=True), AG_A, (128, 256), (256, 512))

  def test_fp8_under_vmap(self):
    f = jax.vmap(lambda x, w: jd.all_gather_matmul(x, w, axis_name="v", fp8="tensor"),
                 axis_name="v")
    with self.assertRaisesMsg(ValueError, "fp8: not where jax.vmap binds axis_name 'v'"):
      jax.eval_shape(f, _sds((2, 64, 128), jnp.float32), _sds((2, 128, 256), jnp.float32))

  def test_bad_gathered(self):
    body = lambda x, w: jd.all_gather_matmul(x, w, axis_name="tp", gathered="c")
    with self.assertRaisesMsg(ValueError, "gathered: expected 'x' or 'w', got 'c'"):
      trace(body, AG_A, (16, 8), (8, 16))

  def test_return_gathered_needs_an_all_gather(self):
    with self.assertRaisesMsg(ValueError, "return_gathered: only an AllGather schedule gathers "
                              "an operand, not ReduceScatter1D_TilingA_RotatingC"):
      trace(dm(RS_A, return_gathered=True), RS_A, (16, 16), (16, 8))
    with self.assertRaisesMsg(TypeError, "return_gathered: expected a bool, got 'yes'"):
      trace(dm(AG_A, return_gathered="yes"), AG_A, (16, 8), (8, 16))

  def test_bad_scatter(self):
    body = lambda x, w: jd.matmul_reduce_scatter(x, w, axis_name="tp", scatter="diag")
    with self.assertRaisesMsg(ValueError, "scatter: expected 'rows' or 'cols', got 'diag'"):
      trace(body, RS_A, (16, 16), (16, 8))

  def test_bad_implementation(self):
    with self.assertRaisesMsg(ValueError, "implementation: expected one of ('ffi', 'xla', "
                              "'reference') or None, got 'cuda'"):
      trace(dm(AG_A, implementation="cuda"), AG_A, (16, 8), (8, 16))

  def test_bad_implementation_env(self):
    with mock.patch.dict(os.environ, {"JAX_DISTGEMM_IMPLEMENTATION": "triton"}):
      with self.assertRaisesMsg(ValueError, "JAX_DISTGEMM_IMPLEMENTATION must be one of ('ffi', "
                                "'xla', 'reference') or unset, got 'triton'"):
        trace(dm(AG_A), AG_A, (16, 8), (8, 16))

  def test_bad_schedule_name(self):
    with self.assertRaisesMsg(ValueError, "schedule: unknown name 'AllGather2D'; expected one "
                              "of ['AllGather1D_TilingCD_RotatingA'"):
      trace(dm("AllGather2D"), AG_A, (16, 8), (8, 16))
    for bad in (7, 1.0, True, None):
      with self.assertRaisesMsg(ValueError, "schedule: expected a Schedule, one of the names"):
        trace(dm(bad), AG_A, (16, 8), (8, 16))
    self.assertIs(Schedule.parse(2), RS_A)

  # -- scalars and timeouts ----------------------------------------------------------------------

  def test_non_static_alpha(self):
    mesh = tu.mesh_1d(TP)
    xs, ws, os_ = tu.specs(AG_A, 0)

    def f(x, w, s):
      return jax.shard_map(lambda x, w: jd.all_gather_matmul(x, w, axis_name="tp", alpha=s),
                           mesh=mesh, in_specs=(xs, ws), out_specs=os_)(x, w)
    x, w = _sds((16, 8), jnp.float32, mesh, xs), _sds((8, 16), jnp.float32, mesh, ws)
    with self.assertRaisesMsg(TypeError, "alpha: must be a static Python float (or int, or "
                              "NumPy scalar), got DynamicJaxprTracer"):
      jax.eval_shape(f, x, w, 2.0)

  def test_alpha_beta_not_finite(self):
    # 1e300 became inf in the kernels' float32 scalar, with only NumPy's overflow warning.
    for bad in (1e300, float("nan"), float("inf"), 10**400):  # 10**400: float() overflows
      with self.assertRaisesMsg(ValueError, "alpha: must be finite as a float32 (the kernels' "
                                "epilogue scalar), got"):
        trace(dm(AG_A, alpha=bad), AG_A, (16, 8), (8, 16))
    with self.assertRaisesMsg(ValueError, "beta: must be finite as a float32"):
      trace(dm(AG_A, beta=-1e39), AG_A, (16, 8), (8, 16), c_shape=(16, 16))

  def test_non_static_beta(self):
    body = lambda x, w, c: jd.distributed_matmul(x, w, c, axis_name="tp", schedule=AG_A,
                                                 beta=c[0, 0])
    with self.assertRaisesMsg(TypeError, "beta: must be a static Python float"):
      trace(body, AG_A, (16, 8), (8, 16), c_shape=(16, 16))

  def test_timeout_ms_not_positive(self):
    for bad in (0, -5):
      with self.assertRaisesMsg(ValueError, f"timeout_ms: must be a positive integer, got {bad}"):
        trace(dm(RS_A, timeout_ms=bad), RS_A, (16, 16), (16, 8))

  def test_timeout_ms_not_an_integer(self):
    # Never truncated (1.5 would have been 1 ms) or passed to int() unchecked.
    with self.assertRaisesMsg(ValueError, "timeout_ms: must be a positive integer, got 1.5 (float"):
      trace(dm(AG_A, timeout_ms=1.5), AG_A, (16, 8), (8, 16))
    for bad, shown in ((True, "True (bool"), ("abc", "'abc' (str")):
      with self.assertRaisesMsg(ValueError, f"timeout_ms: must be a positive integer, got {shown}"):
        trace(dm(AG_A, timeout_ms=bad), AG_A, (16, 8), (8, 16))
    with self.assertRaisesMsg(ValueError, "timeout_ms: must be at most 2147483647 ms (~24.8 days), "
                              "got 1180591620717411303424"):
      trace(dm(AG_A, timeout_ms=2**70), AG_A, (16, 8), (8, 16))
    self.assertEqual(config.check_timeout_ms(np.int32(5)), 5)
    with mock.patch.dict(os.environ, {"JAX_DISTGEMM_TIMEOUT_MS": str(2**31)}):
      with self.assertRaisesMsg(ValueError, "JAX_DISTGEMM_TIMEOUT_MS must be at most 2147483647 "
                                "ms, got 2147483648"):
        trace(dm(AG_A), AG_A, (16, 8), (8, 16))

  def test_timeout_env_not_positive(self):
    for bad, shown in (("0", "0"), ("soon", "'soon'")):
      with mock.patch.dict(os.environ, {"JAX_DISTGEMM_TIMEOUT_MS": bad}):
        with self.assertRaisesMsg(ValueError, "JAX_DISTGEMM_TIMEOUT_MS must be a positive "
                                  f"integer, got {shown}"):
          trace(dm(AG_A), AG_A, (16, 8), (8, 16))

  # -- platform / CUDA rules (pure Python, no GPU needed) -----------------------------------------

  def test_ffi_on_unsupported_platform(self):
    x, w = _sds((4, 8), jnp.float32), _sds((8, 4), jnp.float32)
    self.assertEqual(implementation.ffi_unsupported_reason("tpu", x, w, jnp.float32, AG_A, TP),
                     "no FFI executor for platform 'tpu'")
    self.assertIsNone(implementation.ffi_unsupported_reason("cpu", x, w, jnp.float32, AG_A, TP))
    # Through the public API: an explicit 'ffi' raises, None falls back to the XLA ring.
    with mock.patch.object(implementation, "platform", return_value="tpu"):
      with self.assertRaisesMsg(NotImplementedError, "jax_distgemm implementation='ffi': no FFI "
                                "executor for platform 'tpu'"):
        trace(dm(AG_A, implementation="ffi"), AG_A, (16, 8), (8, 16))
      mesh = tu.mesh_1d(TP)
      xs, ws, os_ = tu.specs(AG_A, 0)
      xg, wg, _ = tu.random_inputs(0, (16, 8), (8, 16), jnp.float32)
      f = jax.jit(jax.shard_map(dm(AG_A), mesh=mesh, in_specs=(xs, ws), out_specs=os_))
      out = f(jax.device_put(xg, NamedSharding(mesh, xs)),
              jax.device_put(wg, NamedSharding(mesh, ws)))
      self.assertNotIn("jax_distgemm_v1", f.lower(xg, wg).as_text())
    self.assertLess(tu.rel_err(out, tu.reference_np(xg, wg)), 1e-5)

  def test_ffi_in_nested_shard_map(self):
    # An inner shard_map without mesh= lowers with an AbstractMesh: 'ffi' says why it cannot run
    # (reading its `devices` used to raise a ValueError first), None runs the XLA ring.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2 * TP]).reshape(2, TP), ("data", "tp"))
    xg, wg, _ = tu.random_inputs(0, (2, 16, 8), (8, 16), jnp.float32)

    def run(impl):
      inner = jax.shard_map(
          lambda x, w: jd.all_gather_matmul(x, w, axis_name="tp", implementation=impl),
          in_specs=(P(None, "tp", None), P(None, "tp")), out_specs=P(None, None, "tp"),
          axis_names={"tp"})
      return jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(P("data"), P()),
                                   out_specs=P("data"), axis_names={"data"}))(xg, wg)

    with self.assertRaisesRegex(NotImplementedError, "concrete jax.sharding.Mesh"):
      run("ffi")
    self.assertLess(tu.rel_err(run(None), np.asarray(xg) @ np.asarray(wg)), 1e-5)

  def test_ffi_cuda_not_built(self):
    x, w = _sds((4, 8), jnp.bfloat16), _sds((8, 16), jnp.bfloat16)
    reason = implementation.ffi_unsupported_reason("cuda", x, w, jnp.bfloat16, AG_A, TP)
    if jax_distgemm_has_cuda():  # a CUDA build: this aligned bf16 case is runnable
      self.assertIsNone(reason)
    else:
      self.assertStartsWith(reason, "the CUDA executor was not built (no nvcc at install time)")

  def test_cuda_dtype_rules(self):
    x, w = _sds((4, 8), jnp.float32), _sds((8, 8), jnp.float32)
    self.assertEqual(cuda_rules.unsupported_reason(x, w, jnp.float32, AG_A, TP),
                     "x, w: dtype float32 is not supported on CUDA (bfloat16 or float16)")
    x, w = _sds((4, 8), jnp.bfloat16), _sds((8, 8), jnp.bfloat16)
    self.assertEqual(cuda_rules.unsupported_reason(x, w, jnp.float16, AG_A, TP),
                     "out_dtype: float16 with bfloat16 inputs is not built (use bfloat16 or "
                     "float32)")
    self.assertIsNone(cuda_rules.unsupported_reason(x, w, jnp.float32, AG_A, TP))

  def test_cuda_tp_limit(self):
    # The C++ limit, read from its header, is the one None and "ffi" check before launch.
    header = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "cc", "cuda",
                          "peer_state.h")
    with open(header) as f:
      self.assertIn(f"inline constexpr int kMaxTp = {cuda_rules.CUDA_MAX_TP};", f.read())
    x, w = _sds((4, 64), jnp.bfloat16), _sds((64, 64 * 65 * 8), jnp.bfloat16)
    self.assertEqual(cuda_rules.unsupported_reason(x, w, jnp.bfloat16, AG_A, 65),
                     "tp: 65 ranks; the CUDA executor takes at most 64 (kMaxTp)")
    self.assertIsNone(cuda_rules.unsupported_reason(x, w, jnp.bfloat16, AG_A, 64))

  def test_tma_alignment(self):
    bf16 = jnp.bfloat16
    ok = cuda_rules.unsupported_reason(_sds((4, 64), bf16), _sds((64, 32), bf16), bf16, AG_A, TP)
    self.assertIsNone(ok)
    cases = [
        # (x, w, out_dtype, schedule, expected message)
        ((4, 12), (12, 32), bf16, AG_A,
         "x (K): the last dimension (12 x 2 bytes) must be a multiple of 16 bytes for TMA"),
        ((4, 64), (64, 12), bf16, AG_B,
         "w (N): the last dimension (12 x 2 bytes) must be a multiple of 16 bytes for TMA"),
        ((8, 64), (64, 16), bf16, RS_B,  # out columns N/TP = 4 -> 8 bytes
         "out (columns): the last dimension (4 x 2 bytes) must be a multiple of 16 bytes for TMA"),
        ((8, 64), (64, 16), jnp.float32, RS_B,  # out 4 x 4 bytes is fine, the w block is not
         "w (N/TP): the column block (4) must start 16-byte aligned for TMA"),
    ]
    for xs, ws, od, sched, msg in cases:
      with self.subTest(schedule=sched.name, x=xs, w=ws):
        self.assertEqual(cuda_rules.unsupported_reason(_sds(xs, bf16), _sds(ws, bf16), od, sched,
                                                       TP), msg)

  def test_stage_extents_fit_32_bits(self):
    # CUTLASS's problem shape holds int extents: a stage of 2^31 rows was admitted and wrapped
    # to -2^31 in the kernel launch.
    bf16 = jnp.bfloat16
    self.assertEqual(
        cuda_rules.unsupported_reason(_sds((2**31, 8), bf16), _sds((8, 8), bf16), bf16, AG_B,
                                      2),
        "x, w: a stage GEMM's rows 2147483648 exceeds 2147483647 (CUTLASS takes 32-bit extents)")
    self.assertEqual(
        cuda_rules.unsupported_reason(_sds((8, 2**31), bf16), _sds((2**31, 8), bf16), bf16,
                                      AG_A, 2),
        f"x, w: a stage GEMM's contraction {2**31} exceeds {2**31 - 1} (CUTLASS takes 32-bit "
        "extents)")

  def test_gpus_other_than_hopper(self):
    # The kernels are sm_90a: an A100 (8.0) or B200 (10.0) failed at the first call ("no
    # kernel image") where None should have run XLA's path.
    bf16 = jnp.bfloat16
    x, w = _sds((4, 64), bf16), _sds((64, 32), bf16)
    fake = lambda cc: [mock.Mock(compute_capability=cc)]
    with mock.patch.object(cuda_rules.jax, "local_devices", return_value=fake("8.0")):
      self.assertEqual(cuda_rules.unsupported_reason(x, w, bf16, AG_A, TP),
                       "GPUs of compute capability 8.0: the CUDA executor's kernels are built "
                       "for sm_90a (Hopper, 9.0) only")
    with mock.patch.object(cuda_rules.jax, "local_devices", return_value=fake("9.0")):
      self.assertIsNone(cuda_rules.unsupported_reason(x, w, bf16, AG_A, TP))

  def test_workspace_cap(self):
    bf16 = jnp.bfloat16
    x, w = _sds((1024, 1024), bf16), _sds((1024, 64), bf16)  # AG_A: 2*3*2 MiB = 12 MiB
    self.assertEqual(cuda_rules.workspace_bytes(x.shape, w.shape, bf16, AG_A, 4), 12 << 20)
    self.assertEqual(config.workspace_cap_bytes(), 8192 << 20)  # default
    self.assertIsNone(cuda_rules.unsupported_reason(x, w, bf16, AG_A, 4))
    with mock.patch.dict(os.environ, {"JAX_DISTGEMM_MAX_WORKSPACE_MB": "12"}):
      self.assertIsNone(cuda_rules.unsupported_reason(x, w, bf16, AG_A, 4))  # exactly at cap
    with mock.patch.dict(os.environ, {"JAX_DISTGEMM_MAX_WORKSPACE_MB": "8"}):
      self.assertEqual(
          cuda_rules.unsupported_reason(x, w, bf16, AG_A, 4),
          "workspace: AllGather1D_TilingCD_RotatingA with TP=4 needs 12582912 bytes (12.0 MiB) "
          "of workspace per device, more than the cap of 8388608 bytes (8.0 MiB); raise "
          "JAX_DISTGEMM_MAX_WORKSPACE_MB or shrink the per-device shapes")
    for bad, shown in (("0", "0"), ("lots", "'lots'")):
      with mock.patch.dict(os.environ, {"JAX_DISTGEMM_MAX_WORKSPACE_MB": bad}):
        with self.assertRaisesMsg(ValueError, "JAX_DISTGEMM_MAX_WORKSPACE_MB must be a positive "
                                  f"integer (MiB), got {shown}"):
          config.workspace_cap_bytes()


class CudaImportTest(absltest.TestCase):
  """Why the CUDA extension is missing, as ffi_unsupported_reason reports it."""

  def test_cuda_import_error_says_why(self):
    # Not "partially initialized module ... (most likely due to a circular import)": the
    # reason implementation.ffi_unsupported_reason appends.
    from jax_distgemm import ffi as ffi_modules  # noqa: PLC0415
    if not ffi_modules.has_cuda():
      msg = str(ffi_modules.cuda_import_error)
      self.assertNotIn("circular import", msg)
      self.assertIn("_distgemm_cuda was not built", msg)
    name = "jax_distgemm.ffi._distgemm_cuda"
    for raised, want in (
        (ModuleNotFoundError(f"No module named {name!r}", name=name), "was not built: no "),
        (ImportError("libcudart.so.12: cannot open shared object file"),
         "is installed but does not load: libcudart.so.12"),
        (ModuleNotFoundError("No module named 'nvidia'", name="nvidia"),
         "is installed but does not load: No module named 'nvidia'")):
      with self.subTest(raised=raised), mock.patch.object(
          ffi_modules.importlib, "import_module", side_effect=raised):
        module, error = ffi_modules._import_cuda()
      self.assertIsNone(module)
      self.assertIsInstance(error, ImportError)
      self.assertIn(want, str(error))
    fake = object()
    with mock.patch.object(ffi_modules.importlib, "import_module", return_value=fake):
      self.assertEqual(ffi_modules._import_cuda(), (fake, None))


class WorkspaceEstimateTest(absltest.TestCase):
  """The estimate behind the workspace cap (not a bad input: no row in the table)."""

  def test_workspace_estimate(self):
    bf16 = jnp.bfloat16
    # AG: 2 (double buffer) * (TP-1) slots * one shard of the rotating operand.
    self.assertEqual(cuda_rules.workspace_bytes((2, 8, 64), (64, 32), bf16, AG_A, 4),
                     2 * 3 * 2 * 8 * 64 * 2)
    self.assertEqual(cuda_rules.workspace_bytes((2, 8, 64), (64, 32), bf16, AG_B, 4),
                     2 * 3 * 64 * 32 * 2)
    # RS: running sums of one output tile, in the output dtype, 256-byte slots, as many as the
    # executor's path takes (cuda_rules.rs_path): stage k = 64 <= 2048, so the copy ring's
    # 2 (TP-1), or TP-1 for remote C.
    self.assertEqual(cuda_rules.workspace_bytes((2, 8, 64), (64, 32), bf16, RS_A, 4),
                     2 * 6 * 256)  # 2*2*32 bf16 = 256 bytes
    self.assertEqual(cuda_rules.workspace_bytes((2, 8, 64), (64, 32), bf16, RS_A, 4,
                                                jnp.float32), 2 * 6 * 512)
    with mock.patch.dict(os.environ, {"JAX_DISTGEMM_RS_PATH": "remote_c"}):
      self.assertEqual(cuda_rules.workspace_bytes((2, 8, 64), (64, 32), bf16, RS_A, 4),
                       2 * 3 * 256)
    self.assertEqual(cuda_rules.workspace_bytes((2, 8, 64), (64, 32), bf16, RS_B, 4),
                     2 * 6 * 256)  # 2*8*8 bf16 = 256 bytes
    self.assertEqual(cuda_rules.workspace_bytes((2, 8, 100), (100, 36), bf16, RS_B, 4),
                     2 * 6 * 512)  # 2*8*9 bf16 = 288 bytes -> one 512-byte slot
    self.assertEqual(cuda_rules.workspace_bytes((8, 64), (64, 32), bf16, RS_B, 1), 0)

  def test_workspace_estimate_follows_the_reduce_scatter_path(self):
    bf16 = jnp.bfloat16
    # RS TilingA at TP=4, local x (128, 16), w (16, 64): stage (sm, sk, sn) = (32, 16, 64) and
    # 16 x 96 <= 32 x 64, so the executor gathers: per parity 3 x (x rows 32x16 + w 16x64 +
    # one running sum 32x64), bf16.
    gather = 2 * 3 * (32 * 16 * 2 + 16 * 64 * 2 + 32 * 64 * 2)
    ring = 2 * 6 * 32 * 64 * 2  # the copy ring (stage k <= 2048)
    cases = ({}, gather), ({"JAX_DISTGEMM_RS_PATH": "copy_ring"}, ring), (
        {"JAX_DISTGEMM_RS_PATH": "remote_c"}, ring // 2)
    for env, want in cases:
      with self.subTest(env=env), tu.rs_env(env):
        self.assertEqual(cuda_rules.workspace_bytes((128, 16), (16, 64), bf16, RS_A, 4), want)
    # TilingB never gathers.
    self.assertEqual(cuda_rules.rs_path(RS_B, 4, (128, 16), (16, 64)), "copy_ring")
    # A batched problem falls back from an asked-for gather to the automatic ring paths.
    with mock.patch.dict(os.environ, {"JAX_DISTGEMM_RS_PATH": "gather"}):
      self.assertEqual(cuda_rules.rs_path(RS_A, 4, (2, 128, 16), (16, 64)), "copy_ring")
      self.assertEqual(cuda_rules.rs_path(RS_A, 4, (2, 128, 4096), (4096, 64)), "remote_c")
    self.assertEqual(cuda_rules.rs_path(AG_A, 4, (128, 16), (16, 64)), "")

  def test_the_rule_is_the_extensions(self):
    # The path and the workspace come from cc/common/workspace.h through the CPU module; the
    # CUDA module, where built, answers the same.
    from jax_distgemm import ffi as ffi_modules  # noqa: PLC0415
    modules = [ffi_modules.module_for("cpu")] + (
        [ffi_modules.module_for("cuda")] if ffi_modules.has_cuda() else [])
    for module in modules:
      self.assertEqual(module.rs_path(int(RS_A), 4, [128, 16], [16, 64]), "gather")
      self.assertEqual(module.rs_path(int(RS_A), 4, [128, 16], [16, 64], override=2),
                       "copy_ring")
      self.assertEqual(module.workspace_bytes(int(AG_B), 4, [2, 8, 64], [64, 32], "bfloat16",
                                              "bfloat16"), 2 * 3 * 64 * 32 * 2)
      with self.assertRaisesRegex(ValueError, "rows of x \\(M=6\\) must be divisible by TP=4"):
        module.workspace_bytes(int(RS_A), 4, [6, 16], [16, 8], "bfloat16", "bfloat16")
      with self.assertRaisesRegex(ValueError, "override: unknown RsPath 9"):
        module.rs_path(int(RS_A), 4, [128, 16], [16, 64], override=9)


def jax_distgemm_has_cuda() -> bool:
  from jax_distgemm import ffi as ffi_modules
  return ffi_modules.has_cuda()


class HandlerValidationTest(absltest.TestCase):
  """The C++ handler's own checks (MakeProblem), reached by binding the primitive directly.

  Each bad call must raise a JaxRuntimeError carrying the handler's INVALID_ARGUMENT message
  (not abort the process), and a correct call right after must still give the right answer.
  """

  def run_bound(self, schedule, x_shape, w_shape, *, dtype=jnp.float32, out_dtype=jnp.float32,
                c_shape=None, inputs=None):
    """Binds distgemm_p inside shard_map (no Python validation) and runs it on TP=4 devices
    (on all-ones operands, or the global `inputs` (x, w))."""
    mesh = tu.mesh_1d(TP)
    xs, ws, os_ = tu.specs(schedule, len(x_shape) - 2)
    in_specs = (xs, ws) + ((P(),) if c_shape is not None else ())

    def body(x, w, *c):
      return primitives.bind(x, w, c[0] if c else None, schedule=schedule, axis_name=("tp",),
                             tp=TP, alpha=1.0, beta=1.0 if c else 0.0, out_dtype=out_dtype,
                             timeout_ms=2000)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=os_))
    x, w = inputs or (jnp.ones(x_shape, dtype), jnp.ones(w_shape, dtype))
    x = jax.device_put(x, NamedSharding(mesh, xs))
    w = jax.device_put(w, NamedSharding(mesh, ws))
    args = (x, w)
    if c_shape is not None:
      args += (jax.device_put(jnp.ones(c_shape, jnp.float32), NamedSharding(mesh, P())),)
    return np.asarray(f(*args))

  def assertHandlerError(self, excerpt, *args, **kwargs):
    with self.assertRaisesRegex(jax.errors.JaxRuntimeError,
                                "INVALID_ARGUMENT: jax_distgemm: " + re.escape(excerpt)):
      self.run_bound(*args, **kwargs)
    self.assertProcessUsable()

  def assertProcessUsable(self):
    # Fresh random operands (all ones would hide a misplaced tile or a stale output).
    self._usable_calls = getattr(self, "_usable_calls", 0) + 1
    x, w, _ = tu.random_inputs(100 + self._usable_calls, (8, 16), (16, 8), jnp.float32)
    out = self.run_bound(RS_B, (8, 16), (16, 8), inputs=(x, w))
    self.assertLess(tu.rel_err(out, tu.reference_np(x, w)), 1e-5)

  def test_handler_mismatched_contraction_dim(self):
    self.assertHandlerError("x, w: contraction dims must match (x[..., K] with w[K, N]), got "
                            "x [4, 8] and w [12, 4]", AG_A, (16, 8), (12, 16))

  def test_handler_unsupported_dtype(self):
    self.assertHandlerError("x, w: dtype must be bfloat16, float16 or float32", AG_B, (16, 8),
                            (8, 16), dtype=jnp.int8)

  def test_handler_unsupported_out_dtype(self):
    self.assertHandlerError("out: dtype must be bfloat16, float16 or float32", AG_A, (16, 8),
                            (8, 16), out_dtype=jnp.int32)

  def test_handler_bad_fp8_scales(self):
    # Past the Python checks (primitives.bind directly): the handler's own (problem.cc).
    mesh = tu.mesh_1d(2)

    def body(x, w):
      (xq, sx), (wq, sw) = jd.quantize(x, "block"), jd.quantize(w, "block", operand="w")
      return primitives.bind(xq, wq, None, schedule=AG_A, axis_name=("tp",), tp=2, alpha=1.0,
                             beta=0.0, out_dtype=jnp.float32, timeout_ms=2000,
                             x_scale=sx[:, :1], w_scale=sw)  # one K block's scales of two

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp")))
    with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "INVALID_ARGUMENT: jax_distgemm: " +
                                re.escape("x_scale, w_scale: expected both scalars (per-tensor "
                                          "scaling) or block scales [..., 32, 2]")):
      jax.block_until_ready(f(jnp.ones((64, 256)), jnp.ones((256, 256))))
    self.assertProcessUsable()

  def test_handler_gathered_wrong_shape(self):
    # The primitive derives the gathered result's shape itself; a wrong one (patched here) must
    # be refused by the handler, not written past.
    mesh = tu.mesh_1d(TP)
    xs, ws, os_ = tu.specs(AG_A, 0)

    def body(x, w):
      out, _ = primitives.bind(x, w, None, schedule=AG_A, axis_name=("tp",), tp=TP, alpha=1.0,
                               beta=0.0, out_dtype=jnp.float32, timeout_ms=2000, gathered=True)
      return out

    bad = lambda s, x_shape, w_shape, tp: (x_shape[-2] * tp + 1, x_shape[-1])
    with mock.patch.object(primitives, "gathered_shape", bad):
      f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=os_))
      args = (jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, xs)),
              jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, ws)))
      with self.assertRaisesRegex(jax.errors.JaxRuntimeError, re.escape(
          "INVALID_ARGUMENT: jax_distgemm: gathered: expected x's shape [4, 8] with dim 0 times "
          "TP=4, got [17, 8]")):
        np.asarray(f(*args))
    self.assertProcessUsable()

  def test_handler_rs_rows_not_divisible(self):
    self.assertHandlerError("ReduceScatter1D_TilingA_RotatingC: rows of x (M=6) must be "
                            "divisible by TP=4", RS_A, (6, 16), (16, 8))

  def test_handler_rs_columns_not_divisible(self):
    self.assertHandlerError("ReduceScatter1D_TilingB_RotatingC: columns of w (N=6) must be "
                            "divisible by TP=4", RS_B, (8, 16), (16, 6))

  def test_handler_c_wrong_shape(self):
    # Local out of RS_B is [8, 2]; c is passed replicated as [8, 3].
    self.assertHandlerError("c: must have the output's shape [8, 2], got [8, 3]", RS_B, (8, 16),
                            (16, 8), c_shape=(8, 3))


class RsPathAttributeTest(absltest.TestCase):
  """JAX_DISTGEMM_RS_PATH, a test hook read when a call is lowered into the call's rs_path
  attribute (config.rs_path_override), and the handler's check of that attribute.  Not a user
  input: no row in the bad-input table."""

  run_bound = HandlerValidationTest.run_bound
  assertProcessUsable = HandlerValidationTest.assertProcessUsable

  def lowered(self, schedule):
    mesh = tu.mesh_1d(TP)
    xs, ws, os_ = tu.specs(schedule, 0)
    f = jax.jit(jax.shard_map(dm(schedule, implementation="ffi"), mesh=mesh,
                              in_specs=(xs, ws), out_specs=os_))
    return f.lower(_sds((16, 16), jnp.float32, mesh, xs),
                   _sds((16, 8), jnp.float32, mesh, ws)).as_text()

  def test_names_become_the_attribute(self):
    self.assertEqual(config.RS_PATHS, {"remote_c": 1, "copy_ring": 2, "gather": 3})
    for env, want in [({}, 0)] + [({"JAX_DISTGEMM_RS_PATH": k}, v)
                                  for k, v in config.RS_PATHS.items()]:
      with self.subTest(env=env), tu.rs_env(env):
        self.assertEqual(config.rs_path_override(), want)
        self.assertRegex(self.lowered(RS_A), rf"rs_path = {want} : i32")
        # AllGather calls carry 0 whatever the switch says.
        self.assertRegex(self.lowered(AG_A), r"rs_path = 0 : i32")

  def test_bad_name_is_refused_at_lowering(self):
    with tu.rs_env({"JAX_DISTGEMM_RS_PATH": "push"}):
      with self.assertRaisesRegex(ValueError, re.escape(
          "JAX_DISTGEMM_RS_PATH must be 'remote_c', 'copy_ring', 'gather' or unset, got "
          "'push'")):
        self.lowered(RS_A)

  def test_handler_refuses_an_unknown_value(self):
    with mock.patch.object(config, "rs_path_override", return_value=7):
      with self.assertRaisesRegex(jax.errors.JaxRuntimeError, re.escape(
          "INVALID_ARGUMENT: jax_distgemm: rs_path: unknown value 7 (0 automatic, 1 remote_c, "
          "2 copy_ring, 3 gather)")):
        self.run_bound(RS_A, (16, 16), (16, 8))
    self.assertProcessUsable()


def _doc_rows():
  """(input, excerpt, where, module.Class.test) rows of the bad-input table."""
  text = DOC.read_text()
  section = text.split("## Bad inputs", 1)[1].split("\n## ", 1)[0]
  rows = []
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 4 or not cells[3].startswith("`") or cells[0].startswith("Input"):
      continue
    excerpt = re.fullmatch(r"`(.*)`", cells[1])
    rows.append((cells[0], excerpt.group(1) if excerpt else None, cells[2],
                 cells[3].strip("`")))
  return rows


class DocsTableTest(absltest.TestCase):

  def test_docs_table_matches_tests(self):
    """Every row of the bad-input table names a test that exists and asserts its excerpt."""
    _check_docs_table(self)


def _check_docs_table(self):
  rows = _doc_rows()
  self.assertGreaterEqual(len(rows), 30, "the bad-input table in docs/reliability.md is missing")
  seen = set()
  for what, excerpt, where, test in rows:
    with self.subTest(row=what):
      self.assertIsNotNone(excerpt, f"row {what!r}: the excerpt must be in backticks")
      self.assertRegex(where, r"^(Python|C\+\+|JAX)")
      module_name, cls_name, method = test.split(".")
      self.assertEqual(module_name, "validation_test")
      fn = getattr(globals()[cls_name], method)
      # The test asserts the excerpt (possibly split over string literals): compare the source
      # with adjacent literals joined.
      src = inspect.getsource(fn)
      joined = re.sub(r'"\s*\n\s*(f?)"', "", src)
      joined = re.sub(r'" "', "", joined)
      self.assertIn(excerpt, joined.replace('\\"', '"'),
                    f"{test} does not assert the documented excerpt {excerpt!r}")
      seen.add(test)
  # And every validation test is documented.
  for cls in (ValidationTest, HandlerValidationTest):
    for name in dir(cls):
      if name.startswith("test_"):
        self.assertIn(f"validation_test.{cls.__name__}.{name}", seen,
                      f"{cls.__name__}.{name} has no row in docs/reliability.md")


if __name__ == "__main__":
  absltest.main()

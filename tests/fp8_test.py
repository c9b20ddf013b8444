"""fp8 operands on fake CPU devices: quantize, every schedule per tensor and in blocks, and
fp8= differentiated straight through the quantizer (bad fp8 inputs: validation_test).

Each device quantizes its own shard (its scales describe that shard only), so a schedule that
moves a shard must move its scales with it: a scale left behind multiplies the wrong block.
"""

import test_util  # noqa: I001  (first: requests the 8 fake CPU devices)

import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_distgemm as jd
from jax_distgemm import Schedule
from jax_distgemm._src import primitives

SCHEDULES = tuple(Schedule)
# Products of the dequantized values in fp32: only the accumulation order differs.
F32_TOL = 1e-5


def shapes(tp: int, batch: int = 0):
  """x, w global shapes with whole 128-blocks in every shard and every stage's slice."""
  lead = (batch,) if batch else ()
  return lead + (32 * tp, 128 * tp), (128 * tp, 128 * tp)


def run(schedule, x, w, *, tp, scaling, implementation=None, c=None, alpha=1.0, beta=0.0,
        out_dtype=jnp.float32):
  """Each device quantizes its shards and calls the op: (out, dequantized x, dequantized w)."""
  mesh = test_util.mesh_1d(tp)
  xs, ws, os_ = test_util.specs(schedule, x.ndim - 2)

  def body(x, w, *c):
    xq, sx = jd.quantize(x, scaling, operand="x")
    wq, sw = jd.quantize(w, scaling, operand="w")
    out = jd.distributed_matmul(xq, wq, c[0] if c else None, axis_name="tp", schedule=schedule,
                                x_scale=sx, w_scale=sw, alpha=alpha, beta=beta,
                                out_dtype=out_dtype, implementation=implementation)
    return out, jd.dequantize(xq, sx, operand="x"), jd.dequantize(wq, sw, operand="w")

  args = [x, w] + ([c] if c is not None else [])
  in_specs = (xs, ws) + ((os_,) if c is not None else ())
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(os_, xs, ws)))
  return f(*args)


class QuantizeTest(parameterized.TestCase):

  @parameterized.product(scaling=["tensor", "block"], operand=["x", "w"],
                         dtype=[jnp.float8_e4m3fn, jnp.float8_e5m2])
  def test_round_trip(self, scaling, operand, dtype):
    a = jax.random.normal(jax.random.key(3), (256, 384), jnp.float32)
    a = a.at[:128].multiply(1e9)  # blocks of very different ranges
    q, s = jd.quantize(a, scaling, operand=operand, dtype=dtype)
    self.assertEqual(q.dtype, jnp.dtype(dtype))
    want = {"tensor": (), "block": (256, 3) if operand == "x" else (2, 3)}[scaling]
    self.assertEqual(s.shape, want)
    back = np.asarray(jd.dequantize(q, s, operand=operand))
    # Relative to each 128-block's own magnitude: per-tensor scaling loses the small rows.
    small = slice(128, 256)
    err = np.linalg.norm(back[small] - a[small]) / np.linalg.norm(a[small])
    bound = {jnp.dtype(jnp.float8_e4m3fn): 0.04, jnp.dtype(jnp.float8_e5m2): 0.08}[jnp.dtype(dtype)]
    if scaling == "block":
      self.assertLess(err, bound)
    else:
      self.assertGreater(err, bound)  # the same rows under one scale: why blocks exist

  def test_zeros_get_scale_one(self):
    q, s = jd.quantize(jnp.zeros((128, 256)), "block", operand="w")
    np.testing.assert_array_equal(np.asarray(s), np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(np.asarray(q, np.float32), 0.0)

  @parameterized.parameters(
      (dict(scaling="rows"), ValueError, "scaling: expected 'tensor' or 'block'"),
      (dict(operand="y"), ValueError, "operand: expected 'x' or 'w'"),
      (dict(dtype=jnp.int8), TypeError, "dtype: expected float8_e4m3fn or float8_e5m2"),
      (dict(scaling="block", operand="w", shape=(100, 128)), ValueError, "multiple of 128"),
      (dict(scaling="block", shape=(128, 100)), ValueError, "multiple of 128"))
  def test_bad_arguments(self, kwargs, error, message):
    shape = kwargs.pop("shape", (128, 128))
    with self.assertRaisesRegex(error, message):
      jd.quantize(jnp.ones(shape), **kwargs)


def ranged(x, w, tp: int):
  """x and w with every shard in a range of its own (x by row and K block, w by K and column
  block), so that a scale applied to another shard's values is far off."""
  def ramp(n, base):
    return base ** (np.arange(n) * tp // n).astype(np.float32)

  *_, m, k = x.shape
  n = w.shape[-1]
  x = x * ramp(m, 4.0)[:, None] * ramp(k, 2.0)
  w = w * ramp(k, 2.0)[:, None] * ramp(n, 4.0)
  return x, w


class Fp8ScheduleTest(parameterized.TestCase):

  def check(self, schedule, tp, scaling, implementation=None, batch=0, epilogue=False):
    x_shape, w_shape = shapes(tp, batch)
    x, w, _ = test_util.random_inputs(test_util.seed_of(schedule, tp, scaling), x_shape,
                                      w_shape, jnp.float32)
    x, w = ranged(x, w, tp)
    c, alpha, beta = None, 1.0, 0.0
    if epilogue:
      out_global = x_shape[:-1] + (w_shape[-1],)
      c = jax.random.normal(jax.random.key(tp), out_global, jnp.float32)
      alpha, beta = 0.5, 2.0
    out, xd, wd = run(schedule, x, w, tp=tp, scaling=scaling, implementation=implementation,
                      c=c, alpha=alpha, beta=beta)
    ref = test_util.reference_np(xd, wd, c, alpha=alpha, beta=beta)
    self.assertLess(test_util.rel_err(out, ref), F32_TOL)

  # Each implementation with each scaling, over the schedules in turn.
  @parameterized.parameters(*((s, sc, i) for n, s in enumerate(SCHEDULES)
                              for sc, i in (("tensor", "reference"), ("block", "reference"),
                                            ("block", "xla"), ("tensor", "xla"))[n % 2::2]))
  def test_every_schedule_and_implementation(self, schedule, scaling, implementation):
    self.check(schedule, 4, scaling, implementation)

  @parameterized.product(schedule=SCHEDULES, scaling=["tensor", "block"])
  def test_fused_call(self, schedule, scaling):
    self.check(schedule, 4, scaling, "ffi")  # the CPU executor, scales in its rotation

  @parameterized.parameters("tensor", "block")
  def test_fused_call_reduce_scatter_by_gathering(self, scaling):
    # The executor's other ReduceScatter path: each stage reads a peer's x rows and w.
    self.enter_context(mock.patch.dict(os.environ, {"JAX_DISTGEMM_RS_PATH": "gather"}))
    self.check(Schedule.ReduceScatter1D_TilingA_RotatingC, 4, scaling, "ffi")

  # TP 2 and 4: the other cases.  Each TP with an AllGather and a ReduceScatter, in turn.
  @parameterized.parameters(*((SCHEDULES[tp % 2], tp) for tp in (1, 3, 5, 6, 7, 8)),
                            *((SCHEDULES[2 + tp % 2], tp) for tp in (1, 3, 5, 6, 7, 8)))
  def test_every_tp_by_default(self, schedule, tp):
    self.check(schedule, tp, "block" if tp == 1 else "tensor")  # None: the CPU executor

  @parameterized.parameters(*zip(SCHEDULES, ("ffi", "xla") * 2))
  def test_batch_and_epilogue(self, schedule, implementation):
    self.check(schedule, 2, "block", implementation, batch=2, epilogue=True)

  def test_a_scale_left_behind_is_caught(self):
    # The same check with one device's scale replaced must fail: the test can fail.
    schedule, tp = Schedule.AllGather1D_TilingCD_RotatingA, 4
    x, w, _ = test_util.random_inputs(7, *shapes(tp), jnp.float32)
    out, xd, wd = run(schedule, x, w, tp=tp, scaling="tensor", implementation="xla")
    wrong = np.asarray(xd).copy()
    wrong[:32] *= 2.0  # device 0's rows, as if its scale had doubled
    self.assertLess(test_util.rel_err(out, test_util.reference_np(xd, wd)), F32_TOL)
    self.assertGreater(test_util.rel_err(out, test_util.reference_np(wrong, wd)), 0.1)

  @parameterized.parameters("xla", "reference")
  def test_a_transposed_operand(self, implementation):
    # x arrives as the transpose of a quantized array, which XLA folds into the dot.
    schedule, tp = Schedule.ReduceScatter1D_TilingA_RotatingC, 2
    mesh = test_util.mesh_1d(tp)
    xs, ws, os_ = test_util.specs(schedule, 0)
    x, w, _ = test_util.random_inputs(11, *shapes(tp), jnp.float32)

    def body(xt, w):
      (xq, sx), (wq, sw) = jd.quantize(xt), jd.quantize(w, operand="w")
      out = jd.distributed_matmul(xq.T, wq, axis_name="tp", schedule=schedule, x_scale=sx,
                                  w_scale=sw, out_dtype=jnp.float32,
                                  implementation=implementation)
      return out, jd.dequantize(xq, sx).T, jd.dequantize(wq, sw)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), ws),
                              out_specs=(os_, xs, ws)))
    out, xd, wd = f(x.T, w)
    self.assertLess(test_util.rel_err(out, test_util.reference_np(xd, wd)), F32_TOL)

  def test_bf16_output(self):
    schedule, tp = Schedule.ReduceScatter1D_TilingA_RotatingC, 2
    x, w, _ = test_util.random_inputs(9, *shapes(tp), jnp.float32)
    out, xd, wd = run(schedule, x, w, tp=tp, scaling="block", out_dtype=None)
    self.assertEqual(out.dtype, jnp.bfloat16)  # the default for fp8 operands
    self.assertLess(test_util.rel_err(out, test_util.reference_np(xd, wd)), 1e-2)


class Fp8VmapTest(parameterized.TestCase):

  @parameterized.parameters("tensor", "block")
  def test_vmap_over_the_fused_call(self, scaling):
    # vmap outside shard_map: the primitive's batch rule gives operands and block scales a
    # leading batch dim; per tensor, unmapped scales stay scalars (w is the same in each slice).
    schedule, tp = Schedule.AllGather1D_TilingCD_RotatingB, 2
    mesh = test_util.mesh_1d(tp)
    xs, ws, os_ = test_util.specs(schedule, 0)
    x = jax.random.normal(jax.random.key(1), (3, 64, 256), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (256, 256), jnp.float32)
    wq, sw = jd.quantize(w, "tensor", operand="w") if scaling == "tensor" else (w, None)

    def body(x, w, *sw):
      xq, sx = jd.quantize(x, scaling, operand="x")
      if sw:  # per tensor: the one quantized w, outside the vmap
        wq, s = w, sw[0]
      else:
        wq, s = jd.quantize(w, scaling, operand="w")
      out = jd.distributed_matmul(xq, wq, axis_name="tp", schedule=schedule, x_scale=sx,
                                  w_scale=s, out_dtype=jnp.float32, implementation="ffi")
      return out, jd.dequantize(xq, sx), jd.dequantize(wq, s, operand="w")

    args, specs = (x, w), (xs, ws)
    if scaling == "tensor":
      args, specs = (x, wq, sw), (xs, ws, P())
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(os_, xs, ws))
    in_axes = (0, None) + ((None,) if scaling == "tensor" else ())
    out, xd, wd = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
    for b in range(3):
      ref = test_util.reference_np(xd[b], wd[b] if wd.ndim == 3 else wd)
      self.assertLess(test_util.rel_err(out[b], ref), F32_TOL)


class Fp8GradTest(parameterized.TestCase):
  """fp8=: the forward multiplies quantized operands; gradients pass straight through the
  quantizer, in fp8 per tensor (g in float8_e5m2) and in the operands' dtype for blocks."""

  def grads(self, schedule, tp, scaling, implementation=None, batch=0):
    mesh = test_util.mesh_1d(tp)
    xs, ws, os_ = test_util.specs(schedule, 1 if batch else 0)
    x, w, _ = test_util.random_inputs(test_util.seed_of("grad", schedule, tp, batch),
                                      *shapes(tp, batch), jnp.float32)
    probe = jax.random.normal(jax.random.key(5), x.shape[:-1] + w.shape[-1:], jnp.float32)

    def op(x, w, fp8):
      return jax.shard_map(lambda x, w: jd.distributed_matmul(
          x, w, axis_name="tp", schedule=schedule, fp8=fp8, implementation=implementation),
                           mesh=mesh, in_specs=(xs, ws), out_specs=os_)(x, w)

    def loss(x, w, fp8):
      return jnp.sum(op(x, w, fp8) * probe)  # linear: its cotangent is the probe, whatever ran

    grads = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
    quantized, exact = (np.asarray(jax.jit(op, static_argnums=2)(x, w, s), np.float64)
                        for s in (scaling, None))
    self.assertBetween(test_util.rel_err(quantized, exact), 1e-3, 0.1)  # the forward quantized
    return grads(x, w, scaling), grads(x, w, None), (x, w, probe)

  @parameterized.product(schedule=SCHEDULES, implementation=[None, "xla", "reference"])
  def test_per_tensor_backward_in_fp8(self, schedule, implementation):
    got, exact, (x, w, g) = self.grads(schedule, 2, "tensor", implementation)
    for a, want, b in zip(got, test_util.fp8_tensor_grads(schedule, x, w, g, 2), exact):
      self.assertLess(test_util.rel_err(a, want), F32_TOL)
      self.assertBetween(test_util.rel_err(a, np.asarray(b, np.float64)), 1e-2, 0.1)  # e5m2

  @parameterized.parameters(*((s, tp, b) for s, tp, b in zip(SCHEDULES, (3, 4, 3, 4),
                                                                (2, 0, 0, 2))))
  def test_per_tensor_backward_tp_and_batch(self, schedule, tp, batch):
    got, _, (x, w, g) = self.grads(schedule, tp, "tensor", batch=batch)
    for a, want in zip(got, test_util.fp8_tensor_grads(schedule, x, w, g, tp)):
      self.assertLess(test_util.rel_err(a, want), F32_TOL)

  @parameterized.parameters(*SCHEDULES)
  def test_block_backward_is_the_unquantized_ops(self, schedule):
    got, exact, _ = self.grads(schedule, 2, "block")
    for a, b in zip(got, exact):
      self.assertLess(test_util.rel_err(a, np.asarray(b, np.float64)), F32_TOL)

  @parameterized.product(scaling=["tensor", "block"], batch=[0, 2])
  def test_collective_matmul_under_jit(self, scaling, batch):
    # Auto axes: the jit-level backward's ops, partitioned like the forward.  Block: the
    # unquantized op's gradients (its dual ops' shards need not be whole 128-blocks).
    tp = 4
    mesh = jax.make_mesh((tp,), ("tp",), devices=test_util.cpu_devices(tp),
                         axis_types=(jax.sharding.AxisType.Auto,))
    x_shape, w_shape = shapes(tp, batch)
    x, w, _ = test_util.random_inputs(test_util.seed_of("jit grad", batch), x_shape, w_shape,
                                      jnp.float32)
    lead = (None,) * (x.ndim - 2)
    x = jax.device_put(x, NamedSharding(mesh, P(*lead, "tp", None)))
    w = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    probe = jax.random.normal(jax.random.key(5), x_shape[:-1] + w_shape[-1:], jnp.float32)

    def grads(fp8):
      loss = lambda x, w: jnp.sum(jd.collective_matmul(x, w, axis="tp", fp8=fp8) * probe)
      return jax.jit(jax.grad(loss, (0, 1)))

    with jax.set_mesh(mesh):
      got, exact = grads(scaling)(x, w), grads(None)(x, w)
      hlo = grads(scaling).lower(x, w).compile().as_text()
    errors = [test_util.rel_err(a, np.asarray(b, np.float64)) for a, b in zip(got, exact)]
    if scaling == "tensor":
      # dx is the forward's dual, a fused op (g in e5m2); where Shardy leaves dw no fused
      # layout (jax 0.12) the plain dot computes it unquantized.
      self.assertBetween(errors[0], 1e-2, 0.1)
      self.assertLess(errors[1], 0.1)
    else:
      self.assertLess(max(errors), F32_TOL)
    self.assertEqual("f8e5m2" in hlo, scaling == "tensor")

  def test_under_vmap(self):
    # vmap binds the axis (fp8= is refused there: validation_test); fp8 operands run the ring.
    x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (2, 128, 256), jnp.float32)

    def quantized(x, w):
      (xq, sx), (wq, sw) = jd.quantize(x), jd.quantize(w, operand="w")
      out = jd.all_gather_matmul(xq, wq, axis_name="v", x_scale=sx, w_scale=sw,
                                 out_dtype=jnp.float32)
      return out, jd.dequantize(xq, sx), jd.dequantize(wq, sw)

    out, xd, wd = jax.vmap(quantized, axis_name="v")(x, w)
    ref = np.concatenate(list(np.asarray(xd, np.float64)), 0) @ np.asarray(wd[0], np.float64)
    self.assertLess(test_util.rel_err(out[0], ref), F32_TOL)


class CudaLoweringTest(parameterized.TestCase):
  """The CUDA lowering, built on CPU: fp8 wgmma reads B K-major, so the call must ask XLA for w
  and its block scales column-major (cc/cuda/executor.h CallBuffers), and nothing else."""

  @parameterized.parameters("tensor", "block")
  def test_w_and_its_scales_arrive_column_major(self, scaling):
    tp, schedule = 2, Schedule.AllGather1D_TilingCD_RotatingB
    mesh = test_util.mesh_1d(tp)
    xs, ws, os_ = test_util.specs(schedule, 1)
    x, w = jnp.zeros((2, *shapes(tp)[0]), jnp.bfloat16), jnp.zeros(shapes(tp)[1], jnp.bfloat16)

    def body(x, w):
      return jd.distributed_matmul(x, w, axis_name="tp", schedule=schedule, fp8=scaling,
                                   implementation="ffi")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=os_))
    with mock.patch.object(primitives.device_ids, "register"):  # the CUDA extension's table
      text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [l for l in text.splitlines() if f"@{primitives.TARGET_FP8}" in l]
    self.assertLen(calls, 1)
    layouts = re.search(r"operand_layouts = \[(.*?)\]\s*,\s*result_layouts", calls[0]).group(1)
    layouts = [tuple(int(d) for d in m.split(",") if d.strip())
               for m in re.findall(r"dense<\[?([\d, ]*)\]?>", layouts)]
    # x [L, M, K] and its scales row-major; w [K, N] and block scales [K/128, N/128] K-major.
    want_ws = (0, 1) if scaling == "block" else ()
    self.assertEqual(layouts, [(2, 1, 0), (2, 1, 0) if scaling == "block" else (),
                               (0, 1), want_ws, (0,)])


if __name__ == "__main__":
  absltest.main()

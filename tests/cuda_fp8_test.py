"""fp8 through the CUDA executor (implementation="ffi") on quantized shards: every schedule, per
tensor and in blocks, bf16 and fp32 out, against the float64 product of the dequantized shards
and against XLA's fp8 path ("reference").  TP=1 needs one Hopper GPU, TP=2 two;
tests/cuda/virtual_group_check.cu --fp8 runs TP 2-8 on one.

NOTE: the shards are quantized by a program of their own.  Inside one program XLA may drop an
f32 -> fp8 -> f32 round trip (excess precision), so a quantize-then-dequantize there need not
give the values the GEMM multiplies.
"""

import test_util  # noqa: I001  (first)

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_distgemm as jd
from jax_distgemm import Schedule

SCHEDULES = tuple(Schedule)


def _scale_spec(spec, scaling):
  # Block scales shard like their operand; a per-tensor scale gets a leading dim per device.
  return spec if scaling == "block" else P("tp")


def quantized_shards(mesh, schedule, x, w, scaling):
  """Each device's shards of x and w quantized: (xq, sx, wq, sw) as global arrays."""
  xs, ws, _ = test_util.specs(schedule, x.ndim - 2)

  def body(x, w):
    (xq, sx), (wq, sw) = jd.quantize(x, scaling), jd.quantize(w, scaling, operand="w")
    if scaling == "tensor":
      sx, sw = sx[None], sw[None]
    return xq, sx, wq, sw

  specs = (xs, _scale_spec(xs, scaling), ws, _scale_spec(ws, scaling))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, xs), (w, ws))]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=specs))(*args)


def run(mesh, schedule, quantized, c, *, scaling, implementation, out_dtype):
  """(out, dequantized x, dequantized w) of the op on the quantized shards."""
  xs, ws, os_ = test_util.specs(schedule, quantized[0].ndim - 2)

  def body(xq, sx, wq, sw, *c):
    if scaling == "tensor":
      sx, sw = sx[0], sw[0]
    out = jd.distributed_matmul(xq, wq, c[0] if c else None, axis_name="tp",
                                schedule=schedule, x_scale=sx, w_scale=sw, alpha=0.5,
                                beta=2.0 if c else 0.0, out_dtype=out_dtype,
                                implementation=implementation)
    return out, jd.dequantize(xq, sx, operand="x"), jd.dequantize(wq, sw, operand="w")

  in_specs = (xs, _scale_spec(xs, scaling), ws, _scale_spec(ws, scaling))
  args = list(quantized)
  if c is not None:
    in_specs += (os_,)
    args.append(jax.device_put(c, NamedSharding(mesh, os_)))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(os_, xs, ws)))
  return f(*args)


class CudaFp8Test(parameterized.TestCase):

  def check(self, schedule, tp, scaling, out_dtype, batch=0, with_c=False):
    mesh = jax.sharding.Mesh(np.array(test_util.require_hopper_gpus(tp)), ("tp",))
    # K and N: whole 128-blocks in every shard and stage slice; M not a multiple of a tile.
    lead = (batch,) if batch else ()
    x_shape, w_shape = lead + (200 * tp, 256 * tp), (256 * tp, 256 * tp)
    x, w, _ = test_util.random_inputs(test_util.seed_of(schedule, tp, scaling), x_shape,
                                      w_shape, jnp.float32)
    c = None
    if with_c:
      c = jax.random.normal(jax.random.key(3), x_shape[:-1] + (w_shape[-1],), jnp.float32)
    quantized = quantized_shards(mesh, schedule, x, w, scaling)
    errors = {}
    for name in ("ffi", "reference"):
      out, xd, wd = run(mesh, schedule, quantized, c, scaling=scaling, implementation=name,
                        out_dtype=out_dtype)
      exact = test_util.reference_np(xd, wd, c, alpha=0.5, beta=2.0 if with_c else 0.0)
      errors[name] = test_util.rel_err(out, exact)
    # The tensor cores' fp8 sums (about 1e-4 of fp32 out, as cuBLASLt's fp8 GEMM) and bf16 out
    # rounding each output (and, ReduceScatter, each running sum) to 2^-8.
    if out_dtype == jnp.float32:
      self.assertLess(errors["ffi"], 1e-3, errors)
    else:  # XLA's path is cuBLASLt's fp8 GEMM here (fp32 out: a bf16 GEMM, nearly exact)
      self.assertLess(errors["ffi"], 2 ** -8 * tp, errors)
      self.assertLess(errors["ffi"], 1.25 * errors["reference"] + 1e-4, errors)

  @parameterized.product(schedule=SCHEDULES, scaling=["tensor", "block"],
                         out_dtype=[jnp.bfloat16, jnp.float32])
  def test_one_gpu(self, schedule, scaling, out_dtype):
    self.check(schedule, 1, scaling, out_dtype)

  @parameterized.product(schedule=SCHEDULES, scaling=["tensor", "block"])
  def test_one_gpu_batch_and_epilogue(self, schedule, scaling):
    self.check(schedule, 1, scaling, jnp.float32, batch=2, with_c=True)

  @parameterized.product(schedule=SCHEDULES, scaling=["tensor", "block"])
  def test_two_gpus(self, schedule, scaling):
    self.check(schedule, 2, scaling, jnp.bfloat16)


class CudaFp8GradTest(parameterized.TestCase):
  """fp8="tensor" differentiated on the CUDA executor: the backward's dual ops run the
  float8_e5m2 x float8_e4m3fn stage GEMMs (the cotangent on the x side)."""

  @parameterized.parameters(*SCHEDULES)
  def test_per_tensor_backward_on_one_gpu(self, schedule):
    tp = 1
    mesh = jax.sharding.Mesh(np.array(test_util.require_hopper_gpus(tp)), ("tp",))
    xs, ws, os_ = test_util.specs(schedule, 0)
    x, w, _ = test_util.random_inputs(test_util.seed_of("grad", schedule), (256, 384),
                                      (384, 512), jnp.float32)
    g = jax.random.normal(jax.random.key(5), (256, 512), jnp.float32)

    def loss(x, w, fp8):
      out = jax.shard_map(lambda x, w: jd.distributed_matmul(
          x, w, axis_name="tp", schedule=schedule, fp8=fp8, implementation="ffi"),
                          mesh=mesh, in_specs=(xs, ws), out_specs=os_)(x, w)
      return jnp.sum(out * g)  # linear: its cotangent is g

    grads = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
    want = test_util.fp8_tensor_grads(schedule, x, w, g, tp)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    for got, exact, ref in zip(grads(x, w, "tensor"), (g64 @ w64.T, x64.T @ g64), want):
      # fp32 sums of fp8 products; a value whose quantization rounds the other way moves ~1e-4.
      self.assertLess(test_util.rel_err(got, ref), 1e-3)
      self.assertBetween(test_util.rel_err(got, exact), 1e-2, 0.1)


if __name__ == "__main__":
  absltest.main()

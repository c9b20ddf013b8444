"""fp8 operands: current-scaling quantization, the scale rules, and scaled operands in a ring.

A quantized operand is its fp8 values and fp32 scales, values * scales ~ the original:

  scaling   x [..., rows, K]: scales     w [..., K, cols]: scales     one scale per
  "tensor"  []                           []                           shard
  "block"   [..., rows, K/128]           [..., K/128, cols/128]       1x128 of x, 128x128 of w

Scales shard like their operand: on each device they describe its own shard, and where a
schedule moves a shard its scales move with it ("xla" sends (values, scales) in one ppermute,
stage by stage).  Every product is of the dequantized values, accumulated in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_distgemm._src import config, reference
from jax_distgemm._src.schedules import Schedule

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SCALINGS = ("tensor", "block")
BLOCK = 128  # the DeepSeek-V3 recipe: 1x128 activation blocks, 128x128 weight blocks


def is_fp8(a) -> bool:
  return a is not None and jnp.dtype(a.dtype) in FP8_DTYPES


def check_scaling(scaling, what: str = "scaling") -> str:
  if scaling not in SCALINGS:
    raise ValueError(f"{what}: expected 'tensor' or 'block', got {scaling!r}")
  return scaling


def check_block_shapes(x_shape, w_shape, schedule: Schedule, tp: int) -> None:
  """Block scaling needs whole 128-blocks in every shard and every slice a stage takes."""
  k, cols = x_shape[-1], w_shape[-1]
  if k % BLOCK:
    raise ValueError(f"x, w: block scaling needs the local contraction dim K={k} to be a "
                     f"multiple of {BLOCK}")
  if cols % BLOCK:
    raise ValueError(f"w: block scaling needs the local columns N={cols} to be a multiple of "
                     f"{BLOCK}")
  if schedule == Schedule.ReduceScatter1D_TilingB_RotatingC and (cols // tp) % BLOCK:
    raise ValueError(f"w: block scaling with {schedule.name} needs N/TP = {cols}/{tp} to be a "
                     f"multiple of {BLOCK} (each stage takes that slice of w's columns)")


def quantize(a, scaling: str = "tensor", *, operand: str = "x", dtype=jnp.float8_e4m3fn):
  """(fp8 values, fp32 scales) of `a` by current scaling: each scale is amax / the fp8 max of
  its tensor or block (1 where the block is all zeros), so values * scales ~ a.

  Args:
    a: the array to quantize, [..., rows, K] (operand="x") or [..., K, cols] (operand="w").
    scaling: "tensor" (one scale) or "block" (1x128 blocks of x, 128x128 of w).
    operand: "x" or "w": which side of the matmul `a` is, for block scaling.
    dtype: float8_e4m3fn (default) or float8_e5m2 (more range, for gradients).
  """
  check_scaling(scaling)
  if operand not in ("x", "w"):
    raise ValueError(f"operand: expected 'x' or 'w', got {operand!r}")
  dtype = jnp.dtype(dtype)
  if dtype not in FP8_DTYPES:
    raise TypeError(f"dtype: expected float8_e4m3fn or float8_e5m2, got {dtype.name}")
  if a.ndim < 2:
    raise ValueError(f"a: must have rank >= 2, got shape {a.shape}")
  fmax = float(jnp.finfo(dtype).max)
  a32 = jnp.asarray(a).astype(jnp.float32)
  if scaling == "tensor":
    return quantize_by_amax(a32, jnp.max(jnp.abs(a32)), dtype)
  *batch, r, c = a32.shape
  if operand == "x" and c % BLOCK or operand == "w" and (r % BLOCK or c % BLOCK):
    dims = "K" if operand == "x" else "both dims"
    raise ValueError(f"a: block scaling of {operand} needs {dims} of shape {a.shape} to be a "
                     f"multiple of {BLOCK}")
  if operand == "x":
    blocks = a32.reshape(*batch, r, c // BLOCK, BLOCK)
    scale = _scale_of(jnp.max(jnp.abs(blocks), axis=-1), fmax)
    values = blocks / scale[..., None]
  else:
    blocks = a32.reshape(*batch, r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    scale = _scale_of(jnp.max(jnp.abs(blocks), axis=(-3, -1)), fmax)
    values = blocks / scale[..., :, None, :, None]
  return jnp.clip(values, -fmax, fmax).reshape(a32.shape).astype(dtype), scale


def quantize_by_amax(a, amax, dtype):
  """Per-tensor (values, scale) of `a` for a given amax: one agreed over devices, say."""
  fmax = float(jnp.finfo(dtype).max)
  scale = _scale_of(amax, fmax)
  return jnp.clip(a.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype), scale


def call_out_dtype(dtype):
  """The dtype an fp8 call writes for a result wanted in `dtype`: `dtype` where the kernels
  write it (OUT_DTYPES), else float32, cast by the caller."""
  dtype = jnp.dtype(dtype)
  return dtype if dtype in OUT_DTYPES else jnp.dtype(jnp.float32)


def _scale_of(amax, fmax):
  return jnp.where(amax > 0, amax / fmax, 1.0).astype(jnp.float32)


def dequantize(values, scale, *, operand: str = "x"):
  """values * scale in fp32, the scale broadcast over its tensor or blocks."""
  v = values.astype(jnp.float32)
  if scale.ndim == 0:
    return v * scale
  if operand == "x":
    return v * jnp.repeat(scale, BLOCK, axis=-1)
  return v * jnp.repeat(jnp.repeat(scale, BLOCK, axis=-2), BLOCK, axis=-1)


def check_scales(x, x_scale, w, w_scale, *, schedule: Schedule, tp: int) -> str:
  """The scaling of an fp8 call ("tensor" or "block"), or an error naming the argument.

  NOTE: scales are traced inside shard_map, so their values cannot be checked here: a scale
  that is not finite makes its products NaN, as the dequantized operand would."""
  if not (is_fp8(x) and is_fp8(w)):
    which = "x" if not is_fp8(x) else "w"
    got = jnp.dtype(x.dtype if which == "x" else w.dtype).name
    raise TypeError(f"{which}: with fp8 operands or scales both x and w must be float8_e4m3fn "
                    f"or float8_e5m2 (quantize them with jax_distgemm.quantize), got {got}")
  for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
    if s is None:
      raise ValueError(f"{name}: fp8 operands need their scales (x ~ x * x_scale; see "
                       "jax_distgemm.quantize)")
    if jnp.dtype(s.dtype) != jnp.float32:
      raise TypeError(f"{name}: must be float32, got {jnp.dtype(s.dtype).name}")
  xs, ws = tuple(x.shape), tuple(w.shape)
  if x_scale.shape == () and w_scale.shape == ():
    scaling = "tensor"
  else:
    scaling = "block"
    k = xs[-1]
    want_x = xs[:-1] + (k // BLOCK,)
    want_w = ws[:-2] + (ws[-2] // BLOCK, ws[-1] // BLOCK)
    if tuple(x_scale.shape) != want_x or tuple(w_scale.shape) != want_w:
      raise ValueError(
          f"x_scale, w_scale: expected both scalars (per-tensor scaling) or block scales of "
          f"shapes {want_x} (one per row and {BLOCK} of K) and {want_w} (one per {BLOCK}x"
          f"{BLOCK} block of w), got {tuple(x_scale.shape)} and {tuple(w_scale.shape)}")
    check_block_shapes(xs, ws, schedule, tp)
  return scaling


def _bf16_matmul(a, b):
  """The fp8 product of fp8 values, accumulated in fp32: they are exact in bf16 (and fp32)."""
  # NOTE: XLA:CPU has no bf16 x bf16 -> f32 dot for a transposed operand (DotThunk).
  dtype = jnp.float32 if config.platform() == "cpu" else jnp.bfloat16
  return jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def matmul(x_op, w_op):
  """x @ w in fp32 of two (values, scales) pairs.  Per tensor the scales factor out of the sum:
  the values multiply as bf16 (a bf16 GEMM, not an fp32 one) and the scales scale the result;
  block scales vary along K, so blocks multiply dequantized, in fp32."""
  (xv, sx), (wv, sw) = x_op, w_op
  if sx.ndim == 0 and sw.ndim == 0:
    return _bf16_matmul(xv, wv) * (sx * sw)
  return reference.matmul_f32(dequantize(xv, sx, operand="x"), dequantize(wv, sw, operand="w"))


def reference_matmul(x, x_scale, w, w_scale, c, *, axis_name, schedule: Schedule, alpha: float,
                     beta: float, out_dtype):
  """The specification for fp8 operands: XLA's all-gather (values and scales) or
  reduce-scatter around the dot of the scaled operands."""
  kwargs = dict(axis_name=axis_name, schedule=schedule, alpha=alpha, beta=beta,
                out_dtype=out_dtype)
  if x_scale.ndim or w_scale.ndim:
    return reference.distributed_matmul(dequantize(x, x_scale, operand="x"),
                                        dequantize(w, w_scale, operand="w"), c, **kwargs)
  rows, cols = x.ndim - 2, x.ndim - 1
  if schedule == Schedule.AllGather1D_TilingCD_RotatingA:  # each gathered shard has its scale
    scales = jnp.repeat(reference.all_gather(x_scale[None], axis_name, 0), x.shape[-2])
    acc = _bf16_matmul(reference.all_gather(x, axis_name, rows), w) * w_scale
    acc = acc * scales[:, None]
  elif schedule == Schedule.AllGather1D_TilingCD_RotatingB:
    scales = jnp.repeat(reference.all_gather(w_scale[None], axis_name, 0), w.shape[-1])
    acc = _bf16_matmul(x, reference.all_gather(w, axis_name, w.ndim - 1)) * x_scale * scales
  else:
    dim = rows if schedule == Schedule.ReduceScatter1D_TilingA_RotatingC else cols
    acc = reference.psum_scatter(matmul((x, x_scale), (w, w_scale)), axis_name, dim)
  return reference.epilogue(acc, c, alpha=alpha, beta=beta, out_dtype=out_dtype)


# Scaled operands in the ring: (values, scale) pairs, or plain arrays.

def values_of(op):
  return op[0] if isinstance(op, tuple) else op


def ring_matmul(a, b):
  """A ring stage's x @ w in fp32: of scaled pairs (matmul) or of plain arrays."""
  if isinstance(a, tuple):
    return matmul(a, b)
  return reference.matmul_f32(a, b)


def slice_rows(op, start, size: int):
  """Rows [start, start + size) of an x operand; its block scales have the same rows."""
  if not isinstance(op, tuple):
    return jax.lax.dynamic_slice_in_dim(op, start, size, op.ndim - 2)
  v, s = op
  v = jax.lax.dynamic_slice_in_dim(v, start, size, v.ndim - 2)
  return v, (s if s.ndim == 0 else jax.lax.dynamic_slice_in_dim(s, start, size, s.ndim - 2))


def slice_cols(op, start, size: int):
  """Columns [start, start + size) of a w operand; its block scales by whole blocks."""
  if not isinstance(op, tuple):
    return jax.lax.dynamic_slice_in_dim(op, start, size, op.ndim - 1)
  v, s = op
  v = jax.lax.dynamic_slice_in_dim(v, start, size, v.ndim - 1)
  if s.ndim:
    s = jax.lax.dynamic_slice_in_dim(s, start // BLOCK, size // BLOCK, s.ndim - 1)
  return v, s

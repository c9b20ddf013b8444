"""The specification: XLA's own all_gather + dot and dot + psum_scatter, per shard.

Every implementation is tested and benchmarked against these.  Called inside jax.shard_map with
the per-device operands; see api.py for the shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_distgemm._src.schedules import Schedule


def epilogue(acc, c, *, alpha: float, beta: float, out_dtype):
  """alpha * acc + beta * c in fp32, then cast."""
  y = acc if alpha == 1.0 else alpha * acc
  if c is not None and beta != 0.0:
    y = y + beta * c.astype(jnp.float32)
  return y.astype(out_dtype)


def matmul_f32(x, w):
  return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def distributed_matmul(x, w, c=None, *, axis_name, schedule: Schedule, alpha: float = 1.0,
                       beta: float = 0.0, out_dtype=None, with_operand: bool = False):
  """Reference semantics of every schedule (see api.distributed_matmul); with_operand
  (AllGather schedules): (out, the all-gathered x or w)."""
  out_dtype = out_dtype or x.dtype
  rows, cols = x.ndim - 2, x.ndim - 1
  if with_operand and not schedule.is_all_gather:
    raise ValueError(f"with_operand: {schedule.name} gathers no operand")
  gathered = None
  if schedule == Schedule.AllGather1D_TilingCD_RotatingA:
    gathered = all_gather(x, axis_name, rows)
    acc = matmul_f32(gathered, w)
  elif schedule == Schedule.AllGather1D_TilingCD_RotatingB:
    gathered = all_gather(w, axis_name, w.ndim - 1)
    acc = matmul_f32(x, gathered)
  elif schedule == Schedule.ReduceScatter1D_TilingA_RotatingC:
    acc = psum_scatter(matmul_f32(x, w), axis_name, rows)
  else:
    acc = psum_scatter(matmul_f32(x, w), axis_name, cols)
  out = epilogue(acc, c, alpha=alpha, beta=beta, out_dtype=out_dtype)
  return (out, gathered) if with_operand else out


# NOTE: XLA refuses zero-size all-gathers and reduce-scatters (a verifier error at lowering);
# where the communicated dim is the empty one, one padded entry travels and is dropped again,
# so the result has the empty shape and the operand's varying axes.

def all_gather(a, axis_name, axis: int):
  if a.shape[axis] == 0:
    pad = [(0, 1 if d == axis else 0) for d in range(a.ndim)]
    g = jax.lax.all_gather(jnp.pad(a, pad), axis_name, axis=axis, tiled=True)
    return jax.lax.slice_in_dim(g, 0, 0, axis=axis)
  return jax.lax.all_gather(a, axis_name, axis=axis, tiled=True)


def psum_scatter(a, axis_name, dim: int):
  if a.shape[dim] == 0:
    tp = jax.lax.axis_size(axis_name)
    pad = [(0, tp if d == dim else 0) for d in range(a.ndim)]
    s = jax.lax.psum_scatter(jnp.pad(a, pad), axis_name, scatter_dimension=dim, tiled=True)
    return jax.lax.slice_in_dim(s, 0, 0, axis=dim)
  return jax.lax.psum_scatter(a, axis_name, scatter_dimension=dim, tiled=True)

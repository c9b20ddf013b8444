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
                       beta: float = 0.0, out_dtype=None):
  """Reference semantics of every schedule (see api.distributed_matmul)."""
  out_dtype = out_dtype or x.dtype
  rows, cols = x.ndim - 2, x.ndim - 1
  if schedule == Schedule.AllGather1D_TilingCD_RotatingA:
    acc = matmul_f32(jax.lax.all_gather(x, axis_name, axis=rows, tiled=True), w)
  elif schedule == Schedule.AllGather1D_TilingCD_RotatingB:
    acc = matmul_f32(x, jax.lax.all_gather(w, axis_name, axis=w.ndim - 1, tiled=True))
  elif schedule == Schedule.ReduceScatter1D_TilingA_RotatingC:
    acc = jax.lax.psum_scatter(matmul_f32(x, w), axis_name, scatter_dimension=rows, tiled=True)
  else:
    acc = jax.lax.psum_scatter(matmul_f32(x, w), axis_name, scatter_dimension=cols, tiled=True)
  return epilogue(acc, c, alpha=alpha, beta=beta, out_dtype=out_dtype)

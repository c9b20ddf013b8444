"""Pure-JAX ring: the four schedules written with ppermute and local dots.

The portable fallback (any backend, any dtype) and a second executable spec: it follows the
same stage order as the fused kernels (cc/schedules/ring_1d.h), so a bug in the index math
shows up here too.  An fp8 operand is a (values, scales) pair (fp8.py): the pair travels in
one ppermute, and each stage multiplies it by fp8.matmul.  In the style of the shard_map tutorial's matmul_allgather_overlapped: the
next shard's ppermute is issued before this stage's dot so XLA may overlap them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_distgemm._src import fp8, schedules
from jax_distgemm._src.reference import epilogue
from jax_distgemm._src.schedules import Schedule


def _shift(x, axis_name, tp: int, offset: int):
  """Every device d sends x to device (d + offset) % tp, d = lax.axis_index(axis_name): ranks
  count in axis_name's order, as for the other implementations."""
  axes, index = _mesh_ordered(axis_name)
  return lax.ppermute(x, axes, perm=[(index(j), index((j + offset) % tp)) for j in range(tp)])


def _mesh_ordered(axis_name):
  """(axes in the mesh's order, rank in axis_name's order -> linear index over those axes).

  NOTE: ppermute needs a multi-axis name in the mesh's order, while axis_index linearizes in
  the order it is given; a group named ("tp", "data") on a ("data", "tp") mesh needs the map.
  """
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  mesh_names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  ordered = tuple(a for a in mesh_names if a in names)
  if len(names) < 2 or ordered == names or len(ordered) != len(names):
    return axis_name, lambda r: r
  sizes = {a: lax.axis_size(a) for a in names}

  def index(rank: int) -> int:
    coord = {}
    for a in reversed(names):
      rank, coord[a] = divmod(rank, sizes[a])
    linear = 0
    for a in ordered:
      linear = linear * sizes[a] + coord[a]
    return linear

  return ordered, index


def _all_gather(x, w, c, *, axis_name, tp, schedule, alpha, beta, out_dtype,
                with_operand=False):
  rotating_a = schedule == Schedule.AllGather1D_TilingCD_RotatingA
  d = lax.axis_index(axis_name)
  xv, wv = fp8.values_of(x), fp8.values_of(w)
  axis = xv.ndim - 2 if rotating_a else xv.ndim - 1  # output axis tiled by the stages
  block = xv.shape[-2] if rotating_a else wv.shape[-1]
  out_shape = list(xv.shape[:-1]) + [wv.shape[-1]]
  out_shape[axis] *= tp
  out = jnp.zeros(out_shape, out_dtype)
  cur = x if rotating_a else w
  # with_operand: also assemble the gathered operand from the shards the stages hold anyway.
  op_axis = xv.ndim - 2 if rotating_a else wv.ndim - 1
  gathered = (jnp.zeros(schedules.gathered_shape(schedule, x.shape, w.shape, tp), cur.dtype)
              if with_operand else None)
  for i in range(tp):
    # Shard of device (d + i) % tp: receive from the right neighbour, as the push schedule
    # delivers it (device s sends its shard to (s - i) % tp for stage i).
    nxt = _shift(cur, axis_name, tp, -1) if i + 1 < tp else None
    tile = schedules.output_tile(schedule, d, i, tp)
    acc = fp8.ring_matmul(cur, w) if rotating_a else fp8.ring_matmul(x, cur)
    ct = None if c is None else lax.dynamic_slice_in_dim(c, tile * block, block, axis)
    y = epilogue(acc, ct, alpha=alpha, beta=beta, out_dtype=out_dtype)
    out = lax.dynamic_update_slice_in_dim(out, y, tile * block, axis)
    if with_operand:
      gathered = lax.dynamic_update_slice_in_dim(gathered, cur, tile * block, op_axis)
    cur = nxt
  return (out, gathered) if with_operand else out


def _reduce_scatter(x, w, c, *, axis_name, tp, schedule, alpha, beta, out_dtype):
  tiling_a = schedule == Schedule.ReduceScatter1D_TilingA_RotatingC
  d = lax.axis_index(axis_name)
  running = None
  for i in range(tp):
    tile = schedules.output_tile(schedule, d, i, tp)
    if tiling_a:
      block = fp8.values_of(x).shape[-2] // tp
      acc = fp8.ring_matmul(fp8.slice_rows(x, tile * block, block), w)
    else:
      block = fp8.values_of(w).shape[-1] // tp
      acc = fp8.ring_matmul(x, fp8.slice_cols(w, tile * block, block))
    if running is not None:
      acc = acc + running
    if i + 1 < tp:
      running = _shift(acc, axis_name, tp, +1)  # to the right neighbour
  # alpha once on the fp32 sum, as "reference" does: scaled per partial, partials that cancel
  # could overflow where alpha * x @ w does not.
  return epilogue(acc, c, alpha=alpha, beta=beta, out_dtype=out_dtype)


def distributed_matmul(x, w, c=None, *, axis_name, schedule: Schedule, alpha: float = 1.0,
                       beta: float = 0.0, out_dtype=None, with_operand: bool = False):
  """Ring implementation of every schedule (see api.distributed_matmul).

  with_operand (AllGather schedules): return (out, AG(x)) for RotatingA or (out, AG(w)) for
  RotatingB (tiled like jax.lax.all_gather(..., tiled=True)), assembled from the shards the
  stages receive anyway: no extra communication.
  """
  out_dtype = out_dtype or fp8.values_of(x).dtype
  tp = lax.axis_size(axis_name)
  kwargs = dict(axis_name=axis_name, tp=tp, schedule=schedule, alpha=alpha, beta=beta,
                out_dtype=out_dtype)
  if schedule.is_all_gather:
    return _all_gather(x, w, c, with_operand=with_operand, **kwargs)
  if with_operand:
    raise ValueError(f"with_operand: {schedule.name} gathers no operand")
  return _reduce_scatter(x, w, c, **kwargs)

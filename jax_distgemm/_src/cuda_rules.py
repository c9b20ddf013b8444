"""What the CUDA executor (CUTLASS SM90 TMA kernels) can run; consulted before launch."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_distgemm._src import config
from jax_distgemm._src.schedules import Schedule, output_shape

CUDA_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDA_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_TMA_ALIGN_BYTES = 16


_SLOT_ALIGN = 256  # cc/cuda/executor.cc kSlotAlign


def workspace_bytes(x_shape, w_shape, dtype, schedule: Schedule, tp: int,
                    out_dtype=None) -> int:
  """CUDA symmetric workspace of one call, in bytes per device (cc/cuda/executor.cc).

  2 parities (double buffering) x (TP-1) slots (ReduceScatter at TP=2: 2, the local and the
  received partial), each 256-byte aligned and holding:
  AllGather: one shard of the rotating operand (x for RotatingA, w for RotatingB), input dtype;
  ReduceScatter: one running sum of the output tile, in the output dtype (default: input).
  Shapes are the per-device (local) operand shapes.
  """
  schedule = Schedule(schedule)
  if tp <= 1:
    return 0
  x_shape, w_shape = tuple(x_shape), tuple(w_shape)
  if schedule == Schedule.AllGather1D_TilingCD_RotatingA:
    slot = math.prod(x_shape) * jnp.dtype(dtype).itemsize
  elif schedule == Schedule.AllGather1D_TilingCD_RotatingB:
    slot = math.prod(w_shape) * jnp.dtype(dtype).itemsize
  else:
    batch, xm, wn = math.prod(x_shape[:-2]), x_shape[-2], w_shape[-1]
    tile = (xm // tp) * wn if schedule == Schedule.ReduceScatter1D_TilingA_RotatingC else (
        xm * (wn // tp))
    slot = batch * tile * jnp.dtype(out_dtype or dtype).itemsize
  slot = -(-slot // _SLOT_ALIGN) * _SLOT_ALIGN
  slots_per_parity = 2 if (not schedule.is_all_gather and tp == 2) else tp - 1
  return 2 * slots_per_parity * slot


def unsupported_reason(x, w, out_dtype, schedule: Schedule, tp: int) -> str | None:
  """None if the CUDA executor runs this case, else why not (naming the argument)."""
  xd = jnp.dtype(x.dtype)
  od = jnp.dtype(out_dtype)
  if xd not in CUDA_IN_DTYPES:
    return f"x, w: dtype {xd.name} is not supported on CUDA (bfloat16 or float16)"
  if od not in CUDA_OUT_DTYPES:
    return f"out_dtype: {od.name} is not supported on CUDA"
  if od == jnp.float16 and xd == jnp.bfloat16 or od == jnp.bfloat16 and xd == jnp.float16:
    return f"out_dtype: {od.name} with {xd.name} inputs is not built (use {xd.name} or float32)"
  out = output_shape(schedule, x.shape, w.shape, tp)
  # TMA: every row pitch (the innermost extent of a row-major operand) is 16-byte aligned.
  for name, extent, itemsize in (("x (K)", x.shape[-1], xd.itemsize),
                                 ("w (N)", w.shape[-1], xd.itemsize),
                                 ("out (columns)", out[-1], od.itemsize)):
    if (extent * itemsize) % _TMA_ALIGN_BYTES:
      return (f"{name}: the last dimension ({extent} x {itemsize} bytes) must be a multiple "
              f"of {_TMA_ALIGN_BYTES} bytes for TMA")
  if schedule == Schedule.ReduceScatter1D_TilingB_RotatingC and (
      (w.shape[-1] // tp) * xd.itemsize) % _TMA_ALIGN_BYTES:
    # Each stage reads a column block of w starting at a multiple of N/TP.
    return (f"w (N/TP): the column block ({w.shape[-1] // tp}) must start 16-byte aligned "
            "for TMA")
  need = workspace_bytes(x.shape, w.shape, xd, schedule, tp, od)
  cap = config.workspace_cap_bytes()
  if need > cap:
    return (f"workspace: {schedule.name} with TP={tp} needs {need} bytes "
            f"({need / 2**20:.1f} MiB) of workspace per device, more than the cap of {cap} "
            f"bytes ({cap / 2**20:.1f} MiB); raise JAX_DISTGEMM_MAX_WORKSPACE_MB or shrink the "
            "per-device shapes")
  return None

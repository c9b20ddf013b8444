"""What the CUDA executor (CUTLASS SM90 TMA kernels) can run; consulted before launch."""

from __future__ import annotations

import jax.numpy as jnp

from jax_distgemm._src.schedules import Schedule, output_shape

CUDA_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDA_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_TMA_ALIGN_BYTES = 16


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
  return None

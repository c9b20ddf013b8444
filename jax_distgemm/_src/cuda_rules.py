"""What the CUDA executor (CUTLASS SM90 TMA kernels) can run; consulted before launch."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_distgemm import ffi as ffi_modules
from jax_distgemm._src import config
from jax_distgemm._src.schedules import Schedule, output_shape

# kMaxTp in cc/cuda/peer_state.h (one flag row per stage); tests/validation_test.py checks it.
CUDA_MAX_TP = 64
CUDA_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDA_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_TMA_ALIGN_BYTES = 16


# -- Where XLA's own path is faster (implementation=None picks "reference") --------------------
# One wave of the stage kernels' 128x128 tiles on an H100/H200 SXM (132 SMs).
ONE_WAVE_TILES = 132
_SMALL_TILE = 128


def _rule_module():
  """The extension that answers for the CUDA executor's path and workspace rule
  (cc/common/workspace.h): the CPU module, built everywhere."""
  return ffi_modules.module_for("cpu")


def rs_path(schedule: Schedule, tp: int, x_shape, w_shape) -> str:
  """The ReduceScatter data path ('remote_c', 'copy_ring' or 'gather') the CUDA executor takes
  for a call on local operands of these shapes, with the path JAX_DISTGEMM_RS_PATH asks for
  (cc/common/workspace.h, ChooseRsPath); '' for an AllGather schedule."""
  return _rule_module().rs_path(int(Schedule(schedule)), int(tp), tuple(x_shape),
                                tuple(w_shape), config.rs_path_override())


def workspace_bytes(x_shape, w_shape, dtype, schedule: Schedule, tp: int,
                    out_dtype=None, scaling: str = "") -> int:
  """CUDA symmetric workspace of one call, in bytes per device (cc/common/workspace.h,
  WorkspaceBytes): 2 parities (double buffering) x the slots of the call's data path (rs_path),
  each 256-byte aligned.  Shapes are the per-device (local) operand shapes; the output dtype
  defaults to the input's; fp8: `scaling` "tensor" or "block" (scales travel with shards).
  """
  return int(_rule_module().workspace_bytes(
      int(Schedule(schedule)), int(tp), tuple(x_shape), tuple(w_shape), jnp.dtype(dtype).name,
      jnp.dtype(out_dtype or dtype).name, config.rs_path_override(), scaling))


def _stage_rows_cols(x_shape, w_shape, schedule: Schedule, tp: int) -> tuple[int, int]:
  """(M, N) of one stage GEMM from the local x and w shapes: a ReduceScatter splits its rows
  (TilingA) or columns (TilingB) into TP output tiles; an AllGather's stage is x's rows by
  w's columns."""
  sm, sn = x_shape[-2], w_shape[-1]
  if schedule == Schedule.ReduceScatter1D_TilingA_RotatingC:
    return sm // tp, sn
  if schedule == Schedule.ReduceScatter1D_TilingB_RotatingC:
    return sm, sn // tp
  return sm, sn


def stage_tiles(x_shape, w_shape, schedule: Schedule, tp: int) -> int:
  """128x128 output tiles of one stage GEMM (the per-device problem has tp times as many),
  from the local x and w shapes."""
  sm, sn = _stage_rows_cols(x_shape, w_shape, Schedule(schedule), tp)
  return math.prod(x_shape[:-2]) * -(-sm // _SMALL_TILE) * -(-sn // _SMALL_TILE)


def xla_faster_reason(x, w, schedule: Schedule, tp: int) -> str | None:
  """None if the fused call is expected to be no slower than XLA's all-gather /
  reduce-scatter + dot, else why (implementation=None then runs "reference").

  Unbatched calls whose whole per-device problem is at most one wave of 128x128 tiles (decode
  and small-batch shapes).  There XLA's dot is a split-K kernel that streams the weight once
  from every SM, faster than our data-parallel stage kernels at such stages, while the fused
  schedule reads the weight shard TP times (a ReduceScatter in TP sequential stage launches)
  and can hide only the transfer of a shard of a few MiB.  Batched calls are left to the
  fused path (not measured).
  """
  if math.prod(x.shape[:-2]) != 1 or len(w.shape) > 2:
    return None
  tiles = tp * stage_tiles(x.shape, w.shape, schedule, tp)
  if tiles > ONE_WAVE_TILES:
    return None
  return (f"the per-device problem is {tiles} output tiles of {_SMALL_TILE}x{_SMALL_TILE}, "
          f"at most one wave ({ONE_WAVE_TILES}), where XLA's split-K dot reads the weight once "
          "and faster than the fused stages")


# The kernels are built for sm_90a (CMakeLists.txt), which runs on compute capability 9.0 only.
CUDA_COMPUTE_CAPABILITY = "9.0"
# CUTLASS's problem shape holds each extent in an int (cc/cuda/sm90_gemm.cuh).
_MAX_EXTENT = 2**31 - 1


def gpu_reason() -> str | None:
  """Why this process's GPUs cannot run the kernels (None: they can)."""
  try:
    devices = jax.local_devices(backend="gpu")
  except RuntimeError:  # no GPU backend (these rules' own tests on CPU)
    return None
  caps = {getattr(d, "compute_capability", None) for d in devices}
  other = sorted(str(c) for c in caps if c is not None and str(c) != CUDA_COMPUTE_CAPABILITY)
  if other:
    return (f"GPUs of compute capability {', '.join(other)}: the CUDA executor's kernels are "
            f"built for sm_90a (Hopper, {CUDA_COMPUTE_CAPABILITY}) only")
  return None


def _common_reason(x, w, schedule: Schedule, tp: int) -> str | None:
  if why := gpu_reason():
    return why
  sm, sn = _stage_rows_cols(x.shape, w.shape, schedule, tp)
  stage = {"rows": sm, "columns": sn, "contraction": x.shape[-1],
           "batch": math.prod(x.shape[:-2])}
  if big := [f"{name} {n}" for name, n in stage.items() if n > _MAX_EXTENT]:
    return (f"x, w: a stage GEMM's {', '.join(big)} exceeds {_MAX_EXTENT} (CUTLASS takes "
            "32-bit extents)")
  if tp > CUDA_MAX_TP:
    return f"tp: {tp} ranks; the CUDA executor takes at most {CUDA_MAX_TP} (kMaxTp)"
  return None


def _workspace_reason(need: int, schedule: Schedule, tp: int) -> str | None:
  cap = config.workspace_cap_bytes()
  if need > cap:
    return (f"workspace: {schedule.name} with TP={tp} needs {need} bytes "
            f"({need / 2**20:.1f} MiB) of workspace per device, more than the cap of {cap} "
            f"bytes ({cap / 2**20:.1f} MiB); raise JAX_DISTGEMM_MAX_WORKSPACE_MB or shrink the "
            "per-device shapes")
  return None


def fp8_unsupported_reason(x, w, out_dtype, schedule: Schedule, tp: int,
                           scaling: str) -> str | None:
  """fp8: None if the CUDA executor runs this case, else why not.  x and w are the operands
  as called (fp8, or bf16/fp32 that fp8= quantizes to float8_e4m3fn)."""
  e4m3 = jnp.dtype(jnp.float8_e4m3fn)
  xd, wd = (jnp.dtype(a.dtype) if jnp.dtype(a.dtype).itemsize == 1 else e4m3 for a in (x, w))
  od = jnp.dtype(out_dtype)
  if why := _common_reason(x, w, schedule, tp):
    return why
  if wd != e4m3 or (scaling == "block" and xd != e4m3):
    return (f"x, w: {xd.name} x {wd.name} is not built on CUDA (w float8_e4m3fn; x "
            "float8_e4m3fn, or float8_e5m2 with per-tensor scaling)")
  if od not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    return f"out_dtype: {od.name} is not supported for fp8 (bfloat16 or float32)"
  k, n = x.shape[-1], w.shape[-1]
  if k % 16 or n % 16:
    return (f"x, w: fp8 on CUDA needs K ({k}) and the local N ({n}) to be multiples of 16 "
            "(the GEMMs read w transposed)")
  return _workspace_reason(workspace_bytes(x.shape, w.shape, xd, schedule, tp, od, scaling),
                           schedule, tp)


def unsupported_reason(x, w, out_dtype, schedule: Schedule, tp: int) -> str | None:
  """None if the CUDA executor runs this case, else why not (naming the argument)."""
  xd = jnp.dtype(x.dtype)
  od = jnp.dtype(out_dtype)
  if why := _common_reason(x, w, schedule, tp):
    return why
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
  return _workspace_reason(workspace_bytes(x.shape, w.shape, xd, schedule, tp, od),
                           schedule, tp)

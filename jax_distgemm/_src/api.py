"""Public shard_map-level API: all_gather_matmul, matmul_reduce_scatter, distributed_matmul.

Shapes, per device, inside jax.shard_map (TP = size of `axis_name`; leading batch dims allowed
on x; w is [K, N] or batched like x):

  schedule                            x (local)      w (local)      out (local)
  AllGather1D_TilingCD_RotatingA      [.., M/TP, K]  [K, N/TP]      [.., M, N/TP]   = AG(x) @ w
  AllGather1D_TilingCD_RotatingB      [.., M/TP, K]  [K, N/TP]      [.., M/TP, N]   = x @ AG(w)
  ReduceScatter1D_TilingA_RotatingC   [.., M, K/TP]  [K/TP, N]      [.., M/TP, N]   = RS_rows(x @ w)
  ReduceScatter1D_TilingB_RotatingC   [.., M, K/TP]  [K/TP, N]      [.., M, N/TP]   = RS_cols(x @ w)

and out = alpha * (...) + beta * c, accumulated in fp32, cast to out_dtype (default x.dtype).
NOTE: "ffi" reads c in out_dtype (the kernels' epilogue source has the output's type), and on
CUDA a ReduceScatter's running sums cross devices in out_dtype: with a 16-bit out_dtype that
rounds more often than "xla" and "reference", which keep fp32 until the end.

implementation: "ffi" (the fused custom call: CUDA on Hopper, or the CPU executor), "xla" (a
ppermute ring, any backend), "reference" (XLA all_gather + dot / dot + psum_scatter), or None:
"ffi" where it can run this case and is expected to be faster, "reference" where XLA's own
path is expected to be faster (on CUDA: unbatched calls of at most one wave of tiles,
cuda_rules.xla_faster_reason), else "xla".  A case the chosen implementation cannot run raises
NotImplementedError with the reason; None moves on instead.
A TP group the FFI executor cannot meet (found at lowering, where the device ids are known:
processes without initialize_multiprocess(), other hosts) raises
validation.GroupUnreachableError under "ffi"; under None the XLA ring is lowered in the custom
call's place, with a warning (primitives._lowering).
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp

from jax_distgemm import ffi as ffi_modules
from jax_distgemm._src import autodiff, config, primitives, reference, validation, xla_ring
from jax_distgemm._src.schedules import Schedule, gathered_shape, output_shape

IMPLEMENTATIONS = ("ffi", "xla", "reference")


def _current_platform() -> str:
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "platform", None):
    return device.platform.lower()
  return jax.default_backend().lower()


def _varying(a) -> frozenset:
  """Manual mesh axes `a` varies over (jax >= 0.11: aval.manual_axis_type.varying)."""
  return frozenset(jax.typeof(a).manual_axis_type.varying)


def _match_vma(*arrays):
  """Casts operands to vary over the same manual axes (what ffi_call requires)."""
  present = [a for a in arrays if a is not None]
  union = frozenset().union(*(_varying(a) for a in present))
  out = []
  for a in arrays:
    missing = None if a is None else tuple(sorted(union - _varying(a)))
    out.append(a if not missing else jax.lax.pcast(a, missing, to="varying"))
  return out


def ffi_unsupported_reason(platform: str, x, w, out_dtype, schedule: Schedule,
                           tp: int) -> str | None:
  """Why the fused FFI path cannot run this case on `platform` (None: it can)."""
  if platform == "cpu":
    return None
  if platform not in ("cuda", "gpu"):
    return f"no FFI executor for platform {platform!r}"
  if not ffi_modules.has_cuda():
    err = ffi_modules.cuda_import_error
    if "does not load" in str(err):  # built and installed, but its import fails (ffi/__init__)
      return f"the CUDA executor does not load: {err}"
    return f"the CUDA executor was not built (no nvcc at install time): {err}"
  from jax_distgemm._src import cuda_rules  # CUDA-only constraints (dtypes, TMA alignment)
  return cuda_rules.unsupported_reason(x, w, out_dtype, schedule, tp)


def xla_faster_reason(platform: str, x, w, schedule: Schedule, tp: int) -> str | None:
  """Why XLA's all-gather / reduce-scatter + dot is expected to beat the fused call here
  (None: it is not); consulted by implementation=None only."""
  if platform not in ("cuda", "gpu"):
    return None  # the CPU executor is there to run the schedule, not to be fast
  from jax_distgemm._src import cuda_rules
  return cuda_rules.xla_faster_reason(x, w, schedule, tp)


def _ffi(x, w, c, *, axis_name, schedule, alpha, beta, out_dtype, tp, timeout_ms,
         with_operand=False, fallback=False):
  reason = ffi_unsupported_reason(_current_platform(), x, w, out_dtype, schedule, tp)
  if reason:
    raise NotImplementedError(f"jax_distgemm implementation='ffi': {reason}")
  if auto := unpartitioned_axes():
    config.warn_once(
        ("ffi", auto),
        "jax_distgemm implementation='ffi': the enclosing shard_map leaves mesh axes %s to the "
        "partitioner; the custom call cannot be split along them, so XLA gathers its operands "
        "and every replica computes the whole call (make them manual, or use "
        "implementation=None or 'xla', which run the XLA ring here)", auto)
  # The ReduceScatter stage kernels have no second epilogue source (their C is the running
  # sum): beta * c joins after the call, one elementwise pass that XLA fuses.
  c_after = None
  if c is not None and not schedule.is_all_gather:
    c, c_after = None, c
  x, w, c = _match_vma(x, w, c)
  out = primitives.bind(x, w, c, schedule=schedule, axis_name=axis_name, tp=tp, alpha=alpha,
                        beta=beta, out_dtype=out_dtype, timeout_ms=timeout_ms,
                        fallback=fallback, gathered=with_operand)
  if c_after is not None:  # (ReduceScatter: never with_operand)
    out = reference.epilogue(out.astype(jnp.float32), c_after, alpha=1.0, beta=beta,
                             out_dtype=out_dtype)
  return out


def _xla(x, w, c, *, axis_name, schedule, alpha, beta, out_dtype, tp, timeout_ms,
         with_operand=False):
  del tp, timeout_ms
  return xla_ring.distributed_matmul(x, w, c, axis_name=axis_name, schedule=schedule,
                                     alpha=alpha, beta=beta, out_dtype=out_dtype,
                                     with_operand=with_operand)


def _reference(x, w, c, *, axis_name, schedule, alpha, beta, out_dtype, tp, timeout_ms,
               with_operand=False):
  del tp, timeout_ms
  return reference.distributed_matmul(x, w, c, axis_name=axis_name, schedule=schedule,
                                      alpha=alpha, beta=beta, out_dtype=out_dtype,
                                      with_operand=with_operand)


_IMPLS: dict[str, Callable] = {"ffi": _ffi, "xla": _xla, "reference": _reference}


def unpartitioned_axes() -> tuple[str, ...]:
  """Mesh axes of size > 1 that the enclosing shard_map leaves to the partitioner (a partial
  shard_map, axis_names=...).  NOTE: the custom call has no sharding rule for them, so XLA
  gathers its operands along them and every replica computes the whole call.  A
  custom_partitioning body (collective_matmul under jit with Auto axes) is per shard already:
  there the abstract mesh is jax.set_mesh's, whose Auto axes no partitioner will split."""
  if primitives.in_partition_body():
    return ()
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(a for a, n, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
               if n > 1 and t != jax.sharding.AxisType.Manual)


def _resolve(x, w, p: autodiff.Params) -> str:
  """The concrete implementation for one call: as requested, else auto (ffi where it runs,
  where no mesh axis is left unpartitioned around it and where XLA's own path is not expected
  to be faster, which then runs; else the XLA ring)."""
  name = p.implementation or config.forced_implementation()
  if name is not None:
    return name
  if auto := unpartitioned_axes():
    # The ring partitions along them; the custom call would repeat the work on every replica.
    config.warn_once((None, auto),
                     "jax_distgemm: implementation=None runs the XLA ring here, not the fused "
                     "FFI call: the enclosing shard_map leaves mesh axes %s to the partitioner, "
                     "along which the custom call cannot be split (make them manual for the "
                     "fused call)", auto)
    return "xla"
  platform = _current_platform()
  if ffi_unsupported_reason(platform, x, w, p.out_dtype, p.schedule, p.tp) is None:
    why = xla_faster_reason(platform, x, w, p.schedule, p.tp)
    if why is None:
      return "ffi"
    config.warn_once(("reference", p.schedule, x.shape, w.shape, p.tp),
                     "jax_distgemm: implementation=None runs XLA's collective + dot "
                     "(\"reference\") for %s, x %s, w %s at TP=%d: %s", p.schedule.name,
                     x.shape, w.shape, p.tp, why, level=logging.INFO)
    return "reference"
  return "xla"


def _run(x, w, c, p: autodiff.Params, name: str):
  kw = {}
  if name == "ffi" and p.implementation is None and config.forced_implementation() is None:
    kw["fallback"] = True  # auto chose it: a group the executor cannot meet lowers the ring
  if p.with_operand:
    kw["with_operand"] = True
  return _IMPLS[name](x, w, c, axis_name=p.axis_name, schedule=p.schedule, alpha=p.alpha,
                      beta=p.beta, out_dtype=p.out_dtype, tp=p.tp, timeout_ms=p.timeout_ms,
                      **kw)


# The differentiable per-shard op: jax.custom_vjp pairing each schedule with its dual.
_matmul = autodiff.differentiable(_run, _resolve)


def distributed_matmul(x, w, c=None, *, axis_name, schedule: Schedule | str,
                       alpha: float = 1.0, beta: float = 0.0, out_dtype=None,
                       implementation: str | None = None, timeout_ms: int | None = None,
                       return_gathered: bool = False):
  """Tensor-parallel matmul with the collective fused in, for use inside `jax.shard_map`.

  Args:
    x: local shard of the left operand, [..., rows, K] (see the module docstring).
    w: local shard of the right operand, [K, cols] or batched like x.
    c: optional addend with the local output's shape (needs beta != 0 to matter).
    axis_name: the mesh axis (or tuple of axes) the tensor-parallel group runs over.
    schedule: a `Schedule` or its name, e.g. "AllGather1D_TilingCD_RotatingA".
    alpha, beta: static scalars of out = alpha * x @ w + beta * c.
    out_dtype: output dtype (bfloat16, float16 or float32); default x.dtype.
    implementation: "ffi", "xla", "reference" or None (see the module docstring).
    timeout_ms: bound on every wait for a peer; default JAX_DISTGEMM_TIMEOUT_MS or 30000.
    return_gathered: AllGather schedules only: also return the operand the call gathered,
      all_gather(x, rows) (RotatingA) or all_gather(w, columns) (RotatingB), tiled, in the
      inputs' dtype.  Every implementation has it without more communication (the fused call
      copies the shards it receives into it).

  Returns:
    The local shard of the output, or (output, gathered operand) with return_gathered.
    Differentiable (reverse mode): the backward runs the dual collective matmul with the same
    `implementation` (see autodiff.py).
  """
  schedule = Schedule.parse(schedule)
  if not isinstance(return_gathered, bool):
    raise TypeError(f"return_gathered: expected a bool, got {return_gathered!r}")
  if return_gathered and not schedule.is_all_gather:
    raise ValueError(f"return_gathered: only an AllGather schedule gathers an operand, not "
                     f"{schedule.name}")
  axis_name = validation.normalize_axis_name(axis_name)
  out_dtype = validation.resolve_out_dtype(out_dtype, x.dtype)
  tp = validation.check_call(x, w, c, schedule=schedule, axis_name=axis_name, alpha=alpha,
                             beta=beta)
  if timeout_ms is None:
    timeout_ms = config.default_timeout_ms()
  else:
    timeout_ms = config.check_timeout_ms(timeout_ms)
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation: expected one of {IMPLEMENTATIONS} or None, got {implementation!r}")
  if free := validation.explicit_free_axes(x, w, c):
    raise ValueError(
        f"x, w: sharded over the Explicit mesh axes {free}, which the enclosing shard_map "
        "leaves free (axis_names=...); the ops run per shard of its manual axes: make the "
        "shard_map manual over those axes too, or give them AxisType.Auto")
  if vmapped := validation.vmap_bound_axes(axis_name, x, w, c):
    implementation = implementation or config.forced_implementation()  # the env var counts too
    if implementation == "ffi":
      raise ValueError(
          f"implementation='ffi': axis_name {vmapped[0]!r} is bound by jax.vmap, not by "
          "jax.shard_map; the fused call runs between the devices of a mesh (use "
          "implementation='xla', or None, which runs the XLA ring under vmap)")
    implementation = implementation or "xla"  # the ring's collectives have vmap rules
  params = autodiff.Params(schedule=schedule, axis_name=axis_name, tp=tp, alpha=float(alpha),
                           beta=float(beta), out_dtype=out_dtype, implementation=implementation,
                           timeout_ms=int(timeout_ms), with_operand=return_gathered)
  if beta == 0:
    c = None
  # Matched before the custom_vjp, so cotangents have the operands' types (autodiff.py).
  x, w, c = _match_vma(x, w, c)
  # NOTE: no GEMM to run (K = 0, or an empty output): no implementation gets the call
  # (_empty_contraction), so no executor ever sees a grid without tiles.
  if x.shape[-1] == 0 or 0 in output_shape(schedule, x.shape, w.shape, tp):
    out = _empty_contraction(x, w, c, params)
    return (out, _gathered_without_gemm(x, w, params)) if return_gathered else out
  if vmapped:
    # NOTE: no custom VJP here: JAX traces a custom_vjp's backward outside the vmap that binds
    # the axis ("unbound axis name" in jax.grad); the ring and the reference are plain JAX,
    # differentiated by JAX itself.
    return _run(x, w, c, params, params.implementation)
  return _matmul(x, w, c, params)


def _gathered_without_gemm(x, w, p: autodiff.Params):
  """The gathered operand of a call with no GEMM to run (K = 0 or an empty output), by XLA.

  NOTE: with an empty stage GEMM the CUDA executor's grid would write none of the marks its
  copy stream waits for before it copies a peer's shard into the gathered result (all_gather.cc,
  CopyGathered), one more reason such calls never reach it.
  """
  rotating_a = p.schedule == Schedule.AllGather1D_TilingCD_RotatingA
  if x.shape[-1] == 0:  # K = 0: the gathered x [.., TP m, 0] or w [0, TP n] is empty too
    return autodiff.zeros_varying_like(x, gathered_shape(p.schedule, x.shape, w.shape, p.tp))
  op = x if rotating_a else w
  axis = p.axis_name if len(p.axis_name) > 1 else p.axis_name[0]
  return reference.all_gather(op, axis, op.ndim - (2 if rotating_a else 1))


def _empty_contraction(x, w, c, p: autodiff.Params):
  """K = 0, or an empty output (M or N = 0): out = beta * c, or zeros of the output's shape;
  nothing is reduced, and nothing is sent (every peer skips the call alike: shapes are
  SPMD-uniform).  Gradients of x and w are zeros (x @ w has no term in them).

  NOTE: a dot with K = 0 inside shard_map crashes XLA:CPU's compiler (segfault, jaxlib 0.11.2),
  whichever implementation lowers it, "reference" and a plain `a @ b` included, so no
  implementation gets this case.
  """
  shape = output_shape(p.schedule, x.shape, w.shape, p.tp)
  # Varies like the product would (x, w and c vary alike already: _match_vma).
  zeros = autodiff.zeros_varying_like(x, shape, jnp.float32)
  return reference.epilogue(zeros, c, alpha=1.0, beta=p.beta, out_dtype=p.out_dtype)


def all_gather_matmul(x, w, c=None, *, axis_name, gathered: str = "x", alpha: float = 1.0,
                      beta: float = 0.0, out_dtype=None, implementation: str | None = None,
                      timeout_ms: int | None = None, return_gathered: bool = False):
  """AllGather + GEMM inside `jax.shard_map`: x rows-sharded, w columns-sharded.

  gathered="x" (AllGather1D_TilingCD_RotatingA, sequence-parallel column-parallel linear):
    out [..., M, N/TP] = all_gather(x, rows) @ w.
  gathered="w" (AllGather1D_TilingCD_RotatingB, FSDP-style weight gather):
    out [..., M/TP, N] = x @ all_gather(w, columns).

  return_gathered: also return that gathered x (resp. w): (out, gathered operand).

  See `distributed_matmul` for the other arguments.
  """
  if gathered not in ("x", "w"):
    raise ValueError(f"gathered: expected 'x' or 'w', got {gathered!r}")
  schedule = (Schedule.AllGather1D_TilingCD_RotatingA if gathered == "x" else
              Schedule.AllGather1D_TilingCD_RotatingB)
  return distributed_matmul(x, w, c, axis_name=axis_name, schedule=schedule, alpha=alpha,
                            beta=beta, out_dtype=out_dtype, implementation=implementation,
                            timeout_ms=timeout_ms, return_gathered=return_gathered)


def matmul_reduce_scatter(x, w, c=None, *, axis_name, scatter: str = "rows",
                          alpha: float = 1.0, beta: float = 0.0, out_dtype=None,
                          implementation: str | None = None, timeout_ms: int | None = None):
  """GEMM + ReduceScatter inside `jax.shard_map`: x and w sharded on the contraction dim.

  scatter="rows" (ReduceScatter1D_TilingA_RotatingC, row-parallel linear):
    out [..., M/TP, N] = psum_scatter(x @ w, rows).
  scatter="cols" (ReduceScatter1D_TilingB_RotatingC):
    out [..., M, N/TP] = psum_scatter(x @ w, columns).

  See `distributed_matmul` for the other arguments.
  """
  if scatter not in ("rows", "cols"):
    raise ValueError(f"scatter: expected 'rows' or 'cols', got {scatter!r}")
  schedule = (Schedule.ReduceScatter1D_TilingA_RotatingC if scatter == "rows" else
              Schedule.ReduceScatter1D_TilingB_RotatingC)
  return distributed_matmul(x, w, c, axis_name=axis_name, schedule=schedule, alpha=alpha,
                            beta=beta, out_dtype=out_dtype, implementation=implementation,
                            timeout_ms=timeout_ms)

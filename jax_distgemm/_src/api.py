"""Public shard_map-level API: all_gather_matmul, matmul_reduce_scatter, distributed_matmul.

Shapes, per device, inside jax.shard_map (TP = size of `axis_name`; leading batch dims allowed
on x; w is [K, N] or batched like x):

  schedule                            x (local)      w (local)      out (local)
  AllGather1D_TilingCD_RotatingA      [.., M/TP, K]  [K, N/TP]      [.., M, N/TP]   = AG(x) @ w
  AllGather1D_TilingCD_RotatingB      [.., M/TP, K]  [K, N/TP]      [.., M/TP, N]   = x @ AG(w)
  ReduceScatter1D_TilingA_RotatingC   [.., M, K/TP]  [K/TP, N]      [.., M/TP, N]   = RS_rows(x @ w)
  ReduceScatter1D_TilingB_RotatingC   [.., M, K/TP]  [K/TP, N]      [.., M, N/TP]   = RS_cols(x @ w)

and out = alpha * (...) + beta * c, accumulated in fp32, cast to out_dtype (default x.dtype).
fp8 (fp8.py): x and w in float8_e4m3fn / float8_e5m2 with x_scale, w_scale (per tensor or in
blocks), out = alpha * (x * x_scale) @ (w * w_scale) + beta * c, bf16 (default) or fp32; or
bf16/fp32 operands with fp8="tensor" | "block", quantized in the call and differentiated
straight through the quantizer.
NOTE: "ffi" reads c in out_dtype (the kernels' epilogue source has the output's type), and on
CUDA a ReduceScatter's running sums cross devices in out_dtype: with a 16-bit out_dtype that
rounds more often than "xla" and "reference", which keep fp32 until the end.

implementation: "ffi", "xla", "reference" or None; implementation.py decides and says what
each is.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_distgemm._src import autodiff, config, fp8 as fp8_lib, reference, validation
from jax_distgemm._src import implementation as impl
from jax_distgemm._src.implementation import Params
from jax_distgemm._src.schedules import Schedule, gathered_shape, output_shape


def distributed_matmul(x, w, c=None, *, axis_name, schedule: Schedule | str,
                       alpha: float = 1.0, beta: float = 0.0, out_dtype=None,
                       implementation: str | None = None, timeout_ms: int | None = None,
                       return_gathered: bool = False, x_scale=None, w_scale=None,
                       fp8: str | None = None):
  """Tensor-parallel matmul with the collective fused in, for use inside `jax.shard_map`.

  Args:
    x: local shard of the left operand, [..., rows, K] (see the module docstring).
    w: local shard of the right operand, [K, cols] or batched like x.
    c: optional addend with the local output's shape (needs beta != 0 to matter).
    axis_name: the mesh axis (or tuple of axes) the tensor-parallel group runs over.
    schedule: a `Schedule` or its name, e.g. "AllGather1D_TilingCD_RotatingA".
    alpha, beta: static scalars of out = alpha * x @ w + beta * c.
    out_dtype: output dtype (bfloat16, float16 or float32); default x.dtype.
    implementation: "ffi", "xla", "reference" or None (auto); see implementation.py.
    timeout_ms: bound on every wait for a peer; default JAX_DISTGEMM_TIMEOUT_MS or 30000.
    return_gathered: AllGather schedules only: also return the operand the call gathered,
      all_gather(x, rows) (RotatingA) or all_gather(w, columns) (RotatingB), tiled, in the
      inputs' dtype.  Every implementation has it without more communication (the fused call
      copies the shards it receives into it).
    x_scale, w_scale: fp32 scales of fp8 x and w (jax_distgemm.quantize): scalars, or block
      scales [..., rows, K/128] and [..., K/128, cols/128]; they shard like their operand.
    fp8: "tensor" or "block": quantize bf16/fp16/fp32 x and w in the call (current scaling, per
      shard) and multiply in fp8; gradients pass straight through to x and w (per tensor in
      fp8, the cotangent in float8_e5m2; block-scaled in x's and w's dtype).

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
  quantized = (fp8_lib.is_fp8(x) or fp8_lib.is_fp8(w) or x_scale is not None
               or w_scale is not None)
  if fp8 is not None:
    fp8_lib.check_scaling(fp8, "fp8")
    if quantized:
      raise ValueError("fp8: quantizes bf16, fp16 or fp32 operands in the call; for operands "
                       "quantized already pass x_scale and w_scale without fp8=")
  if (quantized or fp8 is not None) and return_gathered:
    raise ValueError("return_gathered: not with fp8 operands")
  axis_name = validation.normalize_axis_name(axis_name)
  out_dtype = validation.resolve_out_dtype(out_dtype, jnp.bfloat16 if quantized else x.dtype)
  if quantized and out_dtype not in fp8_lib.OUT_DTYPES:
    raise TypeError(f"out_dtype: an fp8 call writes bfloat16 or float32, not {out_dtype.name}")
  tp = validation.check_call(x, w, c, schedule=schedule, axis_name=axis_name, alpha=alpha,
                             beta=beta)
  scaling = fp8
  if quantized:
    x_scale, w_scale = (None if s is None else jnp.asarray(s) for s in (x_scale, w_scale))
    scaling = fp8_lib.check_scales(x, x_scale, w, w_scale, schedule=schedule, tp=tp)
  elif fp8 == "block":
    fp8_lib.check_block_shapes(x.shape, w.shape, schedule, tp)
  if timeout_ms is None:
    timeout_ms = config.default_timeout_ms()
  else:
    timeout_ms = config.check_timeout_ms(timeout_ms)
  impl.check_name(implementation)
  if free := validation.explicit_free_axes(x, w, c):
    raise ValueError(
        f"x, w: sharded over the Explicit mesh axes {free}, which the enclosing shard_map "
        "leaves free (axis_names=...); the ops run per shard of its manual axes: make the "
        "shard_map manual over those axes too, or give them AxisType.Auto")
  vmapped = validation.vmap_bound_axes(axis_name, x, w, c)
  if fp8 is not None and vmapped:
    # NOTE: no custom VJP under vmap (see below), and so no straight-through gradient.
    raise ValueError(f"fp8: not where jax.vmap binds axis_name {vmapped[0]!r}; quantize with "
                     "jax_distgemm.quantize and pass x_scale, w_scale")
  if vmapped and not quantized:
    implementation = impl.choose_under_vmap(implementation, vmapped)
  params = Params(schedule=schedule, axis_name=axis_name, tp=tp, alpha=float(alpha),
                  beta=float(beta), out_dtype=out_dtype, implementation=implementation,
                  timeout_ms=int(timeout_ms), with_operand=return_gathered)
  fp8_name = None
  if quantized or fp8 is not None:
    fp8_name = impl.choose_fp8(x, w, params, vmapped, scaling)
  if beta == 0:
    c = None
  # Matched before the custom_vjp, so cotangents have the operands' types (autodiff.py).
  x, w, c, x_scale, w_scale = impl.match_vma(x, w, c, x_scale, w_scale)
  # NOTE: no GEMM to run (K = 0, or an empty output): no implementation gets the call
  # (_empty_contraction), so no executor ever sees a grid without tiles.
  if x.shape[-1] == 0 or 0 in output_shape(schedule, x.shape, w.shape, tp):
    out = _empty_contraction(x, w, c, params)
    return (out, _gathered_without_gemm(x, w, params)) if return_gathered else out
  if quantized:  # plain JAX on fp8 values: no custom VJP
    return impl.run_fp8(x, x_scale, w, w_scale, c, params, fp8_name)
  if fp8 is not None:
    return autodiff.quantized_matmul(x, w, c, params, fp8, fp8_name)
  if vmapped:
    # NOTE: no custom VJP here: JAX traces a custom_vjp's backward outside the vmap that binds
    # the axis ("unbound axis name" in jax.grad); the ring and the reference are plain JAX,
    # differentiated by JAX itself.
    return impl.run(x, w, c, params, params.implementation)
  return autodiff.matmul(x, w, c, params)


def _gathered_without_gemm(x, w, p: Params):
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


def _empty_contraction(x, w, c, p: Params):
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
                      timeout_ms: int | None = None, return_gathered: bool = False,
                      x_scale=None, w_scale=None, fp8: str | None = None):
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
                            timeout_ms=timeout_ms, return_gathered=return_gathered,
                            x_scale=x_scale, w_scale=w_scale, fp8=fp8)


def matmul_reduce_scatter(x, w, c=None, *, axis_name, scatter: str = "rows",
                          alpha: float = 1.0, beta: float = 0.0, out_dtype=None,
                          implementation: str | None = None, timeout_ms: int | None = None,
                          x_scale=None, w_scale=None, fp8: str | None = None):
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
                            timeout_ms=timeout_ms, x_scale=x_scale, w_scale=w_scale, fp8=fp8)

"""Reverse-mode autodiff of the collective matmuls: forward and backward collectives paired here.

One `jax.custom_vjp` sits on the per-shard function (inside `jax.shard_map`), so the same rule
serves every implementation.  The backward of each schedule runs its *dual* fused op (AllGather
forward <-> ReduceScatter backward, as TransformerEngine's CollectiveOpSet pairs them) through
the same `implementation` the caller asked for, plus one local GEMM for the other gradient.

Per device, TP = size of the TP axis, B = leading batch dims of x, g = d out (the cotangent),
T = swap of the last two dims; every gradient below is multiplied by alpha, and dc = beta * g:

  forward                   dual fused op in the backward      local GEMM            needs
  RotatingA  AG(x) @ w      dx = RS_rows(g @ wT)   TilingA     dw = AG(x)T @ g        AG(x)
  RotatingB  x @ AG(w)      dw = RS_cols(xT @ g)   TilingB     dx = g @ AG(w)T        AG(w)
  TilingA    RS_rows(x@w)   dx = AG_rows(g) @ wT   RotatingA   dw = xT @ AG_rows(g)   AG(g)
  TilingB    RS_cols(x@w)   dw = xT @ AG_cols(g)   RotatingB   dx = AG_cols(g) @ wT   AG(g)

(w 2-D and x batched: dw also sums over B, so in the RotatingB/TilingB rows B is folded into
the contraction: xT is [K, B*rows], g is [B*rows, cols].  w batched: everything is per batch.)

Where the local GEMM's gathered operand (last column) comes from:

  * RotatingA / RotatingB (the forward gathered x or w): the backward re-gathers the local x
    (resp. w) it saved, with `jax.lax.all_gather`.  This is what Megatron-LM does for
    sequence-parallel layers (and FSDP for weights): the residual is the local shard, not the
    TP-times larger gathered tensor, at the price of one all-gather of x (M*K elements) per
    backward.  The all-gather does not depend on the dual fused op, so XLA is free to run it
    concurrently with it (async collective on GPU).
  * TilingA / TilingB (the backward gathers g): the dual op is an AllGather, and every
    implementation returns the operand it gathered alongside its output (with_operand: the FFI
    call's second result, copied from the shards its stages receive; the ring's shards; the
    reference's explicit all_gather), so g crosses the links once: "reuse the gathered grad from
    DGRAD for WGRAD" (TransformerEngine-JAX's follow-up list, TE #2166).

The gathered operand is also a public result (return_gathered=True, AllGather schedules): its
cotangent, if any, joins the operand's gradient through a reduce-scatter (AG's transpose).

Cotangents are cast to the operands' dtype before the backward GEMMs (as a bf16 training step
does), an fp32 cotangent of fp16 operands first scaled into fp16's range (scale_cotangent);
every GEMM accumulates in fp32.  Forward mode (jax.jvp) is not defined: custom_vjp.

fp8="tensor" runs the same table in fp8 (g in float8_e5m2, _fp8_tensor_bwd); fp8="block" runs
it in the operands' dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax.custom_derivatives import SymbolicZero

from jax_distgemm._src import fp8, implementation, validation
from jax_distgemm._src.implementation import Params
from jax_distgemm._src.reference import matmul_f32
from jax_distgemm._src.schedules import Schedule


@dataclasses.dataclass(frozen=True)
class CollectiveOpSet:
  """How one forward schedule is differentiated (see the module docstring's table)."""

  forward: Schedule
  backward: Schedule  # the dual fused op
  backward_grad: str  # "dx" or "dw": the gradient the dual fused op computes
  gathered: str       # "x", "w" or "g": the operand the local GEMM needs gathered


OP_SETS = {
    Schedule.AllGather1D_TilingCD_RotatingA: CollectiveOpSet(
        Schedule.AllGather1D_TilingCD_RotatingA, Schedule.ReduceScatter1D_TilingA_RotatingC,
        "dx", "x"),
    Schedule.AllGather1D_TilingCD_RotatingB: CollectiveOpSet(
        Schedule.AllGather1D_TilingCD_RotatingB, Schedule.ReduceScatter1D_TilingB_RotatingC,
        "dw", "w"),
    Schedule.ReduceScatter1D_TilingA_RotatingC: CollectiveOpSet(
        Schedule.ReduceScatter1D_TilingA_RotatingC, Schedule.AllGather1D_TilingCD_RotatingA,
        "dx", "g"),
    Schedule.ReduceScatter1D_TilingB_RotatingC: CollectiveOpSet(
        Schedule.ReduceScatter1D_TilingB_RotatingC, Schedule.AllGather1D_TilingCD_RotatingB,
        "dw", "g"),
}


def _t(a):
  return jnp.swapaxes(a, -1, -2)


def _axis(params: Params):
  return params.axis_name if len(params.axis_name) > 1 else params.axis_name[0]


def _all_gather(a, params: Params, dim: int):
  return jax.lax.all_gather(a, _axis(params), axis=dim, tiled=True)


def _fold_batch(xt, g, w_batched: bool):
  """[B.., K, m] and [B.., m, N] -> [K, B*m] and [B*m, N] when w is 2-D (dw sums over B)."""
  if w_batched or xt.ndim == 2:
    return xt, g
  k, n = xt.shape[-2], g.shape[-1]
  xt = jnp.moveaxis(xt, -2, 0).reshape(k, -1)
  return xt, g.reshape(-1, n)


def _weight_grad(lhs_t, rhs, alpha: float, w_batched: bool, dtype):
  """alpha * lhs_t @ rhs, summed over batch dims unless w is batched; fp32 accumulation."""
  lhs_t, rhs = _fold_batch(lhs_t, rhs, w_batched)
  return _local_gemm(lhs_t, rhs, alpha, dtype)


def _local_gemm(a, b, alpha: float, dtype, matmul=matmul_f32):
  """alpha * matmul(a, b) (fp32 accumulation) in `dtype`: the backward's local GEMM."""
  acc = matmul(a, b)
  return (acc if alpha == 1.0 else alpha * acc).astype(dtype)


_F16_LIMIT = 2.0 ** 14  # a scaled fp16 cotangent's largest magnitude (fp16 max: 65504)


def scale_cotangent(g, dtype, combine=lambda amax: amax):
  """(g in `dtype`, s): g * s, s a power of two <= 1 from max |g| (`combine`d over whatever the
  GEMMs that read g combine) so that an fp32 cotangent of a call with fp16 operands cannot
  overflow fp16 (inf, then NaN gradients); s is None, g only cast, for every other pair.
  NOTE: every rank of a fused op must use the same s: per shard, `combine` pmaxes over the TP
  group.  So one large element anywhere in the group scales every rank's cotangent: elements
  more than ~2^24 times smaller than it underflow fp16 (zero), as in a loss-scaled fp16 step.
  NOTE: the max is over finite elements: an inf or NaN stays where it is (s = 0 from an inf
  made every gradient of every rank NaN)."""
  if not (g.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.float16):
    return g.astype(dtype), None
  a = jnp.abs(jax.lax.stop_gradient(g))
  amax = combine(jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), initial=0.0))
  s = jnp.where(amax > _F16_LIMIT, jnp.exp2(jnp.floor(jnp.log2(_F16_LIMIT / amax))), 1.0)
  return (g * s).astype(dtype), s


def unscale(a, s):
  return a if s is None else (a.astype(jnp.float32) / s).astype(a.dtype)


def zeros_varying_like(a, shape=None, dtype=None):
  """Zeros (of a's shape and dtype unless given) varying over the manual axes `a` varies
  over: a cotangent must have its primal's type, a result the type the op would give it."""
  z = jnp.zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)
  if axes := tuple(sorted(jax.typeof(a).manual_axis_type.varying)):
    z = jax.lax.pcast(z, axes, to="varying")
  return z


def _reduce_scatter(a, params: Params, dim: int, dtype):
  """The transpose of `_all_gather` (tiled), summed in fp32."""
  return jax.lax.psum_scatter(a.astype(jnp.float32), _axis(params), scatter_dimension=dim,
                              tiled=True).astype(dtype)


def _eager_shard_map(*arrays) -> bool:
  """Whether the arrays are traced by an eager (un-jitted) shard_map, below any autodiff
  tracers (their `primal`s)."""
  for a in map(validation.strip_autodiff, arrays):
    if isinstance(a, jax.core.Tracer) and type(a).__name__ == "ShardMapTracer":
      return True
  return False


def _batched_like(op, *others):
  """`op` (the operand the call gathers), batched under every jax.vmap that batches one of
  `others`; its values untouched (a select, so no NaN of theirs leaks in).

  NOTE: under vmap, an unbatched gathered operand makes the gathered result an output shared
  across the batch; a custom_vjp's bwd then runs per example on that output's whole cotangent,
  and the sum over examples counts it once per example.  jax 0.11.2 returned that wrong
  gradient (3x for 3 examples); jax 0.12 refuses it.  Batched, the result's cotangent is per
  example, and the broadcast back to `op` sums it once.
  """
  deps = [o for o in others if o is not None and isinstance(o, jax.core.Tracer)
          and hasattr(o, "batch_dim") and o.size]
  for d in deps:
    probe = jax.lax.stop_gradient(d.reshape(-1)[:1].reshape(())).astype(op.dtype)
    op = jnp.where(True, op, probe)
  return op


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x, w, c, params: Params):
  return implementation.run(x, w, c, params)


def _residuals(x, w, c):
  return x, w, None if c is None else jnp.zeros((0,), c.dtype)  # only c's dtype is needed


def _fwd(x, w, c, params):
  # Through `_matmul` itself (not `run`): under an outer differentiation (grad of grad) the
  # forward is then differentiated by this same rule, never by a JVP of the FFI primitive.
  return _matmul(x, w, c, params), _residuals(x, w, c)


# with_operand: (out, gathered operand).  symbolic_zeros: a gathered operand nobody uses
# (its cotangent a symbolic zero) costs no reduce-scatter in the backward.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul_with_operand(x, w, c, params: Params):
  return implementation.run(x, w, c, params)


def _fwd_with_operand(x, w, c, params):
  x, w, c = (None if a is None else a.value for a in (x, w, c))
  return _matmul_with_operand(x, w, c, params), _residuals(x, w, c)  # (see _fwd)


def _bwd_with_operand(params: Params, res, cts):
  x, w, c_token = res
  g, g_op = cts
  plain = dataclasses.replace(params, with_operand=False)
  if isinstance(g, SymbolicZero):  # only the gathered operand is used
    dx, dw = zeros_varying_like(x), zeros_varying_like(w)
    dc = None if c_token is None else zeros_varying_like(x, g.shape, c_token.dtype)
  else:
    dx, dw, dc = _bwd(plain, res, g)
  if not isinstance(g_op, SymbolicZero):
    if params.schedule == Schedule.AllGather1D_TilingCD_RotatingA:
      dx = dx + _reduce_scatter(g_op, params, x.ndim - 2, x.dtype)
    else:
      dw = dw + _reduce_scatter(g_op, params, w.ndim - 1, w.dtype)
  return dx, dw, dc


# NOTE: JAX has no symbolic_zeros custom_vjp under an eager (un-jitted) shard_map
# ("custom_vjp symbolic_zeros support with shard_map is not implemented", jax 0.11-0.12).
# There the same rule runs with dense cotangents: an unused gathered operand then costs a
# reduce-scatter of zeros, in eager mode only.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul_with_operand_dense(x, w, c, params: Params):
  return implementation.run(x, w, c, params)


def _fwd_with_operand_dense(x, w, c, params):
  return _matmul_with_operand_dense(x, w, c, params), _residuals(x, w, c)


def _with_operand_op(*arrays):
  return _matmul_with_operand_dense if _eager_shard_map(*arrays) else _matmul_with_operand


def _dual(a, b, params: Params, schedule: Schedule, out_dtype, *, with_operand: bool):
  """The _dual fused op; with_operand: also return the operand it gathers."""
  p = dataclasses.replace(params, schedule=schedule, beta=0.0, out_dtype=jnp.dtype(out_dtype),
                          with_operand=with_operand)
  # Through the custom_vjp itself, so that the backward is differentiable again.
  if with_operand:
    return _with_operand_op(a, b)(a, b, None, p)
  return _matmul(a, b, None, p), None


def _bwd(params: Params, res, g):
  x, w, c_token = res
  op = OP_SETS[params.schedule]
  alpha, w_batched = params.alpha, w.ndim > 2
  rows = x.ndim - 2
  dc = None if c_token is None else (params.beta * g.astype(jnp.float32)).astype(c_token.dtype)
  # fp16 x with an fp32 out: g scaled by a power of two agreed over the group (s), every
  # product of it unscaled below; bf16 and same-dtype calls are only cast.
  g, sc = scale_cotangent(g, x.dtype, lambda amax: jax.lax.pmax(amax, _axis(params)))
  s = params.schedule
  if s == Schedule.AllGather1D_TilingCD_RotatingA:
    # out [B, M, N/TP] = AG_rows(x) @ w.
    dx, _ = _dual(g, _t(w), params, op.backward, x.dtype, with_operand=False)
    x_all = _all_gather(x, params, rows)                      # re-gathered (see docstring)
    dw = _weight_grad(_t(x_all), g, alpha, w_batched, w.dtype)
  elif s == Schedule.AllGather1D_TilingCD_RotatingB:
    # out [B, M/TP, N] = x @ AG_cols(w).
    xt, gf = _fold_batch(_t(x), g, w_batched)
    dw, _ = _dual(xt, gf, params, op.backward, w.dtype, with_operand=False)
    w_all = _all_gather(w, params, w.ndim - 1)                # re-gathered (see docstring)
    dx = _local_gemm(g, _t(w_all), alpha, x.dtype)
  elif s == Schedule.ReduceScatter1D_TilingA_RotatingC:
    # out [B, M/TP, N] = RS_rows(x @ w).
    dx, g_all = _dual(g, _t(w), params, op.backward, x.dtype, with_operand=True)
    dw = _weight_grad(_t(x), g_all, alpha, w_batched, w.dtype)
  else:
    # out [B, M, N/TP] = RS_cols(x @ w).
    xt, gf = _fold_batch(_t(x), g, w_batched)
    dw, g_all = _dual(xt, gf, params, op.backward, w.dtype, with_operand=True)
    g_all = g_all.reshape(g.shape[:-1] + (g_all.shape[-1],))  # unfold B
    dx = _local_gemm(g_all, _t(w), alpha, x.dtype)
  return unscale(dx, sc), unscale(dw, sc), dc

_matmul.defvjp(_fwd, _bwd)
_matmul_with_operand.defvjp(_fwd_with_operand, _bwd_with_operand, symbolic_zeros=True)
_matmul_with_operand_dense.defvjp(_fwd_with_operand_dense, _bwd_with_operand)


# fp8=: the forward quantizes x and w (current scaling, per shard) and runs the fp8 call; the
# backward differentiates straight through the quantizer.  Per tensor it runs in fp8, as
# TransformerEngine's recipe does: the cotangent in float8_e5m2 (range over precision), x and
# w in float8_e4m3fn.  Block scaling's backward is the unquantized op's (_bwd).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def quantized_matmul(x, w, c, params: Params, scaling: str, name: str):
  """The differentiable per-shard op with fp8=`scaling`, run by implementation `name`."""
  xq, sx = fp8.quantize(x, scaling, operand="x")
  wq, sw = fp8.quantize(w, scaling, operand="w")
  return implementation.run_fp8(xq, sx, wq, sw, c, params, name)


def _fp8_fwd(x, w, c, params, scaling, name):
  return quantized_matmul(x, w, c, params, scaling, name), _residuals(x, w, c)


def _fp8_bwd(params, scaling, name, res, g):
  del name  # the backward's calls choose their own implementation
  if scaling == "tensor":
    return _fp8_tensor_bwd(params, res, g)
  return _bwd(params, res, g)


def _tq(op):
  """The transpose of a per-tensor (values, scale) pair."""
  return _t(op[0]), op[1]


def _fp8_dual(a, b, params: Params, schedule: Schedule, dtype):
  """The dual fused op on per-tensor pairs, a (the e5m2 cotangent) on the x side."""
  p = dataclasses.replace(params, schedule=schedule, beta=0.0,
                          out_dtype=fp8.call_out_dtype(dtype),
                          with_operand=False)
  name = implementation.choose_fp8(a[0], b[0], p, (), "tensor")
  return implementation.run_fp8(a[0], a[1], b[0], b[1], None, p, name).astype(dtype)


def _fp8_tensor_bwd(params: Params, res, g):
  """_bwd's table with per-tensor fp8 operands: g in e5m2 with one scale per shard, or one
  agreed over the group where the backward gathers g (AG(g) is then one tensor); x and w
  quantized as the forward did, or as a whole where the backward gathers them.

  NOTE: the fused kernels take e5m2 on the x side only, so where the table has g on the w
  side (dw of RotatingB and TilingB) the dual op computes dw transposed (RS_cols(xT @ g) =
  RS_rows(gT @ x)T, AG_cols is AG_rows of the transpose).  The ReduceScatters' backward
  gathers g once more for the local GEMM, in fp8: as many bytes as the bf16 backward's one.
  NOTE: not differentiable again where a dual op runs the fused call (no JVP of it)."""
  x, w, c_token = res
  op = OP_SETS[params.schedule]
  alpha, w_batched = params.alpha, w.ndim > 2
  rows = x.ndim - 2
  dc = None if c_token is None else (params.beta * g.astype(jnp.float32)).astype(c_token.dtype)
  amax = jnp.max(jnp.abs(g.astype(jnp.float32)))
  if op.gathered == "g":
    amax = jax.lax.pmax(amax, _axis(params))
  gq = fp8.quantize_by_amax(g, amax, jnp.float8_e5m2)
  xq, wq = fp8.quantize(x, "tensor"), fp8.quantize(w, "tensor", operand="w")
  s = params.schedule
  if s in (Schedule.AllGather1D_TilingCD_RotatingB, Schedule.ReduceScatter1D_TilingB_RotatingC):
    # dw by its transpose, the cotangent on the x side: gT @ x, batch folded into K.
    xt, gf = _fold_batch(_t(xq[0]), gq[0], w_batched)
    dual = (Schedule.ReduceScatter1D_TilingA_RotatingC
            if s == Schedule.AllGather1D_TilingCD_RotatingB
            else Schedule.AllGather1D_TilingCD_RotatingA)
    dw = _t(_fp8_dual((_t(gf), gq[1]), (_t(xt), xq[1]), params, dual, w.dtype))
    if s == Schedule.AllGather1D_TilingCD_RotatingB:
      w_all = fp8.quantize(_all_gather(w, params, w.ndim - 1), "tensor", operand="w")
      dx = _local_gemm(gq, _tq(w_all), alpha, x.dtype, fp8.matmul)
    else:
      g_all = (_all_gather(gq[0], params, g.ndim - 1), gq[1])
      dx = _local_gemm(g_all, _tq(wq), alpha, x.dtype, fp8.matmul)
    return dx, dw, dc
  dx = _fp8_dual(gq, _tq(wq), params, op.backward, x.dtype)
  if s == Schedule.AllGather1D_TilingCD_RotatingA:
    lhs = fp8.quantize(_all_gather(x, params, rows), "tensor")
    rhs = gq
  else:
    lhs, rhs = xq, (_all_gather(gq[0], params, rows), gq[1])
  lhs_t, rhs_v = _fold_batch(_t(lhs[0]), rhs[0], w_batched)
  dw = _local_gemm((lhs_t, lhs[1]), (rhs_v, rhs[1]), alpha, w.dtype, fp8.matmul)
  return dx, dw, dc


quantized_matmul.defvjp(_fp8_fwd, _fp8_bwd)


def matmul(x, w, c, params: Params):
  """The differentiable per-shard op: implementation.run with the custom VJP above.

  Operands must already vary over the same manual axes (implementation.match_vma), so that
  cotangents have the primal's type; the pcast that matched them transposes to the psum over
  the axes a replicated operand (e.g. w over "data") did not vary over.
  """
  if not params.with_operand:
    return _matmul(x, w, c, params)
  if params.schedule == Schedule.AllGather1D_TilingCD_RotatingA:
    x = _batched_like(x, w, c)
  else:
    w = _batched_like(w, x, c)
  return _with_operand_op(x, w)(x, w, c, params)


"""collective_matmul inside jax.jit with Auto mesh axes: a custom_partitioning op.

Tracers carry no sharding there, so the rule table (sharding_rules.py) runs at compile time,
in the partition callback, on the shardings Shardy propagated.  custom_partitioning has no
JVP, so this path has a jit-level custom_vjp: dx = g @ wT and dw = xT @ g are two more
partitioned ops, each asked for its primal's sharding, so the partitioner emits the dual fused
op where the table allows (and the plain dot, gathering only what it needs, elsewhere).  With a
batch dim on x and a 2-D w, dw sums over the batch too: a separate op folds it into the
contraction per shard (a global fold of [B, M] could not carry the (data, tp) sharding).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_distgemm._src import autodiff, config, fp8, primitives, validation
from jax_distgemm._src import sharding_rules as rules


# Out's rows (m) have a factor of their own: Shardy must not propagate x's row sharding to them
# (RotatingA gathers it).  Out's columns share w's (n), so that where nothing asks for a result
# sharding, an AllGather's comes out N-sharded, the table's default (RotatingA), not gathered;
# the contraction k and the batch dims (...) are shared.  The backward's ops take a third
# operand, `like` (the primal; unused by the math), whose sharding is the one wanted for the
# result: it shares the result's factors (m n), so that Shardy gives each gradient its primal's
# layout (with factors of its own, jit(grad) without out_shardings all-gathered dx and dw).
SHARDING_RULES = {
    (False, False): "... i k, k n -> ... m n",
    (True, False): "... i k, ... k n -> ... m n",
    (False, True): "... i k, k j, ... m n -> ... m n",
    (True, True): "... i k, ... k j, ... m n -> ... m n",
}

_call_sites = itertools.count(1)  # distinct rendezvous keys per partitioned op (primitives.py)


@dataclasses.dataclass(frozen=True)
class _AutoConfig:
  options: rules.Options
  out_spec: P | None  # requested by the caller (None: the result sharding Shardy gives)
  fallback: str
  w_batched: bool
  with_like: bool = False  # out_spec is that of a third operand (the backward's ops)
  fold_rank: int = 0  # > 0: the weight-gradient op sum_{batch, m} x[.., m, :]T g[.., m, :]


def _fold_partition(cfg: _AutoConfig, mesh, arg_shapes, result_shape):
  """Partition of the weight-gradient op dw [K, N] = sum over (batch, m) of xT g.

  x [B.., M, K] and g [B.., M, N] are folded per shard ([K, b*m] and [b*m, N], a local
  reshape), which needs x and g sharded alike on the batch dims and M; the contraction is then
  the set of mesh axes of those dims (order is irrelevant to a sum): with "tp" among them the
  table's ReduceScatter rows apply, with "tp" on x's K and g's N its AllGather rows.
  """
  del result_shape
  o = cfg.options
  xs, gs, like = arg_shapes
  nd = len(xs.shape)
  xe = rules.spec_entries(xs.sharding.spec, nd, "x")
  ge = rules.spec_entries(gs.sharding.spec, nd, "g")
  named = lambda s: NamedSharding(mesh, s)
  p = None
  if xe[:-1] == ge[:-1]:
    axes = [a for e in xe[:-1] for a in e]
    contraction = tuple(a for a in axes if a != o.axis) + ((o.axis,) if o.axis in axes else ())
    p = rules.plan(rules.to_spec([xe[-1], contraction]), rules.to_spec([contraction, ge[-1]]),
                   like.sharding.spec, x_ndim=2, w_ndim=2, axis=o.axis)
  if p is not None and p.schedule is not None:
    body = rules.fused_body(p, o)
    site = next(_call_sites)

    def lower_fn(x, g, unused_like):
      k, n = x.shape[-1], g.shape[-1]
      xt = jnp.moveaxis(x.reshape(-1, k), -1, 0)
      with primitives.call_site(site):
        return body(xt, g.reshape(-1, n))
    return mesh, lower_fn, named(p.out_spec), (xs.sharding, gs.sharding, like.sharding)
  # The plain dot: per dim, keep the prefix of axes x and g share (so the fold stays local);
  # the rest is gathered by XLA; partial sums over the kept axes are psum'd.
  common = [tuple(a for a, _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(a, b)))
            for a, b in zip(xe[:-1], ge[:-1])]
  summed = tuple(a for e in common for a in e)
  k = xe[-1] if not set(summed) & set(xe[-1]) else ()
  n = ge[-1] if not set(summed + k) & set(ge[-1]) else ()
  d = rules.Plan(None, rules.to_spec(common + [k]), rules.to_spec(common + [n]),
                 rules.to_spec([k, n]), psum_axes=summed)
  dot = rules.dot_body(d, o)

  def dot_fn(x, g, unused_like):
    kk, nn = x.shape[-1], g.shape[-1]
    return dot(jnp.moveaxis(x.reshape(-1, kk), -1, 0), g.reshape(-1, nn))
  return mesh, dot_fn, named(d.out_spec), (named(d.x_spec), named(d.w_spec), like.sharding)


def _partition(cfg: _AutoConfig, mesh, arg_shapes, result_shape):
  if cfg.fold_rank:
    return _fold_partition(cfg, mesh, arg_shapes, result_shape)
  o = cfg.options
  xs, ws = arg_shapes[:2]
  x_spec, w_spec = xs.sharding.spec, ws.sharding.spec
  nd = len(result_shape.shape)
  out_spec, hint, unconstrained = cfg.out_spec, False, False
  if cfg.with_like:
    out_spec = arg_shapes[2].sharding.spec
  elif out_spec is None:
    # What Shardy propagated back from the result's users: only a hint where "tp" goes (M or
    # N); XLA reshards the rest, as it would for a plain dot.
    result = result_shape.sharding.spec
    if any(o.axis in e for e in rules.spec_entries(result, nd, "out")):
      out_spec, hint = result, True
    else:  # replicated over "tp": the table's default, then gathered by XLA
      unconstrained = True
  if out_spec is not None:
    out_spec = rules.without_size_one(out_spec, mesh, nd, "out_sharding")
  named = lambda s: NamedSharding(mesh, s)
  like = (arg_shapes[2].sharding,) if cfg.with_like else ()

  def dot():  # the plain dot, with XLA's collectives
    d = rules.dot_plan(x_spec, w_spec, len(xs.shape), len(ws.shape))
    return (mesh, rules.dot_body(d, o), named(d.out_spec),
            (named(d.x_spec), named(d.w_spec)) + like)

  if o.axis not in mesh.shape:
    if cfg.fallback == "dot":
      return dot()
    raise ValueError(f"jax_distgemm.collective_matmul: axis {o.axis!r} is not an axis of the "
                     f"mesh {tuple(mesh.axis_names)}")
  if mesh.shape[o.axis] == 1:  # TP = 1 (Shardy dropped "tp" too): nothing to fuse
    return dot()
  p = rules.plan(x_spec, w_spec, out_spec, x_ndim=len(xs.shape), w_ndim=len(ws.shape),
                 axis=o.axis, out_is_hint=hint)
  if p.schedule is not None:
    if unconstrained:
      config.warn(("auto result", p.schedule),
                  f"jax_distgemm.collective_matmul: under jax.jit with Auto mesh axes the "
                  f"result is wanted replicated over {o.axis!r} (or nothing asks for a "
                  f"sharding), so XLA gathers the {p.schedule.name} result after the fused "
                  f"call; pass "
                  f"out_sharding={rules.trim_spec(p.out_spec)} (the table's default) to keep "
                  "it sharded")
    body = rules.fused_body(p, o)
    site = next(_call_sites)

    def lower_fn(x, w, *unused_like):
      with primitives.call_site(site):
        return body(x, w)
    return mesh, lower_fn, named(p.out_spec), (named(p.x_spec), named(p.w_spec)) + like
  if cfg.fallback == "error":
    raise ValueError(f"jax_distgemm.collective_matmul: {p.reason} (pass fallback='dot' to use "
                     "the plain XLA dot instead)")
  return dot()


@functools.lru_cache(maxsize=None)
def _auto_op(cfg: _AutoConfig):
  """The custom_partitioning op of one configuration (its partition callback is the table)."""

  def math(x, w, *unused_like):
    if cfg.fold_rank:  # the weight gradient: x [B.., M, K], w = g [B.., M, N] -> [K, N]
      x, w = _fold_batch(jnp.swapaxes(x, -1, -2), w)
    return rules.dot(x, w, cfg.options)  # the global meaning (also the unpartitioned lowering)

  if cfg.fold_rank:
    batch = " ".join(f"b{i}" for i in range(cfg.fold_rank - 2))
    rule = f"{batch} m k, {batch} m n, r s -> r s"  # `like` (w) shares the result's r s
  else:
    rule = SHARDING_RULES[(cfg.w_batched, cfg.with_like)]
  op = custom_partitioning(math)
  op.def_partition(partition=functools.partial(_partition, cfg), sharding_rule=rule)
  return op


def _fold_batch(xt, g):
  """[B.., K, M] and [B.., M, N] -> [K, B*M] and [B*M, N] (dw of a 2-D w sums over B)."""
  k, n = xt.shape[-2], g.shape[-1]
  return jnp.moveaxis(xt, -2, 0).reshape(k, -1), g.reshape(-1, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _auto_matmul(x, w, cfg: _AutoConfig):
  return _auto_op(cfg)(x, w)


def _auto_matmul_fwd(x, w, cfg):
  return _auto_matmul(x, w, cfg), (x, w)


def _auto_matmul_bwd(cfg: _AutoConfig, res, g):
  """dx = g @ wT and dw = xT @ g as two more partitioned ops, each asked for the sharding of
  its primal: where that is a collective-matmul layout (the dual of the forward's schedule)
  the partitioner emits the fused op, elsewhere the plain dot (XLA's collectives).

  fp8="tensor": each fused op quantizes its own shards, g to float8_e5m2 on the x side (the
  fused kernels take e5m2 there), so dw is asked for transposed, dwT = gT @ x; a plain dot runs
  unquantized, as the forward's does.  Block scaling's backward runs unquantized (as
  autodiff.py's)."""
  x, w = res
  t = lambda a: jnp.swapaxes(a, -1, -2)
  fp8_tensor = cfg.options.fp8 == "tensor"
  if fp8_tensor:
    options, sc = dataclasses.replace(cfg.options, fp8_cotangent=True), None
  else:
    # fp16 x with an fp32 out: a global power-of-two scale keeps g within fp16 (autodiff.py;
    # a global array's max needs no collective of ours).
    g, sc = autodiff.scale_cotangent(g, x.dtype)
    options = dataclasses.replace(cfg.options, fp8=None)

  def config_for(dtype, **kwargs):
    if fp8_tensor:
      dtype = fp8.call_out_dtype(dtype)
    return dataclasses.replace(cfg, options=dataclasses.replace(options, out_dtype=dtype),
                               out_spec=None, fallback="dot", with_like=True, **kwargs)

  def weight_grad(a, b, like):
    """aT @ b, summed over the batch dims too where w is 2-D (and x is not)."""
    if w.ndim > 2 or x.ndim == 2:
      return _auto_matmul_like(t(a), b, like, config_for(like.dtype, w_batched=w.ndim > 2))
    # Folded per shard (a global fold could not be sharded).
    return _auto_weight_grad(a, b, like, config_for(like.dtype, w_batched=False,
                                                    fold_rank=x.ndim))

  dx = _auto_matmul_like(g, t(w), x, config_for(x.dtype, w_batched=w.ndim > 2))
  dw = t(weight_grad(g, x, t(w))) if fp8_tensor else weight_grad(x, g, w)
  return (autodiff.unscale(dx.astype(x.dtype), sc), autodiff.unscale(dw.astype(w.dtype), sc))


_auto_matmul.defvjp(_auto_matmul_fwd, _auto_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _auto_matmul_like(a, b, like, cfg: _AutoConfig):
  return _auto_op(cfg)(a, b, like)


def _auto_matmul_like_fwd(a, b, like, cfg):
  return _auto_matmul_like(a, b, like, cfg), (a, b, like)


def _auto_matmul_like_bwd(cfg, res, g):
  a, b, like = res  # grad of grad: the same construction again, `like` gets a zero cotangent
  base = dataclasses.replace(cfg, with_like=False)
  da, db = _auto_matmul_bwd(base, (a, b), g)
  return da, db, jnp.zeros_like(like)


_auto_matmul_like.defvjp(_auto_matmul_like_fwd, _auto_matmul_like_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _auto_weight_grad(x, g, like, cfg: _AutoConfig):
  return _auto_op(cfg)(x, g, like)


def _auto_weight_grad_fwd(x, g, like, cfg):
  return _auto_weight_grad(x, g, like, cfg), (x, g, like)


def _auto_weight_grad_bwd(cfg, res, h):
  """dw = sum xT g is bilinear: d x = g @ hT and d g = x @ h (grad of grad)."""
  x, g, like = res
  base = dataclasses.replace(cfg, fold_rank=0, w_batched=False)
  op = lambda a, b, to: _auto_matmul_like(
      a, b, to, dataclasses.replace(base, options=dataclasses.replace(
          base.options, out_dtype=to.dtype)))
  h = h.astype(x.dtype)
  return op(g, jnp.swapaxes(h, -1, -2), x), op(x, h, g), jnp.zeros_like(like)


_auto_weight_grad.defvjp(_auto_weight_grad_fwd, _auto_weight_grad_bwd)


def collective_matmul(x, w, out_spec, out_sharding, fallback: str, o: rules.Options, mesh):
  """The custom_partitioning path: the rule table runs in the partition callback."""
  if jnp.ndim(w) > 2 and jnp.shape(w)[:-2] != jnp.shape(x)[:-2]:
    raise ValueError(f"w: batch dims {jnp.shape(w)[:-2]} must equal those of x "
                     f"{jnp.shape(x)[:-2]}")
  cfg = _AutoConfig(options=o, out_spec=None if out_spec is None else rules.trim_spec(out_spec),
                    fallback=fallback, w_batched=jnp.ndim(w) > 2)
  out = _auto_matmul(x, w, cfg)
  if out_sharding is not None:
    if isinstance(out_sharding, P):
      mesh = mesh or validation.context_mesh()
      if mesh is None:
        raise ValueError("out_sharding: a PartitionSpec needs mesh= (or jax.set_mesh)")
      out_sharding = NamedSharding(mesh, out_sharding)
    out = jax.lax.with_sharding_constraint(out, out_sharding)
  return out

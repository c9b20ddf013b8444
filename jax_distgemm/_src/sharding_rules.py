"""The rule table of `collective_matmul`: which schedule the shardings call for.

Only the mesh axis `axis` ("tp") is ours; every other mesh axis passes through untouched (a
batch dim sharded over "data" stays so).  Global shapes x [..., M, K], w [K, N] or
[..., K, N], out [..., M, N]; "tp" marks the dim sharded over the TP axis (the minor axis of
that dim's entry, if it has several):

  x        w        out (requested)   schedule                            per shard
  M: tp    N: tp    N: tp (default)   AllGather1D_TilingCD_RotatingA      AG_rows(x) @ w
  M: tp    N: tp    M: tp             AllGather1D_TilingCD_RotatingB      x @ AG_cols(w)
  K: tp    K: tp    M: tp (default)   ReduceScatter1D_TilingA_RotatingC   RS_rows(x @ w)
  K: tp    K: tp    N: tp             ReduceScatter1D_TilingB_RotatingC   RS_cols(x @ w)
  anything else                       no schedule: Plan.reason says why

Other mesh axes: the batch dims of out take x's (a batched w must be sharded like x there);
M and N keep the other axes of x's rows and w's columns; the contraction may carry other axes
when x and w agree, and those partial sums are then psum'd (an XLA all-reduce); axes only w's
K carries (an FSDP weight) are gathered by XLA first.

Also here: the per-shard bodies a plan runs (the fused op, or the plain dot up to a psum).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_distgemm._src import api, fp8
from jax_distgemm._src.reference import matmul_f32
from jax_distgemm._src.schedules import Schedule

AG_A, AG_B, RS_A, RS_B = tuple(Schedule)


def spec_entries(spec, ndim: int, what: str) -> list[tuple[str, ...]]:
  """A PartitionSpec as one tuple of mesh axes per dim (padded with () to ndim)."""
  spec = tuple(spec) if spec is not None else ()
  if len(spec) > ndim:
    raise ValueError(f"{what}: PartitionSpec {P(*spec)} has more entries than the rank {ndim}")
  out = []
  for e in spec + (None,) * (ndim - len(spec)):
    if e is None:
      out.append(())
    elif isinstance(e, str):
      out.append((e,))
    elif isinstance(e, tuple) and all(isinstance(a, str) for a in e):
      out.append(tuple(e))
    else:
      raise ValueError(f"{what}: unsupported PartitionSpec entry {e!r} in {P(*spec)}")
  return out


def to_spec(entries) -> P:
  return P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


def trim_spec(spec: P) -> P:
  """Drops trailing None entries (P('a', None) == P('a') as a sharding)."""
  e = list(spec)
  while e and e[-1] is None:
    e.pop()
  return P(*e)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The rule table's answer for one call.

  schedule is None when no fused schedule fits (reason says why); the specs are then those of
  the operands as given.  psum_axes: other mesh axes the contraction is sharded over.
  """

  schedule: Schedule | None
  x_spec: P
  w_spec: P
  out_spec: P | None
  psum_axes: tuple[str, ...] = ()
  reason: str = ""


def plan(x_spec, w_spec, out_spec, *, x_ndim: int, w_ndim: int, axis: str = "tp",
         out_is_hint: bool = False) -> Plan:
  """Applies the rule table (module docstring) to PartitionSpecs of the GLOBAL operands.

  Args:
    x_spec, w_spec: PartitionSpecs of x [..., M, K] and w [K, N] or [..., K, N].
    out_spec: the requested PartitionSpec of out [..., M, N], or None for the default (the
      output sharded on N for the AllGather family, on M for the ReduceScatter family).
    x_ndim, w_ndim: ranks of x and w.
    axis: the tensor-parallel mesh axis.
    out_is_hint: out_spec only says where `axis` should go (M or N; elsewhere or nowhere: the
      default), not the whole layout: the caller reshards the plan's output.

  Returns:
    A Plan; Plan.schedule is None (with Plan.reason) when no schedule applies.
  """
  xe = spec_entries(x_spec, x_ndim, "x")
  we = spec_entries(w_spec, w_ndim, "w")
  oe = None if out_spec is None else spec_entries(out_spec, x_ndim, "out_sharding")
  nb = x_ndim - 2

  def no(reason):
    return Plan(None, to_spec(xe), to_spec(we), None if oe is None else to_spec(oe), (), reason)

  if w_ndim != 2 and w_ndim != x_ndim:
    return no(f"w must have rank 2 or the rank of x ({x_ndim}), got {w_ndim}")

  def where(entries, names, what):
    for e, name in zip(entries, names):
      if axis in e:
        if e[-1] != axis:
          return None, (f"{what}: {axis!r} must be the minor (last) axis of the {name} entry "
                        f"{e}")
        return name, None
    return None, None  # not sharded over `axis`

  x_names = [f"batch {i}" for i in range(nb)] + ["M", "K"]
  w_names = [f"batch {i}" for i in range(w_ndim - 2)] + ["K", "N"]
  o_names = [f"batch {i}" for i in range(nb)] + ["M", "N"]
  tx, err = where(xe, x_names, "x")
  if err:
    return no(err)
  tw, err = where(we, w_names, "w")
  if err:
    return no(err)
  to = None
  if oe is not None:
    to, err = where(oe, o_names, "out_sharding")
    if err and not out_is_hint:
      return no(err)

  shown = f"x {to_spec(xe)}, w {to_spec(we)}"
  if (tx, tw) == ("M", "N"):
    family = "all_gather"
  elif (tx, tw) == ("K", "K"):
    family = "reduce_scatter"
  else:
    on = lambda what, t: f"{what}'s {t}" if t else f"{what} (not sharded over it)"
    return no(
        f"{shown}: no collective matmul for {axis!r} on {on('x', tx)} and {on('w', tw)}; the rules "
        f"need x rows ({axis!r} on M) and w columns ({axis!r} on N) sharded (AllGather), or "
        f"both sharded on the contraction K (ReduceScatter)")

  batch = xe[:nb]
  if w_ndim > 2 and list(we[:nb]) != list(batch):
    return no(f"{shown}: a batched w must be sharded like x on the batch dims")
  xk, wk = xe[-1], we[-2]
  w_laid = we  # w as the plan lays it out
  extra = tuple(a for a in wk if a not in xk)
  if xk != wk and extra and axis not in extra and tuple(a for a in wk if a in xk) == xk:
    # An FSDP-sharded weight: w's K carries mesh axes x's does not; XLA gathers w over them
    # (shard_map's in_specs, or reshard) before the fused op, as FSDP does before a layer.
    w_laid = we[:-2] + [xk, we[-1]]
    wk = xk
  if xk != wk:
    return no(f"{shown}: x and w must be sharded alike on the contraction K, up to mesh "
              f"axes other than {axis!r} that only w has there (an FSDP weight, gathered by "
              "XLA first)")
  psum_axes = tuple(a for a in xk if a != axis)

  if family == "all_gather":
    rows_other, cols_other = xe[-2][:-1], we[-1][:-1]
    candidates = {"N": (AG_A, batch + [rows_other, we[-1]]),
                  "M": (AG_B, batch + [xe[-2], cols_other])}
    default = "N"
  else:
    candidates = {"M": (RS_A, batch + [xe[-2] + (axis,), we[-1]]),
                  "N": (RS_B, batch + [xe[-2], we[-1] + (axis,)])}
    default = "M"
  if oe is None or out_is_hint and to not in candidates:
    to = default
  if to not in candidates:
    return no(f"{shown}: the output must be sharded over {axis!r} on M or N, but "
              f"out_sharding {to_spec(oe)} has it " + (f"on {to}" if to else "nowhere"))
  schedule, out = candidates[to]
  used = [a for e in out for a in e]
  if len(used) != len(set(used)):
    return no(f"{shown}: the output of {schedule.name} would be sharded as {out}, which uses "
              "a mesh axis twice")
  if oe is not None and not out_is_hint and trim_spec(to_spec(oe)) != trim_spec(to_spec(out)):
    return no(f"{shown}: out_sharding {to_spec(oe)} asks for {schedule.name} but that gives "
              f"{to_spec(out)} (mesh axes other than {axis!r} pass through from x and w)")
  return Plan(schedule, to_spec(xe), to_spec(w_laid), to_spec(out), psum_axes)


# -- Per-shard bodies ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
  """What a jit-level call passes to every shard (hashable: the bodies are cached)."""

  axis: str
  alpha: float
  out_dtype: jnp.dtype
  # A name, None, or a per-shard callable fn(x, w, *, axis_name, schedule, out_dtype).
  implementation: str | None | Callable
  timeout_ms: int | None
  fp8: str | None = None  # "tensor" or "block": quantize every shard in the call (fp8.py)
  fp8_cotangent: bool = False  # x is a cotangent (the backward's ops): float8_e5m2


def fused_body(p: Plan, o: Options):
  """The per-shard function of a plan with a schedule (the shard_map / partition body)."""

  def body(x, w):
    dtype = jnp.float32 if p.psum_axes else o.out_dtype  # sum partials in fp32
    if callable(o.implementation):  # a per-shard op the caller injected (alpha is 1)
      out = o.implementation(x, w, axis_name=o.axis, schedule=p.schedule, out_dtype=dtype)
    else:
      quantized = dict(fp8=o.fp8)
      if o.fp8_cotangent:  # per tensor, as autodiff._fp8_tensor_bwd quantizes g
        (x, sx), (w, sw) = (fp8.quantize(x, "tensor", dtype=jnp.float8_e5m2),
                            fp8.quantize(w, "tensor", operand="w"))
        quantized = dict(x_scale=sx, w_scale=sw)
      out = api.distributed_matmul(x, w, axis_name=o.axis, schedule=p.schedule,
                                   alpha=o.alpha, out_dtype=dtype,
                                   implementation=o.implementation, timeout_ms=o.timeout_ms,
                                   **quantized)
    if p.psum_axes:
      out = jax.lax.psum(out, p.psum_axes).astype(o.out_dtype)
    return out
  return body


def dot(x, w, o: Options):
  acc = matmul_f32(x, w)
  return (acc if o.alpha == 1.0 else o.alpha * acc).astype(o.out_dtype)


def dot_plan(x_spec, w_spec, x_ndim: int, w_ndim: int) -> Plan:
  """Shardings under which the plain dot is local up to a psum (fallback="dot").

  Batch and rows keep x's sharding; the contraction keeps the axes x and w share (the common
  prefix of their K entries: partial sums, psum'd); w's columns keep theirs unless an axis is
  taken already.  The rest is replicated, so XLA gathers only what the dot really needs: for
  the backward of RotatingA, dw = xT @ g gathers x over "tp" and psums over "data".
  """
  xe, we = spec_entries(x_spec, x_ndim, "x"), spec_entries(w_spec, w_ndim, "w")
  nb = x_ndim - 2
  batch = xe[:nb]
  k = tuple(itertools.takewhile(lambda ab: ab[0] == ab[1], zip(xe[-1], we[-2])))
  k = tuple(a for a, _ in k)
  used = {a for e in batch + [xe[-2], k] for a in e}
  cols = we[-1] if not used & set(we[-1]) else ()
  x_out = to_spec(batch + [xe[-2], k])
  w_out = to_spec((batch if w_ndim > 2 else []) + [k, cols])
  return Plan(None, x_out, w_out, to_spec(batch + [xe[-2], cols]), psum_axes=k)


def dot_body(p: Plan, o: Options):
  def body(x, w, *unused_like):
    if not p.psum_axes:
      return dot(x, w, o)
    return jax.lax.psum(dot(x, w, dataclasses.replace(o, out_dtype=jnp.float32)),
                        p.psum_axes).astype(o.out_dtype)
  return body


def without_size_one(spec, mesh, ndim: int, what: str) -> P:
  """`spec` without the mesh axes of size 1.  NOTE: Shardy drops them from the shardings it
  propagates, so there the operands' specs never name them, while a requested spec may."""
  entries = spec_entries(spec, ndim, what)
  return to_spec([tuple(a for a in e if mesh.shape.get(a) != 1) for e in entries])

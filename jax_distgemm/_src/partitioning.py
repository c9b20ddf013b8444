"""jit-level entry point: the schedule is picked from the operands' and the output's shardings.

`collective_matmul(x, w, out_sharding=...)` takes GLOBAL arrays.  Only the mesh axis `axis`
("tp") is ours; every other mesh axis passes through untouched (a batch dim sharded over "data"
stays so).  Global shapes x [..., M, K], w [K, N] or [..., K, N], out [..., M, N]; "tp" marks
the dim sharded over the TP axis (the minor axis of that dim's entry, if it has several):

  x        w        out (requested)   schedule                            per shard
  M: tp    N: tp    N: tp (default)   AllGather1D_TilingCD_RotatingA      AG_rows(x) @ w
  M: tp    N: tp    M: tp             AllGather1D_TilingCD_RotatingB      x @ AG_cols(w)
  K: tp    K: tp    M: tp (default)   ReduceScatter1D_TilingA_RotatingC   RS_rows(x @ w)
  K: tp    K: tp    N: tp             ReduceScatter1D_TilingB_RotatingC   RS_cols(x @ w)
  anything else                       fallback="error": ValueError saying why;
                                      fallback="dot": the plain XLA dot (XLA's collectives)

Other mesh axes: the batch dims of out take x's (a batched w must be sharded like x there);
M and N keep the other axes of x's rows and w's columns; the contraction may carry other axes
when x and w agree, and those partial sums are then psum'd (an XLA all-reduce); axes only w's
K carries (an FSDP weight) are gathered by XLA first.

How the shardings are known:
  * concrete arrays: their NamedShardings; inside jax.jit with Explicit mesh axes: the traced
    shardings (jax.typeof(x).sharding); or `in_specs=(x_spec, w_spec)` given by the caller.
    The op is then a jax.shard_map over the whole mesh: differentiable (autodiff.py).
  * otherwise (inside jax.jit with Auto mesh axes, where tracers carry no sharding): a
    `custom_partitioning` op with a Shardy sharding_rule; the rule table above runs at compile
    time, in the partition callback, on the shardings Shardy propagated.  Give the output a
    sharding (out_sharding= or jax.lax.with_sharding_constraint on the result): the rule keeps
    the output's M and N factors apart from x's and w's, so Shardy does not pick it for us.
    custom_partitioning has no JVP, so this path has a jit-level custom_vjp: dx = g @ wT and
    dw = xT @ g are two more partitioned ops, each asked for its primal's sharding, so the
    partitioner emits the dual fused op where the table allows (and the plain dot, gathering
    only what it needs, elsewhere).  With a batch dim on x and a 2-D w, dw sums over the batch
    too: a separate op folds it into the contraction per shard (a global fold of [B, M] could
    not carry the (data, tp) sharding).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src import mesh as mesh_lib
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_distgemm._src import api, autodiff, config, primitives, validation
from jax_distgemm._src.reference import matmul_f32
from jax_distgemm._src.schedules import Schedule

FALLBACKS = ("error", "dot")

AG_A, AG_B, RS_A, RS_B = tuple(Schedule)


# -- The rule table -------------------------------------------------------------------------------

def _entries(spec, ndim: int, what: str) -> list[tuple[str, ...]]:
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


def _spec(entries) -> P:
  return P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


def _trim(spec: P) -> P:
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
  xe = _entries(x_spec, x_ndim, "x")
  we = _entries(w_spec, w_ndim, "w")
  oe = None if out_spec is None else _entries(out_spec, x_ndim, "out_sharding")
  nb = x_ndim - 2

  def no(reason):
    return Plan(None, _spec(xe), _spec(we), None if oe is None else _spec(oe), (), reason)

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

  shown = f"x {_spec(xe)}, w {_spec(we)}"
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
              f"out_sharding {_spec(oe)} has it " + (f"on {to}" if to else "nowhere"))
  schedule, out = candidates[to]
  used = [a for e in out for a in e]
  if len(used) != len(set(used)):
    return no(f"{shown}: the output of {schedule.name} would be sharded as {out}, which uses "
              "a mesh axis twice")
  if oe is not None and not out_is_hint and _trim(_spec(oe)) != _trim(_spec(out)):
    return no(f"{shown}: out_sharding {_spec(oe)} asks for {schedule.name} but that gives "
              f"{_spec(out)} (mesh axes other than {axis!r} pass through from x and w)")
  return Plan(schedule, _spec(xe), _spec(w_laid), _spec(out), psum_axes)


# -- Per-shard bodies ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Options:
  axis: str
  alpha: float
  out_dtype: jnp.dtype
  implementation: str | None
  timeout_ms: int | None


def _fused_body(p: Plan, o: _Options):
  """The per-shard function of a plan with a schedule (the shard_map / partition body)."""

  def body(x, w):
    dtype = jnp.float32 if p.psum_axes else o.out_dtype  # sum partials in fp32
    out = api.distributed_matmul(x, w, axis_name=o.axis, schedule=p.schedule, alpha=o.alpha,
                                 out_dtype=dtype, implementation=o.implementation,
                                 timeout_ms=o.timeout_ms)
    if p.psum_axes:
      out = jax.lax.psum(out, p.psum_axes).astype(o.out_dtype)
    return out
  return body


def _dot(x, w, o: _Options):
  acc = matmul_f32(x, w)
  return (acc if o.alpha == 1.0 else o.alpha * acc).astype(o.out_dtype)


def _plain_dot(x, w, o: _Options, out_sharding):
  """fallback="dot" (Auto axes): XLA's partitioner inserts whatever collectives it needs."""
  out = _dot(x, w, o)
  return out if out_sharding is None else jax.lax.with_sharding_constraint(out, out_sharding)


def reshard(a, spec: P, mesh):
  """`a` laid out as `spec` over `mesh` (Explicit axes).  NOTE: a NamedSharding, not the bare
  spec, so that no jax.set_mesh is needed (JAX refuses a PartitionSpec outside one)."""
  return jax.sharding.reshard(a, NamedSharding(mesh, spec))


def all_explicit(mesh) -> bool:
  """Every axis of `mesh` Explicit (reshard refuses specs naming Auto or Manual axes)."""
  types = getattr(mesh, "axis_types", ())
  return bool(types) and all(t == jax.sharding.AxisType.Explicit for t in types)


def _explicit_dot(x, w, o: _Options, out_spec, mesh):
  """fallback="dot" (Explicit axes): reshard to the dot plan, local dot + psum, then out."""
  d = _dot_plan(jax.typeof(x).sharding.spec, jax.typeof(w).sharding.spec, x.ndim, w.ndim)
  x, w = reshard(x, d.x_spec, mesh), reshard(w, d.w_spec, mesh)
  out = jax.shard_map(_dot_body(d, o), mesh=mesh, in_specs=(d.x_spec, d.w_spec),
                      out_specs=d.out_spec)(x, w)
  return out if out_spec is None else reshard(out, out_spec, mesh)


def _is_explicit(a, axis: str) -> bool:
  mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
  if mesh is None or axis not in getattr(mesh, "axis_names", ()):
    return False
  return dict(zip(mesh.axis_names, mesh.axis_types))[axis] == jax.sharding.AxisType.Explicit


# -- Reading shardings -----------------------------------------------------------------------------

def _known_spec(a, axis):
  """(spec, mesh) of `a` if its sharding is known at trace time, else None."""
  # NOTE: an eager jax.grad / jvp wraps concrete arrays in autodiff tracers; their primal's
  # sharding is known, so that case takes the shard_map path like the eager call without
  # autodiff.
  a = validation.strip_autodiff(a)
  if not isinstance(a, core.Tracer):
    s = getattr(a, "sharding", None)
    if isinstance(s, NamedSharding):
      return s.spec, s.mesh
    return P(), None  # a numpy array or a single-device array: not sharded
  if not _is_explicit(a, axis):
    return None  # Auto axes: the tracer does not know its sharding
  s = jax.typeof(a).sharding
  return s.spec, s.mesh


def _context_mesh():
  mesh = mesh_lib.get_concrete_mesh()
  if mesh is not None and not getattr(mesh, "empty", True):
    return mesh
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty:
    return mesh
  return None


def _resolve_mesh(*meshes):
  """The first of `meshes` that is not None, or a concrete mesh of the same axes after it.

  NOTE: under jax.jit the operands of Explicit axes carry an AbstractMesh (names and sizes, no
  devices), while out_sharding's mesh, or jax.set_mesh's, may be concrete; the fused call
  needs the TP group's devices (primitives._concrete_mesh), so a concrete one is preferred.
  """
  found = [m for m in meshes if m is not None]
  if not found or not isinstance(found[0], jax.sharding.AbstractMesh):
    return found[0] if found else None
  axes = lambda m: (tuple(m.axis_names), tuple(m.axis_sizes))
  return next((m for m in found[1:] if not isinstance(m, jax.sharding.AbstractMesh)
               and axes(m) == axes(found[0])), found[0])


def _without_devices(o: _Options) -> _Options:
  """The options of a call whose mesh is abstract (jax.jit on Explicit axes, no concrete mesh
  anywhere): the fused call cannot name its TP group there, so 'ffi' is refused and None runs
  the XLA ring, each saying how to give the mesh."""
  how = "pass mesh=, an out_sharding NamedSharding, or call under jax.set_mesh(mesh)"
  chosen = o.implementation or config.forced_implementation()
  if chosen == "ffi":
    raise ValueError(
        "jax_distgemm.collective_matmul: implementation='ffi' under jax.jit on operands whose "
        "mesh is abstract (Explicit axes carry no devices there), and the fused call needs the "
        f"TP group's devices: {how}")
  if chosen is None:
    config.warn_once(("abstract mesh",),
                     "jax_distgemm.collective_matmul: implementation=None runs the XLA ring: "
                     "under jax.jit the operands' mesh is abstract (no devices), and the fused "
                     "call needs the TP group's devices (%s)", how)
    return dataclasses.replace(o, implementation="xla")
  return o


def _out_spec_of(out_sharding):
  if out_sharding is None:
    return None, None
  if isinstance(out_sharding, NamedSharding):
    return out_sharding.spec, out_sharding.mesh
  if isinstance(out_sharding, P):
    return out_sharding, None
  raise TypeError(
      f"out_sharding: expected a NamedSharding, a PartitionSpec or None, got "
      f"{type(out_sharding).__name__}")


def _check_out_mesh(out_mesh, mesh):
  """out_sharding's mesh, if it has one, must be the one the op runs on (no silent move)."""
  if out_mesh is None or mesh is None:
    return

  def layout(m):  # an AbstractMesh (Explicit axes under jit) has names but no devices
    abstract = isinstance(m, jax.sharding.AbstractMesh)
    return tuple(m.axis_names), None if abstract else m.device_ids.tolist()

  (names, devs), (want_names, want_devs) = layout(mesh), layout(out_mesh)
  if names != want_names or None not in (devs, want_devs) and devs != want_devs:
    raise ValueError(
        f"out_sharding: its mesh (axes {want_names}, devices {want_devs}) is not the mesh the "
        f"op runs on (axes {names}, devices {devs}); give a PartitionSpec or a NamedSharding "
        "on that mesh, and move the result with jax.device_put")


# -- Public entry point ----------------------------------------------------------------------------

def collective_matmul(x, w, *, mesh=None, axis: str = "tp", out_sharding=None,
                      fallback: str = "error", in_specs: Sequence | None = None,
                      alpha: float = 1.0, out_dtype=None, implementation: str | None = None,
                      timeout_ms: int | None = None):
  """out = alpha * x @ w on globally sharded arrays, as the fused collective matmul the
  shardings call for (the rule table in the module docstring).

  Args:
    x: [..., M, K], sharded over the mesh.
    w: [K, N] or [..., K, N] (batch dims like x).
    mesh: the mesh; default the operands' (or out_sharding's, or the context mesh of
      jax.set_mesh).
    axis: the tensor-parallel mesh axis (the only one the op communicates over).
    out_sharding: NamedSharding or PartitionSpec wanted for out; None: the default of the
      table (N sharded after an AllGather, M after a ReduceScatter).
    fallback: "error" (a ValueError saying which rule failed) or "dot" (the plain XLA dot,
      with whatever collectives XLA inserts) when no schedule fits.
    in_specs: (x_spec, w_spec) PartitionSpecs, for operands whose sharding is not known at
      trace time (inside jax.jit with Auto mesh axes); shard_map reshards operands to them.
    alpha: static scalar multiplying x @ w.
    out_dtype: output dtype (default x.dtype).
    implementation: "ffi", "xla", "reference" or None (see distributed_matmul).
    timeout_ms: bound on every wait for a peer (FFI path).

  Returns:
    out [..., M, N], sharded as the plan says (out_sharding when given).

  NOTE: inside jax.jit with Auto mesh axes the shardings are known only to the partitioner,
  whose callback (custom_partitioning) picks the schedule: a rule violation then fails the
  compile with a JaxRuntimeError whose text holds this function's ValueError, and without
  out_sharding the result's sharding is left to XLA's propagation, which may gather it
  (pass out_sharding, or constrain the result).
  """
  if fallback not in FALLBACKS:
    raise ValueError(f"fallback: expected one of {FALLBACKS}, got {fallback!r}")
  if not isinstance(axis, str):
    raise TypeError(f"axis: expected one mesh axis name (a str), got {axis!r}")
  x_ndim, w_ndim = jnp.ndim(x), jnp.ndim(w)
  if x_ndim < 2 or w_ndim < 2:
    raise ValueError(f"x, w: need rank >= 2, got shapes {jnp.shape(x)} and {jnp.shape(w)}")
  # The fused path's rules on scalars and dtypes hold for fallback="dot" too (no int8 dot
  # saturating in its own dtype, no NaN alpha).
  validation.check_scalars(alpha=alpha)
  validation.check_dtypes(x, w)
  o = _Options(axis=axis, alpha=float(alpha),
               out_dtype=validation.resolve_out_dtype(out_dtype, x.dtype),
               implementation=implementation, timeout_ms=timeout_ms)
  out_spec, out_mesh = _out_spec_of(out_sharding)

  for a in (x, w):
    m = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    types = set(getattr(m, "axis_types", ())) - {jax.sharding.AxisType.Manual}
    if isinstance(a, core.Tracer) and len(types) > 1 and in_specs is None:
      # NOTE: a traced spec names only its Explicit axes; the Auto ones' sharding is known to
      # the partitioner alone, so neither mechanism sees the whole layout.
      raise ValueError(
          f"jax_distgemm.collective_matmul: under jax.jit the mesh mixes Explicit and Auto "
          f"axes {dict(zip(m.axis_names, (t.name for t in m.axis_types)))}; use a mesh whose "
          "axes are all Explicit or all Auto, or pass in_specs=")
  if in_specs is not None:
    if (not isinstance(in_specs, (tuple, list)) or len(in_specs) != 2 or
        not all(isinstance(s, P) for s in in_specs)):
      raise ValueError(f"in_specs: expected (x_spec, w_spec), two PartitionSpecs, got "
                       f"{in_specs!r}")
    x_spec, w_spec = in_specs
    known = (x_spec, None), (w_spec, None)
  else:
    known = _known_spec(x, axis), _known_spec(w, axis)
  if known[0] is None or known[1] is None:
    if manual := validation.manual_axes():
      # NOTE: custom_partitioning inside a shard_map's manual region sees GSPMD shardings
      # with no spec: its partition callback could not apply the table there.
      raise ValueError(
          f"jax_distgemm.collective_matmul: called inside jax.shard_map (manual over "
          f"{manual}) on operands whose sharding is not known at trace time (Auto "
          f"axes); there use the per-shard ops (all_gather_matmul / matmul_reduce_scatter / "
          f"distributed_matmul with axis_name={o.axis!r}), or call collective_matmul outside "
          "the shard_map")
    _check_out_mesh(out_mesh, mesh)
    return _auto(x, w, out_spec, out_sharding, fallback, o, mesh or out_mesh)

  (x_spec, x_mesh), (w_spec, w_mesh) = known
  mesh = _resolve_mesh(mesh, x_mesh, w_mesh, out_mesh, _context_mesh())
  if mesh is None:
    why = ("in_specs= names mesh axes but not the mesh" if in_specs is not None else
           "the operands are not sharded with a NamedSharding")
    raise ValueError(f"mesh: not given and none could be found ({why}, out_sharding has no "
                     "mesh and none is set with jax.set_mesh); pass mesh= or call under "
                     "jax.set_mesh(mesh)")
  if axis not in mesh.axis_names:
    raise ValueError(f"axis: {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
  _check_out_mesh(out_mesh, mesh)
  # Axes of size 1 shard nothing: a spec naming one is the same layout as one that does not.
  x_spec, w_spec = (_without_size_one(x_spec, mesh, x_ndim, "x"),
                    _without_size_one(w_spec, mesh, w_ndim, "w"))
  if out_spec is not None:
    out_spec = _without_size_one(out_spec, mesh, x_ndim, "out_sharding")
  p = plan(x_spec, w_spec, out_spec, x_ndim=x_ndim, w_ndim=w_ndim, axis=axis)
  if p.schedule is None:
    if fallback == "error":
      raise ValueError(f"jax_distgemm.collective_matmul: {p.reason} (pass fallback='dot' to "
                       "use the plain XLA dot instead)")
    return _explicit_dot(x, w, o, out_spec, mesh) if _is_explicit(x, axis) else _plain_dot(
        x, w, o, None if out_spec is None else NamedSharding(mesh, out_spec))
  if isinstance(mesh, jax.sharding.AbstractMesh):
    o = _without_devices(o)
  if all_explicit(mesh):
    # shard_map refuses Explicit operands laid out otherwise than its in_specs (in_specs=
    # given, or a plan that moves an axis); a no-op when they match.
    x, w = reshard(x, p.x_spec, mesh), reshard(w, p.w_spec, mesh)
  return _shard_mapped(p, o, mesh)(x, w)


@functools.lru_cache(maxsize=256)
def _shard_mapped(p: Plan, o: _Options, mesh):
  # Under jax.jit even when called eagerly: an eager shard_map compiles each primitive on its
  # own, and that compile of the FFI primitive crashes XLA:CPU (jax 0.11.2).
  return jax.jit(jax.shard_map(_fused_body(p, o), mesh=mesh, in_specs=(p.x_spec, p.w_spec),
                               out_specs=p.out_spec))


# -- Automatic partitioning (custom_partitioning + Shardy) ----------------------------------------

# Separate factors for out's M, N (m n) and x's / w's (i j): Shardy must not propagate x's row
# sharding to out's rows (RotatingA gathers it) nor w's columns to out's (RotatingB does); the
# contraction k and the batch dims (...) are shared.  The backward's ops take a third operand,
# `like` (the primal; unused by the math), whose sharding is the one wanted for the result: it
# shares the result's factors (m n), so that Shardy gives each gradient its primal's layout
# (with factors of its own, jit(grad) without out_shardings all-gathered dx and dw).
SHARDING_RULES = {
    (False, False): "... i k, k j -> ... m n",
    (True, False): "... i k, ... k j -> ... m n",
    (False, True): "... i k, k j, ... m n -> ... m n",
    (True, True): "... i k, ... k j, ... m n -> ... m n",
}

_call_sites = itertools.count(1)  # distinct rendezvous keys per partitioned op (primitives.py)


@dataclasses.dataclass(frozen=True)
class _AutoConfig:
  options: _Options
  out_spec: P | None  # requested by the caller (None: the result sharding Shardy gives)
  fallback: str
  w_batched: bool
  with_like: bool = False  # out_spec is that of a third operand (the backward's ops)
  fold_rank: int = 0  # > 0: the weight-gradient op sum_{batch, m} x[.., m, :]T g[.., m, :]


def _dot_plan(x_spec, w_spec, x_ndim: int, w_ndim: int) -> Plan:
  """Shardings under which the plain dot is local up to a psum (fallback="dot").

  Batch and rows keep x's sharding; the contraction keeps the axes x and w share (the common
  prefix of their K entries: partial sums, psum'd); w's columns keep theirs unless an axis is
  taken already.  The rest is replicated, so XLA gathers only what the dot really needs: for
  the backward of RotatingA, dw = xT @ g gathers x over "tp" and psums over "data".
  """
  xe, we = _entries(x_spec, x_ndim, "x"), _entries(w_spec, w_ndim, "w")
  nb = x_ndim - 2
  batch = xe[:nb]
  k = tuple(itertools.takewhile(lambda ab: ab[0] == ab[1], zip(xe[-1], we[-2])))
  k = tuple(a for a, _ in k)
  used = {a for e in batch + [xe[-2], k] for a in e}
  cols = we[-1] if not used & set(we[-1]) else ()
  x_out = _spec(batch + [xe[-2], k])
  w_out = _spec((batch if w_ndim > 2 else []) + [k, cols])
  return Plan(None, x_out, w_out, _spec(batch + [xe[-2], cols]), psum_axes=k)


def _dot_body(p: Plan, o: _Options):
  def body(x, w, *unused_like):
    if not p.psum_axes:
      return _dot(x, w, o)
    return jax.lax.psum(_dot(x, w, dataclasses.replace(o, out_dtype=jnp.float32)),
                        p.psum_axes).astype(o.out_dtype)
  return body


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
  xe, ge = _entries(xs.sharding.spec, nd, "x"), _entries(gs.sharding.spec, nd, "g")
  named = lambda s: NamedSharding(mesh, s)
  p = None
  if xe[:-1] == ge[:-1]:
    axes = [a for e in xe[:-1] for a in e]
    contraction = tuple(a for a in axes if a != o.axis) + ((o.axis,) if o.axis in axes else ())
    p = plan(_spec([xe[-1], contraction]), _spec([contraction, ge[-1]]), like.sharding.spec,
             x_ndim=2, w_ndim=2, axis=o.axis)
  if p is not None and p.schedule is not None:
    body = _fused_body(p, o)
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
  d = Plan(None, _spec(common + [k]), _spec(common + [n]), _spec([k, n]), psum_axes=summed)
  dot = _dot_body(d, o)

  def dot_fn(x, g, unused_like):
    kk, nn = x.shape[-1], g.shape[-1]
    return dot(jnp.moveaxis(x.reshape(-1, kk), -1, 0), g.reshape(-1, nn))
  return mesh, dot_fn, named(d.out_spec), (named(d.x_spec), named(d.w_spec), like.sharding)


def _without_size_one(spec, mesh, ndim: int, what: str) -> P:
  """`spec` without the mesh axes of size 1.  NOTE: Shardy drops them from the shardings it
  propagates, so there the operands' specs never name them, while a requested spec may."""
  entries = _entries(spec, ndim, what)
  return _spec([tuple(a for a in e if mesh.shape.get(a) != 1) for e in entries])


def _partition(cfg: _AutoConfig, mesh, arg_shapes, result_shape):
  if cfg.fold_rank:
    return _fold_partition(cfg, mesh, arg_shapes, result_shape)
  o = cfg.options
  xs, ws = arg_shapes[:2]
  x_spec, w_spec = xs.sharding.spec, ws.sharding.spec
  nd = len(result_shape.shape)
  out_spec, hint = cfg.out_spec, False
  if cfg.with_like:
    out_spec = arg_shapes[2].sharding.spec
  elif out_spec is None:
    # What Shardy propagated back from the result's users: only a hint where "tp" goes (M or
    # N); XLA reshards the rest, as it would for a plain dot.
    result = result_shape.sharding.spec
    if any(o.axis in e for e in _entries(result, nd, "out")):
      out_spec, hint = result, True  # else unconstrained (replicated): the table's default
  if out_spec is not None:
    out_spec = _without_size_one(out_spec, mesh, nd, "out_sharding")
  named = lambda s: NamedSharding(mesh, s)
  like = (arg_shapes[2].sharding,) if cfg.with_like else ()

  def dot():  # the plain dot, with XLA's collectives
    d = _dot_plan(x_spec, w_spec, len(xs.shape), len(ws.shape))
    return (mesh, _dot_body(d, o), named(d.out_spec), (named(d.x_spec), named(d.w_spec)) + like)

  if o.axis not in mesh.shape:
    if cfg.fallback == "dot":
      return dot()
    raise ValueError(f"jax_distgemm.collective_matmul: axis {o.axis!r} is not an axis of the "
                     f"mesh {tuple(mesh.axis_names)}")
  if mesh.shape[o.axis] == 1:  # TP = 1 (Shardy dropped "tp" too): nothing to fuse
    return dot()
  p = plan(x_spec, w_spec, out_spec, x_ndim=len(xs.shape), w_ndim=len(ws.shape), axis=o.axis,
           out_is_hint=hint)
  if p.schedule is not None:
    body = _fused_body(p, o)
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
    return _dot(x, w, cfg.options)  # the global meaning (also the unpartitioned lowering)

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
  the partitioner emits the fused op, elsewhere the plain dot (XLA's collectives)."""
  x, w = res
  # fp16 x with an fp32 out: a global power-of-two scale keeps g within fp16 (autodiff.py;
  # a global array's max needs no collective of ours).
  g, sc = autodiff.scale_cotangent(g, x.dtype)
  t = lambda a: jnp.swapaxes(a, -1, -2)

  def op(a, b, like, dtype):
    c = dataclasses.replace(cfg, options=dataclasses.replace(cfg.options, out_dtype=dtype),
                            out_spec=None, fallback="dot", w_batched=b.ndim > 2,
                            with_like=True)
    return _auto_matmul_like(a, b, like, c)

  dx = op(g, t(w), x, x.dtype)
  if w.ndim > 2 or x.ndim == 2:
    dw = op(t(x), g, w, w.dtype)
  else:  # sum over the batch dims too, folded per shard (a global fold could not be sharded)
    c = dataclasses.replace(cfg, options=dataclasses.replace(cfg.options, out_dtype=w.dtype),
                            out_spec=None, fallback="dot", w_batched=False, with_like=True,
                            fold_rank=x.ndim)
    dw = _auto_weight_grad(x, g, w, c)
  return autodiff.unscale(dx, sc), autodiff.unscale(dw, sc)


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


def _auto(x, w, out_spec, out_sharding, fallback: str, o: _Options, mesh):
  """The custom_partitioning path: the rule table runs in the partition callback."""
  if jnp.ndim(w) > 2 and jnp.shape(w)[:-2] != jnp.shape(x)[:-2]:
    raise ValueError(f"w: batch dims {jnp.shape(w)[:-2]} must equal those of x "
                     f"{jnp.shape(x)[:-2]}")
  cfg = _AutoConfig(options=o, out_spec=None if out_spec is None else _trim(out_spec),
                    fallback=fallback, w_batched=jnp.ndim(w) > 2)
  out = _auto_matmul(x, w, cfg)
  if out_sharding is not None:
    if isinstance(out_sharding, P):
      mesh = mesh or _context_mesh()
      if mesh is None:
        raise ValueError("out_sharding: a PartitionSpec needs mesh= (or jax.set_mesh)")
      out_sharding = NamedSharding(mesh, out_sharding)
    out = jax.lax.with_sharding_constraint(out, out_sharding)
  return out

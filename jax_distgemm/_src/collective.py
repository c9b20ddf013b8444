"""`collective_matmul`: the jit-level entry point, picking the schedule from the shardings.

It takes GLOBAL arrays; sharding_rules.py holds the table.  Where the shardings are known at
trace time it runs one jax.shard_map (shard_map_path.py); inside jax.jit with Auto mesh axes,
a custom_partitioning op whose partition callback applies the table (auto_partitioning.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax._src import core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_distgemm._src import auto_partitioning, config, shard_map_path, validation
from jax_distgemm._src import fp8 as fp8_lib
from jax_distgemm._src import implementation as impl
from jax_distgemm._src import sharding_rules as rules

FALLBACKS = ("error", "dot")


def is_explicit(a, axis: str) -> bool:
  mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
  if mesh is None or axis not in getattr(mesh, "axis_names", ()):
    return False
  return dict(zip(mesh.axis_names, mesh.axis_types))[axis] == jax.sharding.AxisType.Explicit


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
  if not is_explicit(a, axis):
    return None  # Auto axes: the tracer does not know its sharding
  s = jax.typeof(a).sharding
  return s.spec, s.mesh


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


def _operand_mesh(a):
  """The mesh in `a`'s type (abstract under jax.jit, with Explicit or Auto axes), or None."""
  m = getattr(getattr(jax.typeof(validation.strip_autodiff(a)), "sharding", None), "mesh", None)
  return None if m is None or getattr(m, "empty", False) else m


class _ByIdentity:
  """A callable that hashes and compares by the function it wraps (the per-shard bodies are
  cached by their options, and a callable may have no hash: a dataclass with __call__)."""

  def __init__(self, fn: Callable):
    self.fn = fn

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)

  def __hash__(self):
    return id(self.fn)

  def __eq__(self, other):
    return isinstance(other, _ByIdentity) and other.fn is self.fn


def _checked_implementation(implementation):
  """`implementation` as Options holds it: a name, None, or a hashable per-shard callable."""
  if callable(implementation):
    try:
      hash(implementation)
    except TypeError:
      return _ByIdentity(implementation)
    return implementation
  if implementation is not None and not isinstance(implementation, str):
    raise TypeError(f"implementation: expected a name, None or a per-shard callable, got "
                    f"{implementation!r}")
  return impl.check_name(implementation)


def collective_matmul(x, w, *, mesh=None, axis: str = "tp", out_sharding=None,
                      fallback: str = "error", in_specs: Sequence | None = None,
                      alpha: float = 1.0, out_dtype=None,
                      implementation: str | None | Callable = None,
                      timeout_ms: int | None = None, fp8: str | None = None):
  """out = alpha * x @ w on globally sharded arrays, as the fused collective matmul the
  shardings call for (the rule table in sharding_rules.py).

  Args:
    x: [..., M, K], sharded over the mesh.
    w: [K, N] or [..., K, N] (batch dims like x).
    mesh: the mesh; default the operands' (or out_sharding's, or the context mesh of
      jax.set_mesh).  NOTE: under jax.jit, Explicit axes carry no devices: give mesh=, a
      NamedSharding out_sharding, or call under jax.set_mesh(mesh) for the fused call.
    axis: the tensor-parallel mesh axis (the only one the op communicates over).
    out_sharding: NamedSharding or PartitionSpec wanted for out; None: the default of the
      table (N sharded after an AllGather, M after a ReduceScatter).
    fallback: "error" (a ValueError saying which rule failed) or "dot" (the plain XLA dot,
      with whatever collectives XLA inserts) when no schedule fits.
    in_specs: (x_spec, w_spec) PartitionSpecs, for operands whose sharding is not known at
      trace time (inside jax.jit with Auto mesh axes); shard_map reshards operands to them.
    alpha: static scalar multiplying x @ w.
    out_dtype: output dtype (default x.dtype).
    implementation: "ffi", "xla", "reference" or None (implementation.py), or a per-shard
      callable fn(x, w, *, axis_name, schedule, out_dtype) run in place of the op (alpha 1).
    timeout_ms: bound on every wait for a peer (FFI path).
    fp8: "tensor" or "block": each shard of x and w is quantized to fp8 in the call and the
      schedule multiplies in fp8; gradients pass straight through (see distributed_matmul).
      fallback="dot" runs unquantized.

  Returns:
    out [..., M, N], sharded as the plan says (out_sharding when given).

  NOTE: inside jax.jit with Auto mesh axes the shardings are known only to the partitioner,
  whose callback (custom_partitioning) picks the schedule: a rule violation then fails the
  compile.  There XLA's propagation decides the result's sharding where nothing asks for one;
  a ReduceScatter result it would gather is reported by a warning (pass out_sharding).
  """
  if fallback not in FALLBACKS:
    raise ValueError(f"fallback: expected one of {FALLBACKS}, got {fallback!r}")
  if not isinstance(axis, str):
    raise TypeError(f"axis: expected one mesh axis name (a str), got {axis!r}")
  implementation = _checked_implementation(implementation)
  if callable(implementation) and alpha != 1.0:
    raise ValueError("alpha: a per-shard callable implementation takes no alpha (pass 1.0)")
  if fp8 is not None:
    fp8_lib.check_scaling(fp8, "fp8")
    if callable(implementation):
      raise ValueError("fp8: a per-shard callable implementation quantizes nothing; pass "
                       "implementation=None, 'reference' or 'xla'")
  if timeout_ms is not None:
    timeout_ms = config.check_timeout_ms(timeout_ms)
  x_ndim, w_ndim = jnp.ndim(x), jnp.ndim(w)
  if x_ndim < 2 or w_ndim < 2:
    raise ValueError(f"x, w: need rank >= 2, got shapes {jnp.shape(x)} and {jnp.shape(w)}")
  # The fused path's rules on scalars and dtypes hold for fallback="dot" too (no int8 dot
  # saturating in its own dtype, no NaN alpha).
  validation.check_scalars(alpha=alpha)
  validation.check_dtypes(x, w)
  o = rules.Options(axis=axis, alpha=float(alpha),
                    out_dtype=validation.resolve_out_dtype(out_dtype, x.dtype),
                    implementation=implementation, timeout_ms=timeout_ms, fp8=fp8)
  out_spec, out_mesh = _out_spec_of(out_sharding)
  # Every mesh known at trace time must have the axis: checked here, before either path.
  for where, m in (("mesh", mesh), ("out_sharding", out_mesh), ("x", _operand_mesh(x)),
                   ("w", _operand_mesh(w)), ("the context mesh", validation.context_mesh())):
    if m is not None and axis not in m.axis_names:
      raise ValueError(f"axis: {axis!r} is not an axis of the mesh of {where} "
                       f"{tuple(m.axis_names)}; pass axis= (the tensor-parallel mesh axis)")

  for a in (x, w):
    m = _operand_mesh(a)
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
    return auto_partitioning.collective_matmul(x, w, out_spec, out_sharding, fallback, o,
                                               mesh or out_mesh)

  (x_spec, x_mesh), (w_spec, w_mesh) = known
  mesh = _resolve_mesh(mesh, x_mesh, w_mesh, out_mesh, validation.context_mesh())
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
  x_spec, w_spec = (rules.without_size_one(x_spec, mesh, x_ndim, "x"),
                    rules.without_size_one(w_spec, mesh, w_ndim, "w"))
  if out_spec is not None:
    out_spec = rules.without_size_one(out_spec, mesh, x_ndim, "out_sharding")
  p = rules.plan(x_spec, w_spec, out_spec, x_ndim=x_ndim, w_ndim=w_ndim, axis=axis)
  if p.schedule is None:
    if fallback == "error":
      raise ValueError(f"jax_distgemm.collective_matmul: {p.reason} (pass fallback='dot' to "
                       "use the plain XLA dot instead)")
    if is_explicit(x, axis):
      return shard_map_path.explicit_dot(x, w, o, out_spec, mesh)
    return shard_map_path.plain_dot(
        x, w, o, None if out_spec is None else NamedSharding(mesh, out_spec))
  if isinstance(mesh, jax.sharding.AbstractMesh) and not callable(o.implementation):
    o = dataclasses.replace(o, implementation=impl.choose_without_devices(o.implementation))
  if shard_map_path.all_explicit(mesh):
    # shard_map refuses Explicit operands laid out otherwise than its in_specs (in_specs=
    # given, or a plan that moves an axis); a no-op when they match.
    x = shard_map_path.reshard(x, p.x_spec, mesh)
    w = shard_map_path.reshard(w, p.w_spec, mesh)
  return shard_map_path.shard_mapped(p, o, mesh)(x, w)

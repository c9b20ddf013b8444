"""Input checks run at trace time, before anything is launched.

Every message names the argument and the rule it breaks.  The C++ handlers re-check the shape
rules (cc/common/problem.cc) as a last line of defence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import mesh as mesh_lib

from jax_distgemm._src import fp8
from jax_distgemm._src.schedules import Schedule, output_shape

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def normalize_axis_name(axis_name) -> tuple[str, ...]:
  if isinstance(axis_name, str):
    return (axis_name,)
  if isinstance(axis_name, (tuple, list)) and axis_name and all(
      isinstance(a, str) for a in axis_name):
    repeated = sorted({a for a in axis_name if list(axis_name).count(a) > 1})
    if repeated:
      raise ValueError(f"axis_name: {tuple(axis_name)!r} names {', '.join(map(repr, repeated))} "
                       "more than once; name each mesh axis once")
    return tuple(axis_name)
  raise TypeError(
      f"axis_name: expected a mesh axis name or a tuple of them, got {axis_name!r}")


def axis_size(axis_name: tuple[str, ...]) -> int:
  """Size of the (possibly multi-axis) TP axis; a clear error when it is not bound."""
  try:
    return int(jax.lax.axis_size(axis_name if len(axis_name) > 1 else axis_name[0]))
  except NameError:
    raise ValueError(
        f"axis_name: {axis_name if len(axis_name) > 1 else axis_name[0]!r} is not bound; "
        "call this inside jax.shard_map over a mesh that has that axis") from None


def manual_axes() -> tuple[str, ...]:
  """The axes the enclosing shard_map maps manually (those of the current abstract mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
               if t == jax.sharding.AxisType.Manual)


def context_mesh():
  """jax.set_mesh's mesh (concrete if there is one, else abstract), or None."""
  mesh = mesh_lib.get_concrete_mesh()
  if mesh is not None and not getattr(mesh, "empty", True):
    return mesh
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty:
    return mesh
  return None


def strip_autodiff(a):
  """`a` below any autodiff tracers (jax's JVP and Linearize tracers keep it as `primal`)."""
  while isinstance(a, jax.core.Tracer) and hasattr(a, "primal"):
    a = a.primal
  return a


def vmap_bound_axes(axis_name: tuple[str, ...], *operands) -> tuple[str, ...]:
  """The names of axis_name that a jax.vmap(axis_name=...) around the call binds, not a
  shard_map's mesh (the FFI call runs between the devices of a mesh; under vmap the "group"
  is a batch dim of one array).

  NOTE: read off the operands' batching traces (jax's BatchTracer keeps its vmap's name in
  `_trace.axis_data.name`; private, hence getattr); a mesh axis that is Manual in the
  current abstract mesh is the shard_map's even when a vmap reuses the name.
  """
  manual = set(manual_axes())
  names = set()
  for a in operands:
    a = strip_autodiff(a)  # jax.vmap(jax.grad(...)): the vmap's tracer is under the JVP's
    while isinstance(a, jax.core.Tracer) and hasattr(a, "batch_dim"):  # nested vmaps
      name = getattr(getattr(getattr(a, "_trace", None), "axis_data", None), "name", None)
      if name is not None:
        names.add(name)
      a = strip_autodiff(getattr(a, "val", None))
  return tuple(n for n in axis_name if n in names and n not in manual)


def explicit_free_axes(*operands) -> tuple[str, ...]:
  """Explicit mesh axes that shard an operand inside a shard_map that leaves them free (a
  partial shard_map, axis_names=...).  The ops compute per manual shard; along such an axis
  neither the ring's buffers nor the custom call's results carry the operands' sharding, which
  JAX's sharding-in-types then refuses (forward or backward)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  found = []
  for a in operands:
    s = getattr(jax.typeof(a), "sharding", None) if a is not None else None
    for entry in getattr(s, "spec", None) or ():
      for name in (entry if isinstance(entry, tuple) else (entry,)):
        if types.get(name) == jax.sharding.AxisType.Explicit and name not in found:
          found.append(name)
  return tuple(found)


def _dtype_name(d) -> str:
  return jnp.dtype(d).name


def _shape(a) -> tuple[int, ...]:
  return tuple(np.shape(a))


def check_scalars(**scalars) -> None:
  """alpha / beta: static, finite as a float32 (the kernels' epilogue scalars)."""
  for name, v in scalars.items():
    if isinstance(v, jax.core.Tracer) or not isinstance(v, (int, float, np.floating,
                                                            np.integer)):
      raise TypeError(f"{name}: must be a static Python float (or int, or NumPy scalar), got "
                      f"{type(v).__name__}")
    try:
      finite = abs(float(v)) <= float(np.finfo(np.float32).max)  # False for nan too
    except OverflowError:  # an int beyond a float64
      finite = False
    if not finite:
      raise ValueError(f"{name}: must be finite as a float32 (the kernels' epilogue scalar), "
                       f"got {v!r}")


def resolve_out_dtype(out_dtype, x_dtype) -> np.dtype:
  """out_dtype (None: x's) as a supported dtype, or a TypeError naming it."""
  if out_dtype is None:
    return jnp.dtype(x_dtype)
  try:
    d = jnp.dtype(out_dtype)
  except TypeError:  # not a dtype: "nonsense", and 0 or False (once taken for x's dtype)
    d = None
  if d is None or d not in SUPPORTED_DTYPES:
    shown = repr(out_dtype) if d is None else d.name
    raise TypeError(f"out_dtype: {shown} is not supported; use bfloat16, float16 or float32 "
                    "(or None for x's dtype)")
  return d


def check_dtypes(x, w) -> None:
  xd, wd = jnp.dtype(x.dtype), jnp.dtype(w.dtype)
  if xd in fp8.FP8_DTYPES or wd in fp8.FP8_DTYPES:
    return  # fp8.check_scales: both fp8, with their scales
  if xd not in SUPPORTED_DTYPES:
    raise TypeError(
        f"x: dtype {xd.name} is not supported; use bfloat16, float16 or float32")
  if wd != xd:
    raise TypeError(f"x, w: dtypes must match, got {xd.name} and {wd.name}")


def check_call(x, w, c, *, schedule: Schedule, axis_name: tuple[str, ...], alpha,
               beta) -> int:
  """Validates one call (out_dtype: resolve_out_dtype); returns TP."""
  tp = axis_size(axis_name)
  check_scalars(alpha=alpha, beta=beta)
  xs, ws = _shape(x), _shape(w)
  if len(xs) < 2:
    raise ValueError(f"x: must have rank >= 2 ([..., rows, contraction]), got shape {xs}")
  if len(ws) != 2 and len(ws) != len(xs):
    raise ValueError(
        f"w: must have rank 2 ([contraction, columns]) or the rank of x ({len(xs)}), got "
        f"shape {ws}")
  if len(ws) > 2 and ws[:-2] != xs[:-2]:
    raise ValueError(f"w: batch dims {ws[:-2]} must equal those of x {xs[:-2]}")
  check_dtypes(x, w)
  if xs[-1] != ws[-2]:
    raise ValueError(
        f"x, w: contraction dims must match: x has K={xs[-1]} (shape {xs}) but w has "
        f"K={ws[-2]} (shape {ws})")
  if schedule == Schedule.ReduceScatter1D_TilingA_RotatingC and xs[-2] % tp:
    raise ValueError(
        f"x: rows M={xs[-2]} must be divisible by the TP size {tp} for "
        f"{schedule.name} (the output is scattered over rows)")
  if schedule == Schedule.ReduceScatter1D_TilingB_RotatingC and ws[-1] % tp:
    raise ValueError(
        f"w: columns N={ws[-1]} must be divisible by the TP size {tp} for "
        f"{schedule.name} (the output is scattered over columns)")
  if beta != 0 and c is None:
    raise ValueError("c: beta != 0 needs c (out = alpha * x @ w + beta * c)")
  if c is not None:
    expected = output_shape(schedule, xs, ws, tp)
    if _shape(c) != expected:
      raise ValueError(
          f"c: must have the per-device output shape {expected} for {schedule.name} with "
          f"TP={tp}, got {_shape(c)}")
    if not jnp.issubdtype(c.dtype, jnp.floating):
      raise TypeError(f"c: must be a floating-point array, got {_dtype_name(c.dtype)}")
  return tp


def check_tp_group(axis_sizes, axis_name: tuple[str, ...], tp: int) -> None:
  """Lowering-time check: the mesh gives the TP group the call was traced for.

  axis_sizes maps each axis of the concrete mesh to its size.  The FFI handlers meet exactly
  `tp` devices per group; if the product of the sizes of `axis_name` differs (a call traced for
  one TP size and lowered on a mesh with another, or a primitive bound with a wrong tp), the
  groups would be wrong or not even formable.
  """
  names = tuple(axis_sizes)
  for a in axis_name:
    if a not in axis_sizes:
      raise ValueError(f"axis_name: {a!r} is not an axis of the mesh {names}")
  size = 1
  for a in axis_name:
    size *= int(axis_sizes[a])
  if size != tp:
    shown = axis_name if len(axis_name) > 1 else axis_name[0]
    raise ValueError(
        f"tp: the call was traced for TP={tp} but mesh axis {shown!r} has {size} devices; "
        "the TP group size must equal the mesh axis size (the device count of each call)")
  total = 1
  for s in axis_sizes.values():
    total *= int(s)
  if total % tp:
    raise ValueError(f"tp: the mesh's {total} devices do not split into groups of TP={tp}")


class GroupUnreachableError(ValueError):
  """A TP group the FFI executor cannot meet (it spans processes or hosts it cannot reach).
  implementation=None lowers the XLA ring instead (primitives._lowering); "ffi" raises it."""


def check_groups_local(groups, local_device_ids, *, platform: str = "cpu", process_of=None,
                       multiprocess=None) -> None:
  """Every TP group that holds a device of this process must be one its FFI executor can meet.

  Within one process the executors meet the peers of a group through a host rendezvous between
  XLA's per-device threads.  A group spanning processes is accepted only after
  jax_distgemm.initialize_multiprocess() (`multiprocess`: its state, with same_host(process
  index)), and only when all its processes share this host (`process_of`: device id -> process
  index): the CPU executor meets them through POSIX shared memory, the CUDA executor maps their
  workspaces through CUDA IPC, which also needs one device per process in the group.  Anything
  else could never meet and would only fail at the timeout, so it is refused here.
  groups: [num_groups, tp] global device ids.
  """
  cuda = platform.lower() in ("cuda", "gpu")
  local = set(int(d) for d in local_device_ids)
  for row in np.asarray(groups):
    ids = [int(d) for d in row]
    here = [d for d in ids if d in local]
    if not here or len(here) == len(ids):
      continue
    missing = [d for d in ids if d not in local]
    head = (f"axis_name: the TP group {ids} spans processes (devices {missing} are not "
            "addressable by this process)")
    if not cuda and platform.lower() != "cpu":
      raise GroupUnreachableError(
          f"{head}; implementation='ffi' has no executor across processes on {platform!r}; use "
          "implementation='xla'")
    if multiprocess is None:
      raise GroupUnreachableError(
          f"{head}; implementation='ffi' across processes needs "
          "jax_distgemm.initialize_multiprocess() after jax.distributed.initialize() in every "
          "process, else use implementation='xla' across processes")
    if process_of is not None:
      remote_hosts = [d for d in missing
                      if d in process_of and not multiprocess.same_host(process_of[d])]
      if remote_hosts:
        how = ("maps peers' workspaces through CUDA IPC over NVLink" if cuda else
               "meets peers through POSIX shared memory")
        raise GroupUnreachableError(
            f"{head}; devices {remote_hosts} are on another host, which the "
            f"{'CUDA' if cuda else 'CPU'} executor cannot reach (it {how}, one host only); use "
            "implementation='xla' across hosts")
    if cuda and len(here) != 1:
      raise GroupUnreachableError(
          f"{head}; on CUDA a TP group that spans processes must have one GPU per process (this "
          f"process holds {here}); use implementation='xla' for this mesh")

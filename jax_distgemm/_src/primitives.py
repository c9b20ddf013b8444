"""The `jax_distgemm` primitive: one FFI custom call per distributed GEMM.

Why a primitive and not a bare jax.ffi.ffi_call: the handler must know the device ids of its TP
group, and those are only known at lowering time (shard_map bodies are traced against an
abstract mesh; the lowering context holds the concrete one).  The lowering rule turns the mesh
and axis name into the `groups` attribute.

Operands, per device (row-major, leading batch dims L allowed on x; w is 2-D or batched like x):
  x [..., xm, xk]   w [xk, wn] or [..., xk, wn]   c (out dtype, output shape, or 0 elements)
The output shape per schedule is `output_shape` below.  Results: [out], or, for an AllGather
schedule bound with gathered=True, [out, the gathered operand] (all_gather(x, rows) for
RotatingA, all_gather(w, columns) for RotatingB, tiled, in the inputs' dtype): the executor
holds every shard anyway, so the operand comes without more communication.

fp8 (scaled=True): operands x, x_scale, w, w_scale[, c], fp8 values with their fp32 scales
(fp8.py), bound to a target of their own; a shard's scales travel with it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax._src.interpreters import mlir
from jax._src import sharding_impls
from jax._src.interpreters import batching

from jax_distgemm import ffi as ffi_modules
from jax_distgemm._src import config
from jax_distgemm._src import device_ids
from jax_distgemm._src import multiprocess
from jax_distgemm._src import validation
from jax_distgemm._src import xla_ring
from jax_distgemm._src.schedules import Schedule, gathered_shape, output_shape

TARGET_NAME = "jax_distgemm_v1"
# The same handler, bound by calls with the gathered operand as a second result.  NOTE: a name
# of its own so that a program with such a call (a jax.export artifact, say) fails to find the
# target under a jax_distgemm from before that result, whose handler would ignore the extra
# result and leave it unwritten, instead of running with it.
TARGET_GATHERED = "jax_distgemm_gathered_v1"
TARGET_FP8 = "jax_distgemm_fp8_v1"  # x, x_scale, w, w_scale, c
TARGETS = (TARGET_NAME, TARGET_GATHERED, TARGET_FP8)

distgemm_p = core.Primitive("jax_distgemm")
distgemm_p.multiple_results = True


# Call sites lowered into separate modules that XLA later splices into one program (each
# custom_partitioning op is lowered on its own, with a fresh channel counter) would otherwise
# get equal call_ids; partitioning.py binds them under a distinct call_site (see _lowering).
_call_site = contextvars.ContextVar("jax_distgemm_call_site", default=0)


@contextlib.contextmanager
def call_site(site: int):
  """Primitives bound inside get `site` mixed into their rendezvous key (call_id)."""
  if not 0 <= int(site) < 2**31:
    raise ValueError(f"call_site: expected 0 <= site < 2**31, got {site}")
  token = _call_site.set(int(site))
  try:
    yield
  finally:
    _call_site.reset(token)


def in_partition_body() -> bool:
  """True while partitioning.py traces a custom_partitioning body: already per shard, whatever
  the context mesh (jax.set_mesh's, with Auto axes) says."""
  return _call_site.get() != 0


def bind(x, w, c, *, schedule: Schedule, axis_name: tuple, tp: int, alpha: float,
         beta: float, out_dtype, timeout_ms: int, ring_if_unreachable: bool = False,
         gathered: bool = False, x_scale=None, w_scale=None):
  """Binds the primitive on (x, w) or (x, w, c); c is cast to out_dtype.  With scales (fp8 x
  and w), on (x, x_scale, w, w_scale[, c]).

  Returns out, or (out, gathered operand) with gathered=True (AllGather schedules only).

  ring_if_unreachable: where the lowering finds a TP group the executor cannot meet
  (validation.GroupUnreachableError) or no concrete mesh, lower the XLA ring instead (with a
  warning) rather than raise: implementation.py sets it where None chose the fused call.

  NOTE: without c the primitive has two operands and the lowering supplies the FFI call's
  empty c.  A traced zero-size operand would become a zero-size shard_map argument under an
  eager (un-jitted) shard_map, which crashes XLA:CPU's compiler (jaxlib 0.11.2).
  """
  schedule = Schedule(schedule)
  if gathered and not schedule.is_all_gather:
    raise ValueError(f"gathered: {schedule.name} gathers no operand (AllGather schedules only)")
  scaled = x_scale is not None
  if scaled and gathered:
    raise ValueError("gathered: not with fp8 operands")
  operands = (x, x_scale, w, w_scale) if scaled else (x, w)
  if c is not None:
    operands += (c.astype(out_dtype),)
  results = distgemm_p.bind(
      *operands, schedule=schedule, axis_name=tuple(axis_name),
      tp=int(tp), alpha=float(alpha), beta=float(beta), out_dtype=jnp.dtype(out_dtype),
      timeout_ms=int(timeout_ms), call_site=_call_site.get(),
      ring_if_unreachable=bool(ring_if_unreachable), gathered=bool(gathered), scaled=scaled)
  return tuple(results) if gathered else results[0]


def _split(args, scaled: bool):
  """(x, x_scale, w, w_scale, c) of the primitive's operands (scales and c may be None)."""
  if scaled:
    x, xs, w, ws, *c = args
  else:
    (x, w, *c), xs, ws = args, None, None
  return x, xs, w, ws, (c[0] if c else None)


@distgemm_p.def_abstract_eval
def _abstract_eval(*args, schedule, axis_name, tp, alpha, beta, out_dtype, timeout_ms,
                   call_site, ring_if_unreachable, gathered, scaled):
  del axis_name, alpha, beta, timeout_ms, call_site, ring_if_unreachable
  x, _, w, _, _ = _split(args, scaled)
  shape = output_shape(schedule, x.shape, w.shape, tp)
  # The results vary over the same manual axes as the (vma-matched) operands.
  sharding = core.get_cur_mesh_sharding()
  out = [x.update(shape=shape, dtype=out_dtype, weak_type=False, sharding=sharding)]
  if gathered:
    out.append(x.update(shape=gathered_shape(schedule, x.shape, w.shape, tp), dtype=x.dtype,
                        weak_type=False, sharding=sharding))
  return out


# -- Lowering -------------------------------------------------------------------------------

def device_groups(mesh, axis_name: tuple, tp: int, platform: str = "cpu") -> np.ndarray:
  """Global device ids of every TP group (rows), in rank order along `axis_name`.

  Checks that the FFI executor of `platform` can meet each group that holds a device of this
  process (validation.check_groups_local).
  """
  names = tuple(mesh.axis_names)
  validation.check_tp_group(dict(zip(names, mesh.devices.shape)), axis_name, tp)
  others = [a for a in names if a not in axis_name]
  perm = [names.index(a) for a in others + list(axis_name)]
  ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
  groups = np.transpose(ids, perm).reshape(-1, tp)
  validation.check_groups_local(
      groups, [d.id for d in mesh.devices.flat if d.process_index == jax.process_index()],
      platform=platform, process_of={d.id: d.process_index for d in mesh.devices.flat},
      multiprocess=multiprocess.state())
  return np.ascontiguousarray(groups, dtype=np.int64)


def _concrete_mesh(ctx):
  ac = ctx.module_context.axis_context
  mesh = getattr(ac, "mesh", None) if isinstance(ac, sharding_impls.SPMDAxisContext) else None
  # NOTE: AbstractMesh first: its `devices` property raises (an inner shard_map nested in an
  # outer one without `mesh=` lowers with an AbstractMesh), so hasattr would not return False.
  if (mesh is None or isinstance(mesh, jax.sharding.AbstractMesh)
      or not hasattr(mesh, "devices")):
    raise NotImplementedError(
        "jax_distgemm: the FFI implementation must be lowered inside jax.shard_map over a "
        "concrete jax.sharding.Mesh (the device ids of the TP group are needed); use "
        "implementation='xla' elsewhere")
  return mesh


def _ring_lowering(ctx, *args, schedule, axis_name, alpha, beta, out_dtype, gathered, scaled,
                   why: str, quiet: bool = False):
  """The XLA ring (xla_ring) lowered in the custom call's place, same operands and result;
  a warning at the caller's line says why, unless `quiet`."""
  if not quiet:
    config.warn(("lowering", why), "jax_distgemm: implementation=None runs the XLA ring here, "
                f"not the fused call: {why}")

  def ring(*args):
    x, xs, w, ws, c = _split(args, scaled)
    if scaled:  # scaled operands travel as (values, scales) pairs
      x, w = (x, xs), (w, ws)
    out = xla_ring.distributed_matmul(x, w, c, axis_name=axis_name,
                                      schedule=schedule, alpha=alpha, beta=beta,
                                      out_dtype=out_dtype, with_operand=gathered)
    return list(out) if gathered else [out]

  return mlir.lower_fun(ring, multiple_results=True)(ctx, *args)


_EXPORT_PINS_IDS = ("a jax.export artifact of the fused call names its TP groups by the "
                    "global device ids of the mesh it was exported on")


def _mesh_ids(ctx) -> list[int] | str:
  try:
    return _concrete_mesh(ctx).device_ids.ravel().tolist()
  except NotImplementedError:
    return "of the export's mesh"


def _k_major(aval) -> tuple[int, ...] | None:
  """The minor-to-major layout of a matrix (or batch of them) stored transposed."""
  r = aval.ndim
  return None if r < 2 else (r - 2, r - 1, *range(r - 3, -1, -1))


def _lowering(platform, ctx, *args, schedule, axis_name, tp, alpha, beta, out_dtype,
              timeout_ms, call_site, ring_if_unreachable, gathered, scaled):
  # NOTE: only what the executor cannot reach falls back; a mesh that does not match the
  # axis sizes (check_tp_group) is the caller's error under every implementation.
  ring = functools.partial(_ring_lowering, ctx, *args, schedule=schedule,
                           axis_name=axis_name, alpha=alpha, beta=beta, out_dtype=out_dtype,
                           gathered=gathered, scaled=scaled)
  if ctx.module_context.lowering_parameters.for_export:
    # NOTE: the call names its TP groups by global device ids, while an exported artifact may
    # be called on other devices: where the same ids sit in other mesh positions it would pair
    # the wrong shards.  None exports the ring (collective-permutes over positions, right under
    # any device assignment); "ffi" keeps the fused call, pinned to these ids.
    if ring_if_unreachable:
      config.log_once(("export",), "jax_distgemm: implementation=None exports the XLA ring: %s",
                      _EXPORT_PINS_IDS)
      return ring(why=_EXPORT_PINS_IDS, quiet=True)
    config.warn(("export",), f"jax_distgemm: implementation='ffi' under jax.export: "
                f"{_EXPORT_PINS_IDS}; call the artifact only where the devices "
                f"{_mesh_ids(ctx)} hold the same mesh positions (implementation=None or 'xla' "
                "exports an artifact that runs anywhere)")
  try:
    mesh = _concrete_mesh(ctx)
  except NotImplementedError as e:
    if not ring_if_unreachable:
      raise
    return ring(why=str(e))
  try:
    groups = device_groups(mesh, axis_name, tp, platform)
  except validation.GroupUnreachableError as e:
    if not ring_if_unreachable:
      raise
    return ring(why=str(e))
  device_ids.register(platform)
  if platform == "cpu":
    ffi_modules.register_cpu_targets()
  if len(args) == (4 if scaled else 2):  # the FFI call always takes c: empty means "no c"
    empty = core.ShapedArray((0,), out_dtype)
    args = (*args, mlir.ir_constant(np.zeros((0,), out_dtype)))
    ctx = ctx.replace(avals_in=(*ctx.avals_in, empty))
  layouts = None
  if scaled and platform == "cuda":
    # NOTE: fp8 wgmma reads B K-major, so the CUDA handler takes w, and w's block scales,
    # column-major (cc/cuda/executor.h CallBuffers); XLA transposes them, inside the producer's
    # fusion where it can (e.g. the quantize of fp8=).
    layouts = [_k_major(a) if i in (2, 3) else None for i, a in enumerate(ctx.avals_in)]
  rule = jax.ffi.ffi_lowering(
      TARGET_FP8 if scaled else TARGET_GATHERED if gathered else TARGET_NAME,
      operand_layouts=layouts)
  results = rule(
      ctx, *args,
      schedule=np.int32(int(schedule)),
      tp=np.int64(tp),
      groups=groups.reshape(-1),
      alpha=np.float32(alpha),
      beta=np.float32(beta),
      # Deterministic per module (same on every device and process): the rendezvous key.
      # call_site (0 but in custom_partitioning bodies) keeps separately lowered modules apart.
      call_id=np.int64((call_site << 32) | ctx.module_context.new_channel()),
      timeout_ms=np.int64(timeout_ms),
      # The ReduceScatter path, fixed here so that every device of the call agrees.
      rs_path=np.int32(0 if schedule.is_all_gather else config.rs_path_override()))
  return results


for _platform in ("cpu", "cuda"):
  mlir.register_lowering(distgemm_p, functools.partial(_lowering, _platform),
                         platform=_platform)


# -- vmap: a mapped axis becomes one more leading batch dim ----------------------------------

def _batch_rule(axis_data, args, dims, **params):
  scaled = params["scaled"]
  x, xs, w, ws, c = _split(args, scaled)
  bx, bxs, bw, bws, bc = _split(dims, scaled)
  n_out = 2 if params["gathered"] else 1
  if all(d is None for d in dims):
    return distgemm_p.bind(*args, **params), [None] * n_out
  if scaled and xs.ndim == (bxs is not None) and (bxs is not None or bws is not None):
    # Per-tensor scales mapped by vmap (one per slice): no one call takes them, so a call per
    # slice.
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    mapped = [i for i, d in enumerate(dims) if d is not None]

    def one(slices):
      full = list(moved)
      for i, a in zip(mapped, slices):
        full[i] = a
      return distgemm_p.bind(*full, **params)

    return jax.lax.map(one, [moved[i] for i in mapped]), [0] * n_out

  def lead(a, d):
    if d is None:
      return jnp.broadcast_to(a, (axis_data.size,) + a.shape)
    return jnp.moveaxis(a, d, 0)

  def like_x(a, d):
    # A batched w must carry exactly the batch dims of x.  NOTE: a mapped 2-D w ([v, K, N])
    # beside an x with batch dims of its own ([v, B.., M, K]) gets B.. as ones first: right-
    # aligned broadcasting would pair v with B.
    a = lead(a, d)
    a = a.reshape(a.shape[:1] + (1,) * (x.ndim - a.ndim) + a.shape[1:])
    return jnp.broadcast_to(a, x.shape[:-2] + a.shape[-2:])

  x = lead(x, bx)
  w_batched = bw is not None or w.ndim > 2 or (scaled and (bws is not None or ws.ndim > 2))
  if w_batched:
    w = like_x(w, bw)
  if scaled and xs.ndim:  # block scales batch like their operands
    xs = lead(xs, bxs)
    ws = like_x(ws, bws) if w_batched else ws
  c = None if c is None else lead(c, bc)
  operands = (x, xs, w, ws) if scaled else (x, w)
  operands += () if c is None else (c,)
  # The gathered operand of RotatingB is w's: unbatched if w still is (x alone was mapped).
  dims_out = [0] * n_out
  if n_out == 2 and params["schedule"] == Schedule.AllGather1D_TilingCD_RotatingB and w.ndim == 2:
    dims_out[1] = None
  return distgemm_p.bind(*operands, **params), dims_out


batching.fancy_primitive_batchers[distgemm_p] = _batch_rule

"""Which implementation runs a call: the one module that decides, and the one that runs it.

  "ffi"        the fused custom call: CUDA on Hopper, the CPU executor on fake CPU devices
  "xla"        a ppermute ring (xla_ring.py), any backend
  "reference"  XLA's all-gather / reduce-scatter + dot (reference.py), the specification
  None         auto: "ffi" where its executor runs the case and is expected to be faster,
               "reference" where XLA's own path is (on CUDA: at most one wave of tiles),
               otherwise "xla"

JAX_DISTGEMM_IMPLEMENTATION replaces None everywhere and counts as an explicit choice.
fp8 operands: every implementation; where the fused call cannot run them, None picks XLA's
collective around its fp8 dot ("reference") rather than the ring.

Fallback has one meaning: what runs when the chosen implementation cannot.  An explicit
choice has none (the call raises, naming the rule); None falls back to the XLA ring, with a
warning at the caller's line.  Some obstacles are known only at lowering, where the TP group's
devices are (a group the executor cannot meet, or no concrete mesh): there the primitive
lowers the ring in the custom call's place when `choose` told it to (ring_if_unreachable).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jax_distgemm import ffi as ffi_modules
from jax_distgemm._src import config, fp8, primitives, reference, xla_ring
from jax_distgemm._src.schedules import Schedule

IMPLEMENTATIONS = ("ffi", "xla", "reference")


@dataclasses.dataclass(frozen=True)
class Params:
  """Static arguments of one per-shard call (hashable: the custom_vjp's nondiff argument)."""

  schedule: Schedule
  axis_name: tuple[str, ...]
  tp: int
  alpha: float
  beta: float
  out_dtype: np.dtype
  implementation: str | None  # as requested; None is resolved per call (forward and backward)
  timeout_ms: int
  with_operand: bool = False  # AllGather: also return the gathered operand (out, AG(x or w))


def check_name(implementation, what: str = "implementation") -> str | None:
  """`implementation` if it is a name or None, else a ValueError naming the rule."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"{what}: expected one of {IMPLEMENTATIONS} or None, got {implementation!r}")
  return implementation


def requested(implementation: str | None) -> str | None:
  """The caller's choice, or JAX_DISTGEMM_IMPLEMENTATION's where the caller left None."""
  if check_name(implementation) is not None:
    return implementation
  forced = config.forced_implementation()
  if forced is not None and forced not in IMPLEMENTATIONS:
    raise ValueError(f"JAX_DISTGEMM_IMPLEMENTATION must be one of {IMPLEMENTATIONS} or unset, "
                     f"got {forced!r}")
  return forced


platform = config.platform


def ffi_unsupported_reason(platform_name: str, x, w, out_dtype, schedule: Schedule,
                           tp: int, fp8: str | None = None) -> str | None:
  """Why the fused call cannot run this case on `platform_name` (None: it can); `fp8`: the
  scaling ("tensor" or "block") of x and w as fp8 values with their scales."""
  if platform_name == "cpu":
    return None
  if platform_name not in ("cuda", "gpu"):
    return f"no FFI executor for platform {platform_name!r}"
  if not ffi_modules.has_cuda():
    err = ffi_modules.cuda_import_error
    if "does not load" in str(err):  # built and installed, but its import fails
      return f"the CUDA executor does not load: {err}"
    return f"the CUDA executor was not built (no nvcc at install time): {err}"
  from jax_distgemm._src import cuda_rules  # pylint: disable=g-import-not-at-top
  if fp8:
    return cuda_rules.fp8_unsupported_reason(x, w, out_dtype, schedule, tp, fp8)
  return cuda_rules.unsupported_reason(x, w, out_dtype, schedule, tp)


def xla_faster_reason(platform_name: str, x, w, schedule: Schedule, tp: int) -> str | None:
  """Why XLA's collective + dot is expected to beat the fused call here (None: it is not)."""
  if platform_name not in ("cuda", "gpu"):
    return None  # the CPU executor is there to run the schedule, not to be fast
  from jax_distgemm._src import cuda_rules  # pylint: disable=g-import-not-at-top
  return cuda_rules.xla_faster_reason(x, w, schedule, tp)


def unpartitioned_axes() -> tuple[str, ...]:
  """Mesh axes of size > 1 that the enclosing shard_map leaves to the partitioner.

  NOTE: the custom call has no sharding rule for them, so XLA would gather its operands along
  them and every replica would compute the whole call.  A custom_partitioning body is per
  shard already, whatever its context mesh says.
  """
  if primitives.in_partition_body():
    return ()
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(a for a, n, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
               if n > 1 and t != jax.sharding.AxisType.Manual)


def choose(x, w, p: Params) -> str:
  """The implementation of one per-shard call (forward or backward)."""
  name = requested(p.implementation)
  if name is not None:
    return name
  if auto := unpartitioned_axes():
    config.warn(("unpartitioned", auto),
                f"jax_distgemm: implementation=None runs the XLA ring here, not the fused "
                f"call: the enclosing shard_map leaves mesh axes {auto} to the partitioner, "
                "along which the custom call cannot be split (make them manual)")
    return "xla"
  where = platform()
  if ffi_unsupported_reason(where, x, w, p.out_dtype, p.schedule, p.tp) is not None:
    return "xla"
  if why := xla_faster_reason(where, x, w, p.schedule, p.tp):
    config.log_once(("reference", p.schedule, x.shape, w.shape, p.tp),
                    "jax_distgemm: implementation=None runs XLA's collective + dot "
                    "(\"reference\") for %s, x %s, w %s at TP=%d: %s", p.schedule.name,
                    x.shape, w.shape, p.tp, why, level=logging.INFO)
    return "reference"
  return "ffi"


def choose_under_vmap(implementation: str | None, vmapped: tuple[str, ...]) -> str:
  """A call whose axis_name a jax.vmap binds (no mesh: the "group" is a batch dim)."""
  name = requested(implementation)
  if name == "ffi":
    raise ValueError(
        f"implementation='ffi': axis_name {vmapped[0]!r} is bound by jax.vmap, not by "
        "jax.shard_map; the fused call runs between the devices of a mesh (use "
        "implementation='xla', or None, which runs the XLA ring under vmap)")
  return name or "xla"  # the ring's collectives have vmap rules


def choose_without_devices(implementation: str | None) -> str | None:
  """A jit-level call whose mesh is abstract (Explicit axes under jax.jit, no concrete mesh
  anywhere): the fused call cannot name its TP group, so 'ffi' is refused and None runs the
  ring, each saying how to give the mesh."""
  how = "pass mesh=, an out_sharding NamedSharding, or call under jax.set_mesh(mesh)"
  name = requested(implementation)
  if name == "ffi":
    raise ValueError(
        "jax_distgemm.collective_matmul: implementation='ffi' under jax.jit on operands whose "
        "mesh is abstract (Explicit axes carry no devices there), and the fused call needs the "
        f"TP group's devices: {how}")
  if name is None:
    config.warn(("abstract mesh",),
                "jax_distgemm.collective_matmul runs the XLA ring, not the fused call: under "
                "jax.jit the operands' mesh is abstract (Explicit axes carry no devices), and "
                f"the fused call needs the TP group's devices ({how})")
    return "xla"
  return name


def _varying(a) -> frozenset:
  return frozenset(jax.typeof(a).manual_axis_type.varying)


def match_vma(*arrays):
  """Casts operands to vary over the same manual axes (what ffi_call requires)."""
  present = [a for a in arrays if a is not None]
  union = frozenset().union(*(_varying(a) for a in present))
  out = []
  for a in arrays:
    missing = None if a is None else tuple(sorted(union - _varying(a)))
    out.append(a if not missing else jax.lax.pcast(a, missing, to="varying"))
  return out


def _ffi(x, w, c, p: Params, ring_if_unreachable: bool, x_scale=None, w_scale=None):
  scaling = None if x_scale is None else "tensor" if x_scale.ndim == 0 else "block"
  reason = ffi_unsupported_reason(platform(), x, w, p.out_dtype, p.schedule, p.tp, scaling)
  if reason:
    raise NotImplementedError(f"jax_distgemm implementation='ffi': {reason}")
  if auto := unpartitioned_axes():
    config.warn(("ffi", auto),
                "jax_distgemm implementation='ffi': the enclosing shard_map leaves mesh axes "
                f"{auto} to the partitioner; the custom call cannot be split along them, so "
                "XLA gathers its operands and every replica computes the whole call (make them "
                "manual, or use implementation=None or 'xla', which run the XLA ring here)")
  # The ReduceScatter stage kernels have no second epilogue source (their C is the running
  # sum): beta * c joins after the call, one elementwise pass that XLA fuses.
  c_after = None
  if c is not None and not p.schedule.is_all_gather:
    c, c_after = None, c
  x, w, c, x_scale, w_scale = match_vma(x, w, c, x_scale, w_scale)
  out = primitives.bind(x, w, c, schedule=p.schedule, axis_name=p.axis_name, tp=p.tp,
                        alpha=p.alpha, beta=p.beta, out_dtype=p.out_dtype,
                        timeout_ms=p.timeout_ms, ring_if_unreachable=ring_if_unreachable,
                        gathered=p.with_operand, x_scale=x_scale, w_scale=w_scale)
  if c_after is not None:
    out = reference.epilogue(out.astype(jnp.float32), c_after, alpha=1.0, beta=p.beta,
                             out_dtype=p.out_dtype)
  return out


def run(x, w, c, p: Params, name: str | None = None):
  """The per-shard call with implementation `name` (default: choose(x, w, p))."""
  name = name or choose(x, w, p)
  if name == "ffi":
    # Chosen by None: a group the executor cannot meet lowers the ring instead.
    return _ffi(x, w, c, p, ring_if_unreachable=requested(p.implementation) is None)
  impl = {"xla": xla_ring, "reference": reference}[name]
  return impl.distributed_matmul(x, w, c, axis_name=p.axis_name, schedule=p.schedule,
                                 alpha=p.alpha, beta=p.beta, out_dtype=p.out_dtype,
                                 with_operand=p.with_operand)


def choose_fp8(x, w, p: Params, vmapped: tuple[str, ...], scaling: str) -> str:
  """The implementation of an fp8 call with `scaling` (x, w: the operands before any
  quantization): as `choose`, but where the fused call cannot run it, XLA's collective around
  its fp8 dot ("reference": a cuBLASLt fp8 GEMM on CUDA) rather than the ring."""
  if vmapped:
    return choose_under_vmap(p.implementation, vmapped)
  if requested(p.implementation) is not None or unpartitioned_axes():
    return choose(x, w, p)
  where = platform()
  if ffi_unsupported_reason(where, x, w, p.out_dtype, p.schedule, p.tp, scaling):
    return "reference"
  if where in ("cuda", "gpu"):
    # NOTE: measured on one GPU, at TP = 1 only (docs/benchmarks.md): block-scaled, the fused
    # call runs in a third to a half of XLA's time; per tensor it trails XLA's cuBLASLt GEMM at
    # some shapes.  TP >= 2 keeps XLA's path until it is measured; implementation="ffi" runs it.
    return "ffi" if scaling == "block" and p.tp == 1 else "reference"
  return "ffi"


def run_fp8(x, x_scale, w, w_scale, c, p: Params, name: str):
  """An fp8 call: "ffi" is the fused call with the scales beside their operands; "reference"
  XLA's collective around the scaled dot (fp8.py); "xla" rotates (values, scales) pairs."""
  if name == "ffi":
    return _ffi(x, w, c, p, ring_if_unreachable=requested(p.implementation) is None,
                x_scale=x_scale, w_scale=w_scale)
  kwargs = dict(axis_name=p.axis_name, schedule=p.schedule, alpha=p.alpha, beta=p.beta,
                out_dtype=p.out_dtype)
  if name == "reference":
    return fp8.reference_matmul(x, x_scale, w, w_scale, c, **kwargs)
  return xla_ring.distributed_matmul((x, x_scale), (w, w_scale), c, **kwargs)

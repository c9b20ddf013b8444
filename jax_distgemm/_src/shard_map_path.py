"""collective_matmul where the shardings are known at trace time: one jax.shard_map.

Concrete arrays (their NamedShardings), Explicit mesh axes under jax.jit (the traced
shardings), or in_specs= given by the caller.  The op is a shard_map over the whole mesh of the
plan's per-shard body, differentiable through the per-shard op's custom VJP (autodiff.py).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_distgemm._src import sharding_rules as rules


def plain_dot(x, w, o: rules.Options, out_sharding):
  """fallback="dot" (Auto axes): XLA's partitioner inserts whatever collectives it needs."""
  out = rules.dot(x, w, o)
  return out if out_sharding is None else jax.lax.with_sharding_constraint(out, out_sharding)


def reshard(a, spec: P, mesh):
  """`a` laid out as `spec` over `mesh` (Explicit axes).  NOTE: a NamedSharding, not the bare
  spec, so that no jax.set_mesh is needed (JAX refuses a PartitionSpec outside one)."""
  return jax.sharding.reshard(a, NamedSharding(mesh, spec))


def all_explicit(mesh) -> bool:
  """Every axis of `mesh` Explicit (reshard refuses specs naming Auto or Manual axes)."""
  types = getattr(mesh, "axis_types", ())
  return bool(types) and all(t == jax.sharding.AxisType.Explicit for t in types)


def explicit_dot(x, w, o: rules.Options, out_spec, mesh):
  """fallback="dot" (Explicit axes): reshard to the dot plan, local dot + psum, then out."""
  d = rules.dot_plan(jax.typeof(x).sharding.spec, jax.typeof(w).sharding.spec, x.ndim, w.ndim)
  x, w = reshard(x, d.x_spec, mesh), reshard(w, d.w_spec, mesh)
  out = jax.shard_map(rules.dot_body(d, o), mesh=mesh, in_specs=(d.x_spec, d.w_spec),
                      out_specs=d.out_spec)(x, w)
  return out if out_spec is None else reshard(out, out_spec, mesh)


@functools.lru_cache(maxsize=256)
def shard_mapped(p: rules.Plan, o: rules.Options, mesh):
  # Under jax.jit even when called eagerly: an eager shard_map compiles each primitive on its
  # own, and that compile of the FFI primitive crashes XLA:CPU (jax 0.11.2).
  return jax.jit(jax.shard_map(rules.fused_body(p, o), mesh=mesh, in_specs=(p.x_spec, p.w_spec),
                               out_specs=p.out_spec))

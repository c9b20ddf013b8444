"""The benchmark's cases: the suites, a case's shapes and inputs, and the functions it times.

`python -m jax_distgemm.bench` (bench.py) times, checks and reports them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_distgemm
from jax_distgemm._src import fp8, reference
from jax_distgemm._src.schedules import Schedule

AG_A, AG_B, RS_A, RS_B = Schedule
SHORT_NAMES = {AG_A: "AG-RotA", AG_B: "AG-RotB", RS_A: "RS-TilA", RS_B: "RS-TilB"}

# (M, K, N) global. The seed's shape is CUTLASS example 65's sample command.
SEED_SHAPE = (16384, 16384, 106496)
STANDARD_SHAPES = ((8192, 8192, 28672), (4096, 8192, 8192), SEED_SHAPE, (8192, 4096, 4096),
                   (2048, 8192, 8192))
# Standard: every shape for AG-RotA and RS-TilA, the seed's for the other two. Small: decode and
# small-batch calls, square 8192 layers at three token counts and a 70B-like MLP's up projection
# (AllGather) and down projection (ReduceScatter) at 64 tokens.
SQUARE_8192 = tuple((tokens, 8192, 8192) for tokens in (64, 256, 1024))
SUITES = {"standard": {AG_A: STANDARD_SHAPES, RS_A: STANDARD_SHAPES, AG_B: (SEED_SHAPE,),
                       RS_B: (SEED_SHAPE,)},
          "small": {AG_A: SQUARE_8192 + ((64, 8192, 28672),),
                    RS_A: SQUARE_8192 + ((64, 28672, 8192),)}}
CPU_SHAPE = (256, 128, 512)
CPU_SCALE = {"standard": 64, "small": 16}  # on CPU a suite's dimensions are divided by these
MAX_SETS, SET_BUDGET_BYTES = 32, 8 * 2**30  # a row's rotating input sets, and their bytes


def suite(name: str, scale: int = 1) -> list[tuple[Schedule, int, int, int]]:
  """(schedule, M, K, N) of a named suite, each dimension divided by `scale`."""
  return [(s, m // scale, k // scale, n // scale) for s, shapes in SUITES[name].items()
          for m, k, n in shapes]


@dataclasses.dataclass(frozen=True)
class Case:
  """One problem: global x [L, M, K] @ w [L, K, N] (no L dim when L == 1) over TP devices."""

  schedule: Schedule
  m: int
  k: int
  n: int
  l: int = 1
  tp: int = 2
  dtype: str = "bfloat16"
  alpha: float = 1.0
  beta: float = 0.0
  scaling: str | None = None  # fp8: "tensor" or "block"

  @property
  def out_dtype(self) -> str:
    return "bfloat16" if self.scaling else self.dtype

  @property
  def label(self) -> str:
    batch = f" L={self.l}" if self.l > 1 else ""
    return f"{SHORT_NAMES[self.schedule]} {self.m},{self.k},{self.n}{batch}"

  def specs(self):  # (x, w, out) over mesh axis "tp"
    return self.schedule.partition_specs("tp", (None,) * (self.l > 1), w_batched=True)

  def in_specs(self):  # x, w, the scales (block: like x and w; per tensor: [TP]), c
    x, w, out = self.specs()
    scales = () if not self.scaling else (x, w) if self.scaling == "block" else (P("tp"),) * 2
    return (x, w) + scales + (out,) * (self.beta != 0)

  def shapes(self, which: str):
    """(x, w, out) shapes: "global", "ideal" (one device's share of the FLOPs, no
    communication) or "stage" (the local GEMM of one of the fused op's TP stages)."""
    m, k, n, tp = self.m, self.k, self.n, self.tp
    m, k, n = {
        "global": {s: (m, k, n) for s in Schedule},
        "ideal": {AG_A: (m, k, n // tp), AG_B: (m // tp, k, n), RS_A: (m, k // tp, n),
                  RS_B: (m, k // tp, n)},
        "stage": {AG_A: (m // tp, k, n // tp), AG_B: (m // tp, k, n // tp),
                  RS_A: (m // tp, k // tp, n), RS_B: (m, k // tp, n // tp)},
    }[which][self.schedule]
    b = (self.l,) if self.l > 1 else ()
    return b + (m, k), b + (k, n), b + (m, n)

  def invalid_reason(self) -> str | None:
    dims = {AG_A: "MN", AG_B: "MN", RS_A: "KM", RS_B: "KN"}[self.schedule]  # what TP splits
    bad = [f"{d}={v}" for d in dims if (v := getattr(self, d.lower())) % self.tp]
    if bad:
      return f"{', '.join(bad)} not divisible by TP={self.tp}"
    if self.scaling == "block":  # whole 128-blocks in every shard and stage slice
      k, n = ((self.k, self.n // self.tp) if self.schedule.is_all_gather else
              (self.k // self.tp, self.n))
      try:
        fp8.check_block_shapes((k,), (k, n), self.schedule, self.tp)
      except ValueError as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=64)
def _normal(shape, dtype, scale, sharding):
  return jax.jit(lambda key: (jax.random.normal(key, shape) * scale).astype(dtype),
                 out_shardings=sharding)


@functools.lru_cache(maxsize=64)
def _quantizer(scaling: str, xs: NamedSharding, ws: NamedSharding):
  """Each device quantizes its shards of x and w (a per-tensor scale: one per shard)."""
  specs = (xs.spec, ws.spec) + ((xs.spec, ws.spec) if scaling == "block" else (P("tp"),) * 2)
  def body(x, w):
    (xq, sx), (wq, sw) = (jax_distgemm.quantize(a, scaling, operand=o) for a, o in ((x, "x"), (w, "w")))
    return xq, wq, *((sx, sw) if scaling == "block" else (sx[None], sw[None]))
  return jax.jit(jax.shard_map(body, mesh=xs.mesh, in_specs=specs[:2], out_specs=specs))


def _scale(case: Case, s):
  return s.reshape(()) if case.scaling == "tensor" else s


def draw_inputs(case: Case, key, which: str, shardings, l2_bytes: int) -> list[tuple]:
  """Rotating input sets (x, w[, c]) of `case`'s `which` shapes, placed by `shardings` (x, w, out).

  Normal data drawn on the devices, never zeros; w is scaled by 1/sqrt(K) so outputs are O(1);
  c (fp32) only when beta != 0. Enough sets to exceed twice the L2 per device, and at least two,
  so that a call never reads what the previous one left in cache. A dtype with scales adds them
  here, after x and w, and to the timed functions' arguments.
  """
  xs, ws, cs = case.shapes(which)

  def one(i):
    kx, kw, kc = jax.random.split(jax.random.fold_in(key, i), 3)
    dtype = "float32" if case.scaling else case.dtype
    s = (_normal(xs, dtype, 1.0, shardings[0])(kx),
         _normal(ws, dtype, 1 / math.sqrt(xs[-1]), shardings[1])(kw))
    if case.scaling:
      s = _quantizer(case.scaling, shardings[0], shardings[1])(*s)
    return s + ((_normal(cs, "float32", 1.0, shardings[2])(kc),) if case.beta != 0 else ())

  first = one(0)
  per_device = sum(a.addressable_shards[0].data.nbytes for a in first)
  count = min(max(2, math.ceil(2 * l2_bytes / per_device)), MAX_SETS,
              SET_BUDGET_BYTES // per_device)
  return jax.block_until_ready([first] + [one(i) for i in range(1, count)])


def distributed_fn(case: Case, mesh: Mesh, implementation: str | None):
  op = functools.partial(jax_distgemm.distributed_matmul, axis_name="tp",
                         schedule=case.schedule, alpha=case.alpha, beta=case.beta,
                         out_dtype=case.out_dtype, implementation=implementation)
  body = op if not case.scaling else lambda x, w, sx, sw, *c: op(
      x, w, *c, x_scale=_scale(case, sx), w_scale=_scale(case, sw))
  return jax.shard_map(body, mesh=mesh, in_specs=case.in_specs(), out_specs=case.specs()[2])


def dot_fn(case: Case, out_sharding=None):
  """XLA's GEMM with the case's epilogue: on one device (the ideal; XLA's side of --local-gemm),
  or on global arrays, the output constrained to `out_sharding` and the rest left to XLA's SPMD
  partitioner (what the windowed-einsum flags rewrite)."""
  def f(x, w, *c):
    if case.scaling:  # per tensor, XLA rewrites this into its fp8 GEMM (fp8.matmul)
      if out_sharding is not None:
        raise NotImplementedError("fp8: XLA's SPMD partitioner would gather the scales")
      acc = fp8.matmul((x, _scale(case, c[0])), (w, _scale(case, c[1])))
      return reference.epilogue(acc, *(c[2:] or (None,)), alpha=case.alpha, beta=case.beta,
                                out_dtype=case.out_dtype)
    if case.alpha == 1.0 and not c and out_sharding is None:  # one plain dot, as in a layer
      return jnp.matmul(x, w, preferred_element_type=case.dtype)
    acc = reference.matmul_f32(x, w)
    if out_sharding is not None:
      acc = jax.lax.with_sharding_constraint(acc, out_sharding)
    return reference.epilogue(acc, *(c or (None,)), alpha=case.alpha, beta=case.beta,
                              out_dtype=case.dtype)
  return f

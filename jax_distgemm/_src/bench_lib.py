"""Machinery behind `python -m jax_distgemm.bench`: cases, data, timing, baselines, reports.

Every number comes from the run that prints it.  Per case, in one process: the ideal (an XLA dot
of one device's share of the problem, no communication), ours (implementation="ffi"), "auto"
(implementation=None), XLA all_gather + dot / dot + psum_scatter ("reference"), the ppermute ring
("xla") and plain jit auto-sharding ("jit_auto"); besides, the ideal on every TP device at once
(one program over the mesh, no communication: the step a TP layer would take if communication
were free; "eff*" in the summary).  XLA's windowed einsum needs different XLA_FLAGS
and so runs in a child process started before this process touches a device (so that the child
sees the whole GPU memory, before this process preallocates its share).

Timing (docs: /work/.library/device/METHOD.md, "Time properly"): compile, warm up, then per
repeat N back-to-back calls and one block_until_ready; the median over repeats.  Repeats are
interleaved across implementations, in an order rotated every repeat, so that clock or thermal
drift spreads over all of them.
Inputs are fresh random data, rotated among several sets whose total exceeds twice the L2 size,
so consecutive calls never reuse a buffer that is still in cache.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gc
import json
import math
import os
import platform as platform_mod
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jax_distgemm
from jax_distgemm import ffi as ffi_modules
from jax_distgemm._src import gpu_monitor, primitives, reference, runtime
from jax_distgemm._src.schedules import Schedule

# -- Names ------------------------------------------------------------------------------------------

SHORT_NAMES = {
    Schedule.AllGather1D_TilingCD_RotatingA: "AG-RotA",
    Schedule.AllGather1D_TilingCD_RotatingB: "AG-RotB",
    Schedule.ReduceScatter1D_TilingA_RotatingC: "RS-TilA",
    Schedule.ReduceScatter1D_TilingB_RotatingC: "RS-TilB",
}

# Rows of every case, in print order.
ROWS = ("ideal", "ffi", "auto", "reference", "xla", "windowed_einsum", "jit_auto")
ROW_LABELS = {
    "ideal": "ideal (local dot)",
    "ffi": "ffi (ours)",
    "auto": "auto (impl=None)",
    "reference": "reference (XLA coll.)",
    "xla": "xla (ppermute ring)",
    "windowed_einsum": "XLA windowed einsum",
    "jit_auto": "jit auto-sharding",
}
OURS = "ffi"
# "speedup" is over the fastest of these: every pure-XLA way to run the layer.  jit_auto (XLA's
# own partitioning of the global dot) counts too: at the seed AllGather it was the fastest of
# them in two suites (2026-11-30, docs/performance.md M1), which the first three alone hid.
BASELINES = ("reference", "xla", "windowed_einsum", "jit_auto")
# jax_distgemm's own implementations: their error vs "reference" is gated by --eps.
GATED = ("ffi", "auto", "xla")

WINDOWED_EINSUM_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0",
                         "--xla_gpu_multi_streamed_windowed_einsum=true")

# (M, K, N) global.  The seed's shape is CUTLASS example 65's sample command.
SEED_SHAPE = (16384, 16384, 106496)
STANDARD_SHAPES = ((8192, 8192, 28672), (4096, 8192, 8192), SEED_SHAPE, (8192, 4096, 4096),
                   (2048, 8192, 8192))
CPU_DEFAULT_SHAPE = (256, 128, 512)
# On CPU (fake devices) the suite's shapes are divided by this, so that it finishes.
CPU_SUITE_SCALE = 64
# The small suite (--suite small): decode and small-batch calls, where one wave of tiles or less
# covers a stage and each tile streams its weight panel over the whole k (docs/performance.md
# W1).  (M, K, N) global at TP=2: square 8192 layers at three token counts, and a 70B-like
# MLP's up projection (AllGather) and down projection (ReduceScatter) at 64 tokens.
SMALL_SHAPES = {
    Schedule.AllGather1D_TilingCD_RotatingA: ((64, 8192, 8192), (256, 8192, 8192),
                                               (1024, 8192, 8192), (64, 8192, 28672)),
    Schedule.ReduceScatter1D_TilingA_RotatingC: ((64, 8192, 8192), (256, 8192, 8192),
                                                  (1024, 8192, 8192), (64, 28672, 8192)),
}
CPU_SMALL_SUITE_SCALE = 16
SUITES = ("standard", "small")

DEFAULT_EPS = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-3}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}

LOCAL_GEMM_NOTE = (
    "no ratio: our stage GEMM (the fused op at TP=1, local_stage_fn) could not be timed")


def parse_schedule(value: str) -> Schedule:
  """A schedule from its full name, its short name (AG-RotA, ...) or its wire value."""
  by_short = {v.lower(): k for k, v in SHORT_NAMES.items()}
  if value.lower() in by_short:
    return by_short[value.lower()]
  if value.isdigit():
    return Schedule(int(value))
  return Schedule.parse(value)


def small_suite(scale: int = 1) -> list[tuple[Schedule, int, int, int]]:
  """(schedule, M, K, N): SMALL_SHAPES, AG-RotA's then RS-TilA's."""
  return [(s, m // scale, k // scale, n // scale)
          for s, shapes in SMALL_SHAPES.items() for m, k, n in shapes]


def suite(name: str, platform: str) -> list[tuple[Schedule, int, int, int]]:
  """The named suite's cases, scaled down on CPU."""
  if name == "small":
    return small_suite(CPU_SMALL_SUITE_SCALE if platform == "cpu" else 1)
  if name == "standard":
    return standard_suite(CPU_SUITE_SCALE if platform == "cpu" else 1)
  raise ValueError(f"suite: {name!r} is not one of {SUITES}")


def standard_suite(scale: int = 1) -> list[tuple[Schedule, int, int, int]]:
  """(schedule, M, K, N): every standard shape for AG-RotA and RS-TilA, the seed's for the rest."""
  out = []
  for schedule in (Schedule.AllGather1D_TilingCD_RotatingA,
                   Schedule.ReduceScatter1D_TilingA_RotatingC):
    out += [(schedule, m // scale, k // scale, n // scale) for m, k, n in STANDARD_SHAPES]
  for schedule in (Schedule.AllGather1D_TilingCD_RotatingB,
                   Schedule.ReduceScatter1D_TilingB_RotatingC):
    m, k, n = SEED_SHAPE
    out.append((schedule, m // scale, k // scale, n // scale))
  return out


# -- Cases ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark problem: global x [L, M, K] @ w [L, K, N] (no L dim when L == 1)."""

  schedule: Schedule
  m: int
  k: int
  n: int
  l: int = 1
  tp: int = 2
  dtype: str = "bfloat16"
  alpha: float = 1.0
  beta: float = 0.0

  @property
  def key(self) -> str:
    return f"{self.schedule.name}/L{self.l}/M{self.m}/K{self.k}/N{self.n}/TP{self.tp}"

  @property
  def label(self) -> str:
    batch = f" L={self.l}" if self.l > 1 else ""
    return f"{SHORT_NAMES[self.schedule]} {self.m},{self.k},{self.n}{batch}"

  @property
  def jdtype(self):
    return jnp.dtype(self.dtype)

  @property
  def flops(self) -> int:
    """All devices together."""
    return 2 * self.l * self.m * self.n * self.k

  @property
  def flops_per_device(self) -> float:
    return self.flops / self.tp

  def invalid_reason(self) -> str | None:
    """Why the global shape cannot be split over TP devices for this schedule (None: it can)."""
    s, tp = self.schedule, self.tp
    need = {"M": self.m, "N": self.n} if s.is_all_gather else {"K": self.k}
    if s == Schedule.ReduceScatter1D_TilingA_RotatingC:
      need["M"] = self.m
    if s == Schedule.ReduceScatter1D_TilingB_RotatingC:
      need["N"] = self.n
    bad = [f"{name}={v}" for name, v in need.items() if v % tp]
    if min(self.m, self.k, self.n, self.l) < 1:
      return "M, K, N and L must be positive"
    return f"{', '.join(bad)} not divisible by TP={tp} for {s.name}" if bad else None

  def _batch(self) -> tuple[int, ...]:
    return (self.l,) if self.l > 1 else ()

  def global_shapes(self):
    """(x, w, out) global shapes."""
    b = self._batch()
    return b + (self.m, self.k), b + (self.k, self.n), b + (self.m, self.n)

  def specs(self, axis: str = "tp"):
    """(x, w, out) PartitionSpecs of the global arrays (w carries the batch dims too)."""
    return self.schedule.partition_specs(axis, (None,) * len(self._batch()), w_batched=True)

  def ideal_shapes(self):
    """(x, w, out) of one device's share of the FLOPs, with no communication.

    AG-RotA: x[M, K] @ w[K, N/TP];  AG-RotB: x[M/TP, K] @ w[K, N];  RS: x[M, K/TP] @ w[K/TP, N].
    """
    b, m, k, n, tp = self._batch(), self.m, self.k, self.n, self.tp
    if self.schedule == Schedule.AllGather1D_TilingCD_RotatingA:
      m_, k_, n_ = m, k, n // tp
    elif self.schedule == Schedule.AllGather1D_TilingCD_RotatingB:
      m_, k_, n_ = m // tp, k, n
    else:
      m_, k_, n_ = m, k // tp, n
    return b + (m_, k_), b + (k_, n_), b + (m_, n_)

  def stage_shape(self) -> tuple[int, int, int]:
    """(m, k, n) of the local GEMM of one stage of the fused kernel (TP stages per call)."""
    m, k, n, tp = self.m, self.k, self.n, self.tp
    return {
        Schedule.AllGather1D_TilingCD_RotatingA: (m // tp, k, n // tp),
        Schedule.AllGather1D_TilingCD_RotatingB: (m // tp, k, n // tp),
        Schedule.ReduceScatter1D_TilingA_RotatingC: (m // tp, k // tp, n),
        Schedule.ReduceScatter1D_TilingB_RotatingC: (m, k // tp, n // tp),
    }[self.schedule]

  def as_dict(self) -> dict:
    return {"schedule": self.schedule.name, "short": SHORT_NAMES[self.schedule], "m": self.m,
            "k": self.k, "n": self.n, "l": self.l, "tp": self.tp, "dtype": self.dtype,
            "alpha": self.alpha, "beta": self.beta, "key": self.key,
            "flops_per_device": self.flops_per_device}


def parse_case(text: str) -> Case:
  """The tools' SCHEDULE:M,K,N (a schedule's full or short name, the global shape; TP=2, bf16).
  ValueError, naming the text and the rule, for a malformed entry or a shape the schedule
  cannot split over TP."""
  short, _, dims = text.partition(":")
  try:
    m, k, n = (int(v) for v in dims.split(","))
    case = Case(parse_schedule(short), m, k, n)
  except ValueError as e:
    raise ValueError(
        f"{text!r}: want SCHEDULE:M,K,N with a schedule name and three integers ({e})") from e
  if (why := case.invalid_reason()) is not None:
    raise ValueError(f"{text!r}: {why}")
  return case


def case_arg(text: str) -> str:
  """argparse type of the tools' --cases entries: parse_case's check as a usage error, before
  any device starts (the tools hand the text on, to children or to parse_case)."""
  try:
    parse_case(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from e
  return text


@dataclasses.dataclass
class Options:
  """Timing and data knobs (see bench.py's flags)."""

  iterations: int | None = None  # calls per repeat; None: enough for target_repeat_ms
  warmup: int = 5
  repeats: int = 7
  target_repeat_ms: float = 30.0
  # Untimed calls of the same row right before each of its timed repeats (~ this many ms, at
  # least one call; 0: none).  See time_interleaved.
  heat_ms: float = 30.0
  eps: float | None = None
  l2_bytes: int = 60 * 2**20
  rotation_budget_bytes: int = 8 * 2**30
  max_sets: int = 32
  seed: int = 0
  local_gemm: bool = False
  want: frozenset = frozenset(ROWS)
  # Calls in flight before a block_until_ready: 0 = all of a repeat (GPU); None = per platform
  # (see resolve_in_flight).
  max_in_flight: int | None = None
  # Calls per dispatched program (chained_program): > 1 where a call is too short for the host
  # to keep the GPU fed by one dispatch per call.
  calls_per_program: int = 1

  def eps_for(self, case: Case) -> float:
    return self.eps if self.eps is not None else DEFAULT_EPS[case.dtype]


# -- Devices ----------------------------------------------------------------------------------------

def resolve_in_flight(opts: Options, platform: str) -> Options:
  """max_in_flight=None becomes 1 on CPU and 0 (unbounded) elsewhere.

  XLA:CPU deadlocks (rendezvous timeout, then abort) when many multi-device programs with
  collectives are in flight at once (seen with jax 0.11.2 on 2 fake devices and 2 cores, for
  XLA's own all-gather and collective-permute as well as ours), so on CPU every call is
  synchronized; that is a smoke test anyway.
  """
  if opts.max_in_flight is not None:
    return opts
  return dataclasses.replace(opts, max_in_flight=1 if platform == "cpu" else 0)


def select_devices(tp: int):
  """The first `tp` devices of jax.devices(): GPUs if present, else fake CPU devices.

  Must run before anything initializes JAX's backends (it requests `tp` CPU devices, which only
  takes effect then; on a GPU machine that request is harmless).  Returns (devices, platform,
  note); note is None on GPU.
  """
  try:
    jax.config.update("jax_num_cpu_devices", max(int(tp), 1))
  except RuntimeError:
    pass  # backends already up: checked below
  devices = jax.devices()
  platform = devices[0].platform.lower()
  if len(devices) < tp:
    raise SystemExit(
        f"jax_distgemm.bench: --tp {tp} needs {tp} devices but jax.devices() has "
        f"{len(devices)} ({platform}); on CPU, the fake devices must be requested before JAX "
        "initializes its backends")
  note = None
  if platform == "cpu":
    note = (f"no GPU: running on {tp} fake CPU devices (jax_num_cpu_devices={tp}); the times "
            "measure the CPU executor and XLA:CPU, not a GPU -- a smoke test only")
  return list(devices[:tp]), platform, note


# -- Data -------------------------------------------------------------------------------------------

def rotation_sets(set_bytes: int, *, l2_bytes: int, budget_bytes: int, max_sets: int,
                  min_sets: int = 2) -> int:
  """How many input sets to rotate among (per-device bytes of one set -> count).

  Enough that the sets together exceed twice the L2 size (each call then reads buffers the
  previous calls evicted), at least `min_sets` so that consecutive calls never share a buffer,
  and at most what `budget_bytes` per device and `max_sets` allow (never fewer than one).
  """
  set_bytes = max(int(set_bytes), 1)
  want = max(min_sets, math.ceil(2 * l2_bytes / set_bytes))
  return max(1, min(want, max_sets, budget_bytes // set_bytes))


@functools.lru_cache(maxsize=64)
def _normal_fn(shape, dtype, scale, sharding):
  def f(key):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
  return jax.jit(f, out_shardings=sharding)


def random_array(key, shape, dtype, sharding, scale: float = 1.0):
  """Standard normal * scale, drawn on device straight into `sharding` (never zeros)."""
  return _normal_fn(tuple(shape), jnp.dtype(dtype), float(scale), sharding)(key)


def make_sets(key, count: int, x_shape, w_shape, c_shape, dtype, shardings):
  """`count` fresh (x, w[, c]) tuples; w is scaled by 1/sqrt(K) so outputs are O(1)."""
  xs, ws, cs = shardings
  scale_w = 1.0 / math.sqrt(x_shape[-1])
  sets = []
  for i in range(count):
    kx, kw, kc = jax.random.split(jax.random.fold_in(key, i), 3)
    s = (random_array(kx, x_shape, dtype, xs), random_array(kw, w_shape, dtype, ws, scale_w))
    if c_shape is not None:
      s += (random_array(kc, c_shape, jnp.float32, cs),)
    sets.append(s)
  jax.block_until_ready(sets)
  return sets


def _nbytes(shape, dtype) -> int:
  return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def rotating_sets(key, x_shape, w_shape, dtype, shardings, opts: Options):
  """Fresh random (x, w) sets, enough of them (rotation_sets, per device of `shardings[0]`)
  that consecutive calls miss in L2: the tools' way to draw a row's inputs."""
  nbytes = _nbytes(x_shape, dtype) + _nbytes(w_shape, dtype)
  shards = len(shardings[0].device_set)  # bytes per device of a sharded set
  count = rotation_sets(nbytes // shards, l2_bytes=opts.l2_bytes,
                        budget_bytes=opts.rotation_budget_bytes, max_sets=opts.max_sets)
  return make_sets(key, count, x_shape, w_shape, None, dtype, shardings)


def stacked_ideal_sets(key, count: int, case: Case, mesh: Mesh):
  """`count` fresh sets of one device's share (ideal_shapes, with c when beta != 0), stacked
  [TP, ...] and sharded over the mesh's "tp" axis: ideal_all_devices_fn's inputs."""
  xi, wi, oi = case.ideal_shapes()
  tp = case.tp
  stacked = NamedSharding(mesh, P("tp"))
  return make_sets(key, count, (tp,) + tuple(xi), (tp,) + tuple(wi),
                   (tp,) + tuple(oi) if case.beta != 0 else None, case.jdtype, (stacked,) * 3)


def stacked_rotating_sets(key, case: Case, mesh: Mesh, opts: Options):
  """stacked_ideal_sets with as many sets as rotation_sets gives one device's share (x and w;
  beta == 0): the tools' way to draw ideal_all_devices_fn's inputs, as rotating_sets is."""
  xi, wi, _ = case.ideal_shapes()
  count = rotation_sets(_nbytes(xi, case.jdtype) + _nbytes(wi, case.jdtype),
                        l2_bytes=opts.l2_bytes, budget_bytes=opts.rotation_budget_bytes,
                        max_sets=opts.max_sets)
  return stacked_ideal_sets(key, count, case, mesh)


def stage_rotating_sets(key, case: Case, device, opts: Options):
  """rotating_sets of `case`'s stage shape (x and w, batched when case.l > 1) on `device`: the
  operands of the local-GEMM ratio (XLA's dot of the stage shape against local_stage_fn)."""
  sm, sk, sn = case.stage_shape()
  b = (case.l,) if case.l > 1 else ()
  single = SingleDeviceSharding(device)
  return rotating_sets(key, b + (sm, sk), b + (sk, sn), case.jdtype, (single,) * 3, opts)


# -- Implementations --------------------------------------------------------------------------------

def distributed_fn(case: Case, mesh: Mesh, implementation: str | None):
  """jit(shard_map(jax_distgemm.distributed_matmul)) over global arrays."""
  x_spec, w_spec, out_spec = case.specs()
  with_c = case.beta != 0

  def body(x, w, c=None):
    return jax_distgemm.distributed_matmul(
        x, w, c, axis_name="tp", schedule=case.schedule, alpha=case.alpha, beta=case.beta,
        out_dtype=case.jdtype, implementation=implementation)

  in_specs = (x_spec, w_spec) + ((out_spec,) if with_c else ())
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec))


def auto_sharded_fn(case: Case, mesh: Mesh):
  """The reference formulation left to XLA's SPMD partitioner (what windowed einsum rewrites).

  x and w are NamedSharding'd global arrays; out = matmul (fp32 accumulation, as the reference)
  with the output sharding constrained, then the same epilogue.
  """
  x_spec, w_spec, out_spec = case.specs()
  out_sharding = NamedSharding(mesh, out_spec)

  def f(x, w, c=None):
    acc = jax.lax.with_sharding_constraint(reference.matmul_f32(x, w), out_sharding)
    return reference.epilogue(acc, c, alpha=case.alpha, beta=case.beta, out_dtype=case.jdtype)

  in_shardings = (NamedSharding(mesh, x_spec), NamedSharding(mesh, w_spec))
  if case.beta != 0:
    in_shardings += (out_sharding,)
  return jax.jit(f, in_shardings=in_shardings, out_shardings=out_sharding)


def ideal_fn(case: Case):
  """One device's GEMM, no communication: the floor the fused kernel tries to reach.

  With alpha == 1 and beta == 0 a plain dot with the output dtype (one cuBLAS call on GPU, fp32
  accumulation inside); otherwise the reference epilogue on an fp32 dot.
  """
  def f(x, w, c=None):
    if case.alpha == 1.0 and c is None:
      return jnp.matmul(x, w, preferred_element_type=case.jdtype)
    return reference.epilogue(reference.matmul_f32(x, w), c, alpha=case.alpha, beta=case.beta,
                              out_dtype=case.jdtype)
  return jax.jit(f)


def ideal_all_devices_fn(case: Case, mesh: Mesh):
  """ideal_fn on every device of the TP group at once: one program, no communication.

  Inputs are [TP, ...] stacks of per-device operands sharded over "tp".  This is the step a TP
  layer would take if communication were free: every GPU busy with its own share, the slowest
  one setting the time, with the same multi-device dispatch as ours.
  """
  inner = ideal_fn(case)

  def body(x, w, *c):
    return inner(x[0], w[0], *(ci[0] for ci in c))[None]

  n_in = 3 if case.beta != 0 else 2
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * n_in,
                               out_specs=P("tp")))


@jax.jit
def _rel_err(out, ref):
  o = out.astype(jnp.float32)
  r = ref.astype(jnp.float32)
  num = jnp.sqrt(jnp.sum(jnp.square(o - r)))
  return num / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(r))), jnp.float32(1e-30))


def rel_err(out, ref) -> float:
  """||out - ref||_F / ||ref||_F, computed on the devices (NaN anywhere gives NaN)."""
  return float(_rel_err(out, ref))


_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def hlo_summary(hlo_text: str) -> dict:
  """Collective counts, our custom call, and whether XLA built a windowed-einsum loop."""
  counts = {n: len(re.findall(rf"= [^=\n]*\b{n}(-start)?\(", hlo_text)) for n in _COLLECTIVES}
  counts["jax_distgemm"] = sum(hlo_text.count(t) for t in primitives.TARGETS)
  counts["windowed_einsum_loop"] = "windowed_dot_general" in hlo_text
  return counts


def stage_dot_fn(case: Case):
  """XLA's dot of `case`'s stage shape (alpha 1, beta 0: our stage GEMM's own problem), on
  stage_rotating_sets' operands: the baseline of the local-GEMM ratio."""
  return ideal_fn(dataclasses.replace(case, alpha=1.0, beta=0.0))


def local_stage_fn(case: Case, device):
  """Our stage GEMM of `case` alone: the fused op at TP=1 on `device`.  With a single rank its
  schedule is exactly one stage GEMM (autotuned like every stage), no peers, no waits.  Timed
  interleaved with XLA's dot on the same stage-shaped operands (the local-GEMM ratio)."""
  mesh1 = Mesh(np.array([device]), ("tp",))

  def stage(x, w):
    body = functools.partial(jax_distgemm.distributed_matmul, axis_name="tp",
                             schedule=Schedule.AllGather1D_TilingCD_RotatingA,
                             implementation="ffi", out_dtype=case.jdtype)
    return jax.shard_map(body, mesh=mesh1, in_specs=(P(), P()), out_specs=P(),
                         check_vma=False)(x, w)

  return stage


def local_all_devices_fn(case: Case, mesh: Mesh):
  """Our op at TP=1 on every device of `mesh` at once: each runs one device's share
  (ideal_shapes) as a single stage GEMM, no peers, no waits.  The counterpart of
  ideal_all_devices_fn (same [TP, ...] stacked inputs on the mesh's "tp" axis), for telling the
  kernel's cost under load on every GPU from the cost of the collective around it."""
  # A size-1 axis inside the stacked one: the op's group is one device.
  mesh1 = Mesh(np.asarray(mesh.devices).reshape(-1, 1), ("tp", "one"))

  def body(x, w):
    return jax_distgemm.distributed_matmul(
        x[0], w[0], axis_name="one", schedule=Schedule.AllGather1D_TilingCD_RotatingA,
        implementation="ffi", out_dtype=case.jdtype)[None]

  return jax.jit(jax.shard_map(body, mesh=mesh1, in_specs=(P("tp"), P("tp")),
                               out_specs=P("tp"), check_vma=False))


# -- Timing -----------------------------------------------------------------------------------------

def _describe(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  first = text[0] if text else ""
  if len(first) > 400:
    first = first[:400] + "..."
  return f"{type(e).__name__}: {first}"


def guarded(fn: Callable[[], Any]) -> tuple[Any, dict | None]:
  """Runs fn(); on failure returns (None, row) with status 'unsupported' or 'error' and why."""
  try:
    return fn(), None
  except NotImplementedError as e:
    return None, {"status": "unsupported", "reason": _describe(e)}
  except Exception as e:  # noqa: BLE001 - any failure of one implementation is reported
    return None, {"status": "error", "reason": _describe(e)}


@dataclasses.dataclass
class Timed:
  """One implementation being timed: a compiled callable and its rotating input sets."""

  name: str
  call: Callable
  sets: list
  iterations: int = 0  # programs per repeat (a program is per_program calls)
  heat_calls: int = 0  # untimed programs before each timed repeat
  per_program: int = 1  # calls per program (chained_program); times are per call
  pos: int = 0  # next set to use
  times: list = dataclasses.field(default_factory=list)
  # ms per call of each repeat's heat run: the row entered straight after another row.
  times_after_switch: list = dataclasses.field(default_factory=list)
  # (start, end) time.time() of each timed repeat: where GpuMonitor samples are this row's.
  windows: list = dataclasses.field(default_factory=list)
  failure: dict | None = None

  def run(self, count: int, max_in_flight: int = 0):
    """`count` back-to-back programs, then one block_until_ready (and one every
    max_in_flight)."""
    out = None
    for i in range(count):
      out = self.call(*self.sets[self.pos % len(self.sets)])
      self.pos += 1
      if max_in_flight and (i + 1) % max_in_flight == 0:
        jax.block_until_ready(out)
    jax.block_until_ready(out)

  def timed_run(self, count: int, max_in_flight: int = 0) -> float:
    """ms per call of `count` back-to-back programs (wall time up to the final block)."""
    t0 = time.perf_counter()
    self.run(count, max_in_flight)
    return (time.perf_counter() - t0) * 1e3 / (count * self.per_program)

  def estimate_call_ms(self, max_in_flight: int = 0, min_run_ms: float = 2.0) -> float:
    """One call's ms, for sizing repeats: the difference of two timed runs (k and 2k calls,
    k grown until k calls take >= min_run_ms), so that what a run costs once (the first
    call's dispatch, the final block) does not count per call.

    NOTE: the estimate was the time of 2 calls, which counts that fixed cost half per call: at
    0.2 ms calls on 2x H200 the repeats of one case then ran 7-26 ms of calls instead of the
    30 ms asked for, and a row with few calls per repeat carries more of the fixed cost in its
    per-call time (docs/performance.md, P6).
    """
    k, per = 2, self.per_program  # k programs of `per` calls
    first = self.timed_run(k, max_in_flight) * k * per
    while first < min_run_ms and k < 4096:
      k *= 4
      first = self.timed_run(k, max_in_flight) * k * per
    second = self.timed_run(2 * k, max_in_flight) * 2 * k * per
    diff = (second - first) / (k * per)
    # Noise can make the difference meaningless; never below half the plain per-call time.
    return max(diff, 0.5 * second / (2 * k * per))

  def first_output(self):
    """The output of the first call of the first program (on the first input set)."""
    return first_call_output(self.call(*self.sets[0]), self.per_program)


def chained_program(fn: Callable, sets: list, k: int):
  """(compiled, groups): `fn` applied to k input sets in one program, and the sets grouped k
  to a program (group j holds sets jk .. jk+k-1, modulo their number).  Call i+1 takes its
  inputs through an optimization_barrier with call i's output, as in a stack of dependent
  layers.  NOTE: XLA drops the barriers in compilation (no opt-barrier or control dependency
  is left in the compiled HLO on CPU or on one H200, performance.md W3), so the calls are in
  fact independent: a baseline's collectives may overlap another call's dot, which can only
  flatter the baselines; our custom calls run one after another on the stream anyway.
  k = 1: fn compiled as is, on the sets as they are.

  NOTE: below ~0.1 ms a call, one dispatch per call leaves the GPU idle between calls (XLA's
  dot idled 18-82 us per call at the decode stages on one H200, docs/performance.md W2), so
  the wall clock times the host; k calls per dispatch divide that by k.
  """
  if k == 1:
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*sets[0]).compile(), sets
  n = len(sets)
  groups = [tuple(sets[(j * k + i) % n] for i in range(k)) for j in range(max(1, n // k))]

  def program(*group):
    outs, prev = [], None
    for args in group:
      if prev is not None:
        prev, args = jax.lax.optimization_barrier((prev, args))
      prev = fn(*args)
      outs.append(prev)
    return outs

  return jax.jit(program).lower(*groups[0]).compile(), groups


def first_call_output(out, k: int):
  """The output of the first call of a chained_program (its groups[0][0] = sets[0])."""
  return out[0] if k > 1 else out


def chained_entry(name: str, fn: Callable, sets: list, k: int) -> Timed:
  """The Timed row of `fn` at k calls per program (chained_program)."""
  call, groups = chained_program(fn, sets, k)
  return Timed(name, call, groups, per_program=k)


def round_order(entries: list, seed: int, r: int) -> list:
  """Round r's order: a seeded shuffle, so that a row does not always follow the same row.

  NOTE: rotating one fixed order (as this did until 2026-11-30) keeps every row's predecessor
  the same in every round (the ideal always ran after jit_auto), so whatever a predecessor
  leaves behind (clocks, power, L2) biased a row the same way in every repeat
  (docs/performance.md, I1).
  """
  order = list(entries)
  random.Random(seed * 1_000_003 + r).shuffle(order)
  return order


def settle_call_trials(run_batch: Callable[[], Any], max_batches: int = 50):
  """Runs `run_batch` while a call trial (CUDA: long AllGather grids try two kernels in the
  call, design.md) is running and the batch moves it on, so that timing sees its verdict, not
  its alternation.  A row that feeds no trial stops after one batch."""
  for _ in range(max_batches):
    before = runtime.describe_tuning()
    if "call trial running" not in before:
      return
    run_batch()
    if runtime.describe_tuning() == before:
      return


def time_interleaved(entries: list[Timed], opts: Options, progress: Callable[[str], None]):
  """Warm-up, then `opts.repeats` rounds; in each round every live entry runs one repeat, in a
  shuffled order (round_order).

  Each repeat is preceded by ~opts.heat_ms of untimed calls of the same row, so that it is
  timed in the row's own sustained state (clocks, power cap), not in what the previous row
  left behind: these GPUs run GEMMs at their power cap, and a row entered from another can run
  its first milliseconds faster (ours by up to 12% on 2x H200, docs/performance.md I1).  The
  heat runs' own times are kept as `ms_after_switch` for comparison.
  """
  for e in entries:
    def warm(e=e):
      e.run(max(1, opts.warmup), opts.max_in_flight)
      settle_call_trials(lambda: e.run(20, opts.max_in_flight))
      program_ms = e.estimate_call_ms(opts.max_in_flight) * e.per_program
      e.heat_calls = (0 if opts.heat_ms <= 0 else
                      int(min(500, max(1, math.ceil(opts.heat_ms / max(program_ms, 1e-4))))))
      if opts.iterations:
        return max(1, math.ceil(opts.iterations / e.per_program))
      return int(min(500, max(10, math.ceil(opts.target_repeat_ms / max(program_ms, 1e-4)))))
    e.iterations, e.failure = guarded(warm)
  for r in range(opts.repeats):
    progress(f"repeat {r + 1}/{opts.repeats}")
    for e in round_order(entries, opts.seed, r):
      if e.failure:
        continue
      def one(e=e):
        if e.heat_calls:
          e.times_after_switch.append(e.timed_run(e.heat_calls, opts.max_in_flight))
        t0 = time.time()
        ms = e.timed_run(e.iterations, opts.max_in_flight)
        e.windows.append((t0, time.time()))
        return ms
      ms, e.failure = guarded(one)
      if ms is not None:
        e.times.append(ms)


def per_round_ratio(num: list[float], den: list[float]) -> dict | None:
  """num[r] / den[r] over the rounds both rows completed, as median and quartiles.

  time_interleaved appends one time per round to every live row, so index r is the same round:
  the two repeats ran close in time, under similar clocks, and their ratio is spared most of
  the drift between rounds that the ratio of the two medians carries.  None without a common
  round.
  """
  n = min(len(num), len(den))
  if n == 0:
    return None
  q25, med, q75 = np.percentile([a / b for a, b in zip(num[:n], den[:n])], [25, 50, 75])
  return {"median": float(med), "q25": float(q25), "q75": float(q75), "rounds": n}


def _timing_row(e: Timed) -> dict:
  if e.failure:
    return dict(e.failure)
  t = e.times
  return {"status": "ok", "reason": None, "ms": statistics.median(t), "ms_min": min(t),
          "ms_max": max(t), "spread": (max(t) - min(t)) / statistics.median(t),
          "ms_repeats": t, "calls_per_repeat": e.iterations * e.per_program,
          "calls_per_program": e.per_program,
          "rotation_sets": len(e.sets) * e.per_program, "heat_calls": e.heat_calls * e.per_program,
          "ms_after_switch": (statistics.median(e.times_after_switch)
                              if e.times_after_switch else None),
          "ms_after_switch_repeats": e.times_after_switch}


# -- One case ---------------------------------------------------------------------------------------

def run_case(case: Case, index: int, devices, opts: Options,
             progress: Callable[[str], None], monitor=None) -> dict:
  """Measures every requested row of `case`; returns {"rows": {...}, "data": {...}}.

  With a started gpu_monitor.GpuMonitor, every timed row also gets "gpu": per GPU, the median
  SM clock, power and temperature over its timed repeats.
  Every device array of the case is dropped before this returns (the seed's shape needs GiBs).
  """
  tuned_before = set(runtime.describe_tuning().splitlines())
  try:
    result = _measure_case(case, index, devices, opts, progress, monitor)
    # The kernel variants this case tuned (CUDA), one line per device and launch shape.
    result["data"]["tuning"] = [line for line in runtime.describe_tuning().splitlines()
                                if line not in tuned_before]
    return result
  finally:
    gc.collect()
    jax.clear_caches()


def _measure_case(case: Case, index: int, devices, opts: Options,
                  progress: Callable[[str], None], monitor=None) -> dict:
  want = opts.want
  rows: dict[str, dict] = {}
  mesh = Mesh(np.array(devices), ("tp",))
  x_spec, w_spec, out_spec = case.specs()
  shardings = tuple(NamedSharding(mesh, s) for s in (x_spec, w_spec, out_spec))
  xg, wg, og = case.global_shapes()
  c_shape = og if case.beta != 0 else None
  key = jax.random.fold_in(jax.random.key(opts.seed), index)
  tp, dt = case.tp, case.jdtype

  # Distributed input sets (bytes counted per device).
  set_bytes = (_nbytes(xg, dt) + _nbytes(wg, dt)) // tp + (
      _nbytes(og, jnp.float32) // tp if c_shape else 0)
  n_sets = rotation_sets(set_bytes, l2_bytes=opts.l2_bytes,
                         budget_bytes=opts.rotation_budget_bytes, max_sets=opts.max_sets)
  data = {"rotation_sets": n_sets, "set_bytes_per_device": set_bytes}

  entries: list[Timed] = []
  k = opts.calls_per_program
  dist_rows = [r for r in ("ffi", "auto", "reference", "xla", "jit_auto", "windowed_einsum")
               if r in want]
  sets = None
  ref_out = None
  if dist_rows:
    progress(f"drawing {n_sets} input sets ({_fmt_bytes(set_bytes)} per device each)")
    sets, sets_failure = guarded(
        lambda: make_sets(jax.random.fold_in(key, 0), n_sets, xg, wg, c_shape, dt, shardings))
    if sets_failure:
      rows.update({name: dict(sets_failure, reason=f"input sets: {sets_failure['reason']}")
                   for name in dist_rows})
      dist_rows = []
  if dist_rows:
    # The reference output every other implementation is checked against.
    progress("reference output")
    ref_call, fail = guarded(
        lambda: distributed_fn(case, mesh, "reference").lower(*sets[0]).compile())
    if fail is None:
      ref_out, fail = guarded(lambda: jax.block_until_ready(ref_call(*sets[0])))
    ref_failure = fail
    for name in dist_rows:
      progress(f"compiling {name}")
      impl = {"ffi": "ffi", "auto": None, "reference": "reference", "xla": "xla"}.get(name)

      def compile_(name=name, impl=impl):
        if name == "reference" and ref_failure is None and k == 1:
          entry = Timed(name, ref_call, sets)
        else:
          fn = (auto_sharded_fn(case, mesh) if name in ("jit_auto", "windowed_einsum") else
                distributed_fn(case, mesh, impl))
          entry = chained_entry(name, fn, sets, k)
        return entry, hlo_summary(entry.call.as_text() or "")

      got, fail = guarded(compile_)
      if fail:
        rows[name] = fail
        continue
      entry, hlo = got
      extra: dict[str, Any] = {"hlo": hlo}
      if name == "auto":
        # The ring moves its operands by collective-permute, the reference by one collective.
        extra["resolved"] = ("ffi" if hlo["jax_distgemm"] else
                             "xla" if hlo["collective-permute"] else "reference")
      if name in ("jit_auto", "windowed_einsum"):
        extra["windowed_einsum_loop"] = hlo["windowed_einsum_loop"]
        if name == "windowed_einsum" and not hlo["windowed_einsum_loop"]:
          extra["note"] = ("XLA did not rewrite this into a windowed einsum (no "
                           "windowed_dot_general loop in the compiled HLO); timed as compiled")
      # Correctness vs the reference, on set 0.
      if name != "reference":
        def check(entry=entry):
          out = entry.first_output()
          if ref_out is None:
            jax.block_until_ready(out)
            return None
          return rel_err(out, ref_out)
        err, fail = guarded(check)
        if fail:
          rows[name] = fail
          continue
        extra["rel_err"] = err
        if ref_out is None:
          extra["rel_err_note"] = f"no reference output: {ref_failure['reason']}"
      else:
        extra["rel_err"] = 0.0
      rows[name] = {"status": "pending", **extra}
      entries.append(entry)
    ref_out = None  # the seed shape's output is GiBs per device: not kept while timing

  if "ideal" in want:
    single = SingleDeviceSharding(devices[0])
    xi, wi, oi = case.ideal_shapes()
    ci = oi if case.beta != 0 else None
    ideal_bytes = _nbytes(xi, dt) + _nbytes(wi, dt) + (_nbytes(oi, jnp.float32) if ci else 0)
    n_ideal = rotation_sets(ideal_bytes, l2_bytes=opts.l2_bytes,
                            budget_bytes=opts.rotation_budget_bytes, max_sets=opts.max_sets)
    data.update(ideal_shapes={"x": list(xi), "w": list(wi), "out": list(oi)},
                ideal_rotation_sets=n_ideal, ideal_set_bytes=ideal_bytes)
    progress("ideal: drawing inputs, compiling")

    def prep_ideal():
      s = make_sets(jax.random.fold_in(key, 1), n_ideal, xi, wi, ci, dt, (single,) * 3)
      return chained_entry("ideal", ideal_fn(case), s, k)

    entry, fail = guarded(prep_ideal)
    if fail:
      rows["ideal"] = fail
    else:
      rows["ideal"] = {"status": "pending"}
      entries.append(entry)

    if tp > 1:  # the same per-device operands, stacked [TP, ...] over the mesh
      progress("ideal on every device: drawing inputs, compiling")

      def prep_mesh_ideal():
        s = stacked_ideal_sets(jax.random.fold_in(key, 3), n_ideal, case, mesh)
        return chained_entry("ideal_all_devices", ideal_all_devices_fn(case, mesh), s, k)

      entry, fail = guarded(prep_mesh_ideal)
      if fail:
        data["ideal_all_devices"] = fail
      else:
        entries.append(entry)

  if opts.local_gemm:
    sm, sk, sn = case.stage_shape()
    progress("local GEMM: XLA dot on the stage shape")

    def prep_stage():
      s = stage_rotating_sets(jax.random.fold_in(key, 2), case, devices[0], opts)
      return s, chained_entry("local_xla_dot", stage_dot_fn(case), s, k)

    got, fail = guarded(prep_stage)
    data["local_gemm"] = {"stage_shape": [sm, sk, sn]}
    if fail:
      data["local_gemm"].update(fail)
    else:
      stage_sets, entry = got
      # Both sides of the ratio in the same rounds as the rows (same clocks and heat).
      entries.append(entry)
      ours, fail = guarded(lambda: chained_entry(
          "local_cutlass", local_stage_fn(case, devices[0]), stage_sets, k))
      if fail:
        data["local_gemm"]["ratio_failure"] = fail
      else:
        entries.append(ours)

  time_interleaved(entries, opts, lambda msg: progress(f"timing: {msg}"))
  gpu = {e.name: monitor.stats(e.windows) for e in entries} if monitor is not None else {}
  local = {e.name: e for e in entries if e.name.startswith("local_")}
  for e in entries:
    if e.name == "ideal_all_devices":
      data["ideal_all_devices"] = {**_timing_row(e), "gpu": gpu.get(e.name)}
      continue
    if e.name in local:
      continue
    rows[e.name] = {**{k: v for k, v in rows[e.name].items() if k != "status"},
                    **_timing_row(e), "gpu": gpu.get(e.name)}

  if "local_xla_dot" in local:
    lg = data["local_gemm"]
    xla, ours = local["local_xla_dot"], local.get("local_cutlass")
    lg["xla_dot"] = _timing_row(xla)
    ratio = None
    if not xla.failure:
      lg["xla_dot"]["tflops"] = (2 * case.l * math.prod(case.stage_shape()) /
                                 (lg["xla_dot"]["ms"] * 1e9))
    if ours is not None:
      lg["cutlass"] = _timing_row(ours)
      if ours.failure:
        lg["ratio_failure"] = dict(ours.failure)
      elif not xla.failure:
        ratio = lg["xla_dot"]["ms"] / lg["cutlass"]["ms"]
        # The same quantity paired by round (per_round_ratio), as the rows' efficiency_per_round:
        # the two ran back to back in each round, so a round's GPU-wide clock dip hits both.
        lg["ratio_per_round"] = per_round_ratio(xla.times, ours.times)
    lg["ratio"] = ratio
    lg["cutlass_ms"] = None if ratio is None else lg["cutlass"]["ms"]
    if ratio is None:
      lg["note"] = LOCAL_GEMM_NOTE

  return {"rows": rows, "data": data}


# -- Derived numbers --------------------------------------------------------------------------------

def finalize_case(case: Case, rows: dict, data: dict, opts: Options) -> dict:
  """Fills every row in (missing ones get a reason) and computes TFLOP/s, efficiency, speedup."""
  for name in ROWS:
    rows.setdefault(name, {"status": "skipped", "reason": "not requested (--impls)"})
  ideal_ms = rows["ideal"].get("ms")
  base = {n: rows[n]["ms"] for n in BASELINES if rows[n].get("status") == "ok"}
  best = min(base, key=base.get) if base else None
  best_ms = base[best] if best else None
  eps = opts.eps_for(case)
  for name, row in rows.items():
    if row.get("status") != "ok":
      continue
    ms = row["ms"]
    row["tflops_per_gpu"] = case.flops_per_device / (ms * 1e9)
    row["efficiency"] = ideal_ms / ms if ideal_ms else None
    row["speedup_vs_best_baseline"] = best_ms / ms if best_ms else None
  failures = []
  for name in GATED:
    row = rows[name]
    if row.get("status") == "error":
      failures.append(f"{name}: {row['reason']}")
      continue
    err = row.get("rel_err")
    if row.get("status") == "ok" and err is not None:
      ok = math.isfinite(err) and err <= eps
      row["correct"] = ok
      if not ok:
        failures.append(f"{name}: rel_err {err:.3g} > eps {eps:g}")
  ours = rows[OURS]
  mesh_ideal = data.get("ideal_all_devices") or {}
  mesh_ms = mesh_ideal.get("ms") if mesh_ideal.get("status") == "ok" else None
  return {
      "case": case.as_dict(),
      **data,
      "rows": rows,
      "ideal_ms": ideal_ms,
      "ideal_all_devices_ms": mesh_ms,
      "ours": OURS,
      "ours_ms": ours.get("ms"),
      "efficiency": ours.get("efficiency"),
      "efficiency_all_devices": (mesh_ms / ours["ms"]
                                 if mesh_ms and ours.get("status") == "ok" else None),
      # ideal / ours per round (per_round_ratio): the same quantity with less clock drift.
      "efficiency_per_round": (
          per_round_ratio(rows["ideal"].get("ms_repeats") or [], ours.get("ms_repeats") or [])
          if ideal_ms and ours.get("status") == "ok" else None),
      "speedup": ours.get("speedup_vs_best_baseline"),
      "best_baseline": best,
      "best_baseline_ms": best_ms,
      "rel_err": ours.get("rel_err"),
      "eps": eps,
      "passed": not failures,
      "failures": failures,
  }


# -- Windowed einsum child --------------------------------------------------------------------------

CHILD_FLAG = "--_child-windowed"


def run_windowed_child(argv: list[str], flags: tuple[str, ...],
                       progress: Callable[[str], None]) -> tuple[dict, str | None, str]:
  """Runs this bench in a child with `flags` added to XLA_FLAGS, timing only windowed einsum.

  Called before this process touches a device.  Returns ({case key: row}, failure reason or
  None, the child's XLA_FLAGS).
  """
  env = dict(os.environ)
  xla_flags = " ".join([env.get("XLA_FLAGS", "").strip(), *flags]).strip()
  env["XLA_FLAGS"] = xla_flags
  with tempfile.TemporaryDirectory(prefix="jax_distgemm_bench_") as tmp:
    path = os.path.join(tmp, "windowed_einsum.json")
    cmd = [sys.executable, "-m", "jax_distgemm.bench", *argv, CHILD_FLAG, path]
    progress(f"windowed einsum: child process with XLA_FLAGS={xla_flags!r}")
    tail: collections.deque = collections.deque(maxlen=8)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
      tail.append(line.rstrip())
      sys.stderr.write(f"  [windowed-einsum child] {line}")
      sys.stderr.flush()
    rc = proc.wait()
    results = {}
    if os.path.exists(path):
      with open(path) as f:
        results = json.load(f).get("cases", {})
  reason = None
  if rc != 0:
    reason = f"child process exited with code {rc}: " + " | ".join(
        t for t in tail if t)[-600:]
  return results, reason, xla_flags


def child_main(cases_fn: Callable[[str], list[Case]], tp: int, opts: Options, out_path: str):
  """The child's side: time windowed einsum for every case, writing results after each."""
  devices, platform, _ = select_devices(tp)
  cases = cases_fn(platform)
  opts = dataclasses.replace(resolve_in_flight(opts, platform),
                             want=frozenset({"windowed_einsum"}), local_gemm=False)
  out = {"platform": platform, "xla_flags": os.environ.get("XLA_FLAGS", ""), "cases": {}}
  for i, case in enumerate(cases):
    def progress(msg, i=i, case=case):
      print(f"[{i + 1}/{len(cases)}] {case.label}: {msg}", flush=True)
    got = run_case(case, i, devices, opts, progress)
    out["cases"][case.key] = got["rows"].get(
        "windowed_einsum", {"status": "error", "reason": "not measured"})
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(sanitize(out), f)
    os.replace(tmp, out_path)


# -- Reports ----------------------------------------------------------------------------------------

def sanitize(obj):
  """JSON-safe: non-finite floats become strings ('nan', 'inf')."""
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else str(obj)
  if isinstance(obj, dict):
    return {str(k): sanitize(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [sanitize(v) for v in obj]
  if isinstance(obj, (np.floating, np.integer)):
    return sanitize(obj.item())
  return obj


def environment(devices, platform: str, note: str | None) -> dict:
  import jaxlib
  return {
      "jax": jax.__version__,
      "jaxlib": getattr(jaxlib, "__version__", None),
      "jax_distgemm": jax_distgemm.__version__,
      "python": platform_mod.python_version(),
      "host": platform_mod.node(),
      "platform": platform,
      "devices": [str(d) for d in devices],
      "device_kind": devices[0].device_kind,
      "note": note,
      "cuda_executor_built": ffi_modules.has_cuda(),
      "cuda_import_error": (None if ffi_modules.cuda_import_error is None else
                            str(ffi_modules.cuda_import_error)),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }


def _fmt_rate(v) -> str:
  """TFLOP/s: one decimal where it matters (GPU), three significant digits when tiny (CPU)."""
  return "-" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.3g}")


def _fmt_bytes(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.1f} {unit}"
  return f"{n} B"


def _fmt(v, spec: str) -> str:
  return "-" if v is None else format(v, spec)


def gpu_clock_line(result: dict) -> str | None:
  """'GPU clock' line of a case block: per row with monitor data (the ideal alone, on every
  device, ours), each GPU's median SM clock and power over the row's timed repeats; None
  without any."""
  picks = [("ideal", result["rows"].get("ideal", {})),
           ("ideal on every device", result.get("ideal_all_devices") or {}),
           ("ours", result["rows"].get(OURS, {}))]
  parts = [f"{label} {gpu_monitor.format_stats(row['gpu'])}" for label, row in picks
           if row.get("gpu")]
  if not parts:
    return None
  return "   GPU clock (medians over the timed repeats): " + "; ".join(parts)


def case_block(result: dict, index: int, total: int) -> str:
  """The detailed table of one case: one line per implementation."""
  c = result["case"]
  lines = [
      f"== [{index}/{total}] {c['short']} ({c['schedule']})  M={c['m']} K={c['k']} N={c['n']}"
      + (f" L={c['l']}" if c["l"] > 1 else "")
      + f"  TP={c['tp']}  {c['dtype']}  alpha={c['alpha']:g} beta={c['beta']:g}",
      f"   {c['flops_per_device'] / 1e9:.4g} GFLOP per device; {result['rotation_sets']} "
      f"rotating input sets of {_fmt_bytes(result['set_bytes_per_device'])} per device",
      f"   {'implementation':<22} {'ms':>10} {'TFLOP/s/GPU':>12} {'eff':>6} {'speedup':>8} "
      f"{'rel.err':>9} {'spread':>7}  note",
  ]
  for name in ROWS:
    r = result["rows"][name]
    if r.get("status") == "ok":
      note = []
      if "resolved" in r:
        note.append(f"resolved to {r['resolved']}")
      if "windowed_einsum_loop" in r:
        note.append("windowed loop in HLO" if r["windowed_einsum_loop"] else
                    "no windowed loop in HLO")
      if r.get("correct") is False:
        note.append("FAILED --eps")
      if r.get("rel_err_note"):
        note.append(r["rel_err_note"])
      err = r.get("rel_err")
      err_s = "-" if err is None or name == "reference" else (
          f"{err:.2e}" if isinstance(err, float) else str(err))
      lines.append(
          f"   {ROW_LABELS[name]:<22} {r['ms']:>10.4f} {_fmt_rate(r['tflops_per_gpu']):>12} "
          f"{_fmt(r.get('efficiency'), '.2f'):>6} "
          f"{_fmt(r.get('speedup_vs_best_baseline'), '.2f'):>8} {err_s:>9} "
          f"{r['spread'] * 100:>6.1f}%  {'; '.join(note)}")
    else:
      lines.append(f"   {ROW_LABELS[name]:<22} {'n/a':>10}  {r.get('status')}: {r.get('reason')}")
  clocks = gpu_clock_line(result)
  if clocks:
    lines.append(clocks)
  lg = result.get("local_gemm")
  if lg:
    x = lg.get("xla_dot", {})
    xs = (f"XLA dot {x['ms']:.4f} ms ({_fmt_rate(x.get('tflops'))} TFLOP/s)"
          if x.get("status") == "ok" else f"XLA dot n/a: {x.get('reason') or lg.get('reason')}")
    ratio = lg.get("ratio")
    who = lg.get("executor") or "ours"  # what ran our side (the JSON keeps "cutlass" for it)
    rs = f"ratio (xla/{who}) {ratio:.3f}" if ratio else f"ratio n/a ({lg.get('note', '')})"
    pr = lg.get("ratio_per_round")
    if ratio and pr:
      rs += f", per round {pr['median']:.3f} [{pr['q25']:.3f}-{pr['q75']:.3f}]"
    lines.append(f"   local GEMM, stage {tuple(lg['stage_shape'])}: {xs}; {rs}")
  mi = result.get("ideal_all_devices")
  if mi:
    lines.append(
        f"   ideal on all {c['tp']} devices at once: " +
        (f"{mi['ms']:.4f} ms; ours' efficiency against it "
         f"{_fmt(result.get('efficiency_all_devices'), '.2f')}" if mi.get("status") == "ok"
         else f"n/a ({mi.get('status')}: {mi.get('reason')})"))
  for line in result.get("tuning") or ():
    lines.append(f"   tuned: {line}")
  status = "PASS" if result["passed"] else "FAIL: " + "; ".join(result["failures"])
  best = result["best_baseline"]
  pr = result.get("efficiency_per_round")
  per_round = (f" (per round {pr['median']:.3f}, quartiles {pr['q25']:.3f}-{pr['q75']:.3f})"
               if pr else "")
  lines.append(
      f"   -> ours {_fmt(result['ours_ms'], '.4f')} ms, efficiency "
      f"{_fmt(result['efficiency'], '.2f')}{per_round}, "
      f"speedup {_fmt(result['speedup'], '.2f')} over "
      f"{best or 'no baseline'}; eps {result['eps']:g}: {status}")
  return "\n".join(lines)


def summary_table(results: list[dict]) -> str:
  """One line per case: ms of every implementation, then ours' TFLOP/s, efficiency, speedup."""
  head = (f"{'schedule':<8} {'M,K,N':<20} {'ideal':>9} {'ffi':>9} {'auto':>9} {'ref':>9} "
          f"{'ring':>9} {'win.ein':>9} {'jit':>9} {'TFLOP/s':>8} {'eff':>5} {'eff*':>5} "
          f"{'speedup':>7} {'best':<15} {'rel.err':>8}  check")
  lines = ["times in ms per call (median); TFLOP/s per GPU and eff (ideal/ours) and speedup "
           "(best baseline/ours) are for ffi (ours); eff* = the ideal run on every TP device at "
           "once / ours", head, "-" * len(head)]
  notes: dict[str, int] = {}
  for r in results:
    c, rows = r["case"], r["rows"]
    cells = []
    for name in ROWS:
      row = rows[name]
      if row.get("status") == "ok":
        cells.append(f"{row['ms']:>9.4f}")
      else:
        why = f"{name}: {row.get('status')}: {row.get('reason')}"
        mark = notes.setdefault(why, len(notes) + 1)
        cells.append(f"{'n/a[' + str(mark) + ']':>9}")
    ours = rows[OURS]
    err = r["rel_err"]
    err_s = f"{err:.1e}" if isinstance(err, float) else "-"
    shape = f"{c['m']},{c['k']},{c['n']}" + (f"x{c['l']}" if c["l"] > 1 else "")
    lines.append(
        f"{c['short']:<8} {shape:<20} {' '.join(cells)} "
        f"{_fmt_rate(ours.get('tflops_per_gpu')):>8} {_fmt(r['efficiency'], '.2f'):>5} "
        f"{_fmt(r.get('efficiency_all_devices'), '.2f'):>5} {_fmt(r['speedup'], '.2f'):>7} "
        f"{r['best_baseline'] or '-':<15} {err_s:>8}  "
        f"{'ok' if r['passed'] else 'FAIL'}")
  for why, mark in notes.items():
    lines.append(f"[{mark}] {why}")
  return "\n".join(lines)


def plot(results: list[dict], path: str, title: str) -> None:
  """Grouped bars: TFLOP/s per GPU of every implementation, per case."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [n for n in ROWS if any(r["rows"][n].get("status") == "ok" for r in results)]
  width = 0.8 / max(len(names), 1)
  fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(results) + 3), 5))
  xs = np.arange(len(results))
  for j, name in enumerate(names):
    vals = [r["rows"][name].get("tflops_per_gpu") or 0.0 for r in results]
    bars = ax.bar(xs + (j - (len(names) - 1) / 2) * width, vals, width, label=ROW_LABELS[name])
    if name == OURS:
      for b, r in zip(bars, results):
        if r["efficiency"]:
          ax.annotate(f"{r['efficiency']:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                      ha="center", va="bottom", fontsize=7)
  ax.set_xticks(xs)
  ax.set_xticklabels([f"{r['case']['short']}\n{r['case']['m']},{r['case']['k']},"
                      f"{r['case']['n']}" for r in results], fontsize=8)
  ax.set_ylabel("TFLOP/s per GPU")
  ax.set_title(title + "  (label on ffi bars: efficiency = ideal / ours)", fontsize=9)
  ax.legend(fontsize=7, ncol=min(4, len(names)))
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120, format="png")  # the file named, whatever its suffix
  plt.close(fig)

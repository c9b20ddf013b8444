"""The four 1-D schedules of CUTLASS's Distributed GEMM (Python mirror of cc/schedules/ring_1d.h).

Used by the XLA ring implementation and by tests, which check this table against the C++ one.
See ring_1d.h for the diagrams.  Notation: x [M, K] @ w [K, N], TP devices, TP stages.
"""

from __future__ import annotations

import enum


class Schedule(enum.IntEnum):
  """Schedules, with the names and wire values of the seed (CUTLASS example 65)."""

  # x rows-sharded, w cols-sharded -> out = all_gather(x) @ w, cols-sharded.
  AllGather1D_TilingCD_RotatingA = 0
  # x rows-sharded, w cols-sharded -> out = x @ all_gather(w), rows-sharded.
  AllGather1D_TilingCD_RotatingB = 1
  # x, w sharded on K -> out = reduce_scatter(x @ w) over rows.
  ReduceScatter1D_TilingA_RotatingC = 2
  # x, w sharded on K -> out = reduce_scatter(x @ w) over columns.
  ReduceScatter1D_TilingB_RotatingC = 3

  @property
  def is_all_gather(self) -> bool:
    return self in (Schedule.AllGather1D_TilingCD_RotatingA,
                    Schedule.AllGather1D_TilingCD_RotatingB)

  def partition_specs(self, axis: str = "tp", batch: tuple = (), w_batched: bool = False):
    """(x, w, out) PartitionSpecs of the global arrays this schedule takes and gives.

    x is [*batch, M, K], w is [K, N] (or [*batch, K, N] with `w_batched`), out is [*batch, M, N];
    `axis` is the TP mesh axis; `batch` has one entry per leading batch dim: None, or the mesh
    axes that shard it (w takes the same entries).
    """
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    b = tuple(batch)
    wb = b if w_batched else ()
    if self.is_all_gather:  # x rows-sharded, w columns-sharded
      x, w = P(*b, axis, None), P(*wb, None, axis)
    else:  # both sharded on K
      x, w = P(*b, None, axis), P(*wb, axis, None)
    rows_sharded_out = self in (Schedule.AllGather1D_TilingCD_RotatingB,
                                Schedule.ReduceScatter1D_TilingA_RotatingC)
    out = P(*b, axis, None) if rows_sharded_out else P(*b, None, axis)
    return x, w, out

  @classmethod
  def parse(cls, value: "Schedule | str | int") -> "Schedule":
    if isinstance(value, Schedule):
      return value
    if isinstance(value, str):
      try:
        return cls[value]
      except KeyError:
        raise ValueError(
            f"schedule: unknown name {value!r}; expected one of "
            f"{[s.name for s in cls]}") from None
    if isinstance(value, int) and not isinstance(value, bool) and value in set(cls):
      return cls(value)
    raise ValueError(f"schedule: expected a Schedule, one of the names "
                     f"{[s.name for s in cls]} or their numbers 0-{len(cls) - 1}, got {value!r}")


def output_tile(schedule: Schedule, d: int, i: int, tp: int) -> int:
  """Output tile (row/column block) device d writes at stage i."""
  if schedule.is_all_gather:
    return (d + i) % tp
  return (d - 1 - i) % tp


def source(schedule: Schedule, d: int, i: int, tp: int) -> int:
  """Device whose shard (AllGather) or running sum (ReduceScatter) d consumes at stage i."""
  if schedule.is_all_gather:
    return (d + i) % tp
  return (d - 1) % tp


def push_target(schedule: Schedule, d: int, i: int, tp: int) -> int:
  """Device that consumes d's shard at its stage i (AG) / d's running sum of stage i (RS)."""
  if schedule.is_all_gather:
    return (d - i) % tp
  return (d + 1) % tp


def table(schedule: Schedule, tp: int) -> list[tuple[int, int, int, int, int]]:
  """(device, stage, output_tile, source, push_target) for every device and stage."""
  return [(d, i, output_tile(schedule, d, i, tp), source(schedule, d, i, tp),
           push_target(schedule, d, i, tp)) for d in range(tp) for i in range(tp)]


def output_shape(schedule: Schedule, x_shape, w_shape, tp: int) -> tuple[int, ...]:
  """Per-device output shape of `schedule` for per-device operand shapes."""
  batch, xm, wn = tuple(x_shape[:-2]), x_shape[-2], w_shape[-1]
  if schedule == Schedule.AllGather1D_TilingCD_RotatingA:
    return batch + (xm * tp, wn)
  if schedule == Schedule.AllGather1D_TilingCD_RotatingB:
    return batch + (xm, wn * tp)
  if schedule == Schedule.ReduceScatter1D_TilingA_RotatingC:
    return batch + (xm // tp, wn)
  return batch + (xm, wn // tp)


def gathered_shape(schedule: Schedule, x_shape, w_shape, tp: int) -> tuple[int, ...]:
  """Per-device shape of an AllGather schedule's gathered operand (return_gathered): x with TP
  times its rows (RotatingA), or w with TP times its columns (RotatingB)."""
  if schedule == Schedule.AllGather1D_TilingCD_RotatingA:
    return tuple(x_shape[:-2]) + (x_shape[-2] * tp, x_shape[-1])
  return tuple(w_shape[:-1]) + (w_shape[-1] * tp,)

"""The Python schedule table (jax_distgemm/_src/schedules.py) equals the C++ one (ring_1d.h).

The XLA ring follows the Python table and the CPU/CUDA executors follow the C++ one, so the two
must agree entry for entry.  The property tests check what the tables must mean, so that a bug
made identically on both sides still fails here.
"""

import os
import re

import test_util  # noqa: F401  (first: configures JAX before it initializes)

from absl.testing import absltest
from absl.testing import parameterized

from jax_distgemm import Schedule
from jax_distgemm._src import schedules
from jax_distgemm.ffi import _distgemm_cpu

TPS = tuple(range(1, 9))
ALL_GATHER = (Schedule.AllGather1D_TilingCD_RotatingA, Schedule.AllGather1D_TilingCD_RotatingB)
REDUCE_SCATTER = (Schedule.ReduceScatter1D_TilingA_RotatingC,
                  Schedule.ReduceScatter1D_TilingB_RotatingC)
RING_1D_H = os.path.join(os.path.dirname(__file__), os.pardir, "cc", "schedules", "ring_1d.h")


def _by_device_stage(table):
  """{(device, stage): (output_tile, source, push_target)}."""
  return {(d, i): (tile, src, push) for d, i, tile, src, push in table}


class ScheduleTableTest(parameterized.TestCase):

  @parameterized.product(schedule=tuple(Schedule), tp=TPS)
  def test_python_table_equals_cpp_table(self, schedule, tp):
    cpp = [tuple(e) for e in _distgemm_cpu.schedule_table(int(schedule), tp)]
    py = schedules.table(schedule, tp)
    self.assertLen(cpp, tp * tp)
    self.assertEqual(py, cpp)

  def test_wire_values_match_the_cpp_enum(self):
    # The `schedule` FFI attribute is int(Schedule); the C++ side decodes it with ScheduleKind.
    with open(RING_1D_H) as f:
      header = f.read()
    cpp = {name: int(value)
           for name, value in re.findall(r"\bk(\w+_Rotating\w)\s*=\s*(\d+)", header)}
    self.assertEqual(cpp, {s.name: int(s) for s in Schedule})

  def test_all_gather_and_reduce_scatter_tables_differ(self):
    # Guards the equality test above against a binding that ignores its schedule argument.
    for tp in (2, 3, 4):
      tables = {s: tuple(_distgemm_cpu.schedule_table(int(s), tp)) for s in Schedule}
      self.assertNotEqual(tables[ALL_GATHER[0]], tables[REDUCE_SCATTER[0]])

  @parameterized.product(schedule=ALL_GATHER, tp=TPS)
  def test_all_gather_consumes_every_shard_and_writes_every_tile_once(self, schedule, tp):
    t = _by_device_stage(_distgemm_cpu.schedule_table(int(schedule), tp))
    for d in range(tp):
      sources = [t[d, i][1] for i in range(tp)]
      tiles = [t[d, i][0] for i in range(tp)]
      self.assertCountEqual(sources, range(tp), f"device {d}: shards consumed")
      self.assertCountEqual(tiles, range(tp), f"device {d}: tiles written")
      # The tile written is the one of the shard consumed (row block of x or column block of w).
      self.assertEqual(tiles, sources)
      self.assertEqual(t[d, 0][1], d, "stage 0 uses the local shard (no wait)")
    for i in range(tp):
      # At every stage the devices read distinct shards: each shard has one reader per stage.
      self.assertCountEqual([t[d, i][1] for d in range(tp)], range(tp), f"stage {i}")

  @parameterized.product(schedule=ALL_GATHER, tp=TPS)
  def test_all_gather_push_target_inverts_source(self, schedule, tp):
    t = _by_device_stage(_distgemm_cpu.schedule_table(int(schedule), tp))
    for d in range(tp):
      for i in range(tp):
        src = t[d, i][1]
        # Device src pushes its shard, for stage i, to exactly the device that reads it then.
        self.assertEqual(t[src, i][2], d, f"device {d}, stage {i}, source {src}")
        self.assertEqual(t[t[d, i][2], i][1], d, f"device {d}, stage {i}")

  @parameterized.product(schedule=REDUCE_SCATTER, tp=TPS)
  def test_reduce_scatter_ring(self, schedule, tp):
    t = _by_device_stage(_distgemm_cpu.schedule_table(int(schedule), tp))
    for d in range(tp):
      tiles = [t[d, i][0] for i in range(tp)]
      self.assertCountEqual(tiles, range(tp), f"device {d}: every partial computed once")
      self.assertEqual(t[d, tp - 1][0], d, f"device {d}: the last stage lands on tile d")
      for i in range(tp):
        self.assertEqual(t[d, i][1], (d - 1) % tp, "the source is the left neighbour")
        self.assertEqual(t[d, i][2], (d + 1) % tp, "the push target is the right neighbour")
        # push_target inverts source: the left neighbour hands its sum to d.
        self.assertEqual(t[t[d, i][1], i][2], d)
        if i > 0:
          # d adds the running sum its source produced one stage earlier for the same tile.
          self.assertEqual(t[t[d, i][1], i - 1][0], t[d, i][0], f"device {d}, stage {i}")
    for i in range(tp):
      self.assertCountEqual([t[d, i][0] for d in range(tp)], range(tp),
                            f"stage {i}: devices work on distinct tiles")


class PartitionSpecsTest(absltest.TestCase):
  """Schedule.partition_specs: the global shardings each schedule takes and gives (the tests,
  the benchmark and the examples place their arrays with it)."""

  def test_specs_per_schedule(self):
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415
    want = {  # (x, w, out) of x [M, K] @ w [K, N]
        Schedule.AllGather1D_TilingCD_RotatingA: (P("tp", None), P(None, "tp"), P(None, "tp")),
        Schedule.AllGather1D_TilingCD_RotatingB: (P("tp", None), P(None, "tp"), P("tp", None)),
        Schedule.ReduceScatter1D_TilingA_RotatingC: (P(None, "tp"), P("tp", None),
                                                     P("tp", None)),
        Schedule.ReduceScatter1D_TilingB_RotatingC: (P(None, "tp"), P("tp", None),
                                                     P(None, "tp")),
    }
    for schedule, specs in want.items():
      self.assertEqual(schedule.partition_specs(), specs, schedule.name)

  def test_batch_entries_and_batched_w(self):
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415
    rs_b = Schedule.ReduceScatter1D_TilingB_RotatingC
    self.assertEqual(rs_b.partition_specs("m", batch=("dp",)),
                     (P("dp", None, "m"), P("m", None), P("dp", None, "m")))
    self.assertEqual(rs_b.partition_specs("m", batch=(None, "dp"), w_batched=True),
                     (P(None, "dp", None, "m"), P(None, "dp", "m", None),
                      P(None, "dp", None, "m")))


if __name__ == "__main__":
  absltest.main()

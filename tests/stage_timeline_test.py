"""tools/stage_timeline.py's reduction of trace records to per-stage timelines (no GPU needed:
the records are synthetic; the GPU run itself is in docs/performance.md)."""

import argparse
import os
import sys

from absl.testing import absltest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import stage_timeline  # noqa: E402  pylint: disable=g-import-not-at-top


def rec(call, stage, chunk, start_us, ready_us, end_us, device=0):
  return (device, call, stage, chunk, int(start_us * 1e3), int(ready_us * 1e3),
          int(end_us * 1e3))


class SummarizeTest(absltest.TestCase):

  def test_offsets_spans_and_gaps(self):
    # Two calls of two stages each; the second stage of each waits 10 us for its peer.
    records = [
        rec(7, 0, 0, 1000, 1000, 1090), rec(7, 1, 0, 1088, 1100, 1190),
        rec(8, 0, 0, 1195, 1195, 1287), rec(8, 1, 0, 1285, 1297, 1391),
    ]
    t = stage_timeline._summarize(records, calls_wanted=10)["0"]
    self.assertEqual(t["calls"], 2)
    self.assertAlmostEqual(t["span_us"], (190 + 196) / 2)
    self.assertAlmostEqual(t["gap_us"], 5.0)  # only between consecutive epochs 7 -> 8
    s0, s1 = t["launches"]
    self.assertEqual((s0["stage"], s1["stage"]), (0, 1))
    self.assertAlmostEqual(s0["end"], (90 + 92) / 2)
    self.assertAlmostEqual(s1["start"], (88 + 90) / 2)
    self.assertAlmostEqual(s1["ready"], (100 + 102) / 2)

  def test_keeps_last_calls_per_device_and_drops_unwritten(self):
    records = [rec(c, 0, 0, 100 * c, 100 * c, 100 * c + 50, device=d)
               for d in (0, 1) for c in range(1, 6)]
    records.append((0, 6, 0, 0, 0, 0, 0))  # never ran (e.g. a timed-out call)
    out = stage_timeline._summarize(records, calls_wanted=3)
    self.assertEqual(sorted(out), ["0", "1"])
    self.assertEqual(out["0"]["calls"], 3)
    self.assertAlmostEqual(out["0"]["gap_us"], 50.0)
    self.assertAlmostEqual(out["1"]["span_us"], 50.0)

  def test_host_records(self):
    records = [rec(c, 0, 0, 100 * c + d, 100 * c + d, 100 * c + 50, device=d)
               for d in (0, 1) for c in range(1, 4)]
    records += [(0, -1, -1, 0, 1000 * c, 1000 * c, 1000 * c + 300) for c in range(1, 4)]
    out = stage_timeline._summarize(records, calls_wanted=10)
    self.assertAlmostEqual(out["0"]["host_us"], 0.3)
    self.assertAlmostEqual(out["0"]["host_period_us"], 1.0)
    self.assertIsNone(out["1"]["host_us"])
    self.assertEqual(len(out["0"]["launches"]), 1)  # host records are not launches

  def test_ready_never_before_start(self):
    # A launch without a flag wait may stamp "ready" from a CTA that started before the
    # last one: the report clamps it to the launch's start.
    t = stage_timeline._summarize([rec(1, 1, 0, 10, 5, 20)], 1)["0"]
    self.assertAlmostEqual(t["launches"][0]["ready"], 0.0)


class ReportTest(absltest.TestCase):

  def test_names_the_rank_order_when_devices_are_reversed(self):
    timeline = stage_timeline._summarize([rec(1, 0, 0, 10, 10, 100, device=1)], 1)
    result = {"case": "AG-RotA 64,32,16", "ranks": [1, 0], "ideal_ms": 0.1, "ours_ms": 0.125,
              "eff": 0.8, "timeline": timeline}
    text = stage_timeline.report("rev", [result])
    self.assertIn("ranks 0..: devices [1, 0]; the ideal on device 1", text)
    self.assertIn("device 1: span 90.0 us", text)
    result["ideal"] = "all"
    self.assertIn("the ideal on every device", stage_timeline.report("all", [result]))
    del result["ranks"]  # JSON of runs before --reverse-devices existed
    self.assertNotIn("ranks", stage_timeline.report("old", [result]))


class CaseArgTest(absltest.TestCase):

  def test_accepts_short_and_full_names(self):
    for text in ("AG-RotA:8192,4096,4096", "ReduceScatter1D_TilingA_RotatingC:64,32,16"):
      self.assertEqual(stage_timeline._case_arg(text), text)

  def test_rejects_before_launch_naming_the_rule(self):
    for text, needle in (("Nope:1,2,3", "schedule"), ("AG-RotA:1,2", "three integers"),
                         ("AG-RotA:a,b,c", "three integers"),
                         ("RS-TilA:8,3,8", "K=3 not divisible by TP=2")):
      with self.assertRaisesRegex(argparse.ArgumentTypeError, needle, msg=text):
        stage_timeline._case_arg(text)


if __name__ == "__main__":
  absltest.main()

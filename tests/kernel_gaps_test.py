"""tools/kernel_gaps.py's arithmetic and argument checks, without a GPU (the GPU run itself is
in docs/performance.md)."""

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import kernel_gaps  # noqa: E402  pylint: disable=g-import-not-at-top


class SummaryTest(absltest.TestCase):

  def test_busy_and_idle_per_call(self):
    # Two calls: kernels 0-10 and 8-20 overlap (busy 20), then a 5 us gap, 25-45.
    ev = [(0.0, 10.0, "a"), (8.0, 20.0, "b"), (25.0, 45.0, "a")]
    s = kernel_gaps.intervals_summary(ev, calls=2)
    self.assertEqual(s["kernels"], 3)
    self.assertAlmostEqual(s["busy_us_per_call"], 20.0)
    self.assertAlmostEqual(s["idle_us_per_call"], 2.5)
    self.assertAlmostEqual(s["median_gap_us"], 5.0)
    self.assertAlmostEqual(s["p90_gap_us"], 5.0)
    self.assertAlmostEqual(s["max_gap_us"], 5.0)
    self.assertEqual(s["gaps_over_20us"], 0)
    self.assertEqual(s["top_kernels"][0]["name"], "a")
    self.assertEqual(s["top_kernels"][0]["count"], 2)
    self.assertAlmostEqual(s["top_kernels"][0]["median_us"], 15.0)

  def test_long_stalls_show_in_the_tail(self):
    # Nine 2-us gaps and one 50-us stall between ten 10-us kernels.
    ev, t = [], 0.0
    for i in range(10):
      ev.append((t, t + 10.0, "k"))
      t += 10.0 + (50.0 if i == 4 else 2.0)
    s = kernel_gaps.intervals_summary(ev, calls=10)
    self.assertAlmostEqual(s["median_gap_us"], 2.0)
    self.assertAlmostEqual(s["max_gap_us"], 50.0)
    self.assertEqual(s["gaps_over_20us"], 1)
    self.assertAlmostEqual(s["idle_us_per_call"], (8 * 2.0 + 50.0) / 10)

  def test_no_kernels(self):
    self.assertEqual(kernel_gaps.intervals_summary([], calls=3), {"kernels": 0})

  def test_trace_is_split_by_device_and_keeps_kernels_only(self):
    trace = {"traceEvents": [
        {"cat": "kernel", "ts": 1.0, "dur": 2.0, "name": "k0", "args": {"device": 0}},
        {"cat": "kernel", "ts": 5.0, "dur": 1.0, "name": "k1", "args": {"device": 1}},
        {"cat": "gpu_memcpy", "ts": 1.0, "dur": 9.0, "name": "copy", "args": {"device": 0}},
        {"cat": "kernel", "ts": 7.0, "name": "no duration", "args": {"device": 0}},
        {"ph": "M", "name": "process_name"},
    ]}
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "t.json")
      with open(path, "w") as f:
        json.dump(trace, f)
      got = kernel_gaps.kernels_by_device(path)
    self.assertEqual(dict(got), {0: [(1.0, 3.0, "k0")], 1: [(5.0, 6.0, "k1")]})


class LocalRowsTest(absltest.TestCase):

  def test_rows_time_the_stage_shape_and_agree(self):
    # The --local rows on one (CPU) device: XLA's dot and our op at TP=1 on the stage shape
    # of the case (RS-TilA at TP=2: m/2, k/2, n), one extra row per --ours-env setting.
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax_distgemm._src import bench_lib as bl  # pylint: disable=g-import-not-at-top
    case = bl.parse_case("RS-TilA:256,128,512")
    env = [("JAX_DISTGEMM_GEMM_CONFIG", "7:1:1")]
    rows, sets = kernel_gaps.local_rows(jax, bl, case, jax.random.key(0), jax.devices()[0],
                                        bl.Options(), env)
    self.assertEqual([r[0] for r in rows],
                     ["local_xla_dot", "local_ffi", "local_ffi[JAX_DISTGEMM_GEMM_CONFIG=7:1:1]"])
    self.assertEqual(rows[2][3], dict(env))
    x, w = sets[0][:2]
    self.assertEqual((x.shape, w.shape), ((128, 64), (64, 512)))
    want = np.asarray(rows[0][1](*sets[0]), np.float32)
    got = np.asarray(rows[1][1](*sets[0]), np.float32)
    self.assertEqual(got.shape, (128, 512))
    self.assertGreater(np.abs(want).max(), 0.1)  # random operands, not zeros
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


class ArgsTest(parameterized.TestCase):

  def test_env_parses(self):
    self.assertEqual(kernel_gaps._env_arg("JAX_DISTGEMM_AG_JOIN=event"),
                     ("JAX_DISTGEMM_AG_JOIN", "event"))

  @parameterized.parameters("JAX_DISTGEMM_AG_JOIN", "OTHER=1", "=1")
  def test_bad_env_is_rejected(self, text):
    with self.assertRaises(argparse.ArgumentTypeError):
      kernel_gaps._env_arg(text)

  @parameterized.parameters((["--cases", "AG-RotA:8,8"],),
                            (["--cases", "AG-RotA:9,8,8"],),
                            (["--cases", "AG-RotA:8,8,8", "--calls", "1"],),
                            (["--cases", "AG-RotA:8,8,8", "--heat-ms", "-1"],),
                            (["--cases", "AG-RotA:8,8,8", "--local", "--copy-load"],))
  def test_bad_arguments_are_usage_errors(self, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as cm:
      kernel_gaps.main(argv)
    self.assertEqual(cm.exception.code, 2)
    self.assertIn("error:", err.getvalue())


if __name__ == "__main__":
  absltest.main()

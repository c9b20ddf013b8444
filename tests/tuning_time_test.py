"""tools/tuning_time.py on fake CPU devices: its arguments and its JSON (the GPU run itself is
in docs/performance.md, P4)."""

import contextlib
import io
import json
import os
import sys
import tempfile

from absl.testing import absltest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import tuning_time  # noqa: E402  pylint: disable=g-import-not-at-top


class TuningTimeTest(absltest.TestCase):

  def test_bad_arguments_name_the_rule(self):
    for argv, rule in ((["--shapes", "8,8"], "want M,K,N"),
                       (["--shapes", "8,0,8"], "must be >= 1"),
                       (["--shapes", "8,8,8", "--calls", "0"], "--calls must be >= 1")):
      err = io.StringIO()
      with self.subTest(argv=argv), contextlib.redirect_stderr(err):
        with self.assertRaises(SystemExit):
          tuning_time.main(argv)
        self.assertIn(rule, err.getvalue())

  def test_json_per_shape(self):
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "t.json")
      with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        tuning_time.main(["--shapes", "64,32,16", "16,64,32", "--calls", "3", "--json", path])
      with open(path) as f:
        data = json.load(f)
    self.assertEqual([r["shape"] for r in data["results"]], [[64, 32, 16], [16, 64, 32]])
    for r in data["results"]:
      self.assertGreater(r["compile_s"], 0)
      self.assertGreater(r["call_ms"], 0)
      self.assertAlmostEqual(r["tuning_s"], r["first_call_s"] - r["call_ms"] / 1e3, places=9)


if __name__ == "__main__":
  absltest.main()

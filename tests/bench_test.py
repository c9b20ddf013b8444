"""`python -m jax_distgemm.bench` on fake CPU devices: its flags, its report and its check.

Times on CPU mean nothing, so only the report's structure is checked: every row is measured or
says why not, efficiency and speedup are the ratios they claim to be, the JSON and the PNG are
written. The check itself is tested in this process by breaking one implementation on purpose.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

try:
  from tests import test_util as tu  # noqa: I001 - must precede JAX initialization
except ImportError:
  import test_util as tu

from absl.testing import absltest  # noqa: E402
from absl.testing import parameterized  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

import jax_distgemm  # noqa: E402
from jax_distgemm import bench  # noqa: E402
from jax_distgemm import bench_cases  # noqa: E402
from jax_distgemm import runtime  # noqa: E402
from jax_distgemm import Schedule  # noqa: E402
from jax_distgemm._src import implementation  # noqa: E402

TINY = ["--m", "64", "--k", "32", "--n", "128"]
FAST = ["--iterations", "2", "--repeats", "2", "--warmup-iterations", "1"]


def run_bench(args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jax_distgemm.bench", *args], env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


class ArgumentsTest(parameterized.TestCase):
  """Usage errors stop the run before anything is timed (exit status 2, argparse's)."""

  @parameterized.named_parameters(
      ("unknown_schedule", ["--schedule", "AG-Rot"], "--schedule: unknown 'AG-Rot'"),
      ("suite_and_shape", ["--suite", "--m", "64"], "--suite runs its own shapes"),
      ("schedule_not_in_suite", ["--suite", "small", "--schedule", "AG-RotB"], "has no case"),
      ("shape_tp_does_not_divide", ["--m", "65"], "M=65 not divisible by TP=2"),
      ("non_finite_alpha", ["--alpha", "nan"], "--alpha: must be finite"),
      ("zero_repeats", ["--repeats", "0"], "must be a number >= 1"),
      ("missing_directory", ["--json", "{tmp}/missing/out.json"], "does not exist"),
      ("directory", ["--json", "{tmp}"], "is a directory"),
      ("plot_not_png", ["--plot", "{tmp}/out.jpg"], "must end in .png"),
      ("json_and_plot_one_file", ["--json", "{tmp}/a.png", "--plot", "{tmp}/a.png"],
       "--json and --plot name the same file"),
      ("json_and_tuning_one_file", ["--json", "{tmp}/a", "--tuning-file", "{tmp}/./a"],
       "--json and --tuning-file name the same file"),
  )
  def test_usage_error(self, argv, message):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    stderr = io.StringIO()
    with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(stderr):
      bench.parse_args([a.format(tmp=tmp) for a in argv])
    self.assertEqual(cm.exception.code, 2)
    self.assertIn(message, stderr.getvalue())

  def test_schedules_and_cases(self):
    for text, want in (("RS-TilB", [Schedule.ReduceScatter1D_TilingB_RotatingC]),
                       ("AllGather1D_TilingCD_RotatingB", [Schedule(1)]), ("all", list(Schedule))):
      self.assertEqual(bench.parse_args(["--schedule", text]).schedules, want)
    # The seed's shape on GPU, a tiny one on CPU; the suites scaled down on CPU.
    args = bench.parse_args(["--schedule", "all"])
    self.assertEqual([(c.m, c.k, c.n) for c in bench.resolve_cases(args, "gpu")],
                     [bench_cases.SEED_SHAPE] * 4)
    self.assertEqual({(c.m, c.k, c.n) for c in bench.resolve_cases(args, "cpu")},
                     {bench_cases.CPU_SHAPE})
    self.assertLen(bench_cases.suite("standard"), 12)
    args = bench.parse_args(["--suite", "--schedule", "RS-TilA"])
    self.assertEqual([(c.m, c.k, c.n) for c in bench.resolve_cases(args, "gpu")],
                     list(bench_cases.STANDARD_SHAPES))
    args = bench.parse_args(["--suite", "small"])
    self.assertEqual([(c.schedule, c.m * 16, c.k * 16, c.n * 16)
                      for c in bench.resolve_cases(args, "cpu")], bench_cases.suite("small"))

  def test_windowed_einsum_formulation_matches_reference(self):
    # On CPU the windowed-einsum child skips it: check the formulation it times here.
    mesh = Mesh(np.array(tu.cpu_devices(2)), ("tp",))
    for schedule in Schedule:
      case = bench_cases.Case(schedule, 32, 16, 64, alpha=2.0, beta=0.5)
      shardings = [NamedSharding(mesh, s) for s in case.specs()]
      sets = bench_cases.draw_inputs(case, jax.random.key(0), "global", shardings, l2_bytes=0)
      self.assertLen(sets, 2)  # never the same buffer twice in a row
      ref = bench.compile_timed(bench_cases.distributed_fn(case, mesh, "reference"), sets, 1)
      got = bench.compile_timed(bench_cases.dot_fn(case, shardings[2]), sets, 2)  # 2 calls a program
      self.assertLess(float(bench._rel_err(got.first_output(), ref.first_output())), 1e-2)


class CheckTest(absltest.TestCase):
  """The --eps check against reference, and a row that cannot run: main() in this process."""

  def run_main(self, *patches):
    path = os.path.join(self.enter_context(tempfile.TemporaryDirectory()), "out.json")
    child = {"": {"status": "skipped", "reason": "not run by this test"}}
    with contextlib.ExitStack() as stack, contextlib.redirect_stdout(io.StringIO()) as out:
      stack.enter_context(mock.patch.object(bench, "run_windowed_child", return_value=child))
      for p in patches:
        stack.enter_context(p)
      rc = bench.main([*TINY, *FAST, "--json", path])
    with open(path) as f:
      return rc, json.load(f)["cases"][0], out.getvalue()

  def test_wrong_result_fails(self):
    real = jax_distgemm.distributed_matmul

    def off_by_half(*a, implementation=None, **kw):
      out = real(*a, implementation=implementation, **kw)
      return out * 1.5 if implementation == "ffi" else out

    rc, case, out = self.run_main(mock.patch.object(jax_distgemm, "distributed_matmul",
                                                    off_by_half))
    self.assertEqual(rc, 1)
    self.assertFalse(case["passed"])
    self.assertFalse(case["rows"]["ffi"]["correct"])
    self.assertGreater(case["rows"]["ffi"]["rel_err"], 0.3)
    self.assertTrue(case["rows"]["auto"]["correct"])
    self.assertTrue(case["rows"]["xla"]["correct"])
    self.assertIn("ffi: rel_err", case["failures"][0])
    self.assertIn("FAIL AG-RotA 64,32,128: ffi: rel_err", out)

  def test_unsupported_row_is_reported_not_fatal(self):
    rc, case, out = self.run_main(mock.patch.object(implementation, "ffi_unsupported_reason",
                                                    return_value="forced by the test"))
    self.assertEqual(rc, 0, out)
    self.assertTrue(case["passed"], case["failures"])
    ffi = case["rows"]["ffi"]
    self.assertEqual(ffi["status"], "unsupported")
    self.assertIn("forced by the test", ffi["reason"])
    self.assertEqual(case["rows"]["auto"]["resolved"], "xla")
    self.assertIsNone(case["efficiency"])
    self.assertIn("ffi: unsupported: NotImplementedError", out)


@pytest.mark.slow
class BenchRunTest(absltest.TestCase):
  """One run of a single case in a child process: every row, --local-gemm, --json, --plot and
  --tuning-file (absent at first: nothing to load, and no GPU, so nothing to save but an empty
  file)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.json, cls.png, cls.tuning = (os.path.join(cls.tmp.name, name)
                                     for name in ("out.json", "out.png", "tuning.json"))
    cls.proc = run_bench([*TINY, *FAST, "--schedule", "RS-TilA", "--local-gemm", "--json",
                          cls.json, "--plot", cls.png, "--tuning-file", cls.tuning])

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    self.assertEqual(self.proc.returncode, 0, self.proc.stdout + self.proc.stderr[-3000:])
    with open(self.json) as f:
      self.data = json.load(f)

  def test_every_row_measured_or_explained(self):
    self.assertTrue(self.data["complete"])
    self.assertTrue(self.data["passed"])
    self.assertEqual(self.data["meta"]["platform"], "cpu")
    (case,) = self.data["cases"]
    rows = case["rows"]
    self.assertEqual(list(rows), list(bench.ROWS))
    for name in ("ideal", "ffi", "auto", "reference", "xla"):
      self.assertGreater(rows[name]["ms"], 0, name)
      self.assertLen(rows[name]["ms_repeats"], 2)
      self.assertGreaterEqual(rows[name]["input_sets"], 2)
    self.assertEqual(rows["windowed_einsum"]["status"], "skipped")  # the child ran, on CPU
    self.assertIn("no GPU", rows["windowed_einsum"]["reason"])
    for name in bench.CHECKED:
      self.assertTrue(rows[name]["correct"], name)
      self.assertLessEqual(rows[name]["rel_err"], case["eps"])
    ours = rows["ffi"]["ms"]
    self.assertAlmostEqual(case["efficiency"], rows["ideal"]["ms"] / ours)
    best = min(("reference", "xla"), key=lambda n: rows[n]["ms"])
    self.assertEqual(case["best_baseline"], best)
    self.assertAlmostEqual(case["speedup"], rows[best]["ms"] / ours)

  def test_table(self):
    out = self.proc.stdout
    self.assertIn("fake CPU devices", out)
    self.assertRegex(out, r"RS-TilA 64,32,128 .* ok\n")
    self.assertIn("windowed_einsum: skipped: no GPU", out)
    self.assertIn("local GEMM, stage 32,16,128: XLA dot", out)

  def test_local_gemm(self):
    lg = self.data["cases"][0]["local_gemm"]
    self.assertEqual(lg["stage_shape"], [32, 16, 128])  # RS-TilA: (M/TP, K/TP, N)
    self.assertEqual(lg["executor"], "cpu executor")
    self.assertAlmostEqual(lg["ratio"], lg["xla_ms"] / lg["ours_ms"])

  def test_plot_and_tuning_file_written(self):
    with open(self.png, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    self.assertEqual(runtime.load_tuning(self.tuning), 0)  # a valid file, with no choice
    self.assertEqual(self.data["meta"]["tuning_saved"], 0)


@pytest.mark.slow
class Fp8RunTest(absltest.TestCase):
  """--dtype fp8: each device quantizes its shards; every row runs and is checked (ffi: the CPU
  executor's fp8 target); block scaling refuses shapes without whole blocks."""

  def test_block_scaled_run(self):
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "out.json")
      # RS-TilB: block scales sliced per stage (N/TP of w's columns).
      proc = run_bench(["--m", "64", "--k", "256", "--n", "256", *FAST, "--dtype", "fp8",
                        "--scaling", "block", "--schedule", "RS-TilB", "--json", out])
      self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr[-3000:])
      with open(out) as f:
        data = json.load(f)
    self.assertLen(data["cases"], 1)
    for case in data["cases"]:
      rows = case["rows"]
      self.assertEqual(case["case"]["scaling"], "block")
      for name in ("ideal", "ffi", "auto", "reference", "xla"):
        self.assertGreater(rows[name]["ms"], 0, name)
      for name in ("ffi", "auto", "xla"):
        self.assertLessEqual(rows[name]["rel_err"], case["eps"], name)
      self.assertEqual(rows["auto"]["resolved"], "ffi")  # None on CPU: the executor

  def test_usage(self):
    proc = run_bench([*TINY, "--scaling", "block"])
    self.assertEqual(proc.returncode, 2)
    self.assertIn("--scaling: only with --dtype fp8", proc.stderr)
    proc = run_bench([*TINY, "--dtype", "fp8", "--scaling", "block", "--schedule", "RS-TilA"])
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("block scaling needs the local contraction dim K=16 to be a multiple of 128",
                  proc.stdout + proc.stderr)


class ListTest(absltest.TestCase):

  def test_small_suite_list(self):
    proc = run_bench(["--suite", "small", "--list"])
    self.assertEqual(proc.returncode, 0, proc.stderr)
    want = [bench_cases.Case(s, m, k, n).label for s, m, k, n in bench_cases.suite("small", 16)]
    self.assertEqual(proc.stdout.splitlines()[1:], want)  # after the CPU note
    self.assertNotIn("windowed einsum", proc.stderr)  # --list starts no child


if __name__ == "__main__":
  absltest.main()

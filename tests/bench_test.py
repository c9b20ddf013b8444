"""`python -m jax_distgemm.bench` on fake CPU devices: it runs, and its report adds up.

The end-to-end tests run the bench in a subprocess (JAX_PLATFORMS=cpu, tiny shapes, all four
schedules, the windowed-einsum child included) and check the JSON it writes: every row of every
case is there, either measured (positive numbers) or with the reason it is not; efficiency is
ideal / ours and speedup is best baseline / ours; the table is printed.  The in-process tests
cover what a CPU run cannot show by itself: an implementation that raises NotImplementedError
is reported, not fatal, and the --eps gate fails a case.  Timings on CPU mean nothing; only
the structure is checked.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

try:
  from tests import test_util as tu  # noqa: I001 - must precede JAX initialization
except ImportError:
  import test_util as tu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from absl.testing import absltest  # noqa: E402

from jax_distgemm._src import api  # noqa: E402
from jax_distgemm._src import bench_lib as bl  # noqa: E402
from jax_distgemm._src import gpu_monitor  # noqa: E402
from jax_distgemm._src.schedules import Schedule  # noqa: E402

TINY = ["--m", "64", "--k", "32", "--n", "128"]
FAST = ["--iterations", "2", "--repeats", "2", "--warmup-iterations", "1"]


def run_bench(args, timeout=900):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jax_distgemm.bench", *args], env=env,
                        capture_output=True, text=True, timeout=timeout)


def _have_matplotlib() -> bool:
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return False
  return True


class BenchEndToEndTest(absltest.TestCase):
  """One bench run (4 schedules, every row, --local-gemm), shared by the checks below."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.json_path = os.path.join(cls.tmp.name, "bench.json")
    cls.png_path = os.path.join(cls.tmp.name, "bench.png")
    cls.tuning_path = os.path.join(cls.tmp.name, "tuning.json")  # absent: only written
    args = [*TINY, *FAST, "--schedule", "all", "--local-gemm", "--json", cls.json_path,
            "--tuning-file", cls.tuning_path]
    if _have_matplotlib():
      args += ["--plot", cls.png_path]
    cls.proc = run_bench(args)
    cls.data = None
    if os.path.exists(cls.json_path):
      with open(cls.json_path) as f:
        cls.data = json.load(f)

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    msg = f"stdout:\n{self.proc.stdout[-3000:]}\nstderr:\n{self.proc.stderr[-3000:]}"
    self.assertEqual(self.proc.returncode, 0, msg)
    self.assertIsNotNone(self.data, msg)

  def test_table_printed(self):
    out = self.proc.stdout
    self.assertIn("fake CPU devices", out)
    self.assertIn("times in ms per call", out)
    for label in bl.ROW_LABELS.values():
      self.assertIn(label, out)
    for short in bl.SHORT_NAMES.values():
      self.assertIn(f"{short}  ", out)  # one summary line per case
    self.assertIn("ratio (xla/", out)  # --local-gemm: our stage GEMM was timed
    self.assertIn("windowed-einsum child", self.proc.stderr)  # progress went to stderr

  def test_meta(self):
    meta = self.data["meta"]
    self.assertTrue(self.data["complete"])
    self.assertTrue(self.data["passed"])
    self.assertEqual(meta["platform"], "cpu")
    self.assertEqual(meta["tp"], 2)
    self.assertLen(meta["devices"], 2)
    self.assertEqual(meta["rows"], list(bl.ROWS))
    self.assertEqual(meta["baselines"], ["reference", "xla", "windowed_einsum", "jit_auto"])
    self.assertIn("--xla_gpu_threshold_for_windowed_einsum_mib=0",
                  meta["windowed_einsum_xla_flags"])
    self.assertEqual(meta["timing"]["max_in_flight"], 1)
    # No GPU here: the monitor stays off, says why, and no row claims clock data.
    self.assertEqual((meta["gpu_monitor"]["status"], meta["gpu_monitor"]["reason"]),
                     ("off", "platform cpu"))
    for c in self.data["cases"]:
      self.assertTrue(all(r.get("gpu") is None for r in c["rows"].values()), c["case"]["key"])

  def test_tuning_file_written(self):
    # No GPU: nothing was tuned, so the file holds no choice, but it is a valid tuning file.
    meta = self.data["meta"]
    self.assertEqual(meta["tuning_file"], self.tuning_path)
    self.assertIsNone(meta["tuning_loaded"])  # it did not exist yet
    self.assertEqual((meta["tuning_saved"], meta["tuning_kept"]), (0, 0))
    with open(self.tuning_path) as f:
      saved = json.load(f)
    self.assertEqual((saved["format"], saved["entries"]), ("jax_distgemm tuning", []))
    self.assertEqual(bl.runtime.load_tuning(self.tuning_path), 0)

  def test_every_row_measured_or_explained(self):
    cases = self.data["cases"]
    self.assertEqual([c["case"]["schedule"] for c in cases], [s.name for s in Schedule])
    for c in cases:
      self.assertEqual(set(c["rows"]), set(bl.ROWS), c["case"]["key"])
      for name, row in c["rows"].items():
        with self.subTest(case=c["case"]["key"], row=name):
          if row["status"] != "ok":
            self.assertIsInstance(row["reason"], str)
            self.assertNotEmpty(row["reason"])
            continue
          self.assertGreater(row["ms"], 0)
          self.assertGreater(row["ms_min"], 0)
          self.assertGreater(row["tflops_per_gpu"], 0)
          self.assertLen(row["ms_repeats"], 2)
          self.assertTrue(all(t > 0 for t in row["ms_repeats"]))
          self.assertEqual(row["calls_per_repeat"], 2)
          self.assertGreaterEqual(row["rotation_sets"], 2)
      # On CPU everything runs: ours, the ideal and every baseline.
      for name in ("ideal", "ffi", "auto", *bl.BASELINES):
        self.assertEqual(c["rows"][name]["status"], "ok", (c["case"]["key"], name))

  def test_efficiency_and_speedup(self):
    for c in self.data["cases"]:
      rows = c["rows"]
      ours, ideal = rows["ffi"]["ms"], rows["ideal"]["ms"]
      self.assertEqual(c["ours_ms"], ours)
      self.assertEqual(c["ideal_ms"], ideal)
      self.assertAlmostEqual(c["efficiency"], ideal / ours, places=9)
      best = min(bl.BASELINES, key=lambda n: rows[n]["ms"])
      self.assertEqual(c["best_baseline"], best)
      self.assertAlmostEqual(c["speedup"], rows[best]["ms"] / ours, places=9)
      # The ideal on every TP device at once (same dot, one program over the mesh).
      mesh = c["ideal_all_devices"]
      self.assertEqual(mesh["status"], "ok")
      self.assertGreater(mesh["ms"], 0)
      self.assertEqual(c["ideal_all_devices_ms"], mesh["ms"])
      self.assertAlmostEqual(c["efficiency_all_devices"], mesh["ms"] / ours, places=9)
      # Per round: the same rounds of the two rows, paired by index.
      pr = c["efficiency_per_round"]
      pairs = [a / b for a, b in zip(rows["ideal"]["ms_repeats"], rows["ffi"]["ms_repeats"])]
      self.assertEqual(pr["rounds"], len(pairs))
      self.assertAlmostEqual(pr["median"], statistics.median(pairs), places=9)
      self.assertLessEqual(pr["q25"], pr["median"])
      self.assertLessEqual(pr["median"], pr["q75"])
      for name, row in rows.items():
        self.assertAlmostEqual(row["efficiency"], ideal / row["ms"], places=9, msg=name)
        self.assertAlmostEqual(row["tflops_per_gpu"],
                               c["case"]["flops_per_device"] / (row["ms"] * 1e9), places=9)

  def test_correctness_recorded(self):
    for c in self.data["cases"]:
      self.assertTrue(c["passed"], c["failures"])
      self.assertLess(c["rel_err"], c["eps"])
      for name in bl.GATED:
        self.assertTrue(c["rows"][name]["correct"], name)
      self.assertIsInstance(c["rows"]["windowed_einsum"]["rel_err"], float)
      self.assertIn(c["rows"]["auto"]["resolved"], ("ffi", "xla"))

  def test_local_gemm_ratio_measured(self):
    # Our side of the local-GEMM comparison is the fused op at TP=1 (one stage GEMM); on CPU
    # that is the CPU executor, so only the bookkeeping is checked: a positive measured ratio
    # that agrees with the two times it is made of.
    for c in self.data["cases"]:
      lg = c["local_gemm"]
      self.assertEqual(lg["xla_dot"]["status"], "ok")
      self.assertGreater(lg["xla_dot"]["ms"], 0)
      self.assertGreater(lg["ratio"], 0)
      self.assertGreater(lg["cutlass_ms"], 0)
      self.assertAlmostEqual(lg["xla_dot"]["ms"] / lg["cutlass_ms"], lg["ratio"], places=6)
      self.assertNotIn("note", lg)
      # Paired by round: the median of the rounds' own ratios, from the repeats' times.
      pr = lg["ratio_per_round"]
      x, ours = lg["xla_dot"]["ms_repeats"], lg["cutlass"]["ms_repeats"]
      self.assertEqual(pr["rounds"], min(len(x), len(ours)))
      self.assertAlmostEqual(pr["median"], float(np.median([a / b for a, b in zip(x, ours)])),
                             places=6)

  def test_local_gemm_names_the_executor(self):
    # No CUTLASS on CPU: the table names what ran; the JSON keeps its "cutlass" keys for
    # existing readers and says which executor filled them.
    self.assertIn("ratio (xla/cpu executor)", self.proc.stdout)
    self.assertNotIn("xla/cutlass", self.proc.stdout)
    for c in self.data["cases"]:
      self.assertEqual(c["local_gemm"]["executor"], "cpu executor")
      self.assertGreater(c["local_gemm"]["cutlass"]["ms"], 0)

  def test_plot_written(self):
    if not _have_matplotlib():
      self.skipTest("matplotlib is not installed")
    with open(self.png_path, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class BenchCliTest(absltest.TestCase):

  def test_suite_list(self):
    proc = run_bench(["--suite", "--list"], timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stderr)
    lines = [l for l in proc.stdout.splitlines() if "/TP2" in l]
    self.assertLen(lines, 12)
    self.assertNotIn("windowed-einsum child", proc.stderr)

  def test_suite_schedule_filter(self):
    proc = run_bench(["--suite", "--schedule", "RS-TilA", "--list"], timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stderr)
    lines = [l for l in proc.stdout.splitlines() if "/TP2" in l]
    self.assertLen(lines, 5)
    self.assertTrue(all(l.startswith("RS-TilA") for l in lines), lines)

  def test_small_suite_list(self):
    proc = run_bench(["--suite", "small", "--list"], timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stderr)
    labels = [" ".join(l.split()[:2]) for l in proc.stdout.splitlines() if "/TP2" in l]
    # On CPU the shapes are divided by CPU_SMALL_SUITE_SCALE.
    want = [f"{bl.SHORT_NAMES[s]} {m},{k},{n}"
            for s, m, k, n in bl.small_suite(bl.CPU_SMALL_SUITE_SCALE)]
    self.assertLen(want, 8)
    self.assertEqual(labels, want)

  def test_calls_per_program_default(self):
    from jax_distgemm import bench  # noqa: PLC0415
    self.assertEqual(bench.options(bench.parse_args(["--suite", "small"])).calls_per_program,
                     bench.SMALL_SUITE_CALLS_PER_PROGRAM)
    self.assertEqual(bench.options(bench.parse_args(["--suite"])).calls_per_program, 1)
    self.assertEqual(bench.options(bench.parse_args(
        ["--suite", "small", "--calls-per-program", "2"])).calls_per_program, 2)
    proc = run_bench(["--calls-per-program", "0", "--list"], timeout=300)
    self.assertEqual(proc.returncode, 2)
    self.assertIn("--calls-per-program", proc.stderr)

  def test_unknown_suite_is_rejected(self):
    proc = run_bench(["--suite", "huge", "--list"], timeout=300)
    self.assertEqual(proc.returncode, 2)
    self.assertIn("--suite", proc.stderr)
    self.assertIn("small", proc.stderr)

  def test_suite_excludes_shape_flags(self):
    proc = run_bench(["--suite", "--m", "128", "--list"], timeout=300)
    self.assertEqual(proc.returncode, 2)
    self.assertIn("--suite", proc.stderr)


  def test_bad_tuning_file_stops_before_timing(self):
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "tuning.json")
      with open(path, "w") as f:
        json.dump({"format": "jax_distgemm tuning", "version": 99, "entries": []}, f)
      proc = run_bench([*TINY, "--no-windowed-einsum", "--tuning-file", path], timeout=300)
    self.assertEqual(proc.returncode, 1, proc.stderr)
    self.assertIn("--tuning-file: jax_distgemm.load_tuning:", proc.stderr)
    self.assertIn("has version 99", proc.stderr)
    self.assertNotIn("timing:", proc.stderr)

  def test_tuning_file_keeps_the_choices_this_run_did_not_settle(self):
    # A file saved on a GPU: on CPU this run settles nothing, and loads nothing (no GPU of the
    # file's model); saving at the end must keep the file's choice, not write an empty file.
    entry = {"gpu": "NVIDIA H200", "sm_count": 132, "ab_type": "bfloat16",
             "d_type": "bfloat16", "has_c": False, "m": 4096, "n": 14336, "k": 8192,
             "batch": 1, "shared_b": False, "fused_stages": 2, "tune_mode": "sustained",
             "turn_heat_ms": -1, "call_trials": True,
             "config": "Cooperative 128x256x64 cluster 1x1", "raster": 1, "swizzle": 8,
             "ms": 2.9, "call_ms": [-1.0, -1.0]}
    with tempfile.TemporaryDirectory() as d:
      path, out = os.path.join(d, "tuning.json"), os.path.join(d, "bench.json")
      with open(path, "w") as f:
        json.dump({"format": "jax_distgemm tuning", "version": 1, "entries": [entry]}, f)
      proc = run_bench([*TINY, "--iterations", "2", "--repeats", "1", "--warmup-iterations",
                        "0", "--impls", "ffi,reference", "--no-windowed-einsum",
                        "--tuning-file", path, "--json", out], timeout=600)
      self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
      with open(path) as f:
        self.assertEqual(json.load(f)["entries"], [entry])
      with open(out) as f:
        meta = json.load(f)["meta"]
    self.assertEqual((meta["tuning_loaded"], meta["tuning_saved"], meta["tuning_kept"]),
                     (0, 0, 1))
    self.assertIn("kept 1 other(s) from the file", proc.stdout)
    if not meta["cuda_executor_built"]:
      self.assertNotIn("circular import", meta["cuda_import_error"])

  def test_output_paths_are_checked_before_anything_runs(self):
    from jax_distgemm import bench  # noqa: PLC0415
    with tempfile.TemporaryDirectory() as d:
      missing = os.path.join(d, "missing", "out")
      for flag in ("--json", "--plot", "--tuning-file"):
        for path, why in ((missing, "does not exist"), (d, "is a directory")):
          with self.subTest(flag=flag, path=path):
            err = io.StringIO()
            with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err), \
                mock.patch.dict(sys.modules, {"matplotlib": mock.Mock()}):  # --plot's check
              bench.parse_args([flag, path])
            self.assertEqual(cm.exception.code, 2)
            self.assertIn(f"{flag}: {path}", err.getvalue())
            self.assertIn(why, err.getvalue())
      # End to end: the usage error comes before the windowed-einsum child or any case.
      proc = run_bench([*TINY, "--json", os.path.join(missing, "bench.json")], timeout=300)
      self.assertEqual(proc.returncode, 2, proc.stderr[-3000:])
      self.assertIn("--json:", proc.stderr)
      self.assertNotIn("Traceback", proc.stderr)
      self.assertNotIn("windowed-einsum child", proc.stderr)
      # A path that goes away after the check is a named error, not a traceback.
      with self.assertRaisesRegex(SystemExit, "--json: cannot write .*No such file"):
        bench._write_json(os.path.join(missing, "bench.json"), {})

  def test_plot_suffix_and_shared_output_paths_are_usage_errors(self):
    from jax_distgemm import bench  # noqa: PLC0415
    with tempfile.TemporaryDirectory() as d:
      j, png = os.path.join(d, "out.json"), os.path.join(d, "out.png")
      bad = {("--plot", os.path.join(d, "x.txt")): "--plot: .*x.txt: must end in .png",
             ("--plot", os.path.join(d, "plotnoext")): "--plot: .*plotnoext: must end in .png",
             ("--plot", png, "--json", png): "--json and --plot name the same file",
             ("--json", j, "--tuning-file", os.path.join(d, ".", "out.json")):
                 "--json and --tuning-file name the same file",
             ("--plot", png, "--tuning-file", png): "--plot and --tuning-file name the same file"}
      for argv, want in bad.items():
        with self.subTest(argv=argv):
          err = io.StringIO()
          with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err), \
              mock.patch.dict(sys.modules, {"matplotlib": mock.Mock()}):
            bench.parse_args(list(argv))
          self.assertEqual(cm.exception.code, 2)
          self.assertRegex(err.getvalue(), want)
      with mock.patch.dict(sys.modules, {"matplotlib": mock.Mock()}):
        bench.parse_args(["--plot", os.path.join(d, "x.PNG"), "--json", j])  # distinct, PNG
      # End to end: the usage error comes before any case (it used to fail in savefig after).
      proc = run_bench([*TINY, "--no-windowed-einsum", "--plot", os.path.join(d, "x.txt"),
                        "--json", j], timeout=300)
      self.assertEqual(proc.returncode, 2, proc.stderr[-3000:])
      self.assertIn("must end in .png", proc.stderr)
      self.assertNotIn("Traceback", proc.stderr)
      self.assertFalse(os.path.exists(j))

  def test_non_finite_alpha_beta_are_usage_errors(self):
    # The library's rule (finite as a float32), before any case runs, not a FAIL per case.
    from jax_distgemm import bench  # noqa: PLC0415
    for flag, v in (("--alpha", "nan"), ("--alpha", "inf"), ("--alpha", "1e39"),
                    ("--alpha", "-inf"), ("--beta", "nan"), ("--beta", "-1e39")):
      with self.subTest(flag=flag, value=v):
        err = io.StringIO()
        with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err):
          bench.parse_args([f"{flag}={v}"])
        self.assertEqual(cm.exception.code, 2)
        self.assertIn(f"{flag}: must be finite as a float32", err.getvalue())
    args = bench.parse_args(["--alpha=3e38", "--beta=-0.5"])
    self.assertEqual((args.alpha, args.beta), (3e38, -0.5))
    proc = run_bench([*TINY, "--alpha", "nan", "--list"], timeout=300)
    self.assertEqual(proc.returncode, 2, proc.stderr[-3000:])
    self.assertIn("--alpha: must be finite as a float32", proc.stderr)

  def test_write_errors_after_the_run_are_reported_with_the_json(self):
    # A tuning file or plot that cannot be written at the end: named on stderr, exit status 1,
    # and the JSON still written in full (no traceback, no "complete": false).
    from jax_distgemm import bench  # noqa: PLC0415
    with tempfile.TemporaryDirectory() as d:
      out = os.path.join(d, "bench.json")
      argv = [*TINY, "--iterations", "2", "--repeats", "1", "--warmup-iterations", "0",
              "--impls", "ffi,reference", "--no-windowed-einsum", "--json", out,
              "--tuning-file", os.path.join(d, "tuning.json"), "--plot", os.path.join(d, "p.png")]
      err = io.StringIO()
      with mock.patch.object(bench.runtime, "_save_tuning",
                             side_effect=ValueError("jax_distgemm.save_tuning: cannot write X")), \
          mock.patch.object(bench.bl, "plot", side_effect=PermissionError("denied")), \
          mock.patch.dict(sys.modules, {"matplotlib": mock.Mock()}), \
          contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        self.assertEqual(bench.main(argv), 1)
      with open(out) as f:
        data = json.load(f)
    self.assertTrue(data["complete"])
    self.assertTrue(data["passed"])
    self.assertEqual(data["meta"]["tuning_error"], "jax_distgemm.save_tuning: cannot write X")
    self.assertIn("jax_distgemm.bench: --tuning-file: jax_distgemm.save_tuning: cannot write X",
                  err.getvalue())
    self.assertIn("jax_distgemm.bench: --plot: cannot write", err.getvalue())

  def test_schedule_filter_that_leaves_no_case_is_a_usage_error(self):
    from jax_distgemm import bench  # noqa: PLC0415
    err = io.StringIO()
    with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err):
      bench.parse_args(["--suite", "small", "--schedule", "AG-RotB"])
    self.assertEqual(cm.exception.code, 2)
    self.assertIn("--schedule AG-RotB: no case of --suite small", err.getvalue())
    self.assertIn("its schedules: AG-RotA, RS-TilA", err.getvalue())
    bench.parse_args(["--suite", "small", "--schedule", "RS-TilA"])  # a filter that keeps some
    proc = run_bench(["--suite", "small", "--schedule", "AG-RotB", "--list"], timeout=300)
    self.assertEqual(proc.returncode, 2, proc.stderr)
    self.assertIn("no case of --suite small", proc.stderr)

  def test_negative_heat_is_rejected(self):
    proc = run_bench(["--heat-ms", "-5", "--list"], timeout=300)
    self.assertEqual(proc.returncode, 2)
    self.assertIn("--heat-ms", proc.stderr)
    self.assertIn("must be a number >= 0", proc.stderr)


  def test_bad_numbers_and_empty_rows_are_rejected(self):
    from jax_distgemm import bench  # noqa: PLC0415
    bad = {"--eps": ("-1", "nan"), "--target-repeat-ms": ("0", "inf"),
           "--rotation-budget-gb": ("-2",), "--l2-mb": ("-1",),
           "--warmup-iterations": ("-1",), "--max-in-flight": ("-3",),
           "--impls": ("", " , ")}
    for flag, values in bad.items():
      for v in values:
        with self.subTest(flag=flag, value=v):
          err = io.StringIO()
          with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err):
            bench.parse_args([f"{flag}={v}"])
          self.assertEqual(cm.exception.code, 2)
          self.assertIn(flag, err.getvalue())
    with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
      bench.parse_args(["--impls", "windowed_einsum", "--no-windowed-einsum"])
    args = bench.parse_args(["--eps", "0", "--warmup-iterations", "0", "--l2-mb", "0"])
    self.assertEqual((args.eps, args.warmup_iterations, args.l2_mb), (0.0, 0, 0.0))


class BenchLibTest(absltest.TestCase):

  def test_per_round_ratio(self):
    # Rounds pair by index; a row that stopped early (a failure) pairs only its rounds.
    r = bl.per_round_ratio([1.0, 2.0, 3.0, 9.0], [2.0, 2.0, 2.0])
    self.assertEqual(r["rounds"], 3)
    self.assertAlmostEqual(r["median"], 1.0)
    self.assertAlmostEqual(r["q25"], 0.75)
    self.assertAlmostEqual(r["q75"], 1.25)
    # Drift that scales both rows alike leaves the per-round ratio exact.
    r = bl.per_round_ratio([0.9, 1.0, 1.2], [1.0, 1.111111111111, 1.333333333333])
    self.assertAlmostEqual(r["median"], 0.9, places=6)
    self.assertAlmostEqual(r["q75"] - r["q25"], 0.0, places=6)
    self.assertIsNone(bl.per_round_ratio([], [1.0]))

  def test_parse_case(self):
    self.assertEqual(bl.parse_case("RS-TilA:64,32,16"),
                     bl.Case(Schedule.ReduceScatter1D_TilingA_RotatingC, 64, 32, 16))
    self.assertEqual(bl.parse_case("AllGather1D_TilingCD_RotatingB:8,4,2").schedule,
                     Schedule.AllGather1D_TilingCD_RotatingB)
    for text, needle in (("Nope:1,2,3", "schedule"), ("AG-RotA:1,2", "three integers"),
                         ("AG-RotA", "three integers"), ("AG-RotA:a,b,c", "three integers"),
                         ("AG-RotA:3,4,4", "M=3 not divisible by TP=2"),
                         ("AG-RotA:0,4,4", "must be positive")):
      with self.assertRaisesRegex(ValueError, needle, msg=text):
        bl.parse_case(text)

  def test_standard_suite(self):
    suite = bl.standard_suite()
    self.assertLen(suite, 12)
    for schedule in (Schedule.AllGather1D_TilingCD_RotatingA,
                     Schedule.ReduceScatter1D_TilingA_RotatingC):
      self.assertEqual([(m, k, n) for s, m, k, n in suite if s == schedule],
                       list(bl.STANDARD_SHAPES))
    for schedule in Schedule:
      self.assertIn((schedule, *bl.SEED_SHAPE), suite)
    for s, m, k, n in bl.standard_suite(bl.CPU_SUITE_SCALE):
      self.assertIsNone(bl.Case(s, m, k, n, tp=2).invalid_reason())

  def test_small_suite(self):
    suite = bl.small_suite()
    self.assertLen(suite, 8)
    for schedule, shapes in bl.SMALL_SHAPES.items():
      self.assertEqual([(m, k, n) for s, m, k, n in suite if s == schedule], list(shapes))
    # One wave of 128x128 tiles or less per stage at the decode shapes (what the suite is for).
    for s, m, k, n in suite:
      if m <= 256:
        sm, sn = (m // 2, n // 2) if s == Schedule.AllGather1D_TilingCD_RotatingA else (m // 2, n)
        self.assertLessEqual(-(-sm // 128) * -(-sn // 128), 132, (s, m, k, n))
    for s, m, k, n in bl.small_suite(bl.CPU_SMALL_SUITE_SCALE):
      self.assertIsNone(bl.Case(s, m, k, n, tp=2).invalid_reason())
    self.assertEqual(bl.suite("small", "gpu"), suite)
    self.assertEqual(bl.suite("standard", "cpu"), bl.standard_suite(bl.CPU_SUITE_SCALE))
    with self.assertRaisesRegex(ValueError, "not one of"):
      bl.suite("huge", "gpu")

  def test_cuda_import_error_says_not_built(self):
    # Not "partially initialized module ... (most likely due to a circular import)": the
    # reason the bench records (meta cuda_import_error) and api.ffi_unsupported_reason appends.
    from jax_distgemm import ffi as ffi_modules  # noqa: PLC0415
    if not ffi_modules.has_cuda():
      msg = str(ffi_modules.cuda_import_error)
      self.assertNotIn("circular import", msg)
      self.assertIn("_distgemm_cuda was not built", msg)
    name = "jax_distgemm.ffi._distgemm_cuda"
    for raised, want in (
        (ModuleNotFoundError(f"No module named {name!r}", name=name), "was not built: no "),
        (ImportError("libcudart.so.12: cannot open shared object file"),
         "is installed but does not load: libcudart.so.12"),
        (ModuleNotFoundError("No module named 'nvidia'", name="nvidia"),
         "is installed but does not load: No module named 'nvidia'")):
      with self.subTest(raised=raised), mock.patch.object(
          ffi_modules.importlib, "import_module", side_effect=raised):
        module, error = ffi_modules._import_cuda()
      self.assertIsNone(module)
      self.assertIsInstance(error, ImportError)
      self.assertIn(want, str(error))
    fake = object()
    with mock.patch.object(ffi_modules.importlib, "import_module", return_value=fake):
      self.assertEqual(ffi_modules._import_cuda(), (fake, None))

  def test_rotation_sets(self):
    l2 = 60 * 2**20
    kw = dict(l2_bytes=l2, budget_bytes=8 * 2**30, max_sets=32)
    self.assertEqual(bl.rotation_sets(2 * 2**30, **kw), 2)  # large: still never the same buffer
    self.assertEqual(bl.rotation_sets(48 * 2**20, **kw), 3)  # total > 2 x L2
    self.assertEqual(bl.rotation_sets(1024, **kw), 32)  # tiny: capped
    self.assertEqual(bl.rotation_sets(6 * 2**30, **kw), 1)  # over budget: one set

  def test_call_estimate_leaves_out_a_run_fixed_cost(self):
    # A row whose every run costs 5 ms once (dispatch, the final block) plus 1 ms per call:
    # timing 2 calls would read 3.5 ms per call, and size its repeats 3.5x too short.
    class Fake(bl.Timed):
      def run(self, count, max_in_flight=0):
        time.sleep(0.005 + 0.001 * count)

    est = Fake("fake", None, []).estimate_call_ms()
    self.assertBetween(est, 0.8, 1.4)

  def test_round_order_varies_predecessors(self):
    rows = list(range(6))
    orders = [bl.round_order(rows, seed=0, r=r) for r in range(7)]
    for order in orders:
      self.assertCountEqual(order, rows)  # a permutation: every row once per round
    self.assertEqual(orders, [bl.round_order(rows, seed=0, r=r) for r in range(7)])  # seeded
    # Unlike a rotation of one order, the row before a given row changes between rounds.
    before = {o[o.index(3) - 1] for o in orders if o.index(3) > 0}
    self.assertGreater(len(before), 1)

  def test_heat_runs_before_each_timed_repeat(self):
    calls = []

    def call(x):
      calls.append(x)
      return x

    # The per-call estimate (its own test below) makes a varying number of calls: a fixed one.
    self.enter_context(mock.patch.object(bl.Timed, "estimate_call_ms", return_value=1e-3))
    opts = bl.Options(iterations=3, warmup=1, repeats=2, heat_ms=1e-6)
    e = bl.Timed("row", call, [(1,), (2,)])
    bl.time_interleaved([e], opts, lambda msg: None)
    self.assertEqual(e.heat_calls, 1)  # at least one call, however short heat_ms
    # warm-up 1, then per repeat: 1 heat call + 3 timed calls.
    self.assertLen(calls, 1 + 2 * (1 + 3))
    row = bl._timing_row(e)
    self.assertLen(row["ms_repeats"], 2)
    self.assertLen(row["ms_after_switch_repeats"], 2)
    self.assertEqual(row["heat_calls"], 1)
    self.assertGreater(row["ms_after_switch"], 0)

    calls.clear()
    e = bl.Timed("row", call, [(1,), (2,)])
    bl.time_interleaved([e], bl.Options(iterations=3, warmup=1, repeats=2, heat_ms=0),
                        lambda msg: None)
    self.assertEqual(e.heat_calls, 0)
    self.assertLen(calls, 1 + 2 * 3)
    self.assertIsNone(bl._timing_row(e)["ms_after_switch"])

  def test_case_shapes(self):
    m, k, n, tp = 8, 16, 32, 2
    ideal = {s: bl.Case(s, m, k, n, tp=tp).ideal_shapes() for s in Schedule}
    self.assertEqual(ideal[Schedule.AllGather1D_TilingCD_RotatingA], ((8, 16), (16, 16), (8, 16)))
    self.assertEqual(ideal[Schedule.AllGather1D_TilingCD_RotatingB], ((4, 16), (16, 32), (4, 32)))
    for s in (Schedule.ReduceScatter1D_TilingA_RotatingC,
              Schedule.ReduceScatter1D_TilingB_RotatingC):
      self.assertEqual(ideal[s], ((8, 8), (8, 32), (8, 32)))
    for s in Schedule:  # the ideal is exactly one device's share of the FLOPs
      (im, ik), (_, in_), _ = ideal[s]
      self.assertEqual(2 * im * ik * in_, bl.Case(s, m, k, n, tp=tp).flops_per_device)
    self.assertIn("not divisible",
                  bl.Case(Schedule.AllGather1D_TilingCD_RotatingA, 7, 16, 32).invalid_reason())
    self.assertIsNone(
        bl.Case(Schedule.AllGather1D_TilingCD_RotatingA, 8, 7, 32).invalid_reason())

  def test_settle_call_trials_runs_until_the_verdict(self):
    calls = {"n": 0}

    def describe(progressing, total=8):
      done = calls["n"] * 4 >= total
      call = min(calls["n"] * 4, total) if progressing else 0
      return "device 0 ...: ok" if done and progressing else (
          f"device 0 ...; call trial running (call {call} of {total})")

    def batch():
      calls["n"] += 1

    for progressing, want in ((True, 2), (False, 1)):
      calls["n"] = 0
      with mock.patch.object(bl.runtime, "describe_tuning",
                             side_effect=lambda p=progressing: describe(p)):
        bl.settle_call_trials(batch)
      self.assertEqual(calls["n"], want)  # a row that feeds no trial stops after one batch
    calls["n"] = 0
    with mock.patch.object(bl.runtime, "describe_tuning", return_value="device 0 ...: ok"):
      bl.settle_call_trials(batch)
    self.assertEqual(calls["n"], 0)

  def test_copy_stream_lines_name_their_group(self):
    # A GPU in two groups (the local-GEMM TP=1 group and the TP=2 one) has two copy streams;
    # each line says which (the module's rows: ordinal, candidates, independent, note, group,
    # rank; cc/cuda/distgemm_cuda.h).
    rows = [(0, 1, 1, "", [0], 0), (0, 2, 1, "", [0, 1], 0), (1, 1, 0, "no free queue", [0, 1], 1),
            (1, 1, 1, "", [-1, 1], 1)]
    fake = mock.Mock(copy_stream_reports=mock.Mock(return_value=rows))
    with mock.patch.object(bl.runtime.ffi_modules, "module_for", return_value=fake):
      reports = bl.runtime.copy_stream_reports()
    self.assertEqual([(r["ordinal"], r["group"], r["rank"]) for r in reports],
                     [(0, [0], 0), (0, [0, 1], 0), (1, [0, 1], 1), (1, [-1, 1], 1)])
    lines = [bl.runtime.describe_copy_stream(r) for r in reports]
    self.assertEqual(lines[0], "copy stream of GPU 0 as rank 0 of TP=1 group [GPU 0]: "
                     "1 candidate(s), independent of XLA's compute stream: 1")
    self.assertEqual(lines[1], "copy stream of GPU 0 as rank 0 of TP=2 group [GPU 0, GPU 1]: "
                     "2 candidate(s), independent of XLA's compute stream: 1")
    self.assertTrue(lines[2].endswith(": 0 (no free queue)"), lines[2])
    self.assertIn("group [another process, GPU 1]", lines[3])

  def test_local_all_devices_matches_the_ideal(self):
    # Our op at TP=1 on every device at once computes each device's share, as XLA's dot does.
    devices = tu.cpu_devices(2)
    mesh = Mesh(np.array(devices), ("tp",))
    for s in (Schedule.AllGather1D_TilingCD_RotatingA, Schedule.ReduceScatter1D_TilingA_RotatingC):
      case = bl.Case(s, 32, 16, 64, tp=2)
      (x, w), = bl.stacked_ideal_sets(jax.random.key(0), 1, case, mesh)
      ours = bl.local_all_devices_fn(case, mesh)(x, w)
      ideal = bl.ideal_all_devices_fn(case, mesh)(x, w)
      self.assertEqual(ours.shape, (2,) + case.ideal_shapes()[2])
      self.assertEqual(ours.sharding.spec[0], "tp")
      self.assertLess(bl.rel_err(ours, ideal), 1e-2)
      self.assertGreater(float(jnp.abs(ours[1] - ours[0]).max()), 0)  # each device its own share

  def test_chained_program(self):
    # k calls of fn in one program, each on its own set, in set order; groups wrap around.
    sets = [(jnp.full((2, 2), float(i)), jnp.eye(2)) for i in range(5)]
    call, groups = bl.chained_program(lambda x, w: x @ w + 1.0, sets, 2)
    self.assertLen(groups, 2)
    self.assertEqual([[float(a[0][0, 0]) for a in g] for g in groups], [[0.0, 1.0], [2.0, 3.0]])
    outs = call(*groups[1])
    self.assertEqual([float(o[0, 0]) for o in outs], [3.0, 4.0])
    self.assertEqual(float(bl.first_call_output(outs, 2)[0, 0]), 3.0)
    _, groups = bl.chained_program(lambda x, w: x @ w, sets[:1], 3)
    self.assertLen(groups, 1)
    self.assertLen(groups[0], 3)  # one set, used three times
    call, same = bl.chained_program(lambda x, w: x @ w, sets, 1)
    self.assertIs(same, sets)
    self.assertEqual(float(call(*sets[4])[0, 0]), 4.0)

  def test_calls_per_program_rows(self):
    devices = tu.cpu_devices(2)
    case = bl.Case(Schedule.AllGather1D_TilingCD_RotatingA, 32, 16, 64, tp=2)
    opts = bl.Options(warmup=1, repeats=2, max_in_flight=1, calls_per_program=4,
                      target_repeat_ms=1.0, local_gemm=True,
                      want=frozenset({"ideal", "ffi", "auto", "reference", "xla"}))
    got = bl.run_case(case, 0, devices, opts, lambda msg: None)
    result = bl.finalize_case(case, got["rows"], got["data"], opts)
    self.assertTrue(result["passed"], result["failures"])
    for name in ("ideal", "ffi", "auto", "reference", "xla"):
      row = result["rows"][name]
      self.assertEqual(row["calls_per_program"], 4, name)
      self.assertEqual(row["calls_per_repeat"] % 4, 0, name)
      self.assertLess(row["rel_err"] if name != "ideal" else 0.0, 1e-5, name)
    self.assertEqual(got["data"]["local_gemm"]["xla_dot"]["calls_per_program"], 4)
    self.assertGreater(got["data"]["local_gemm"]["ratio"], 0)

  def test_auto_resolved_to_reference_is_reported(self):
    devices = tu.cpu_devices(2)
    case = bl.Case(Schedule.AllGather1D_TilingCD_RotatingA, 32, 16, 64, tp=2)
    opts = bl.Options(iterations=2, warmup=1, repeats=2, max_in_flight=1,
                      want=frozenset({"ideal", "ffi", "auto", "reference"}))
    with mock.patch.object(api, "xla_faster_reason", return_value="forced by the test"):
      got = bl.run_case(case, 0, devices, opts, lambda msg: None)
    self.assertEqual(got["rows"]["auto"]["resolved"], "reference")
    self.assertEqual(got["rows"]["ffi"]["hlo"]["jax_distgemm"], 1)

  def test_unsupported_implementation_is_reported(self):
    devices = tu.cpu_devices(2)
    case = bl.Case(Schedule.ReduceScatter1D_TilingA_RotatingC, 32, 16, 64, tp=2)
    opts = bl.Options(iterations=2, warmup=1, repeats=2, max_in_flight=1,
                      want=frozenset({"ideal", "ffi", "auto", "reference", "xla"}))
    with mock.patch.object(api, "ffi_unsupported_reason", return_value="forced by the test"):
      got = bl.run_case(case, 0, devices, opts, lambda msg: None)
    rows = got["rows"]
    self.assertEqual(rows["ffi"]["status"], "unsupported")
    self.assertIn("forced by the test", rows["ffi"]["reason"])
    self.assertEqual(rows["auto"]["resolved"], "xla")
    result = bl.finalize_case(case, rows, got["data"], opts)
    self.assertTrue(result["passed"], result["failures"])
    self.assertIsNone(result["ours_ms"])
    self.assertIsNone(result["efficiency"])
    self.assertEqual(result["rows"]["windowed_einsum"]["status"], "skipped")
    self.assertIn("unsupported: NotImplementedError", bl.case_block(result, 1, 1))
    self.assertIn("n/a[", bl.summary_table([result]))
    json.dumps(bl.sanitize(result), allow_nan=False)

  def test_eps_gate(self):
    case = bl.Case(Schedule.AllGather1D_TilingCD_RotatingA, 8, 8, 8)
    ok = {"status": "ok", "ms": 2.0, "rel_err": 1e-3}
    for bad_err in (0.5, float("nan")):
      rows = {"ideal": {"status": "ok", "ms": 1.0}, "ffi": dict(ok, rel_err=bad_err),
              "auto": dict(ok), "reference": {"status": "ok", "ms": 4.0, "rel_err": 0.0},
              "xla": dict(ok, ms=3.0)}
      result = bl.finalize_case(case, rows, {}, bl.Options())
      self.assertFalse(result["passed"])
      self.assertFalse(result["rows"]["ffi"]["correct"])
      self.assertTrue(result["rows"]["auto"]["correct"])
      self.assertEqual(result["best_baseline"], "xla")
      self.assertAlmostEqual(result["speedup"], 1.5)
      self.assertAlmostEqual(result["efficiency"], 0.5)
      self.assertTrue(math.isfinite(json.loads(json.dumps(bl.sanitize(result)))["efficiency"]))


class GpuMonitorTest(absltest.TestCase):
  """Clock and power sampling (jax_distgemm/_src/gpu_monitor.py): per-row windows, the sampling
  thread with a stand-in reader, and the fallback where NVML is missing."""

  def test_window_stats_take_medians_per_gpu_inside_the_windows(self):
    samples = [(1.0, 0, 1400, 600, 50), (1.1, 0, 1300, 700, 52), (1.2, 0, 1350, 650, 51),
               (1.1, 1, 1200, 690, 60), (5.0, 0, 1980, 100, 30)]  # the last: outside
    got = gpu_monitor.window_stats(samples, [(0.9, 1.25), (3.0, 4.0)])
    self.assertEqual(got, {
        "0": {"sm_mhz": 1350, "power_w": 650, "temp_c": 51, "samples": 3},
        "1": {"sm_mhz": 1200, "power_w": 690, "temp_c": 60, "samples": 1}})
    self.assertIsNone(gpu_monitor.window_stats(samples, [(2.0, 3.0)]))

  def test_unavailable_without_nvml(self):
    with mock.patch.object(gpu_monitor.ctypes, "CDLL",
                           side_effect=OSError("libnvidia-ml.so.1: cannot open")):
      m = gpu_monitor.GpuMonitor().start()
    self.assertEqual(m.status, "unavailable")
    self.assertIn("libnvidia-ml.so.1", m.reason)
    self.assertIsNone(m.stats([(0.0, 1e12)]))
    m.stop()  # harmless when nothing started

  def test_samples_on_a_thread_and_stops(self):
    class Reader:  # two GPUs, GPU 1's clock rising by 1 MHz a read
      closed = False
      n = 0

      def read(self):
        self.n += 1
        return [(0, 1410.0, 602.0, 57.0), (1, 1200.0 + self.n, 690.0, 60.0)]

      def close(self):
        Reader.closed = True

    m = gpu_monitor.GpuMonitor(interval_ms=10, reader_factory=Reader).start()
    self.assertEqual(m.status, "ok", m.reason)
    t0 = time.time()
    time.sleep(0.3)
    t1 = time.time()
    m.stop()
    got = m.stats([(t0, t1)])
    self.assertEqual(sorted(got), ["0", "1"])
    self.assertEqual((got["0"]["sm_mhz"], got["0"]["power_w"], got["0"]["temp_c"]),
                     (1410.0, 602.0, 57.0))
    self.assertGreaterEqual(got["1"]["samples"], 5)
    self.assertGreater(got["1"]["sm_mhz"], 1200.0)
    self.assertTrue(Reader.closed)
    n = len(m.samples)
    time.sleep(0.05)
    self.assertLen(m.samples, n)  # stopped: no more samples
    self.assertEqual(m.describe()["samples"], n)

  def test_case_block_prints_the_clock_line(self):
    result = {"rows": {"ideal": {"gpu": {"0": {"sm_mhz": 1410, "power_w": 602}}},
                       "ffi": {"gpu": {"0": {"sm_mhz": 1290, "power_w": 693},
                                       "1": {"sm_mhz": 1298, "power_w": 691}}}},
              "ideal_all_devices": {"gpu": None}}
    line = bl.gpu_clock_line(result)
    self.assertIn("ideal GPU0 1410 MHz 602 W; ours GPU0 1290 MHz 693 W GPU1 1298 MHz 691 W",
                  line)
    self.assertIsNone(bl.gpu_clock_line({"rows": {"ideal": {}, "ffi": {"gpu": None}}}))


if __name__ == "__main__":
  absltest.main()

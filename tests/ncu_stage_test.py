"""tools/ncu_stage.py's reading of Nsight Compute's CSV and its argument checks, without a GPU
(the GPU run itself is in docs/performance.md)."""

import contextlib
import io
import os
import sys
import tempfile

from absl.testing import absltest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import ncu_stage  # noqa: E402  pylint: disable=g-import-not-at-top

_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
           '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
           '"Metric Value"\n')


def _row(kid, kernel, section, metric, unit, value):
  return (f'"{kid}","7","python3","vm","{kernel}","1","13","(384, 1, 1)","(132, 1, 1)","0",'
          f'"9.0","{section}","{metric}","{unit}","{value}"\n')


class KernelRowsTest(absltest.TestCase):

  def _write(self, text):
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    path = os.path.join(tmp.name, "ncu.csv")
    with open(path, "w") as f:
      f.write(text)
    return path

  def test_one_row_per_kernel_in_the_columns_units(self):
    ours = ("void cutlass::device_kernel<jax_distgemm::cuda::StageKernel<cutlass::gemm::kernel::"
            "GemmUniversal<int>>>(T1::Params)")
    xla = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
    sol, cmd = "GPU Speed Of Light Throughput", "Command line profiler metrics"
    path = self._write(
        "==PROF== Connected to process 7\n[ncu_stage] program output\n" + _HEADER +
        _row(0, xla, sol, "Duration", "ns", "1,177,000") +
        _row(0, xla, cmd, "dram__bytes_read.sum", "byte", "512000000") +
        _row(0, xla, sol, "SM Frequency", "Hz", "1980000000") +
        _row(1, ours, sol, "Duration", "ns", "1,217,500") +
        _row(1, ours, cmd, "lts__t_sector_hit_rate.pct", "%", "81.5") +
        _row(1, ours, "Launch Statistics", "Grid Size", "", "132") +
        _row(2, "void jax_distgemm::cuda::FusedStageKernel<int>(int)", sol, "Duration", "ns",
             "n/a"))
    rows = ncu_stage.kernel_rows(path)
    self.assertEqual([r["kernel"] for r in rows],
                     ["xla:" + xla, "ours:stage", "ours:fused"])
    self.assertAlmostEqual(rows[0]["us"], 1177.0)
    self.assertAlmostEqual(rows[0]["DRAM rd MB"], 512.0)
    self.assertAlmostEqual(rows[0]["SM MHz"], 1980.0)
    self.assertNotIn("L2 hit %", rows[0])
    self.assertAlmostEqual(rows[1]["us"], 1217.5)
    self.assertAlmostEqual(rows[1]["L2 hit %"], 81.5)
    self.assertAlmostEqual(rows[1]["grid"], 132.0)
    self.assertEqual(rows[2]["us"], "n/a")  # text that does not parse stays text

  def test_summary_prints_a_header_and_a_line_per_kernel(self):
    path = self._write(_HEADER + _row(0, "k", "GPU Speed Of Light Throughput", "Duration", "ns",
                                      "2000"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      ncu_stage.main(["--summarize", path])
    lines = out.getvalue().splitlines()
    self.assertEqual(lines[0].split("\t")[:3], ["id", "kernel", "us"])
    self.assertEqual(lines[1].split("\t")[:3], ["0", "xla:k", "2"])
    self.assertLen(lines, 2)


class ArgumentTest(absltest.TestCase):

  def _usage_error(self, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as cm:
      ncu_stage.main(argv)
    self.assertEqual(cm.exception.code, 2)
    return err.getvalue()

  def test_cases_or_summarize_required(self):
    self.assertIn("--cases or --summarize", self._usage_error([]))

  def test_launches_must_be_positive(self):
    self.assertIn("--launches", self._usage_error(["--cases", "AG-RotA:64,64,64",
                                                   "--launches", "0"]))

  def test_bad_case_names_the_flag(self):
    self.assertIn("--cases", self._usage_error(["--cases", "AG-RotA:64,64"]))


if __name__ == "__main__":
  absltest.main()

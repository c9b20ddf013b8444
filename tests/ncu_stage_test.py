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


class LabelTest(absltest.TestCase):

  def _files(self, kernels, log):
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    csv_path, log_path = os.path.join(tmp.name, "n.csv"), os.path.join(tmp.name, "n.log")
    with open(csv_path, "w") as f:
      f.write(_HEADER + "".join(
          _row(i, k, "GPU Speed Of Light Throughput", "Duration", "ns", str(1000 * (i + 1)))
          for i, k in enumerate(kernels)))
    with open(log_path, "w") as f:
      f.write(log)
    return csv_path, log_path

  _LOG = ("[ncu_stage] RS-TilA 8192,8192,28672: stage m=4096 k=4096 n=28672; profiled in order, "
          "1 launch(es) each: xla, ours (tuner), ours 7:1:1\n==PROF== noise\n"
          "[ncu_stage] AG-RotA 64,64,64: share m=64 k=64 n=32; profiled in order, "
          "2 launch(es) each: xla, ours (tuner)\n")

  def test_launches_in_order(self):
    _, log = self._files([], self._LOG)
    labels = ncu_stage.launch_labels(log)
    rs, ag = "RS-TilA 8192,8192,28672", "AG-RotA 64,64,64"
    self.assertEqual([(x["case"], x["row"]) for x in labels],
                     [(rs, "xla"), (rs, "ours (tuner)"), (rs, "ours 7:1:1"), (ag, "xla"),
                      (ag, "xla"), (ag, "ours (tuner)"), (ag, "ours (tuner)")])
    self.assertEqual(labels[0]["mkn"], [4096, 4096, 28672])
    self.assertEqual(labels[3]["problem"], "share")

  def test_compact_records_are_labelled_when_counts_agree(self):
    kernels = ["nvjet_a", "jax_distgemm::StageKernel<x>", "jax_distgemm::StageKernel<y>",
               "triton_b", "triton_b", "jax_distgemm::StageKernel<z>",
               "jax_distgemm::StageKernel<z>"]
    csv_path, log = self._files(kernels, self._LOG)
    records = ncu_stage.with_labels(ncu_stage.compact(csv_path), log)
    self.assertEqual([r["row"] for r in records[:3]], ["xla", "ours (tuner)", "ours 7:1:1"])
    self.assertEqual(records[1]["kernel"], "ours:stage")
    self.assertEqual(records[2]["metrics"],
                     {"GPU Speed Of Light Throughput / Duration": "3000 ns"})

  def test_a_count_mismatch_leaves_rows_unlabelled(self):
    csv_path, log = self._files(["nvjet_a", "nvjet_b"], self._LOG)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      rows = ncu_stage.with_labels(ncu_stage.kernel_rows(csv_path), log)
    self.assertNotIn("row", rows[0])
    self.assertIn("2 kernels but 7 launches", err.getvalue())


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

  def test_warmup_must_be_positive(self):
    self.assertIn("--warmup", self._usage_error(["--cases", "AG-RotA:64,64,64", "--warmup", "0"]))

  def test_bad_case_names_the_flag(self):
    self.assertIn("--cases", self._usage_error(["--cases", "AG-RotA:64,64"]))


if __name__ == "__main__":
  absltest.main()

"""tools/config_sweep.py without a GPU: which rows it times, and that a CPU run writes them.

The row list is checked in process; the sweeps themselves run in a subprocess (JAX_PLATFORMS=cpu,
tiny shapes), one per mode, and the JSON they write is checked: the stage (resp. whole-call)
shape, every row measured, our rows agreeing with the reference.  Timings on CPU mean nothing.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tools")
sys.path.insert(0, _TOOLS)
import config_sweep  # noqa: E402  pylint: disable=g-import-not-at-top


def _args(**kw):
  base = dict(tune_modes="sustained,coarse", rs_fused_modes="", row=[], forced=True,
              swizzles="1,4")
  base.update(kw)
  return argparse.Namespace(**base)


def run_sweep(argv, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, os.path.join(_TOOLS, "config_sweep.py"), *argv],
                        env=env, capture_output=True, text=True, timeout=timeout)


class VariantsTest(absltest.TestCase):

  def test_stage_kernels_force_every_config(self):
    rows = config_sweep.variants(_args(), fused_kernel=False, reduce_scatter=False)
    names = [n for n, _ in rows]
    self.assertEqual(names[:2], ["auto_sustained", "auto_coarse"])
    forced = [env["JAX_DISTGEMM_GEMM_CONFIG"] for _, env in rows[2:]]
    # configs x rasters {1: M, 2: N} x swizzles {1, 4}
    self.assertLen(forced, len(config_sweep.CONFIG_NAMES) * 2 * 2)
    self.assertEqual({int(f.split(":")[0]) for f in forced}, set(config_sweep.CONFIG_NAMES))
    self.assertIn("coop256x192_c1x1/rN/s4", names)

  def test_fused_grid_forces_only_fused_configs(self):
    rows = config_sweep.variants(_args(swizzles="8"), fused_kernel=True, reduce_scatter=False)
    forced = {int(env["JAX_DISTGEMM_GEMM_CONFIG"].split(":")[0])
              for _, env in rows if "JAX_DISTGEMM_GEMM_CONFIG" in env}
    self.assertEqual(forced, set(config_sweep.FUSED_CONFIGS))

  def test_extra_rows_and_rs_modes(self):
    rows = config_sweep.variants(
        _args(forced=False, tune_modes="sustained", rs_fused_modes="all,none",
              row=["mine:JAX_DISTGEMM_GEMM_CONFIG=7:2:4,JAX_DISTGEMM_TUNE=coarse"]),
        fused_kernel=False, reduce_scatter=True)
    self.assertEqual(rows, [
        ("auto_sustained", {"JAX_DISTGEMM_TUNE": "sustained"}),
        ("rs_fused_all", {"JAX_DISTGEMM_RS_FUSED": "all"}),
        ("rs_fused_none", {"JAX_DISTGEMM_RS_FUSED": "none"}),
        ("mine", {"JAX_DISTGEMM_GEMM_CONFIG": "7:2:4", "JAX_DISTGEMM_TUNE": "coarse"}),
    ])


class SweepEndToEndTest(absltest.TestCase):

  def _run(self, argv):
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "sweep.json")
      r = run_sweep([*argv, "--repeats", "2", "--target-repeat-ms", "1", "--heat-ms", "0",
                     "--json", path])
      self.assertEqual(r.returncode, 0, r.stderr[-3000:])
      with open(path) as f:
        return json.load(f)["results"], r.stdout

  def _check_rows(self, rows, names):
    self.assertEqual(sorted(rows), sorted(["ideal", *names]))
    for name, row in rows.items():
      self.assertGreater(row["ms"], 0, name)
      if name != "ideal":
        self.assertGreater(row["efficiency"], 0, name)
        self.assertLess(row["rel_err"], 2e-2, name)

  def test_local_times_the_stage_shape(self):
    # At TP=2, RS-TilA's stage is (m/2, k/2, n), AG-RotA's (m/2, k, n/2).
    results, out = self._run(["--local", "--cases", "RS-TilA:128,128,256", "AG-RotA:128,64,256",
                              "--no-forced", "--tune-modes", "sustained",
                              "--row", "c7:JAX_DISTGEMM_GEMM_CONFIG=7:1:1"])
    self.assertEqual([r["stage_shape"] for r in results], [[64, 64, 256], [64, 64, 128]])
    for r in results:
      self._check_rows(r["rows"], ["auto_sustained", "c7"])
    self.assertIn("RS-TilA 128,128,256: ideal", out)

  def test_whole_calls_on_two_devices(self):
    results, _ = self._run(["--cases", "AG-RotA:128,64,256", "--tune-modes", "sustained",
                            "--swizzles", "1"])
    (r,) = results
    self.assertEqual(r["case"]["tp"], 2)
    forced = [n for n, _ in config_sweep.variants(
        _args(tune_modes="", swizzles="1"), fused_kernel=True, reduce_scatter=False)]
    self._check_rows(r["rows"], ["auto_sustained", *forced])

  def test_exclusive_modes_are_a_usage_error(self):
    r = run_sweep(["--local", "--all-devices", "--cases", "AG-RotA:8,8,8"])
    self.assertEqual(r.returncode, 2)
    self.assertIn("exclusive", r.stderr)


if __name__ == "__main__":
  absltest.main()

"""examples/distributed_gemm.py runs on fake CPU devices, checks itself and reports its timing.

Each case runs the example in a subprocess (JAX_PLATFORMS=cpu: the example must pick fake CPU
devices by itself) and parses what it prints.  flax_tp_mlp.py's command line is checked the same
way, and launch_multiprocess.py runs a real 2-process job whose own check must catch a wrong
result.
"""

import importlib.util
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
EXAMPLE = os.path.join(REPO, "examples", "distributed_gemm.py")
FLAX = os.path.join(REPO, "examples", "flax_tp_mlp.py")
LAUNCH = os.path.join(REPO, "examples", "launch_multiprocess.py")
README = os.path.join(REPO, "README.md")
SCHEDULES = (
    "AllGather1D_TilingCD_RotatingA",
    "AllGather1D_TilingCD_RotatingB",
    "ReduceScatter1D_TilingA_RotatingC",
    "ReduceScatter1D_TilingB_RotatingC",
)
SMALL = ["--m=64", "--n=96", "--k=32", "--iterations=5", "--warmup-iterations=1"]
NUMBER = r"([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)"

# The examples run as child processes: the slow tier (`-m "not slow"` leaves them out).
pytestmark = pytest.mark.slow


def run_example(args, timeout=300, script=EXAMPLE, env_extra=None, python_args=()):
  # The other examples run without XLA_FLAGS, as in their own tests.
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("JAX_DISTGEMM_") and (k != "XLA_FLAGS" or script == EXAMPLE)}
  env["JAX_PLATFORMS"] = "cpu"
  env.update(env_extra or {})
  return subprocess.run([sys.executable, *python_args, script, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


# Runs argv[1] as __main__ with the CPU executor's fault hook set on device 0 (it skips its
# peers): every call of the fused op then fails in the others with DEADLINE_EXCEEDED.
WITH_FAULT = """
import runpy, sys
from jax_distgemm.ffi import _distgemm_cpu
_distgemm_cpu.set_fault_device(0)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class ExampleTest(parameterized.TestCase):

  def assert_passed_with_timing(self, proc):
    out = proc.stdout
    self.assertEqual(proc.returncode, 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}")
    self.assertIn("Disposition: Passed", out)
    runtime = re.search(rf"Avg runtime: {NUMBER} ms", out)
    tflops = re.search(rf"TFLOP/s per device: {NUMBER}", out)
    self.assertIsNotNone(runtime, out)
    self.assertIsNotNone(tflops, out)
    self.assertGreater(float(runtime.group(1)), 0.0)
    self.assertGreater(float(tflops.group(1)), 0.0)
    return out

  # Every schedule once, at either TP (the API tests cover the rest).
  @parameterized.parameters(*zip(SCHEDULES, (2, 4, 4, 2)))
  def test_schedule(self, schedule, tp):
    out = self.assert_passed_with_timing(
        run_example([f"--schedule={schedule}", f"--tp={tp}", *SMALL]))
    self.assertIn(f"running on {tp} fake CPU devices", out)
    self.assertIn(f"Distributed GEMM: {schedule}, TP={tp}", out)
    self.assertIn("implementation=auto (ffi)", out)  # auto picks the CPU executor

  @parameterized.parameters("ffi", "xla", "reference")
  def test_implementation_with_batch_and_epilogue(self, implementation):
    out = self.assert_passed_with_timing(run_example(
        [f"--implementation={implementation}", "--tp=2", "--l=2", "--alpha=0.5", "--beta=2",
         "--dtype=fp16", *SMALL]))
    self.assertIn(f"implementation={implementation}", out)
    self.assertIn("L=2, fp16, alpha=0.5 beta=2", out)

  def test_failed_check_exits_1(self):
    # eps=0 cannot hold for a bf16 output: the check must be able to fail.
    proc = run_example(["--tp=2", "--eps=0", *SMALL])
    self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
    self.assertIn("Disposition: Failed", proc.stdout)
    self.assertNotIn("Disposition: Passed", proc.stdout)

  def test_alpha_zero_exact_zero_output_passes(self):
    # alpha=0 and no C: the reference is all zeros and so is the output; no 0/0 NaN.
    out = self.assert_passed_with_timing(run_example(["--tp=2", "--alpha=0", *SMALL]))
    self.assertIn("alpha=0 beta=0", out)
    self.assertIn("(max relative error 0.000e+00, eps", out)

  def test_negative_eps_is_a_usage_error(self):
    proc = run_example(["--tp=2", "--eps=-1", *SMALL])
    self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
    self.assertIn("--eps must be a number >= 0", proc.stderr)

  def test_indivisible_shape_is_a_usage_error(self):
    proc = run_example(["--tp=4", "--m=66", "--n=96", "--k=32"])
    self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
    self.assertIn("M=66 must be divisible by TP=4", proc.stderr)

  @parameterized.parameters(("--alpha", "1e39"), ("--beta", "nan"))  # float32 overflow, NaN
  def test_non_finite_alpha_beta_are_usage_errors(self, flag, value):
    proc = run_example(["--tp=2", f"{flag}={value}", *SMALL])
    self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
    self.assertIn(f"{flag}: must be finite as a float32", proc.stderr)
    self.assertNotIn("Traceback", proc.stderr)

  def test_checked_call_runtime_error_is_a_failure_not_a_traceback(self):
    # The first call (the one checked) times out in device 1: reported like a failed profiled
    # call, with the Disposition, not as a traceback.
    proc = run_example(["--tp=2", *SMALL], python_args=("-c", WITH_FAULT),
                       env_extra={"JAX_DISTGEMM_TIMEOUT_MS": "200"})
    self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
    self.assertIn("Disposition: Failed", proc.stdout)
    self.assertIn("error: the checked call failed: DEADLINE_EXCEEDED", proc.stderr)
    self.assertNotIn("Traceback", proc.stderr)

  def test_ci_runs_the_readme_test_command(self):
    # .ci/run takes the line below from the README; there must be exactly one.
    with open(README) as f:
      commands = [l for l in f.read().splitlines() if re.match(r"python -m pytest( |$)", l)]
    self.assertEqual(commands, ["python -m pytest -q -n 2 tests"])
    with open(os.path.join(REPO, ".ci", "run")) as f:
      ci = f.read()
    self.assertIn("grep -E '^python -m pytest( |$)' README.md", ci)
    self.assertIn('bash -c "$test_cmd"', ci)
    self.assertTrue(os.access(os.path.join(REPO, ".ci", "run"), os.X_OK))

  def test_readme_example_command_with_defaults(self):
    # The README's first command, as written: defaults pick 8 CPU devices and the small shape.
    with open(README) as f:
      readme = f.read()
    self.assertRegex(readme, r"(?m)^python examples/distributed_gemm\.py( +#.*)?$")
    out = self.assert_passed_with_timing(run_example([]))
    self.assertIn("running on 8 fake CPU devices", out)
    self.assertIn("M=512 N=1024 K=256 L=1, bf16", out)


class FlaxExampleCliTest(parameterized.TestCase):
  """examples/flax_tp_mlp.py: bad sizes are usage errors; a nan loss is a failure."""

  @parameterized.parameters(
      ("--tp=0", "--tp must be >= 1"), ("--tp=-2", "--tp must be >= 1"),
      ("--data=0", "--data must be >= 1"), ("--batch=0", "--batch must be >= 1"),
      ("--seq=0", "--seq must be >= 1"), ("--d-model=0", "--d-model must be >= 1"),
      ("--d-ff=-1", "--d-ff must be >= 1"), ("--steps=0", "--steps must be >= 2"),
      ("--steps=1", "--steps must be >= 2"))
  def test_bad_size_is_a_usage_error(self, flag, message):
    proc = run_example([flag], script=FLAX)
    self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
    self.assertIn(message, proc.stderr)
    self.assertNotIn("Traceback", proc.stderr)

  def test_max_difference_keeps_nan(self):
    spec = importlib.util.spec_from_file_location("flax_tp_mlp", FLAX)
    flax_example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flax_example)  # argparse only at import: no JAX started
    self.assertEqual(flax_example.max_difference([1e-7, 3e-6, 2e-7]), 3e-6)
    self.assertTrue(math.isnan(flax_example.max_difference([1e-7, math.nan, 2e-7])))
    self.assertTrue(math.isnan(flax_example.max_difference([math.nan, 1e-7])))

  def test_nan_loss_is_a_failure(self):
    # A nan learning rate makes every loss after the first nan: the summary says so.
    proc = run_example(["--lr=nan", "--steps=2", "--implementation=xla"], script=FLAX)
    self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
    self.assertIn("max relative difference: nan", proc.stdout)
    self.assertIn("Disposition: Failed", proc.stdout)


class LaunchMultiprocessExampleTest(parameterized.TestCase):
  """examples/launch_multiprocess.py: one TP group over 2 processes, checked by each process."""

  def launch(self, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("JAX_DISTGEMM_") and k != "XLA_FLAGS"}
    env["PYTHONSAFEPATH"] = "1"  # the workers import the installed package, not the source tree
    env.update(env_extra or {})
    # A session of its own: a hung job is killed with its workers, not only the launcher.
    proc = subprocess.Popen([sys.executable, LAUNCH, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
      out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      out, err = proc.communicate()
      self.fail(f"the job hung (killed after 240 s):\n{out}\n{err[-3000:]}")
    return proc.returncode, out, err

  @parameterized.parameters("auto", "ffi")
  def test_two_processes_match_the_reference(self, implementation):
    rc, out, err = self.launch(f"--implementation={implementation}")
    self.assertEqual(rc, 0, out + err[-3000:])
    for pid in range(2):
      self.assertRegex(out, rf"process {pid} of 2: all_gather_matmul, TP=4, implementation="
                       rf"{implementation}: max relative error \S+ OK")

  def test_a_wrong_result_fails_the_job(self):
    # The last device's block of all_gather_matmul is off by one (a sitecustomize patches it in
    # every worker: a multi-process job must run the same program everywhere); that device is
    # process 1's, whose own check must say so, and the job must exit non-zero.
    site = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
      f.write("import os\n"
              "if 'JDG_PROCESS_ID' in os.environ:\n"
              "  import jax, jax_distgemm\n"
              "  _op = jax_distgemm.all_gather_matmul\n"
              "  def _off_on_last(*a, **k):\n"
              "    name = k['axis_name']\n"
              "    last = jax.lax.axis_index(name) == jax.lax.psum(1, name) - 1\n"
              "    return _op(*a, **k) + last\n"
              "  jax_distgemm.all_gather_matmul = _off_on_last\n")
    rc, out, err = self.launch(env_extra={"PYTHONPATH": site})
    self.assertEqual(rc, 1, out + err[-3000:])
    self.assertRegex(out, r"process 1 of 2: .* WRONG")
    self.assertRegex(out, r"process 0 of 2: .* OK")


if __name__ == "__main__":
  absltest.main()

"""The host meetings (cc/common/rendezvous.cc, shm_exchange.cc) under sanitizers, without XLA.

tests/rendezvous_stress.cc drives Session/SessionExchange and ShmExchange from TP threads,
with ranks that stop mid-meeting; compiled here with the system C++ compiler under
-fsanitize=thread and -fsanitize=address,undefined, so every access of ours is instrumented on
both sides (run under Python, XLA's uninstrumented threads hide them: docs/reliability.md,
"Host sanitizers").  A data race, a memory error, UB, a wrong peer value or a meeting that
misses a stopped rank fails the test.
"""

import os
import shutil
import subprocess
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
SOURCES = ("tests/rendezvous_stress.cc", "cc/common/rendezvous.cc", "cc/common/shm_exchange.cc")
SANITIZERS = {
    "thread": ("-fsanitize=thread", {"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"}),
    "address_undefined": ("-fsanitize=address,undefined -fno-sanitize-recover=undefined",
                          {"ASAN_OPTIONS": "halt_on_error=1 detect_leaks=1"}),
}


class RendezvousStressTest(parameterized.TestCase):

  @parameterized.parameters(*SANITIZERS)
  def test_meetings_under_sanitizer(self, sanitizer):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    self.assertIsNotNone(cxx, "no C++ compiler (c++ or g++, or $CXX) on PATH")
    flags, env = SANITIZERS[sanitizer]
    with tempfile.TemporaryDirectory() as d:
      exe = os.path.join(d, "stress")
      build = subprocess.run(
          [cxx, "-std=c++17", *flags.split(), "-O1", "-g", f"-I{REPO}",
           *(os.path.join(REPO, s) for s in SOURCES), "-lpthread", "-lrt", "-o", exe],
          capture_output=True, text=True, timeout=300, check=False)
      self.assertEqual(build.returncode, 0, build.stderr[-4000:])
      run = subprocess.run([exe, "150"], capture_output=True, text=True, timeout=300,
                           check=False, env={**os.environ, **env})
    out = run.stdout + run.stderr
    self.assertEqual(run.returncode, 0, out[-6000:])
    self.assertNotIn("WARNING: ThreadSanitizer", out)
    self.assertNotIn("ERROR: AddressSanitizer", out)
    self.assertNotIn("runtime error:", out)  # UBSan
    self.assertRegex(run.stdout, r"in process: 150 meetings, [1-9]\d* timed-out waits, 0 errors")
    self.assertRegex(run.stdout, r"shared memory: 150 meetings, [1-9]\d* timed-out waits, "
                     r"0 errors")


if __name__ == "__main__":
  absltest.main()

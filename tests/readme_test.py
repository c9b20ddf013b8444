"""The README's Python blocks run as written, in order, on 4 fake CPU devices."""

import os
import re
import subprocess
import sys

import pytest
from absl.testing import absltest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
class ReadmeTest(absltest.TestCase):

  def test_python_blocks_run(self):
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
      blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    self.assertGreaterEqual(len(blocks), 3)
    code = "\n".join(['import jax\njax.config.update("jax_num_cpu_devices", 4)'] + blocks +
                     ["assert y.shape == (2, 512, 256), y.shape", "print('ok')"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertEqual(out.stdout.strip().splitlines()[-1], "ok")


if __name__ == "__main__":
  absltest.main()

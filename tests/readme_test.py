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
    self.assertLen(blocks, 3)
    # After each block, what its comments promise: ones @ ones is K=256 everywhere.
    checks = [
        "assert y.shape == (512, 1024) and y.sharding.spec == P(None, 'tp'), y.sharding\n"
        "assert (np.asarray(y, np.float32) == 256).all()",
        "assert y.shape == (512, 1024) and y.sharding.spec == P(None, 'tp'), y.sharding\n"
        "assert (np.asarray(y, np.float32) == 256).all()",
        "assert y.shape == (2, 512, 256), y.shape\nassert np.isfinite(np.asarray(y, np.float32)).all()",
    ]
    code = "\n".join(['import jax\nimport numpy as np\njax.config.update("jax_num_cpu_devices", 4)']
                     + [b + c for b, c in zip(blocks, checks)] + ["print('ok')"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONSAFEPATH="1"))
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertEqual(out.stdout.strip().splitlines()[-1], "ok")


if __name__ == "__main__":
  absltest.main()

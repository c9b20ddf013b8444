"""tools/cublas_kernels.py's arguments, checked before it imports JAX or torch (no GPU needed;
the GPU run itself is docs/performance.md J1)."""

import argparse
import contextlib
import io
import os
import sys

from absl.testing import absltest
from absl.testing import parameterized

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import cublas_kernels  # noqa: E402  pylint: disable=g-import-not-at-top


class ArgsTest(parameterized.TestCase):

  def test_shape_parses_m_k_n(self):
    self.assertEqual(cublas_kernels._shape("4096,8192,14336"),
                     ("4096,8192,14336", 4096, 8192, 14336))

  @parameterized.parameters("1,2", "1,x,3", "", "0,8,8", "8,-1,8")
  def test_bad_shape_is_rejected(self, text):
    with self.assertRaises(argparse.ArgumentTypeError):
      cublas_kernels._shape(text)

  @parameterized.parameters((["--calls", "0"],), (["--shapes", "8,8"],))
  def test_bad_arguments_are_usage_errors(self, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as cm:
      cublas_kernels.main(argv)
    self.assertEqual(cm.exception.code, 2)
    self.assertIn("error:", err.getvalue())


if __name__ == "__main__":
  absltest.main()

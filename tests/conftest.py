"""pytest configuration: the tests import the INSTALLED jax_distgemm, never the source tree.

`python -m pytest` (the README's test command) puts the working directory first on sys.path.
Run from the repository root, that directory holds the jax_distgemm sources, which have no
compiled extension after a regular `pip install .` (the extension goes to site-packages), so
`import jax_distgemm` would fail there.  So the package is imported here once with the
repository root left out of sys.path; every later import gets that module from sys.modules.
sys.path is then restored (a test may still import `tests.test_util` from the root).  Editable
installs are unaffected: their import hook comes first either way.  Importing the package does
not start JAX's backends, so test_util can still request its fake CPU devices.

Child interpreters that tests start (`python -m jax_distgemm.bench`, the examples) would put
their working or script directory first in the same way; PYTHONSAFEPATH=1 (Python >= 3.11)
stops that, so they import the installed package too.
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_saved_path = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPO]
try:
  import jax_distgemm  # noqa: F401
finally:
  sys.path[:] = _saved_path

os.environ["PYTHONSAFEPATH"] = "1"

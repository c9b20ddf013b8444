"""pytest configuration: the tests import the INSTALLED jax_distgemm, never the source tree.

`python -m pytest` (the README's test command) puts the working directory first on sys.path.
Run from the repository root, that directory holds the jax_distgemm sources, which have no
compiled extension after a regular `pip install .` (the extension goes to site-packages), so
`import jax_distgemm` would fail there.  Dropping the repository root from sys.path makes the
installed package win.  Editable installs are unaffected: their import hook comes first anyway.
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPO]

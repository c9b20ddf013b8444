"""Loads the compiled extension modules and registers their FFI targets with JAX.

_distgemm_cpu is always built; _distgemm_cuda only where nvcc was found at build time.
"""

from __future__ import annotations

import os
import threading

import jax

try:
  from jax_distgemm.ffi import _distgemm_cpu
except ImportError as e:  # pragma: no cover - a broken install
  _here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if os.path.exists(os.path.join(os.path.dirname(_here), "pyproject.toml")):
    # NOTE: `python` run from the repository root puts it first on sys.path, so this is the
    # source tree (no compiled modules after a regular `pip install .`), not the install.
    raise ImportError(
        f"jax_distgemm: imported from the source tree at {_here}, which has no compiled "
        "extension (_distgemm_cpu): run from another directory to use the installed package, "
        "or install it in place with `pip install -e .`") from e
  raise ImportError(
      "jax_distgemm: the compiled CPU extension (_distgemm_cpu) is missing; reinstall the "
      "package with `pip install .` so that it is built") from e

try:
  from jax_distgemm.ffi import _distgemm_cuda
except ImportError as e:
  _distgemm_cuda = None
  cuda_import_error: ImportError | None = e
else:
  cuda_import_error = None

for _name, _type in _distgemm_cpu.types().items():
  jax.ffi.register_ffi_type(_name, _type, platform="cpu")
_cpu_targets_lock = threading.Lock()
_cpu_targets_registered = False


def register_cpu_targets() -> None:
  """Registers the CPU targets (once), after the CPU backend and with it our state type.

  NOTE: the CPU target's instantiate stage keeps a state type (a call site; cc/cpu/
  distgemm_cpu.cc), which XLA needs registered before the handler.  jaxlib's make_cpu_client
  registers the targets queued before it existed ahead of the queued types, and then refuses
  the handler ("Types used by FFI handlers must be registered before the handler
  registration"), so the target is registered here, at our primitive's first CPU lowering,
  with the backend up (not at import: that would fix jax_num_cpu_devices before the user sets
  it).
  """
  global _cpu_targets_registered
  with _cpu_targets_lock:
    if _cpu_targets_registered:
      return
    jax.devices("cpu")  # the CPU client, which registered our type as it started
    for name, target in _distgemm_cpu.registrations().items():
      jax.ffi.register_ffi_target(name, target, platform="cpu")
    _cpu_targets_registered = True


if _distgemm_cuda is not None:
  for _name, _target in _distgemm_cuda.registrations().items():
    jax.ffi.register_ffi_target(_name, _target, platform="CUDA")


def module_for(platform: str):
  """The extension module serving `platform` ('cpu' or 'cuda'), or None."""
  platform = platform.lower()
  if platform == "cpu":
    return _distgemm_cpu
  if platform in ("cuda", "gpu"):
    return _distgemm_cuda
  return None


def has_cuda() -> bool:
  return _distgemm_cuda is not None

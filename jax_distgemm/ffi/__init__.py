"""Loads the compiled extension modules and registers their FFI targets with JAX.

_distgemm_cpu is always built; _distgemm_cuda only where nvcc was found at build time.
"""

from __future__ import annotations

import importlib
import os
import threading

import jax
from jaxlib import xla_client as _xla_client

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


def _import_cuda():
  """(the CUDA extension module, None), or (None, an ImportError saying why there is none)."""
  name = f"{__name__}._distgemm_cuda"
  try:
    return importlib.import_module(name), None
  except ImportError as e:
    # NOTE: not `from jax_distgemm.ffi import _distgemm_cuda`: inside this package's own
    # __init__, a missing submodule reads "partially initialized module ... (most likely due to
    # a circular import)", which is not what happened.
    if isinstance(e, ModuleNotFoundError) and e.name == name:
      return None, ImportError(f"the CUDA extension {name} was not built: no _distgemm_cuda "
                               f"module in {', '.join(__path__)}")
    # Present but broken: e.g. a CUDA runtime library it links is missing.
    return None, ImportError(f"the CUDA extension {name} is installed but does not load: {e}")


_distgemm_cuda, cuda_import_error = _import_cuda()

_cpu_targets_lock = threading.Lock()
_cpu_targets_registered = False


def _flush_cpu_types() -> bool:
  """Registers the queued CPU types with XLA now, before any CPU client exists.

  NOTE: the CPU target's instantiate stage keeps a state type (a call site; cc/cpu/
  distgemm_cpu.cc), which XLA needs registered before the handler.  jaxlib's make_cpu_client
  registers the targets queued before it existed ahead of the queued types, and then refuses
  the handler ("Types used by FFI handlers must be registered before the handler
  registration").  XLA's FFI type registry is process-wide, not the client's, so installing
  jaxlib's own CPU type handler here (the one make_cpu_client installs, which then finds it
  in place) registers our type at import, without starting the CPU client (that would fix
  jax_num_cpu_devices before the user sets it).  jaxlib 0.11.2 and 0.12.0.1 both have it;
  where a jaxlib does not, False: the target then waits for our first CPU lowering.
  """
  register = getattr(getattr(_xla_client, "_xla", None), "register_custom_type", None)
  install = getattr(_xla_client, "register_custom_type_handler", None)
  if register is None or install is None:  # pragma: no cover - another jaxlib
    return False
  install("cpu", register)
  return True


def register_cpu_targets() -> None:
  """Registers the CPU targets with XLA (once).

  Runs at import where the state type could be registered first (`_flush_cpu_types`), so a
  program that reaches XLA without our lowering (a deserialized `jax.export` artifact) finds
  the target; otherwise at our primitive's first CPU lowering, with the CPU client (which
  registers the type as it starts) up.
  """
  global _cpu_targets_registered
  with _cpu_targets_lock:
    if _cpu_targets_registered:
      return
    if not _cpu_types_flushed:
      jax.devices("cpu")  # the CPU client, which registered our type as it started
    for name, target in _distgemm_cpu.registrations().items():
      jax.ffi.register_ffi_target(name, target, platform="cpu")
    _cpu_targets_registered = True


for _name, _type in _distgemm_cpu.types().items():
  jax.ffi.register_ffi_type(_name, _type, platform="cpu")
_cpu_types_flushed = _flush_cpu_types()
if _cpu_types_flushed:
  register_cpu_targets()


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

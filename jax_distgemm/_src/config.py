"""Process-wide defaults, overridable by environment variables; process-wide warnings; the
platform a call runs on."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import jax
import jaxlib

_log = logging.getLogger("jax_distgemm")
_given: set = set()  # keys of the warnings and log lines given (once per process)
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))) + os.sep
    for m in (jax, jaxlib))
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_FLAX_PART = os.sep + "flax" + os.sep  # nnx layers are often called through Flax's wrappers


def caller_frame():
  """The innermost frame outside jax_distgemm, jax and jaxlib (the user's line)."""
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    path = os.path.abspath(frame.f_code.co_filename)
    if not (path.startswith(_OWN_DIR) or path.startswith(_LIBRARY_DIRS) or _FLAX_PART in path):
      return frame
    frame = frame.f_back
  return None


def warn(key, msg: str, category=UserWarning) -> None:
  """A Python warning at the caller's line, once per `key` per process."""
  if key in _given:
    return
  _given.add(key)
  frame = caller_frame()
  if frame is None:
    warnings.warn(msg, category, stacklevel=2)
    return
  warnings.warn_explicit(msg, category, frame.f_code.co_filename, frame.f_lineno,
                         module=frame.f_globals.get("__name__"),
                         registry=frame.f_globals.setdefault("__warningregistry__", {}))


def log_once(key, msg: str, *args, level: int = logging.INFO) -> None:
  """One line per `key` per process on the "jax_distgemm" logger (msg % args)."""
  if key not in _given:
    _given.add(key)
    _log.log(level, msg, *args)

# 30 s: long enough that a peer delayed by a loaded host (8 fake CPU devices on a 2-core CI box,
# a process still compiling) is not an error, and below XLA:CPU's own 40 s bound on its
# collectives, so a real hang names our call before XLA terminates the process.
_DEFAULT_TIMEOUT_MS = 30000
_DEFAULT_MAX_WORKSPACE_MB = 8192
# ~24.8 days: far beyond any wait worth bounding, and far below what the executors' deadlines
# (steady_clock::now() + timeout, %globaltimer ns) can hold without overflowing.
MAX_TIMEOUT_MS = 2**31 - 1


def platform() -> str:
  """The platform of the devices a traced call runs on: the context mesh's, else the default
  backend's."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "platform", None):
    return device.platform.lower()
  return jax.default_backend().lower()


def check_timeout_ms(value, what: str = "timeout_ms") -> int:
  """`value` as a timeout in ms: an integer (not a bool or float) in [1, MAX_TIMEOUT_MS]."""
  import numbers  # noqa: PLC0415
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{what}: must be a positive integer, got {value!r} "
                     f"({type(value).__name__}; milliseconds)")
  ms = int(value)
  if ms < 1:
    raise ValueError(f"{what}: must be a positive integer, got {ms}")
  if ms > MAX_TIMEOUT_MS:
    raise ValueError(f"{what}: must be at most {MAX_TIMEOUT_MS} ms (~24.8 days), got {ms}")
  return ms


def default_timeout_ms() -> int:
  """Bound on every wait for a peer (GPU flag spin or host rendezvous), in milliseconds.

  JAX_DISTGEMM_TIMEOUT_MS overrides the default of 30000.
  """
  value = os.environ.get("JAX_DISTGEMM_TIMEOUT_MS")
  if value is None:
    return _DEFAULT_TIMEOUT_MS
  try:
    ms = int(value)
  except ValueError:
    raise ValueError(
        f"JAX_DISTGEMM_TIMEOUT_MS must be a positive integer, got {value!r}") from None
  if ms < 1:
    raise ValueError(f"JAX_DISTGEMM_TIMEOUT_MS must be a positive integer, got {ms}")
  if ms > MAX_TIMEOUT_MS:
    raise ValueError(f"JAX_DISTGEMM_TIMEOUT_MS must be at most {MAX_TIMEOUT_MS} ms, got {ms}")
  return ms


def forced_implementation() -> str | None:
  """JAX_DISTGEMM_IMPLEMENTATION's value, if set (implementation.requested checks it)."""
  return os.environ.get("JAX_DISTGEMM_IMPLEMENTATION") or None


def workspace_cap_bytes() -> int:
  """Largest workspace (bytes) the fused CUDA path may need; bigger cases are refused before launch.

  JAX_DISTGEMM_MAX_WORKSPACE_MB overrides the default of 8192 MiB.  See
  cuda_rules.workspace_bytes for the estimate it is compared with.
  """
  value = os.environ.get("JAX_DISTGEMM_MAX_WORKSPACE_MB")
  if value is None:
    return _DEFAULT_MAX_WORKSPACE_MB << 20
  try:
    mb = int(value)
  except ValueError:
    raise ValueError(
        f"JAX_DISTGEMM_MAX_WORKSPACE_MB must be a positive integer (MiB), got {value!r}"
    ) from None
  if mb <= 0:
    raise ValueError(f"JAX_DISTGEMM_MAX_WORKSPACE_MB must be a positive integer (MiB), got {mb}")
  return mb << 20


# JAX_DISTGEMM_RS_PATH's names and the values of the `rs_path` attribute (RsPath in
# cc/common/workspace.h); 0, unset: the executor chooses per shape.
RS_PATHS = {"remote_c": 1, "copy_ring": 2, "gather": 3}


def rs_path_override() -> int:
  """The ReduceScatter data path JAX_DISTGEMM_RS_PATH asks for, as the `rs_path` attribute of
  the FFI call (0: unset, the executor chooses per shape).

  A test hook, read when a call is lowered, so that every device of the call runs the same
  path: an executable already compiled keeps the path it was lowered with.
  """
  value = os.environ.get("JAX_DISTGEMM_RS_PATH") or None
  if value is None:
    return 0
  if value not in RS_PATHS:
    raise ValueError("JAX_DISTGEMM_RS_PATH must be " +
                     ", ".join(repr(name) for name in RS_PATHS) +
                     f" or unset, got {value!r}")
  return RS_PATHS[value]

"""Multi-process runs (jax.distributed, one or more devices per process): the setup call.

    jax.distributed.initialize(...)
    jax_distgemm.initialize_multiprocess()

Afterwards implementation="ffi" accepts TP groups whose devices live in several processes of
one host.  On CPU the executor meets them through POSIX shared memory
(cc/common/shm_exchange.h, docs/design.md "Multi-process").  On CUDA (one GPU per process in
such a group) each member's symmetric workspace and flags are exported as CUDA IPC memory
handles, which travel through a shared-memory meeting of the group at its first call (and when
the workspace grows); peers open them once (cc/cuda/peer_ipc.cc).  What this call settles,
through JAX's distributed key-value store:

* the job token that names every shared-memory segment: a hash of the coordinator address and a
  nonce drawn by process 0, so a job never meets the segments of another job or of a crashed
  run;
* which processes share this host (hostname and boot id), so that a TP group with a member on
  another host is refused at lowering with a clear message instead of timing out;
* the map of this process's device ordinals to global device ids, which the handler uses to
  tell local from remote members.

It also removes segments that crashed processes of earlier jobs left in /dev/shm, and makes
sure this process unlinks its own at exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import math
import numbers
import os
import secrets
import socket
import threading
import time

import jax

from jax_distgemm import ffi as ffi_modules
from jax_distgemm._src import config, device_ids

_KEY = "jax_distgemm/multiprocess/v1"


@dataclasses.dataclass(frozen=True)
class State:
  token: str
  process_index: int
  hosts: tuple[str, ...]  # host identity of every process, by process index

  def same_host(self, process_index: int) -> bool:
    return self.hosts[int(process_index)] == self.hosts[self.process_index]


_state: State | None = None
_client_used = None
_atexit_registered = False


def _host_identity() -> str:
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
  except OSError:
    boot = ""
  return f"{socket.gethostname()}|{boot}"


def _distributed_state():
  """(client, coordinator address, process index, process count) of jax.distributed, read from
  its global state: jax.process_index() would start the backend, which waits for every process
  (up to JAX's own 2 min) outside any bound of ours."""
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - very old or very new jax
    return None, None, None, None
  gs = distributed.global_state
  return (gs.client, getattr(gs, "coordinator_address", None), getattr(gs, "process_id", None),
          getattr(gs, "num_processes", None))


def _check_timeout_s(timeout_s) -> int:
  """`timeout_s` (a finite number of seconds > 0, at most config.MAX_TIMEOUT_MS ms) in whole
  ms (>= 1)."""
  what = "jax_distgemm.initialize_multiprocess: timeout_s"
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
    raise TypeError(f"{what}: must be a number of seconds, got {timeout_s!r} "
                    f"({type(timeout_s).__name__})")
  seconds = float(timeout_s)
  if not (math.isfinite(seconds) and seconds > 0):
    raise ValueError(f"{what}: must be a finite number of seconds > 0, got {timeout_s!r}")
  if seconds * 1000 > config.MAX_TIMEOUT_MS:
    raise ValueError(f"{what}: must be at most {config.MAX_TIMEOUT_MS / 1000} s (~24.8 days), "
                     f"got {timeout_s!r}")
  return max(1, math.ceil(seconds * 1000))


_backend_start: tuple[threading.Thread, list] | None = None


def _start_backend(timeout_s: float, where: str) -> None:
  """Starts JAX's backends within `timeout_s`: their start is itself an exchange with every
  process (XLA's local topologies), which waits up to JAX's own 2 min for a missing one.  It
  runs on a thread that a retry joins again."""
  global _backend_start
  if _backend_start is None:
    failure: list = []

    def start():
      try:
        jax.devices()
      except BaseException as e:  # noqa: BLE001  (re-raised by the caller)
        failure.append(e)

    thread = threading.Thread(target=start, name="jax_distgemm backend start", daemon=True)
    thread.start()
    _backend_start = (thread, failure)
  thread, failure = _backend_start
  thread.join(timeout_s)
  if thread.is_alive():
    raise RuntimeError(
        f"jax_distgemm.initialize_multiprocess: {where}: JAX's backend did not start within "
        f"{timeout_s} s (its start waits for every process of the job: did one stop or exit "
        "before its first JAX call?)")
  if failure:
    _backend_start = None  # a later call tries again
    raise RuntimeError(f"jax_distgemm.initialize_multiprocess: {where}: starting JAX's backend "
                       f"failed: {failure[0]}") from failure[0]


def _exchange(client, key: str, mine: str, me: int, n: int, timeout_ms: int) -> tuple[str, ...]:
  """Every process's value under `key` (this one's is `mine`), all within `timeout_ms`; set
  with allow_overwrite, so a call retried after a timeout meets the others again."""
  client.key_value_set(f"{key}/{me}", mine, allow_overwrite=True)
  deadline = time.monotonic() + timeout_ms / 1000
  left_ms = lambda: max(1, math.ceil((deadline - time.monotonic()) * 1000))
  return tuple(client.blocking_key_value_get(f"{key}/{p}", left_ms()) for p in range(n))


def initialize_multiprocess(timeout_s: float = 60.0) -> None:
  """Prepares implementation="ffi" for TP groups that span processes of one host.

  Call it in every process after `jax.distributed.initialize()` and before the first
  distgemm call is lowered; all processes must call it (it waits for the others, at most
  `timeout_s` seconds per step: the job token and hosts, the start of JAX's backend, the final
  meeting).  Calling it again in the same job does nothing; calling it again after a timeout
  meets the processes that arrive late.

  Raises:
    TypeError, ValueError: `timeout_s` is not a finite number of seconds in (0, ~24.8 days].
    RuntimeError: jax.distributed is not initialized, or the other processes did not answer
      within `timeout_s`.
  """
  global _state, _client_used, _atexit_registered
  timeout_ms = _check_timeout_s(timeout_s)
  client, coordinator, me, n = _distributed_state()
  if client is None:
    raise RuntimeError(
        "jax_distgemm.initialize_multiprocess: call jax.distributed.initialize() first (the "
        "processes agree on shared-memory names through its key-value store)")
  if _state is not None and client is _client_used:
    return
  if me is None or n is None:  # pragma: no cover - a jax without them: ask the backend
    _start_backend(timeout_s, "this process")
    me, n = jax.process_index(), jax.process_count()
  try:
    if me == 0:
      try:
        client.key_value_set(f"{_KEY}/nonce", secrets.token_hex(8))
      except Exception as e:  # noqa: BLE001
        if "ALREADY_EXISTS" not in str(e):  # a retry: keep the nonce the others may hold
          raise
    nonce = client.blocking_key_value_get(f"{_KEY}/nonce", timeout_ms)
    hosts = _exchange(client, f"{_KEY}/host", _host_identity(), me, n, timeout_ms)
  except Exception as e:  # the client raises XlaRuntimeError (DEADLINE_EXCEEDED, ...)
    raise RuntimeError(
        f"jax_distgemm.initialize_multiprocess: process {me} of {n} could not agree on the job "
        f"token with the other processes within {timeout_s} s (does every process call "
        f"initialize_multiprocess()?): {e}") from e
  token = hashlib.sha256(f"{coordinator}|{nonce}".encode()).hexdigest()[:16]
  _start_backend(timeout_s, f"process {me} of {n}")
  if (jax.process_index(), jax.process_count()) != (me, n):
    raise RuntimeError(
        f"jax_distgemm.initialize_multiprocess: jax.distributed says process {me} of {n}, the "
        f"backend says {jax.process_index()} of {jax.process_count()}")

  ffi_modules.module_for("cpu").sweep_stale_shm_segments()  # before any token: not this job's
  for platform in ("cpu", "cuda"):
    module = ffi_modules.module_for(platform)
    if module is None:
      continue
    module.set_job_token(token)  # each extension module keeps its own shared-memory state
    try:
      device_ids.register(platform)
    except RuntimeError:  # no such backend (JAX_PLATFORMS): nothing to register
      pass
  if not _atexit_registered:
    atexit.register(release)
    _atexit_registered = True
  try:  # a barrier of key-value pairs: wait_at_barrier cannot be retried after a timeout
    _exchange(client, f"{_KEY}/ready", token, me, n, timeout_ms)
  except Exception as e:
    raise RuntimeError(
        f"jax_distgemm.initialize_multiprocess: process {me} of {n}: not every process "
        f"finished its setup within {timeout_s} s: {e}") from e
  _state = State(token=token, process_index=me, hosts=hosts)
  _client_used = client


def state() -> State | None:
  """The job's multi-process state, or None before initialize_multiprocess()."""
  return _state


def release() -> list[str]:
  """Unlinks the shared-memory segments this process created (run at exit); their names."""
  names = []
  for platform in ("cpu", "cuda"):
    module = ffi_modules.module_for(platform)
    if module is not None:
      names += list(module.release_shm_segments())
  return names


def shm_segment_prefix(token: str | None = None) -> str:
  """The /dev/shm file-name prefix of this job's segments."""
  token = token or (_state.token if _state else "")
  return f"jdg_{token}_"


def leftover_segments(token: str) -> list[str]:
  """This job's segment files still in /dev/shm (for tests and the launcher)."""
  try:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(shm_segment_prefix(token)))
  except FileNotFoundError:
    return []

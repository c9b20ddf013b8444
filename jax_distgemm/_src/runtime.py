"""Host-side controls of the CUDA executor: recovery after a timed-out wait, tuning report."""

from __future__ import annotations

from jax_distgemm import ffi as ffi_modules


def reset() -> None:
  """Recovers the CUDA executor after a timed-out peer wait.

  Drains every GPU the executor used, zeroes its flags and call epochs and clears the sticky
  error, so the next call starts clean.  Call it when no distgemm call is in flight (after
  the failing call's exception, once outstanding results were blocked on or dropped).  On a
  process without the CUDA executor it does nothing (the CPU executor needs no recovery: each
  call meets its peers afresh).
  """
  module = ffi_modules.module_for("cuda")
  if module is None:
    return
  err = module.reset()
  if err:
    raise RuntimeError(f"jax_distgemm.reset: {err}")


def pending_error() -> str | None:
  """The sticky error a timed-out GPU wait left behind, or None."""
  module = ffi_modules.module_for("cuda")
  if module is None:
    return None
  return module.pending_error() or None


def describe_tuning() -> str:
  """The stage GEMM configuration chosen per shape so far (CUDA), one line each."""
  module = ffi_modules.module_for("cuda")
  return "" if module is None else module.describe_tuning()


def copy_stream_reports() -> list[dict]:
  """How each initialized GPU's copy stream was chosen (CUDA; [] otherwise).

  A copy stream that shares XLA's compute stream's hardware queue holds up the compute stream
  whenever it waits (cc/cuda/copy_stream.h); the executor probes candidates and keeps one that
  does not (`independent` 1), unless JAX_DISTGEMM_COPY_STREAM=plain.
  """
  module = ffi_modules.module_for("cuda")
  if module is None or not hasattr(module, "copy_stream_reports"):
    return []
  return [{"ordinal": o, "candidates": n, "independent": i, "note": note,
           "group": list(group), "rank": rank}
          for o, n, i, note, group, rank in module.copy_stream_reports()]


def describe_copy_stream(report: dict) -> str:
  """One line for a copy_stream_reports() entry, naming its peer group (a GPU has one copy
  stream per group it is in, e.g. the TP=1 local-GEMM group and the TP=2 one)."""
  members = ", ".join("another process" if o < 0 else f"GPU {o}" for o in report["group"])
  note = f" ({report['note']})" if report["note"] else ""
  return (f"copy stream of GPU {report['ordinal']} as rank {report['rank']} of "
          f"TP={len(report['group'])} group [{members}]: {report['candidates']} candidate(s), "
          f"independent of XLA's compute stream: {report['independent']}{note}")

"""Host-side controls of the CUDA executor: recovery after a timed-out wait, the tuning report,
saved tuning choices."""

from __future__ import annotations

import contextlib
import json
import os

from jax_distgemm import ffi as ffi_modules


def reset() -> None:
  """Recovers the CUDA executor after a timed-out peer wait.

  Drains every GPU the executor used, moves the call epochs past any a late peer could still
  deliver and clears the sticky error, so the next call starts clean.  Call it when no
  distgemm call is in flight (after the failing call's exception, once outstanding results
  were blocked on or dropped), in every process of a group that spans processes.  On a
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


# -- Saved tuning choices -----------------------------------------------------------------------

TUNING_FORMAT = "jax_distgemm tuning"
TUNING_VERSION = 2
# Field -> accepted types of one saved choice (cc/cuda/autotune.h, TuningRecord).
_TUNING_FIELDS = {
    "gpu": (str,), "sm_count": (int,), "ab_type": (str,), "d_type": (str,), "has_c": (bool,),
    "m": (int,), "n": (int,), "k": (int,), "batch": (int,), "shared_b": (bool,),
    "fused_stages": (int,), "config": (str,), "raster": (int,), "swizzle": (int,),
    "ms": (int, float),
}
# Version 1 records also named how they were timed.  Those timed the one way the tuner still
# times (tune_mode "sustained", turn_heat_ms -1: the default turn heat) load as version 2
# records; their call_trials and call_ms are ignored.
_V1_TIMING_FIELDS = {"tune_mode": (str,), "turn_heat_ms": (int,)}
_V1_ONLY_FIELDS = ("tune_mode", "turn_heat_ms", "call_trials", "call_ms")


def save_tuning(path) -> int:
  """Writes every stage-GEMM choice this process has settled (CUDA) to `path` (JSON).

  A choice is keyed by the GPU model and SM count, the types and the stage shape, not by the
  device ordinal: load_tuning installs it on every GPU of that model.  So one record per key is
  written: where devices chose differently, the one with the lowest tuner time.  The file is
  written in the current version (TUNING_VERSION), and replaced, not merged into: records
  already in it are gone (`python -m jax_distgemm.bench --tuning-file` keeps them).  A path
  that cannot be written (a missing directory, a directory) raises ValueError naming it, and
  leaves whatever was at `path` as it was.  Returns how many were written (0 without the CUDA
  executor).
  """
  return _save_tuning(path, keep_existing=False)[0]


def _save_tuning(path, keep_existing: bool) -> tuple[int, int]:
  """save_tuning, or with `keep_existing` a merge into the tuning file at `path`.

  With `keep_existing`, the file's records whose key (_TUNING_KEY: GPU model and SM count,
  types, shape) this process did not settle stay, in their order and
  ahead of this process's, so that a run on one GPU model, or of some shapes, does not drop the
  others' (e.g. a file shared by H100 and H200 runs, or a suite's file after a one-shape run);
  on a key both have, this process's choice wins.  Where the file has one key twice, the last
  stays (the one load_tuning leaves installed).  The file is read here, not taken from an
  earlier load_tuning, so what another run saved since is kept too (NOTE: two runs saving at
  once still race: the later rename wins).  A missing file merges as an empty one; one that
  load_tuning would reject raises its ValueError (prefixed save_tuning), and nothing is
  written.  Returns (records of this process, records kept from the file).
  """
  where = "jax_distgemm.save_tuning"
  path = os.fspath(path)
  module = ffi_modules.module_for("cuda")
  settled = _one_per_key([] if module is None else list(module.export_tuning()))
  kept: list[dict] = []
  if keep_existing and os.path.exists(path):
    entries = _read_tuning(path, where)["entries"]
    mine = {_key(e) for e in settled}
    last = {_key(e): i for i, e in enumerate(entries)}
    kept = [e for i, e in enumerate(entries) if _key(e) not in mine and last[_key(e)] == i]
  data = {"format": TUNING_FORMAT, "version": TUNING_VERSION, "entries": kept + settled}
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1)
    os.replace(tmp, path)  # never a half-written file under `path`
  except OSError as e:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise ValueError(f"{where}: cannot write {path}: {e.strerror or e}") from e
  return len(settled), len(kept)


# What a choice is for (its key); the rest of a record is the choice.
_TUNING_KEY = ("gpu", "sm_count", "ab_type", "d_type", "has_c", "m", "n", "k", "batch",
               "shared_b", "fused_stages")


def _key(entry: dict) -> tuple:
  return tuple(entry[f] for f in _TUNING_KEY)


def _one_per_key(entries: list[dict]) -> list[dict]:
  """One record per key.  The module exports one per device, and a load installs a record on
  every GPU of its model: where the devices of a model chose differently, keep the choice whose
  tuner time was lowest (NOTE: each device timed its own candidates; their times compare only
  as well as the devices do)."""
  def tuner_ms(e):  # < 0: not timed, ranks last
    return e["ms"] if e["ms"] > 0 else float("inf")

  best: dict[tuple, dict] = {}
  for e in entries:
    key = _key(e)
    if key not in best or tuner_ms(e) < tuner_ms(best[key]):
      best[key] = e
  return list(best.values())


def _check_entry(where: str, entry, version: int) -> dict:
  """The entry as a current (version 2) record, checked; ValueError (prefixed `where`) naming
  the rule it breaks."""
  if not isinstance(entry, dict):
    raise ValueError(f"{where}: each entry must be a JSON object, got {type(entry).__name__}")
  fields = _TUNING_FIELDS if version == TUNING_VERSION else {**_TUNING_FIELDS,
                                                             **_V1_TIMING_FIELDS}
  missing = sorted(set(fields) - set(entry))
  if missing:
    raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
  for name, types in fields.items():
    v = entry[name]
    # JSON's true/false are Python bools, which are ints too: keep them apart.
    if isinstance(v, bool) != (types == (bool,)) or not isinstance(v, types):
      want = " or ".join(t.__name__ for t in types)
      raise ValueError(f"{where}: field {name!r} must be {want}, got {v!r}")
  for name in ("m", "n", "k", "batch", "sm_count"):
    if entry[name] < 1:
      raise ValueError(f"{where}: field {name!r} must be >= 1, got {entry[name]}")
  if version == TUNING_VERSION:
    return entry
  if entry["tune_mode"] != "sustained" or entry["turn_heat_ms"] != -1:
    raise ValueError(
        f"{where}: tune_mode {entry['tune_mode']!r} with turn_heat_ms {entry['turn_heat_ms']}: "
        "a version 1 record loads only if it was tuned the way this jax_distgemm tunes "
        "(tune_mode 'sustained', turn_heat_ms -1)")
  return {k: v for k, v in entry.items() if k not in _V1_ONLY_FIELDS}


def _read_tuning(path: str, where: str) -> dict:
  """The checked contents of the tuning file at `path`, its entries as current (version 2)
  records; ValueError (prefixed `where`) if it cannot be read or is not a valid tuning file."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:  # missing, a directory, unreadable
    raise ValueError(f"{where}: cannot read {path}: {e.strerror or e}") from e
  try:
    data = json.loads(raw.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise ValueError(f"{where}: {path} is not JSON: not UTF-8 text ({e.reason} at byte "
                     f"{e.start})") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: {path} is not JSON: {e}") from None
  except RecursionError:  # NOTE: json's decoder recurses once per nesting level
    raise ValueError(f"{where}: {path} is not JSON: nested too deeply to parse") from None
  if (not isinstance(data, dict) or data.get("format") != TUNING_FORMAT or
      not isinstance(data.get("entries"), list)):
    raise ValueError(f"{where}: {path} is not a jax_distgemm tuning file "
                     f"(want an object with format {TUNING_FORMAT!r} and a list 'entries')")
  version = data.get("version")
  # JSON's true and 1.0 compare equal to 1: only the integer is version 1.
  if type(version) is not int or version not in (1, TUNING_VERSION):
    raise ValueError(f"{where}: {path} has version {version!r}; "
                     f"this jax_distgemm reads versions 1 and {TUNING_VERSION}")
  entries = [_check_entry(f"{where}: {path}: entry {i}", entry, version)
             for i, entry in enumerate(data["entries"])]
  return {**data, "version": TUNING_VERSION, "entries": entries}


def load_tuning(path) -> int:
  """Installs the choices save_tuning wrote, so that their shapes skip tuning (CUDA).

  Each choice goes to every visible GPU of its model and SM count, replacing what this process
  chose for the same key (types, shape).  Reads version 2 files and version 1 files, whose
  records load where they were tuned the way this version tunes (tune_mode "sustained",
  turn_heat_ms -1).  A path that cannot be read (missing, a directory), a file that does not
  parse (not UTF-8 JSON, or nested too deeply), another format or version, or any invalid
  entry raises ValueError naming the path (and the entry and the rule), and installs nothing.
  Call it before the calls, or between them as for reset().  Returns how many (choice, GPU)
  pairs were installed: 0 without the CUDA executor, or where no GPU of the file's models is
  visible.  NOTE: the names in a record (kernel config, element types) and the ranges of
  raster, swizzle and fused_stages are the CUDA executor's to check (its tables); a build
  without it checks the file's structure, field types and sizes only.
  """
  path = os.fspath(path)
  data = _read_tuning(path, "jax_distgemm.load_tuning")
  module = ffi_modules.module_for("cuda")
  if module is None:
    return 0
  try:
    return int(module.import_tuning(data["entries"]))
  except ValueError as e:  # a name this build does not know, a config it did not compile
    raise ValueError(f"jax_distgemm.load_tuning: {path}: {e}") from None


def clear_tuning() -> None:
  """Forgets every stage-GEMM choice (CUDA): each shape tunes again at its next call.  No-op
  without the CUDA executor."""
  module = ffi_modules.module_for("cuda")
  if module is not None:
    module.clear_tuning()


def copy_stream_reports() -> list[dict]:
  """How each initialized GPU's copy stream was chosen (CUDA; [] otherwise).

  A copy stream that shares XLA's compute stream's hardware queue holds up the compute stream
  whenever it waits (cc/cuda/copy_stream.h); the executor probes candidates and keeps one that
  does not (`independent` 1; -1 where it could not probe).
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

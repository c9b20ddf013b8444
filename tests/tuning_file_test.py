"""jax_distgemm.save_tuning / load_tuning / clear_tuning without a GPU: the file format, the
checks that name the entry and the rule, and what reaches the CUDA module (a fake here; the GPU
round trip is tests/cuda_tuning_test.py)."""

import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

import jax_distgemm as jd
from jax_distgemm._src import runtime

ENTRY = {
    "gpu": "NVIDIA H200", "sm_count": 132, "ab_type": "bfloat16", "d_type": "bfloat16",
    "has_c": False, "m": 4096, "n": 14336, "k": 8192, "batch": 1, "shared_b": False,
    "fused_stages": 2, "config": "Cooperative 128x256x64 cluster 1x1", "raster": 1,
    "swizzle": 8, "ms": 2.9,
}
# The same choice as a version 1 file recorded it: how it was timed, and a call trial's fields.
V1_ENTRY = {**ENTRY, "tune_mode": "sustained", "turn_heat_ms": -1, "call_trials": True,
            "call_ms": [-1.0, -1.0]}


def v1_file(entries):
  return {"format": runtime.TUNING_FORMAT, "version": 1, "entries": entries}


def tuning_file(entries):
  return {"format": runtime.TUNING_FORMAT, "version": runtime.TUNING_VERSION, "entries": entries}


def fake_module(entries=(), installed=2):
  return mock.Mock(export_tuning=mock.Mock(return_value=list(entries)),
                   import_tuning=mock.Mock(return_value=installed),
                   clear_tuning=mock.Mock())


class TuningFileTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()  # (absltest's create_tempdir needs parsed flags)
    self.addCleanup(tmp.cleanup)
    self.dir = tmp.name
    self.path = os.path.join(self.dir, "tuning.json")

  def write(self, data):
    with open(self.path, "w") as f:
      f.write(data if isinstance(data, str) else json.dumps(data))

  def test_round_trip_through_the_module(self):
    fake = fake_module([ENTRY], installed=2)
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      self.assertEqual(jd.runtime.save_tuning(self.path), 1)
      self.assertEqual(jd.runtime.load_tuning(self.path), 2)
    with open(self.path) as f:
      data = json.load(f)
    self.assertEqual(data["format"], runtime.TUNING_FORMAT)
    self.assertEqual(data["version"], runtime.TUNING_VERSION)
    self.assertEqual(data["entries"], [ENTRY])
    fake.import_tuning.assert_called_once_with([ENTRY])
    self.assertEqual(os.listdir(self.dir), ["tuning.json"])  # no temporary file left

  def test_one_record_per_key(self):
    # Two devices, one key: an exact duplicate collapses; a different choice with a lower
    # tuner time wins; another shape stays.
    faster = {**ENTRY, "config": "Cooperative 128x256x64 cluster 2x1", "ms": 2.5}
    other = {**ENTRY, "m": 2048}
    fake = fake_module([ENTRY, ENTRY, faster, other])
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      self.assertEqual(jd.runtime.save_tuning(self.path), 2)
    with open(self.path) as f:
      self.assertEqual(json.load(f)["entries"], [faster, other])

  def test_without_the_cuda_module(self):
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=None):
      self.assertEqual(jd.runtime.save_tuning(self.path), 0)
      self.write(tuning_file([ENTRY]))
      self.assertEqual(jd.runtime.load_tuning(self.path), 0)  # checked, nothing to install it on
      self.write(tuning_file([{"m": 1}]))
      with self.assertRaisesRegex(ValueError, "missing field"):
        jd.runtime.load_tuning(self.path)
      jd.runtime.clear_tuning()  # a no-op

  def test_clear(self):
    fake = fake_module()
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      jd.runtime.clear_tuning()
    fake.clear_tuning.assert_called_once_with()

  def test_version_1_file_loads_as_version_2(self):
    # A version 1 record tuned the way the tuner still tunes loads without its timing fields;
    # its call trial's fields are ignored, whatever they say.
    trial = {**V1_ENTRY, "m": 2048, "call_trials": False, "call_ms": [3.5, 3.25]}
    self.write(v1_file([V1_ENTRY, trial]))
    fake = fake_module(installed=4)
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      self.assertEqual(jd.runtime.load_tuning(self.path), 4)
    fake.import_tuning.assert_called_once_with([ENTRY, {**ENTRY, "m": 2048}])

  def test_version_1_file_is_rewritten_as_version_2_when_merged(self):
    self.write(v1_file([V1_ENTRY]))
    fake = fake_module([{**ENTRY, "n": 4096}])
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      self.assertEqual(runtime._save_tuning(self.path, keep_existing=True), (1, 1))
    with open(self.path) as f:
      self.assertEqual(json.load(f), tuning_file([ENTRY, {**ENTRY, "n": 4096}]))

  @parameterized.named_parameters(
      ("coarse", {"tune_mode": "coarse"}, "tune_mode 'coarse' with turn_heat_ms -1"),
      ("burst", {"tune_mode": "burst"}, "tune_mode 'burst' with turn_heat_ms -1"),
      ("fixed_turn_heat", {"turn_heat_ms": 50}, "tune_mode 'sustained' with turn_heat_ms 50"),
  )
  def test_version_1_record_of_a_cut_timing_mode_fails(self, change, what):
    # The good record first: the bad one (entry 1) must still keep it from being installed.
    self.write(v1_file([V1_ENTRY, {**V1_ENTRY, **change}]))
    fake = fake_module()
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      with self.assertRaises(ValueError) as cm:
        jd.runtime.load_tuning(self.path)
    msg = str(cm.exception)
    self.assertIn(f"jax_distgemm.load_tuning: {self.path}: entry 1: {what}", msg)
    self.assertIn("a version 1 record loads only if it was tuned the way this jax_distgemm "
                  "tunes (tune_mode 'sustained', turn_heat_ms -1)", msg)
    fake.import_tuning.assert_not_called()

  @parameterized.named_parameters(
      ("not_json", "{", "is not JSON"),
      ("not_an_object", [], "is not a jax_distgemm tuning file"),
      ("other_format", {"format": "x", "version": 1, "entries": []}, "is not a jax_distgemm"),
      ("no_entries", {"format": runtime.TUNING_FORMAT, "version": 1}, "a list 'entries'"),
      ("newer_version", {"format": runtime.TUNING_FORMAT, "version": 3, "entries": []},
       "has version 3; this jax_distgemm reads versions 1 and 2"),
      ("version_0", {"format": runtime.TUNING_FORMAT, "version": 0, "entries": []},
       "has version 0;"),
      ("entry_not_object", tuning_file([7]), "entry 0: each entry must be a JSON object"),
      ("missing_field", tuning_file([{k: v for k, v in ENTRY.items() if k != "swizzle"}]),
       "entry 0: missing field.* swizzle"),
      ("bool_for_int", tuning_file([{**ENTRY, "m": True}]), "field 'm' must be int, got True"),
      ("int_for_bool", tuning_file([{**ENTRY, "has_c": 1}]), "field 'has_c' must be bool, got 1"),
      ("string_for_number", tuning_file([{**ENTRY, "ms": "2.9"}]),
       "field 'ms' must be int or float"),
      ("v1_missing_timing", v1_file([{k: v for k, v in V1_ENTRY.items() if k != "tune_mode"}]),
       "entry 0: missing field.* tune_mode"),
      ("v1_bad_timing_type", v1_file([{**V1_ENTRY, "turn_heat_ms": "-1"}]),
       "field 'turn_heat_ms' must be int"),
      ("v2_missing_field", tuning_file([{k: v for k, v in ENTRY.items() if k != "config"}]),
       "entry 0: missing field.* config"),
      ("zero_extent", tuning_file([ENTRY, {**ENTRY, "k": 0}]),
       "entry 1: field 'k' must be >= 1, got 0"),
      # JSON's true and 1.0 compare equal to 1, but are not version 1.
      ("bool_version", {**tuning_file([ENTRY]), "version": True},
       "has version True; this jax_distgemm reads versions 1 and 2"),
      ("float_version", {**tuning_file([ENTRY]), "version": 1.0}, "has version 1.0;"),
      ("nested_too_deeply", "[" * 100000 + "]" * 100000, "is not JSON: nested too deeply"),
  )
  def test_bad_file_names_the_rule_and_installs_nothing(self, data, rule):
    self.write(data)
    fake = fake_module()
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      with self.assertRaisesRegex(ValueError, rule):
        jd.runtime.load_tuning(self.path)
    fake.import_tuning.assert_not_called()

  def test_unreadable_paths_raise_value_error_naming_the_path(self):
    missing = os.path.join(self.dir, "missing.json")
    not_utf8 = os.path.join(self.dir, "latin1.json")
    with open(not_utf8, "wb") as f:
      f.write(b"\xff\xfe\x00garbage")
    fake = fake_module()
    for path, rule in ((missing, "cannot read .*: No such file"),
                       (self.dir, "cannot read .*: Is a directory"),
                       (not_utf8, "is not JSON: not UTF-8 text")):
      with self.subTest(path=path), mock.patch.object(runtime.ffi_modules, "module_for",
                                                      return_value=fake):
        with self.assertRaisesRegex(ValueError, "^jax_distgemm.load_tuning: .*" + rule) as cm:
          jd.runtime.load_tuning(path)
        self.assertIn(path, str(cm.exception))
    fake.import_tuning.assert_not_called()

  def test_unwritable_paths_raise_value_error_and_leave_no_file(self):
    fake = fake_module([ENTRY])
    for path in (os.path.join(self.dir, "missing", "tuning.json"), self.dir):
      with self.subTest(path=path), mock.patch.object(runtime.ffi_modules, "module_for",
                                                      return_value=fake):
        with self.assertRaisesRegex(ValueError, "^jax_distgemm.save_tuning: cannot write") as cm:
          jd.runtime.save_tuning(path)
        self.assertIn(path, str(cm.exception))
    self.assertEqual(os.listdir(self.dir), [])  # no temporary file left behind
    self.assertFalse(os.path.exists(f"{self.dir}.tmp{os.getpid()}"))  # (save_tuning(self.dir))

  def test_save_replaces_but_bench_merge_keeps_other_keys(self):
    # The file: a choice for another GPU model, one for a shape this run never tuned (twice:
    # the last is the one a load installs), and one for a key this run settles again.
    h100 = {**ENTRY, "gpu": "NVIDIA H100 80GB HBM3", "sm_count": 132}
    untuned = {**ENTRY, "m": 1024}
    older = {**untuned, "config": "Cooperative 128x256x64 cluster 2x1", "ms": 9.0}
    stale = {**ENTRY, "config": "Cooperative 128x256x64 cluster 2x1", "ms": 3.5}
    new_shape = {**ENTRY, "n": 4096}
    fake = fake_module([ENTRY, new_shape])
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      self.write(tuning_file([older, h100, stale, untuned]))
      self.assertEqual(runtime._save_tuning(self.path, keep_existing=True), (2, 2))
      with open(self.path) as f:
        self.assertEqual(json.load(f)["entries"], [h100, untuned, ENTRY, new_shape])
      self.assertEqual(jd.runtime.load_tuning(self.path), 2)  # a valid file
      # Merging again changes nothing; without a file it writes this run's choices only.
      self.assertEqual(runtime._save_tuning(self.path, keep_existing=True), (2, 2))
      os.remove(self.path)
      self.assertEqual(runtime._save_tuning(self.path, keep_existing=True), (2, 0))
      # A file that would not load is not overwritten.
      self.write("{")
      with self.assertRaisesRegex(ValueError, "^jax_distgemm.save_tuning: .* is not JSON"):
        runtime._save_tuning(self.path, keep_existing=True)
      with open(self.path) as f:
        self.assertEqual(f.read(), "{")
      # save_tuning itself replaces the file, as documented.
      self.write(tuning_file([h100]))
      self.assertEqual(jd.runtime.save_tuning(self.path), 2)
    with open(self.path) as f:
      self.assertEqual(json.load(f)["entries"], [ENTRY, new_shape])

  def test_module_errors_name_the_file(self):
    self.write(tuning_file([ENTRY]))
    fake = fake_module()
    fake.import_tuning.side_effect = ValueError("tuning record 0 (...): unknown kernel config")
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      with self.assertRaisesRegex(ValueError, f"load_tuning: {self.path}: .*unknown kernel"):
        jd.runtime.load_tuning(self.path)


if __name__ == "__main__":
  absltest.main()

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
    "fused_stages": 2, "tune_mode": "sustained", "turn_heat_ms": -1, "call_trials": True,
    "config": "Cooperative 128x256x64 cluster 1x1", "raster": 1, "swizzle": 8, "ms": 2.9,
    "call_ms": [-1.0, -1.0],
}


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
      self.assertEqual(jd.save_tuning(self.path), 1)
      self.assertEqual(jd.load_tuning(self.path), 2)
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
      self.assertEqual(jd.save_tuning(self.path), 2)
    with open(self.path) as f:
      self.assertEqual(json.load(f)["entries"], [faster, other])

  def test_without_the_cuda_module(self):
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=None):
      self.assertEqual(jd.save_tuning(self.path), 0)
      self.write({"format": runtime.TUNING_FORMAT, "version": 1, "entries": [ENTRY]})
      self.assertEqual(jd.load_tuning(self.path), 0)  # checked, nothing to install it on
      self.write({"format": runtime.TUNING_FORMAT, "version": 1, "entries": [{"m": 1}]})
      with self.assertRaisesRegex(ValueError, "missing field"):
        jd.load_tuning(self.path)
      jd.clear_tuning()  # a no-op

  def test_clear(self):
    fake = fake_module()
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      jd.clear_tuning()
    fake.clear_tuning.assert_called_once_with()

  @parameterized.named_parameters(
      ("not_json", "{", "is not JSON"),
      ("not_an_object", [], "is not a jax_distgemm tuning file"),
      ("other_format", {"format": "x", "version": 1, "entries": []}, "is not a jax_distgemm"),
      ("no_entries", {"format": runtime.TUNING_FORMAT, "version": 1}, "a list 'entries'"),
      ("newer_version", {"format": runtime.TUNING_FORMAT, "version": 2, "entries": []},
       "has version 2; this jax_distgemm reads version 1"),
      ("entry_not_object", tuning_file([7]), "entry 0: each entry must be a JSON object"),
      ("missing_field", tuning_file([{k: v for k, v in ENTRY.items() if k != "swizzle"}]),
       "entry 0: missing field.* swizzle"),
      ("bool_for_int", tuning_file([{**ENTRY, "m": True}]), "field 'm' must be int, got True"),
      ("int_for_bool", tuning_file([{**ENTRY, "has_c": 1}]), "field 'has_c' must be bool, got 1"),
      ("string_for_number", tuning_file([{**ENTRY, "ms": "2.9"}]),
       "field 'ms' must be int or float"),
      ("call_ms_length", tuning_file([{**ENTRY, "call_ms": [1.0]}]),
       "'call_ms' must be a list of two"),
      ("zero_extent", tuning_file([ENTRY, {**ENTRY, "k": 0}]),
       "entry 1: field 'k' must be >= 1, got 0"),
  )
  def test_bad_file_names_the_rule_and_installs_nothing(self, data, rule):
    self.write(data)
    fake = fake_module()
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      with self.assertRaisesRegex(ValueError, rule):
        jd.load_tuning(self.path)
    fake.import_tuning.assert_not_called()

  def test_module_errors_name_the_file(self):
    self.write({"format": runtime.TUNING_FORMAT, "version": 1, "entries": [ENTRY]})
    fake = fake_module()
    fake.import_tuning.side_effect = ValueError("tuning record 0 (...): unknown kernel config")
    with mock.patch.object(runtime.ffi_modules, "module_for", return_value=fake):
      with self.assertRaisesRegex(ValueError, f"load_tuning: {self.path}: .*unknown kernel"):
        jd.load_tuning(self.path)


if __name__ == "__main__":
  absltest.main()

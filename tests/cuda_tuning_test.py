"""GPU test of saved tuning choices (jax_distgemm.save_tuning / load_tuning / clear_tuning).

Needs one Hopper GPU (the op at TP=1 tunes like every stage); skipped without one, unless
JAX_DISTGEMM_REQUIRE_GPU=1 (tools/gpu_check.sh).  The file format and its checks are tested
without a GPU in tests/tuning_file_test.py.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import test_util  # noqa: I001  (fake CPU devices before JAX initializes)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_distgemm as jd  # noqa: E402
from jax_distgemm import Schedule  # noqa: E402
from jax_distgemm import ffi as ffi_modules  # noqa: E402

GPUS = test_util.hopper_gpus()
# A shape no other GPU test uses: its choice is this file's alone.
M, K, N = 384, 1152, 640


def setUpModule():
  test_util.require_hopper_gpus(1)


def op_on(gpu):
  mesh = jax.sharding.Mesh(np.array([gpu]), ("tp",))

  def body(x, w):
    return jd.distributed_matmul(x, w, axis_name="tp",
                                 schedule=Schedule.AllGather1D_TilingCD_RotatingA,
                                 implementation="ffi")

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                               check_vma=False))


def shape_lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if f" m={M} n={N} k={K} " in line]


class CudaTuningFileTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = tmp.name
    self.x, self.w, _ = test_util.random_inputs(7, (M, K), (K, N), jnp.bfloat16)
    self.x, self.w = jax.device_put((self.x, self.w), GPUS[0])
    self.ref = test_util.reference_np(self.x, self.w)
    self.f = op_on(GPUS[0])

  def check_output(self):
    out = self.f(self.x, self.w)
    self.assertLess(test_util.rel_err(out, self.ref), test_util.REL_TOL[jnp.dtype(jnp.bfloat16)])

  def tuned_entry(self) -> dict:
    self.check_output()  # tunes the shape on GPU 0 if this process has not
    # One record per device that has the shape: GPU 0 tuned it, a load installs it on all.
    mine = [e for e in ffi_modules.module_for("cuda").export_tuning()
            if (e["m"], e["n"], e["k"]) == (M, N, K)]
    self.assertBetween(len(mine), 1, len(GPUS))
    return mine[0]

  def test_a_loaded_choice_runs_untuned(self):
    entry = self.tuned_entry()
    # Load a *different* variant, with a time no tuner measures: if the next call tuned the
    # shape instead, describe_tuning would show the tuner's own variant and time.
    other = ("Pingpong 128x128x64 cluster 2x1"
             if entry["config"] != "Pingpong 128x128x64 cluster 2x1"
             else "Cooperative 128x256x64 cluster 1x1")
    loaded = {**entry, "config": other, "raster": 2, "swizzle": 2, "ms": 123.5}
    path = os.path.join(self.dir, "t.json")
    with open(path, "w") as f:
      json.dump({"format": "jax_distgemm tuning", "version": 2, "entries": [loaded]}, f)
    jd.runtime.clear_tuning()
    self.assertEqual(shape_lines(jd.runtime.describe_tuning()), [])
    same_model = [g for g in GPUS if g.device_kind == GPUS[0].device_kind]
    self.assertEqual(jd.runtime.load_tuning(path), len(same_model))
    self.check_output()
    lines = [ln for ln in shape_lines(jd.runtime.describe_tuning()) if ln.startswith("device 0 ")]
    self.assertLen(lines, 1, jd.runtime.describe_tuning())
    self.assertIn(f": {other} raster along N swizzle 2 (123.5 ms)", lines[0])
    # And save_tuning writes it back as loaded.
    again = os.path.join(self.dir, "again.json")
    self.assertGreaterEqual(jd.runtime.save_tuning(again), 1)
    with open(again) as f:
      saved = [e for e in json.load(f)["entries"]
               if (e["m"], e["n"], e["k"]) == (M, N, K) and e["gpu"] == entry["gpu"]]
    self.assertIn(loaded, saved)

  def test_a_version_1_file_loads(self):
    # A version 1 record of the one timing mode left loads; its call trial's fields are ignored.
    entry = self.tuned_entry()
    v1 = {**entry, "ms": 99.5, "tune_mode": "sustained", "turn_heat_ms": -1,
          "call_trials": True, "call_ms": [-1.0, -1.0]}
    path = os.path.join(self.dir, "v1.json")
    with open(path, "w") as f:
      json.dump({"format": "jax_distgemm tuning", "version": 1, "entries": [v1]}, f)
    jd.runtime.clear_tuning()
    same_model = [g for g in GPUS if g.device_kind == GPUS[0].device_kind]
    self.assertEqual(jd.runtime.load_tuning(path), len(same_model))
    self.check_output()
    lines = [ln for ln in shape_lines(jd.runtime.describe_tuning()) if ln.startswith("device 0 ")]
    self.assertLen(lines, 1, jd.runtime.describe_tuning())
    self.assertIn("(99.5 ms)", lines[0])

  def test_an_invalid_record_installs_nothing(self):
    entry = self.tuned_entry()
    before = jd.runtime.describe_tuning()
    path = os.path.join(self.dir, "bad.json")
    for bad, rule in (
        ({**entry, "config": "Cooperative 999x999"}, "unknown kernel config"),
        # bf16 -> fp32 has one compiled config (Cooperative 128x256 cluster 2x1).
        ({**entry, "d_type": "float32", "config": "Pingpong 128x128x64 cluster 2x1"},
         "is not compiled for bfloat16 -> float32"),
        ({**entry, "swizzle": 3}, "swizzle 1, 2, 4 or 8"),
    ):
      with self.subTest(rule=rule):
        # The good record first: a bad one later must still keep it from being installed.
        good = {**entry, "ms": 77.25}
        with open(path, "w") as f:
          json.dump({"format": "jax_distgemm tuning", "version": 2, "entries": [good, bad]}, f)
        with self.assertRaisesRegex(ValueError, re.escape(path) + ".*" + rule):
          jd.runtime.load_tuning(path)
        self.assertEqual(jd.runtime.describe_tuning(), before)


if __name__ == "__main__":
  absltest.main()

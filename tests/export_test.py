"""A jax.export artifact of the FFI path runs in a fresh process that only imports jax_distgemm.

The child never lowers our primitive (it deserializes XLA's module), so it finds the CPU target
only if importing the package registered it (jax_distgemm/ffi/__init__.py, `_flush_cpu_types`).
Before that, it failed with `NOT_FOUND: No FFI handler registered for jax_distgemm_v1`.
"""

import test_util as tu  # noqa: I001  (first: configures JAX before it initializes)

import os
import subprocess
import sys
import tempfile
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
import pytest
from jax import export

import jax_distgemm as jd
from jax_distgemm import Schedule
from jax_distgemm._src.primitives import TARGET_GATHERED, TARGET_NAME

TP = 2

# The fresh process: TP fake CPU devices, the package imported and nothing else of ours called;
# argv: a directory of <schedule>.bin artifacts and <schedule>.npz inputs; writes <schedule>.npy.
_CHILD = f"""
import os, sys
import numpy as np
import jax
jax.config.update("jax_num_cpu_devices", {TP})
import jax_distgemm  # noqa: F401  (registers the FFI targets)
from jax import export
d = sys.argv[1]
mesh = jax.sharding.Mesh(np.array(jax.devices()[:{TP}]), ("tp",))
for name in sys.argv[2:]:
  exp = export.deserialize(bytearray(open(os.path.join(d, name + ".bin"), "rb").read()))
  data = np.load(os.path.join(d, name + ".npz"))
  args = [jax.device_put(data[k], s) for k, s in zip(("x", "w"), exp.in_shardings_jax(mesh))]
  np.save(os.path.join(d, name + ".npy"), np.asarray(exp.call(*args)))
"""


class ExportTest(absltest.TestCase):

  @pytest.mark.slow  # a child Python runs the artifact
  def test_exported_ffi_call_runs_in_a_fresh_process(self):
    mesh = tu.mesh_1d(TP)
    expected = {}  # schedule name -> float64 reference
    with tempfile.TemporaryDirectory() as d:
      # Every schedule, and RotatingA with its gathered operand (the other target name).
      cases = [(s, False) for s in Schedule] + [(Schedule.AllGather1D_TilingCD_RotatingA, True)]
      for schedule, gathered in cases:
        name = schedule.name + ("_gathered" if gathered else "")
        target = TARGET_GATHERED if gathered else TARGET_NAME
        xs, ws, os_ = tu.specs(schedule, 0)
        x, w, _ = tu.random_inputs(tu.seed_of("export", name), (16, 32), (32, 24), jnp.float32)
        args, in_specs = tu.place(mesh, (xs, ws, os_), x, w)

        def body(a, b, s=schedule, gathered=gathered):
          out = jd.distributed_matmul(a, b, axis_name="tp", schedule=s, implementation="ffi",
                                      return_gathered=gathered)
          return out[0] if gathered else out  # (the call keeps its second result)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=os_))
        exp = export.export(
            f, disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*args)
        self.assertIn(f"@{target}(", exp.mlir_module())  # the artifact holds our call
        with open(os.path.join(d, name + ".bin"), "wb") as fh:
          fh.write(exp.serialize())
        np.savez(os.path.join(d, name + ".npz"), x=np.asarray(x), w=np.asarray(w))
        expected[name] = tu.reference_np(x, w)
      env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_DISTGEMM_")}
      env["JAX_PLATFORMS"] = "cpu"
      proc = subprocess.run([sys.executable, "-c", _CHILD, d, *expected], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
      self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
      for name in expected:
        out = np.load(os.path.join(d, name + ".npy"))
        with self.subTest(schedule=name):
          self.assertEqual(out.shape, expected[name].shape)
          self.assertLess(tu.rel_err(out, expected[name]), 1e-5)

  def test_export_on_another_device_assignment(self):
    # The fused call names its TP groups by global device ids; an artifact called with the same
    # devices in other mesh positions would pair the wrong shards.  None exports the XLA ring,
    # right under any assignment; "ffi" keeps the fused call and warns that the artifact is
    # pinned to the export's device ids.
    devices = np.array(tu.cpu_devices(4)).reshape(2, 2)
    exported_on = jax.sharding.Mesh(devices, ("data", "tp"))
    called_on = jax.sharding.Mesh(devices.T.copy(), ("data", "tp"))
    schedule = Schedule.AllGather1D_TilingCD_RotatingA
    xs, ws, os_ = schedule.partition_specs("tp", batch=("data",))
    x, w, _ = tu.random_inputs(tu.seed_of("export", "permuted"), (2, 8, 16), (16, 8),
                               jnp.float32)
    for implementation in (None, "ffi"):
      f = jax.jit(jax.shard_map(
          lambda a, b, i=implementation: jd.all_gather_matmul(a, b, axis_name="tp",
                                                              implementation=i),
          mesh=exported_on, in_specs=(xs, ws), out_specs=os_))
      args = tu.place(exported_on, (xs, ws, os_), x, w)[0]
      jd._src.config._given.clear()
      with (warnings.catch_warnings(record=True) as caught,
            mock.patch.object(jd._src.config._log, "log") as log):
        warnings.simplefilter("always")
        exp = export.export(
            f, disabled_checks=[export.DisabledSafetyCheck.custom_call(TARGET_NAME)])(*args)
      fused = f"@{TARGET_NAME}(" in exp.mlir_module()
      with self.subTest(implementation=implementation):
        self.assertEqual(fused, implementation == "ffi")
        said = [str(c.message) for c in caught] + [str(a) for a in log.call_args_list]
        self.assertIn("global device ids of the mesh it was exported on", "".join(said))
        # 'ffi' warns at the caller's line; None, the recommended way, only logs at INFO.
        self.assertEqual(len(caught), 1 if fused else 0, said)
        if fused:
          self.assertEqual(caught[0].filename, __file__)
        if not fused:
          exp = export.deserialize(exp.serialize())
          sh = exp.in_shardings_jax(called_on)
          out = exp.call(jax.device_put(x, sh[0]), jax.device_put(w, sh[1]))
          self.assertLess(tu.rel_err(out, tu.reference_np(x, w)), 1e-5)


if __name__ == "__main__":
  absltest.main()

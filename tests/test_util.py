"""Shared test helpers: fake CPU devices, meshes, shardings per schedule, inputs, references.

Importing this module requests 8 fake CPU devices; it must be imported before JAX initializes
its backends (test modules import it first).  If the devices cannot be had, tests FAIL (they do
not skip): see `cpu_devices`.
"""

from __future__ import annotations

import contextlib
import os
import re
import unittest
import zlib
from unittest import mock

os.environ.setdefault("XLA_FLAGS", "")
# Every GPU test, whichever file runs first: the CUDA executor fills each output with NaN
# before its kernels write it (read once per process), so a tile they skip fails the test.
os.environ.setdefault("JAX_DISTGEMM_POISON_OUTPUT", "1")
import jax  # noqa: E402

NUM_CPU_DEVICES = 8
try:
  jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
except RuntimeError:
  pass  # backends already initialized: cpu_devices() below checks what we got.

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jax_distgemm import Schedule  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}

# The ReduceScatter path switch, read when a call is lowered (config.rs_path_override) and
# passed to both executors as the call's rs_path attribute.
RS_SWITCHES = ("JAX_DISTGEMM_RS_PATH",)


@contextlib.contextmanager
def rs_env(env: dict[str, str]):
  """Exactly the RS_SWITCHES in `env` set, the others unset, whatever the caller's environment;
  all restored on exit."""
  with mock.patch.dict(os.environ, env):
    for k in set(RS_SWITCHES) - set(env):
      os.environ.pop(k, None)
    yield

# Relative Frobenius error bound vs a float64 reference, per input dtype: products are exact in
# fp32 accumulation, the output rounding dominates.
REL_TOL = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3,
           jnp.dtype(jnp.float32): 1e-5}


def cpu_devices(n: int):
  devs = jax.devices("cpu")
  if len(devs) < n:
    raise AssertionError(
        f"need {n} CPU devices but JAX has {len(devs)}: tests/test_util.py must be imported "
        "before JAX initializes (it sets jax_num_cpu_devices)")
  return devs[:n]


def hopper_gpus():
  """The visible sm_90 GPUs (empty without a GPU backend)."""
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return []
  return [d for d in gpus if getattr(d, "compute_capability", "") == "9.0"]


def require_hopper_gpus(n: int):
  """The first n Hopper GPUs; skips where there are fewer.  JAX_DISTGEMM_REQUIRE_GPU=1
  (tools/gpu_check.sh) makes finding none a failure: on a GPU machine that is a broken install,
  not a missing test.  A missing CUDA extension is always a failure."""
  gpus = hopper_gpus()
  if len(gpus) < n:
    msg = f"needs {n} Hopper GPUs, found {len(gpus)}"
    if not gpus and os.environ.get("JAX_DISTGEMM_REQUIRE_GPU") == "1":
      raise AssertionError(msg + " (JAX_DISTGEMM_REQUIRE_GPU=1)")
    raise unittest.SkipTest(msg)
  from jax_distgemm import ffi as ffi_modules
  if not ffi_modules.has_cuda():
    raise AssertionError(f"CUDA extension not built: {ffi_modules.cuda_import_error}")
  return gpus[:n]


def place(mesh, specs3, x, w, c=None):
  """x, w (and c, if given) on `mesh` by the (x, w, out) specs: (arrays, their in_specs)."""
  xs, ws, os_ = specs3
  pairs = [(x, xs), (w, ws)] + ([(c, os_)] if c is not None else [])
  return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in pairs], tuple(s for _, s in pairs)


def mesh_1d(tp: int, devices=None, axis: str = "tp") -> jax.sharding.Mesh:
  devices = cpu_devices(tp) if devices is None else devices[:tp]
  return jax.sharding.Mesh(np.array(devices), (axis,))


def specs(schedule: Schedule, batch_ndim: int, axis="tp", w_batched: bool = False):
  """(x_spec, w_spec, out_spec) of the global arrays for `schedule` along mesh axis `axis`, with
  `batch_ndim` replicated leading batch dims."""
  return schedule.partition_specs(axis, (None,) * batch_ndim, w_batched)


def random_inputs(seed: int, x_shape, w_shape, dtype, c_shape=None):
  """Fresh normal data (never zeros), rounded to `dtype`; also returns float64 copies."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(x_shape).astype(np.float32)
  w = (rng.standard_normal(w_shape) / np.sqrt(x_shape[-1])).astype(np.float32)
  x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
  c = None if c_shape is None else jnp.asarray(rng.standard_normal(c_shape), jnp.float32)
  return x, w, c


def reference_np(x, w, c=None, *, alpha=1.0, beta=0.0):
  """Global float64 reference: alpha * x @ w + beta * c."""
  y = alpha * np.matmul(np.asarray(x, np.float64), np.asarray(w, np.float64))
  if c is not None and beta:
    y = y + beta * np.asarray(c, np.float64)
  return y


def fp8_tensor_grads(schedule: Schedule, x, w, g, tp: int):
  """float64 (dx, dw) of fp8="tensor" for global x [..., M, K], 2-D w and cotangent g: products
  of quantized operands (autodiff._fp8_tensor_bwd), g in float8_e5m2.  g is quantized per
  shard, or as a whole where the backward gathers it (ReduceScatter forward); x and w per shard
  as the forward did, or as a whole where the backward gathers them."""
  import jax_distgemm as jd  # pylint: disable=g-import-not-at-top

  def deq(a, **kwargs):
    # Quantized by a program of its own (XLA's fused division may round a value the other way
    # than an eager one); dequantized apart from it, so that its fp8 rounding stays.
    q = jax.jit(lambda a: jd.quantize(a, "tensor", **kwargs))(jnp.asarray(a))
    return np.asarray(jd.dequantize(*q), np.float64)

  def deq_g(a):
    return deq(a, dtype=jnp.float8_e5m2)

  def fold(a):
    return a.reshape(-1, a.shape[-1])

  def t(a):
    return np.swapaxes(a, -1, -2)

  x, w, g = (np.asarray(a, np.float32) for a in (x, w, g))
  if schedule == Schedule.AllGather1D_TilingCD_RotatingA:  # g and w by columns
    gs, ws = np.split(g, tp, -1), np.split(w, tp, -1)
    dx = sum(deq_g(gr) @ t(deq(wr, operand="w")) for gr, wr in zip(gs, ws))
    dw = np.concatenate([fold(deq(x)).T @ fold(deq_g(gr)) for gr in gs], -1)
  elif schedule == Schedule.AllGather1D_TilingCD_RotatingB:  # x and g by rows
    gs, xs = np.split(g, tp, -2), np.split(x, tp, -2)
    dw = sum(fold(deq(xr)).T @ fold(deq_g(gr)) for gr, xr in zip(gs, xs))
    dx = np.concatenate([deq_g(gr) @ t(deq(w, operand="w")) for gr in gs], -2)
  else:  # x by K columns, w by K rows
    xs, ws = np.split(x, tp, -1), np.split(w, tp, 0)
    dx = np.concatenate([deq_g(g) @ t(deq(wr, operand="w")) for wr in ws], -1)
    dw = np.concatenate([fold(deq(xr)).T @ fold(deq_g(g)) for xr in xs], 0)
  return dx, dw


def rel_err(out, ref) -> float:
  out = np.asarray(out, np.float64)
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def seed_of(*parts) -> int:
  """A data seed from a case's parameters, the same in every process (hash() of a str is
  salted per process, so two runs of a GPU test would draw different data)."""
  return zlib.crc32(repr(parts).encode()) % 2**31


def collectives_in_hlo(hlo_text: str) -> dict[str, int]:
  """Counts of collective ops and of our custom call in compiled HLO text."""
  names = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
  counts = {n: len(re.findall(rf"= [^=\n]*\b{n}(-start)?\(", hlo_text)) for n in names}
  # Both targets (primitives.TARGETS): without and with the gathered operand as a 2nd result.
  counts["jax_distgemm"] = len(re.findall(r'custom_call_target="jax_distgemm_(gathered_)?v1"',
                                          hlo_text))
  return counts

"""A small run of every schedule at TP=2 on two GPUs, for compute-sanitizer (docs/reliability.md).

  compute-sanitizer --tool memcheck --kernel-name kns=StageKernel python3 tests/sanitize_run.py

Tiny bf16 shapes, no autotuning (one config per stage), two calls per schedule (both slot
parities), every result checked against XLA's reference.  Exit status 1 on a wrong result.
"""

import os

os.environ.setdefault("JAX_DISTGEMM_AUTOTUNE", "0")
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_autotune_level=0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_distgemm as jd  # noqa: E402
from jax_distgemm import Schedule  # noqa: E402

TP = 2
M, K, N = 256, 256, 512


def main() -> int:
  mesh = jax.sharding.Mesh(np.array(jax.devices("gpu")[:TP]), ("tp",))
  rng = np.random.default_rng(0)
  bad = 0
  for schedule in Schedule:
    ag = schedule.is_all_gather
    xs, ws = (P("tp", None), P(None, "tp")) if ag else (P(None, "tp"), P("tp", None))
    out_spec = {Schedule.AllGather1D_TilingCD_RotatingA: P(None, "tp"),
                Schedule.AllGather1D_TilingCD_RotatingB: P("tp", None),
                Schedule.ReduceScatter1D_TilingA_RotatingC: P("tp", None),
                Schedule.ReduceScatter1D_TilingB_RotatingC: P(None, "tp")}[schedule]
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), jnp.bfloat16)
    args = (jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
    f = jax.jit(jax.shard_map(
        lambda a, b: jd.distributed_matmul(a, b, axis_name="tp", schedule=schedule,
                                           implementation="ffi"),
        mesh=mesh, in_specs=(xs, ws), out_specs=out_spec))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for call in range(2):
      out = np.asarray(f(*args), np.float64)
      err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
      ok = bool(np.isfinite(err) and err < 1e-2)
      bad += not ok
      print(f"{schedule.name} call {call}: rel err {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  raise SystemExit(main())

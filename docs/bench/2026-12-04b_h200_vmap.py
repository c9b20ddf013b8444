# Twenty-eighth session's second one-H200 smoke (performance.md AB2): the FFI path's vmap rule
# with a batched x and a mapped 2-D w (d17e7db) on the CUDA executor at TP=1, every schedule,
# in_axes (0, 0), (None, 0), (0, None), against "xla" and float64 numpy.  Writes
# $OUT/vmap.json.  Run from outside the repository root with the package on PYTHONPATH.
import json, os, traceback
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_distgemm as jd
from jax_distgemm import Schedule

mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
rng = np.random.default_rng(0)
out = {"devices": str(jax.devices())}
vb, b, m, k, n = 3, 2, 256, 128, 384
x = rng.standard_normal((vb, b, m, k)).astype(np.float32)
w = (rng.standard_normal((vb, k, n)) / np.sqrt(k)).astype(np.float32)
for s in Schedule:
  xs, ws, os_ = s.partition_specs("tp", (None,))
  for axes in ((0, 0), (None, 0), (0, None)):
    key = f"{s.name} in_axes={axes}"
    try:
      f = lambda impl: jax.jit(jax.vmap(jax.jit(jax.shard_map(
          lambda a, c: jd.distributed_matmul(a, c, axis_name="tp", schedule=s,
                                             implementation=impl),
          mesh=mesh, in_specs=(xs, ws), out_specs=os_)), in_axes=axes))
      xa = jnp.asarray(x if axes[0] == 0 else x[0], jnp.bfloat16)
      wa = jnp.asarray(w if axes[1] == 0 else w[0], jnp.bfloat16)
      got = np.asarray(f("ffi")(xa, wa), np.float64)
      ring = np.asarray(f("xla")(xa, wa), np.float64)
      xf, wf = np.asarray(xa, np.float64), np.asarray(wa, np.float64)
      want = np.stack([(xf[v] if axes[0] == 0 else xf) @ (wf[v] if axes[1] == 0 else wf)
                       for v in range(vb)])
      rel = lambda a: float(np.linalg.norm(a - want) / np.linalg.norm(want))
      out[key] = {"ffi_rel_err": rel(got), "xla_rel_err": rel(ring), "shape": list(got.shape)}
    except Exception as e:
      out[key] = {"error": f"{type(e).__name__}: {e}"[:1500], "tb": traceback.format_exc()[-2000:]}
    print(key, json.dumps(out[key])[:300], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "vmap.json"), "w"), indent=1)

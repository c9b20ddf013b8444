# Twenty-eighth session's fourth one-H200 check (performance.md AB4): the fp16 -> fp32-output
# backward with a cotangent above fp16's range (d loss / d out = 1e5) on the CUDA executor at
# TP=1, every schedule, "ffi" against jax.grad of the dense math; also with a cotangent that
# fits (1.0), where the scale is 1.  Writes $OUT/fp16.json.
import json, os, traceback
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding
import jax_distgemm as jd
from jax_distgemm import Schedule

mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
rng = np.random.default_rng(0)
out = {"devices": str(jax.devices())}
m, k, n = 512, 256, 384
x = jnp.asarray(rng.standard_normal((m, k)) * 1e-2, jnp.float16)
w = jnp.asarray(rng.standard_normal((k, n)) * 1e-2, jnp.float16)
r = jnp.cos(jnp.arange(m * n, dtype=jnp.float32)).reshape(m, n)
for s in Schedule:
  xs, ws, os_ = s.partition_specs("tp")
  for scale in (1e5, 1.0):
    key = f"{s.name} scale={scale}"
    try:
      f = jax.shard_map(lambda a, b: jd.distributed_matmul(a, b, axis_name="tp", schedule=s,
                        out_dtype=jnp.float32, implementation="ffi"),
                        mesh=mesh, in_specs=(xs, ws), out_specs=os_)
      g = jax.jit(jax.grad(lambda a, b: scale * jnp.sum(f(a, b) * r), (0, 1)))
      got = g(jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
      want = jax.grad(lambda a, b: scale * jnp.sum(jnp.matmul(
          a, b, preferred_element_type=jnp.float32) * r), (0, 1))(x, w)
      rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32))
                               / jnp.linalg.norm(b.astype(jnp.float32)))
      out[key] = {"finite": [bool(jnp.isfinite(a).all()) for a in got],
                  "rel_err": [rel(a, b) for a, b in zip(got, want)],
                  "custom_calls": g.lower(jax.device_put(x, NamedSharding(mesh, xs)),
                                          jax.device_put(w, NamedSharding(mesh, ws))
                                          ).compile().as_text().count('custom_call_target="jax_distgemm')}
    except Exception as e:
      out[key] = {"error": f"{type(e).__name__}: {e}"[:1500], "tb": traceback.format_exc()[-2000:]}
    print(key, json.dumps(out[key])[:300], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "fp16.json"), "w"), indent=1)

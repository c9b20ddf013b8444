# Twenty-second session's one-H200 smoke (performance.md X1): the CUDA ffi path at TP=1 after
# that session's import change, every schedule, then layers stacked with lax.scan (with and
# without jax.checkpoint) in bf16 and fp16, ffi and reference, each against an fp32 reference.
# Ran from /tmp (not the repository root, which would import the source tree) with the package
# and .carry/modules on PYTHONPATH; wrote the JSON next to this file.
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
import jax_distgemm as jd
from jax_distgemm import Schedule
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
out = {"devices": str(jax.devices()), "cpu_types_flushed": jd.ffi._cpu_types_flushed}
mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
rng = np.random.default_rng(0)
for s in Schedule:
  xs, ws, os_ = s.partition_specs("tp")
  x = jnp.asarray(rng.standard_normal((2048, 1024)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((1024, 1536)), jnp.bfloat16)
  f = lambda impl: jax.jit(jax.shard_map(lambda a, b: jd.distributed_matmul(a, b, axis_name="tp", schedule=s, implementation=impl), mesh=mesh, in_specs=(xs, ws), out_specs=os_))
  args = (jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
  hlo = f("ffi").lower(*args).compile().as_text()
  got, ref = f("ffi")(*args).astype(jnp.float32), f("reference")(*args).astype(jnp.float32)
  out[s.name] = {"rel_err": float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)), "custom_call": "jax_distgemm" in hlo}
L, M, D, F = 3, 1024, 512, 2048
h0 = rng.standard_normal((M, D)); w10 = rng.standard_normal((L, D, F)) / 20; w20 = rng.standard_normal((L, F, D)) / 40
specs = (P("tp", None), P(None, None, "tp"), P(None, "tp", None))
def loss(impl, remat):
  def layer(x, ws):
    up = jd.all_gather_matmul(x, ws[0], axis_name="tp", implementation=impl)
    return x + jd.matmul_reduce_scatter(jnp.tanh(up), ws[1], axis_name="tp", implementation=impl), None
  step = jax.checkpoint(layer) if remat else layer
  body = lambda x, a, b: jax.lax.scan(step, x, (a, b))[0]
  o = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp", None))
  return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(o(*a).astype(jnp.float32))), (0, 1, 2)))
cast = lambda dt: [jnp.asarray(a, dt) for a in (h0, w10, w20)]
v32, g32 = loss("reference", False)(*cast(jnp.float32))
rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
out["scan_fp32_value"] = float(v32)
for dt in (jnp.bfloat16, jnp.float16):
  for impl in ("ffi", "reference"):
    for remat in (False, True):
      v, g = loss(impl, remat)(*cast(dt))
      out[f"scan_{jnp.dtype(dt).name}_{impl}_remat{remat}"] = {"value": float(v), "grad_rel_err_vs_fp32": [rel(a, b) for a, b in zip(g, g32)]}
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "smoke.json"), "w"), indent=1)

# A one-H200 smoke of 84e5d58 (performance.md Z): on CUDA, at TP=1, an
# empty output (M = 0 or N = 0) of every schedule with implementation="ffi" must give an empty
# result with no custom call and no collective in its HLO, zero gradients of both operands, and a
# non-empty call right after it must still match XLA's reference (the group's kernels,
# the add kernel among them, load in PeerGroup::InitDevice now).
# Run from /tmp with the package and .carry/modules on PYTHONPATH; writes empty.json to $OUT.
import json, os
import jax, jax.numpy as jnp, numpy as np
import jax_distgemm as jd
from jax_distgemm import Schedule
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

out = {"devices": str(jax.devices())}
mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
rng = np.random.default_rng(3)
rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32)) /
                         jnp.linalg.norm(b.astype(jnp.float32)))
ops = ("custom_call_target=\"jax_distgemm", "all-gather", "reduce-scatter", "all-reduce",
       "collective-permute")
for s in Schedule:
  xs, ws, os_ = s.partition_specs("tp")
  def op(impl):
    return jax.jit(jax.shard_map(
        lambda a, b: jd.distributed_matmul(a, b, axis_name="tp", schedule=s, implementation=impl),
        mesh=mesh, in_specs=(xs, ws), out_specs=os_))
  row = {}
  for m, n in ((0, 512), (1024, 0), (1024, 512)):
    x = jnp.asarray(rng.standard_normal((m, 768)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((768, n)) / 20, jnp.bfloat16)
    args = (jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
    f = op("ffi")
    hlo = f.lower(*args).compile().as_text()
    o = f(*args)
    g = jax.jit(jax.grad(lambda a, b: jnp.sum(op("ffi")(a, b).astype(jnp.float32)), (0, 1)))(*args)
    r = {"hlo_ops": {k: hlo.count(k) for k in ops}, "shape": list(o.shape)}
    if m and n:
      r["rel_err"] = rel(o, op("reference")(*args))
    else:
      r["grad_max_abs"] = [float(jnp.max(jnp.abs(t.astype(jnp.float32)))) if t.size else 0.0
                           for t in g]
      r["grad_shapes"] = [list(t.shape) for t in g]
    row[f"{m}x{n}"] = r
  out[s.name] = row
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "empty.json"), "w"), indent=1)

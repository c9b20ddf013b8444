# Twenty-third session's one-H200 smoke of the gathered operand (performance.md Y1): at TP=1 on
# CUDA, return_gathered=True for both AllGather schedules (2-D and batched: the gathered operand
# must equal x or w bit for bit), the gradient through it against XLA's reference, and the
# ReduceScatter backward, which now takes d out gathered from its dual AllGather (its HLO: two
# custom calls, no all-gather).  TP > 1 is tools/virtual_group_check.cu's "+gathered" cases.
# Run from /tmp with the package and .carry/modules on PYTHONPATH; writes gathered.json to $OUT.
import json, os
import jax, jax.numpy as jnp, numpy as np
import jax_distgemm as jd
from jax_distgemm import Schedule
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_distgemm._src import reference

out = {"devices": str(jax.devices())}
mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
rng = np.random.default_rng(1)
count = lambda hlo, s: hlo.count(s)
# Our custom calls under both target names (the one with the gathered operand has its own).
calls = lambda hlo: sum(count(hlo, f'custom_call_target="{t}"') for t in
                        ("jax_distgemm_v1", "jax_distgemm_gathered_v1"))
rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32)) /
                         jnp.linalg.norm(b.astype(jnp.float32)))
for s in (Schedule.AllGather1D_TilingCD_RotatingA, Schedule.AllGather1D_TilingCD_RotatingB):
  for batch in ((), (3,)):
    xs, ws, os_ = s.partition_specs("tp", (None,) * len(batch))
    x = jnp.asarray(rng.standard_normal(batch + (1024, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 768)) / 20, jnp.bfloat16)
    args = (jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
    def op(impl):
      def body(a, b):
        if impl == "ref":
          o, g = reference.distributed_matmul(a, b, axis_name="tp", schedule=s, with_operand=True)
        else:
          o, g = jd.distributed_matmul(a, b, axis_name="tp", schedule=s, implementation=impl,
                                       return_gathered=True)
        return o, g[None]
      return jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=(os_, P("tp")))
    f = jax.jit(op("ffi"))
    hlo = f.lower(*args).compile().as_text()
    o, g = f(*args)
    o_ref, _ = jax.jit(op("ref"))(*args)
    operand = x if s == Schedule.AllGather1D_TilingCD_RotatingA else w
    loss = lambda impl: jax.jit(jax.grad(lambda a, b: sum(
        jnp.sum(jnp.sin(t.astype(jnp.float32))) for t in op(impl)(a, b)), (0, 1)))
    gf, gr = loss("ffi")(*args), loss("ref")(*args)
    out[f"{s.name}_batch{len(batch)}"] = {
        "custom_calls": calls(hlo),
        "gathered_target": count(hlo, 'custom_call_target="jax_distgemm_gathered_v1"'),
        "out_rel_err": rel(o, o_ref),
        "gathered_bit_exact": bool(np.array_equal(np.asarray(g[0]), np.asarray(operand))),
        "grad_rel_err": [rel(a, b) for a, b in zip(gf, gr)]}
for s in (Schedule.ReduceScatter1D_TilingA_RotatingC, Schedule.ReduceScatter1D_TilingB_RotatingC):
  xs, ws, os_ = s.partition_specs("tp")
  x = jnp.asarray(rng.standard_normal((1024, 1024)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((1024, 512)) / 30, jnp.bfloat16)
  args = (jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
  loss = lambda impl: jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(jax.shard_map(
      lambda p, q: jd.distributed_matmul(p, q, axis_name="tp", schedule=s, implementation=impl),
      mesh=mesh, in_specs=(xs, ws), out_specs=os_)(a, b).astype(jnp.float32))), (0, 1)))
  hlo = loss("ffi").lower(*args).compile().as_text()
  gf, gr = loss("ffi")(*args), loss("reference")(*args)
  out[f"{s.name}_grad"] = {
      "custom_calls": calls(hlo),
      "gathered_target": count(hlo, 'custom_call_target="jax_distgemm_gathered_v1"'),
      "all_gathers": count(hlo, " all-gather(") + count(hlo, " all-gather-start("),
      "grad_rel_err": [rel(a, b) for a, b in zip(gf, gr)]}
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gathered.json"), "w"), indent=1)

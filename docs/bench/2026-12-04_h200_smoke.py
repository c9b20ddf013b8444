# Twenty-eighth session's one-H200 smoke (performance.md AB): this session's Python changes on
# the CUDA executor at TP=1 (one GPU), each against "reference" (XLA's own path):
#   1. the MLP block (nnx layers) on an Explicit mesh, fed a replicated input (the layers
#      reshard it now), forward and gradients, the custom calls in the compiled step;
#   2. an axis bound by jax.vmap: "ffi" must raise its ValueError, None must equal "xla".
# (collective_matmul's automatic path cannot be checked on one GPU: on a one-device mesh the
# partitioner compiles the plain dot, never calling the partition callback.)
# Run from outside the repository root with the installed package on PYTHONPATH; writes
# $OUT/smoke.json.
import json, os, re, traceback
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jax_distgemm as jd
from jax_distgemm import nnx as tp_nnx

out = {"devices": str(jax.devices()), "jax": jax.__version__}
rng = np.random.default_rng(0)
rel = lambda a, b: float(jnp.linalg.norm(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))
                         / jnp.linalg.norm(jnp.asarray(b, jnp.float32)))
dev = jax.devices()[:1]


def section(name, fn):
  try:
    out[name] = fn()
  except Exception as e:  # recorded, and the next section still runs
    out[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "tb": traceback.format_exc()[-3000:]}
  print(name, json.dumps(out[name])[:600], flush=True)


def nnx_explicit():
  mesh = jax.make_mesh((1, 1), ("data", "tp"), devices=dev, axis_types=(AxisType.Explicit,) * 2)
  x = jnp.asarray(rng.standard_normal((2, 256, 512)), jnp.bfloat16)
  res = {}
  with jax.set_mesh(mesh):
    for impl in ("ffi", "reference"):
      mlp = tp_nnx.ParallelMLP(512, 1024, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, implementation=impl)
      xs = jax.device_put(x, NamedSharding(mesh, P()))
      loss = lambda m, a: jnp.sum(m(a).astype(jnp.float32) ** 2)
      step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
      v, (gm, gx) = step(mlp, xs)
      graphdef, state = nnx.split(mlp)
      pure = jax.jit(jax.grad(lambda st, a: loss(nnx.merge(graphdef, st), a), argnums=(0, 1)))
      calls = len(re.findall(r"custom_call_target=\"jax_distgemm",
                             pure.lower(state, xs).compile().as_text()))
      y = nnx.jit(lambda m, a: m(a))(mlp, xs)
      res[impl] = dict(v=float(v), y=y, gx=gx, gk=gm["up"]["kernel"][...], spec=str(y.sharding.spec),
                       calls=calls)
  f, r = res["ffi"], res["reference"]
  return dict(loss_ffi=f["v"], loss_ref=r["v"], y_rel=rel(f["y"], r["y"]), gx_rel=rel(f["gx"], r["gx"]),
              gk_up_rel=rel(f["gk"], r["gk"]), y_spec=f["spec"],
              custom_calls_ffi=f["calls"], custom_calls_ref=r["calls"])


def vmap_axis():
  x = jnp.asarray(rng.standard_normal((2, 256, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((2, 128, 384)), jnp.bfloat16)
  f = lambda impl: jax.jit(jax.vmap(lambda a, b: jd.all_gather_matmul(
      a, b, axis_name="tp", implementation=impl), axis_name="tp"))
  try:
    f("ffi")(x, w)
    ffi = "no error"
  except ValueError as e:
    ffi = str(e)
  return dict(ffi_error=ffi, none_equals_xla=bool(jnp.array_equal(f(None)(x, w), f("xla")(x, w))))


section("nnx_explicit_mesh", nnx_explicit)
section("vmap_bound_axis", vmap_axis)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "smoke.json"), "w"), indent=1)

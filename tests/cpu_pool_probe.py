"""Probe: our CPU calls next to XLA collectives in one wide program (8 fake devices).

XLA:CPU runs thunks that become ready together on its intra-op pool (about one thread per
core, shared by every fake device); blocking collectives that land there can starve each other.
This program puts NC independent distgemm calls next to NC all-gathers over 'tp' and NC psums
over 'data' and runs it ITERS times.  A deadlock ends in XLA's "Termination timeout" abort.

  XLA_FLAGS="--xla_cpu_collective_call_terminate_timeout_seconds=6" \\
      python tests/cpu_pool_probe.py --calls 8 --iters 60 [--implementation xla]
"""

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_distgemm as jd  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--calls", type=int, default=8, help="independent calls per program (NC)")
  ap.add_argument("--iters", type=int, default=60)
  ap.add_argument("--timeout-ms", type=int, default=2000)
  ap.add_argument("--implementation", default="ffi", choices=("ffi", "xla"))
  args = ap.parse_args()
  mesh = jax.make_mesh((2, 4), ("data", "tp"))

  def body(x, w, z):
    outs = []
    for i in range(args.calls):
      outs.append(jd.all_gather_matmul(x + i, w, axis_name="tp",
                                       implementation=args.implementation,
                                       timeout_ms=args.timeout_ms).sum())
      outs.append(jax.lax.all_gather(z + i, "tp", tiled=True).sum()
                  + jax.lax.psum(z * i, "data").sum())
    return sum(outs)[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh,
                            in_specs=(P(("data", "tp"), None), P(None, "tp"), P("data")),
                            out_specs=P(("data", "tp"))))
  x = jax.device_put(jnp.ones((8 * 64, 256)), NamedSharding(mesh, P(("data", "tp"), None)))
  w = jax.device_put(jnp.ones((256, 4 * 128)), NamedSharding(mesh, P(None, "tp")))
  z = jax.device_put(jnp.ones((2 * 256, 256)), NamedSharding(mesh, P("data")))
  start = time.time()
  for _ in range(args.iters):
    out = f(x, w, z)
  jax.block_until_ready(out)
  print(f"ok: {args.iters} iterations, {args.calls} calls each, {time.time() - start:.1f} s "
        f"(jax {jax.__version__})")


if __name__ == "__main__":
  main()

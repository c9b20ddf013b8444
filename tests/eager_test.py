"""The FFI path outside jax.jit: an eager jax.shard_map and vmap around the op.

Regression test: an eager shard_map used to hand XLA:CPU a zero-size operand (the empty "no c"
placeholder), which crashed its compiler (segfault, jaxlib 0.11.2).
"""

import test_util as tu  # noqa: I001  (first: configures JAX before it initializes)

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding

import jax_distgemm as jd
from jax_distgemm import Schedule


class EagerShardMapTest(parameterized.TestCase):

  @parameterized.product(schedule=list(Schedule), with_c=[False, True])
  def test_eager_shard_map(self, schedule, with_c):
    mesh = tu.mesh_1d(4)
    xs, ws, os_ = tu.specs(schedule, 0)
    x, w, _ = tu.random_inputs(3, (16, 32), (32, 24), jnp.float32)
    c = jnp.asarray(np.random.default_rng(4).standard_normal((16, 24)), jnp.float32)
    args, in_specs = tu.place(mesh, (xs, ws, os_), x, w, c if with_c else None)

    def body(a, b, *rest):
      return jd.distributed_matmul(a, b, rest[0] if rest else None, axis_name="tp",
                                   schedule=schedule, beta=0.5 if rest else 0.0,
                                   implementation="ffi")

    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=os_)  # no jit
    out = f(*args)
    ref = tu.reference_np(x, w, c if with_c else None, beta=0.5 if with_c else 0.0)
    self.assertLess(tu.rel_err(out, ref), 1e-5)

  def test_vmap_inside_shard_map(self):
    schedule = Schedule.ReduceScatter1D_TilingA_RotatingC
    mesh = tu.mesh_1d(2)
    xs, ws, os_ = tu.specs(schedule, 1)
    x, w, _ = tu.random_inputs(5, (3, 8, 16), (16, 12), jnp.float32)

    body = jax.vmap(lambda a, b: jd.matmul_reduce_scatter(a, b, axis_name="tp",
                                                          implementation="ffi"),
                    in_axes=(0, None))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=os_))
    out = f(jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
    self.assertLess(tu.rel_err(out, tu.reference_np(x, w)), 1e-5)


if __name__ == "__main__":
  absltest.main()

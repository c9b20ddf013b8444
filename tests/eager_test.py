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

  # (None is "ffi" on CPU.)  The rule is the custom VJP's, the same for every implementation:
  # the ring, slow op by op in eager mode, once.
  @parameterized.parameters(*((s, "ffi") for s in Schedule),
                            (Schedule.ReduceScatter1D_TilingA_RotatingC, "xla"))
  def test_eager_grad_and_gathered_result(self, schedule, implementation):
    # A ReduceScatter's backward runs the dual AllGather with its gathered operand, whose
    # custom VJP takes symbolic zeros; JAX has none under an eager shard_map ("custom_vjp
    # symbolic_zeros support with shard_map is not implemented"), so the eager gradient of
    # every ReduceScatter, and return_gathered=True even forward, failed.
    mesh = tu.mesh_1d(4)
    xs, ws, os_ = tu.specs(schedule, 0)
    x, w, _ = tu.random_inputs(6, (16, 32), (32, 24), jnp.float32)
    (xd, wd), _ = tu.place(mesh, (xs, ws, os_), x, w, None)
    gathered = schedule.is_all_gather
    r = jnp.cos(jnp.arange(16 * 24, dtype=jnp.float32)).reshape(16, 24)

    def body(a, b):  # with return_gathered, only out leaves: the gathered one's cotangent is 0
      out = jd.distributed_matmul(a, b, axis_name="tp", schedule=schedule,
                                  implementation=implementation, return_gathered=gathered)
      return out[0] if gathered else out

    f = jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=os_)  # no jit
    self.assertLess(tu.rel_err(f(xd, wd), tu.reference_np(x, w)), 1e-5)
    gx, gw = jax.grad(lambda a, b: jnp.sum(f(a, b) * r), (0, 1))(xd, wd)
    want_x, want_w = jax.grad(lambda a, b: jnp.sum((a @ b) * r), (0, 1))(x, w)
    self.assertLess(tu.rel_err(gx, np.asarray(want_x)), 1e-5)
    self.assertLess(tu.rel_err(gw, np.asarray(want_w)), 1e-5)

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

"""Property tests (hypothesis): random shapes, batch dims, dtypes, TP and schedules on CPU.

For every drawn case, the fused FFI path (CPU executor) and the XLA ring must both match a
float64 numpy reference of the global computation, alpha * x @ w + beta * c, within the
per-dtype bound of tests/test_util.REL_TOL.  Runs are derandomized (the same examples every
run, no example database) so CI is stable; each schedule gets its own test with a few explicit
TP=8 examples on top of the drawn ones.  Runtime: well under 3 minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses

try:
  from tests import test_util as tu  # noqa: I001 - must precede JAX initialization
except ImportError:
  import test_util as tu

from absl.testing import absltest  # noqa: E402
from hypothesis import example, given, HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_distgemm as jd  # noqa: E402
from jax_distgemm import Schedule  # noqa: E402

TPS = (1, 2, 4, 8)
SETTINGS = settings(max_examples=9, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow], print_blob=True)


@dataclasses.dataclass(frozen=True)
class Case:
  schedule: Schedule
  tp: int
  batch: tuple[int, ...]
  w_batched: bool
  m: int  # per-device block sizes (see global_shapes)
  k: int
  n: int
  dtype: str  # key of tu.DTYPES
  out_f32: bool
  alpha: float
  beta: float
  seed: int

  def global_shapes(self):
    """Global x, w, out shapes: the sharded dims are multiples of TP, as shard_map needs."""
    b, wb = self.batch, (self.batch if self.w_batched else ())
    if self.schedule.is_all_gather:
      xs, ws = b + (self.m * self.tp, self.k), wb + (self.k, self.n * self.tp)
    else:
      # RS: K is sharded; the scattered output dim must also split into TP blocks locally.
      rows = self.m * self.tp if self.schedule == Schedule.ReduceScatter1D_TilingA_RotatingC \
          else self.m
      cols = self.n * self.tp if self.schedule == Schedule.ReduceScatter1D_TilingB_RotatingC \
          else self.n
      xs, ws = b + (rows, self.k * self.tp), wb + (self.k * self.tp, cols)
    return xs, ws, b + (xs[-2], ws[-1])


def cases(schedule: Schedule):
  @st.composite
  def draw(d):
    batch = tuple(d(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    beta = d(st.sampled_from([0.0, 0.0, 1.0, -0.5]))
    return Case(
        schedule=schedule,
        tp=d(st.sampled_from(TPS)),
        batch=batch,
        w_batched=bool(batch) and d(st.booleans()),
        m=d(st.integers(1, 9)),
        k=d(st.integers(1, 12)),
        n=d(st.integers(1, 9)),
        dtype=d(st.sampled_from(sorted(tu.DTYPES))),
        out_f32=d(st.booleans()),
        alpha=d(st.sampled_from([1.0, 1.0, 2.0, -0.75])),
        beta=beta,
        seed=d(st.integers(0, 2**16)),
    )
  return draw()


def _tp8(schedule, **kw):
  base = dict(schedule=schedule, tp=8, batch=(2, 3), w_batched=True, m=3, k=5, n=2,
              dtype="bf16", out_f32=False, alpha=1.5, beta=1.0, seed=7)
  base.update(kw)
  return Case(**base)


class PropertyTest(absltest.TestCase):

  def check(self, case: Case):
    mesh = tu.mesh_1d(case.tp)
    dtype = tu.DTYPES[case.dtype]
    x_shape, w_shape, out_shape = case.global_shapes()
    xs, ws, os_ = tu.specs(case.schedule, len(case.batch), w_batched=case.w_batched)
    use_c = case.beta != 0.0
    xg, wg, cg = tu.random_inputs(case.seed, x_shape, w_shape, dtype,
                                  c_shape=out_shape if use_c else None)
    ref = tu.reference_np(xg, wg, cg, alpha=case.alpha, beta=case.beta)
    out_dtype = jnp.float32 if case.out_f32 else None
    args, in_specs = tu.place(mesh, (xs, ws, os_), xg, wg, cg if use_c else None)
    for impl in ("ffi", "xla"):
      body = lambda x, w, *c, impl=impl: jd.distributed_matmul(
          x, w, *c, axis_name="tp", schedule=case.schedule, alpha=case.alpha, beta=case.beta,
          out_dtype=out_dtype, implementation=impl)
      f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=os_))
      out = f(*args)
      self.assertEqual(out.shape, out_shape, f"{impl}: {case}")
      self.assertEqual(out.dtype, jnp.dtype(out_dtype or dtype), f"{impl}: {case}")
      err = tu.rel_err(out, ref)
      self.assertLess(err, tu.REL_TOL[jnp.dtype(dtype)], f"{impl}: rel err {err} for {case}")

  @SETTINGS
  @given(case=cases(Schedule.AllGather1D_TilingCD_RotatingA))
  @example(case=_tp8(Schedule.AllGather1D_TilingCD_RotatingA))
  def test_all_gather_rotating_a(self, case):
    self.check(case)

  @SETTINGS
  @given(case=cases(Schedule.AllGather1D_TilingCD_RotatingB))
  @example(case=_tp8(Schedule.AllGather1D_TilingCD_RotatingB, dtype="fp16", w_batched=False))
  def test_all_gather_rotating_b(self, case):
    self.check(case)

  @SETTINGS
  @given(case=cases(Schedule.ReduceScatter1D_TilingA_RotatingC))
  @example(case=_tp8(Schedule.ReduceScatter1D_TilingA_RotatingC, out_f32=True))
  def test_reduce_scatter_tiling_a(self, case):
    self.check(case)

  @SETTINGS
  @given(case=cases(Schedule.ReduceScatter1D_TilingB_RotatingC))
  @example(case=_tp8(Schedule.ReduceScatter1D_TilingB_RotatingC, dtype="fp32", batch=(),
                     w_batched=False, beta=0.0))
  def test_reduce_scatter_tiling_b(self, case):
    self.check(case)


if __name__ == "__main__":
  absltest.main()

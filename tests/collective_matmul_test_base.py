"""Shared cases for every implementation of the collective matmuls.

A backend's test module subclasses `CollectiveMatmulTestBase` once per implementation and sets
IMPLEMENTATION ("ffi", "xla" or "reference"); every case then runs through the public API
inside jax.jit(jax.shard_map(...)) and is compared with a float64 numpy GEMM of the GLOBAL
problem.  Each case draws fresh random data for every call and calls the jitted function several
times, so a stale buffer, a rendezvous that leaks into the next call or a wrong tile placement
shows up as a numeric failure.

This module is not collected by itself (its name does not end in _test.py); import it as a
module, not its class, so that test loaders do not collect the abstract base.
"""

from __future__ import annotations

import dataclasses
import zlib

import test_util  # noqa: I001  (first: configures JAX before it initializes)

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_distgemm
from jax_distgemm import Schedule
from jax_distgemm._src import implementation

SCHEDULES = tuple(Schedule)
AG_A, AG_B, RS_A, RS_B = SCHEDULES
TPS = (1, 2, 4, 8)
CALLS = 3  # calls of one jitted function, each with fresh data

# Global problem sizes: divisible by every TP we test; not powers of two, so that a stride bug
# cannot hide behind a square or aligned shape.
M, K, N = 56, 24, 40


@dataclasses.dataclass(frozen=True)
class Epilogue:
  """One epilogue configuration: out = alpha * x @ w + beta * c, cast to out_dtype."""
  name: str
  dtype: str
  out_dtype: str | None = None
  alpha: float = 1.0
  beta: float = 0.0
  c_dtype: str = "fp32"

  def __repr__(self):
    return self.name


EPILOGUES = (
    Epilogue("bf16_to_fp32", "bf16", out_dtype="fp32"),
    Epilogue("bf16_to_fp32_alpha_beta", "bf16", out_dtype="fp32", alpha=0.5, beta=2.0),
    Epilogue("fp16_to_fp32_negative_alpha", "fp16", out_dtype="fp32", alpha=-1.25, beta=0.25),
    Epilogue("fp32_to_bf16_beta", "fp32", out_dtype="bf16", beta=1.0),
    Epilogue("bf16_alpha_beta_bf16_c", "bf16", alpha=2.0, beta=-0.5, c_dtype="bf16"),
    Epilogue("fp16_to_bf16_alpha", "fp16", out_dtype="bf16", alpha=3.0),
)


def call_public_api(schedule: Schedule, x, w, c, *, api: str = "wrapper", **kwargs):
  """Calls the public entry point for `schedule` (inside shard_map)."""
  if api == "distributed_matmul":
    return jax_distgemm.distributed_matmul(x, w, c, schedule=schedule.name, **kwargs)
  if schedule.is_all_gather:
    return jax_distgemm.all_gather_matmul(
        x, w, c, gathered="x" if schedule == AG_A else "w", **kwargs)
  return jax_distgemm.matmul_reduce_scatter(
      x, w, c, scatter="rows" if schedule == RS_A else "cols", **kwargs)


def with_batch_axis(spec, batch_ndim: int, batch_axis):
  """`spec` with its first (batch) entry sharded over mesh axis `batch_axis`."""
  if batch_axis is None or not batch_ndim:
    return spec
  entries = tuple(spec)
  return P(batch_axis, *entries[1:])


class _Machinery(parameterized.TestCase):
  """Building, running and checking one case through the public API."""

  IMPLEMENTATION: str | None = None

  def setUp(self):
    super().setUp()
    if self.IMPLEMENTATION not in implementation.IMPLEMENTATIONS:
      raise AssertionError(
          f"{type(self).__name__}.IMPLEMENTATION must be one of "
          f"{implementation.IMPLEMENTATIONS}, got {self.IMPLEMENTATION!r}")

  # -- Machinery -------------------------------------------------------------------------------

  def seed(self, call: int) -> int:
    """Different for every test case and every call, reproducible across runs."""
    return zlib.crc32(f"{self.id()}/{call}".encode())

  def build(self, schedule: Schedule, *, mesh, axis_name="tp", batch=(), w_batched=False,
            batch_axis=None, pass_c=False, api="wrapper", implementation="default", **kwargs):
    """jax.jit(jax.shard_map(...)) of the public API, and its global in/out specs."""
    x_spec, w_spec, out_spec = test_util.specs(schedule, len(batch), axis=axis_name,
                                               w_batched=w_batched)
    x_spec = with_batch_axis(x_spec, len(batch), batch_axis)
    w_spec = with_batch_axis(w_spec, len(batch) if w_batched else 0, batch_axis)
    out_spec = with_batch_axis(out_spec, len(batch), batch_axis)
    impl = self.IMPLEMENTATION if implementation == "default" else implementation

    def body(x, w, c=None):
      return call_public_api(schedule, x, w, c, api=api, axis_name=axis_name,
                             implementation=impl, **kwargs)

    in_specs = (x_spec, w_spec, out_spec) if pass_c else (x_spec, w_spec)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
    return fn, in_specs, out_spec

  def check(self, schedule: Schedule, *, tp=None, mesh=None, axis_name="tp", dtype="bf16",
            out_dtype=None, alpha=1.0, beta=0.0, c_dtype="fp32", batch=(), w_batched=False,
            batch_axis=None, pass_c=None, api="wrapper", implementation="default",
            m=M, k=K, n=N, calls=CALLS):
    """Runs one case `calls` times with fresh data; asserts each result against float64.

    Returns the jitted function and the placed arguments of the last call (for HLO checks).
    """
    if mesh is None:
      mesh = test_util.mesh_1d(tp)
    pass_c = beta != 0.0 if pass_c is None else pass_c
    kwargs = dict(alpha=alpha, beta=beta)
    if out_dtype is not None:
      kwargs["out_dtype"] = test_util.DTYPES[out_dtype]
    fn, in_specs, out_spec = self.build(
        schedule, mesh=mesh, axis_name=axis_name, batch=batch, w_batched=w_batched,
        batch_axis=batch_axis, pass_c=pass_c, api=api, implementation=implementation,
        **kwargs)
    in_dtype = jnp.dtype(test_util.DTYPES[dtype])
    want_dtype = jnp.dtype(test_util.DTYPES[out_dtype]) if out_dtype else in_dtype
    tol = max(test_util.REL_TOL[in_dtype], test_util.REL_TOL[want_dtype])
    x_shape, out_shape = tuple(batch) + (m, k), tuple(batch) + (m, n)
    w_shape = (tuple(batch) if w_batched else ()) + (k, n)

    previous = None
    for call in range(calls):
      x, w, c = test_util.random_inputs(self.seed(call), x_shape, w_shape, in_dtype,
                                        c_shape=out_shape if pass_c else None)
      if c is not None:
        c = jnp.full_like(c, jnp.nan) if c_dtype == "nan" else c.astype(test_util.DTYPES[c_dtype])
      args = [x, w] + ([c] if pass_c else [])
      placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
      if call == 0:
        run = fn.lower(*placed).compile()  # once per case: the calls and the HLO check share it
        if (self.IMPLEMENTATION if implementation == "default" else implementation) == "ffi":
          # Every "ffi" case is the custom call, once, with no XLA collective beside it.
          counts = test_util.collectives_in_hlo(run.as_text())
          self.assertEqual(counts.pop("jax_distgemm"), 1, counts)
          self.assertEqual(sum(counts.values()), 0, counts)
      out = run(*placed)
      self.assertEqual(out.shape, out_shape)
      self.assertEqual(out.dtype, want_dtype)
      self.assertTrue(out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), out.ndim),
                      f"output sharding {out.sharding} is not {out_spec}")
      ref = test_util.reference_np(x, w, c, alpha=alpha, beta=beta)
      err = test_util.rel_err(out, ref)
      self.assertLessEqual(
          err, tol, f"call {call}: relative error {err:.3g} > {tol:g} ({schedule.name}, "
          f"implementation={self.IMPLEMENTATION}, in={dtype}, out={out_dtype})")
      out = np.asarray(out.astype(jnp.float32))
      if previous is not None:
        self.assertFalse(np.array_equal(out, previous), "two calls returned the same output")
      previous = out
    return fn, placed

  def compiled_collectives(self, schedule: Schedule, tp: int) -> dict[str, int]:
    """Collectives in the compiled HLO of one case; the compiled program is also checked."""
    fn, placed = self.check(schedule, tp=tp, calls=1)
    return test_util.collectives_in_hlo(fn.lower(*placed).compile().as_text())


# Which cases each tier runs.  "full": every case (the fused op; a variant that only changes a
# ReduceScatter path passes schedules=RS_SCHEDULES).  "ring": the cases that exercise the
# ppermute ring's own logic (stage order, multi-axis groups, batches, vmap), not XLA's dot.
# "spec": the reference, XLA's own all-gather / reduce-scatter: one dtype, the layouts.
TIERS = ("full", "ring", "spec")
RS_SCHEDULES = (RS_A, RS_B)


def cases(implementation: str, *, schedules=SCHEDULES, tier: str = "full"):
  """A TestCase base class of the shared cases for `implementation` (subclass it once)."""
  assert tier in TIERS, tier
  full, ring = tier == "full", tier in ("full", "ring")
  dtypes = ("bf16", "fp16", "fp32") if full else ("fp32",)
  epilogues = EPILOGUES if full else EPILOGUES[1:2] if ring else ()
  ag = tuple(s for s in schedules if s.is_all_gather)

  class Cases(_Machinery):
    IMPLEMENTATION = implementation

    @parameterized.product(schedule=schedules, tp=TPS, dtype=dtypes)
    def test_schedule(self, schedule, tp, dtype):
      self.check(schedule, tp=tp, dtype=dtype)

    if ring:
      @parameterized.product(schedule=schedules, batch=((3,), (2, 2)), w_batched=(False, True))
      def test_leading_batch_dims(self, schedule, batch, w_batched):
        # x [*L, M, K] with w [K, N] (shared weight) or w [*L, K, N] (one weight per batch entry).
        self.check(schedule, tp=4, batch=batch, w_batched=w_batched)

    if epilogues:
      @parameterized.product(schedule=schedules, epilogue=epilogues)
      def test_epilogue(self, schedule, epilogue):
        self.check(schedule, tp=4, dtype=epilogue.dtype, out_dtype=epilogue.out_dtype,
                   alpha=epilogue.alpha, beta=epilogue.beta, c_dtype=epilogue.c_dtype)

    if full:
      @parameterized.product(schedule=schedules)
      def test_c_is_ignored_when_beta_is_zero(self, schedule):
        # The reference leaves c out when beta == 0; the result must not depend on it, not even
        # through 0 * c: c is NaN here (check() compares against x @ w alone and fails on NaN).
        self.check(schedule, tp=2, alpha=1.5, beta=0.0, pass_c=True, c_dtype="nan")

    @parameterized.product(schedule=schedules, w_batched=(False, True))
    def test_2d_mesh_batch_sharded_on_data(self, schedule, w_batched):
      # mesh ("data", "tp") = (2, 4): two independent TP groups of 4, batch split between them.
      mesh = jax.sharding.Mesh(np.array(test_util.cpu_devices(8)).reshape(2, 4), ("data", "tp"))
      self.check(schedule, mesh=mesh, batch=(4,), w_batched=w_batched, batch_axis="data",
                 beta=0.5)

    if ring:
      @parameterized.product(schedule=schedules)
      def test_tp_over_two_mesh_axes(self, schedule):
        # axis_name=("data", "tp") on a (2, 4) mesh: one TP group of 8, ranks in row-major order.
        mesh = jax.sharding.Mesh(np.array(test_util.cpu_devices(8)).reshape(2, 4), ("data", "tp"))
        self.check(schedule, mesh=mesh, axis_name=("data", "tp"))

    if ring:
      @parameterized.product(schedule=schedules)
      def test_tp_over_two_mesh_axes_out_of_mesh_order(self, schedule):
        # axis_name=("tp", "data") on a ("data", "tp") mesh: ranks count tp-major, as
        # P(("tp", "data")) lays out the global arrays (the ring's ppermute needs the mesh's order).
        mesh = jax.sharding.Mesh(np.array(test_util.cpu_devices(8)).reshape(2, 4), ("data", "tp"))
        self.check(schedule, mesh=mesh, axis_name=("tp", "data"))

    if full:
      @parameterized.product(schedule=schedules, empty=("M", "N"))
      def test_empty_rows_or_columns(self, schedule, empty):
        # M = 0 or N = 0 globally: an empty result of the right shape and sharding, no error, no
        # call of any implementation (nothing to compute or send: api._empty_contraction), and
        # zero gradients of the operand that is not empty.
        mesh = test_util.mesh_1d(4)
        m, n = (0, N) if empty == "M" else (M, 0)
        fn, in_specs, out_spec = self.build(schedule, mesh=mesh)
        x, w, _ = test_util.random_inputs(0, (m, K), (K, n), jnp.float32)
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), in_specs)]
        counts = test_util.collectives_in_hlo(fn.lower(*args).compile().as_text())
        self.assertEqual(sum(counts.values()), 0, counts)
        out = fn(*args)
        self.assertEqual(out.shape, (m, n))
        self.assertTrue(out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 2))
        gx, gw = jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1))(*args)
        for g, a in ((gx, x), (gw, w)):
          self.assertEqual(g.shape, a.shape)
          np.testing.assert_array_equal(np.asarray(g), np.zeros(a.shape, np.float32))

    if full:
      @parameterized.product(schedule=schedules, with_c=(False, True))
      def test_empty_contraction(self, schedule, with_c):
        # K = 0: out = beta * c (zeros without c) of the right shape and sharding, and c's gradient
        # is beta times the cotangent.  (A K = 0 dot inside shard_map crashed XLA:CPU, api.py.)
        mesh = test_util.mesh_1d(4)
        beta = 0.5 if with_c else 0.0
        fn, in_specs, out_spec = self.build(schedule, mesh=mesh, pass_c=with_c, alpha=2.0,
                                            beta=beta)
        x, w, c = test_util.random_inputs(1, (M, 0), (0, N), jnp.float32,
                                          c_shape=(M, N) if with_c else None)
        args = [jax.device_put(a, NamedSharding(mesh, s))
                for a, s in zip((x, w, c) if with_c else (x, w), in_specs)]
        out = fn(*args)
        self.assertEqual(out.shape, (M, N))
        self.assertTrue(out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 2))
        want = beta * np.asarray(c) if with_c else np.zeros((M, N), np.float32)
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
        if with_c:
          g = jax.grad(lambda *a: jnp.sum(fn(*a) * 3.0), argnums=2)(*args)
          np.testing.assert_allclose(np.asarray(g), np.full((M, N), 1.5, np.float32), rtol=1e-6)

    if ag:
      @parameterized.product(schedule=ag, tp=(1, 2, 4),
                             layout=("2d", "batched", "batched_w"))
      def test_return_gathered(self, schedule, tp, layout):
        # return_gathered=True: (out, the gathered x or w), the latter on every device, equal to the
        # global operand bit for bit; for "ffi" still one custom call and no XLA collective.
        batch = () if layout == "2d" else (3,)
        w_batched = layout == "batched_w"
        mesh = test_util.mesh_1d(tp)
        x_spec, w_spec, out_spec = test_util.specs(schedule, len(batch), w_batched=w_batched)

        def body(x, w):
          out, g = call_public_api(schedule, x, w, None, axis_name="tp", alpha=0.5,
                                   implementation=self.IMPLEMENTATION, return_gathered=True)
          return out, g[None]  # one copy per device, stacked along "tp"

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec),
                                   out_specs=(out_spec, P("tp"))))
        x_shape = batch + (M, K)
        w_shape = (batch if w_batched else ()) + (K, N)
        for call in range(CALLS):
          x, w, _ = test_util.random_inputs(self.seed(call), x_shape, w_shape, jnp.bfloat16)
          placed = (jax.device_put(x, NamedSharding(mesh, x_spec)),
                    jax.device_put(w, NamedSharding(mesh, w_spec)))
          if call == 0 and self.IMPLEMENTATION == "ffi":
            counts = test_util.collectives_in_hlo(fn.lower(*placed).compile().as_text())
            self.assertEqual(counts.pop("jax_distgemm"), 1, counts)
            self.assertEqual(sum(counts.values()), 0, counts)
          out, g = fn(*placed)
          self.assertLessEqual(test_util.rel_err(out, test_util.reference_np(x, w, alpha=0.5)),
                               test_util.REL_TOL[jnp.dtype(jnp.bfloat16)])
          operand = x if schedule == AG_A else w
          self.assertEqual(g.shape, (tp,) + operand.shape)
          self.assertEqual(g.dtype, operand.dtype)
          for d in range(tp):
            np.testing.assert_array_equal(np.asarray(g[d]), np.asarray(operand), f"device {d}")

    if full and ag:
      @parameterized.product(schedule=ag, empty=("K", "M", "N"))
      def test_return_gathered_empty(self, schedule, empty):
        # K = 0: zeros, and the gathered operand is empty too (x [M, 0] or w [0, N] per device).
        # M or N = 0: an empty output, and the gathered operand all the same (never the executor:
        # api._gathered_without_gemm).
        tp = 4
        m, k, n = {"K": (M, 0, N), "M": (0, K, N), "N": (M, K, 0)}[empty]
        mesh = test_util.mesh_1d(tp)
        x_spec, w_spec, out_spec = test_util.specs(schedule, 0)

        def body(x, w):
          out, g = call_public_api(schedule, x, w, None, axis_name="tp",
                                   implementation=self.IMPLEMENTATION, return_gathered=True)
          return out, g[None]

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec),
                                   out_specs=(out_spec, P("tp"))))
        x, w, _ = test_util.random_inputs(2, (m, k), (k, n), jnp.bfloat16)
        out, g = fn(jax.device_put(x, NamedSharding(mesh, x_spec)),
                    jax.device_put(w, NamedSharding(mesh, w_spec)))
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.zeros((m, n), np.float32))
        operand = x if schedule == AG_A else w
        self.assertEqual(g.shape, (tp,) + operand.shape)
        self.assertEqual(g.dtype, jnp.bfloat16)
        for d in range(tp):
          np.testing.assert_array_equal(np.asarray(g[d]), np.asarray(operand), f"device {d}")

    if full:
      @parameterized.product(schedule=schedules)
      def test_distributed_matmul_by_schedule_name(self, schedule):
        self.check(schedule, tp=4, api="distributed_matmul", alpha=0.75)

    def fp16_grads_with_an_fp32_output(self, schedule, x, w, r):
      """(dx, dw) of sum(out * r) through the call at TP=2, fp16 operands and an fp32 output, and
      the dense gradient of the same."""
      mesh = test_util.mesh_1d(2)
      x_spec, w_spec, out_spec = test_util.specs(schedule, 0)
      f = jax.shard_map(lambda a, b: call_public_api(schedule, a, b, None, axis_name="tp",
                                                     out_dtype=jnp.float32,
                                                     implementation=self.IMPLEMENTATION),
                        mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
      place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
      got = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * r), (0, 1)))(
          place(x, x_spec), place(w, w_spec))
      want = jax.grad(lambda a, b: jnp.sum(
          jnp.matmul(a, b, preferred_element_type=jnp.float32) * r), (0, 1))(x, w)
      return got, want

    if full:
      @parameterized.product(schedule=schedules)
      def test_fp16_grads_with_an_fp32_output_and_a_large_cotangent(self, schedule):
        # d loss / d out = 1e5 (a loss scale): above fp16's 65504, so the backward's cast of the
        # fp32 cotangent to fp16 made it inf and every dx, dw NaN, although they fit fp16.
        x, w, _ = test_util.random_inputs(self.seed(0), (M, K), (K, N), jnp.float16)
        r = 1e5 * jnp.cos(jnp.arange(M * N, dtype=jnp.float32)).reshape(M, N)
        got, want = self.fp16_grads_with_an_fp32_output(schedule, x * 1e-2, w * 1e-2, r)
        for g, ref, what in zip(got, want, ("dx", "dw")):
          self.assertTrue(bool(jnp.isfinite(g).all()), what)
          self.assertLess(test_util.rel_err(g, np.asarray(ref, np.float64)), 2e-3, what)

    if full:
      @parameterized.product(schedule=schedules)
      def test_fp16_grads_with_an_fp32_output_and_an_inf_in_the_cotangent(self, schedule):
        # One inf in d loss / d out: the fp16 scale came from max |g| = inf, so s = 0, and every
        # dx and dw of every rank was NaN.  Only the rows / columns that meet the inf may be
        # non-finite, as in the dense gradient; the rest must match it.
        x, w, _ = test_util.random_inputs(self.seed(0), (M, K), (K, N), jnp.float16)
        r = np.cos(np.arange(M * N, dtype=np.float32)).reshape(M, N)
        r[1, 2] = np.inf
        got, want = self.fp16_grads_with_an_fp32_output(schedule, x, w, r)
        for g, ref, what in zip(got, want, ("dx", "dw")):
          g, ref = np.asarray(g, np.float64), np.asarray(ref, np.float64)
          finite = np.isfinite(ref)
          self.assertTrue(0 < finite.sum() < finite.size, what)  # the case has both kinds
          np.testing.assert_array_equal(np.isfinite(g), finite, what)
          self.assertLess(test_util.rel_err(g[finite], ref[finite]), 2e-3, what)

    if ring and ag:
      @parameterized.product(schedule=ag)
      def test_vmap_grad_with_a_shared_gathered_operand(self, schedule):
        # vmap inside shard_map over the operand the call does NOT gather: the gathered result is
        # then shared by the examples.  The custom VJP ran per example on its whole cotangent and
        # the sum counted it once per example (jax 0.11.2: a wrong dw, 3x that term; jax 0.12:
        # JAX's "shared across the batch" error).  Compared with plain jax.grad of the math.
        tp, vb = 2, 3
        mesh = test_util.mesh_1d(tp)
        x_spec, w_spec, _ = test_util.specs(schedule, 0)
        x, w, _ = test_util.random_inputs(self.seed(0), (vb, M, K), (K, N), jnp.float32)
        if schedule == AG_A:  # gathers x: vmap over w
          x, w = x[0], jnp.stack([w, 2 * w, -w])
          in_axes, specs = (None, 0), (x_spec, P(None, *w_spec))
        else:  # gathers w: vmap over x
          in_axes, specs = (0, None), (P(None, *x_spec), w_spec)

        def loss(impl):
          def op(a, b):
            if impl == "math":
              g = jax.lax.all_gather(a if schedule == AG_A else b, "tp",
                                     axis=0 if schedule == AG_A else 1, tiled=True)
              out = g @ b if schedule == AG_A else a @ g
            else:
              out, g = call_public_api(schedule, a, b, None, axis_name="tp", implementation=impl,
                                       return_gathered=True)
            return jnp.sum(jnp.sin(out)) + jnp.sum(g ** 2)
          body = lambda a, b: jax.vmap(op, in_axes=in_axes)(a, b)[None]
          sm = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp"))
          return lambda a, b: jnp.sum(sm(a, b))

        place = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
        args = (place(x, specs[0]), place(w, specs[1]))
        want = jax.jit(jax.grad(loss("math"), (0, 1)))(*args)
        got = jax.jit(jax.grad(loss(self.IMPLEMENTATION), (0, 1)))(*args)
        for g, r, what in zip(got, want, ("dx", "dw")):
          self.assertLess(test_util.rel_err(g, np.asarray(r)), 1e-5, what)

    if ring:
      @parameterized.product(schedule=schedules, in_axes=((0, 0), (None, 0), (0, None)))
      def test_vmap_of_batched_x_and_2d_w(self, schedule, in_axes):
        # Per shard x [B, m, K] and a 2-D w, vmapped around the jitted shard_map: a mapped w
        # [v, K, N] beside x [v, B, m, K] was broadcast right-aligned, pairing v with B (a
        # broadcasting error in the FFI path's batching rule).
        tp, vb, b = 2, 3, 2
        mesh = test_util.mesh_1d(tp)
        x_spec, w_spec, out_spec = test_util.specs(schedule, 1)
        fn = jax.jit(jax.shard_map(
            lambda x, w: call_public_api(schedule, x, w, None, axis_name="tp",
                                         implementation=self.IMPLEMENTATION),
            mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))
        x, _, _ = test_util.random_inputs(self.seed(0), (vb, b, M, K), (K, N), jnp.float32)
        w, _, _ = test_util.random_inputs(self.seed(1), (vb, K, N), (K, N), jnp.float32)
        xs, ws = (x if in_axes[0] == 0 else x[0]), (w if in_axes[1] == 0 else w[0])
        out = jax.vmap(fn, in_axes=in_axes)(xs, ws)
        self.assertEqual(out.shape, (vb, b, M, N))
        for v in range(vb):
          want = test_util.reference_np(x[v if in_axes[0] == 0 else 0],
                                        w[v if in_axes[1] == 0 else 0])
          self.assertLessEqual(test_util.rel_err(out[v], want), 1e-5, f"vmapped row {v}")

    if ring:
      @parameterized.product(schedule=schedules)
      def test_vmap_inside_shard_map(self, schedule):
        # A vmapped x gains a leading batch dim inside the per-device program.
        tp, vb = 2, 3
        mesh = test_util.mesh_1d(tp)
        x_spec, w_spec, out_spec = test_util.specs(schedule, 1)

        def body(x, w):
          f = lambda xi: call_public_api(schedule, xi, w, None, axis_name="tp",
                                         implementation=self.IMPLEMENTATION)
          return jax.vmap(f)(x)

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))
        for call in range(CALLS):
          x, w, _ = test_util.random_inputs(self.seed(call), (vb, M, K), (K, N), jnp.bfloat16)
          out = fn(jax.device_put(x, NamedSharding(mesh, x_spec)),
                   jax.device_put(w, NamedSharding(mesh, w_spec)))
          self.assertEqual(out.shape, (vb, M, N))
          self.assertLessEqual(test_util.rel_err(out, test_util.reference_np(x, w)),
                               test_util.REL_TOL[jnp.dtype(jnp.bfloat16)])

  return Cases

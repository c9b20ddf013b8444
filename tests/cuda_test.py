"""GPU tests of the CUDA executor (CUTLASS SM90 stages + NVLink peers).

Skipped only where no pair of Hopper (sm_90) GPUs is visible.  With
JAX_DISTGEMM_REQUIRE_GPU=1 (tools/gpu_check.sh) a missing GPU or a missing CUDA extension is a
failure instead.  Outputs are poisoned with NaN before every call
(JAX_DISTGEMM_POISON_OUTPUT=1, set by test_util before the executor reads it), so a tile the kernels
never write fails the comparison.
"""

from __future__ import annotations

import contextlib
import os
import time

import test_util  # noqa: E402,I001  (fake CPU devices, poisoned outputs, before JAX starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_distgemm as jd  # noqa: E402
from jax_distgemm import Schedule  # noqa: E402
from jax_distgemm import ffi as ffi_modules  # noqa: E402
from jax_distgemm._src import runtime  # noqa: E402

GPUS = test_util.hopper_gpus()
TP = 2


def setUpModule():
  test_util.require_hopper_gpus(TP)


def gpu_mesh(tp=TP):
  return jax.sharding.Mesh(np.array(GPUS[:tp]), ("tp",))


def place_global(schedule, x, w, c=None, *, mesh=None, w_batched=False):
  """Global x, w (and c) placed on the GPU mesh as `schedule` takes them: (arrays, in_specs)."""
  specs = test_util.specs(schedule, x.ndim - 2, w_batched=w_batched)
  return test_util.place(mesh or gpu_mesh(), specs, x, w, c)


def run_global(schedule, x, w, c=None, *, alpha=1.0, beta=0.0, out_dtype=None,
               implementation="ffi", mesh=None, w_batched=False, timeout_ms=None):
  mesh = mesh or gpu_mesh()
  _, _, os_ = test_util.specs(schedule, x.ndim - 2, w_batched=w_batched)
  args, in_specs = place_global(schedule, x, w, c, mesh=mesh, w_batched=w_batched)

  def body(a, b, *rest):
    return jd.distributed_matmul(a, b, rest[0] if rest else None, axis_name="tp",
                                 schedule=schedule, alpha=alpha, beta=beta, out_dtype=out_dtype,
                                 implementation=implementation, timeout_ms=timeout_ms)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=os_))
  return f, args


# Global (M, K, N); local shards are M/TP or N/TP or K/TP.  The second and third are not
# multiples of any tile; every row pitch (K, N, K/TP, N/TP) stays a multiple of 8 elements, the
# 16-byte TMA rule (cuda_rules.py).
SHAPES = {"square": (512, 512, 1024), "ragged": (400, 528, 528), "tall": (1040, 272, 272)}


class CudaCorrectnessTest(parameterized.TestCase):

  @parameterized.product(schedule=list(Schedule), dtype=["bf16", "fp16"],
                         shape=list(SHAPES))
  def test_matches_reference(self, schedule, dtype, shape):
    m, k, n = SHAPES[shape]
    dt = test_util.DTYPES[dtype]
    # Fresh data every call: calls 0 and 2 share a workspace parity, so a call that read a
    # slot before its peer's push landed would find call 0's data there, not its own.
    sets = [test_util.random_inputs(test_util.seed_of(schedule, dtype, shape, rep), (m, k),
                                    (k, n), dt)[:2] for rep in range(3)]
    f, _ = run_global(schedule, *sets[0])
    for rep, (x, w) in enumerate(sets):
      out = f(*place_global(schedule, x, w)[0])
      err = test_util.rel_err(out, test_util.reference_np(x, w))
      self.assertFalse(np.isnan(np.asarray(out, np.float32)).any(), "unwritten output (NaN)")
      self.assertLess(err, test_util.REL_TOL[jnp.dtype(dt)], f"call {rep}")

  @parameterized.product(schedule=list(Schedule), w_batched=[False, True],
                         dtype=["bf16", "fp16"])
  def test_batch_alpha_beta(self, schedule, w_batched, dtype):
    L, (m, k, n) = 3, SHAPES["ragged"]
    dt = test_util.DTYPES[dtype]
    x, w, _ = test_util.random_inputs(7, (L, m, k), (L, k, n) if w_batched else (k, n), dt)
    c = jnp.asarray(np.random.default_rng(8).standard_normal((L, m, n)), dt)
    _, _, out_spec = test_util.specs(schedule, 1, w_batched=w_batched)
    f, args = run_global(schedule, x, w, c, alpha=0.5, beta=-0.75, w_batched=w_batched)
    out = f(*args)
    ref = test_util.reference_np(x, w, c, alpha=0.5, beta=-0.75)
    self.assertFalse(np.isnan(np.asarray(out, np.float32)).any(), "unwritten output (NaN)")
    self.assertLess(test_util.rel_err(out, ref), test_util.REL_TOL[jnp.dtype(dt)])

  @parameterized.product(schedule=list(Schedule), dtype=["bf16", "fp16"])
  def test_fp32_output(self, schedule, dtype):
    m, k, n = SHAPES["square"]
    dt = test_util.DTYPES[dtype]
    x, w, _ = test_util.random_inputs(11, (m, k), (k, n), dt)
    f, args = run_global(schedule, x, w, out_dtype=jnp.float32)
    out = f(*args)
    self.assertEqual(out.dtype, jnp.float32)
    self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)), 2e-3)

  def test_hlo_has_custom_call_and_no_collectives(self):
    for schedule in Schedule:
      x, w, _ = test_util.random_inputs(1, (512, 512), (512, 1024), jnp.bfloat16)
      f, args = run_global(schedule, x, w)
      counts = test_util.collectives_in_hlo(f.lower(*args).compile().as_text())
      self.assertEqual(counts["jax_distgemm"], 1, schedule.name)
      self.assertEqual(counts["all-gather"] + counts["reduce-scatter"], 0, schedule.name)


# AllGather paths the executor chooses by itself (all_gather.cc), by global (M, K, N) at TP=2:
# the fused grid with the shard in one piece (256 rows or columns per device) or in two chunks
# (AgChunks: 512 per device, a stage n or m of 512), and stage launches (fp16, for which no
# fused kernel is built; a batch).
AG_PATHS = {
    "fused": {"extent": 512, "batch": (), "dtype": jnp.bfloat16},
    "fused_chunks2": {"extent": 1024, "batch": (), "dtype": jnp.bfloat16},
    "stages": {"extent": 1024, "batch": (), "dtype": jnp.float16},
    "batched": {"extent": 1024, "batch": (3,), "dtype": jnp.bfloat16},
}


class CudaGatheredOperandTest(parameterized.TestCase):
  """return_gathered=True on CUDA: the copy stream copies each received slot into the second
  result (all_gather.cc, CopyGathered) on the fused grid, chunked, the stage launches and batched
  calls; the ReduceScatter backward then runs no XLA all-gather."""

  @parameterized.product(
      schedule=[Schedule.AllGather1D_TilingCD_RotatingA, Schedule.AllGather1D_TilingCD_RotatingB],
      path=list(AG_PATHS))
  def test_gathered_equals_the_operand(self, schedule, path):
    batch, dtype, extent = (AG_PATHS[path][k] for k in ("batch", "dtype", "extent"))
    rot_a = schedule == Schedule.AllGather1D_TilingCD_RotatingA
    m, k, n = (extent, 512, 1024) if rot_a else (1024, 512, extent)
    mesh = gpu_mesh()
    x_spec, w_spec, out_spec = test_util.specs(schedule, len(batch))

    def body(a, b):
      out, g = jd.distributed_matmul(a, b, axis_name="tp", schedule=schedule,
                                     implementation="ffi", return_gathered=True)
      return out, g[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec),
                              out_specs=(out_spec, P("tp"))))
    for call in range(3):  # fresh data each call; calls 0 and 2 share a slot parity
      x, w, _ = test_util.random_inputs(test_util.seed_of(schedule, path, call), batch + (m, k),
                                        (k, n), dtype)
      args, _ = place_global(schedule, x, w)
      out, g = f(*args)
      self.assertLess(test_util.rel_err(out, test_util.reference_np(x, w)),
                      test_util.REL_TOL[jnp.dtype(dtype)], f"call {call}")
      operand = np.asarray(x if rot_a else w)
      for d in range(TP):
        np.testing.assert_array_equal(np.asarray(g[d]), operand, f"call {call}, device {d}")

  @parameterized.parameters(Schedule.ReduceScatter1D_TilingA_RotatingC,
                            Schedule.ReduceScatter1D_TilingB_RotatingC)
  def test_reduce_scatter_grad_gathers_d_out_once(self, schedule):
    m, k, n = 1024, 1024, 512
    x, w, _ = test_util.random_inputs(test_util.seed_of(schedule, "grad"), (m, k), (k, n),
                                      jnp.bfloat16)
    args, in_specs = place_global(schedule, x, w)
    _, _, out_spec = test_util.specs(schedule, 0)

    def loss(impl):
      body = lambda a, b: jd.distributed_matmul(a, b, axis_name="tp", schedule=schedule,
                                                implementation=impl)
      sm = jax.shard_map(body, mesh=gpu_mesh(), in_specs=in_specs, out_specs=out_spec)
      return lambda a, b: jnp.sum(jnp.sin(sm(a, b).astype(jnp.float32)))

    g = jax.jit(jax.grad(loss("ffi"), (0, 1)))
    counts = test_util.collectives_in_hlo(g.lower(*args).compile().as_text())
    self.assertEqual((counts["jax_distgemm"], counts["all-gather"]), (2, 0), counts)
    want = jax.jit(jax.grad(loss("reference"), (0, 1)))(*args)
    for name, got, ref in zip(("dx", "dw"), g(*args), want):
      err = test_util.rel_err(got, np.asarray(ref.astype(jnp.float32), np.float64))
      self.assertLess(err, 2e-2, name)


class CudaCopyStreamTest(absltest.TestCase):
  """Each device's copy stream sits on a hardware queue apart from XLA's compute stream
  (cc/cuda/copy_stream.h): a wait blocked on it does not hold up the compute stream."""

  def test_copy_stream_is_independent_of_the_compute_stream(self):
    x, w, _ = test_util.random_inputs(3, (256, 512), (512, 256), jnp.bfloat16)
    f, args = run_global(Schedule.AllGather1D_TilingCD_RotatingA, x, w)
    self.assertLess(test_util.rel_err(f(*args), test_util.reference_np(x, w)), 1e-2)
    reports = runtime.copy_stream_reports()
    ordinals = [d.local_hardware_id for d in GPUS[:TP]]
    mine = [r for r in reports if r["group"] == ordinals]  # this call's group
    self.assertEqual(ordinals, sorted(r["ordinal"] for r in mine), reports)
    for r in mine:
      self.assertEqual(r["group"][r["rank"]], r["ordinal"], r)
      self.assertEqual((r["independent"], r["note"]), (1, ""), f"{r}: {reports}")
      self.assertBetween(r["candidates"], 1, 32)


class CudaStressTest(parameterized.TestCase):

  @parameterized.parameters(Schedule.AllGather1D_TilingCD_RotatingA,
                            Schedule.ReduceScatter1D_TilingA_RotatingC)
  def test_1000_back_to_back_calls_two_shapes(self, schedule):
    """1,000 calls, alternating two shapes, fresh inputs each call, every result checked."""
    mesh = gpu_mesh()
    xs, ws, os_ = test_util.specs(schedule, 0)
    shapes = [(256, 512, 384), (512, 256, 1024)]

    def make_step(m, k, n):
      def body(key):
        kx, kw = jax.random.split(jax.random.fold_in(key, jax.lax.axis_index("tp")))
        ag = schedule.is_all_gather
        xl = jax.random.normal(kx, (m // TP, k) if ag else (m, k // TP), jnp.float32)
        wl = jax.random.normal(kw, (k, n // TP) if ag else (k // TP, n), jnp.float32)
        xl, wl = xl.astype(jnp.bfloat16), wl.astype(jnp.bfloat16)
        ours = jd.distributed_matmul(xl, wl, axis_name="tp", schedule=schedule,
                                     implementation="ffi")
        ref = jd.distributed_matmul(xl, wl, axis_name="tp", schedule=schedule,
                                    implementation="reference").astype(jnp.float32)
        num = jnp.sum((ours.astype(jnp.float32) - ref) ** 2)
        den = jnp.sum(ref ** 2)
        return jax.lax.psum(jnp.stack([num, den]), "tp")[None]
      return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("tp")))

    steps = [make_step(*s) for s in shapes]
    results = []
    t0 = time.perf_counter()
    for i in range(1000):
      results.append(steps[i % 2](jax.random.key(i)))
    errs = np.array([np.sqrt(r[0, 0] / r[0, 1]) for r in jax.device_get(results)])
    elapsed = time.perf_counter() - t0
    self.assertEqual(len(errs), 1000)
    self.assertTrue(np.all(np.isfinite(errs)), "NaN result (unwritten tile or race)")
    self.assertLess(errs.max(), 1e-2, f"worst call {errs.argmax()}")
    self.assertIsNone(jd.runtime.pending_error())
    print(f"{schedule.name}: 1000 calls in {elapsed:.2f}s, worst rel err {errs.max():.2e}")

  def test_inside_program_with_xla_all_reduce(self):
    """Our ops and an XLA all-reduce on the same devices in one jitted program."""
    mesh = gpu_mesh()
    rs, ag = Schedule.ReduceScatter1D_TilingA_RotatingC, Schedule.AllGather1D_TilingCD_RotatingA
    xs, ws, ys = test_util.specs(rs, 0)
    _, w2s, zs = test_util.specs(ag, 0)
    x, w, _ = test_util.random_inputs(3, (512, 1024), (1024, 768), jnp.bfloat16)
    _, w2, _ = test_util.random_inputs(4, (8, 768), (768, 256), jnp.bfloat16)

    def body(a, b, b2):
      y = jd.matmul_reduce_scatter(a, b, axis_name="tp", implementation="ffi")
      total = jax.lax.psum(jnp.sum(y.astype(jnp.float32)), "tp")  # XLA all-reduce
      z = jd.all_gather_matmul(y, b2, axis_name="tp", implementation="ffi")
      return y, z, total[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, ws, w2s),
                              out_specs=(ys, zs, P("tp"))))
    args = (jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)),
            jax.device_put(w2, NamedSharding(mesh, w2s)))
    counts = test_util.collectives_in_hlo(f.lower(*args).compile().as_text())
    self.assertEqual(counts["jax_distgemm"], 2)
    self.assertGreaterEqual(counts["all-reduce"], 1)
    self.assertEqual(counts["all-gather"] + counts["reduce-scatter"], 0)
    ref_y = test_util.reference_np(x, w)
    ref_z = ref_y @ np.asarray(w2, np.float64)
    for _ in range(3):
      y, z, total = f(*args)
      self.assertLess(test_util.rel_err(y, ref_y), 1e-2)
      self.assertLess(test_util.rel_err(z, ref_z), 2e-2)
      np.testing.assert_allclose(np.asarray(total)[0], np.asarray(y, np.float64).sum(),
                                 rtol=1e-3, atol=1e-1 * np.sqrt(y.size))


@contextlib.contextmanager
def new_tuning_lines(module):
  """Yields a list that holds, once the block exits, the tuning-table lines it added: the
  launches a case tuned, which tell the path it took (fused launches list their stages)."""
  before = set(module.describe_tuning().splitlines())
  added = []
  yield added
  added.extend(line for line in module.describe_tuning().splitlines() if line not in before)


def tuned_lines_of_three_calls(test, schedule, x, w, c=None, *, alpha=1.0, beta=0.0):
  """Three calls (both parities of the slots and pointer tables; per-stage counters reset), each
  free of NaN (tiles never written) and within 1e-2 of the reference.  Calls 1 and 2 draw fresh
  x and w: calls 0 and 2 share a parity, so a call that read a slot before its peer wrote it
  would find call 0's data there.  Returns the tuning-table lines the case added: the launches
  it tuned, which tell the path it took (fused launches list their stages)."""
  module = ffi_modules.module_for("cuda")
  ref = test_util.reference_np(x, w, c, alpha=alpha, beta=beta)
  with new_tuning_lines(module) as tuned:
    f, args = run_global(schedule, x, w, c, alpha=alpha, beta=beta)
    for rep in range(3):
      if rep:
        x, w, _ = test_util.random_inputs(test_util.seed_of(schedule, x.shape, w.shape, rep),
                                          x.shape, w.shape, x.dtype)
        args, _ = place_global(schedule, x, w, c)
        ref = test_util.reference_np(x, w, c, alpha=alpha, beta=beta)
      out = f(*args)
      test.assertFalse(np.isnan(np.asarray(out, np.float32)).any(), f"unwritten output, {rep}")
      test.assertLess(test_util.rel_err(out, ref), 1e-2, f"call {rep}")
  test.assertNotEmpty(tuned)
  return tuned


class CudaAllGatherPathsTest(parameterized.TestCase):
  """AllGather runs all stages in one fused grid where a fused kernel is built (bfloat16) and
  the call has one batch, else one launch per stage."""

  @parameterized.product(
      schedule=[Schedule.AllGather1D_TilingCD_RotatingA, Schedule.AllGather1D_TilingCD_RotatingB],
      dtype=["bf16", "fp16"], with_c=[False, True], shape=["square", "tall"])
  def test_fused_and_stage_paths_match_reference(self, schedule, dtype, with_c, shape):
    fused = dtype == "bf16"  # no fused kernel is built for float16
    dt = test_util.DTYPES[dtype]
    m, k, n = SHAPES[shape]
    # A shape per case, so that each case tunes (and so lists) its own launches.
    variant = 4 * (schedule == Schedule.AllGather1D_TilingCD_RotatingB) + 2 * with_c + fused
    m += 16 * TP * variant
    x, w, _ = test_util.random_inputs(test_util.seed_of(schedule, dtype, with_c), (m, k), (k, n),
                                      dt)
    c = (jnp.asarray(np.random.default_rng(3).standard_normal((m, n)), dt) if with_c else None)
    alpha, beta = (0.5, -0.75) if with_c else (1.0, 0.0)
    # The path taken shows in the tuning table: fused launches are tuned as such.
    tuned = tuned_lines_of_three_calls(self, schedule, x, w, c, alpha=alpha, beta=beta)
    self.assertEqual([fused] * len(tuned), ["fused stages=2" in line for line in tuned], tuned)

  @parameterized.product(
      schedule=[Schedule.AllGather1D_TilingCD_RotatingA, Schedule.AllGather1D_TilingCD_RotatingB],
      extent=[1024, 640])
  def test_chunked_shard_in_the_fused_grid(self, schedule, extent):
    """Where the push lasts about as long as stage 0 (a small stage n or m), the shard travels
    in two chunks with a flag each, and each tile of the fused grid waits only for the chunk it
    reads (all_gather.cc, AgChunks).  1024 rows or columns per device split into 512 + 512, 640
    into 384 + 256, so that 256-row tiles straddle the boundary."""
    rot_a = schedule == Schedule.AllGather1D_TilingCD_RotatingA
    m, k, n = (extent * TP, 512, 768) if rot_a else (768, 512, extent * TP)
    # A shape per case, so that each case tunes (and so lists) its own launches.
    k += 64 * (2 * (not rot_a) + (extent == 640))
    x, w, _ = test_util.random_inputs(test_util.seed_of(schedule, extent), (m, k), (k, n),
                                      jnp.bfloat16)
    tuned = tuned_lines_of_three_calls(self, schedule, x, w)
    self.assertTrue(tuned and all("fused stages=2" in line for line in tuned), tuned)


def rs_paths():
  """(ordinal, data path) of the TP group's devices' last ReduceScatter call, by ordinal."""
  ordinals = [d.local_hardware_id for d in GPUS[:TP]]
  rows = ffi_modules.module_for("cuda").last_rs_paths()
  return sorted((o, path) for o, group, path in rows if group == ordinals)


def check_alternating_calls(test, shapes, seed):
  """200 back-to-back ReduceScatter (TilingA) calls alternating two shapes, nothing blocking in
  between (slots, flags and pointer tables cycle through both parities): every call matches
  the reference.  Each shape cycles through three input sets, so two calls of one parity never
  read the same data: a call that read a slot its peer had not yet written would find the
  previous call's running sums there, and fail."""
  schedule = Schedule.ReduceScatter1D_TilingA_RotatingC
  cases = []
  for i, (m, k, n) in enumerate(shapes):
    sets = [test_util.random_inputs(seed + 10 * i + j, (m, k), (k, n), jnp.bfloat16)[:2]
            for j in range(3)]
    f, _ = run_global(schedule, *sets[0])
    placed = [place_global(schedule, x, w)[0] for x, w in sets]
    cases.append((f, placed, [test_util.reference_np(x, w) for x, w in sets]))
  pick = lambda i: (cases[i % 2], (i // 2) % 3)
  outs = []
  for i in range(200):
    (f, placed, _), j = pick(i)
    outs.append(f(*placed[j]))
  for i, out in enumerate(outs):
    (_, _, refs), j = pick(i)
    test.assertLess(test_util.rel_err(out, refs[j]), 1e-2, f"call {i}")


def check_timeout_and_recovery(test, schedule, seed, *, fault_kind=0,
                               message="timed out on GPU.*stage 1"):
  """Device 1 misbehaves (fault_kind 0: never delivers, no push, no signal; 1: never marks its
  own pushes done): the call fails within 30 s with `message`, and after jax_distgemm.runtime.reset()
  the same call is correct again."""
  module = ffi_modules.module_for("cuda")
  x, w, _ = test_util.random_inputs(seed, (512, 512), (512, 1024), jnp.bfloat16)
  f, args = run_global(schedule, x, w, timeout_ms=500)
  jax.block_until_ready(f(*args))
  module.set_sync_check(True)
  module.set_fault_device(GPUS[1].local_hardware_id, fault_kind)
  try:
    t0 = time.perf_counter()
    with test.assertRaisesRegex(Exception, message):
      jax.block_until_ready(f(*args))
    test.assertLess(time.perf_counter() - t0, 30)
  finally:
    module.set_fault_device(-1)
    module.set_sync_check(False)
  jd.runtime.reset()
  test.assertIsNone(jd.runtime.pending_error())
  test.assertLess(test_util.rel_err(f(*args), test_util.reference_np(x, w)), 1e-2)


class CudaRemoteCTest(parameterized.TestCase):
  """ReduceScatter remote_c (the automatic path where the stage k > 2048, unless the gather path
  moves no more bytes; asked for by name here): one launch per stage, whose epilogue reads the
  left neighbour's running sum over NVLink as C."""

  def setUp(self):
    super().setUp()
    self.enter_context(test_util.rs_env({"JAX_DISTGEMM_RS_PATH": "remote_c"}))

  @parameterized.product(
      schedule=[Schedule.ReduceScatter1D_TilingA_RotatingC,
                Schedule.ReduceScatter1D_TilingB_RotatingC],
      shape=["square", "ragged", "tall"])
  def test_matches_reference(self, schedule, shape):
    m, k, n = SHAPES[shape]
    # A shape per case, so that each case tunes (and so lists) its launches.
    m += 16 * TP * (8 + (schedule == Schedule.ReduceScatter1D_TilingB_RotatingC))
    x, w, _ = test_util.random_inputs(test_util.seed_of(schedule, "remote_c", shape), (m, k),
                                      (k, n), jnp.bfloat16)
    tuned = tuned_lines_of_three_calls(self, schedule, x, w)
    self.assertEqual(rs_paths(), sorted((d.local_hardware_id, "remote_c") for d in GPUS[:TP]),
                     tuned)

  def test_back_to_back_calls_alternating_shapes(self):
    check_alternating_calls(self, [(768, 512, 1024), (512, 1024, 384)], seed=30)

  def test_missing_peer_signal_times_out_and_recovers(self):
    # Device 1's stage 1 launch never signals that its stage 0 is done.
    check_timeout_and_recovery(self, Schedule.ReduceScatter1D_TilingA_RotatingC, 41)


class CudaCopyRingTest(parameterized.TestCase):
  """ReduceScatter copy_ring (the automatic path where the stage k <= 2048, unless the gather
  path moves no more bytes; asked for by name here): each stage runs in row chunks, and the
  copy stream pushes each chunk's running sum to the right neighbour while the next chunks
  compute."""

  def setUp(self):
    super().setUp()
    self.enter_context(test_util.rs_env({"JAX_DISTGEMM_RS_PATH": "copy_ring"}))

  # Rows of the running sum per device: 1024 splits into two equal chunks, 640 into 384 + 256.
  ROWS = {"even": 1024, "uneven": 640}

  @parameterized.product(
      schedule=[Schedule.ReduceScatter1D_TilingA_RotatingC,
                Schedule.ReduceScatter1D_TilingB_RotatingC],
      rows=["even", "uneven"])
  def test_chunk_launches_match_reference(self, schedule, rows):
    sm = self.ROWS[rows]
    tiling_a = schedule == Schedule.ReduceScatter1D_TilingA_RotatingC
    m = sm * TP if tiling_a else sm
    k = 512  # stage k 256 (TilingA) / 512
    # A shape per case, so that each case tunes (and so lists) its own launches.
    n = 512 + 32 * (2 * (not tiling_a) + (rows == "uneven"))
    x, w, _ = test_util.random_inputs(test_util.seed_of(schedule, "copy_ring", rows), (m, k),
                                      (k, n), jnp.bfloat16)
    tuned = tuned_lines_of_three_calls(self, schedule, x, w)
    self.assertEqual(rs_paths(), sorted((d.local_hardware_id, "copy_ring") for d in GPUS[:TP]),
                     tuned)

  def test_back_to_back_calls_alternating_shapes(self):
    check_alternating_calls(self, [(1024, 512, 1024), (512, 1024, 384)], seed=50)

  def test_missing_peer_push_times_out_and_recovers(self):
    # 512 x 512 @ 512 x 1024: stage k 256, two chunks of 128 rows; device 1 never pushes.
    check_timeout_and_recovery(self, Schedule.ReduceScatter1D_TilingA_RotatingC, 43)


class CudaRsGatherTest(parameterized.TestCase):
  """ReduceScatter TilingA by gathering operands (JAX_DISTGEMM_RS_PATH=gather, or the automatic
  path where it moves no more bytes than the ring): each device pushes its peers the x rows and
  the w shard they need at the call's start and sums its own rows over every K shard; no
  running sum travels (reduce_scatter.cc, EnqueueRsGather).  Where it does not apply (TilingB,
  batches) the automatic path runs."""

  def setUp(self):
    super().setUp()
    self.enter_context(test_util.rs_env({}))

  def paths(self):
    return rs_paths()

  @parameterized.product(shape=list(SHAPES), with_c=[False, True])
  def test_matches_reference(self, shape, with_c):
    os.environ["JAX_DISTGEMM_RS_PATH"] = "gather"
    schedule = Schedule.ReduceScatter1D_TilingA_RotatingC
    m, k, n = SHAPES[shape]
    m += 16 * TP * (3 + with_c)  # a shape of its own: it tunes in the call
    x, w, _ = test_util.random_inputs(test_util.seed_of("gather", shape, with_c), (m, k), (k, n),
                                      jnp.bfloat16)
    c = None
    if with_c:
      c = jax.random.normal(jax.random.key(m), (m, n), jnp.float32).astype(jnp.bfloat16)
    alpha, beta = (0.5, -0.75) if with_c else (1.0, 0.0)
    tuned = tuned_lines_of_three_calls(self, schedule, x, w, c, alpha=alpha, beta=beta)
    self.assertEqual(self.paths(), [(o, "gather") for o in
                                    sorted(d.local_hardware_id for d in GPUS[:TP])], tuned)

  def test_automatic_where_it_moves_no_more_bytes(self):
    # Unset JAX_DISTGEMM_RS_PATH: gather where sk (sm + sn) <= sm sn (workspace.h), else the ring.
    # Stages: (sm, sk, sn) = (512, 256, 1024): 393216 <= 524288, gather; (256, 512, 512):
    # 524288 > 131072, copy ring (sk <= 2048).
    schedule = Schedule.ReduceScatter1D_TilingA_RotatingC
    for (m, k, n), want in (((1024, 512, 1024), "gather"), ((512, 1024, 512), "copy_ring")):
      x, w, _ = test_util.random_inputs(m + k + n, (m, k), (k, n), jnp.bfloat16)
      f, args = run_global(schedule, x, w)
      self.assertLess(test_util.rel_err(f(*args), test_util.reference_np(x, w)), 1e-2)
      self.assertEqual(self.paths(), [(o, want) for o in
                                      sorted(d.local_hardware_id for d in GPUS[:TP])])

  def test_falls_back_where_it_does_not_apply(self):
    os.environ["JAX_DISTGEMM_RS_PATH"] = "gather"
    x, w, _ = test_util.random_inputs(61, (560, 512), (512, 1040), jnp.bfloat16)  # own shape
    tuned_lines_of_three_calls(self, Schedule.ReduceScatter1D_TilingB_RotatingC, x, w)
    self.assertNotIn("gather", [path for _, path in self.paths()])

  def test_back_to_back_calls_alternating_shapes(self):
    os.environ["JAX_DISTGEMM_RS_PATH"] = "gather"
    check_alternating_calls(self, [(768, 512, 1024), (512, 1024, 384)], seed=62)

  def test_alternating_with_the_ring_path(self):
    # Calls of the two paths interleave: slots and flags of consecutive calls sit in different
    # parity halves whichever path each took.  The path is fixed when a call is lowered, so
    # each path has its own function.
    schedule = Schedule.ReduceScatter1D_TilingA_RotatingC
    x, w, _ = test_util.random_inputs(63, (1024, 512), (512, 768), jnp.bfloat16)
    ref = test_util.reference_np(x, w)
    fns = {}
    for path in ("copy_ring", "gather"):
      os.environ["JAX_DISTGEMM_RS_PATH"] = path
      f, args = run_global(schedule, x, w)
      jax.block_until_ready(f(*args))  # lowered (and so fixed to `path`) here
      fns[path] = f
    for i in range(6):
      want = "gather" if i % 2 else "copy_ring"
      os.environ["JAX_DISTGEMM_RS_PATH"] = want
      self.assertLess(test_util.rel_err(fns[want](*args), ref), 1e-2, f"call {i}")
      self.assertEqual(self.paths(), sorted((d.local_hardware_id, want) for d in GPUS[:TP]), i)

  def test_missing_peer_push_times_out_and_recovers(self):
    os.environ["JAX_DISTGEMM_RS_PATH"] = "gather"  # device 1 never pushes its operands
    check_timeout_and_recovery(self, Schedule.ReduceScatter1D_TilingA_RotatingC, 64)


class CudaReliabilityTest(absltest.TestCase):

  def test_forced_timeout_reports_error_and_recovers(self):
    # Device 1 never pushes its shard.
    check_timeout_and_recovery(self, Schedule.AllGather1D_TilingCD_RotatingA, 5)

  def test_grid_join_timeout_names_own_copy_engine_and_recovers(self):
    # Device 1's pushes land, but its copy stream never marks them done: its fused grid's
    # join (CTA 0, before the grid exits) times out.
    check_timeout_and_recovery(self, Schedule.AllGather1D_TilingCD_RotatingA, 6, fault_kind=1,
                               message="timed out on GPU.*own copy engine")

  def test_memory_stable_over_2000_calls_5_shapes(self):
    module = ffi_modules.module_for("cuda")
    shapes = [(256, 256, 512), (512, 256, 256), (384, 512, 768), (1024, 128, 256),
              (256, 1024, 1024)]
    fns = []
    for i, (m, k, n) in enumerate(shapes):
      schedule = list(Schedule)[i % 4]
      x, w, _ = test_util.random_inputs(i, (m, k), (k, n), jnp.bfloat16)
      fns.append(run_global(schedule, x, w))
    for f, args in fns:  # warm up: compile, tune, grow the workspace to its maximum
      jax.block_until_ready(f(*args))

    def used():
      return [module.mem_get_info(g.local_hardware_id)[1] -
              module.mem_get_info(g.local_hardware_id)[0] for g in GPUS[:TP]]

    before = used()
    for i in range(2000):
      f, args = fns[i % len(fns)]
      out = f(*args)
    jax.block_until_ready(out)
    after = used()
    for b, a in zip(before, after):
      self.assertLessEqual(a - b, 8 << 20, f"device memory grew by {(a - b) >> 20} MiB")
    print(f"device memory in use before/after 2000 calls: {before} / {after}")


if __name__ == "__main__":
  absltest.main()

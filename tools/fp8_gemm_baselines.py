"""Baselines for the fp8 stage GEMMs, and the summary of tools/fp8_gemm_check.sh.

Not a test module (pytest collects *_test.py only); run on the GPU machine by
tools/fp8_gemm_check.sh:

  python tools/fp8_gemm_baselines.py bench --shapes MxKxN,... --jsonl OUT.jsonl
  python tools/fp8_gemm_baselines.py summary --check CHECK.jsonl --baselines OUT.jsonl

bench, in one process on GPU 0, at each stage shape (M x K x N):
  * torch._scaled_mm (cuBLASLt) with per-tensor scales: e4m3 x e4m3 with fp32 accumulation
    (use_fast_accum=False) to bf16 and to fp32, with fast accumulation to bf16, and e5m2 x e4m3
    (fp32 accumulation, bf16); its error against float64 of the dequantized operands on a sample
    of rows and columns (the check program's measure);
  * torch._scaled_mm with DeepSeek-V3 block scales (1x128 for A, 128x128 for B), where this
    torch and cuBLASLt take them (best effort: layouts tried in turn, the error tells);
  * torch.matmul in bf16 (the bf16 baseline of the block-scaling target);
  * jax.lax.dot_general on float8_e4m3fn operands with preferred_element_type=bfloat16, jitted,
    and XLA's fp8 pattern (dequantize in bf16, then dot), each with the custom call that XLA
    compiled it to.
Operands are a quantizer's (N(0, 1) values, scale = amax / fp8 max), rotated over enough sets to
exceed 2x the L2; times are medians of --repeats launches between CUDA events (torch) or of
batches of back-to-back launches timed by the host (JAX: no events; each batch ends in one
block_until_ready).  One JSON line per measurement.

summary joins these lines with the check program's (fp8_gemm_check --jsonl) and prints, per
shape, TFLOP/s and the issue's targets: per-tensor >= 0.95x cuBLASLt with fp32 accumulation,
block >= 0.85x our per-tensor and >= 1.6x bf16, per-tensor error <= 1.25x cuBLASLt's.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

DEFAULT_SHAPES = ("4096x8192x14336,2048x8192x4096,6144x6144x12288,4096x4096x28672,"
                  "8192x16384x8192,8192x16384x53248")
SEED_SHAPE = (8192, 16384, 53248)


def parse_shapes(text):
  shapes = []
  for item in text.split(","):
    m, k, n = (int(v) for v in item.lower().split("x"))
    shapes.append((m, k, n))
  return shapes


def sample_indices(total, count, gen):
  """All of 0..total-1, or a sorted sample with the first and the last (as the check program)."""
  import torch  # pylint: disable=import-outside-toplevel
  if total <= count:
    return torch.arange(total, device="cuda")
  idx = torch.randint(1, total - 1, (count - 2,), generator=gen, device="cuda")
  idx = torch.cat([torch.tensor([0, total - 1], device="cuda"), idx])
  return torch.unique(idx)


def emit(out, record):
  line = json.dumps(record)
  print(line, flush=True)
  out.write(line + "\n")
  out.flush()


# -- torch -----------------------------------------------------------------------------------------


def torch_bench(args, out):
  import torch  # pylint: disable=import-outside-toplevel

  dev = torch.device("cuda", 0)
  props = torch.cuda.get_device_properties(dev)
  l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
  print(f"torch {torch.__version__} on {props.name}, L2 {l2 >> 20} MB", flush=True)
  gen = torch.Generator(device=dev)
  gen.manual_seed(args.seed)
  e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
  scaled_mm = torch._scaled_mm  # pylint: disable=protected-access

  def quantize(x, dtype):
    fmax = torch.finfo(dtype).max
    scale = (x.abs().amax().float() / fmax).clamp(min=1e-30)
    return (x / scale).clamp(-fmax, fmax).to(dtype), scale

  def median_ms(fn, sets):
    for i in range(args.warmup):
      fn(i % sets)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(args.repeats + 1)]
    ev[0].record()
    for i in range(args.repeats):
      fn(i % sets)
      ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(args.repeats))

  def n_sets(set_bytes):
    return 1 if set_bytes <= 0 else min(16, (2 * l2) // set_bytes + 1)

  def rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()

  def dequant_rows(q, rows, scale):
    """float64 rows of an fp8 matrix times its scale(s) (indexing through uint8)."""
    return q.view(torch.uint8)[rows].view(q.dtype).double() * scale

  for (m, k, n) in args.shapes:
    flops = 2.0 * m * n * k
    base = {"m": m, "k": k, "n": n}
    # Per-tensor operands.  B is made as B^T [N, K] (K-major): _scaled_mm's b is its .t().
    for a_dtype, label in ((e4m3, "e4m3xe4m3"), (e5m2, "e5m2xe4m3")):
      sets = n_sets(m * k + n * k + m * n * 4)
      try:
        ops = []
        for _ in range(sets):
          a, sa = quantize(torch.randn(m, k, device=dev, generator=gen), a_dtype)
          bt, sb = quantize(torch.randn(n, k, device=dev, generator=gen), e4m3)
          ops.append((a, sa, bt, sb))
        a, sa, bt, sb = ops[0]
        rows = sample_indices(m, args.sample, gen)
        cols = sample_indices(n, args.sample, gen)
        ref = dequant_rows(a, rows, sa.double()) @ dequant_rows(bt, cols, sb.double()).t()
        variants = [("fp32", False, torch.bfloat16), ("fast", True, torch.bfloat16),
                    ("fp32", False, torch.float32)]
        if a_dtype == e5m2:
          variants = [("fp32", False, torch.bfloat16)]
        for accum, fast, out_dtype in variants:
          rec = dict(base, impl="torch_scaled_mm", scaling="tensor", types=label, accum=accum,
                     out="bf16" if out_dtype == torch.bfloat16 else "f32", sets=sets)
          try:
            def run(i, fast=fast, out_dtype=out_dtype):
              a_, sa_, bt_, sb_ = ops[i]
              return scaled_mm(a_, bt_.t(), scale_a=sa_, scale_b=sb_, out_dtype=out_dtype,
                               use_fast_accum=fast)
            got = run(0)[rows][:, cols]
            rec["err"] = rel_err(got, ref)
            ms = median_ms(run, sets)
            rec.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
          except Exception as e:  # pylint: disable=broad-except
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
          emit(out, rec)
        del ops, a, bt, ref
      except Exception as e:  # pylint: disable=broad-except
        emit(out, dict(base, impl="torch_scaled_mm", scaling="tensor", types=label,
                       error=f"{type(e).__name__}: {e}"[:300]))
      torch.cuda.empty_cache()

    # Block scales (best effort): A per row and 128 of K, B per 128x128 block.
    rec = dict(base, impl="torch_scaled_mm", scaling="block", types="e4m3xe4m3", accum="fp32",
               out="bf16")
    try:
      kb, nb = -(-k // 128), -(-n // 128)
      fmax = torch.finfo(e4m3).max
      x = torch.randn(m, kb * 128, device=dev, generator=gen)
      x[:, k:] = 0
      sfa = (x.view(m, kb, 128).abs().amax(-1) / fmax).clamp(min=1e-30)  # [M, kb]
      a = (x.view(m, kb, 128) / sfa[..., None]).view(m, kb * 128)[:, :k].to(e4m3).contiguous()
      w = torch.randn(nb * 128, kb * 128, device=dev, generator=gen)  # B^T, [N, K]
      w[n:] = 0
      w[:, k:] = 0
      sfb = (w.view(nb, 128, kb, 128).abs().amax((1, 3)) / fmax).clamp(min=1e-30)  # [nb, kb]
      bt = (w.view(nb, 128, kb, 128) / sfb[:, None, :, None]).view(nb * 128, kb * 128)
      bt = bt[:n, :k].to(e4m3).contiguous()
      del x, w
      rows = sample_indices(m, args.sample, gen)
      cols = sample_indices(n, args.sample, gen)
      sa_rows = sfa[rows].double().repeat_interleave(128, dim=1)[:, :k]
      sb_cols = sfb[cols // 128].double().repeat_interleave(128, dim=1)[:, :k]
      ref = dequant_rows(a, rows, sa_rows) @ dequant_rows(bt, cols, sb_cols).t()
      # Candidate scale layouts: [M, kb] and [kb, nb] (the API's), each also stored transposed
      # ("outer-dim-major"), as torch versions have asked for either.
      sfb_kn = sfb.t().contiguous()  # [kb, nb]
      candidates = [("sfa[M,kb] sfb[kb,nb]", sfa.contiguous(), sfb_kn),
                    ("sfa[M,kb]^T sfb[kb,nb]^T", sfa.t().contiguous().t(),
                     sfb_kn.t().contiguous().t()),
                    ("sfa[M,kb]^T sfb[kb,nb]", sfa.t().contiguous().t(), sfb_kn),
                    ("sfa[M,kb] sfb[nb,kb]", sfa.contiguous(), sfb.contiguous())]
      errors = []
      for name, s_a, s_b in candidates:
        try:
          def run(_, s_a=s_a, s_b=s_b):
            return scaled_mm(a, bt.t(), scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16)
          got = run(0)[rows][:, cols]
          rec.update(layout=name, err=rel_err(got, ref))
          ms = median_ms(run, 1)  # one set: the time is a pointer, not a target
          rec.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, sets=1)
          break
        except Exception as e:  # pylint: disable=broad-except
          errors.append(f"{name}: {type(e).__name__}: {e}"[:200])
      else:
        rec["error"] = " | ".join(errors)
      del a, bt
    except Exception as e:  # pylint: disable=broad-except
      rec["error"] = f"{type(e).__name__}: {e}"[:300]
    emit(out, rec)
    torch.cuda.empty_cache()

    # bf16 baseline.
    rec = dict(base, impl="torch_matmul", scaling="none", types="bf16xbf16", out="bf16")
    try:
      sets = n_sets(2 * (m * k + k * n + m * n))
      ops = [(torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16),
              torch.randn(k, n, device=dev, generator=gen, dtype=torch.bfloat16))
             for _ in range(sets)]
      ms = median_ms(lambda i: torch.matmul(*ops[i]), sets)
      rec.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, sets=sets)
      del ops
    except Exception as e:  # pylint: disable=broad-except
      rec["error"] = f"{type(e).__name__}: {e}"[:300]
    emit(out, rec)
    torch.cuda.empty_cache()


# -- JAX -------------------------------------------------------------------------------------------


def jax_bench(args, out):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  dev = jax.devices()[0]
  print(f"jax {jax.__version__} on {dev.platform} {dev.device_kind}", flush=True)
  if dev.platform != "gpu" and not args.allow_cpu:
    emit(out, {"impl": "jax_fp8_dot", "error": f"JAX has no GPU (platform {dev.platform})"})
    return
  l2 = 50 << 20
  dims = (((1,), (0,)), ((), ()))

  @jax.jit
  def fp8_dot(a, b):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16)

  @jax.jit
  def fp8_scaled(a, b, sa, sb):
    # XLA's fp8 GEMM pattern: dequantize (convert, multiply by the scale), then dot.
    da = a.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
    db = b.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
    return jax.lax.dot_general(da, db, dims, preferred_element_type=jnp.bfloat16)

  def quantize(key, shape, dtype):
    x = jax.random.normal(key, shape, jnp.float32)
    fmax = float(jnp.finfo(dtype).max)
    scale = jnp.max(jnp.abs(x)) / fmax
    return (x / scale).astype(dtype), scale

  def gemm_target(compiled_text):
    for needle, name in (("__cublas$lt$matmul$f8", "cublasLt fp8"),
                         ("__cublas$lt$matmul", "cublasLt"), ("__cublas$gemm", "cublas gemm"),
                         ("__triton", "triton"), ("cudnn", "cudnn")):
      if needle in compiled_text:
        return name
    return "other"

  def host_median_ms(fn, sets, batch=5):
    for i in range(args.warmup):
      fn(i % sets).block_until_ready()
    times = []
    rounds = max(3, args.repeats // batch)
    for r in range(rounds):
      t0 = time.perf_counter()
      res = None
      for i in range(batch):
        res = fn((r * batch + i) % sets)
      res.block_until_ready()
      times.append((time.perf_counter() - t0) * 1e3 / batch)
    return statistics.median(times)

  key = jax.random.PRNGKey(args.seed)
  for (m, k, n) in args.shapes:
    flops = 2.0 * m * n * k
    sets = min(16, (2 * l2) // (m * k + k * n + m * n * 2) + 1)
    for impl in ("jax_fp8_dot", "jax_fp8_scaled_dot"):
      rec = {"m": m, "k": k, "n": n, "impl": impl, "scaling": "tensor", "types": "e4m3xe4m3",
             "out": "bf16", "sets": sets}
      try:
        ops = []
        for _ in range(sets):
          key, ka, kb_ = jax.random.split(key, 3)
          a, sa = quantize(ka, (m, k), jnp.float8_e4m3fn)
          b, sb = quantize(kb_, (k, n), jnp.float8_e4m3fn)
          ops.append((a, b, sa, sb))
        if impl == "jax_fp8_dot":
          run = lambda i: fp8_dot(ops[i][0], ops[i][1])  # pylint: disable=cell-var-from-loop
          rec["hlo_gemm"] = gemm_target(fp8_dot.lower(ops[0][0], ops[0][1]).compile().as_text())
          scale = ops[0][2] * ops[0][3]  # the dot of the raw fp8 values misses the scales
        else:
          run = lambda i: fp8_scaled(*ops[i])  # pylint: disable=cell-var-from-loop
          rec["hlo_gemm"] = gemm_target(fp8_scaled.lower(*ops[0]).compile().as_text())
          scale = 1.0
        # Error on a sample of rows and columns, against float64 of the dequantized operands.
        rng = np.random.default_rng(args.seed)
        rows = np.unique(np.concatenate([[0, m - 1], rng.integers(0, m, min(m, args.sample))]))
        cols = np.unique(np.concatenate([[0, n - 1], rng.integers(0, n, min(n, args.sample))]))
        a, b, sa, sb = ops[0]
        a64 = np.asarray(a[rows].astype(jnp.float32), np.float64) * float(sa)
        b64 = np.asarray(b[:, cols].astype(jnp.float32), np.float64) * float(sb)
        ref = a64 @ b64
        got = np.asarray(run(0)[rows][:, cols].astype(jnp.float32), np.float64) * float(scale)
        rec["err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        ms = host_median_ms(run, sets)
        rec.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        del ops
      except Exception as e:  # pylint: disable=broad-except
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
      emit(out, rec)


def bench(args):
  """Returns 0 if anything was timed, else 1."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  with open(args.jsonl, "w") as out:
    if "torch" in args.only:
      try:
        torch_bench(args, out)
      except Exception:  # pylint: disable=broad-except
        traceback.print_exc()
      try:
        import torch  # pylint: disable=import-outside-toplevel
        torch.cuda.empty_cache()
      except Exception:  # pylint: disable=broad-except
        pass
    if "jax" in args.only:
      try:
        jax_bench(args, out)
      except Exception:  # pylint: disable=broad-except
        traceback.print_exc()
  return 0 if any(r.get("tflops") for r in load_jsonl(args.jsonl)) else 1


# -- Summary ---------------------------------------------------------------------------------------


def load_jsonl(path):
  rows = []
  if path and os.path.exists(path):
    with open(path) as f:
      for line in f:
        line = line.strip()
        if line.startswith("{"):
          try:
            rows.append(json.loads(line))
          except json.JSONDecodeError:
            pass
  return rows


def summary(args):
  runs = [r for p in args.check for r in load_jsonl(p)]
  ours = [r for r in runs if not r.get("pdl")]  # the tables: launches without PDL
  base = load_jsonl(args.baselines)
  lines = []
  say = lines.append
  verdicts = []

  def best(rows):
    rows = [r for r in rows if r.get("tflops")]
    return max(rows, key=lambda r: r["tflops"]) if rows else None

  def launched(rows):
    """Of our rows, the executor's pick for the shape where the check program marks it."""
    return best([r for r in rows if r.get("picked")]) or best(rows)

  def pick(rows, **kw):
    return [r for r in rows if all(r.get(key) == v for key, v in kw.items())]

  def fmt(r, key="tflops"):
    return f"{r[key]:7.1f}" if r and r.get(key) is not None else "    n/a"

  def kernel(r):
    return f"cfg {r['config']}{' +C' if r.get('has_c') else ''}" if r else ""

  shapes = sorted({(r["m"], r["k"], r["n"]) for r in ours + base if "m" in r},
                  key=lambda s: (s[0] * s[1] * s[2], s))
  say("TFLOP/s (ours: the kernel the executor picks, launched without C; batch 1)")
  say(f"{'M x K x N':>20} | {'ours/t':>7} {'cuBLAS':>7} {'ratio':>6} {'fast':>7} {'jax':>7} "
      f"{'jaxsc':>7} | {'ours/b':>7} {'b/t':>5} {'bf16':>7} {'b/bf16':>6} {'cuBLASb':>7}")
  for (m, k, n) in shapes:
    shape = dict(m=m, k=k, n=n)
    o_t = launched(pick(ours, scaling="tensor", types="e4m3xe4m3", out="bf16", batch=1,
                        has_c=False, **shape))
    o_b = launched(pick(ours, scaling="block", types="e4m3xe4m3", out="bf16", batch=1,
                        has_c=False, **shape))
    cub = best(pick(base, impl="torch_scaled_mm", scaling="tensor", types="e4m3xe4m3",
                    accum="fp32", out="bf16", **shape))
    fast = best(pick(base, impl="torch_scaled_mm", scaling="tensor", types="e4m3xe4m3",
                     accum="fast", out="bf16", **shape))
    jx = best(pick(base, impl="jax_fp8_dot", **shape))
    jxs = best(pick(base, impl="jax_fp8_scaled_dot", **shape))
    bf = best(pick(base, impl="torch_matmul", **shape))
    cubb = best(pick(base, impl="torch_scaled_mm", scaling="block", **shape))
    ratio = o_t["tflops"] / cub["tflops"] if o_t and cub else None
    b_t = o_b["tflops"] / o_t["tflops"] if o_b and o_t else None
    b_bf = o_b["tflops"] / bf["tflops"] if o_b and bf else None
    say(f"{f'{m} x {k} x {n}':>20} | {fmt(o_t)} {fmt(cub)} "
        f"{(f'{ratio:6.3f}' if ratio else '   n/a')} {fmt(fast)} {fmt(jx)} {fmt(jxs)} | "
        f"{fmt(o_b)} {(f'{b_t:5.2f}' if b_t else '  n/a')} {fmt(bf)} "
        f"{(f'{b_bf:6.2f}' if b_bf else '   n/a')} {fmt(cubb)}"
        f"   [{kernel(o_t)}; {kernel(o_b)}]")
    if (m, k, n) != SEED_SHAPE and ratio is not None:
      verdicts.append((f"per-tensor >= 0.95x cuBLASLt at {m}x{k}x{n}", ratio >= 0.95,
                       f"{ratio:.3f}"))
    if (m, k, n) == SEED_SHAPE:
      if b_t is not None:
        verdicts.append((f"block >= 0.85x our per-tensor at {m}x{k}x{n}", b_t >= 0.85,
                         f"{b_t:.3f}"))
      if b_bf is not None:
        verdicts.append((f"block >= 1.6x bf16 at {m}x{k}x{n}", b_bf >= 1.6, f"{b_bf:.2f}"))
  say("")
  say("Relative Frobenius error vs float64 of the dequantized operands (sampled rows/columns)")
  say(f"{'M x K x N':>20} | {'out':>4} | {'ours/t':>9} {'cuBLAS':>9} {'ratio':>6} | "
      f"{'ours/b':>9} {'cuBLASb':>9} | {'e5m2 ours':>9} {'cuBLAS':>9} | {'jax':>9}")
  for (m, k, n) in shapes:
    shape = dict(m=m, k=k, n=n)
    for out in ("bf16", "f32"):
      def worst(rows):
        """The largest error of the rows (ours: with or without C), as its row's "err"."""
        rows = [dict(r, err=max(r["err"], r.get("err_c") or 0.0)) for r in rows
                if r.get("err") is not None]
        return max(rows, key=lambda r: r["err"]) if rows else None
      o_t = worst(pick(ours, scaling="tensor", types="e4m3xe4m3", out=out, batch=1, **shape))
      o_b = worst(pick(ours, scaling="block", out=out, batch=1, **shape))
      o_5 = worst(pick(ours, scaling="tensor", types="e5m2xe4m3", out=out, batch=1, **shape))
      cub = worst(pick(base, impl="torch_scaled_mm", scaling="tensor", types="e4m3xe4m3",
                       accum="fp32", out=out, **shape))
      cub5 = worst(pick(base, impl="torch_scaled_mm", scaling="tensor", types="e5m2xe4m3",
                        out=out, **shape))
      cubb = worst(pick(base, impl="torch_scaled_mm", scaling="block", out=out, **shape))
      jx = worst(pick(base, impl="jax_fp8_dot", out=out, **shape))
      if not any((o_t, o_b, cub)):
        continue
      def e(r):
        return f"{r['err']:9.3e}" if r else "      n/a"
      ratio = o_t["err"] / cub["err"] if o_t and cub and cub["err"] > 0 else None
      say(f"{f'{m} x {k} x {n}':>20} | {out:>4} | {e(o_t)} {e(cub)} "
          f"{(f'{ratio:6.3f}' if ratio else '   n/a')} | {e(o_b)} {e(cubb)} | {e(o_5)} "
          f"{e(cub5)} | {e(jx)}")
      if ratio is not None:
        verdicts.append((f"per-tensor error <= 1.25x cuBLASLt ({out}) at {m}x{k}x{n}",
                         ratio <= 1.25, f"{ratio:.3f}"))
      if o_b is not None and k <= 16384:
        limit = 3e-3 if out == "bf16" else 1e-3
        verdicts.append((f"block error <= {limit:g} ({out}) at {m}x{k}x{n}",
                         o_b["err"] <= limit, f"{o_b['err']:.3e}"))
  with_pdl = [r for r in runs if r.get("pdl") and r.get("tflops")]
  if with_pdl:
    say("")
    say("PDL on (the executor's default) against off, same kernel and shape")
    for r in with_pdl:
      off = pick(ours, scaling=r["scaling"], types=r["types"], out=r["out"], m=r["m"], k=r["k"],
                 n=r["n"], batch=r["batch"], config=r["config"], has_c=r["has_c"])
      off_t = off[0]["tflops"] if off and off[0].get("tflops") else None
      say(f"  {r['m']} x {r['k']} x {r['n']} {r['scaling']} {r['out']} {kernel(r)}: "
          f"{r['tflops']:.1f} TFLOP/s with PDL, {f'{off_t:.1f}' if off_t else 'n/a'} without")
  failed_checks = [r for r in runs if not r.get("ok")]
  say("")
  say(f"check program: {len(runs)} kernel runs, {len(failed_checks)} failed")
  for r in failed_checks:
    say(f"  FAILED: {json.dumps(r)}")
  say("")
  say("Targets:")
  for name, ok, value in verdicts:
    say(f"  {'MET ' if ok else 'MISS'} {name}: {value}")
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  b = sub.add_parser("bench")
  b.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES))
  b.add_argument("--jsonl", required=True)
  b.add_argument("--repeats", type=int, default=30)
  b.add_argument("--warmup", type=int, default=5)
  b.add_argument("--sample", type=int, default=512)
  b.add_argument("--seed", type=int, default=1234)
  b.add_argument("--only", default="torch,jax", help="comma list: torch, jax")
  b.add_argument("--allow-cpu", action="store_true", help="run the JAX part on CPU (smoke test)")
  s = sub.add_parser("summary")
  s.add_argument("--check", nargs="+", default=[])
  s.add_argument("--baselines", default="")
  s.add_argument("--out", default="")
  args = parser.parse_args()
  if args.cmd == "bench":
    return bench(args)
  summary(args)
  return 0


if __name__ == "__main__":
  sys.exit(main())

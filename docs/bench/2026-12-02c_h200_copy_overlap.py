# Twenty-third session, one H200 (performance.md Y2): what the gathered operand's local copies
# cost the GEMM they run under.  The ReduceScatter backward's dual AllGather now also copies
# AG(d out), M x N bf16, slot by slot into its second result on the copy stream (HBM to HBM, copy
# engine) while its stages compute.  Here: the dual's whole per-device GEMM at TP=2,
# [M, N] @ [N, K/2] for each suite shape (M, K, N), timed alone and with a D2D copy of M x N
# bf16 on a second stream started with it (torch, cuBLAS; CUDA events on the GEMM's stream;
# median of 20 after 5 warm-ups; fresh normal data).  Writes copy_overlap.json to $OUT.
import json, os, statistics
import torch

SUITE = [(8192, 8192, 28672), (4096, 8192, 8192), (16384, 16384, 106496), (8192, 4096, 4096),
         (2048, 8192, 8192)]
dev = torch.device("cuda")
compute, copy = torch.cuda.Stream(), torch.cuda.Stream()
rows = []


def timed(fn, stream, reps=20, warmup=5):
  times = []
  for i in range(warmup + reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
      start.record()
    fn()
    with torch.cuda.stream(stream):
      end.record()
    torch.cuda.synchronize()
    if i >= warmup:
      times.append(start.elapsed_time(end))
  return statistics.median(times)


for m, k, n in SUITE:
  a = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
  b = torch.randn(n, k // 2, device=dev, dtype=torch.bfloat16) / n ** 0.5
  out = torch.empty(m, k // 2, device=dev, dtype=torch.bfloat16)
  src = torch.randn(m * n, device=dev, dtype=torch.bfloat16)
  dst = torch.empty_like(src)

  def gemm():
    with torch.cuda.stream(compute):
      torch.matmul(a, b, out=out)

  def copy_only():
    with torch.cuda.stream(copy):
      dst.copy_(src, non_blocking=True)

  def both():
    with torch.cuda.stream(copy):
      dst.copy_(src, non_blocking=True)
    gemm()

  alone = timed(gemm, compute)
  under = timed(both, compute)
  cp = timed(copy_only, copy)
  torch.cuda.synchronize()
  rows.append({"m": m, "k": k, "n": n, "gemm": [m, n, k // 2], "copy_mb": 2 * m * n / 2**20,
               "gemm_ms": alone, "gemm_with_copy_ms": under, "copy_alone_ms": cp,
               "slowdown": under / alone - 1.0,
               "copy_gbps": 2 * 2 * m * n / cp / 1e6})  # read + write
  print(json.dumps(rows[-1]))
  del a, b, out, src, dst
  torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(os.environ.get("OUT", "."), "copy_overlap.json"), "w"), indent=1)

// Shared by the standalone CUTLASS probes (tools/*_probe.cu), not part of the package: the
// arguments of a row-major bf16 GEMM, a sustained timing turn, and normal bf16 operands.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/tile_scheduler_detail.hpp"

namespace probe {

using T = cutlass::bfloat16_t;

// D [m, n] = A [m, k] B [k, n], all row-major, alpha 1, no C; raster 1 = along M, 2 = along N.
template <class Kernel>
typename Kernel::Arguments GemmArguments(int m, int n, int k, const T* a, const T* b, T* d,
                                         int raster) {
  using cute::Int;
  using cute::make_stride;
  typename Kernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};
  args.mainloop = {a, make_stride(int64_t(k), Int<1>{}, int64_t(0)), b,
                   make_stride(Int<1>{}, int64_t(n), int64_t(0))};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.dC = make_stride(int64_t(n), Int<1>{}, int64_t(0));
  args.epilogue.ptr_D = d;
  args.epilogue.dD = make_stride(int64_t(n), Int<1>{}, int64_t(0));
  cudaDeviceGetAttribute(&args.hw_info.sm_count, cudaDevAttrMultiProcessorCount, 0);
  using RO = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order = raster == 1 ? RO::AlongM : RO::AlongN;
  args.scheduler.max_swizzle_size = 1;
  return args;
}

// One turn as our tuner times it: `heat` untimed launches, then the mean of `timed` ones (ms).
template <class R>
float Turn(R& r, int heat, int timed, cudaEvent_t e0, cudaEvent_t e1) {
  for (int i = 0; i < heat; ++i) r.Run(0);
  cudaEventRecord(e0);
  for (int i = 0; i < timed; ++i) r.Run(0);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  return ms / timed;
}

// NOTE: power at the cap depends on the operands' bits, so the probes draw normal values, as
// the benchmark does (a low-entropy pattern once read 738 TFLOP/s where these read 660).
// Fills b, then a (from a shuffled copy of the same 4M values), both with normal bf16.
inline void FillNormal(T* a, size_t na, T* b, size_t nb) {
  std::vector<uint16_t> h(1 << 22);
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : h) {
    float f = nd(rng);
    uint32_t u;
    memcpy(&u, &f, 4);
    v = uint16_t(u >> 16);
  }
  for (size_t off = 0; off < nb; off += h.size())
    cudaMemcpy(b + off, h.data(), std::min(h.size(), nb - off) * 2, cudaMemcpyHostToDevice);
  std::shuffle(h.begin(), h.end(), rng);
  for (size_t off = 0; off < na; off += h.size())
    cudaMemcpy(a + off, h.data(), std::min(h.size(), na - off) * 2, cudaMemcpyHostToDevice);
}

inline float Bf16ToFloat(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

}  // namespace probe

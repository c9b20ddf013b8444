// Host interface of the CUTLASS SM90 fp8 stage GEMMs (no CUTLASS or device code here).
//
// One stage computes, for l < batch:
//   per-tensor scaling:  D[l] = alpha * (sa * sb) * (A[l] @ B[l]) + beta * C[l]
//   block scaling:       D[l, m, n] = alpha * sum_kb sfa[l, m, kb] * sfb[l, n / 128, kb]
//                                     * (A[l] @ B[l])_kb[m, n] + beta * C[l, m, n]
// where sa, sb are fp32 scalars in device memory (read by the kernel, never by the host) and
// (.)_kb is the product over the 128-wide K block kb (the DeepSeek-V3 recipe: activations
// scaled per row and 128 of K, weights per 128x128 block).  Accumulation is fp32 with
// promotion: the tensor cores' partial sums go to fp32 registers every 128 of K, with either
// scaling, never fp8 "fast accumulation" over all of K.
//
// Layouts (fp8 wgmma reads both operands K-major):
//   A   = x      [batch, M, K]  row-major, lda >= K, batch stride any
//   B^T = w^T    [batch, N, K]  row-major, ldb >= K, batch stride 0 allowed (one weight for the
//                               batch): the API's w [K, N] stored column-major.
//   C, D         [batch, M, N]  row-major, ldc, ldd >= N (a stage may write a column block of a
//                               wider output, D a sub-block through a pointer offset)
//   sfa (block)  [batch, M, ceil(K/128)] fp32, row-major with ld_sfa >= ceil(K/128): one scale
//                               per row and 128-wide K block (the activation quantizer's layout)
//   sfb (block)  [batch, ceil(N/128), ceil(K/128)] fp32, row-major with ld_sfb: one scale per
//                               128x128 block of w, K-major like B^T: the API's [K/128, N/128]
//                               stored column-major.
// Every row pitch (lda, ldb, ldc, ldd in bytes) and base pointer must be 16-byte aligned.
//
// Before the GEMM body every CTA runs StageSync (stage_sync.h): the kernels are wrapped by
// StageKernel (sm90_gemm.cuh) like the bf16 stage GEMMs.
// NOTE: sa, sb, sfa and sfb are operands like A and B: they must be complete when the stage's
// wait ends (the kernel reads them after it), and with StageSync::overlap_previous the previous
// grid on the stream must not write them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cc/common/problem.h"
#include "cc/cuda/stage_sync.h"

namespace jax_distgemm::cuda {

enum class Fp8Type : int32_t { kE4M3 = 0, kE5M2 = 1 };  // float8_e4m3fn, float8_e5m2
enum class Fp8Scaling : int32_t { kTensor = 0, kBlock = 1 };

// Kernel configurations: two consumer warpgroups (Cooperative), CTA tile, K tile 128, cluster
// shape.  Not every config is compiled for every scaling (Fp8AvailableConfigs).
// NOTE: the fp32 promotion keeps extra accumulator sets in registers (N/2 per set and
// consumer thread for a 64 x N share), which is what bounds the tiles (sm90_fp8_gemm.cuh,
// "Config").
enum class Fp8Config : int32_t {
  kCoop128x128_C1x2 = 0,     // block only: CUTLASS's blockwise mainloop, A multicast over N
  kStagger128x192_C2x1 = 1,  // per-tensor only: 128x192, warpgroups half a K tile apart
                             // (sm90_fp8_staggered_mainloop.cuh), B multicast over M
  kSplit128x256_C2x1 = 2,    // 128x256, each warpgroup promotes in two halves
                             // (sm90_fp8_split_mainloop.cuh), B multicast over M; per tensor
                             // for launches with few tiles (Fp8PickConfig)
};
inline constexpr int kNumFp8Configs = 3;
const char* Fp8ConfigName(Fp8Config c);
// The CTA tile's N (its M is 128 for every config); sm90_fp8_gemm.cuh asserts it per config.
constexpr int Fp8ConfigTileN(Fp8Config c) {
  return c == Fp8Config::kStagger128x192_C2x1 ? 192
         : c == Fp8Config::kSplit128x256_C2x1 ? 256
                                              : 128;
}
const char* Fp8TypeName(Fp8Type t);
const char* Fp8ScalingName(Fp8Scaling s);

struct Fp8GemmOperands {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  const void* a = nullptr;  // fp8 [batch, M, K]
  int64_t lda = 0, batch_stride_a = 0;
  const void* b = nullptr;  // fp8 B^T [batch, N, K]
  int64_t ldb = 0, batch_stride_b = 0;
  const void* c = nullptr;  // D's type; nullptr: no source (beta ignored)
  int64_t ldc = 0, batch_stride_c = 0;
  void* d = nullptr;  // bf16 or fp32
  int64_t ldd = 0, batch_stride_d = 0;
  float alpha = 1.f, beta = 0.f;
  // Per-tensor scaling: one fp32 each, device memory.
  const float* scale_a = nullptr;
  const float* scale_b = nullptr;
  // Block scaling (elements, not bytes).
  const float* sfa = nullptr;
  int64_t ld_sfa = 0, batch_stride_sfa = 0;
  const float* sfb = nullptr;
  int64_t ld_sfb = 0, batch_stride_sfb = 0;
};

struct Fp8GemmLaunch {
  Fp8Scaling scaling = Fp8Scaling::kTensor;
  Fp8Config config = Fp8Config::kStagger128x192_C2x1;  // the first per-tensor config
  Fp8Type a_type = Fp8Type::kE4M3;
  Fp8Type b_type = Fp8Type::kE4M3;
  ElemType d_type = ElemType::kBF16;  // kBF16 or kF32; C, when present, has D's type
  Fp8GemmOperands ops;
  StageSync sync;
  int device = 0;
  int sm_count = 0;  // persistent grid size; 0: CUTLASS queries the device
  // Tile order (GemmLaunch's fields).  The defaults are the executor's: bands of clusters along
  // M, walked along N, so that the tiles in flight form a compact block whose A rows and B
  // columns are read from L2 more than once; the band is the config's (sm90_fp8_gemm.cuh).
  int max_swizzle = 0;  // 0: the config's
  int raster = 2;       // 0 heuristic, 1 along M, 2 along N
  bool pdl = true;   // programmatic dependent launch
  void* workspace = nullptr;  // Fp8GemmWorkspaceBytes
};

// One compiled kernel.  A kernel compiled with a source (has_c) also serves launches without C:
// it reads C only where beta != 0 (CUTLASS skips the loads), so those launches pass D as C.
struct Fp8GemmEntry {
  Fp8Scaling scaling;
  Fp8Config config;
  Fp8Type a_type, b_type;
  ElemType d_type;
  bool has_c;
  std::string (*launch)(const Fp8GemmLaunch&, cudaStream_t);
  size_t (*workspace_bytes)(const Fp8GemmLaunch&);
  std::string (*prepare)();
};

// Every compiled kernel, `*count` of them (for tools that time each one).
const Fp8GemmEntry* Fp8GemmEntries(int* count);

// The kernel that runs `launch` (the no-C kernel for a launch without C when compiled, else
// the one with C), or nullptr.
const Fp8GemmEntry* FindFp8Gemm(const Fp8GemmLaunch& launch);

// Configs compiled for (scaling, a_type, b_type, d_type) that serve a launch with C (has_c) or
// without, in default preference order.
int Fp8AvailableConfigs(Fp8Scaling scaling, Fp8Type a_type, Fp8Type b_type, ElemType d_type,
                        bool has_c, Fp8Config* out, int max);

// Of `configs` (Fp8AvailableConfigs' order for `scaling`), the one to run an m x n (x batch)
// launch on `sm_count` SMs: per tensor, 128x256 tiles where 128x192 ones would leave more of
// their last wave idle than their rate gains (a 2048 x 4096 stage: 176 clusters of 128x192
// tiles on 66 run 2.7 waves, of 128x256 1.9), else the first.
Fp8Config Fp8PickConfig(Fp8Scaling scaling, const Fp8Config* configs, int count, int64_t m,
                        int64_t n, int64_t batch, int sm_count);

// Checks shapes, pointers, alignment and scales; "" or an error naming the rule.
std::string CheckFp8Gemm(const Fp8GemmLaunch& launch);

// Enqueues one stage on `stream`.  Returns "" or an error message.
std::string LaunchFp8Gemm(const Fp8GemmLaunch& launch, cudaStream_t stream);

// Bytes of CUTLASS workspace the launch needs (0 for the persistent data-parallel scheduler).
size_t Fp8GemmWorkspaceBytes(const Fp8GemmLaunch& launch);

// Sets the dynamic shared-memory limit of every compiled fp8 kernel on the current device and
// so loads them (as PrepareGemmKernels: before any kernel that spins on a peer is launched).
std::string PrepareFp8GemmKernels();

}  // namespace jax_distgemm::cuda

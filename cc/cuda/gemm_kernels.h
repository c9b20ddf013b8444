// Host interface of the CUTLASS SM90 stage GEMMs (no CUTLASS or device code here).
//
// One "stage" is one local GEMM of a distributed schedule:
//   D[l, m, n] = alpha * sum_k A[l, m, k] B[l, k, n] + beta * C[l, m, n]
// with row-major A, B, C, D given by pointer + leading dim + batch stride (B's batch stride may
// be 0: a weight shared across the batch).  Before the GEMM body, every CTA runs StageSync:
// an optional signal to a peer's flag and an optional bounded wait on a local flag.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cc/common/problem.h"
#include "cc/cuda/stage_sync.h"

namespace jax_distgemm::cuda {

// Kernel configurations compiled in (cc/cuda/sm90_gemm_*.cu).  Names: mainloop schedule, CTA
// tile MxN (K tile 64), cluster shape.
enum class GemmConfig : int32_t {
  kCoop128x256_C2x1 = 0,  // Cooperative, 2 consumer warpgroups, 128x256 tile
  kCoop256x128_C1x2 = 1,  // Cooperative, 256x128 tile
  kPingpong128x128_C1x2 = 2,
  kPingpong128x128_C2x1 = 3,
  kCoop256x128_C2x1 = 4,  // Cooperative, 256x128 tile, B multicast (cuBLAS's 256x128 2x1)
  kCoop128x256_C1x2 = 5,  // Cooperative, 128x256 tile, A multicast
  kCoop128x256_C1x1 = 6,  // Cooperative, 128x256 tile, no cluster
  kCoop256x192_C1x1 = 7,  // Cooperative, 256x192 tile (192 accumulators per thread), no cluster
};
inline constexpr int kNumGemmConfigs = 8;
const char* GemmConfigName(GemmConfig c);

struct GemmOperands {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  const void* a = nullptr;
  int64_t lda = 0, batch_stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 0, batch_stride_b = 0;
  const void* c = nullptr;  // nullptr: no source (beta ignored)
  int64_t ldc = 0, batch_stride_c = 0;
  void* d = nullptr;
  int64_t ldd = 0, batch_stride_d = 0;
  float alpha = 1.f, beta = 0.f;
};

// A fused launch (FusedStageKernel, sm90_fused_gemm.cuh): the `count` stages of one AllGather
// call, one shape, in one persistent grid, stage s on its own operands.  Every CTA first
// publishes the pointers below into `table` (device memory: kMaxFusedStages entries each of A,
// B, C and D; the caller alternates two tables by call parity); the CUTLASS ptr-array kernel
// reads them from there.  A CTA's producer warp waits for *wait_flag[s] >= StageSync::wait_epoch
// before it loads stage s's first tile (nullptr: stage s needs no wait).
inline constexpr int kMaxFusedStages = 8;
// FusedStages::table: the A, B, C, D pointers of stage s at s, S + s, 2S + s, 3S + s.
inline constexpr int kFusedTableEntries = 4 * kMaxFusedStages;
struct FusedStages {
  int count = 0;  // 0: an ordinary stage launch (GemmOperands' pointers)
  const void* a[kMaxFusedStages] = {};
  const void* b[kMaxFusedStages] = {};
  const void* c[kMaxFusedStages] = {};  // all nullptr or none (GemmOperands::c says which)
  void* d[kMaxFusedStages] = {};
  const Epoch* wait_flag[kMaxFusedStages] = {};
  int32_t peer[kMaxFusedStages] = {};  // rank that signals wait_flag[s]
  // With a gathered result: a producer warp that has waited for wait_flag[s] + c (arrived or
  // timed out, or skipped after an earlier timeout) stores the epoch to seen_flag[s] + c
  // (peer_state.h SeenMark); nullptr: no marks.
  Epoch* seen_flag[kMaxFusedStages] = {};
  void** table = nullptr;  // kFusedTableEntries entries
  // CTA 0 waits, before it exits, for *exit_wait_flag >= wait_epoch (this device's copy engine
  // has finished pushing the shard the grid's caller may reuse), so that the main stream needs
  // no event join on the copy stream (all_gather.cc); nullptr: no wait.
  const Epoch* exit_wait_flag = nullptr;
  // The rotating shard arrives in `shard_chunks` chunks (flags wait_flag[s] + c) of
  // `shard_chunk_size` rows of A (shard_dim 0, RotatingA) or columns of B (1, RotatingB), the
  // last one up to `shard_extent`; a tile waits only for the chunk it reads.  1: one flag.
  int shard_chunks = 1;
  int shard_dim = 0;
  int64_t shard_chunk_size = 0, shard_extent = 0;
};

// An fp8 stage (ab_type fp8: GemmOperands' B is then B^T [N, K], K-major, as fp8 wgmma reads
// it; Problem::w_k_major): w's type and the fp32 scales of A and B, scalars (kTensor) or, for
// kBlock, scale matrices whose views (in elements, offset included) are Problem::AScaleView's
// and BScaleView's.  Launched by fp8_gemm.h's kernels (executor.cc, Launch).
struct Fp8Scales {
  Scaling scaling = Scaling::kNone;
  ElemType b_type = ElemType::kF8E4M3;
  const float* a = nullptr;
  MatrixView a_view;
  const float* b = nullptr;
  MatrixView b_view;
};

struct GemmLaunch {
  GemmConfig config = GemmConfig::kCoop128x256_C2x1;
  ElemType ab_type = ElemType::kBF16;  // A's (and, but for fp8, B's) type
  ElemType d_type = ElemType::kBF16;  // C, when present, has D's type
  Fp8Scales fp8;
  GemmOperands ops;  // shape, leading dims, alpha/beta; pointers unless fused.count > 0
  StageSync sync;
  FusedStages fused;
  int device = 0;
  int sm_count = 0;
  int max_swizzle = 1;
  // Persistent tile scheduler rasterization: 0 = CUTLASS heuristic (along the shorter of the
  // tile grid's M and N), 1 = along M (consecutive tiles walk down M, sharing a B column
  // panel), 2 = along N (sharing an A row panel).
  int raster = 0;
  bool pdl = true;  // programmatic dependent launch: overlap with the previous kernel's tail
  void* workspace = nullptr;  // CUTLASS kernel workspace (GemmWorkspaceBytes)
};

// One compiled kernel (both C variants share config and types).
struct GemmEntry {
  GemmConfig config;
  ElemType ab_type, d_type;
  bool has_c;
  bool fused;  // FusedStageKernel (ptr-array) rather than StageKernel
  std::string (*launch)(const GemmLaunch&, cudaStream_t);
  size_t (*workspace_bytes)(const GemmLaunch&);
  std::string (*prepare)();
};

// Registry entries of one (config, A/B type, D type) of the GEMM class template `GEMM`
// (StageGemm or FusedStageGemm, whose `fused` flag is FUSED), with and without C.
#define DISTGEMM_REGISTRY_ENTRIES(GEMM, FUSED, CONFIG, AB_ENUM, AB, D_ENUM, D)     \
  {CONFIG, AB_ENUM, D_ENUM, false, FUSED,                                          \
   &::jax_distgemm::cuda::GEMM<CONFIG, AB, D, false>::Launch,                      \
   &::jax_distgemm::cuda::GEMM<CONFIG, AB, D, false>::WorkspaceBytes,              \
   &::jax_distgemm::cuda::GEMM<CONFIG, AB, D, false>::Prepare},                    \
  {CONFIG, AB_ENUM, D_ENUM, true, FUSED,                                           \
   &::jax_distgemm::cuda::GEMM<CONFIG, AB, D, true>::Launch,                       \
   &::jax_distgemm::cuda::GEMM<CONFIG, AB, D, true>::WorkspaceBytes,               \
   &::jax_distgemm::cuda::GEMM<CONFIG, AB, D, true>::Prepare}

// The compiled kernel for (config, ab_type, d_type, has_c, fused), or nullptr.
const GemmEntry* FindGemm(GemmConfig config, ElemType ab_type, ElemType d_type, bool has_c,
                          bool fused);
// Configs compiled for (ab_type, d_type, fused), fastest-first by default preference.
int AvailableConfigs(ElemType ab_type, ElemType d_type, bool fused, GemmConfig* out, int max);

// Enqueues one stage on `stream`.  Returns "" or an error message.
std::string LaunchGemm(const GemmLaunch& launch, cudaStream_t stream);

// Bytes of CUTLASS workspace the launch needs (0 for the persistent data-parallel scheduler).
size_t GemmWorkspaceBytes(const GemmLaunch& launch);

// Sets the dynamic shared-memory limit of every compiled kernel on the current device.  This
// also forces the module to load: it must run on every device before any kernel that spins on
// a peer is launched (lazy loading takes a process-wide lock; docs/design.md, "Hazards").
std::string PrepareGemmKernels();

}  // namespace jax_distgemm::cuda

// CUTLASS 3.x SM90 TMA warp-specialized GEMMs for the distributed stages (device code).
//
// Layouts are JAX's: A = x [M, K] row-major (K-major), B = w [K, N] row-major (N-major),
// C, D [M, N] row-major.  fp32 accumulation.  Each kernel is wrapped by StageKernel, which runs
// the cross-device StageSync before the unmodified CUTLASS kernel body.
//
// Include only from the sm90_gemm_*.cu instantiation files (compile time: ~1 min per kernel).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cc/cuda/gemm_kernels.h"
#include "cc/cuda/stage_sync.h"
#include "cc/cuda/stage_sync_device.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

// NOTE: stage ordering is StageKernel's griddepcontrol (stage_sync_device.cuh).  With
// CUTLASS's own enabled, its producer warp would wait for the previous grid before loading,
// and a stage could never run into the previous one's tail.
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
#error "Build without CUTLASS_ENABLE_GDC_FOR_SM90: StageKernel orders the stages itself"
#endif

namespace jax_distgemm::cuda {

using namespace cute;

// -- Config -> CUTLASS types ------------------------------------------------------------------------

template <GemmConfig kConfig>
struct ConfigTraits;

// A CTA tile of kM x kN (x 64 along k) on a kCm x kCn cluster, with either mainloop schedule.
template <int kM, int kN, int kCm, int kCn>
struct Tiling {
  using TileShape = Shape<Int<kM>, Int<kN>, _64>;
  using ClusterShape = Shape<Int<kCm>, Int<kCn>, _1>;
};
template <int kM, int kN, int kCm, int kCn>
struct Cooperative : Tiling<kM, kN, kCm, kCn> {
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
template <int kM, int kN, int kCm, int kCn>
struct Pingpong : Tiling<kM, kN, kCm, kCn> {
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
};

template <>
struct ConfigTraits<GemmConfig::kCoop128x256_C2x1> : Cooperative<128, 256, 2, 1> {};
template <>
struct ConfigTraits<GemmConfig::kCoop256x128_C1x2> : Cooperative<256, 128, 1, 2> {};
template <>
struct ConfigTraits<GemmConfig::kPingpong128x128_C1x2> : Pingpong<128, 128, 1, 2> {};
template <>
struct ConfigTraits<GemmConfig::kPingpong128x128_C2x1> : Pingpong<128, 128, 2, 1> {};

// With the first two, the four {128x256, 256x128} x {cluster along M, along N} cooperative
// tiles: cuBLAS's usual large-bf16 Hopper kernel is 256x128 on a 2-CTA cluster, which for our
// row-major D = A B (cuBLAS computes D^T) reads as 128x256 on a 1x2 cluster; both readings are
// compiled.  kCoop128x256_C1x1 drops the cluster: no multicast, so a CTA's pipeline never waits
// for its partner's slot (the pair runs in lock-step), which wins where a stage is
// latency-bound more than L2-bound (small M, long K).  Not compiled: Pingpong 128x256 (one
// consumer warpgroup would hold the whole fp32 accumulator, 256 registers per thread); 2x2
// clusters (cluster-4 occupancy can leave SMs idle on a 132-SM part); stream-K (no faster at a
// partial last wave, more workspace and a memset per launch, and the fused grids have no
// stream-K scheduler); wider epilogue subtiles and Pingpong 64x256 (no faster).
template <>
struct ConfigTraits<GemmConfig::kCoop256x128_C2x1> : Cooperative<256, 128, 2, 1> {};
template <>
struct ConfigTraits<GemmConfig::kCoop128x256_C1x2> : Cooperative<128, 256, 1, 2> {};
template <>
struct ConfigTraits<GemmConfig::kCoop128x256_C1x1> : Cooperative<128, 256, 1, 1> {};

// 256x192, no cluster: two consumer warpgroups of 128 x 192 (192 fp32 accumulators per
// thread, 3 mainloop stages) read fewer operand bytes per MAC than 128x256 (1/256 + 1/192
// against 1/128 + 1/256), which at the power cap buys clock on long-K stages (the tuner leaves
// it on short ones, where it is slower).  Not compiled: 160-wide tiles (32-element swizzle atoms
// for our N-major B, and 64x160 wgmmas need CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED).
// NOTE: ptxas spills a few bytes with this tile in the stage kernel with C and the fused ones.
template <>
struct ConfigTraits<GemmConfig::kCoop256x192_C1x1> : Cooperative<256, 192, 1, 1> {};

template <GemmConfig kConfig, class ElementAB, class ElementD, bool kHasC>
struct Sm90Gemm {
  using Traits = ConfigTraits<kConfig>;
  using ElementC = cute::conditional_t<kHasC, ElementD, void>;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::RowMajor;
  using LayoutC = cutlass::layout::RowMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16 / sizeof(ElementAB);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  static constexpr int kAlignC = kAlignD;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Traits::TileShape,
      typename Traits::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc,
      ElementAcc, ElementC, LayoutC, kAlignC, ElementD, LayoutD, kAlignD,
      typename Traits::EpilogueSchedule>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB,
      ElementAB, LayoutB, kAlignAB, ElementAcc, typename Traits::TileShape,
      typename Traits::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Traits::KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                          CollectiveMainloop, CollectiveEpilogue>;
};

// The CUTLASS kernel with StageSync in front.  Statics (SharedStorageSize, ArchTag, ...) are
// inherited, so GemmUniversalAdapter<StageKernel<K>>::run launches it like K.
template <class GemmKernel_>
struct StageKernel : GemmKernel_ {
  using Base = GemmKernel_;
  struct Params {
    typename Base::Params base;
    StageSync sync;
  };

  static dim3 get_grid_shape(Params const& params) { return Base::get_grid_shape(params.base); }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) {
    const StageSync& s = params.sync;
    // Wait until the previous grid on this stream is complete and its memory flushed (a no-op
    // when launched without PDL), unless this grid does not read what it wrote; then let the
    // next stage launch early (after the wait: see StageSync::overlap_previous).
    if (!s.overlap_previous) WaitForPreviousGrid();
    LaunchNextGrid();

    if (s.signal_flag != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 &&
        threadIdx.x == 0) {
      StoreReleaseSys(s.signal_flag, s.signal_epoch);
    }
    if (s.wait_flag != nullptr) {
      // One decision per cluster (the mainloop's cluster barriers need all CTAs of a cluster
      // to run or none): the leader waits, the others read its verdict from its shared memory.
      // The GEMM's own shared storage is not initialized yet, so word 0 is free to borrow.
      volatile uint32_t* verdict = reinterpret_cast<volatile uint32_t*>(smem);
      const bool leader = cute::block_rank_in_cluster() == 0;
      if (leader && threadIdx.x == 0) {
        *verdict = WaitFlag(s) ? 1u : 0u;
        if (s.seen_flag != nullptr) StoreReleaseSys(s.seen_flag, s.wait_epoch);
      }
      cute::cluster_sync();
      uint32_t go;
      if constexpr (size(typename Base::DispatchPolicy::ClusterShape{}) > 1) {
        uint32_t smem_addr = cute::cast_smem_ptr_to_uint(smem);
        uint32_t remote = cute::set_block_rank(smem_addr, 0);
        asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(go) : "r"(remote) : "memory");
      } else {
        go = *verdict;
      }
      cute::cluster_sync();  // everyone has read the verdict before the GEMM reuses smem
      if (go == 0u) {  // timed out: the host reports the ErrorRecord
        if (s.overlap_previous) WaitForPreviousGrid();
        return;
      }
      // The peer's data was written by another device (copy engine or TMA); order our TMA
      // (async proxy) reads after the leader's acquire.
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    Base gemm;
    gemm(params.base, smem);
    if (s.overlap_previous) WaitForPreviousGrid();  // complete in stream order
  }
};

// -- Host launch ----------------------------------------------------------------------------------

// Helpers shared with FusedStageGemm (sm90_fused_gemm.cuh).
inline cutlass::KernelHardwareInfo HardwareInfo(const GemmLaunch& g) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = g.device;
  hw.sm_count = g.sm_count;
  return hw;
}

template <class SchedulerArguments>
void SetSchedulerArguments(const GemmLaunch& g, SchedulerArguments& s) {
  s.max_swizzle_size = g.max_swizzle;
  using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
  s.raster_order = g.raster == 1   ? RasterOrderOptions::AlongM
                   : g.raster == 2 ? RasterOrderOptions::AlongN
                                   : RasterOrderOptions::Heuristic;
}

// NOTE: CUTLASS's persistent scheduler rounds both tile counts up to whole bands
// (max_swizzle) and hands the padding tiles out like real ones: each runs the whole mainloop
// on TMA's zero fill.  Only the banded count needs the rounding (M's when rastered along N,
// N's along M), so this takes the other's back to whole clusters: 2048 x 6336 with 128x192
// tiles in bands of 4 on 132 SMs then runs 33 column tiles, 4 per CTA, not 36 and 5.  It
// rewrites the scheduler's parameters as its initialize() would have without the padding.
template <class Kernel>
void DropBandPadding(typename Kernel::Params& params, int64_t m, int64_t n) {
  using SchedulerParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;
  static_assert(std::is_same_v<decltype(params.scheduler), SchedulerParams>,
                "DropBandPadding knows CUTLASS's persistent SM90 scheduler only");
  SchedulerParams& s = params.scheduler;
  const int64_t tile_m = size<0>(typename Kernel::TileShape{});
  const int64_t tile_n = size<1>(typename Kernel::TileShape{});
  auto whole_clusters = [](int64_t extent, int64_t tile, int64_t cluster) {
    return static_cast<uint32_t>((extent + tile * cluster - 1) / (tile * cluster));
  };
  if (s.raster_order_ == SchedulerParams::RasterOrder::AlongN) {  // bands along M
    s.problem_tiles_n_ = whole_clusters(n, tile_n, s.cluster_shape_n_);
    s.divmod_cluster_blk_major_ = cutlass::FastDivmodU64(s.problem_tiles_n_);
  } else {  // bands along N
    s.problem_tiles_m_ = whole_clusters(m, tile_m, s.cluster_shape_m_);
    s.divmod_cluster_blk_major_ = cutlass::FastDivmodU64(s.problem_tiles_m_);
  }
  const uint64_t blocks_m = uint64_t{s.problem_tiles_m_} * s.cluster_shape_m_;
  const uint64_t blocks_n = uint64_t{s.problem_tiles_n_} * s.cluster_shape_n_;
  s.divmod_batch_ = cutlass::FastDivmodU64(blocks_m * blocks_n);
  s.blocks_per_problem_ = blocks_m * blocks_n * s.problem_tiles_l_;
}

template <class Adapter, class Params>
std::string RunKernel(Params& params, const GemmLaunch& g, cudaStream_t stream) {
  cutlass::Status st = Adapter::run(params, stream, nullptr, g.pdl);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS launch failed: ") + cutlass::cutlassGetStatusString(st) + " / " +
           cudaGetErrorString(cudaGetLastError());
  }
  return "";
}

template <class Kernel>
std::string PrepareKernel() {
  const int smem = static_cast<int>(Kernel::SharedStorageSize);
  cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
  return "";
}

template <GemmConfig kConfig, class ElementAB, class ElementD, bool kHasC>
struct StageGemm {
  using Gemm = Sm90Gemm<kConfig, ElementAB, ElementD, kHasC>;
  using Kernel = StageKernel<typename Gemm::GemmKernel>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using BaseKernel = typename Gemm::GemmKernel;
  using Arguments = typename BaseKernel::Arguments;

  static Arguments MakeArguments(const GemmLaunch& g) {
    using StrideA = typename BaseKernel::StrideA;
    using StrideB = typename BaseKernel::StrideB;
    using StrideC = typename BaseKernel::StrideC;
    using StrideD = typename BaseKernel::StrideD;
    const GemmOperands& o = g.ops;
    StrideA stride_a = make_stride(o.lda, Int<1>{}, o.batch_stride_a);
    StrideB stride_b = make_stride(Int<1>{}, o.ldb, o.batch_stride_b);
    StrideC stride_c = make_stride(o.ldc, Int<1>{}, o.batch_stride_c);
    StrideD stride_d = make_stride(o.ldd, Int<1>{}, o.batch_stride_d);
    Arguments args{};
    args.mode = o.batch > 1 ? cutlass::gemm::GemmUniversalMode::kBatched
                            : cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {static_cast<int>(o.m), static_cast<int>(o.n), static_cast<int>(o.k),
                          static_cast<int>(o.batch)};
    args.mainloop = {static_cast<const ElementAB*>(o.a), stride_a,
                     static_cast<const ElementAB*>(o.b), stride_b};
    args.epilogue.thread.alpha = o.alpha;
    args.epilogue.thread.beta = kHasC ? o.beta : 0.f;
    if constexpr (kHasC) {
      args.epilogue.ptr_C = static_cast<const ElementD*>(o.c);
    }
    args.epilogue.dC = stride_c;
    args.epilogue.ptr_D = static_cast<ElementD*>(o.d);
    args.epilogue.dD = stride_d;
    args.hw_info = HardwareInfo(g);
    SetSchedulerArguments(g, args.scheduler);
    return args;
  }

  static size_t WorkspaceBytes(const GemmLaunch& g) {
    return BaseKernel::get_workspace_size(MakeArguments(g));
  }

  static std::string Launch(const GemmLaunch& g, cudaStream_t stream) {
    Arguments args = MakeArguments(g);
    if (!BaseKernel::can_implement(args)) {
      return std::string("CUTLASS cannot implement this stage GEMM (") +
             GemmConfigName(kConfig) + "): check 16-byte alignment of every row pitch";
    }
    typename Kernel::Params params{BaseKernel::to_underlying_arguments(args, g.workspace),
                                   g.sync};
    DropBandPadding<BaseKernel>(params.base, g.ops.m, g.ops.n);
    return RunKernel<Adapter>(params, g, stream);
  }

  static std::string Prepare() { return PrepareKernel<Kernel>(); }
};

}  // namespace jax_distgemm::cuda

// Registry entries of one (config, A/B type, D type), with and without C.
#define DISTGEMM_GEMM_ENTRIES(CONFIG, AB_ENUM, AB, D_ENUM, D) \
  DISTGEMM_REGISTRY_ENTRIES(StageGemm, false, CONFIG, AB_ENUM, AB, D_ENUM, D)

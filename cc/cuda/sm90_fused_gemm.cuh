// All stages of an AllGather schedule in one persistent CUTLASS grid (device code).
//
// The stage path (sm90_gemm.cuh) launches one GEMM per stage: each launch pays its own ramp-up
// (prologue, pipeline fill) and its own tail (the last partial wave drains while no next tile
// is ready).  Here the TP stages of one call are the batches of one CUTLASS ptr-array GEMM:
//
//   tile order (persistent scheduler, batch slowest):
//     stage 0 tiles (own shard, ready) | stage 1 tiles (peer's shard) | ... | stage TP-1
//   CTA c:  [s0 tile][s0 tile] .. [wait flag(1)][s1 tile] ..          one ramp-up, one tail
//
// so a CTA that runs out of stage-0 tiles moves straight on to stage 1 while the others finish.
// The per-stage wait moves from the kernel's head (StageKernel) to the point where a CTA's
// producer warp first switches its TMA descriptors to stage s (FlagWaitMainloop below): only
// the loads of stage s wait for stage s's data.
//
// Operand pointers differ per call (XLA's buffers) and ptr-array kernels read them from device
// memory, so every CTA first stores this call's pointers (kernel parameters) into a small table
// in this device's scratch; all CTAs store the same values, and each reads only what its own
// CTA stored or an identical value.  The caller alternates two tables by call parity, so a
// table is never rewritten while a grid of the previous call may still read it.
//
// Include only from the sm90_fused_gemm_*.cu instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cc/cuda/gemm_kernels.h"
#include "cc/cuda/sm90_gemm.cuh"
#include "cc/cuda/stage_sync.h"
#include "cc/cuda/stage_sync_device.cuh"
#include "cutlass/gemm/group_array_problem_shape.hpp"

namespace jax_distgemm::cuda {

using namespace cute;

// -- Schedules: the ptr-array forms of ConfigTraits' kernel schedules ------------------------------

template <class KernelSchedule>
struct PtrArraySchedules;
template <>
struct PtrArraySchedules<cutlass::gemm::KernelTmaWarpSpecializedCooperative> {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <>
struct PtrArraySchedules<cutlass::gemm::KernelTmaWarpSpecializedPingpong> {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// -- Per-stage flag waits, in the producer warp ---------------------------------------------------

struct StageWaits {
  const Epoch* flag[kMaxFusedStages] = {};  // nullptr: no wait
  Epoch* seen[kMaxFusedStages] = {};  // FusedStages::seen_flag
  int32_t peer[kMaxFusedStages] = {};
  // AllGather with a chunked shard (FusedStages::shard_chunks > 1): a tile of batch s > 0
  // waits for flag[s] + c, c = the shard chunk that holds the tile's last row (dim 0) or
  // column (dim 1); chunks travel in order on one copy stream, so that covers the ones before.
  int32_t shard_chunks = 1, shard_dim = 0;
  int64_t shard_chunk_size = 0, shard_extent = 0;
  Epoch epoch = 0;
  uint64_t timeout_ns = 0;
  ErrorRecord* error = nullptr;
  int32_t rank = 0;
};

// Out of line: the producer warp runs on few registers (setmaxnreg), and inlined here the
// wait made the kernel spill.  Returns false on timeout, or at once when `skip` (an earlier
// wait of this thread timed out).  Then marks the wait done where asked (StageWaits::seen),
// skipped or not: the copy stream's wait for that mark must end.
static __device__ __noinline__ bool WaitForStage(const StageWaits& w, int32_t stage,
                                                 int32_t chunk, bool skip) {
  const bool arrived = !skip && WaitFlagUntil(w.flag[stage] + chunk, w.epoch, w.timeout_ns,
                                              w.error, w.rank, stage, w.peer[stage]);
  if (w.seen[stage] != nullptr) StoreReleaseSys(w.seen[stage] + chunk, w.epoch);
  return arrived;
}

// The fused AllGather grid's join (FusedStageKernel): this device's own pushes of the call are
// done.  Out of line for the same reason as WaitForStage.
// NOTE: twice the timeout.  With a gathered result the copy stream's last copies wait for this
// grid's stage waits to end (the seen marks), and CTA 0 can reach the join before another CTA
// even starts a wait for a dead peer: with one timeout the join would time out first, and the
// error would blame this device's own copy engine instead of the peer.
static __device__ __noinline__ void WaitForOwnPushes(const Epoch* flag, const StageWaits& w) {
  WaitFlagUntil(flag, w.epoch, 2 * w.timeout_ns, w.error, w.rank, kPushDoneStage, w.rank);
}

// The waits of a fused launch, with its epoch, timeout, error record and rank.
inline StageWaits MakeWaits(const GemmLaunch& g) {
  StageWaits w;
  for (int s = 0; s < g.fused.count; ++s) {
    w.flag[s] = g.fused.wait_flag[s];
    w.seen[s] = g.fused.seen_flag[s];
    w.peer[s] = g.fused.peer[s];
  }
  w.shard_chunks = std::max(g.fused.shard_chunks, 1);
  w.shard_dim = g.fused.shard_dim;
  w.shard_chunk_size = g.fused.shard_chunk_size;
  w.shard_extent = g.fused.shard_extent;
  w.epoch = g.sync.wait_epoch;
  w.timeout_ns = g.sync.timeout_ns;
  w.error = g.sync.error;
  w.rank = g.sync.rank;
  return w;
}

// The CUTLASS ptr-array mainloop, unchanged except that switching the TMA descriptors to
// batch s first waits for flag s.  The kernels call tensormaps_perform_update from the mainloop
// producer warp only, once per batch change, before the first load of that batch.  With a
// chunked shard the wait moves to each tile's first load instead (load below), for the chunk
// that tile reads.
template <class Base_>
struct FlagWaitMainloop : Base_ {
  using Base = Base_;
  using TileShape = typename Base::TileShape;
  struct Arguments : Base::Arguments {
    StageWaits waits;
  };
  struct Params : Base::Params {
    StageWaits waits;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                        void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shape, args, workspace);
    p.waits = args.waits;
    return p;
  }

  template <class TensorMaps, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(typename Base::TensorMapStorage& shared_tensormaps,
                                                Params const& params,
                                                TensorMaps const& input_tensormaps,
                                                ProblemShape_MNKL problem_shape_mnkl,
                                                int32_t next_batch) {
    const StageWaits& w = params.waits;
    batch_ = next_batch;
    waited_chunk_ = -1;
    if (w.shard_chunks == 1 && next_batch > 0 && next_batch < kMaxFusedStages &&
        w.flag[next_batch] != nullptr) {
      // NOTE: after a timeout the CTA goes on with whatever the slot holds (the error record
      // makes the host fail the call) and skips its later waits, so TP-1 stages do not each
      // wait out the timeout.  Not read here: the error record itself, which lives in host
      // memory, where a read by every CTA at once is slow.
      if (cute::elect_one_sync()) timed_out_ = !WaitForStage(w, next_batch, 0, timed_out_);
      __syncwarp();
      // The peer's data was written by its copy engine; order our TMA (async proxy) reads
      // after the acquire.
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    Base::tensormaps_perform_update(shared_tensormaps, params, input_tensormaps,
                                    problem_shape_mnkl, next_batch);
  }

  // A tile's loads, after (chunked shard only) the wait for the chunk it reads.
  template <class Pipeline, class PipelineState, class LoadInputs, class TensorMaps,
            class BlockCoord, class KTileIterator, class TensorStorage>
  CUTLASS_DEVICE void load(Params const& params, Pipeline pipeline, PipelineState state,
                           LoadInputs const& load_inputs, TensorMaps const& input_tensormaps,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter,
                           int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    const StageWaits& w = params.waits;
    if (w.shard_chunks > 1 && batch_ > 0 && batch_ < kMaxFusedStages &&
        w.flag[batch_] != nullptr) {
      const int64_t tile = w.shard_dim == 0 ? int64_t{cute::size<0>(TileShape{})}
                                            : int64_t{cute::size<1>(TileShape{})};
      const int64_t coord = w.shard_dim == 0 ? int64_t(cute::get<0>(blk_coord))
                                             : int64_t(cute::get<1>(blk_coord));
      const int64_t last = cute::min((coord + 1) * tile, w.shard_extent) - 1;
      const int32_t c = static_cast<int32_t>(
          cute::min(last / cute::max(w.shard_chunk_size, int64_t{1}),
                    int64_t{w.shard_chunks - 1}));
      if (c > waited_chunk_) {
        if (cute::elect_one_sync()) timed_out_ = !WaitForStage(w, batch_, c, timed_out_);
        __syncwarp();
        asm volatile("fence.proxy.async.global;" ::: "memory");  // as above
        waited_chunk_ = c;
      }
    }
    Base::load(params, pipeline, state, load_inputs, input_tensormaps, blk_coord, k_tile_iter,
               k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
  }

 private:
  bool timed_out_ = false;  // this thread's wait timed out before (see above)
  int32_t batch_ = 0;  // the batch whose descriptors are loaded
  int32_t waited_chunk_ = -1;  // chunked shard: the last chunk of batch_ waited for
};

template <GemmConfig kConfig, class ElementAB, class ElementD, bool kHasC>
struct Sm90FusedGemm {
  using Traits = ConfigTraits<kConfig>;
  using Schedules = PtrArraySchedules<typename Traits::KernelSchedule>;
  using ElementC = cute::conditional_t<kHasC, ElementD, void>;
  using ElementAcc = float;
  using Layout = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16 / sizeof(ElementAB);
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Traits::TileShape,
      typename Traits::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc,
      ElementAcc, ElementC, Layout, kAlignD, ElementD, Layout, kAlignD,
      typename Schedules::Epilogue>::CollectiveOp;

  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, Layout, kAlignAB,
      ElementAB, Layout, kAlignAB, ElementAcc, typename Traits::TileShape,
      typename Traits::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedules::Kernel>::CollectiveOp;
  using CollectiveMainloop = FlagWaitMainloop<BaseMainloop>;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::ArrayProblemShape<Shape<int, int, int, int>>,
                                           CollectiveMainloop, CollectiveEpilogue>;
};

struct FusedPointers {
  const void* ptr[kFusedTableEntries];
};

// The ptr-array kernel with the pointer table published in front; no StageSync wait here (the
// waits are per stage, FlagWaitMainloop).  The grid is the call's first launch: it waits for
// the previous grid on the stream before anything else.
template <class GemmKernel_>
struct FusedStageKernel : GemmKernel_ {
  using Base = GemmKernel_;
  struct Params {
    typename Base::Params base;
    FusedPointers pointers;
    void** table;
    const Epoch* exit_flag;  // FusedStages::exit_wait_flag
  };

  static dim3 get_grid_shape(Params const& params) { return Base::get_grid_shape(params.base); }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) {
    WaitForPreviousGrid();
    LaunchNextGrid();
    // Publish this call's pointers; every CTA stores the same values (see the file comment).
    for (int i = threadIdx.x; i < kFusedTableEntries; i += blockDim.x) {
      params.table[i] = const_cast<void*>(params.pointers.ptr[i]);
    }
    __syncthreads();
    Base gemm;
    gemm(params.base, smem);
    // Join: the grid completes only after this device's own pushes (FusedStages::exit_wait_flag).
    if (params.exit_flag != nullptr && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 &&
        blockIdx.z == 0) {
      WaitForOwnPushes(params.exit_flag, params.base.mainloop.waits);
    }
  }
};

// -- Host launch ----------------------------------------------------------------------------------

template <GemmConfig kConfig, class ElementAB, class ElementD, bool kHasC>
struct FusedStageGemm {
  using Gemm = Sm90FusedGemm<kConfig, ElementAB, ElementD, kHasC>;
  using BaseKernel = typename Gemm::GemmKernel;
  using Kernel = FusedStageKernel<BaseKernel>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename BaseKernel::Arguments;

  static Arguments MakeArguments(const GemmLaunch& g) {
    const GemmOperands& o = g.ops;
    const FusedStages& f = g.fused;
    using StrideA = typename BaseKernel::StrideA;
    using StrideB = typename BaseKernel::StrideB;
    using StrideC = typename BaseKernel::StrideC;
    using StrideD = typename BaseKernel::StrideD;
    // One shape and one set of leading dims for every stage; the batch strides are unused
    // (each stage has its own pointers).
    StrideA stride_a = make_stride(o.lda, Int<1>{}, int64_t{0});
    StrideB stride_b = make_stride(Int<1>{}, o.ldb, int64_t{0});
    StrideC stride_c = make_stride(o.ldc, Int<1>{}, int64_t{0});
    StrideD stride_d = make_stride(o.ldd, Int<1>{}, int64_t{0});
    void** t = f.table;
    Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kArray;
    args.problem_shape = {{static_cast<int>(o.m), static_cast<int>(o.n), static_cast<int>(o.k),
                           f.count}};
    args.mainloop.ptr_A = static_cast<const ElementAB**>(static_cast<void*>(t));
    args.mainloop.dA = stride_a;
    args.mainloop.ptr_B = static_cast<const ElementAB**>(static_cast<void*>(t + kMaxFusedStages));
    args.mainloop.dB = stride_b;
    args.mainloop.waits = MakeWaits(g);
    args.epilogue.thread.alpha = o.alpha;
    args.epilogue.thread.beta = kHasC ? o.beta : 0.f;
    if constexpr (kHasC) {
      args.epilogue.ptr_C = static_cast<const ElementD**>(static_cast<void*>(t + 2 * kMaxFusedStages));
    }
    args.epilogue.dC = stride_c;
    args.epilogue.ptr_D = static_cast<ElementD**>(static_cast<void*>(t + 3 * kMaxFusedStages));
    args.epilogue.dD = stride_d;
    args.hw_info = HardwareInfo(g);
    SetSchedulerArguments(g, args.scheduler);
    return args;
  }

  static size_t WorkspaceBytes(const GemmLaunch& g) {
    return BaseKernel::get_workspace_size(MakeArguments(g));
  }

  static std::string Launch(const GemmLaunch& g, cudaStream_t stream) {
    const FusedStages& f = g.fused;
    if (f.count < 1 || f.count > kMaxFusedStages || f.table == nullptr) {
      return "fused launch without stages or pointer table";
    }
    Arguments args = MakeArguments(g);
    if (!BaseKernel::can_implement(args)) {
      return std::string("CUTLASS cannot implement this fused GEMM (") + GemmConfigName(kConfig) +
             "): check 16-byte alignment of every row pitch";
    }
    typename Kernel::Params params{};
    params.base = BaseKernel::to_underlying_arguments(args, g.workspace);
    DropBandPadding<BaseKernel>(params.base, g.ops.m, g.ops.n);
    for (int s = 0; s < kMaxFusedStages; ++s) {
      const bool used = s < f.count;
      params.pointers.ptr[s] = used ? f.a[s] : nullptr;
      params.pointers.ptr[kMaxFusedStages + s] = used ? f.b[s] : nullptr;
      params.pointers.ptr[2 * kMaxFusedStages + s] = used ? f.c[s] : nullptr;
      params.pointers.ptr[3 * kMaxFusedStages + s] = used ? f.d[s] : nullptr;
    }
    params.table = f.table;
    params.exit_flag = f.exit_wait_flag;
    return RunKernel<Adapter>(params, g, stream);
  }

  static std::string Prepare() { return PrepareKernel<Kernel>(); }
};

}  // namespace jax_distgemm::cuda

// Registry entries of one fused (config, A/B type, D type), with and without C.
#define DISTGEMM_FUSED_GEMM_ENTRIES(CONFIG, AB_ENUM, AB, D_ENUM, D) \
  DISTGEMM_REGISTRY_ENTRIES(FusedStageGemm, true, CONFIG, AB_ENUM, AB, D_ENUM, D)

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
#include <cstring>
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
  const uint32_t* flag[kMaxFusedStages] = {};  // nullptr: no wait
  uint32_t* seen[kMaxFusedStages] = {};  // FusedStages::seen_flag (mainloop waits only)
  int32_t peer[kMaxFusedStages] = {};
  int32_t stage[kMaxFusedStages] = {};  // the schedule stage of batch s (FusedStages::chunks)
  // AllGather with a chunked shard (FusedStages::shard_chunks > 1): a tile of batch s > 0
  // waits for flag[s] + c, c = the shard chunk that holds the tile's last row (dim 0) or
  // column (dim 1); chunks travel in order on one copy stream, so that covers the ones before.
  int32_t shard_chunks = 1, shard_dim = 0;
  int64_t shard_chunk_size = 0, shard_extent = 0;
  uint32_t epoch = 0;
  uint64_t timeout_ns = 0;
  ErrorRecord* error = nullptr;
  int32_t rank = 0;
};

// Out of line: the producer warp runs on few registers (setmaxnreg), and inlined here the
// wait made the kernel spill.  Returns false on timeout, or at once when `skip` (an earlier
// wait of this thread timed out).  Then marks the wait done where asked (StageWaits::seen),
// skipped or not: the copy stream's wait for that mark must end.  Serves the mainloop's
// operand waits and the epilogue's C waits (no marks) alike.
static __device__ __noinline__ bool WaitForStage(const StageWaits& w, int32_t stage,
                                                 int32_t chunk = 0, bool skip = false) {
  const bool arrived = !skip && WaitFlagUntil(w.flag[stage] + chunk, w.epoch, w.timeout_ns,
                                              w.error, w.rank, w.stage[stage], w.peer[stage]);
  if (w.seen[stage] != nullptr) StoreReleaseSys(w.seen[stage] + chunk, w.epoch);
  return arrived;
}

// The fused AllGather grid's join (FusedStageKernel): this device's own pushes of the call are
// done.  Out of line for the same reason as WaitForStage.
// NOTE: twice the timeout.  With a gathered result the copy stream's last copies wait for this
// grid's stage waits to end (the seen marks), and CTA 0 can reach the join before another CTA
// even starts a wait for a dead peer: with one timeout the join timed out first and the error
// blamed this device's own copy engine instead of the peer (virtual TP=8, performance.md AD).
static __device__ __noinline__ void WaitForOwnPushes(const uint32_t* flag, const StageWaits& w) {
  WaitFlagUntil(flag, w.epoch, 2 * w.timeout_ns, w.error, w.rank, kPushDoneStage, w.rank);
}

// The waits of a fused launch on `flags` (FusedStages::wait_flag or c_wait_flag), with the
// launch's epoch, timeout, error record and rank.
inline StageWaits MakeWaits(const GemmLaunch& g, const uint32_t* const (&flags)[kMaxFusedStages]) {
  StageWaits w;
  for (int s = 0; s < g.fused.count; ++s) {
    w.flag[s] = flags[s];
    w.peer[s] = g.fused.peer[s];
    w.stage[s] = s / std::max(g.fused.chunks, 1);
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
      // memory; one read per CTA, all at once, cost ~100 us on 2x H200.
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

// -- ReduceScatter: per-stage C waits and completion signals, in the epilogue ----------------------
//
// A fused ReduceScatter (executor.cc) runs its TP stages as the batches of one grid; stage
// s > 0 adds the left neighbour's running sum of its stage s-1 as C: read over NVLink (remote
// C), or from this device's slot, where the neighbour's epilogue stored it (push).
// Only C depends on the peer, and C is loaded by CUTLASS's epilogue producer warp, not by the
// mainloop producer that FlagWaitMainloop holds: so the wait sits where that warp switches its
// C descriptor to stage s, and the mainloop of stage s runs meanwhile.
//
//   device r, CTA c:  [s0 tile][s0 tile] | [s1 tile: mainloop .. | C: wait flag(1), load | store]
//   completion:       each TMA-store warp, as it moves past stage s (to a later stage, or at
//                     the end), waits until its stores have landed and adds its tile count to
//                     counter[s]; the add that reaches the stage's tile count resets the word
//                     and sets the right neighbour's flag(s+1).
//
// Stage 0 has no running sum: its beta is 0 (per-stage beta, FusedStages::stage_beta), and
// CUTLASS's epilogue then skips its C loads tile by tile.
struct StageSignals {
  StageWaits c_waits;  // flag[s]: C of stage s is ready (>= epoch)
  uint32_t* done_flag[kMaxFusedStages] = {};  // set to c_waits.epoch when stage s is stored here
  uint32_t* counters = nullptr;  // nullptr: no completion tracking
  uint32_t tiles_per_stage = 0;  // set by the launch from CUTLASS's scheduler parameters
};

__device__ __forceinline__ uint32_t AtomicAddAcqRelSys(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.sys.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

// The CUTLASS ptr-array epilogue, unchanged except for the C wait and the completion count
// (both idle unless StageSignals asks for them).
template <class Base_>
struct SignalingEpilogue : Base_ {
  using Base = Base_;
  struct Arguments : Base::Arguments {
    StageSignals signals;
  };
  struct Params : Base::Params {
    StageSignals signals;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape,
                                                  Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shape, args, workspace);
    p.signals = args.signals;
    return p;
  }

  CUTLASS_HOST_DEVICE
  SignalingEpilogue(Params const& params, typename Base::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), signals_(&params.signals) {}

  template <bool IsLoad, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(typename Base::TensorMapStorage& shared_tensormaps,
                                                typename Base::Params const& params,
                                                cute::TmaDescriptor const* tensormap,
                                                ProblemShape_MNKL problem_shape_mnkl,
                                                int32_t next_batch, int32_t warp_group_idx) {
    if constexpr (IsLoad) {  // the epilogue producer warp, before its first C load of next_batch
      const StageWaits& w = signals_->c_waits;
      if (next_batch > 0 && next_batch < kMaxFusedStages && w.flag[next_batch] != nullptr) {
        // NOTE: as in FlagWaitMainloop, a timed-out wait is not repeated for later stages.
        if (cute::elect_one_sync() && !timed_out_) timed_out_ = !WaitForStage(w, next_batch);
        __syncwarp();
        // The peer's running sum came through its TMA unit; order our TMA (async proxy) loads
        // after the acquire.
        asm volatile("fence.proxy.async.global;" ::: "memory");
      }
    } else {  // warp 0 of a consumer warpgroup, moving on to a later stage
      ReportStored();
    }
    Base::template tensormaps_perform_update<IsLoad>(shared_tensormaps, params, tensormap,
                                                     problem_shape_mnkl, next_batch,
                                                     warp_group_idx);
  }

  template <class LoadPipeline, class LoadPipelineState, class StorePipeline,
            class StorePipelineState, class ProblemShapeMNKL, class TileShapeMNK,
            class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma,
            class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline,
                            LoadPipelineState load_pipe_consumer_state,
                            StorePipeline store_pipeline,
                            StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma,
                            int thread_idx, typename Base::TensorStorage& shared_tensors,
                            TensorMapD const& store_tensormap, int subtile_idx = -1) {
    auto next = Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline,
                            store_pipe_producer_state, problem_shape_mnkl, tile_shape_MNK,
                            tile_coord_mnkl, accumulators, tiled_mma, thread_idx, shared_tensors,
                            store_tensormap, subtile_idx);
    // CUTLASS issues a tile's TMA stores from its epilogue thread 0: that thread's warp counts
    // the tiles it stored of the current stage.
    store_warp_ = thread_idx < cutlass::NumThreadsPerWarp;
    stage_ = static_cast<int32_t>(cute::get<3>(tile_coord_mnkl));
    ++tiles_;
    return next;
  }

  template <class... Args>
  CUTLASS_DEVICE auto store_tail(Args&&... args) {
    auto r = Base::store_tail(static_cast<Args&&>(args)...);
    ReportStored();  // the last stage this CTA worked on
    return r;
  }

 private:
  // Called by whole warps.  The TMA-store warp waits until its stores of stage_ have landed in
  // memory (not only left shared memory; for push, the neighbour's memory), then adds its tile
  // count; the add that completes the stage resets the counter for the next grid and signals
  // the peer.
  CUTLASS_DEVICE void ReportStored() {
    const StageSignals& g = *signals_;
    if (g.counters == nullptr || !store_warp_ || tiles_ == 0) return;
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // every lane: its own groups
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __syncwarp();
    if (cute::elect_one_sync() && stage_ >= 0 && stage_ < kMaxFusedStages) {
      uint32_t* counter = g.counters + stage_;
      const uint32_t added = static_cast<uint32_t>(tiles_);
      if (AtomicAddAcqRelSys(counter, added) + added == g.tiles_per_stage) {
        // NOTE: the next grid reads the word only after this one has completed (its first
        // instruction waits for the previous grid), so a plain store suffices.
        *reinterpret_cast<volatile uint32_t*>(counter) = 0u;
        if (g.done_flag[stage_] != nullptr) StoreReleaseSys(g.done_flag[stage_], g.c_waits.epoch);
      }
    }
    __syncwarp();
    tiles_ = 0;
  }

  StageSignals const* signals_;
  bool timed_out_ = false;  // this thread's C wait timed out before
  bool store_warp_ = false;
  int32_t stage_ = -1;
  int32_t tiles_ = 0;
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

  using BaseEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Traits::TileShape,
      typename Traits::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc,
      ElementAcc, ElementC, Layout, kAlignD, ElementD, Layout, kAlignD,
      typename Schedules::Epilogue>::CollectiveOp;
  using CollectiveEpilogue = SignalingEpilogue<BaseEpilogue>;

  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, Layout, kAlignAB,
      ElementAB, Layout, kAlignAB, ElementAcc, typename Traits::TileShape,
      typename Traits::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename BaseEpilogue::SharedStorage))>,
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
    const uint32_t* exit_flag;  // FusedStages::exit_wait_flag
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
    args.mainloop.waits = MakeWaits(g, f.wait_flag);
    for (int s = 0; s < f.count; ++s) {
      args.mainloop.waits.seen[s] = f.seen_flag[s];
    }
    args.epilogue.thread.alpha = o.alpha;
    args.epilogue.thread.beta = kHasC ? o.beta : 0.f;
    if constexpr (kHasC) {
      args.epilogue.ptr_C = static_cast<const ElementD**>(static_cast<void*>(t + 2 * kMaxFusedStages));
      if (f.stage_beta) {  // beta of stage s: the float at the start of table entry 4S + s
        args.epilogue.thread.beta_ptr = reinterpret_cast<const float*>(t + kFusedBetaEntry);
        args.epilogue.thread.dBeta = {_0{}, _0{}, int64_t{sizeof(void*) / sizeof(float)}};
      }
    }
    StageSignals& sig = args.epilogue.signals;
    sig.c_waits = MakeWaits(g, f.c_wait_flag);
    for (int s = 0; s < f.count; ++s) sig.done_flag[s] = f.done_flag[s];
    sig.counters = f.counters;
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
    if (f.stage_beta && !kHasC) return "fused GEMM: per-stage beta without a C operand";
    typename Kernel::Params params{};
    params.base = BaseKernel::to_underlying_arguments(args, g.workspace);
    if (f.counters != nullptr) {
      // Tiles per stage as CUTLASS's persistent scheduler enumerates them (cluster-padded).
      const uint64_t blocks = params.base.scheduler.blocks_per_problem_;
      if (blocks == 0 || blocks % f.count != 0 || blocks / f.count > UINT32_MAX) {
        return "fused GEMM: unexpected tile count for per-stage completion";
      }
      params.base.epilogue.signals.tiles_per_stage = static_cast<uint32_t>(blocks / f.count);
    }
    for (int s = 0; s < kMaxFusedStages; ++s) {
      const bool used = s < f.count;
      params.pointers.ptr[s] = used ? f.a[s] : nullptr;
      params.pointers.ptr[kMaxFusedStages + s] = used ? f.b[s] : nullptr;
      params.pointers.ptr[2 * kMaxFusedStages + s] = used ? f.c[s] : nullptr;
      params.pointers.ptr[3 * kMaxFusedStages + s] = used ? f.d[s] : nullptr;
      uint64_t beta_bits = 0;  // the float in the entry's first (low, little-endian) 4 bytes
      if (used) std::memcpy(&beta_bits, &f.beta[s], sizeof(float));
      params.pointers.ptr[kFusedBetaEntry + s] = reinterpret_cast<const void*>(beta_bits);
    }
    params.table = f.table;
    params.exit_flag = f.exit_wait_flag;
    return RunKernel<Adapter>(params, g, stream);
  }

  static std::string Prepare() { return PrepareKernel<Kernel>(); }
};

}  // namespace jax_distgemm::cuda

// Registry entries of one fused (config, A/B type, D type), with and without C.
#define JAX_DISTGEMM_FUSED_GEMM_ENTRIES(CONFIG, AB_ENUM, AB, D_ENUM, D) \
  JAX_DISTGEMM_REGISTRY_ENTRIES(FusedStageGemm, true, CONFIG, AB_ENUM, AB, D_ENUM, D)

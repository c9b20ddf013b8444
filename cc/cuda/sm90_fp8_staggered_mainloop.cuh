// A per-tensor fp8 consumer mainloop whose two warpgroups run half a K tile apart, so that one
// adds its partial sums into the fp32 totals while the other's wgmmas keep the tensor cores
// busy.
//
// Each warpgroup holds two whole-width sets (totals and partials) and after each group of
// wgmmas (128 of K) waits for it and adds the partials, as CUTLASS's fp8 loop does.  Started
// together, the two warpgroups stay in step and both add while the tensor cores idle.  Here
// warpgroup 1 first issues half a K tile, so its groups straddle two stages and its adds fall
// inside warpgroup 0's groups (k0-3: the K tile's four 32-wide wgmma blocks):
//
//     warpgroup 0 | t0 k0-3        | t1 k0-3        | t2 k0-3        | ...
//     warpgroup 1 | t0 k0-1 | t0 k2-3 t1 k0-1 | t1 k2-3 t2 k0-1 | ...
//
// Both promote every 128 of K, warpgroup 1 shifted by 64.  A stage is free once both
// warpgroups released it (the pipeline counts both), so warpgroup 1 holds each stage half a
// K tile longer.  No barrier keeps the offset: a warpgroup whose adds stall only delays its
// own next group, which lets the other run ahead.
// Assumes k_tile_count >= 1 (CheckFp8Gemm: K > 0): warpgroup 1 issues two groups even for one
// K tile.  Two sets of N/2 registers per consumer thread fit N = 192 (192 of 232).
// Per-tensor only: warpgroup 1's groups mix two K tiles, which block scales would have to tell
// apart.
// Only the consumer side (mma, mma_tail) differs from the base collective: the producer,
// shared storage, parameters and TMA descriptors are the base's.
#pragma once

#include "cc/cuda/sm90_fp8_warpgroup_operands.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace jax_distgemm::cuda {

// Base: CUTLASS's SM90 per-tensor fp8 CollectiveMma (MainloopSm90TmaGmmaWarpSpecializedFP8)
// built for the cooperative kernel.
template <class Base>
struct Fp8StaggeredPromotion : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using typename Base::TiledMma;

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& /*params*/) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "accumulators must be registers");
    TiledMma tiled_mma;
    auto operands = WarpGroupOperands<TiledMma, SmemLayoutA, SmemLayoutB>(tiled_mma, thread_idx,
                                                                          shared_tensors);
    Tensor tCrA = get<0>(operands);  // (MMA,M,K,PIPE)
    Tensor tCrB = get<1>(operands);  // (MMA,N,K,PIPE)
    CUTE_STATIC_ASSERT_V(size<1>(tCrA) == size<1>(accum));
    CUTE_STATIC_ASSERT_V(size<1>(tCrB) == size<2>(accum));
    constexpr int kBlocks = decltype(size<2>(tCrA))::value;
    static_assert(kBlocks % 2 == 0, "a K tile splits into two halves");
    constexpr int kHalf = kBlocks / 2;
    const bool lagging = WarpGroupIndex(thread_idx) == 1;

    Tensor part = make_fragment_like(accum);
    // NOTE: both sets are defined before the first wgmma: a first definition between two
    // wgmma groups makes ptxas serialize every wgmma of the kernel.
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) accum(i) = 0.f;
    clear(part);
    warpgroup_fence_operand(accum);
    warpgroup_fence_operand(part);

    auto begin_group = [&]() { BeginWgmmaGroup(tiled_mma, part); };
    // Blocks [k_begin, k_end) of one stage into the open group.
    auto issue = [&](int stage, auto k_begin, auto k_end) {
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = decltype(k_begin)::value; k_block < decltype(k_end)::value; ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
    };
    auto end_group_and_add = [&]() { EndWgmmaGroupAndAdd(part, accum, accum); };

    if (!lagging) {
      CUTLASS_PRAGMA_NO_UNROLL
      for (int k_tile = 0; k_tile < k_tile_count; ++k_tile) {
        pipeline.consumer_wait(smem_pipe_read);
        begin_group();
        issue(smem_pipe_read.index(), Int<0>{}, Int<kBlocks>{});
        end_group_and_add();
        pipeline.consumer_release(smem_pipe_read);
        ++smem_pipe_read;
      }
      return;
    }
    PipelineState previous = smem_pipe_read;
    pipeline.consumer_wait(previous);
    begin_group();
    issue(previous.index(), Int<0>{}, Int<kHalf>{});
    end_group_and_add();
    ++smem_pipe_read;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k_tile = 1; k_tile < k_tile_count; ++k_tile) {
      pipeline.consumer_wait(smem_pipe_read);
      begin_group();
      issue(previous.index(), Int<kHalf>{}, Int<kBlocks>{});
      issue(smem_pipe_read.index(), Int<0>{}, Int<kHalf>{});
      end_group_and_add();
      pipeline.consumer_release(previous);
      previous = smem_pipe_read;
      ++smem_pipe_read;
    }
    begin_group();
    issue(previous.index(), Int<kHalf>{}, Int<kBlocks>{});
    end_group_and_add();
    pipeline.consumer_release(previous);
  }

  // mma() waited for every wgmma and released every stage it read.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};

}  // namespace jax_distgemm::cuda

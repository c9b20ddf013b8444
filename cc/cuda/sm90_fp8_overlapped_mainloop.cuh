// An fp8 consumer mainloop whose fp32 promotion overlaps the next K tile's tensor-core work.
//
// CUTLASS's per-tensor fp8 mainloop (sm90_mma_tma_gmma_ss_warpspecialized_fp8.hpp) issues K
// tiles' wgmmas into a partial accumulator, and at each promotion waits for all of them
// (wgmma.wait_group 0) before adding the partials into the fp32 totals: the wait drains the
// warpgroup's wgmma queue, and the adds run while its tensor-core share idles.  This loop keeps
// two partial sets and alternates them: K tile t is issued into part[t % 2] before the partials
// of tile t - 1 are added, behind a wait that leaves tile t in flight:
//
//     issue   | t0->P0 | t1->P1        | t2->P0        | t3->P1        | ...
//     wait    |        | t0 done       | t1 done       | t2 done       |
//     add     |        | acc += P0     | acc += P1     | acc += P0     |
//     release |        | stage of t0   | stage of t1   | stage of t2   |
//
// Promotion is every K tile (128 of K), the most exact interval.
// Only the consumer side (mma, mma_tail) differs from the base collective: the producer,
// shared storage, parameters and TMA descriptors are the base's.
// NOTE: three accumulator sets (totals + two partials) cost 3 * M*N/256 registers per
// consumer thread: 192 for a 128x128 tile, within the cooperative kernel's 232; wider tiles do
// not fit.  The same loop for block scaling (the scale-and-add overlapped) spilled and ran
// slower than CUTLASS's blockwise loop; block scaling has sm90_fp8_split_mainloop.cuh.
#pragma once

#include "cc/cuda/sm90_fp8_warpgroup_operands.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace jax_distgemm::cuda {

// Base: CUTLASS's SM90 per-tensor fp8 CollectiveMma (MainloopSm90TmaGmmaWarpSpecializedFP8)
// built for the cooperative kernel.
template <class Base>
struct Fp8OverlappedPromotion : Base {
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

    Tensor part0 = make_fragment_like(accum);
    Tensor part1 = make_fragment_like(accum);

    PipelineState smem_pipe_release = smem_pipe_read;

    // Waits for the next stage and issues its wgmmas into `part`.
    auto issue = [&](auto& part) {
      pipeline.consumer_wait(smem_pipe_read);
      const int stage = smem_pipe_read.index();
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(part);
      ++smem_pipe_read;
    };
    // After the wait that completed `part`'s group: frees its stage, adds it into the totals.
    auto promote = [&](auto& part) {
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      warpgroup_fence_operand(part);
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) {
        accum(i) += part(i);
      }
      warpgroup_fence_operand(accum);
    };

    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) accum(i) = 0.f;
    warpgroup_fence_operand(accum);

    issue(part0);
    int remaining = k_tile_count - 1;
    // Two K tiles per trip, so that each partial set has a fixed register home.
    CUTLASS_PRAGMA_NO_UNROLL
    for (; remaining >= 2; remaining -= 2) {
      issue(part1);
      warpgroup_wait<1>();
      promote(part0);
      issue(part0);
      warpgroup_wait<1>();
      promote(part1);
    }
    if (remaining == 1) {
      issue(part1);
      warpgroup_wait<1>();
      promote(part0);
      warpgroup_wait<0>();
      promote(part1);
    } else {
      warpgroup_wait<0>();
      promote(part0);
    }
  }

  // mma() waited for every wgmma and released every stage it read.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};

}  // namespace jax_distgemm::cuda

// An fp8 consumer mainloop for 128x256 tiles: each warpgroup promotes its 64 x 256 share to
// fp32 in two 128-column halves, so one partial set of half the width does.
//
// With a whole-width partial set a 128x256 tile needs 256 registers per consumer thread
// (totals and partials, 128 each); a thread gets 232.  Here a K tile's wgmmas go out per half
// (4 x 64x128x32 each) into one 64-register partial set, which the warpgroup waits for and
// adds before it issues the next half: 192 registers.  Block-scaled, a half is one 128-column
// block of B's scales, so the add is times one sfa per row and one sfb; per tensor it is a
// plain add and the scales wait for the epilogue.
//
//     K tile t    | half 0                  | half 1                  | release stage t
//     warpgroup w | issue, wait, acc0 += .. | issue, wait, acc1 += .. |
//
// While one warpgroup waits and adds, the other's half keeps the tensor cores busy, if the
// two are out of step: started together, their halves share the tensor cores and end together,
// and both add while the tensor cores idle.  Per tensor, warpgroup 1 runs its first half's
// groups half a K tile late (as sm90_fp8_staggered_mainloop.cuh runs whole tiles), so its
// group boundaries fall inside warpgroup 0's groups (k0-3: the K tile's 32-wide wgmma blocks):
//
//     warpgroup 0 | t0 h0 k0-3 | t0 h1 k0-3 | t1 h0 k0-3 | t1 h1 k0-3 | ...
//     warpgroup 1 | t0 h0 k0-1 | t0 h1 k0-3 | t0 h0 k2-3 t1 h0 k0-1 | t1 h1 k0-3 | ...
//
// Block-scaled, a group must stay within one K tile (one scale per row and K tile), so both
// warpgroups run the first line.
// Promotion is every 128 of K, as the recipe asks.
// Only the consumer side (mma, mma_tail) and the TiledMma differ from the base collective: the
// producer, shared storage, parameters, TMA descriptors and scale loads are the base's; the
// kernel and the epilogue partition the accumulators with this TiledMma, (MMA, 1, 2) per thread.
#pragma once

#include "cc/cuda/sm90_fp8_warpgroup_operands.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace jax_distgemm::cuda {

// Base: CUTLASS's SM90 fp8 CollectiveMma for the cooperative kernel at a 128x256 tile, the
// blockwise one (MainloopSm90TmaGmmaWarpSpecializedBlockScalingFP8) when kBlockScaled, else the
// per-tensor one (MainloopSm90TmaGmmaWarpSpecializedFP8).
template <class Base, bool kBlockScaled>
struct Fp8SplitPromotion : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  static_assert(cute::size<0>(TileShape{}) == 128 && cute::size<1>(TileShape{}) == 256,
                "the split loop runs 128x256 tiles: two warpgroups of 64 rows, two halves");

  // One half per atom: 64x128x32 wgmmas, two warpgroups along M.
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<typename Base::ElementA, typename Base::ElementB, float,
                                 cute::Shape<cute::_128, cute::_128, cute::_128>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

  // Block scales as the accumulators see them: (BLK_M, BLK_N, (BLK_K, PIPE)) views of the
  // per-stage sfa (one per row) and sfb (one per 128 columns), zero strides where a scale is
  // shared, partitioned like the accumulators (CUTLASS's blockwise loop builds the same).
  CUTLASS_DEVICE static auto ScaleViews(TiledMma const& tiled_mma, int thread_idx,
                                        TensorStorage& shared_tensors) {
    using namespace cute;
    static_assert(Base::ScaleMsPerTile == 128 && Base::ScaleNsPerTile == 2,
                  "block scales: one sfa per row, one sfb per half");
    using LayoutSFA = typename Base::SmemLayoutSFA;  // (M, K, PIPE)
    using LayoutSFB = typename Base::SmemLayoutSFB;  // (N, K, PIPE)
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(get<0>(shape(LayoutSFA{})), get<1>(TileShape{}),
                               make_shape(get<1>(shape(LayoutSFA{})), get<2>(shape(LayoutSFA{})))),
                    make_stride(get<0>(stride(LayoutSFA{})), _0{},
                                make_stride(get<1>(stride(LayoutSFA{})),
                                            get<2>(stride(LayoutSFA{}))))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), get<0>(shape(LayoutSFB{})),
                               make_shape(get<1>(shape(LayoutSFB{})), get<2>(shape(LayoutSFB{})))),
                    make_stride(_0{}, get<0>(stride(LayoutSFB{})),
                                make_stride(get<1>(stride(LayoutSFB{})),
                                            get<2>(stride(LayoutSFB{}))))));
    auto thread_c = tiled_mma.get_slice(thread_idx);
    // (MMA,1,2,(1,PIPE)) each
    return make_tuple(thread_c.partition_C(sSFA), thread_c.partition_C(sSFB));
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& /*params*/) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "accumulators must be registers");
    TiledMma tiled_mma;
    auto operands = WarpGroupOperands<TiledMma, SmemLayoutA, SmemLayoutB>(tiled_mma, thread_idx,
                                                                          shared_tensors);
    Tensor tCrA = get<0>(operands);  // (MMA,1,K,PIPE)
    Tensor tCrB = get<1>(operands);  // (MMA,2,K,PIPE)
    CUTE_STATIC_ASSERT_V(size<1>(tCrA) == Int<1>{});
    CUTE_STATIC_ASSERT_V(size<1>(accum) == Int<1>{});
    CUTE_STATIC_ASSERT_V(size<2>(accum) == Int<2>{});
    CUTE_STATIC_ASSERT_V(size<1>(tCrB) == size<2>(accum));

    auto scale_views = [&] {
      if constexpr (kBlockScaled) {
        return ScaleViews(tiled_mma, thread_idx, shared_tensors);
      } else {
        return 0;  // per tensor: none
      }
    }();
    Tensor part = make_fragment_like(accum(_, _, 0));  // (MMA,1): one half
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) accum(i) = 0.f;
    warpgroup_fence_operand(accum);

    auto wait_and_release = [&](int half) {
      warpgroup_wait<0>();
      if (half == 1) pipeline.consumer_release(smem_pipe_read);
      warpgroup_fence_operand(part);
      warpgroup_fence_operand(accum);
    };

    if constexpr (!kBlockScaled) {
      if (WarpGroupIndex(thread_idx) == 1) {
        LaggingTensorMma(pipeline, smem_pipe_read, accum, part, tiled_mma, tCrA, tCrB,
                         k_tile_count);
        return;
      }
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k_tile = 0; k_tile < k_tile_count; ++k_tile) {
      pipeline.consumer_wait(smem_pipe_read);
      const int stage = smem_pipe_read.index();
      CUTLASS_PRAGMA_UNROLL
      for (int half = 0; half < 2; ++half) {
        warpgroup_fence_operand(part);
        warpgroup_arrive();
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        CUTLASS_PRAGMA_UNROLL
        for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
          cute::gemm(tiled_mma, tCrA(_, 0, k_block, stage), tCrB(_, half, k_block, stage),
                     part(_, 0));
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        warpgroup_fence_operand(part);

        Tensor acc = accum(_, _, half);
        if constexpr (kBlockScaled) {
          // Scales to registers while the wgmmas run; sfb folds into sfa's row values.
          Tensor sfa = get<0>(scale_views)(_, _, half, make_coord(_0{}, stage));  // (MMA,1)
          Tensor sfb = get<1>(scale_views)(_, _, half, make_coord(_0{}, stage));
          Tensor scale = make_tensor_like<float>(sfa);
          Tensor scale_b = make_tensor_like<float>(sfb);
          copy(sfa, scale);
          copy(sfb, scale_b);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(filter_zeros(scale)); ++i) {
            filter_zeros(scale)(i) *= scale_b(_0{});
          }
          wait_and_release(half);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(acc); ++i) acc(i) += part(i) * scale(i);
        } else {
          wait_and_release(half);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(acc); ++i) acc(i) += part(i);
        }
        warpgroup_fence_operand(accum);
      }
      ++smem_pipe_read;
    }
  }

  // Per tensor, warpgroup 1: half h0's groups straddle two K tiles (the diagram above).
  // Assumes k_tile_count >= 1 (CheckFp8Gemm: K > 0).
  template <class FrgTensorC, class FrgTensorP, class TensorA, class TensorB>
  CUTLASS_DEVICE static void LaggingTensorMma(MainloopPipeline& pipeline,
                                              PipelineState smem_pipe_read, FrgTensorC& accum,
                                              FrgTensorP& part, TiledMma& tiled_mma,
                                              TensorA const& tCrA, TensorB const& tCrB,
                                              int k_tile_count) {
    using namespace cute;
    constexpr int kBlocks = decltype(size<2>(tCrA))::value;
    static_assert(kBlocks % 2 == 0, "a K tile splits into two halves");
    constexpr int kHalf = kBlocks / 2;
    auto begin_group = [&]() { BeginWgmmaGroup(tiled_mma, part); };
    // Blocks [k_begin, k_end) of one stage, columns `half`, into the open group.
    auto issue = [&](int stage, auto half, auto k_begin, auto k_end) {
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = decltype(k_begin)::value; k_block < decltype(k_end)::value; ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, 0, k_block, stage), tCrB(_, half, k_block, stage),
                   part(_, 0));
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
    };
    auto end_group_and_add = [&](auto half) {
      EndWgmmaGroupAndAdd(part, accum, accum(_, _, half));
    };

    PipelineState previous = smem_pipe_read;
    pipeline.consumer_wait(previous);
    begin_group();
    issue(previous.index(), _0{}, Int<0>{}, Int<kHalf>{});
    end_group_and_add(_0{});
    begin_group();
    issue(previous.index(), _1{}, Int<0>{}, Int<kBlocks>{});
    end_group_and_add(_1{});
    ++smem_pipe_read;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k_tile = 1; k_tile < k_tile_count; ++k_tile) {
      pipeline.consumer_wait(smem_pipe_read);
      begin_group();
      issue(previous.index(), _0{}, Int<kHalf>{}, Int<kBlocks>{});
      issue(smem_pipe_read.index(), _0{}, Int<0>{}, Int<kHalf>{});
      end_group_and_add(_0{});
      pipeline.consumer_release(previous);
      begin_group();
      issue(smem_pipe_read.index(), _1{}, Int<0>{}, Int<kBlocks>{});
      end_group_and_add(_1{});
      previous = smem_pipe_read;
      ++smem_pipe_read;
    }
    begin_group();
    issue(previous.index(), _0{}, Int<kHalf>{}, Int<kBlocks>{});
    end_group_and_add(_0{});
    pipeline.consumer_release(previous);
  }

  // mma() waited for every wgmma and released every stage it read.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};

}  // namespace jax_distgemm::cuda

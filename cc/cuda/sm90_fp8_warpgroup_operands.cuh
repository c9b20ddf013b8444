// What the fp8 promotion loops (sm90_fp8_staggered_mainloop.cuh, sm90_fp8_split_mainloop.cuh)
// share: the shared-memory operands one consumer warpgroup issues its wgmmas from, and the
// group of wgmmas whose partial sums it adds into the fp32 totals.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace jax_distgemm::cuda {

// The calling thread's consumer warpgroup, read from lane 0 as CUTLASS's mainloops do, so that
// the compiler keeps it uniform.
CUTLASS_DEVICE int WarpGroupIndex(int thread_idx) {
  return __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
}

// wgmma descriptors over every pipeline stage, sliced for the calling thread's warpgroup:
// (A (MMA,M,K,PIPE), B (MMA,N,K,PIPE)).
template <class TiledMma, class SmemLayoutA, class SmemLayoutB, class TensorStorage>
CUTLASS_DEVICE auto WarpGroupOperands(TiledMma const& tiled_mma, int thread_idx,
                                      TensorStorage& shared_tensors) {
  using namespace cute;
  constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
  const int warp_group = WarpGroupIndex(thread_idx);
  auto thread_mma = tiled_mma.get_slice(
      make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(warp_group));
  Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
  return make_tuple(thread_mma.make_fragment_A(thread_mma.partition_A(sA)),
                    thread_mma.make_fragment_B(thread_mma.partition_B(sB)));
}

// Opens a group of wgmmas into `part`; its first wgmma overwrites the previous partial sums.
template <class TiledMma, class Part>
CUTLASS_DEVICE void BeginWgmmaGroup(TiledMma& tiled_mma, Part& part) {
  cute::warpgroup_fence_operand(part);
  cute::warpgroup_arrive();
  tiled_mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
}

// Closes the open group, waits for it and adds its partial sums into `totals`, which is
// `accum` or a view of it.
template <class Part, class Accum, class Totals>
CUTLASS_DEVICE void EndWgmmaGroupAndAdd(Part& part, Accum& accum, Totals&& totals) {
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  cute::warpgroup_fence_operand(part);
  cute::warpgroup_fence_operand(accum);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(totals); ++i) totals(i) += part(i);
  cute::warpgroup_fence_operand(accum);
}

}  // namespace jax_distgemm::cuda

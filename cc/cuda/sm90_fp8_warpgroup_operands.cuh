// The shared-memory operands one consumer warpgroup issues its wgmmas from, for the fp8
// promotion loops (sm90_fp8_staggered_mainloop.cuh, sm90_fp8_split_mainloop.cuh).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace jax_distgemm::cuda {

// wgmma descriptors over every pipeline stage, sliced for the calling thread's warpgroup:
// (A (MMA,M,K,PIPE), B (MMA,N,K,PIPE)).  The warpgroup index is read from lane 0, as CUTLASS's
// mainloops do, so that the compiler keeps it uniform.
template <class TiledMma, class SmemLayoutA, class SmemLayoutB, class TensorStorage>
CUTLASS_DEVICE auto WarpGroupOperands(TiledMma const& tiled_mma, int thread_idx,
                                      TensorStorage& shared_tensors) {
  using namespace cute;
  constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
  const int warp_group =
      __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
  auto thread_mma = tiled_mma.get_slice(
      make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(warp_group));
  Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
  return make_tuple(thread_mma.make_fragment_A(thread_mma.partition_A(sA)),
                    thread_mma.make_fragment_B(thread_mma.partition_B(sB)));
}

}  // namespace jax_distgemm::cuda

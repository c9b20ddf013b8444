// Elementwise kernels of the executor (no CUTLASS): the final add of the copy-engine
// ReduceScatter path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cc/common/problem.h"
#include "cc/cuda/stage_sync.h"

namespace jax_distgemm::cuda {

// out[i] += addend[i] for n elements of type `t` (sum in fp32), after every block has seen
// `sync`'s flag (bounded wait; on timeout the block leaves out untouched).
std::string LaunchAddInPlace(ElemType t, void* out, const void* addend, int64_t n,
                             const StageSync& sync, int sm_count, cudaStream_t stream);

// Loads every kernel of this file on the current device (as PrepareGemmKernels does the
// GEMMs'): the add kernel spins on a peer's flag, so its first launch must not be the one that
// loads it (lazy loading; docs/design.md, "Symmetric workspace").
std::string PrepareCombineKernels();

}  // namespace jax_distgemm::cuda

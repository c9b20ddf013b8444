// Test helper: the layouts the fp8 stage GEMMs read of w (cc/cuda/fp8_gemm.h), made on the
// GPU from the API's.  fp8 wgmma reads B K-major, so w [K, N] becomes B^T = w^T [N, K], and its
// block scales follow it.  In the library XLA makes them (the lowering asks for K-major w).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jax_distgemm::cuda {

// in: fp8 [batch, K, N] row-major (ld_in >= N) -> out: fp8 [batch, N, K] row-major
// (ld_out >= K).  K, N, both leading dims, both batch strides (bytes) and both pointers must be
// multiples of 16.  Either fp8 type (a byte copy).  Returns "" or an error message.
std::string Fp8TransposeWeights(const void* in, int64_t ld_in, int64_t batch_stride_in, void* out,
                                int64_t ld_out, int64_t batch_stride_out, int64_t k, int64_t n,
                                int64_t batch, cudaStream_t stream);

// The block scales of w, in: fp32 [batch, k_blocks, n_blocks] row-major (ld_in >= n_blocks; the
// API's [K/128, N/128]) -> out: fp32 [batch, n_blocks, k_blocks] row-major (ld_out >= k_blocks;
// fp8_gemm.h's sfb, K-major like B^T).  k_blocks = ceil(K / 128), n_blocks = ceil(N / 128).
std::string Fp8TransposeBlockScales(const float* in, int64_t ld_in, int64_t batch_stride_in,
                                    float* out, int64_t ld_out, int64_t batch_stride_out,
                                    int64_t k_blocks, int64_t n_blocks, int64_t batch,
                                    cudaStream_t stream);

}  // namespace jax_distgemm::cuda

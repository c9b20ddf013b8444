// Stage GEMM instantiations: bfloat16_t inputs, bfloat16_t output, Coop128x256_C1x1.
#include <vector>

#include "cc/cuda/sm90_gemm.cuh"

namespace jax_distgemm::cuda {

void AddGemms_bf16_bf16_coop128x256_c1x1(std::vector<GemmEntry>* out) {
  constexpr GemmConfig kConfig = GemmConfig::kCoop128x256_C1x1;
  out->insert(out->end(), {DISTGEMM_GEMM_ENTRIES(kConfig, ElemType::kBF16, cutlass::bfloat16_t,
                                                 ElemType::kBF16, cutlass::bfloat16_t)});
}

}  // namespace jax_distgemm::cuda

// Stage GEMM instantiations: bfloat16_t inputs, float output, Coop128x256_C2x1.
#include <vector>

#include "cc/cuda/sm90_gemm.cuh"

namespace jax_distgemm::cuda {

void AddGemms_bf16_f32_coop128x256(std::vector<GemmEntry>* out) {
  constexpr GemmConfig kConfig = GemmConfig::kCoop128x256_C2x1;
  out->insert(out->end(), {DISTGEMM_GEMM_ENTRIES(kConfig, ElemType::kBF16, cutlass::bfloat16_t,
                                                 ElemType::kF32, float)});
}

}  // namespace jax_distgemm::cuda

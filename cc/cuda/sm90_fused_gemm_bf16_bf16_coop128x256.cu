// Fused (all stages in one grid) GEMM instantiations: bfloat16_t in and out, Coop128x256_C2x1.
#include <vector>

#include "cc/cuda/sm90_fused_gemm.cuh"

namespace jax_distgemm::cuda {

void AddFusedGemms_bf16_bf16_coop128x256(std::vector<GemmEntry>* out) {
  constexpr GemmConfig kConfig = GemmConfig::kCoop128x256_C2x1;
  out->insert(out->end(),
              {DISTGEMM_FUSED_GEMM_ENTRIES(kConfig, ElemType::kBF16, cutlass::bfloat16_t,
                                           ElemType::kBF16, cutlass::bfloat16_t)});
}

}  // namespace jax_distgemm::cuda

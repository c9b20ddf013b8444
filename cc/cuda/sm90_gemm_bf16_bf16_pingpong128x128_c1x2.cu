// Stage GEMM instantiations: bfloat16_t inputs, bfloat16_t output, Pingpong128x128_C1x2.
#include <vector>

#include "cc/cuda/sm90_gemm.cuh"

namespace jax_distgemm::cuda {

void AddGemms_bf16_bf16_pingpong128x128_c1x2(std::vector<GemmEntry>* out) {
  constexpr GemmConfig kConfig = GemmConfig::kPingpong128x128_C1x2;
  out->insert(out->end(), {DISTGEMM_GEMM_ENTRIES(kConfig, ElemType::kBF16, cutlass::bfloat16_t,
                                                 ElemType::kBF16, cutlass::bfloat16_t)});
}

}  // namespace jax_distgemm::cuda

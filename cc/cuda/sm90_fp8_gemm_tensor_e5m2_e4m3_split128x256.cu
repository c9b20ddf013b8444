// Per-tensor scaled fp8 stage GEMMs: float8_e5m2 (gradients) x float8_e4m3fn, Split128x256_C2x1.
#include <vector>

#include "cc/cuda/sm90_fp8_gemm.cuh"

namespace jax_distgemm::cuda {

void AddFp8Gemms_tensor_e5m2_e4m3_split128x256(std::vector<Fp8GemmEntry>* out) {
  constexpr Fp8Scaling kScaling = Fp8Scaling::kTensor;
  constexpr Fp8Config kConfig = Fp8Config::kSplit128x256_C2x1;
  constexpr Fp8Type kA = Fp8Type::kE5M2, kB = Fp8Type::kE4M3;
  out->insert(out->end(), {
      DISTGEMM_FP8_ENTRY(kScaling, kConfig, kA, kB, ElemType::kBF16, true),
      DISTGEMM_FP8_ENTRY(kScaling, kConfig, kA, kB, ElemType::kF32, true),
  });
}

}  // namespace jax_distgemm::cuda

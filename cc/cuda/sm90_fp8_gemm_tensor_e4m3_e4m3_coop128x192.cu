// Per-tensor scaled fp8 stage GEMM: float8_e4m3fn x float8_e4m3fn, Coop128x192_C2x1 (fewer operand
// bytes per MAC than 128x128: 1/128 + 1/192 against 2/128), bf16 output without C: the
// alternative for the common launch.
#include <vector>

#include "cc/cuda/sm90_fp8_gemm.cuh"

namespace jax_distgemm::cuda {

void AddFp8Gemms_tensor_e4m3_e4m3_coop128x192(std::vector<Fp8GemmEntry>* out) {
  constexpr Fp8Scaling kScaling = Fp8Scaling::kTensor;
  constexpr Fp8Config kConfig = Fp8Config::kCoop128x192_C2x1;
  constexpr Fp8Type kA = Fp8Type::kE4M3, kB = Fp8Type::kE4M3;
  out->insert(out->end(), {
      DISTGEMM_FP8_ENTRY(kScaling, kConfig, kA, kB, ElemType::kBF16, false),
  });
}

}  // namespace jax_distgemm::cuda

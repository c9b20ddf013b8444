// Block-scaled fp8 stage GEMMs: float8_e4m3fn x float8_e4m3fn, Coop128x128_C1x2, CUTLASS's
// blockwise loop (the second block config, after Split128x256_C2x1).  The bf16 output has a
// kernel without C too (as sm90_fp8_gemm_tensor_e4m3_e4m3_stagger128x192.cu; here the source's
// shared memory also costs a mainloop stage: 5 instead of 6).
#include <vector>

#include "cc/cuda/sm90_fp8_gemm.cuh"

namespace jax_distgemm::cuda {

void AddFp8Gemms_block_e4m3_e4m3_coop128x128_c1x2(std::vector<Fp8GemmEntry>* out) {
  constexpr Fp8Scaling kScaling = Fp8Scaling::kBlock;
  constexpr Fp8Config kConfig = Fp8Config::kCoop128x128_C1x2;
  constexpr Fp8Type kA = Fp8Type::kE4M3, kB = Fp8Type::kE4M3;
  out->insert(out->end(), {
      DISTGEMM_FP8_ENTRY(kScaling, kConfig, kA, kB, ElemType::kBF16, false),
      DISTGEMM_FP8_ENTRY(kScaling, kConfig, kA, kB, ElemType::kBF16, true),
      DISTGEMM_FP8_ENTRY(kScaling, kConfig, kA, kB, ElemType::kF32, true),
  });
}

}  // namespace jax_distgemm::cuda

// Per-tensor scaled fp8 stage GEMMs: float8_e4m3fn x float8_e4m3fn, Split128x256_C2x1.
// The bf16 output has a kernel without C too: the no-C stage of an AllGather is the common
// launch, and a kernel with C runs it without DelayTmaStore (CUTLASS delays the TMA store wait
// only without a source).
#include <vector>

#include "cc/cuda/sm90_fp8_gemm.cuh"

namespace jax_distgemm::cuda {

void AddFp8Gemms_tensor_e4m3_e4m3_split128x256(std::vector<Fp8GemmEntry>* out) {
  constexpr Fp8Scaling kScaling = Fp8Scaling::kTensor;
  constexpr Fp8Config kConfig = Fp8Config::kSplit128x256_C2x1;
  constexpr Fp8Type kA = Fp8Type::kE4M3, kB = Fp8Type::kE4M3;
  out->insert(out->end(), {
      DISTGEMM_FP8_ENTRY(kScaling, kConfig, kA, kB, ElemType::kBF16, false),
      DISTGEMM_FP8_ENTRY(kScaling, kConfig, kA, kB, ElemType::kBF16, true),
      DISTGEMM_FP8_ENTRY(kScaling, kConfig, kA, kB, ElemType::kF32, true),
  });
}

}  // namespace jax_distgemm::cuda

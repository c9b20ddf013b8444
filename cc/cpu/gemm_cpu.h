// Reference GEMM for the CPU executor: fp32 accumulation, bf16/fp16/fp32 in and out, and fp8
// operands with their scales (products of the dequantized values).
#pragma once

#include <cstdint>

#include "cc/common/problem.h"

namespace jax_distgemm {

// D = alpha * (A @ B) + running_sum + beta * c, batched over L.
// `running_sum` (ReduceScatter partials, fp32) and `c` (of type c_type) are optional (nullptr).
struct CpuGemmArgs {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  ElemType a_type = ElemType::kF32, b_type = ElemType::kF32;
  const void* a = nullptr;
  MatrixView a_view;
  const void* b = nullptr;
  MatrixView b_view;
  // fp8 operands: one scale each (kTensor), or a_scale per row and 128 of K and b_scale per
  // 128x128 block (kBlock), views in scale elements; A and B start on block boundaries.
  Scaling scaling = Scaling::kNone;
  const float* a_scale = nullptr;
  MatrixView a_scale_view;
  const float* b_scale = nullptr;
  MatrixView b_scale_view;
  float alpha = 1.f;
  const float* running_sum = nullptr;
  MatrixView running_sum_view;
  const void* c = nullptr;
  ElemType c_type = ElemType::kF32;
  MatrixView c_view;
  float beta = 0.f;
  ElemType d_type = ElemType::kF32;
  void* d = nullptr;
  MatrixView d_view;
};

void GemmCpu(const CpuGemmArgs& args);

}  // namespace jax_distgemm

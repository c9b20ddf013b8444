// Reference GEMM for the CPU executor: fp32 accumulation, bf16/fp16/fp32 in and out.
#pragma once

#include <cstdint>

#include "cc/common/problem.h"

namespace jax_distgemm {

// D = alpha * (A @ B) + running_sum + beta * c, batched over L.
// `running_sum` (ReduceScatter partials, fp32) and `c` (of type c_type) are optional (nullptr).
struct CpuGemmArgs {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  ElemType ab_type = ElemType::kF32;
  const void* a = nullptr;
  MatrixView a_view;
  const void* b = nullptr;
  MatrixView b_view;
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

// Host-side CUDA error plumbing of the executor: errors travel as strings ("" = success), which
// the handler turns into FFI errors naming the device.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace jax_distgemm::cuda {

// "<what>: <CUDA's message>"; clears the sticky last error.
inline std::string CudaError(const char* what, cudaError_t e) {
  cudaGetLastError();
  return std::string(what) + ": " + cudaGetErrorString(e);
}

}  // namespace jax_distgemm::cuda

// Returns CudaError("<expr>", e) from the enclosing function (which returns std::string) when
// `expr` is not cudaSuccess.
#define JDG_RETURN_IF_CUDA_ERROR(expr)                                   \
  do {                                                                   \
    cudaError_t _jdg_e = (expr);                                         \
    if (_jdg_e != cudaSuccess) {                                         \
      return ::jax_distgemm::cuda::CudaError(#expr, _jdg_e);             \
    }                                                                    \
  } while (0)

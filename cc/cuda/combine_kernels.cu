#include "cc/cuda/combine_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cc/cuda/stage_sync_device.cuh"

namespace jax_distgemm::cuda {
namespace {

__device__ __forceinline__ float ToF32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToF32(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToF32(float v) { return v; }
template <class T> __device__ __forceinline__ T FromF32(float v);
template <> __device__ __forceinline__ __nv_bfloat16 FromF32(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half FromF32(float v) { return __float2half(v); }
template <> __device__ __forceinline__ float FromF32(float v) { return v; }

// One 16-byte vector per thread per step; a scalar loop takes the tail.
template <class T>
__global__ void __launch_bounds__(256) AddInPlaceKernel(T* out, const T* addend, int64_t n,
                                                        StageSync sync) {
  __shared__ uint32_t go;
  if (sync.wait_flag != nullptr) {
    if (threadIdx.x == 0) go = WaitFlag(sync) ? 1u : 0u;
    __syncthreads();
    if (go == 0u) return;
  }
  constexpr int kVec = 16 / sizeof(T);
  const int64_t n_vec = n / kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  auto* out4 = reinterpret_cast<uint4*>(out);
  const auto* add4 = reinterpret_cast<const uint4*>(addend);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n_vec;
       i += stride) {
    uint4 a = out4[i];
    const uint4 b = add4[i];
    T* av = reinterpret_cast<T*>(&a);
    const T* bv = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int j = 0; j < kVec; ++j) av[j] = FromF32<T>(ToF32(av[j]) + ToF32(bv[j]));
    out4[i] = a;
  }
  for (int64_t i = n_vec * kVec + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < n; i += stride) {
    out[i] = FromF32<T>(ToF32(out[i]) + ToF32(addend[i]));
  }
}

template <class T>
std::string Launch(void* out, const void* addend, int64_t n, const StageSync& sync,
                   int sm_count, cudaStream_t stream) {
  const int blocks = sm_count > 0 ? 4 * sm_count : 528;
  AddInPlaceKernel<T><<<blocks, 256, 0, stream>>>(static_cast<T*>(out),
                                                  static_cast<const T*>(addend), n, sync);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("add kernel: ") + cudaGetErrorString(e);
}

}  // namespace

std::string PrepareCombineKernels() {
  // cudaFuncGetAttributes needs the function's module: it loads it now.
  cudaFuncAttributes attr;
  for (const void* f : {reinterpret_cast<const void*>(&AddInPlaceKernel<__nv_bfloat16>),
                        reinterpret_cast<const void*>(&AddInPlaceKernel<__half>),
                        reinterpret_cast<const void*>(&AddInPlaceKernel<float>)}) {
    if (cudaError_t e = cudaFuncGetAttributes(&attr, f); e != cudaSuccess) {
      return std::string("add kernel: cudaFuncGetAttributes: ") + cudaGetErrorString(e);
    }
  }
  return "";
}

std::string LaunchAddInPlace(ElemType t, void* out, const void* addend, int64_t n,
                             const StageSync& sync, int sm_count, cudaStream_t stream) {
  // NOTE: both pointers come from 256-byte aligned buffers (XLA outputs, workspace slots), so
  // the 16-byte vector casts are safe.
  switch (t) {
    case ElemType::kBF16: return Launch<__nv_bfloat16>(out, addend, n, sync, sm_count, stream);
    case ElemType::kF16: return Launch<__half>(out, addend, n, sync, sm_count, stream);
    case ElemType::kF32: return Launch<float>(out, addend, n, sync, sm_count, stream);
    default: return "add kernel: unsupported type";
  }
}

}  // namespace jax_distgemm::cuda

// fp8 weight and block-scale transposes (fp8_transpose.h).  Memory-bound: 16-byte loads and
// stores, both coalesced; the byte transpose happens in registers, 4x4 bytes per thread.
#include "tests/cuda/fp8_transpose.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jax_distgemm::cuda {
namespace {

// One 64 x 64 byte tile per block of 256 threads.
constexpr int kTile = 64;
constexpr int kThreads = 256;
// Word pitches of the shared tiles.  In: 20 words (16-byte rows for the uint4 stores; the
// phase-2 word reads of two 4-row groups land 16 banks apart).  Out: 17 words (the phase-2 word
// stores and phase-3 word loads spread over the banks; at most 2-way conflicts).
constexpr int kInPitch = 20;
constexpr int kOutPitch = 17;

__global__ void __launch_bounds__(kThreads)
    TransposeFp8Kernel(const uint8_t* __restrict__ in, int64_t ld_in, int64_t batch_stride_in,
                       uint8_t* __restrict__ out, int64_t ld_out, int64_t batch_stride_out,
                       int64_t k, int64_t n) {
  __shared__ uint32_t s_in[kTile * kInPitch];
  __shared__ uint32_t s_out[kTile * kOutPitch];
  const int t = threadIdx.x;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kTile;
  in += blockIdx.z * batch_stride_in;
  out += blockIdx.z * batch_stride_out;

  // Rows of in: k0 + t / 4, bytes n0 + 16 (t % 4) ..  (K, N are multiples of 16: a 16-byte
  // chunk is wholly inside or outside.)
  {
    const int row = t / 4, chunk = t % 4;
    const int64_t gk = k0 + row, gn = n0 + 16 * chunk;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (gk < k && gn < n) v = *reinterpret_cast<const uint4*>(in + gk * ld_in + gn);
    *reinterpret_cast<uint4*>(&s_in[row * kInPitch + 4 * chunk]) = v;
  }
  __syncthreads();

  // 4x4 bytes: rows 4 kb .. 4 kb + 3 of in, bytes 4 nb .. 4 nb + 3 -> rows 4 nb .. of out.
  {
    const int kb = t / 16, nb = t % 16;
    const uint32_t w0 = s_in[(4 * kb + 0) * kInPitch + nb];
    const uint32_t w1 = s_in[(4 * kb + 1) * kInPitch + nb];
    const uint32_t w2 = s_in[(4 * kb + 2) * kInPitch + nb];
    const uint32_t w3 = s_in[(4 * kb + 3) * kInPitch + nb];
    // Interleave pairs: lo = [w0.b0, w1.b0, w0.b1, w1.b1], hi = the same of bytes 2, 3.
    const uint32_t lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
    const uint32_t lo23 = __byte_perm(w2, w3, 0x5140), hi23 = __byte_perm(w2, w3, 0x7362);
    // Byte i of each wj, j = 0..3: column 4 nb + i of in, K bytes 4 kb .. 4 kb + 3.
    s_out[(4 * nb + 0) * kOutPitch + kb] = __byte_perm(lo01, lo23, 0x5410);
    s_out[(4 * nb + 1) * kOutPitch + kb] = __byte_perm(lo01, lo23, 0x7632);
    s_out[(4 * nb + 2) * kOutPitch + kb] = __byte_perm(hi01, hi23, 0x5410);
    s_out[(4 * nb + 3) * kOutPitch + kb] = __byte_perm(hi01, hi23, 0x7632);
  }
  __syncthreads();

  // Rows of out: n0 + t / 4, bytes k0 + 16 (t % 4) ..
  {
    const int row = t / 4, chunk = t % 4;
    const int64_t gn = n0 + row, gk = k0 + 16 * chunk;
    if (gn < n && gk < k) {
      const uint32_t* s = &s_out[row * kOutPitch + 4 * chunk];
      *reinterpret_cast<uint4*>(out + gn * ld_out + gk) = make_uint4(s[0], s[1], s[2], s[3]);
    }
  }
}

__global__ void TransposeScalesKernel(const float* __restrict__ in, int64_t ld_in,
                                      int64_t batch_stride_in, float* __restrict__ out,
                                      int64_t ld_out, int64_t batch_stride_out, int64_t k_blocks,
                                      int64_t n_blocks) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= k_blocks * n_blocks) return;
  const int64_t nb = i / k_blocks, kb = i % k_blocks;  // consecutive threads: consecutive stores
  out[blockIdx.y * batch_stride_out + nb * ld_out + kb] =
      in[blockIdx.y * batch_stride_in + kb * ld_in + nb];
}

bool Aligned16(int64_t v) { return v % 16 == 0; }
bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

std::string Fp8TransposeWeights(const void* in, int64_t ld_in, int64_t batch_stride_in, void* out,
                                int64_t ld_out, int64_t batch_stride_out, int64_t k, int64_t n,
                                int64_t batch, cudaStream_t stream) {
  if (k <= 0 || n <= 0 || batch <= 0) return "Fp8TransposeWeights: empty or negative extent";
  if (ld_in < n || ld_out < k) return "Fp8TransposeWeights: leading dim below the row length";
  if (!Aligned16(k) || !Aligned16(n) || !Aligned16(ld_in) || !Aligned16(ld_out) ||
      !Aligned16(in) || !Aligned16(out) ||
      (batch > 1 && (!Aligned16(batch_stride_in) || !Aligned16(batch_stride_out)))) {
    return "Fp8TransposeWeights: K, N, leading dims, batch strides and pointers must be "
           "multiples of 16 bytes";
  }
  const int64_t tiles_k = (k + kTile - 1) / kTile;
  if (tiles_k > 65535 || batch > 65535) return "Fp8TransposeWeights: K or batch too large";
  dim3 grid(static_cast<unsigned>((n + kTile - 1) / kTile), static_cast<unsigned>(tiles_k),
            static_cast<unsigned>(batch));
  TransposeFp8Kernel<<<grid, kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(in), ld_in, batch_stride_in, static_cast<uint8_t*>(out), ld_out,
      batch_stride_out, k, n);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("Fp8TransposeWeights: ") + cudaGetErrorString(e);
}

std::string Fp8TransposeBlockScales(const float* in, int64_t ld_in, int64_t batch_stride_in,
                                    float* out, int64_t ld_out, int64_t batch_stride_out,
                                    int64_t k_blocks, int64_t n_blocks, int64_t batch,
                                    cudaStream_t stream) {
  if (k_blocks <= 0 || n_blocks <= 0 || batch <= 0) {
    return "Fp8TransposeBlockScales: empty or negative extent";
  }
  if (ld_in < n_blocks || ld_out < k_blocks) {
    return "Fp8TransposeBlockScales: leading dim below the row length";
  }
  if (batch > 65535) return "Fp8TransposeBlockScales: batch too large";
  const int64_t count = k_blocks * n_blocks;
  dim3 grid(static_cast<unsigned>((count + 255) / 256), static_cast<unsigned>(batch));
  TransposeScalesKernel<<<grid, 256, 0, stream>>>(in, ld_in, batch_stride_in, out, ld_out,
                                                  batch_stride_out, k_blocks, n_blocks);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("Fp8TransposeBlockScales: ") + cudaGetErrorString(e);
}

}  // namespace jax_distgemm::cuda

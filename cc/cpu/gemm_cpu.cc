#include "cc/cpu/gemm_cpu.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace jax_distgemm {
namespace {

// -- Scalar conversions (round-to-nearest-even, as XLA does) -------------------------------------

float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
    return sign ? -f : f;
  }
  uint32_t u = exp == 31 ? (sign | 0x7f800000u | (man << 13))
                         : (sign | ((exp + 112u) << 23) | (man << 13));
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00u;
  if (a >= 65520.f) return sign | 0x7c00u;  // overflow to inf
  if (a < 6.103515625e-05f) {               // subnormal half: step 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  // 11 significant bits: scale mantissa to [1024, 2048), round to nearest even.
  float scaled = std::nearbyint(m * 2048.f);
  if (scaled >= 2048.f) {
    scaled /= 2.f;
    ++e;
  }
  const uint32_t exp = static_cast<uint32_t>(e - 1 + 15);
  if (exp >= 31) return sign | 0x7c00u;
  return sign | static_cast<uint16_t>((exp << 10) | (static_cast<uint32_t>(scaled) & 0x3ffu));
}

// float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN.  float8_e5m2: the top byte of a
// float16.
float F8E4M3ToF32(uint8_t b) {
  const int exp = (b >> 3) & 0xf, man = b & 7;
  float f = exp == 15 && man == 7 ? NAN
            : exp == 0            ? std::ldexp(static_cast<float>(man), -9)
                                  : std::ldexp(static_cast<float>(8 + man), exp - 10);
  return (b & 0x80) ? -f : f;
}

float Load(ElemType t, const void* base, int64_t i) {
  switch (t) {
    case ElemType::kF8E4M3: return F8E4M3ToF32(static_cast<const uint8_t*>(base)[i]);
    case ElemType::kF8E5M2:
      return F16ToF32(static_cast<uint16_t>(static_cast<const uint8_t*>(base)[i] << 8));
    case ElemType::kBF16: return Bf16ToF32(static_cast<const uint16_t*>(base)[i]);
    case ElemType::kF16: return F16ToF32(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

void Store(ElemType t, void* base, int64_t i, float v) {
  switch (t) {
    case ElemType::kBF16: static_cast<uint16_t*>(base)[i] = F32ToBf16(v); break;
    case ElemType::kF16: static_cast<uint16_t*>(base)[i] = F32ToF16(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

// The scale of A's element (l, i, kk) or B's (l, kk, j); 1 without scaling.
float AScale(const CpuGemmArgs& g, int64_t l, int64_t i, int64_t kk) {
  if (g.scaling == Scaling::kNone) return 1.f;
  if (g.scaling == Scaling::kTensor) return g.a_scale[0];
  const MatrixView& v = g.a_scale_view;
  return g.a_scale[v.offset + l * v.batch_stride + i * v.ld + kk / kScaleBlock];
}
float BScale(const CpuGemmArgs& g, int64_t l, int64_t kk, int64_t j) {
  if (g.scaling == Scaling::kNone) return 1.f;
  if (g.scaling == Scaling::kTensor) return g.b_scale[0];
  const MatrixView& v = g.b_scale_view;
  return g.b_scale[v.offset + l * v.batch_stride + (kk / kScaleBlock) * v.ld + j / kScaleBlock];
}

}  // namespace

void GemmCpu(const CpuGemmArgs& g) {
  std::vector<float> a_row(g.k), b_tile(g.k * g.n), acc(g.n);
  for (int64_t l = 0; l < g.batch; ++l) {
    // B for this batch, widened (and dequantized) once: [k, n].
    const int64_t b0 = g.b_view.offset + l * g.b_view.batch_stride;
    for (int64_t kk = 0; kk < g.k; ++kk) {
      for (int64_t j = 0; j < g.n; ++j) {
        b_tile[kk * g.n + j] = Load(g.b_type, g.b, b0 + kk * g.b_view.ld + j) * BScale(g, l, kk, j);
      }
    }
    for (int64_t i = 0; i < g.m; ++i) {
      const int64_t a0 = g.a_view.offset + l * g.a_view.batch_stride + i * g.a_view.ld;
      for (int64_t kk = 0; kk < g.k; ++kk) {
        a_row[kk] = Load(g.a_type, g.a, a0 + kk) * AScale(g, l, i, kk);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t kk = 0; kk < g.k; ++kk) {
        const float av = a_row[kk];
        const float* brow = &b_tile[kk * g.n];
        for (int64_t j = 0; j < g.n; ++j) acc[j] += av * brow[j];
      }
      const int64_t d0 = g.d_view.offset + l * g.d_view.batch_stride + i * g.d_view.ld;
      for (int64_t j = 0; j < g.n; ++j) {
        float v = g.alpha * acc[j];
        if (g.running_sum) {
          v += g.running_sum[g.running_sum_view.offset + l * g.running_sum_view.batch_stride +
                             i * g.running_sum_view.ld + j];
        }
        if (g.c) {
          v += g.beta * Load(g.c_type, g.c,
                             g.c_view.offset + l * g.c_view.batch_stride + i * g.c_view.ld + j);
        }
        Store(g.d_type, g.d, d0 + j, v);
      }
    }
  }
}

}  // namespace jax_distgemm

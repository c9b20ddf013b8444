// Table of the compiled fp8 stage GEMMs (one AddFp8Gemms_* function per sm90_fp8_gemm_*.cu
// file), launch checks and dispatch.
#include "cc/cuda/fp8_gemm.h"

#include <cstdint>
#include <string>
#include <vector>

namespace jax_distgemm::cuda {

void AddFp8Gemms_tensor_e4m3_e4m3_stagger128x192(std::vector<Fp8GemmEntry>* out);
void AddFp8Gemms_tensor_e5m2_e4m3_stagger128x192(std::vector<Fp8GemmEntry>* out);
void AddFp8Gemms_tensor_e4m3_e4m3_split128x256(std::vector<Fp8GemmEntry>* out);
void AddFp8Gemms_tensor_e5m2_e4m3_split128x256(std::vector<Fp8GemmEntry>* out);
void AddFp8Gemms_block_e4m3_e4m3_coop128x128_c1x2(std::vector<Fp8GemmEntry>* out);
void AddFp8Gemms_block_e4m3_e4m3_split128x256_c2x1(std::vector<Fp8GemmEntry>* out);

namespace {

// In default preference order within each (scaling, types, output): the first entry of a
// combination is what Fp8AvailableConfigs lists first.
const std::vector<Fp8GemmEntry>& Registry() {
  static const std::vector<Fp8GemmEntry>* entries = [] {
    auto* e = new std::vector<Fp8GemmEntry>();
    AddFp8Gemms_tensor_e4m3_e4m3_stagger128x192(e);
    AddFp8Gemms_tensor_e5m2_e4m3_stagger128x192(e);
    AddFp8Gemms_tensor_e4m3_e4m3_split128x256(e);
    AddFp8Gemms_tensor_e5m2_e4m3_split128x256(e);
    AddFp8Gemms_block_e4m3_e4m3_split128x256_c2x1(e);
    AddFp8Gemms_block_e4m3_e4m3_coop128x128_c1x2(e);
    return e;
  }();
  return *entries;
}

bool Aligned16(int64_t bytes) { return bytes % 16 == 0; }
bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
constexpr int64_t kInt32Max = INT32_MAX;

}  // namespace

const char* Fp8ConfigName(Fp8Config c) {
  switch (c) {
    case Fp8Config::kCoop128x128_C1x2: return "Cooperative 128x128x128 cluster 1x2";
    case Fp8Config::kStagger128x192_C2x1: return "Staggered promotion 128x192x128 cluster 2x1";
    case Fp8Config::kSplit128x256_C2x1: return "Split promotion 128x256x128 cluster 2x1";
  }
  return "?";
}

Fp8Config Fp8PickConfig(Fp8Scaling scaling, const Fp8Config* configs, int count, int64_t m,
                        int64_t n, int64_t batch, int sm_count) {
  // The staggered loop's rate per flop at 128x192 over the split loop's at 128x256, per
  // tensor on an H100 (docs/benchmarks.md).
  constexpr double kStaggerRate = 1.07;
  if (count < 1) return Fp8Config::kStagger128x192_C2x1;
  const int clusters = sm_count / 2;  // per tensor, 2x1 clusters of 128-row tiles (asserted)
  if (scaling != Fp8Scaling::kTensor || clusters < 1) return configs[0];
  Fp8Config best = configs[0];
  double best_cost = 0;
  for (int i = 0; i < count; ++i) {
    const int tile_n = Fp8ConfigTileN(configs[i]);
    const int64_t cluster_tiles = (m + 255) / 256 * ((n + tile_n - 1) / tile_n) * batch;
    const int64_t waves = (cluster_tiles + clusters - 1) / clusters;
    const double rate = configs[i] == Fp8Config::kStagger128x192_C2x1 ? kStaggerRate : 1.0;
    const double cost = static_cast<double>(waves) * tile_n / rate;
    if (i == 0 || cost < best_cost) best = configs[i], best_cost = cost;
  }
  return best;
}

const char* Fp8TypeName(Fp8Type t) {
  switch (t) {
    case Fp8Type::kE4M3: return "float8_e4m3fn";
    case Fp8Type::kE5M2: return "float8_e5m2";
  }
  return "?";
}

const char* Fp8ScalingName(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::kTensor: return "per-tensor";
    case Fp8Scaling::kBlock: return "block";
  }
  return "?";
}

const Fp8GemmEntry* Fp8GemmEntries(int* count) {
  *count = static_cast<int>(Registry().size());
  return Registry().data();
}

const Fp8GemmEntry* FindFp8Gemm(const Fp8GemmLaunch& g) {
  const bool has_c = g.ops.c != nullptr;
  const Fp8GemmEntry* with_c = nullptr;
  for (const Fp8GemmEntry& e : Registry()) {
    if (e.scaling != g.scaling || e.config != g.config || e.a_type != g.a_type ||
        e.b_type != g.b_type || e.d_type != g.d_type) {
      continue;
    }
    if (e.has_c == has_c) return &e;
    if (e.has_c) with_c = &e;  // serves a launch without C too
  }
  return with_c;
}

int Fp8AvailableConfigs(Fp8Scaling scaling, Fp8Type a_type, Fp8Type b_type, ElemType d_type,
                        bool has_c, Fp8Config* out, int max) {
  int n = 0;
  for (const Fp8GemmEntry& e : Registry()) {
    if (e.scaling != scaling || e.a_type != a_type || e.b_type != b_type || e.d_type != d_type ||
        (has_c && !e.has_c)) {
      continue;
    }
    bool seen = false;
    for (int i = 0; i < n; ++i) seen = seen || out[i] == e.config;
    if (!seen && n < max) out[n++] = e.config;
  }
  return n;
}

std::string CheckFp8Gemm(const Fp8GemmLaunch& g) {
  const Fp8GemmOperands& o = g.ops;
  if (g.d_type != ElemType::kBF16 && g.d_type != ElemType::kF32) {
    return "fp8 GEMM: the output must be bfloat16 or float32";
  }
  if (o.m <= 0 || o.n <= 0 || o.k <= 0 || o.batch <= 0) {
    return "fp8 GEMM: M, N, K and the batch must be positive";
  }
  if (o.m > kInt32Max || o.n > kInt32Max || o.k > kInt32Max || o.batch > kInt32Max) {
    return "fp8 GEMM: M, N, K and the batch must fit in int32 (CUTLASS's problem shape)";
  }
  if (o.a == nullptr || o.b == nullptr || o.d == nullptr) {
    return "fp8 GEMM: A, B and D must be set";
  }
  if (o.lda < o.k || o.ldb < o.k || o.ldd < o.n || (o.c != nullptr && o.ldc < o.n)) {
    return "fp8 GEMM: a leading dimension is below its row length (lda, ldb >= K; ldc, ldd >= N)";
  }
  // TMA: 16-byte aligned base addresses, row pitches, batch strides and row lengths.
  const int64_t d_size = g.d_type == ElemType::kF32 ? 4 : 2;
  if (!Aligned16(o.a) || !Aligned16(o.b) || !Aligned16(o.d) || !Aligned16(o.c)) {
    return "fp8 GEMM: A, B, C and D must be 16-byte aligned";
  }
  if (!Aligned16(o.lda) || !Aligned16(o.ldb) || !Aligned16(o.ldd * d_size) ||
      !Aligned16(o.ldc * d_size)) {
    return "fp8 GEMM: every row pitch must be a multiple of 16 bytes";
  }
  if (o.batch > 1 && (!Aligned16(o.batch_stride_a) || !Aligned16(o.batch_stride_b) ||
                      !Aligned16(o.batch_stride_d * d_size) ||
                      !Aligned16(o.batch_stride_c * d_size))) {
    return "fp8 GEMM: every batch stride must be a multiple of 16 bytes";
  }
  if (!Aligned16(o.k) || !Aligned16(o.n * d_size)) {
    return "fp8 GEMM: K must be a multiple of 16 and N of 16 bytes of the output";
  }
  if (g.scaling == Fp8Scaling::kTensor) {
    if (o.scale_a == nullptr || o.scale_b == nullptr) {
      return "fp8 GEMM (per-tensor): scale_a and scale_b must point to device fp32 scalars";
    }
  } else {
    if (g.a_type != Fp8Type::kE4M3 || g.b_type != Fp8Type::kE4M3) {
      return "fp8 GEMM (block scaling): only float8_e4m3fn x float8_e4m3fn is compiled";
    }
    if (o.sfa == nullptr || o.sfb == nullptr) {
      return "fp8 GEMM (block scaling): sfa and sfb must be set";
    }
    const int64_t kb = (o.k + 127) / 128, nb = (o.n + 127) / 128;
    if (o.ld_sfa < kb || o.ld_sfb < kb) {
      return "fp8 GEMM (block scaling): ld_sfa and ld_sfb must be >= ceil(K / 128)";
    }
    // CUTLASS's scale layouts hold int32 strides and extents.
    if (o.ld_sfa * o.m > kInt32Max || o.ld_sfb * nb > kInt32Max ||
        o.batch_stride_sfa > kInt32Max || o.batch_stride_sfb > kInt32Max ||
        o.batch_stride_sfa < 0 || o.batch_stride_sfb < 0) {
      return "fp8 GEMM (block scaling): scale offsets must fit in int32";
    }
  }
  return "";
}

std::string LaunchFp8Gemm(const Fp8GemmLaunch& g, cudaStream_t stream) {
  std::string err = CheckFp8Gemm(g);
  if (!err.empty()) return err;
  const Fp8GemmEntry* e = FindFp8Gemm(g);
  if (e == nullptr) {
    return std::string("no ") + Fp8ScalingName(g.scaling) + " fp8 GEMM compiled for " +
           Fp8TypeName(g.a_type) + " x " + Fp8TypeName(g.b_type) + " -> " + ElemName(g.d_type) +
           (g.ops.c != nullptr ? " with C" : "") + " with " + Fp8ConfigName(g.config);
  }
  return e->launch(g, stream);
}

size_t Fp8GemmWorkspaceBytes(const Fp8GemmLaunch& g) {
  const Fp8GemmEntry* e = FindFp8Gemm(g);
  return e == nullptr ? 0 : e->workspace_bytes(g);
}

std::string PrepareFp8GemmKernels() {
  for (const Fp8GemmEntry& e : Registry()) {
    std::string err = e.prepare();
    if (!err.empty()) return std::string(Fp8ConfigName(e.config)) + ": " + err;
  }
  return "";
}

}  // namespace jax_distgemm::cuda

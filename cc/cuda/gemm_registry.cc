// Table of the compiled stage GEMMs (one AddGemms_* function per sm90_gemm_*.cu file).
#include <vector>

#include "cc/cuda/gemm_kernels.h"

namespace jax_distgemm::cuda {

void AddGemms_bf16_bf16_coop128x256(std::vector<GemmEntry>* out);
void AddGemms_bf16_bf16_coop256x128(std::vector<GemmEntry>* out);
void AddGemms_bf16_bf16_pingpong128x128_c1x2(std::vector<GemmEntry>* out);
void AddGemms_bf16_bf16_pingpong128x128_c2x1(std::vector<GemmEntry>* out);
void AddGemms_bf16_bf16_coop256x128_c2x1(std::vector<GemmEntry>* out);
void AddGemms_bf16_bf16_coop128x256_c1x2(std::vector<GemmEntry>* out);
void AddGemms_bf16_bf16_coop128x256_c1x1(std::vector<GemmEntry>* out);
void AddGemms_bf16_bf16_coop256x192_c1x1(std::vector<GemmEntry>* out);
void AddGemms_bf16_f32_coop128x256(std::vector<GemmEntry>* out);
void AddGemms_f16_f16_coop128x256(std::vector<GemmEntry>* out);
void AddGemms_f16_f32_coop128x256(std::vector<GemmEntry>* out);
void AddFusedGemms_bf16_bf16_coop128x256(std::vector<GemmEntry>* out);
void AddFusedGemms_bf16_bf16_coop128x256_c1x1(std::vector<GemmEntry>* out);
void AddFusedGemms_bf16_bf16_coop256x128_c2x1(std::vector<GemmEntry>* out);
void AddFusedGemms_bf16_bf16_pingpong128x128_c1x2(std::vector<GemmEntry>* out);
void AddFusedGemms_bf16_bf16_coop256x192_c1x1(std::vector<GemmEntry>* out);

namespace {

const std::vector<GemmEntry>& Registry() {
  static const std::vector<GemmEntry>* entries = [] {
    auto* e = new std::vector<GemmEntry>();
    AddGemms_bf16_bf16_coop128x256(e);
    AddGemms_bf16_bf16_coop256x128(e);
    AddGemms_bf16_bf16_pingpong128x128_c1x2(e);
    AddGemms_bf16_bf16_pingpong128x128_c2x1(e);
    AddGemms_bf16_bf16_coop256x128_c2x1(e);
    AddGemms_bf16_bf16_coop128x256_c1x2(e);
    AddGemms_bf16_bf16_coop128x256_c1x1(e);
    AddGemms_bf16_bf16_coop256x192_c1x1(e);
    AddGemms_bf16_f32_coop128x256(e);
    AddGemms_f16_f16_coop128x256(e);
    AddGemms_f16_f32_coop128x256(e);
    AddFusedGemms_bf16_bf16_coop128x256(e);
    AddFusedGemms_bf16_bf16_coop128x256_c1x1(e);
    AddFusedGemms_bf16_bf16_coop256x128_c2x1(e);
    AddFusedGemms_bf16_bf16_pingpong128x128_c1x2(e);
    AddFusedGemms_bf16_bf16_coop256x192_c1x1(e);
    return e;
  }();
  return *entries;
}

}  // namespace

const char* GemmConfigName(GemmConfig c) {
  switch (c) {
    case GemmConfig::kCoop128x256_C2x1: return "Cooperative 128x256x64 cluster 2x1";
    case GemmConfig::kCoop256x128_C1x2: return "Cooperative 256x128x64 cluster 1x2";
    case GemmConfig::kPingpong128x128_C1x2: return "Pingpong 128x128x64 cluster 1x2";
    case GemmConfig::kPingpong128x128_C2x1: return "Pingpong 128x128x64 cluster 2x1";
    case GemmConfig::kCoop256x128_C2x1: return "Cooperative 256x128x64 cluster 2x1";
    case GemmConfig::kCoop128x256_C1x2: return "Cooperative 128x256x64 cluster 1x2";
    case GemmConfig::kCoop128x256_C1x1: return "Cooperative 128x256x64 cluster 1x1";
    case GemmConfig::kCoop256x192_C1x1: return "Cooperative 256x192x64 cluster 1x1";
  }
  return "?";
}

const GemmEntry* FindGemm(GemmConfig config, ElemType ab_type, ElemType d_type, bool has_c,
                          bool fused) {
  for (const GemmEntry& e : Registry()) {
    if (e.config == config && e.ab_type == ab_type && e.d_type == d_type && e.has_c == has_c &&
        e.fused == fused) {
      return &e;
    }
  }
  return nullptr;
}

int AvailableConfigs(ElemType ab_type, ElemType d_type, bool fused, GemmConfig* out, int max) {
  int n = 0;
  for (const GemmEntry& e : Registry()) {
    if (e.ab_type == ab_type && e.d_type == d_type && !e.has_c && e.fused == fused && n < max) {
      out[n++] = e.config;
    }
  }
  return n;
}

std::string LaunchGemm(const GemmLaunch& g, cudaStream_t stream) {
  const GemmEntry* e = FindGemm(g.config, g.ab_type, g.d_type, g.ops.c != nullptr,
                                g.fused.count > 0);
  if (e == nullptr) {
    return std::string("no ") + (g.fused.count > 0 ? "fused" : "stage") + " GEMM compiled for " +
           ElemName(g.ab_type) + " -> " + ElemName(g.d_type) + " with " +
           GemmConfigName(g.config);
  }
  return e->launch(g, stream);
}

size_t GemmWorkspaceBytes(const GemmLaunch& g) {
  const GemmEntry* e = FindGemm(g.config, g.ab_type, g.d_type, g.ops.c != nullptr,
                                g.fused.count > 0);
  return e == nullptr ? 0 : e->workspace_bytes(g);
}

std::string PrepareGemmKernels() {
  for (const GemmEntry& e : Registry()) {
    std::string err = e.prepare();
    if (!err.empty()) return std::string(GemmConfigName(e.config)) + ": " + err;
  }
  return "";
}

}  // namespace jax_distgemm::cuda

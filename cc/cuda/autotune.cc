#include "cc/cuda/autotune.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>

#include "cc/common/env.h"

namespace jax_distgemm::cuda {
namespace {

// (device, A/B type, D type, has C, m, n, k, batch, B shared across the batch, fused stages,
// tuning mode)
using Key = std::tuple<int, int, int, bool, int64_t, int64_t, int64_t, int64_t, bool, int, int>;
struct Choice {
  GemmConfig config;
  int swizzle;
  int raster;  // GemmLaunch::raster: 1 along M, 2 along N
  float ms;
};

const char* RasterName(int raster) {
  return raster == 1 ? "along M" : raster == 2 ? "along N" : "heuristic";
}

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
std::map<Key, Choice>& Cache() {
  static auto* c = new std::map<Key, Choice>();
  return *c;
}

bool LogTuning() {
  static const bool on = EnvFlag("JAX_DISTGEMM_LOG_TUNING");
  return on;
}

bool AutotuneEnabled() {
  return !EnvEquals("JAX_DISTGEMM_AUTOTUNE", "0");
}

// JAX_DISTGEMM_GEMM_CONFIG=<config>[:<raster>[:<swizzle>]] (raster as GemmLaunch::raster).
struct Forced {
  int config = -1;  // -1: not forced
  int raster = 0;
  int swizzle = 1;
};
Forced ForcedVariant() {
  Forced f;
  const char* v = std::getenv("JAX_DISTGEMM_GEMM_CONFIG");
  if (v == nullptr || *v == '\0') return f;
  if (std::sscanf(v, "%d:%d:%d", &f.config, &f.raster, &f.swizzle) < 1) f.config = -1;
  f.raster = std::clamp(f.raster, 0, 2);
  f.swizzle = std::max(f.swizzle, 1);
  return f;
}

// JAX_DISTGEMM_TUNE: how candidates are timed.
//   sustained (default): the GPU is first kept busy for kHeatMs; then the candidates take turns,
//     each running back-to-back launches for ~kSliceMs (>= 1 launch) per round, over many rounds
//     (kRounds, kLongRounds for launches over kLongLaunchMs), and each counts with its median
//     round; the three best are then timed again, alone together, for kFinalRounds.  Under load
//     these GPUs sit at their 700 W cap (SM clock 1.1-1.5 GHz) and their clock drifts by
//     ~10% over tens of milliseconds: short turns put every candidate through the same drift,
//     and the median does not reward a candidate for one lucky round.
//   coarse: the previous sustained tuner (3 rounds of >= 5 ms and >= 2 launches per candidate,
//     the best round counts), kept to compare against (tools/config_sweep.py rows).
//   burst: a warm-up and the best of two single launches each (the GPU at boost clock).
enum TuneMode : int { kBurst = 0, kSustained = 1, kCoarse = 2 };
TuneMode ReadTuneMode() {
  if (EnvEquals("JAX_DISTGEMM_TUNE", "burst")) return kBurst;
  return EnvEquals("JAX_DISTGEMM_TUNE", "coarse") ? kCoarse : kSustained;
}
const char* TuneModeName(int mode) {
  return mode == kBurst ? "burst" : mode == kCoarse ? "coarse" : "sustained";
}
constexpr float kHeatMs = 100.f;
constexpr float kSliceMs = 1.f;
constexpr int kRounds = 8;
constexpr float kLongLaunchMs = 5.f;
constexpr int kLongRounds = 5;
constexpr int kFinalists = 3;
constexpr int kFinalRounds = 8;
constexpr float kCoarseTrialMs = 5.f;
constexpr int kCoarseRounds = 3;

Key MakeKey(const GemmLaunch& g, TuneMode mode) {
  return Key{g.device, static_cast<int>(g.ab_type), static_cast<int>(g.d_type),
             g.ops.c != nullptr, g.ops.m, g.ops.n, g.ops.k, g.ops.batch,
             g.ops.batch_stride_b == 0, g.fused.count, static_cast<int>(mode)};
}

GemmLaunch TrialLaunch(GemmLaunch g) {
  g.sync = StageSync{};  // trial runs never wait or signal
  for (const uint32_t*& flag : g.fused.wait_flag) flag = nullptr;
  for (const uint32_t*& flag : g.fused.c_wait_flag) flag = nullptr;
  for (uint32_t*& flag : g.fused.done_flag) flag = nullptr;
  g.fused.counters = nullptr;
  g.pdl = false;
  return g;
}

// Mean ms per launch of `count` back-to-back launches; < 0 on failure.
float TimeLaunches(const GemmLaunch& g, int count, cudaStream_t stream, cudaEvent_t start,
                   cudaEvent_t stop) {
  cudaEventRecord(start, stream);
  for (int i = 0; i < count; ++i) {
    if (!LaunchGemm(g, stream).empty()) return -1.f;
  }
  cudaEventRecord(stop, stream);
  if (cudaEventSynchronize(stop) != cudaSuccess) return -1.f;
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  return ms / static_cast<float>(count);
}

// Burst timing of a TrialLaunch: warm-up, then the best of two single launches; < 0 on failure.
float TimeBurst(const GemmLaunch& g, cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop) {
  if (!LaunchGemm(g, stream).empty()) return -1.f;  // warm-up (also rejects unsupported)
  float best = -1.f;
  for (int rep = 0; rep < 2; ++rep) {
    const float ms = TimeLaunches(g, 1, stream, start, stop);
    if (ms < 0.f) return -1.f;
    best = best < 0.f ? ms : std::min(best, ms);
  }
  return best;
}

// Launches per turn: ~`target_ms` of work, at least `min_count` launches, from one launch's time.
// NOTE: at the seed shape a launch takes ~20 ms, and single launches ranked the top variants
// within 1-2% noise (docs/performance.md, H3).
int LaunchesFor(float one_ms, float target_ms, int min_count) {
  return std::clamp(static_cast<int>(std::ceil(target_ms / std::max(one_ms, 1e-3f))), min_count,
                    1000);
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? -1.f : n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

bool CanFuse(ElemType ab_type, ElemType d_type) {
  GemmConfig configs[kNumGemmConfigs];
  const int n = AvailableConfigs(ab_type, d_type, /*fused=*/true, configs, kNumGemmConfigs);
  const int forced = ForcedVariant().config;
  if (forced < 0) return n > 0;
  return std::find(configs, configs + n, static_cast<GemmConfig>(forced)) != configs + n;
}

std::string ChooseConfig(GemmLaunch& g, cudaStream_t stream) {
  GemmConfig configs[kNumGemmConfigs];
  const int n = AvailableConfigs(g.ab_type, g.d_type, g.fused.count > 0, configs,
                                 kNumGemmConfigs);
  if (n == 0) {
    return std::string("no ") + (g.fused.count > 0 ? "fused" : "stage") +
           " GEMM compiled for " + ElemName(g.ab_type) + " -> " + ElemName(g.d_type);
  }
  if (const Forced f = ForcedVariant(); f.config >= 0) {
    g.config = static_cast<GemmConfig>(f.config);
    g.max_swizzle = f.swizzle;
    g.raster = f.raster;
    return "";
  }
  if (!AutotuneEnabled() || n == 1) {
    g.config = configs[0];
    g.max_swizzle = 1;
    g.raster = 0;
    return "";
  }
  const TuneMode mode = ReadTuneMode();
  const Key key = MakeKey(g, mode);
  {
    std::lock_guard<std::mutex> lock(Mu());
    auto it = Cache().find(key);
    if (it != Cache().end()) {
      g.config = it->second.config;
      g.max_swizzle = it->second.swizzle;
      g.raster = it->second.raster;
      return "";
    }
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  struct Variant {
    GemmConfig config;
    int raster, swizzle;
    int count = 1;  // launches per turn (sustained, coarse)
    float ms = -1.f;  // the estimate; < 0: failed or not timed
    std::vector<float> rounds;  // sustained: ms per launch of each turn
  };
  auto make = [&](const Variant& v) {
    GemmLaunch t = g;
    t.config = v.config;
    t.max_swizzle = v.swizzle;
    t.raster = v.raster;
    return TrialLaunch(t);
  };
  auto log = [&](const Variant& v) {
    if (!LogTuning()) return;
    std::fprintf(stderr,
                 "jax_distgemm tune (%s): device %d m=%lld n=%lld k=%lld l=%lld %s->%s%s: %s "
                 "raster %s swizzle %d: %.4f ms (%.1f TFLOP/s)\n",
                 TuneModeName(mode), g.device,
                 static_cast<long long>(g.ops.m), static_cast<long long>(g.ops.n),
                 static_cast<long long>(g.ops.k), static_cast<long long>(g.ops.batch),
                 ElemName(g.ab_type), ElemName(g.d_type), g.ops.c ? " +C" : "",
                 GemmConfigName(v.config), RasterName(v.raster), v.swizzle, v.ms,
                 v.ms > 0.f ? 2e-9 * g.ops.m * g.ops.n * g.ops.k * g.ops.batch / v.ms : 0.0);
  };
  // Sizes each variant's turn from one launch (which also rejects unsupported ones); returns
  // the longest single launch.
  auto size_turns = [&](std::vector<Variant>& vs, float target_ms, int min_count) {
    float longest = 0.f;
    for (Variant& v : vs) {
      const float one = TimeLaunches(make(v), 1, stream, start, stop);
      v.count = one > 0.f ? LaunchesFor(one, target_ms, min_count) : 0;
      v.ms = -1.f;
      v.rounds.clear();
      longest = std::max(longest, one);
    }
    return longest;
  };
  // Times `vs` in place (see TuneMode); `rounds` (sustained only): 0 picks by launch time.
  auto time_all = [&](std::vector<Variant>& vs, int rounds) {
    if (mode == kBurst) {
      for (Variant& v : vs) v.ms = TimeBurst(make(v), stream, start, stop);
    } else if (mode == kCoarse) {
      size_turns(vs, kCoarseTrialMs, 2);
      for (int round = 0; round < kCoarseRounds; ++round) {
        for (Variant& v : vs) {
          if (v.count == 0) continue;
          const float ms = TimeLaunches(make(v), v.count, stream, start, stop);
          if (ms > 0.f && (v.ms < 0.f || ms < v.ms)) v.ms = ms;
        }
      }
    } else {
      const float longest = size_turns(vs, kSliceMs, 1);
      if (rounds == 0) rounds = longest > kLongLaunchMs ? kLongRounds : kRounds;
      for (int round = 0; round < rounds; ++round) {
        for (Variant& v : vs) {
          if (v.count == 0) continue;
          const float ms = TimeLaunches(make(v), v.count, stream, start, stop);
          if (ms > 0.f) v.rounds.push_back(ms);
        }
      }
      for (Variant& v : vs) {
        // A variant that failed a turn does not count (a launch that fails once fails always).
        v.ms = v.count > 0 && static_cast<int>(v.rounds.size()) == rounds ? Median(v.rounds) : -1.f;
      }
    }
    for (const Variant& v : vs) log(v);
  };
  auto by_time = [](const Variant& a, const Variant& b) { return a.ms < b.ms; };
  auto timed = [](const std::vector<Variant>& vs) {
    std::vector<Variant> out;
    for (const Variant& v : vs) {
      if (v.ms > 0.f) out.push_back(v);
    }
    return out;
  };
  // NOTE: tuning runs inside a call while peers may already spin on this device's signals,
  // so it must stay well inside the flag-wait timeout (30 s by default): every config once
  // (CUTLASS's raster heuristic, no swizzle; sustained: also along M and N with swizzle 8),
  // then both rasterizations (the heuristic picks one by the tile grid's aspect ratio, not
  // always the faster for L2 reuse) x swizzle for the two best configs only: 7 (21) + 2 x 9
  // variants; sustained mode adds kHeatMs, turns of ~kSliceMs over 8 rounds (5 for launches
  // over 5 ms), and a final round of three (seed-shape stage: ~5 s in all, its fused two-stage
  // grid ~8 s).
  if (mode != kBurst) {
    Variant heat{configs[0], 0, 1};
    const float one = TimeLaunches(make(heat), 1, stream, start, stop);
    if (one > 0.f) {
      TimeLaunches(make(heat), std::clamp(static_cast<int>(kHeatMs / one), 1, 10000), stream,
                   start, stop);
    }
  }
  // Round one: every config.  Sustained mode also tries each with raster M and N at swizzle 8:
  // at wide shapes the raster decides more than the config (seed-shape stage on one H200:
  // Cooperative 128x256 c1x1 21.1-21.3 ms along M with swizzle 8, 28.5-28.8 ms along N with
  // swizzle 1, 21.7-22.6 ms with CUTLASS's choice; docs/performance.md, I2), so a config must
  // not be dropped for its heuristic raster alone.
  std::vector<Variant> first;
  for (int i = 0; i < n; ++i) {
    first.push_back(Variant{configs[i], 0, 1});
    if (mode == kSustained) {
      for (int raster : {1, 2}) first.push_back(Variant{configs[i], raster, 8});
    }
  }
  time_all(first, 0);
  std::vector<Variant> all = timed(first);
  std::sort(all.begin(), all.end(), by_time);
  std::vector<GemmConfig> finalists;  // the two configs with the fastest variants
  for (const Variant& v : all) {
    if (finalists.size() < 2 &&
        std::find(finalists.begin(), finalists.end(), v.config) == finalists.end()) {
      finalists.push_back(v.config);
    }
  }
  std::vector<Variant> second;
  for (const GemmConfig config : finalists) {
    // The round-one finalists run again here, so that the final comparison is between
    // variants timed in the same rounds (a GPU heats up between the phases).
    if (mode != kBurst) second.push_back(Variant{config, 0, 1});
    for (int raster : {1, 2}) {
      for (int swizzle : {1, 2, 4, 8}) second.push_back(Variant{config, raster, swizzle});
    }
  }
  time_all(second, 0);
  if (mode != kBurst && !second.empty()) all.clear();
  for (const Variant& v : timed(second)) all.push_back(v);
  if (mode == kSustained && all.size() > 1) {
    // The closest few of 18 can swap places by drift alone: time the best three again,
    // taking turns among themselves only.
    std::sort(all.begin(), all.end(), by_time);
    all.resize(std::min<size_t>(all.size(), kFinalists));
    time_all(all, kFinalRounds);
    all = timed(all);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGetLastError();
  if (all.empty()) return "every stage GEMM configuration failed to launch for this shape";
  const Variant best = *std::min_element(all.begin(), all.end(), by_time);
  {
    std::lock_guard<std::mutex> lock(Mu());
    Cache()[key] = Choice{best.config, best.swizzle, best.raster, best.ms};
  }
  g.config = best.config;
  g.max_swizzle = best.swizzle;
  g.raster = best.raster;
  return "";
}

std::string DescribeTuning() {
  std::lock_guard<std::mutex> lock(Mu());
  std::ostringstream s;
  for (const auto& [k, c] : Cache()) {
    s << "device " << std::get<0>(k) << " " << ElemName(static_cast<ElemType>(std::get<1>(k)))
      << "->" << ElemName(static_cast<ElemType>(std::get<2>(k)))
      << (std::get<3>(k) ? " +C" : "") << " m=" << std::get<4>(k) << " n=" << std::get<5>(k)
      << " k=" << std::get<6>(k) << " l=" << std::get<7>(k);
    if (std::get<9>(k) > 0) s << " fused stages=" << std::get<9>(k);
    if (std::get<10>(k) != kSustained) s << " (" << TuneModeName(std::get<10>(k)) << " tuning)";
    s << ": " << GemmConfigName(c.config)
      << " raster " << RasterName(c.raster) << " swizzle " << c.swizzle << " (" << c.ms
      << " ms)\n";
  }
  return s.str();
}

}  // namespace jax_distgemm::cuda

#include "cc/cuda/autotune.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
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
// tuning mode, JAX_DISTGEMM_TUNE_HEAT_MS or -1, call trials enabled)
using Key = std::tuple<int, int, int, bool, int64_t, int64_t, int64_t, int64_t, bool, int, int,
                       int, bool>;
struct Variant {
  GemmConfig config;
  int raster, swizzle;
  int count = 1;  // timed launches per turn (sustained, coarse)
  int heat = 0;  // untimed launches before them (sustained)
  float ms = -1.f;  // best so far; < 0: failed or not timed
};
struct Choice {
  GemmConfig config;
  int swizzle;
  int raster;  // GemmLaunch::raster: 1 along M, 2 along N
  float ms;
  // A call trial's verdict (below): ms per call in calls of the tuner's choice and of the
  // challenger; < 0: no trial.
  float call_ms[2] = {-1.f, -1.f};
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
//   sustained (default): the GPU is first kept busy for kHeatMs; then, in kRounds interleaved
//     rounds, every candidate takes a turn: untimed launches (the turn heat, TurnHeatMs), then
//     back-to-back launches for >= kTrialMs (and >= 2 launches), timed (per-launch mean; the
//     best round counts).  Under load these GPUs sit at their 700 W cap (SM clock 1.1-1.5
//     GHz), and the power limiter lags: a candidate timed right after another may run at the
//     clock that one left (seed-shape stage, one H200: with turns of one launch, a variant timed
//     at 21.2 ms ran 24.6 ms in a call loop; docs/performance.md, I2).  The untimed part lets
//     each candidate reach its own clock, and so ranks kernels by the work they sustain per
//     watt: with 5 ms, Pingpong 128x128 won the 8192,8192,28672 stages and sustained 0.94 of
//     XLA's dot; with 100 ms, Cooperative 128x256 won and sustained 1.00 (docs/performance.md, J1).
//   coarse: the same without the untimed part (the default until 2026-11-30), kept to compare.
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
// The turn heat: kTurnHeatLaunches launches of the shape, within [kMinTurnHeatMs,
// kMaxTurnHeatMs], and at least kShortTurnLaunches launches up to kShortTurnMs.  100 ms is what
// let the limiter settle (docs/performance.md, I4 and J1); the tuning time grows with it (~25
// variants x kRounds turns: ~8 s per shape at 100 ms, ~4 s at 50 ms).  64 launches alone gave
// the suite's 0.1-0.2 ms stages turns of 6-13 ms, which chose Pingpong 128x128 or Cooperative
// 256x128 tiles that sustained 0.89-0.985 of XLA's dot; 50 ms turns chose Cooperative 128x256,
// 0.971-1.018 (one H200; docs/performance.md T3-T5).  So launches of 0.1-0.78 ms get 50 ms
// turns (T5's build), longer ones 64 launches as before, 10-100 us ones 500 launches (5-50 ms,
// not measured), and tiny ones (<= 10 us, as in the GPU tests, whose calls are latency more
// than watts) keep the 5 ms floor and their short tuning.
constexpr int kTurnHeatLaunches = 64;
constexpr float kMinTurnHeatMs = 5.f;
constexpr float kMaxTurnHeatMs = 100.f;
constexpr int kShortTurnLaunches = 500;
constexpr float kShortTurnMs = 50.f;
// JAX_DISTGEMM_TUNE_HEAT_MS: a fixed turn heat in ms (0-1000) instead; -1 when unset.
int TurnHeatOverride(TuneMode mode) {
  if (mode != kSustained) return 0;
  const char* e = std::getenv("JAX_DISTGEMM_TUNE_HEAT_MS");
  if (e == nullptr || *e == '\0') return -1;
  return std::clamp(EnvInt("JAX_DISTGEMM_TUNE_HEAT_MS"), 0, 1000);
}
float TurnHeatMs(int override_ms, float one_launch_ms) {
  if (override_ms >= 0) return static_cast<float>(override_ms);
  return std::max(std::clamp(kTurnHeatLaunches * one_launch_ms, kMinTurnHeatMs, kMaxTurnHeatMs),
                  std::min(kShortTurnLaunches * one_launch_ms, kShortTurnMs));
}
constexpr float kTrialMs = 5.f;
constexpr int kRounds = 3;

// -- Call trials: long AllGather grids ----------------------------------------------------------
// A fused AllGather grid whose first trial launch takes >= kCallTrialMinMs: once tuned, if the
// tuner's choice is another config than the cluster-less Cooperative 128x256 (the challenger,
// kChallengerConfig) and the challenger was timed too,
// the next calls alternate between the two in turns (~kCallTrialHeatMs of calls untimed, then
// ~kCallTrialTimedMs timed), kCallTrialRounds rounds each; the lower best-round median wins
// and is cached.  Why: at the seed AllGather (41-45 ms grids) the cluster-less tile sustained
// 0.5-4.3% more than the tuner's 2x1-cluster choice in whole calls in every run on 2x H200,
// while timing the grid alone, even in 1 s turns, ranked the 2x1 tile ~1% ahead
// (docs/performance.md, N2-N4).  The call is the only place that ranks them as the call runs.
//
//   calls:  [0, H)   [H, P)   [P, P+H)    [P+H, 2P)   [2P, 3P)        [3P, 4P)         [4P, ..)
//   runs:   tuner's  tuner's  challenger  challenger  tuner's (round  challenger (round  verdict
//           untimed  timed    untimed     timed        two, same)     two, same)
//
// What is timed is the call's period on this device's stream: from the end of one timed
// call's grid to the end of the next's (an event after each grid), which counts the wait for
// the peer, and whatever else the call enqueues, as a user sees them.  The grid's own time
// would not: a device whose grid starts early waits inside it for the peer's shard.
// The turn lengths (H, P) are counted in calls from the problem's FLOPs at a nominal rate, not
// from a measured time, so that every device of a group, in one process or several, counts the
// same and runs its candidate in the same calls as the peer's.  NOTE: no host sync: the events
// are read when done, at later calls; the tuner's choice runs until the last ones are.
// NOTE: a timed call records an event right after the grid, which may keep the next kernel
// from overlapping the grid's tail (programmatic dependent launch): both candidates alike.
// JAX_DISTGEMM_CALL_TRIAL=0 turns trials off.
constexpr float kCallTrialMinMs = 20.f;
constexpr float kCallTrialHeatMs = 1000.f;
constexpr float kCallTrialTimedMs = 300.f;
constexpr int kCallTrialMinTimedCalls = 4;  // >= 3 periods per turn
constexpr int kCallTrialRounds = 2;
constexpr double kNominalFlopPerMs = 6e11;  // 600 TFLOP/s: turn lengths only, never a verdict
constexpr GemmConfig kChallengerConfig = GemmConfig::kCoop128x256_C1x1;
bool CallTrialsEnabled() { return !EnvEquals("JAX_DISTGEMM_CALL_TRIAL", "0"); }
bool IsLongAllGatherGrid(const GemmLaunch& g, float one_launch_ms) {
  return g.fused.count > 0 && one_launch_ms >= kCallTrialMinMs;
}
// The grid's ms at the nominal rate: the same number on every device of a group.
float NominalGridMs(const GemmLaunch& g) {
  const double flop = 2.0 * static_cast<double>(g.ops.m) * static_cast<double>(g.ops.n) *
                      static_cast<double>(g.ops.k) *
                      static_cast<double>(std::max<int64_t>(g.ops.batch, 1)) *
                      static_cast<double>(std::max(g.fused.count, 1));
  return static_cast<float>(flop / kNominalFlopPerMs);
}

struct CallTrial {
  Variant candidate[2];  // [0] the tuner's choice, [1] the challenger
  int heat_calls = 0, timed_calls = 0;  // per turn
  int64_t calls = 0;  // calls scheduled so far
  struct Mark {  // an event after a timed call's grid
    cudaEvent_t done = nullptr;
    int64_t call = 0;
    int candidate = 0, round = 0;
    bool recorded = false, complete = false;
  };
  std::deque<Mark> marks;  // in call order; deque: CallTiming points into it
  // ImportTuning / ClearTuning replaced the choice: the device's next BeginCall (or tuning of
  // the key) erases the trial.  Not erased at once: a call in flight may hold a CallTiming
  // that points into `marks`.
  bool dropped = false;
};
std::map<Key, CallTrial>& Trials() {
  static auto* t = new std::map<Key, CallTrial>();
  return *t;
}

// Erases a trial and its events.  Only from its own device's calls, between calls (BeginCall,
// ChooseConfig), where no CallTiming of it is outstanding.
void DropTrial(std::map<Key, CallTrial>::iterator it) {
  for (CallTrial::Mark& mark : it->second.marks) cudaEventDestroy(mark.done);
  Trials().erase(it);
}

Key MakeKey(const GemmLaunch& g, TuneMode mode, int heat_override, bool call_trials) {
  return Key{g.device, static_cast<int>(g.ab_type), static_cast<int>(g.d_type),
             g.ops.c != nullptr, g.ops.m, g.ops.n, g.ops.k, g.ops.batch,
             g.ops.batch_stride_b == 0, g.fused.count, static_cast<int>(mode), heat_override,
             call_trials};
}

GemmLaunch TrialLaunch(GemmLaunch g) {
  g.sync = StageSync{};  // trial runs never wait or signal
  for (const uint32_t*& flag : g.fused.wait_flag) flag = nullptr;
  for (uint32_t*& flag : g.fused.seen_flag) flag = nullptr;
  g.fused.exit_wait_flag = nullptr;
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

// Launches of ~`target_ms` of work, at least `min_count`, from one launch's time.
// NOTE: at the seed shape a launch takes ~20 ms, and single launches ranked the top variants
// within 1-2% noise (docs/performance.md, H3).
int LaunchesFor(float one_ms, float target_ms, int min_count) {
  return std::clamp(static_cast<int>(std::ceil(target_ms / std::max(one_ms, 1e-3f))), min_count,
                    1000);
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
  const int heat_override = TurnHeatOverride(mode);
  const bool call_trials = CallTrialsEnabled();
  const Key key = MakeKey(g, mode, heat_override, call_trials);
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
  float turn_heat_ms = 0.f;  // sustained: set from the first launch below
  // Times `vs` in place: burst, or (sustained, coarse) one launch that sizes the turns, then
  // kRounds interleaved rounds of turns (sustained: an untimed part, then the timed launches).
  auto time_all = [&](std::vector<Variant>& vs) {
    if (mode == kBurst) {
      for (Variant& v : vs) v.ms = TimeBurst(make(v), stream, start, stop);
    } else {
      for (Variant& v : vs) {
        const float one = TimeLaunches(make(v), 1, stream, start, stop);
        v.count = one > 0.f ? LaunchesFor(one, kTrialMs, 2) : 0;
        v.heat = one > 0.f && turn_heat_ms > 0.f ? LaunchesFor(one, turn_heat_ms, 1) : 0;
        v.ms = -1.f;
      }
      for (int round = 0; round < kRounds; ++round) {
        for (Variant& v : vs) {
          if (v.count == 0) continue;
          const GemmLaunch launch = make(v);
          if (v.heat > 0 && TimeLaunches(launch, v.heat, stream, start, stop) < 0.f) continue;
          const float ms = TimeLaunches(launch, v.count, stream, start, stop);
          if (ms > 0.f && (v.ms < 0.f || ms < v.ms)) v.ms = ms;
        }
      }
    }
    for (const Variant& v : vs) log(v);
  };
  // NOTE: tuning runs inside a call while peers may already spin on this device's signals,
  // so it must stay well inside the flag-wait timeout (30 s by default): every config once
  // (CUTLASS's raster heuristic, no swizzle), then both rasterizations (the heuristic picks
  // one by the tile grid's aspect ratio, not always the faster for L2 reuse) x swizzle for the
  // two fastest configs only: n + 2 x 9 variants for n compiled configs (8 stage kernels, 5
  // fused, bf16 -> bf16; + 9 for a call trial's challenger), and n + 2 x 8 in burst mode,
  // which does not time the finalists' heuristic raster again: 3 launches each there; coarse
  // mode adds kHeatMs and runs each for kRounds x max(kTrialMs, 2 launches) (seed-shape
  // stage: ~4 s in all); sustained mode adds the turn heat (>= 1 launch) to each turn (seed
  // shape, estimated from launch counts: ~11 s for a stage, ~14 s for the fused two-stage grid).
  float first_launch_ms = 0.f;
  {
    Variant heat{configs[0], 0, 1};
    first_launch_ms = std::max(TimeLaunches(make(heat), 1, stream, start, stop), 0.f);
    if (mode == kSustained) turn_heat_ms = TurnHeatMs(heat_override, first_launch_ms);
    if (mode != kBurst && first_launch_ms > 0.f) {
      TimeLaunches(make(heat), std::clamp(static_cast<int>(kHeatMs / first_launch_ms), 1, 10000),
                   stream, start, stop);
    }
  }
  // A long AllGather grid's call trial needs the challenger's variants timed in round two.
  const bool trial = call_trials && IsLongAllGatherGrid(g, first_launch_ms) &&
                     std::find(configs, configs + n, kChallengerConfig) != configs + n;
  std::vector<Variant> first;
  for (int i = 0; i < n; ++i) first.push_back(Variant{configs[i], 0, 1});
  time_all(first);
  std::vector<Variant> all;
  for (const Variant& v : first) {
    if (v.ms > 0.f) all.push_back(v);
  }
  std::sort(all.begin(), all.end(),
            [](const Variant& a, const Variant& b) { return a.ms < b.ms; });
  std::vector<GemmConfig> finalists;
  for (size_t i = 0; i < all.size() && i < 2; ++i) finalists.push_back(all[i].config);
  if (trial && std::find(finalists.begin(), finalists.end(), kChallengerConfig) ==
                   finalists.end()) {
    finalists.push_back(kChallengerConfig);
  }
  std::vector<Variant> second;
  for (GemmConfig config : finalists) {
    // Sustained and coarse: the round-one finalists run again here, so that the final
    // comparison is between variants timed in the same rounds (a GPU heats up between the
    // phases).
    if (mode != kBurst) second.push_back(Variant{config, 0, 1});
    for (int raster : {1, 2}) {
      for (int swizzle : {1, 2, 4, 8}) second.push_back(Variant{config, raster, swizzle});
    }
  }
  time_all(second);
  if (mode != kBurst && !second.empty()) all.clear();
  for (const Variant& v : second) {
    if (v.ms > 0.f) all.push_back(v);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGetLastError();
  if (all.empty()) return "every stage GEMM configuration failed to launch for this shape";
  auto faster = [](const Variant& a, const Variant& b) { return a.ms < b.ms; };
  const Variant best = *std::min_element(all.begin(), all.end(), faster);
  std::vector<Variant> challengers;
  for (const Variant& v : all) {
    if (v.config == kChallengerConfig) challengers.push_back(v);
  }
  {
    std::lock_guard<std::mutex> lock(Mu());
    Cache()[key] = Choice{best.config, best.swizzle, best.raster, best.ms};
    if (trial && best.config != kChallengerConfig && !challengers.empty()) {
      if (auto old = Trials().find(key); old != Trials().end()) DropTrial(old);  // (dropped)
      CallTrial& t = Trials()[key];
      t.candidate[0] = best;
      t.candidate[1] = *std::min_element(challengers.begin(), challengers.end(), faster);
      const float nominal_ms = NominalGridMs(g);
      t.heat_calls = LaunchesFor(nominal_ms, kCallTrialHeatMs, 1);
      t.timed_calls = LaunchesFor(nominal_ms, kCallTrialTimedMs, kCallTrialMinTimedCalls);
    }
  }
  g.config = best.config;
  g.max_swizzle = best.swizzle;
  g.raster = best.raster;
  return "";
}

namespace {

// Whether every recorded event of `t` is done (never waits); false while some are in flight.
bool Harvest(CallTrial& t) {
  bool all_done = true;
  for (CallTrial::Mark& mark : t.marks) {
    if (!mark.recorded || mark.complete) continue;
    if (cudaEventQuery(mark.done) != cudaSuccess) {
      cudaGetLastError();  // cudaErrorNotReady is not an error here
      all_done = false;
      continue;
    }
    mark.complete = true;
  }
  return all_done;
}

float Median(std::vector<float> v) {
  if (v.empty()) return -1.f;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// The lower of the candidates' best-round medians of the call period: the verdict, cached in
// place of the tuner's.  The caller then drops the trial (DropTrial frees its events).
void Decide(const Key& key, CallTrial& t) {
  std::vector<float> periods[2][kCallTrialRounds];
  for (size_t i = 1; i < t.marks.size(); ++i) {
    const CallTrial::Mark& a = t.marks[i - 1];
    const CallTrial::Mark& b = t.marks[i];
    if (!a.complete || !b.complete || b.call != a.call + 1 || a.candidate != b.candidate ||
        a.round != b.round) {
      continue;  // not consecutive calls of one turn
    }
    float ms = 0.f;
    if (cudaEventElapsedTime(&ms, a.done, b.done) == cudaSuccess && ms > 0.f) {
      periods[b.candidate][b.round].push_back(ms);
    }
  }
  cudaGetLastError();
  float best_ms[2] = {-1.f, -1.f};
  for (int c = 0; c < 2; ++c) {
    for (int r = 0; r < kCallTrialRounds; ++r) {
      const float ms = Median(periods[c][r]);
      if (ms > 0.f && (best_ms[c] < 0.f || ms < best_ms[c])) best_ms[c] = ms;
    }
  }
  const int winner = best_ms[1] > 0.f && (best_ms[0] < 0.f || best_ms[1] < best_ms[0]) ? 1 : 0;
  const Variant& v = t.candidate[winner];
  Choice choice{v.config, v.swizzle, v.raster, v.ms};
  choice.call_ms[0] = best_ms[0];
  choice.call_ms[1] = best_ms[1];
  Cache()[key] = choice;
  if (LogTuning()) {
    std::fprintf(stderr,
                 "jax_distgemm call trial: device %d m=%lld n=%lld k=%lld: %s raster %s swizzle "
                 "%d %.4f ms per call, %s raster %s swizzle %d %.4f ms per call: the %s\n",
                 std::get<0>(key), static_cast<long long>(std::get<4>(key)),
                 static_cast<long long>(std::get<5>(key)),
                 static_cast<long long>(std::get<6>(key)), GemmConfigName(t.candidate[0].config),
                 RasterName(t.candidate[0].raster), t.candidate[0].swizzle, best_ms[0],
                 GemmConfigName(t.candidate[1].config), RasterName(t.candidate[1].raster),
                 t.candidate[1].swizzle, best_ms[1], winner ? "challenger" : "tuner's choice");
  }
}

}  // namespace

CallTiming BeginCall(GemmLaunch& g) {
  CallTiming timing;
  if (g.fused.count == 0) return timing;  // trials are for fused grids only
  std::lock_guard<std::mutex> lock(Mu());
  if (Trials().empty()) return timing;  // every call but a trial's: no key, no env reads
  const TuneMode mode = ReadTuneMode();
  const Key key = MakeKey(g, mode, TurnHeatOverride(mode), CallTrialsEnabled());
  auto it = Trials().find(key);
  if (it == Trials().end()) return timing;
  if (it->second.dropped) {  // a loaded choice replaced it (ChooseConfig has set g from it)
    DropTrial(it);
    return timing;
  }
  CallTrial& t = it->second;
  const bool all_done = Harvest(t);
  const int per_turn = t.heat_calls + t.timed_calls;
  const int64_t turn = t.calls / per_turn;
  if (turn >= 2 * kCallTrialRounds) {  // schedule over: decide once every event is read
    if (all_done) {
      Decide(key, t);
      const Choice& c = Cache()[key];
      g.config = c.config;
      g.max_swizzle = c.swizzle;
      g.raster = c.raster;
      DropTrial(it);
    }
    return timing;  // meanwhile the tuner's choice, as ChooseConfig set it
  }
  const int candidate = static_cast<int>(turn % 2);
  const int round = static_cast<int>(turn / 2);
  const bool timed = t.calls % per_turn >= t.heat_calls;
  const int64_t call = t.calls++;
  const Variant& v = t.candidate[candidate];
  g.config = v.config;
  g.max_swizzle = v.swizzle;
  g.raster = v.raster;
  if (!timed) return timing;
  CallTrial::Mark mark;
  if (cudaEventCreate(&mark.done) != cudaSuccess) {
    cudaGetLastError();
    return timing;  // this call untimed: its period and the next one's go uncounted
  }
  mark.call = call;
  mark.candidate = candidate;
  mark.round = round;
  t.marks.push_back(mark);
  timing.done = t.marks.back().done;
  timing.recorded = &t.marks.back().recorded;
  return timing;
}

void EndCall(const CallTiming& timing, cudaStream_t stream) {
  if (timing.done == nullptr) return;
  std::lock_guard<std::mutex> lock(Mu());
  if (cudaEventRecord(timing.done, stream) == cudaSuccess) {
    *timing.recorded = true;
  } else {
    cudaGetLastError();
  }
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
    if (std::get<10>(k) == kSustained && std::get<11>(k) >= 0) {
      s << " (turn heat " << std::get<11>(k) << " ms)";
    }
    if (!std::get<12>(k)) s << " (no call trials)";
    s << ": " << GemmConfigName(c.config)
      << " raster " << RasterName(c.raster) << " swizzle " << c.swizzle << " (" << c.ms
      << " ms)";
    if (auto t = Trials().find(k); t != Trials().end() && !t->second.dropped) {
      s << "; call trial running (call " << t->second.calls << " of "
        << 2 * kCallTrialRounds * (t->second.heat_calls + t->second.timed_calls) << ")";
    }
    if (c.call_ms[0] > 0.f || c.call_ms[1] > 0.f) {
      s << "; call trial: tuner's choice " << c.call_ms[0] << " ms, challenger " << c.call_ms[1]
        << " ms per call";
    }
    s << "\n";
  }
  return s.str();
}

// -- Saved choices --------------------------------------------------------------------------------

namespace {

struct DeviceModel {
  std::string name;
  int sm_count = 0;
};
// The model of every visible device, by ordinal ("" where CUDA cannot say).  Not under Mu():
// the queries need no tuner state.
std::vector<DeviceModel> VisibleModels() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  std::vector<DeviceModel> models(static_cast<size_t>(count));
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, ordinal) == cudaSuccess) {
      models[ordinal].name = prop.name;
      models[ordinal].sm_count = prop.multiProcessorCount;
    }
  }
  cudaGetLastError();
  return models;
}

bool ElemFromName(const std::string& name, ElemType* out) {
  for (ElemType t : {ElemType::kBF16, ElemType::kF16, ElemType::kF32}) {
    if (name == ElemName(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

bool ConfigFromName(const std::string& name, GemmConfig* out) {
  for (int i = 0; i < kNumGemmConfigs; ++i) {
    if (name == GemmConfigName(static_cast<GemmConfig>(i))) {
      *out = static_cast<GemmConfig>(i);
      return true;
    }
  }
  return false;
}

bool ModeFromName(const std::string& name, int* out) {
  for (int mode : {kBurst, kSustained, kCoarse}) {
    if (name == TuneModeName(mode)) {
      *out = mode;
      return true;
    }
  }
  return false;
}

// A record checked and resolved: the key without its device, and the choice.
struct Resolved {
  const TuningRecord* record;
  ElemType ab, d;
  GemmConfig config;
  int mode;
};

std::string Resolve(const TuningRecord& r, size_t index, Resolved* out) {
  std::ostringstream err;
  err << "tuning record " << index << " (" << r.gpu << ", m=" << r.m << " n=" << r.n
      << " k=" << r.k << "): ";
  out->record = &r;
  if (!ElemFromName(r.ab_type, &out->ab) || !ElemFromName(r.d_type, &out->d)) {
    err << "unknown element type '" << r.ab_type << "' or '" << r.d_type << "'";
    return err.str();
  }
  if (!ConfigFromName(r.config, &out->config)) {
    err << "unknown kernel config '" << r.config << "'";
    return err.str();
  }
  if (FindGemm(out->config, out->ab, out->d, r.has_c, r.fused_stages > 0) == nullptr) {
    err << "'" << r.config << "' is not compiled for " << r.ab_type << " -> " << r.d_type
        << (r.has_c ? " with C" : "") << (r.fused_stages > 0 ? " as a fused grid" : "");
    return err.str();
  }
  if (!ModeFromName(r.tune_mode, &out->mode)) {
    err << "unknown tuning mode '" << r.tune_mode << "'";
    return err.str();
  }
  if (r.raster < 0 || r.raster > 2 || (r.swizzle != 1 && r.swizzle != 2 && r.swizzle != 4 &&
                                       r.swizzle != 8)) {
    err << "raster must be 0, 1 or 2 and swizzle 1, 2, 4 or 8, got " << r.raster << " and "
        << r.swizzle;
    return err.str();
  }
  if (r.m < 1 || r.n < 1 || r.k < 1 || r.batch < 1 || r.fused_stages < 0 ||
      r.fused_stages > kMaxFusedStages || r.sm_count < 1) {
    err << "m, n, k, batch and sm_count must be >= 1 and fused_stages 0-" << kMaxFusedStages;
    return err.str();
  }
  return "";
}

}  // namespace

std::vector<TuningRecord> ExportTuning() {
  const std::vector<DeviceModel> models = VisibleModels();
  std::lock_guard<std::mutex> lock(Mu());
  std::vector<TuningRecord> out;
  for (const auto& [k, c] : Cache()) {
    if (auto t = Trials().find(k); t != Trials().end() && !t->second.dropped) continue;
    const size_t ordinal = static_cast<size_t>(std::get<0>(k));
    const DeviceModel model = ordinal < models.size() ? models[ordinal] : DeviceModel{};
    TuningRecord r;
    r.gpu = model.name;
    r.sm_count = model.sm_count;
    r.ab_type = ElemName(static_cast<ElemType>(std::get<1>(k)));
    r.d_type = ElemName(static_cast<ElemType>(std::get<2>(k)));
    r.has_c = std::get<3>(k);
    r.m = std::get<4>(k);
    r.n = std::get<5>(k);
    r.k = std::get<6>(k);
    r.batch = std::get<7>(k);
    r.shared_b = std::get<8>(k);
    r.fused_stages = std::get<9>(k);
    r.tune_mode = TuneModeName(std::get<10>(k));
    r.turn_heat_ms = std::get<11>(k);
    r.call_trials = std::get<12>(k);
    r.config = GemmConfigName(c.config);
    r.raster = c.raster;
    r.swizzle = c.swizzle;
    r.ms = c.ms;
    r.call_ms[0] = c.call_ms[0];
    r.call_ms[1] = c.call_ms[1];
    out.push_back(r);
  }
  return out;
}

std::string ImportTuning(const std::vector<TuningRecord>& records, int* installed) {
  *installed = 0;
  std::vector<Resolved> resolved(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    if (std::string err = Resolve(records[i], i, &resolved[i]); !err.empty()) return err;
  }
  const std::vector<DeviceModel> models = VisibleModels();
  const int count = static_cast<int>(models.size());
  std::lock_guard<std::mutex> lock(Mu());
  for (const Resolved& v : resolved) {
    const TuningRecord& r = *v.record;
    for (int ordinal = 0; ordinal < count; ++ordinal) {
      if (models[ordinal].name != r.gpu || models[ordinal].sm_count != r.sm_count) continue;
      const Key key{ordinal, static_cast<int>(v.ab), static_cast<int>(v.d), r.has_c, r.m, r.n,
                    r.k, r.batch, r.shared_b, r.fused_stages, v.mode, r.turn_heat_ms,
                    r.call_trials};
      Choice choice{v.config, r.swizzle, r.raster, r.ms};
      choice.call_ms[0] = r.call_ms[0];
      choice.call_ms[1] = r.call_ms[1];
      Cache()[key] = choice;
      if (auto t = Trials().find(key); t != Trials().end()) t->second.dropped = true;
      ++*installed;
    }
  }
  return "";
}

void ClearTuning() {
  std::lock_guard<std::mutex> lock(Mu());
  Cache().clear();
  for (auto& [k, t] : Trials()) t.dropped = true;
}

}  // namespace jax_distgemm::cuda

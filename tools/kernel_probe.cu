// Probe, not part of the package: CUTLASS SM90 bf16 GEMM variants (row-major A, B, D; fp32
// accumulate; persistent data-parallel scheduler, raster along M) against the kernel we ship
// most (Cooperative 128x256, cluster 2x1, epilogue tile auto = 128x32 subtiles, TMA stores),
// at the suite's stage shapes.  Six variant sets, chosen at compile time:
//
//   -DPROBE_SET=1 (epilogue; docs/performance.md Q1): only the epilogue differs
//     e128x64   128x64 subtiles: half the named-barrier rounds per tile, same mainloop stages
//     e128x128  128x128 subtiles: a quarter of them, one mainloop stage less
//     nosmem    no shared memory: every thread stores its accumulators to global itself
//     c1x1      the baseline without the cluster
//   -DPROBE_SET=2 (tiles whose epilogue overlaps math; Q4): Pingpong, where the two consumer
//     warpgroups own a tile each and one's epilogue runs under the other's mainloop
//     pp64x256 c2x1 / c1x1   64x256 tiles: per warpgroup the same 64x256x16 wgmma as the
//                            baseline's; the 2x1 cluster multicasts the 256-wide B panel
//     pp128x128 c1x2         the tuner's usual pick at short k
//     c1x1                   the baseline without the cluster
//   -DPROBE_SET=3 (the two partial gains together; R1): stream-K (CUTLASS's StreamKScheduler,
//     Heuristic decomposition: stream-K only for a partial last wave; P3) and 128x64 subtiles
//     (Q1), each alone and both, on the baseline; and both without the cluster
//   -DPROBE_SET=4 (tile widths cuBLAS's nvjet is near; S2): taken then to need n a multiple of
//     64 for our N-major B (set 5 shows 160 builds too); so
//     coop128x192 c2x1 / c1x1   4800 tiles at 4096 x 28672 (36.4 waves) against 3584 (27.2)
//     coop128x320 c1x1          64x64 atoms, five per warpgroup and k-step (A re-read)
//     coop256x192 c1x1          192 accumulators per thread: fewer operand bytes per MAC
//   -DPROBE_SET=5 (160-wide tiles; 2026-12-01, session 19): with
//     CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED the builder picks 64x160 wgmma atoms and, for our
//     N-major B, 32-element (64-byte) swizzle atoms, which 160 is a multiple of
//     coop256x192 c1x1          config 7, the tuner's pick at 4096 x 4096 x 28672 (18.2 waves)
//     coop256x160 c1x1          2880 tiles there, 21.8 waves; 160 accumulators per thread
//     coop256x160 c2x1          the same, B multicast to the CTA pair
//     coop128x160 c2x1          cuBLAS's tile area (43.6 waves)
//   -DPROBE_SET=6 (the wide tiles' partial last wave; session 19): stream-K (Heuristic) on
//     coop256x192 c1x1 (18.2 waves at 4096 x 4096 x 28672), data-parallel and stream-K, and on
//     coop256x160 c2x1 (21.8 waves) and the baseline (27.2 waves); needs the extended shapes
//   -DPROBE_SET=7 (skinny stages, decode-like M; 2026-12-02, session 21): one wave of tiles or
//     less, each CTA alone on the whole k, so the weight streams from too few SMs.  Baseline
//     here: pp128x128 c1x2, the tuner's pick at these stages; against it
//     coop128x128 c1x1 sk     stream-K, Heuristic decomposition (stream-K below one wave)
//     coop128x128 c1x1 splitk split-K into about sm_count / tiles splits
//     coop128x256 c1x1 sk     the wider tile, stream-K
//     coop128x128 c1x1        data-parallel control
//     and each row's weight bandwidth (bytes of B / time)
//
// Sustained timing, as our tuner does: per turn ~100 ms untimed then >= 30 ms timed; the
// variants take turns, 5 rounds, median; normal bf16 operands (tools/probe_common.cuh).  Also
// each variant's largest difference from the baseline's output.
//
//   I=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
//   nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -DPROBE_SET=1 -I. -I$I \
//       -o kernel_probe tools/kernel_probe.cu && ./kernel_probe      # ~1 min on one H200
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "tools/probe_common.cuh"
using namespace cute;
using probe::T;
using Cooperative = cutlass::epilogue::TmaWarpSpecializedCooperative;
using NoSmem = cutlass::epilogue::NoSmemWarpSpecialized;
using AutoTile = cutlass::epilogue::collective::EpilogueTileAuto;

// -- Variants ------------------------------------------------------------------------------
template <class Tile, class Cluster, class EpiTile, class EpiSchedule, class KernelSchedule,
          class Sched = cutlass::gemm::PersistentScheduler, bool kSplitK_ = false>
struct G {
  static constexpr bool kSplitK = kSplitK_;
  static constexpr int kTileM = cute::size<0>(Tile{}), kTileN = cute::size<1>(Tile{});
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, EpiTile, float, float,
      void, cutlass::layout::RowMajor, 8, T, cutlass::layout::RowMajor, 8,
      EpiSchedule>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::RowMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epi::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using K = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, Sched>;
  using A = cutlass::gemm::device::GemmUniversalAdapter<K>;
  static constexpr int kStages = Main::DispatchPolicy::Stages;
};
using C1 = Shape<_1, _1, _1>;
using C2 = Shape<_2, _1, _1>;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingpongEpi = cutlass::epilogue::TmaWarpSpecialized;
using T128x256 = Shape<_128, _256, _64>;
#if (PROBE_SET == 5 || PROBE_SET == 6) && !defined(CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
#error "-DPROBE_SET=5 and 6 need -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (64x160 wgmma atoms)"
#endif
#if PROBE_SET == 7
using V0 = G<Shape<_128, _128, _64>, Shape<_1, _2, _1>, AutoTile,
             cutlass::epilogue::TmaWarpSpecialized, cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
#else
using V0 = G<T128x256, C2, AutoTile, Cooperative, Coop>;
#endif
#if PROBE_SET == 1
using V1 = G<T128x256, C2, Shape<_128, _64>, Cooperative, Coop>;
using V2 = G<T128x256, C2, Shape<_128, _128>, Cooperative, Coop>;
using V3 = G<T128x256, C2, AutoTile, NoSmem, Coop>;
using V4 = G<T128x256, C1, AutoTile, Cooperative, Coop>;
const char* kNames[] = {"auto", "e128x64", "e128x128", "nosmem", "auto c1x1"};
#elif PROBE_SET == 2
using V1 = G<Shape<_64, _256, _64>, C2, AutoTile, PingpongEpi, Pingpong>;
using V2 = G<Shape<_64, _256, _64>, C1, AutoTile, PingpongEpi, Pingpong>;
using V3 = G<Shape<_128, _128, _64>, Shape<_1, _2, _1>, AutoTile, PingpongEpi, Pingpong>;
using V4 = G<T128x256, C1, AutoTile, Cooperative, Coop>;
const char* kNames[] = {"coop128x256 c2x1", "pp64x256 c2x1", "pp64x256 c1x1",
                        "pp128x128 c1x2", "coop128x256 c1x1"};
#elif PROBE_SET == 3
using SK = cutlass::gemm::StreamKScheduler;
using E64 = Shape<_128, _64>;
using V1 = G<T128x256, C2, E64, Cooperative, Coop>;
using V2 = G<T128x256, C2, AutoTile, Cooperative, Coop, SK>;
using V3 = G<T128x256, C2, E64, Cooperative, Coop, SK>;
using V4 = G<T128x256, C1, E64, Cooperative, Coop, SK>;
const char* kNames[] = {"dp auto", "dp e128x64", "sk auto", "sk e128x64", "sk e128x64 c1x1"};
#elif PROBE_SET == 4
using V1 = G<Shape<_128, _192, _64>, C2, AutoTile, Cooperative, Coop>;
using V2 = G<Shape<_128, _192, _64>, C1, AutoTile, Cooperative, Coop>;
using V3 = G<Shape<_128, Int<320>, _64>, C1, AutoTile, Cooperative, Coop>;
using V4 = G<Shape<_256, _192, _64>, C1, AutoTile, Cooperative, Coop>;
const char* kNames[] = {"coop128x256 c2x1", "coop128x192 c2x1", "coop128x192 c1x1",
                        "coop128x320 c1x1", "coop256x192 c1x1"};
#elif PROBE_SET == 5
using V1 = G<Shape<_256, _192, _64>, C1, AutoTile, Cooperative, Coop>;
using V2 = G<Shape<_256, Int<160>, _64>, C1, AutoTile, Cooperative, Coop>;
using V3 = G<Shape<_256, Int<160>, _64>, C2, AutoTile, Cooperative, Coop>;
using V4 = G<Shape<_128, Int<160>, _64>, C2, AutoTile, Cooperative, Coop>;
const char* kNames[] = {"coop128x256 c2x1", "coop256x192 c1x1", "coop256x160 c1x1",
                        "coop256x160 c2x1", "coop128x160 c2x1"};
#elif PROBE_SET == 6
using SK = cutlass::gemm::StreamKScheduler;
using V1 = G<Shape<_256, _192, _64>, C1, AutoTile, Cooperative, Coop>;
using V2 = G<Shape<_256, _192, _64>, C1, AutoTile, Cooperative, Coop, SK>;
using V3 = G<Shape<_256, Int<160>, _64>, C2, AutoTile, Cooperative, Coop, SK>;
using V4 = G<T128x256, C2, AutoTile, Cooperative, Coop, SK>;
const char* kNames[] = {"coop128x256 c2x1", "coop256x192 c1x1", "coop256x192 c1x1 sk",
                        "coop256x160 c2x1 sk", "coop128x256 c2x1 sk"};
#elif PROBE_SET == 7
using SK = cutlass::gemm::StreamKScheduler;
using T128x128 = Shape<_128, _128, _64>;
using V1 = G<T128x128, C1, AutoTile, Cooperative, Coop, SK>;
using V2 = G<T128x128, C1, AutoTile, Cooperative, Coop, SK, /*kSplitK=*/true>;
using V3 = G<T128x256, C1, AutoTile, Cooperative, Coop, SK>;
using V4 = G<T128x128, C1, AutoTile, Cooperative, Coop>;
const char* kNames[] = {"pp128x128 c1x2", "coop128x128 c1x1 sk", "coop128x128 c1x1 splitk",
                        "coop128x256 c1x1 sk", "coop128x128 c1x1"};
#else
#error "-DPROBE_SET=1 (epilogue), 2 (Pingpong tiles), 3 (stream-K x subtiles), 4 (tile widths), 5 (160-wide), 6 (stream-K, wide tiles) or 7 (skinny stages)"
#endif
constexpr int kVariants = 5;

// -- Running -------------------------------------------------------------------------------
struct RunnerBase {
  virtual ~RunnerBase() = default;
  virtual bool Init(int m, int n, int k, T* a, T* b, T* d) = 0;
  virtual void Run(cudaStream_t s) = 0;
};
template <class Gm>
struct Runner : RunnerBase {
  typename Gm::A op;
  typename Gm::K::Arguments saved{};
  void* ws = nullptr;  // stream-K's partials and barriers (none for data-parallel tiles)
  ~Runner() override {
    if (ws != nullptr) cudaFree(ws);
  }
  bool Init(int m, int n, int k, T* a, T* b, T* d) override {
    auto args = probe::GemmArguments<typename Gm::K>(m, n, k, a, b, d, /*raster=*/1);
    if constexpr (Gm::kSplitK) {  // about one wave of (tile, split) units
      using Mode = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams::DecompositionMode;
      int tiles = ((m + Gm::kTileM - 1) / Gm::kTileM) * ((n + Gm::kTileN - 1) / Gm::kTileN);
      args.scheduler.decomposition_mode = Mode::SplitK;
      args.scheduler.splits = std::max(1, std::min(args.hw_info.sm_count / tiles, k / 256));
    }
    if (op.can_implement(args) != cutlass::Status::kSuccess) return false;
    if (size_t bytes = Gm::A::get_workspace_size(args); bytes != 0) cudaMalloc(&ws, bytes);
    saved = args;
    return op.initialize(args, ws) == cutlass::Status::kSuccess;
  }
  // run() re-initializes the workspace (stream-K: zeroes its barriers), as a fresh call would.
  void Run(cudaStream_t s) override { op.run(saved, ws, s); }
};

int main() {
#if PROBE_SET == 7
  // (m, k, n): AllGather stages of (M, 8192, 8192) at TP=2, ReduceScatter stages of the same,
  // a 70B-like MLP's (M, 8192, 28672) at TP=2 (AllGather, then its ReduceScatter), and one
  // stage of two waves.
  int shapes[][3] = {{16, 8192, 4096},   {64, 8192, 4096},   {256, 8192, 4096},
                     {512, 8192, 4096},  {32, 4096, 8192},   {128, 4096, 8192},
                     {512, 4096, 8192},  {16, 8192, 14336},  {16, 14336, 8192},
                     {128, 8192, 14336}, {1024, 8192, 4096}};
#else
  // (m, k, n) of the suite's stages at TP=2 (docs/performance.md), largest first.
  int shapes[][3] = {{8192, 16384, 53248}, {8192, 8192, 106496}, {4096, 4096, 28672},
                     {4096, 8192, 14336},  {2048, 8192, 4096},   {2048, 4096, 8192},
                     {4096, 4096, 2048},   {4096, 2048, 4096},   {1024, 8192, 4096},
                     {1024, 4096, 8192}};
#endif
  size_t maxa = 8192ull * 16384, maxb = 16384ull * 106496, maxd = 8192ull * 106496;
  T *a, *b, *d;
  cudaMalloc(&a, maxa * 2);
  cudaMalloc(&b, maxb * 2);
  cudaMalloc(&d, maxd * 2);
  probe::FillNormal(a, maxa, b, maxb);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  printf("mainloop stages: %s %d, %s %d, %s %d, %s %d, %s %d\n", kNames[0], V0::kStages,
         kNames[1], V1::kStages, kNames[2], V2::kStages, kNames[3], V3::kStages, kNames[4],
         V4::kStages);
  for (auto& s : shapes) {
    int m = s[0], k = s[1], n = s[2];
    Runner<V0> r0;
    Runner<V1> r1;
    Runner<V2> r2;
    Runner<V3> r3;
    Runner<V4> r4;
    RunnerBase* rs[kVariants] = {&r0, &r1, &r2, &r3, &r4};
    bool ok = true;
    for (auto* r : rs) ok = ok && r->Init(m, n, k, a, b, d);
    if (!ok) {
      printf("m=%d k=%d n=%d: init failed\n", m, k, n);
      continue;
    }
    // Outputs against the baseline's.
    std::vector<uint16_t> ref(size_t(m) * n), got(size_t(m) * n);
    double maxdiff[kVariants] = {0};
    r0.Run(0);
    cudaMemcpy(ref.data(), d, ref.size() * 2, cudaMemcpyDeviceToHost);
    for (int v = 1; v < kVariants; ++v) {
      cudaMemset(d, 0, ref.size() * 2);
      rs[v]->Run(0);
      cudaMemcpy(got.data(), d, got.size() * 2, cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < ref.size(); i += 5)
        maxdiff[v] = std::max(
            maxdiff[v], double(fabsf(probe::Bf16ToFloat(ref[i]) - probe::Bf16ToFloat(got[i]))));
    }
    float one = probe::Turn(r0, 1, 2, e0, e1);
    int heat = std::max(1, int(100.f / one)), timed = std::max(3, int(30.f / one));
    std::vector<float> t[kVariants];
    for (int round = 0; round < 5; ++round)
      for (int v = 0; v < kVariants; ++v) t[v].push_back(probe::Turn(*rs[v], heat, timed, e0, e1));
    double flop = 2.0 * m * n * k;
    printf("m=%d k=%d n=%d:", m, k, n);
    float base = 0;
    for (int v = 0; v < kVariants; ++v) {
      std::sort(t[v].begin(), t[v].end());
      float med = t[v][2];
      if (v == 0) base = med;
      printf(" %s %.4f ms (%.0f TF/s, B %.0f GB/s, x%.3f, diff %.3g);", kNames[v], med,
             flop / med / 1e9, 2.0 * k * n / med / 1e6, base / med, maxdiff[v]);
    }
    printf(" err %s\n", cudaGetErrorString(cudaGetLastError()));
    fflush(stdout);
  }
  return 0;
}

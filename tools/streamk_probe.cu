// Probe, not part of the package: CUTLASS SM90 Cooperative 128x256 bf16 GEMM (row-major A, B,
// D; fp32 accumulate; clusters 1x1 and 2x1) with the persistent data-parallel tile scheduler
// against the stream-K one (its Heuristic decomposition: stream-K only for a partial last
// wave), at the suite's stage shapes and whole-wave neighbours.  Sustained timing, as our tuner
// does: per turn ~100 ms untimed, then >= 30 ms timed; the four kernels take turns, 5 rounds,
// median.  Also the largest difference between the stream-K and data-parallel outputs.
// Results: docs/performance.md, P3.
//
//   I=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
//   nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -I. -I$I -o streamk_probe \
//       tools/streamk_probe.cu && ./streamk_probe      # ~1 min on one H200
//
// Operands are normal bf16, as the benchmark draws them (tools/probe_common.cuh says why).
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstring>
#include <random>
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
template <class Cluster, class Sched>
struct G {
  using Tile = Shape<_128, _256, _64>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, 8, T, cutlass::layout::RowMajor, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::RowMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epi::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using K = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, Sched>;
  using A = cutlass::gemm::device::GemmUniversalAdapter<K>;
};
template <class Gm>
struct Runner {
  typename Gm::A op;
  typename Gm::K::Arguments saved{};
  void* ws = nullptr;
  size_t ws_bytes = 0;
  bool Init(int m, int n, int k, T* a, T* b, T* d, int raster) {
    auto args = probe::GemmArguments<typename Gm::K>(m, n, k, a, b, d, raster);
    if (op.can_implement(args) != cutlass::Status::kSuccess) return false;
    ws_bytes = Gm::A::get_workspace_size(args);
    if (ws_bytes) cudaMalloc(&ws, ws_bytes);
    saved = args;
    return op.initialize(args, ws) == cutlass::Status::kSuccess;
  }
  // run() re-initializes the workspace (stream-K: zeroes its barriers) like a fresh call would.
  void Run(cudaStream_t s) { op.run(saved, ws, s); }
};
using probe::Turn;
int main() {
  int shapes[][3] = {{4096, 4096, 28672}, {4096, 4096, 25344}, {4096, 8192, 14336},
                     {4096, 8192, 16896}, {2048, 8192, 4096}, {1024, 8192, 4096},
                     {8192, 8192, 106496}, {8192, 16384, 53248}};
  size_t maxa = 8192ull * 16384, maxb = 16384ull * 106496, maxd = 8192ull * 106496;
  T *a, *b, *d;
  cudaMalloc(&a, maxa * 2); cudaMalloc(&b, maxb * 2); cudaMalloc(&d, maxd * 2);
  probe::FillNormal(a, maxa, b, maxb);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  using DP1 = G<Shape<_1, _1, _1>, cutlass::gemm::PersistentScheduler>;
  using SK1 = G<Shape<_1, _1, _1>, cutlass::gemm::StreamKScheduler>;
  using DP2 = G<Shape<_2, _1, _1>, cutlass::gemm::PersistentScheduler>;
  using SK2 = G<Shape<_2, _1, _1>, cutlass::gemm::StreamKScheduler>;
  for (auto& s : shapes) {
    int m = s[0], k = s[1], n = s[2];
    for (int raster : {1, 2}) {
      Runner<DP1> dp1; Runner<SK1> sk1; Runner<DP2> dp2; Runner<SK2> sk2;
      bool ok = dp1.Init(m, n, k, a, b, d, raster) && sk1.Init(m, n, k, a, b, d, raster) &&
                dp2.Init(m, n, k, a, b, d, raster) && sk2.Init(m, n, k, a, b, d, raster);
      if (!ok) { printf("m=%d k=%d n=%d: init failed\n", m, k, n); continue; }
      float one = Turn(dp1, 1, 2, e0, e1);
      int heat = std::max(1, int(100.f / one)), timed = std::max(3, int(30.f / one));
      std::vector<float> t[4];
      for (int round = 0; round < 5; ++round) {
        t[0].push_back(Turn(dp1, heat, timed, e0, e1));
        t[1].push_back(Turn(sk1, heat, timed, e0, e1));
        t[2].push_back(Turn(dp2, heat, timed, e0, e1));
        t[3].push_back(Turn(sk2, heat, timed, e0, e1));
      }
      // SK's result against DP's (the K split changes the summation order only).
      std::vector<uint16_t> hd(size_t(m) * n), hs(size_t(m) * n);
      dp1.Run(0); cudaMemcpy(hd.data(), d, hd.size() * 2, cudaMemcpyDeviceToHost);
      sk1.Run(0); cudaMemcpy(hs.data(), d, hs.size() * 2, cudaMemcpyDeviceToHost);
      double maxdiff = 0, maxref = 0;
      for (size_t i = 0; i < hd.size(); i += 7) {
        float fx = probe::Bf16ToFloat(hd[i]), fy = probe::Bf16ToFloat(hs[i]);
        maxdiff = std::max(maxdiff, double(fabsf(fx - fy)));
        maxref = std::max(maxref, double(fabsf(fx)));
      }
      float med[4];
      for (int i = 0; i < 4; ++i) { std::sort(t[i].begin(), t[i].end()); med[i] = t[i][2]; }
      double flop = 2.0 * m * n * k;
      printf("m=%d k=%d n=%d raster %s: DP c1x1 %.4f ms (%.0f TF/s), SK c1x1 %.4f (%.0f), "
             "DP c2x1 %.4f (%.0f), SK c2x1 %.4f (%.0f); SK ws %zu / %zu bytes; "
             "SK-DP max %.3g of %.3g; err %s\n",
             m, k, n, raster == 1 ? "M" : "N", med[0], flop / med[0] / 1e9, med[1],
             flop / med[1] / 1e9, med[2], flop / med[2] / 1e9, med[3], flop / med[3] / 1e9,
             sk1.ws_bytes, sk2.ws_bytes, maxdiff, maxref, cudaGetErrorString(cudaGetLastError()));
      fflush(stdout);
      if (sk1.ws) cudaFree(sk1.ws);
      if (sk2.ws) cudaFree(sk2.ws);
      if (dp1.ws) cudaFree(dp1.ws);
      if (dp2.ws) cudaFree(dp2.ws);
    }
  }
  return 0;
}

// Per-shape choice of the stage GEMM kernel configuration.
//
// The first time a stage shape (types, M, N, K, batch, source, fused stage count) is seen on a
// device, every compiled config is timed on the real operands (events on the caller's stream),
// then the two fastest again with each raster order x swizzle; the fastest variant is cached
// for the process.  Candidates are timed as a power-capped GPU runs them in a loop: after
// heating the GPU, over back-to-back launches in interleaved rounds, each turn after an untimed
// run of the same candidate, so that each runs at the clock it sustains (autotune.cc).
//
// JAX_DISTGEMM_AUTOTUNE=0 disables tuning (a fixed default is used);
// JAX_DISTGEMM_GEMM_CONFIG=<n>[:<raster>[:<swizzle>]] forces config n (raster 0 heuristic,
// 1 along M, 2 along N; swizzle 1, 2, 4 or 8), a debugging and test hook.  Both are read once
// per process, so that every device of a call sees the same value.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cc/cuda/gemm_kernels.h"

namespace jax_distgemm::cuda {

// Sets g.config, g.raster and g.max_swizzle.  May run (and synchronize on) trial launches: only
// call it where a trial GEMM may scribble on g.ops.d and nobody waits on this device yet.
std::string ChooseConfig(GemmLaunch& g, cudaStream_t stream);

// Whether a fused (ptr-array) kernel is compiled for these types, and for the config that
// JAX_DISTGEMM_GEMM_CONFIG forces, if any.
bool CanFuse(ElemType ab_type, ElemType d_type);

// Tuned entries so far, one line each (for logs and the benchmark).
std::string DescribeTuning();

// -- Saved choices (jax_distgemm.save_tuning / load_tuning) ---------------------------------------
// One cached choice in a form that outlives the process: the device is named by its model and
// SM count (not its ordinal), the kernel by its config's name (GemmConfigName), types by
// ElemName.
struct TuningRecord {
  std::string gpu;  // cudaDeviceProp::name
  int sm_count = 0;
  std::string ab_type, d_type;
  bool has_c = false;
  int64_t m = 0, n = 0, k = 0, batch = 1;
  bool shared_b = false;  // B's batch stride is 0
  int fused_stages = 0;  // 0: a stage launch
  std::string config;
  int raster = 0, swizzle = 1;
  float ms = -1.f;  // the tuner's time for it (informational)
};
// Every cached choice.
std::vector<TuningRecord> ExportTuning();
// Installs `records` for every visible device of the record's model and SM count, replacing
// what this process chose for the same key.  Checks every record first and installs none if one
// is invalid (unknown name, config not compiled for its types, bad raster or swizzle): returns
// "" or the error.  *installed: (record, device) pairs.
std::string ImportTuning(const std::vector<TuningRecord>& records, int* installed);
// Forgets every choice: the next call of each shape tunes again.
void ClearTuning();

}  // namespace jax_distgemm::cuda

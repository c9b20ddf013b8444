// Per-shape choice of the stage GEMM kernel configuration.
//
// The first time a stage shape (types, M, N, K, batch, source, fused stage count) is seen on a
// device, every compiled config is timed on the real operands (events on the caller's stream),
// then the two fastest again with each raster order x swizzle; the fastest variant is cached
// for the process.  Candidates are timed after heating the GPU, over back-to-back launches in
// interleaved rounds, each turn after an untimed run of the same candidate (what a power-capped
// GPU sustains in a loop); JAX_DISTGEMM_TUNE=coarse skips the untimed runs,
// JAX_DISTGEMM_TUNE=burst takes the best of two single launches instead.
// JAX_DISTGEMM_AUTOTUNE=0 disables tuning (a fixed default is used);
// JAX_DISTGEMM_GEMM_CONFIG=<n>[:<raster>[:<swizzle>]] forces config n (raster 0 heuristic,
// 1 along M, 2 along N; swizzle 1, 2, 4 or 8).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cc/cuda/gemm_kernels.h"

namespace jax_distgemm::cuda {

// Sets g.config, g.raster and g.max_swizzle.  May run (and synchronize on) trial launches: only call it
// where a trial GEMM may scribble on g.ops.d and nobody waits on this device yet.
std::string ChooseConfig(GemmLaunch& g, cudaStream_t stream);

// A call trial's timing of one launch (autotune.cc, "Call trials"): the event to record after it.
struct CallTiming {
  cudaEvent_t done = nullptr;  // nullptr: this launch is not timed
  bool* recorded = nullptr;
};

// After ChooseConfig, on every launch: while a long AllGather grid's call trial lasts, sets the
// variant this call runs; then EndCall after the launch, which may record an event on `stream`.
// Never synchronizes.
CallTiming BeginCall(GemmLaunch& g);
void EndCall(const CallTiming& timing, cudaStream_t stream);

// Whether a fused (ptr-array) kernel is compiled for these types, and for the config that
// JAX_DISTGEMM_GEMM_CONFIG forces, if any.
bool CanFuse(ElemType ab_type, ElemType d_type);

// Tuned entries so far, one line each (for logs and the benchmark).
std::string DescribeTuning();

// -- Saved choices (jax_distgemm.save_tuning / load_tuning) ---------------------------------------
// One cached choice in a form that outlives the process: the device is named by its model and SM
// count (not its ordinal), the kernel by its config's name (GemmConfigName), types by ElemName,
// the tuning mode by name ("sustained", "coarse", "burst").
struct TuningRecord {
  std::string gpu;  // cudaDeviceProp::name
  int sm_count = 0;
  std::string ab_type, d_type;
  bool has_c = false;
  int64_t m = 0, n = 0, k = 0, batch = 1;
  bool shared_b = false;  // B's batch stride is 0
  int fused_stages = 0;  // 0: a stage launch
  std::string tune_mode;
  int turn_heat_ms = -1;  // JAX_DISTGEMM_TUNE_HEAT_MS, -1 unset
  bool call_trials = true;  // JAX_DISTGEMM_CALL_TRIAL not 0
  std::string config;
  int raster = 0, swizzle = 1;
  float ms = -1.f;  // the tuner's time for it (informational)
  float call_ms[2] = {-1.f, -1.f};  // a call trial's verdict, if one ran
};
// Every settled choice (a key whose call trial still runs is left out: its choice is not final).
std::vector<TuningRecord> ExportTuning();
// Installs `records` for every visible device of the record's model and SM count, replacing
// what this process chose for the same key (a call trial of that key is dropped).  Checks every
// record first and installs none if one is invalid (unknown name, config not compiled for its
// types, bad raster or swizzle): returns "" or the error.  *installed: (record, device) pairs.
std::string ImportTuning(const std::vector<TuningRecord>& records, int* installed);
// Forgets every choice and call trial: the next call of each shape tunes again.
void ClearTuning();

}  // namespace jax_distgemm::cuda

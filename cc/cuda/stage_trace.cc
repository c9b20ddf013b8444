#include "cc/cuda/stage_trace.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "cc/common/env.h"
#include "cc/cuda/cuda_check.h"

namespace jax_distgemm::cuda {
namespace {

struct Meta {
  int64_t call;
  int32_t stage, chunk;
};
struct DeviceTrace {
  uint64_t* words = nullptr;  // [kTraceCapacity][3], device memory
  std::vector<Meta> meta;     // one per reserved record
  std::vector<TraceRecord> host;  // one per call
};

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
std::map<int, DeviceTrace>& Traces() {
  static auto* t = new std::map<int, DeviceTrace>();
  return *t;
}

constexpr size_t kTraceBytes = sizeof(uint64_t) * 3 * kTraceCapacity;

}  // namespace

bool TraceEnabled() {
  static const bool on = EnvFlag("JAX_DISTGEMM_TRACE");
  return on;
}

std::string TraceInit(int ordinal) {
  if (!TraceEnabled()) return "";
  std::lock_guard<std::mutex> lock(Mu());
  DeviceTrace& t = Traces()[ordinal];
  if (t.words != nullptr) return "";
  JDG_RETURN_IF_CUDA_ERROR(cudaSetDevice(ordinal));
  void* p = nullptr;
  JDG_RETURN_IF_CUDA_ERROR(cudaMalloc(&p, kTraceBytes));
  JDG_RETURN_IF_CUDA_ERROR(cudaMemset(p, 0, kTraceBytes));
  t.words = static_cast<uint64_t*>(p);
  t.meta.reserve(kTraceCapacity);
  return "";
}

uint64_t* TraceReserve(int ordinal, int64_t call, int stage, int chunk) {
  if (!TraceEnabled()) return nullptr;
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Traces().find(ordinal);
  if (it == Traces().end() || it->second.words == nullptr) return nullptr;
  DeviceTrace& t = it->second;
  if (t.meta.size() >= static_cast<size_t>(kTraceCapacity)) return nullptr;
  t.meta.push_back(Meta{call, stage, chunk});
  return t.words + 3 * (t.meta.size() - 1);
}

void TraceHostCall(int ordinal, int64_t call, uint64_t begin_ns, uint64_t end_ns) {
  if (!TraceEnabled()) return;
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Traces().find(ordinal);
  if (it == Traces().end() || it->second.host.size() >= static_cast<size_t>(kTraceCapacity)) {
    return;
  }
  it->second.host.push_back(TraceRecord{ordinal, call, -1, 0, begin_ns, begin_ns, end_ns});
}

std::string TraceDump(bool clear, std::vector<TraceRecord>* out) {
  std::lock_guard<std::mutex> lock(Mu());
  int prev = 0;
  JDG_RETURN_IF_CUDA_ERROR(cudaGetDevice(&prev));
  for (auto& [ordinal, t] : Traces()) {
    if (t.words == nullptr) continue;
    JDG_RETURN_IF_CUDA_ERROR(cudaSetDevice(ordinal));
    JDG_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
    std::vector<uint64_t> words(3 * t.meta.size());
    if (!words.empty()) {
      JDG_RETURN_IF_CUDA_ERROR(cudaMemcpy(words.data(), t.words, words.size() * sizeof(uint64_t),
                                          cudaMemcpyDeviceToHost));
    }
    for (size_t i = 0; i < t.meta.size(); ++i) {
      const uint64_t s = words[3 * i];
      out->push_back(TraceRecord{ordinal, t.meta[i].call, t.meta[i].stage, t.meta[i].chunk,
                                 s == 0 ? 0 : ~s, words[3 * i + 1], words[3 * i + 2]});
    }
    out->insert(out->end(), t.host.begin(), t.host.end());
    if (clear) {
      t.host.clear();
      JDG_RETURN_IF_CUDA_ERROR(cudaMemset(t.words, 0, kTraceBytes));
      JDG_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
      t.meta.clear();
    }
  }
  JDG_RETURN_IF_CUDA_ERROR(cudaSetDevice(prev));
  return "";
}

}  // namespace jax_distgemm::cuda

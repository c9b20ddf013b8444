#include "cc/cuda/copy_stream.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "cc/cuda/cuda_check.h"
#include "cc/cuda/peer_state.h"

namespace jax_distgemm::cuda {
namespace {

// Enough to pass every hardware queue (CUDA_DEVICE_MAX_CONNECTIONS is at most 32).
constexpr int kMaxCandidates = 32;
// How long `main`'s event may take on an idle GPU before we call the candidate's queue shared
// (an independent queue completes it in microseconds).
constexpr auto kProbeMs = std::chrono::milliseconds(20);
// How long the released wait may take to pass before the probe gives up with an error.
constexpr auto kReleaseMs = std::chrono::milliseconds(2000);

// Host-mapped gate word plus an event: what one probe needs, freed on every path.
struct Probe {
  uint32_t* host = nullptr;
  uint32_t* dev = nullptr;
  cudaEvent_t ev = nullptr;
  ~Probe() {
    if (ev != nullptr) cudaEventDestroy(ev);
    if (host != nullptr) cudaFreeHost(host);
  }
  void Set(uint32_t v) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    *reinterpret_cast<volatile uint32_t*>(host) = v;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
};

// Polls `query` until it is no longer cudaErrorNotReady or `limit` passes.
template <class Query>
cudaError_t PollUntil(Query query, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  cudaError_t e = query();
  while (e == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    e = query();
  }
  return e;
}

// Whether `s` sits on a queue of its own: block it on the gate, record an event on `main`,
// and see whether the event completes before the gate opens.
// *unsupported: the wait could not even be enqueued (nothing is blocked; the caller may fall
// back to an unprobed stream).
std::string IsIndependent(Probe& probe, cudaStream_t main, cudaStream_t s, bool* independent,
                          bool* unsupported) {
  probe.Set(0);
  if (cudaError_t e = StreamWaitValue32(s, probe.dev, 1); e != cudaSuccess) {
    *unsupported = true;
    return CudaError("copy stream probe: cuStreamWaitValue32 on a mapped host word", e);
  }
  cudaError_t rec = cudaEventRecord(probe.ev, main);
  cudaError_t seen = rec == cudaSuccess
                         ? PollUntil([&] { return cudaEventQuery(probe.ev); }, kProbeMs)
                         : rec;
  probe.Set(1);  // always open the gate, whatever we saw
  cudaError_t passed = PollUntil([&] { return cudaStreamQuery(s); }, kReleaseMs);
  cudaGetLastError();  // cudaErrorNotReady is not an error here
  if (rec != cudaSuccess) return CudaError("copy stream probe: cudaEventRecord", rec);
  if (passed != cudaSuccess) {
    return passed == cudaErrorNotReady
               ? "copy stream probe: a stream wait on a host word did not pass 2 s after the "
                 "word was set"
               : CudaError("copy stream probe: cudaStreamQuery", passed);
  }
  JDG_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(main));
  *independent = seen == cudaSuccess;
  return "";
}

}  // namespace

namespace {
std::atomic<int> g_copy_stream_mode{static_cast<int>(CopyStreamMode::kProbe)};
}  // namespace

void SetCopyStreamMode(CopyStreamMode mode) { g_copy_stream_mode.store(static_cast<int>(mode)); }
CopyStreamMode GetCopyStreamMode() {
  return static_cast<CopyStreamMode>(g_copy_stream_mode.load());
}

std::string CreateCopyStream(cudaStream_t main, CopyStreamMode mode, cudaStream_t* out,
                             CopyStreamReport* report) {
  *report = CopyStreamReport{};
  JDG_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(main));
  auto unprobed = [&](const std::string& why) -> std::string {  // one stream, not probed
    cudaGetLastError();
    report->note = why;
    report->candidates = 1;
    report->independent = -1;
    JDG_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(out, cudaStreamNonBlocking));
    return "";
  };
  if (mode == CopyStreamMode::kUnchecked) return unprobed("CopyStreamMode::kUnchecked");
  Probe probe;
  void* h = nullptr;
  if (cudaHostAlloc(&h, sizeof(uint32_t), cudaHostAllocMapped) != cudaSuccess) {
    return unprobed("no mapped host word for the probe");
  }
  probe.host = static_cast<uint32_t*>(h);
  if (cudaHostGetDevicePointer(reinterpret_cast<void**>(&probe.dev), h, 0) != cudaSuccess ||
      cudaEventCreateWithFlags(&probe.ev, cudaEventDisableTiming) != cudaSuccess) {
    return unprobed("no device view of the probe's host word");
  }
  // Candidates not kept, alive until we return (so that the next stream goes to the next
  // queue), then destroyed whichever way we return.
  struct Rejected {
    std::vector<cudaStream_t> streams;
    ~Rejected() {
      for (cudaStream_t r : streams) cudaStreamDestroy(r);
    }
  } rejected;
  for (int i = 0; i < kMaxCandidates; ++i) {
    cudaStream_t s = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
      return CudaError("cudaStreamCreateWithFlags (copy stream)", e);
    }
    ++report->candidates;
    bool independent = false, unsupported = false;
    if (std::string err = IsIndependent(probe, main, s, &independent, &unsupported);
        !err.empty()) {
      rejected.streams.push_back(s);
      return unsupported ? unprobed(err) : err;
    }
    report->independent = independent ? 1 : 0;
    // Keep the first independent one; with none, the last one tried.
    if (independent || i + 1 == kMaxCandidates) {
      *out = s;
      return "";
    }
    rejected.streams.push_back(s);
  }
  return "copy stream probe: no candidate";  // unreachable: limit >= 1
}

}  // namespace jax_distgemm::cuda

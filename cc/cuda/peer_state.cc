#include "cc/cuda/peer_state.h"

#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>

#include "cc/common/rendezvous.h"
#include "cc/cuda/cuda_check.h"
#include "cc/cuda/fp8_gemm.h"
#include "cc/cuda/gemm_kernels.h"

namespace jax_distgemm::cuda {
namespace {

size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

}  // namespace

PeerGroup::PeerGroup(std::vector<int64_t> ids, std::vector<int> ordinals)
    : ids_(std::move(ids)), ordinals_(std::move(ordinals)), devs_(ordinals_.size()) {
  for (size_t r = 0; r < devs_.size(); ++r) {
    devs_[r].ordinal = ordinals_[r];
    devs_[r].id = ids_[r];
    if (ordinals_[r] < 0) cross_process_ = true;
  }
}

PeerGroup::~PeerGroup() = default;  // process-lifetime: the driver reclaims at exit

std::string PeerGroup::InitDevice(int rank, cudaStream_t stream) {
  DeviceState& d = devs_[rank];
  JDG_RETURN_IF_CUDA_ERROR(cudaSetDevice(d.ordinal));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_ == nullptr) {
      void* p = nullptr;
      JDG_RETURN_IF_CUDA_ERROR(
          cudaHostAlloc(&p, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
      error_ = static_cast<ErrorRecord*>(p);
      *error_ = ErrorRecord{};
    }
  }
  // Peers read and write this device's workspace directly (TMA, copy engine): peer access to
  // every member.  XLA already enabled it for its own devices; "already enabled" is fine.
  // (Members in other processes: cudaIpcOpenMemHandle enables the path, peer_ipc.cc.)
  for (int peer : ordinals_) {
    if (peer == d.ordinal || peer < 0) continue;
    int can = 0;
    JDG_RETURN_IF_CUDA_ERROR(cudaDeviceCanAccessPeer(&can, d.ordinal, peer));
    if (!can) {
      std::ostringstream m;
      m << "device " << d.ordinal << " cannot access device " << peer
        << " (no NVLink/P2P path); use implementation='xla' for this mesh";
      return m.str();
    }
    cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else if (e != cudaSuccess) {
      return CudaError("cudaDeviceEnablePeerAccess", e);
    }
  }
  JDG_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, d.ordinal));
  if (std::string err = CreateCopyStream(stream, GetCopyStreamMode(), &d.copy_stream,
                                         &d.copy_stream_report);
      !err.empty()) {
    return err;
  }
  JDG_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&d.fork, cudaEventDisableTiming));
  JDG_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&d.join, cudaEventDisableTiming));
  JDG_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&d.stage_done, cudaEventDisableTiming));
  JDG_RETURN_IF_CUDA_ERROR(cudaMalloc(&d.flags, kFlagWords * sizeof(Epoch)));
  JDG_RETURN_IF_CUDA_ERROR(cudaMemset(d.flags, 0, kFlagWords * sizeof(Epoch)));
  JDG_RETURN_IF_CUDA_ERROR(cudaMalloc(&d.gemm_scratch, kGemmScratchBytes));
  JDG_RETURN_IF_CUDA_ERROR(cudaMemset(d.gemm_scratch, 0, kGemmScratchBytes));
  // Load every kernel now, before any peer can launch a kernel that spins on us.
  if (std::string err = PrepareGemmKernels(); !err.empty()) return err;
  if (std::string err = PrepareFp8GemmKernels(); !err.empty()) return err;
  JDG_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
  return "";
}

std::string PeerGroup::EnsureReady(int rank, size_t bytes, cudaStream_t stream, int64_t run_id,
                                   int64_t timeout_ms) {
  DeviceState& d = devs_[rank];
  const bool need_init = d.flags == nullptr;
  const bool need_grow = bytes > d.workspace_bytes;
  if (!need_init && !need_grow) return "";
  if (cross_process_) {
    return EnsureReadyCrossProcess(rank, bytes, need_init, need_grow, stream, timeout_ms);
  }
  // Every device of the group sees the same condition at the same call (same problem, same
  // history), so all TP threads come here together.
  std::ostringstream key;
  key << "cuda-ready";
  for (int o : ordinals_) key << "/" << o;
  key << "@" << run_id << "#" << d.workspace_bytes;
  std::shared_ptr<Session> session = JoinSession(key.str(), tp());
  const auto timeout = std::chrono::milliseconds(timeout_ms);
  if (need_init) {
    if (std::string err = InitDevice(rank, stream); !err.empty()) return err;
  }
  JDG_RETURN_IF_CUDA_ERROR(cudaSetDevice(d.ordinal));
  JDG_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
  JDG_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(d.copy_stream));
  // NOTE: after this barrier no device runs anything of ours: safe to free and cudaMalloc.
  if (auto e = session->Barrier(rank, 0, "workspace setup (drain)", timeout); !e.empty()) return e;
  if (need_grow) {
    if (std::string err = AllocateWorkspace(d, bytes); !err.empty()) return err;
  }
  JDG_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
  if (auto e = session->Barrier(rank, 1, "workspace setup (publish)", timeout); !e.empty()) return e;
  return "";
}

std::string PeerGroup::AllocateWorkspace(DeviceState& d, size_t bytes) {
  JDG_RETURN_IF_CUDA_ERROR(cudaSetDevice(d.ordinal));
  if (d.workspace != nullptr) JDG_RETURN_IF_CUDA_ERROR(cudaFree(d.workspace));
  d.workspace = nullptr;
  d.workspace_bytes = 0;
  const size_t size = RoundUp(bytes, size_t{2} << 20);
  cudaError_t e = cudaMalloc(&d.workspace, size);
  if (e != cudaSuccess) {
    cudaGetLastError();
    std::ostringstream m;
    m << "could not allocate the " << size << "-byte symmetric workspace on device "
      << d.ordinal << " (" << cudaGetErrorString(e)
      << "); it lives outside XLA's memory pool: lower XLA_PYTHON_CLIENT_MEM_FRACTION";
    return m.str();
  }
  d.workspace_bytes = size;
  return "";
}

std::string PeerGroup::PendingError() const {
  if (error_ == nullptr) return "";
  const volatile ErrorRecord* r = error_;
  if (r->code == 0) return "";
  std::ostringstream m;
  const int64_t device =
      r->rank >= 0 && r->rank < static_cast<int>(ids_.size()) ? ids_[r->rank] : -1;
  // NOTE: after a timeout the slots' ordering argument no longer holds (a device that gave up
  // runs ahead of a slow peer), so every call then in flight on the group is suspect too.
  constexpr const char* kInvalid =
      "the outputs of that call, and of every call in flight on the group's devices since, are "
      "invalid. Call jax_distgemm.runtime.reset() once no call is in flight to recover.";
  if (r->stage == kPushDoneStage) {
    m << "a wait timed out on GPU: rank " << r->rank << " (device " << device
      << ") waited for its own copy engine to finish pushing call epoch " << r->expected
      << " to its peers (flag still " << r->observed << "); " << kInvalid;
    return m.str();
  }
  m << "a wait on a peer timed out on GPU: rank " << r->rank << " (device " << device
    << ") at stage " << r->stage << " waited for rank " << r->peer << " to deliver call epoch "
    << r->expected << " (flag still " << r->observed
    << "). Every device of the TP group must run the same sequence of distgemm calls; "
    << kInvalid;
  return m.str();
}

std::string PeerGroup::Reset() {
  // Every local device drained first: no grid or copy of ours runs anywhere in this process
  // while the counters change.
  Epoch top = 0;
  for (DeviceState& d : devs_) {
    if (d.ordinal < 0 || d.flags == nullptr) continue;  // other processes reset their own
    JDG_RETURN_IF_CUDA_ERROR(cudaSetDevice(d.ordinal));
    JDG_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
    top = std::max(top, d.epoch);
  }
  // Flags are not zeroed: a late peer (another process still finishing an old call) could land
  // an old epoch in a zeroed word.  Calls continue from the next multiple of 2^32 instead, which
  // every process computes alike (their counters differ by the calls in flight at most), and
  // no old epoch reaches it.
  const Epoch base = ((top >> 32) + 1) << 32;
  for (DeviceState& d : devs_) {
    if (d.ordinal >= 0 && d.flags != nullptr) d.epoch = base;
  }
  if (error_ != nullptr) *error_ = ErrorRecord{};
  return "";
}

namespace {

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
using GroupKey = std::pair<std::vector<int64_t>, std::vector<int>>;
std::map<GroupKey, std::unique_ptr<PeerGroup>>& Groups() {
  static auto* g = new std::map<GroupKey, std::unique_ptr<PeerGroup>>();
  return *g;
}

}  // namespace

PeerGroup* GetPeerGroup(const std::vector<int64_t>& ids, const std::vector<int>& ordinals) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& slot = Groups()[GroupKey{ids, ordinals}];
  if (!slot) slot = std::make_unique<PeerGroup>(ids, ordinals);
  return slot.get();
}

std::vector<PeerGroup*> AllPeerGroups() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  std::vector<PeerGroup*> out;
  for (auto& [k, g] : Groups()) out.push_back(g.get());
  return out;
}

namespace {

// The driver's stream memory operations, through its entry point (no link-time dependency on
// libcuda); nullptr where the driver lacks one.  Write and wait of one width share a signature.
template <class Word>
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, Word, unsigned int);

template <class Word>
StreamValueFn<Word> DriverStreamValue(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<StreamValueFn<Word>>(p);
}

template <class Word>
cudaError_t CallStreamValue(StreamValueFn<Word> fn, cudaStream_t stream, const void* address,
                            Word value, unsigned int flags) {
  if (fn == nullptr) return cudaErrorNotSupported;
  CUresult r = fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address),
                  value, flags);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown;
}

}  // namespace

// Default write flags: a system-scope fence orders prior work on the stream before the write.
// GEQ waits compare cyclically in the word's width: 64-bit epochs never get near a wrap.
cudaError_t StreamWriteValue64(cudaStream_t stream, Epoch* address, Epoch value) {
  static const auto fn = DriverStreamValue<cuuint64_t>("cuStreamWriteValue64");
  return CallStreamValue<cuuint64_t>(fn, stream, address, value, CU_STREAM_WRITE_VALUE_DEFAULT);
}

cudaError_t StreamWaitValue64(cudaStream_t stream, const Epoch* address, Epoch value) {
  static const auto fn = DriverStreamValue<cuuint64_t>("cuStreamWaitValue64");
  return CallStreamValue<cuuint64_t>(fn, stream, address, value, CU_STREAM_WAIT_VALUE_GEQ);
}

cudaError_t StreamWriteValue32(cudaStream_t stream, uint32_t* address, uint32_t value) {
  static const auto fn = DriverStreamValue<cuuint32_t>("cuStreamWriteValue32");
  return CallStreamValue<cuuint32_t>(fn, stream, address, value, CU_STREAM_WRITE_VALUE_DEFAULT);
}

cudaError_t StreamWaitValue32(cudaStream_t stream, const uint32_t* address, uint32_t value) {
  static const auto fn = DriverStreamValue<cuuint32_t>("cuStreamWaitValue32");
  return CallStreamValue<cuuint32_t>(fn, stream, address, value, CU_STREAM_WAIT_VALUE_GEQ);
}

}  // namespace jax_distgemm::cuda

// Cross-process setup of a PeerGroup (one process per GPU): the members' workspaces and flags
// travel as CUDA IPC handles through a POSIX shared-memory meeting of the group
// (cc/common/shm_exchange.h, named by the job token that initialize_multiprocess() agreed on
// through JAX's key-value store).  Afterwards the executor uses the mapped pointers exactly as
// it uses a local peer's: copy-engine pushes, flag writes, TMA reads of a running sum.
//
// One setup meeting per (re)allocation, the same sequence in every process (same problems, same
// order: SPMD), numbered by PeerGroup::setup_meetings_:
//
//   phase 0  drain     every member drained its streams: nothing of ours runs anywhere
//            (growing)  unmap the peers' old workspaces
//   phase 1  unmapped  nobody maps an old workspace any more: owners may free it
//            (growing)  free + cudaMalloc this member's workspace;  export workspace (and, on
//                       the first meeting, flags) as cudaIpcMemHandles into our segment
//   phase 2  published open every peer's handles that changed (cudaIpcOpenMemHandle)
//   leave              the next meeting starts only when all left this one (shm gate), so
//                      nobody overwrites its handles while a peer still reads them
//
// NOTE: a member may push into a peer's workspace as soon as it passed phase 2: every peer
// allocated its workspace and flags before reaching phase 2.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <sstream>

#include "cc/common/shm_exchange.h"
#include "cc/cuda/cuda_check.h"
#include "cc/cuda/peer_state.h"

namespace jax_distgemm::cuda {
namespace {

// The setup channel's call_id: negative, so it never meets a call site's channel.
constexpr int64_t kSetupChannel = -0x1d67;
constexpr uint64_t kPublishedMagic = 0x3163706967646aULL;  // "jdgipc1"

// What a member publishes in the setup meeting.
struct Published {
  uint64_t magic;
  int32_t pid;
  int32_t reserved;
  int64_t workspace_generation;  // allocations of the workspace so far
  uint64_t workspace_bytes;
  cudaIpcMemHandle_t workspace;
  cudaIpcMemHandle_t flags;
};

std::string MapFailure(const DeviceState& peer, const Published& p, const char* what,
                       cudaError_t e) {
  cudaGetLastError();
  std::ostringstream m;
  m << "could not map the " << what << " of device " << peer.id << " (process " << p.pid
    << ") through CUDA IPC: " << cudaGetErrorString(e)
    << ". The GPUs of a TP group must share an NVLink/P2P path on one host; use "
       "implementation='xla' for this mesh";
  return m.str();
}

}  // namespace

std::string PeerGroup::EnsureReadyCrossProcess(int rank, size_t bytes, bool need_init,
                                               bool need_grow, cudaStream_t stream,
                                               int64_t timeout_ms) {
  DeviceState& d = devs_[rank];
  const auto timeout =
      std::chrono::milliseconds(std::max(timeout_ms, kCrossProcessSetupTimeoutMs));
  if (need_init) {
    if (std::string err = InitDevice(rank, stream); !err.empty()) return err;
  }
  JDG_RETURN_IF_CUDA_ERROR(cudaSetDevice(d.ordinal));
  JDG_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
  JDG_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(d.copy_stream));

  std::unique_ptr<ShmExchange> meeting;
  bool timed_out = false;
  if (std::string err = ShmExchange::Join(ids_, kSetupChannel, setup_meetings_++, rank, timeout,
                                          &meeting, &timed_out);
      !err.empty()) {
    return "cross-process workspace setup: " + err;
  }
  auto* mine = static_cast<Published*>(meeting->Buffer(rank, sizeof(Published)));
  if (auto e = meeting->Barrier(rank, 0, "cross-process workspace setup (drain)", timeout);
      !e.empty()) {
    return e;
  }
  if (need_grow) {
    // Every member grows at the same call (symmetric workspaces, same problem): drop our
    // mappings of the old ones before their owners free them.
    for (DeviceState& peer : devs_) {
      if (peer.ordinal >= 0 || peer.workspace == nullptr) continue;
      JDG_RETURN_IF_CUDA_ERROR(cudaIpcCloseMemHandle(peer.workspace));
      peer.workspace = nullptr;
      peer.workspace_bytes = 0;
      peer.ipc_generation = -1;
    }
  }
  if (auto e = meeting->Barrier(rank, 1, "cross-process workspace setup (unmap)", timeout);
      !e.empty()) {
    return e;
  }
  if (need_grow) {
    if (std::string err = AllocateWorkspace(d, bytes); !err.empty()) return err;
    ++d.ipc_generation;  // for a local member: allocations so far - 1
  }
  Published out{};
  out.magic = kPublishedMagic;
  out.pid = static_cast<int32_t>(getpid());
  out.workspace_generation = d.ipc_generation;
  out.workspace_bytes = d.workspace_bytes;
  if (d.workspace != nullptr) {
    JDG_RETURN_IF_CUDA_ERROR(cudaIpcGetMemHandle(&out.workspace, d.workspace));
  }
  JDG_RETURN_IF_CUDA_ERROR(cudaIpcGetMemHandle(&out.flags, d.flags));
  std::memcpy(mine, &out, sizeof(out));
  JDG_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
  if (auto e = meeting->Barrier(rank, 2, "cross-process workspace setup (publish)", timeout);
      !e.empty()) {
    return e;
  }
  for (int q = 0; q < tp(); ++q) {
    DeviceState& peer = devs_[q];
    if (peer.ordinal >= 0) continue;
    Published p;
    std::memcpy(&p, meeting->PeerBuffer(q, sizeof(Published)), sizeof(p));
    if (p.magic != kPublishedMagic) {
      return "cross-process workspace setup: device " + std::to_string(peer.id) +
             " published no handles (does every process run the same program?)";
    }
    // NOTE: slots are addressed by halves of the owner's workspace (executor.cc, Slot), so
    // the sizes must agree, not just suffice.
    if (p.workspace_bytes != d.workspace_bytes) {
      std::ostringstream m;
      m << "cross-process workspace setup: device " << peer.id << " holds a " << p.workspace_bytes
        << "-byte workspace, this one " << d.workspace_bytes << " (does every process run the "
        << "same program with the same JAX_DISTGEMM_* settings?)";
      return m.str();
    }
    if (peer.flags == nullptr) {
      void* ptr = nullptr;
      cudaError_t e = cudaIpcOpenMemHandle(&ptr, p.flags, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) return MapFailure(peer, p, "flags", e);
      peer.flags = static_cast<Epoch*>(ptr);
    }
    if (peer.workspace == nullptr || peer.ipc_generation != p.workspace_generation) {
      if (peer.workspace != nullptr) {
        JDG_RETURN_IF_CUDA_ERROR(cudaIpcCloseMemHandle(peer.workspace));
      }
      void* ptr = nullptr;
      cudaError_t e = cudaIpcOpenMemHandle(&ptr, p.workspace, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) return MapFailure(peer, p, "workspace", e);
      peer.workspace = static_cast<uint8_t*>(ptr);
      peer.workspace_bytes = p.workspace_bytes;
      peer.ipc_generation = p.workspace_generation;
    }
  }
  return "";  // ~ShmExchange leaves the meeting
}

}  // namespace jax_distgemm::cuda

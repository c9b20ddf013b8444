// Persistent per-group state of the CUDA executor: the symmetric workspace, peer flags, copy
// streams, call epochs and the group's error record.  Host code only (CUDA runtime API).
//
// Usually one process drives all GPUs of a TP group (JAX's default: one host thread per device
// calls the handler concurrently).  With one process per GPU (jax.distributed), a group's other
// members live in other processes of the host: their workspace and flags are mapped into this
// process through CUDA IPC (peer_ipc.cc), and from then on the executor treats them exactly like
// local peers.  Each device owns, for the lifetime of the process:
//
//   workspace  cudaMalloc'd outside XLA's pool, same size on every device, grown (never shrunk)
//              when a larger problem arrives.  Peers write into it (AllGather pushes, the
//              ReduceScatter running sums), so its pointer is published to the group.
//   flags      kMaxTp x kMaxChunks 64-bit epochs, written by peers: flags[FlagIndex(i, c)] >= e
//              means "chunk c of the data stage i of call e consumes has landed"; then as
//              many words of this device's own marks (SeenMark); then the same again for the
//              ReduceScatter rings' running sums (RingFlags), so that each word has one writer.
//   epoch      calls issued on this device (host counter; the same sequence on every device;
//              64-bit, never wrapping; reset() moves it on, never back).
//
// Slots are double-buffered by call parity.  NOTE: why no trailing barrier is needed: a device
// starts call e only after finishing call e-1, which consumed data every peer produced in call
// e-1, which those peers produced only after finishing call e-2.  So when anyone writes parity
// (e % 2) for call e, nobody still reads parity (e % 2) of call e-2 (docs/design.md, "Epochs").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/cuda/copy_stream.h"
#include "cc/cuda/stage_sync.h"

namespace jax_distgemm::cuda {

inline constexpr int kMaxTp = 64;
// A stage's data may arrive in up to this many chunks, each with its own flag.
inline constexpr int kMaxChunks = 4;
inline constexpr int kNumFlags = kMaxTp * kMaxChunks;
// flags[FlagIndex(stage, chunk)]
inline constexpr int FlagIndex(int stage, int chunk) { return stage * kMaxChunks + chunk; }
// Stage 0 never waits for data, so its first flag has another use: this device's own copy
// stream sets it to the epoch once its AllGather pushes of that call are done (all_gather.cc).
inline constexpr int kPushDoneFlag = FlagIndex(0, 0);
// Past the peers' words (the allocation holds kFlagWords): this device's own AllGather stage
// GEMM sets SeenMark(i, c) to the epoch once it has waited for flag(i, c) (arrived or timed
// out), and its copy stream waits for that mark before it copies slot i-1 into the call's
// gathered result (all_gather.cc, CopyGathered): a wait on our own grid, which always ends,
// never directly on a peer.
inline constexpr int SeenMark(int stage, int chunk) {
  return kNumFlags + FlagIndex(stage, chunk);
}
// NOTE: one writer per flag word.  Stage i's data comes from device d + i in an AllGather (and
// the ReduceScatter gather path), but from the left neighbour d - 1 in every ReduceScatter
// ring path (remote C, copy ring).  Each writer's epochs rise in its own stream order; two
// writers of one word are not ordered: at TP >= 4 a device that finished a ring call early
// could push call e+1's AllGather data, and set d's word to e+1, before the left neighbour set
// it to e for call e (a wait for e would pass before its data, and the late e then hide e+1
// until the wait timed out).  So the rings' words are a row of their own,
// RingFlags(d)[FlagIndex(i, c)].
inline constexpr int kRingFlagsOffset = 2 * kNumFlags;
inline constexpr int kFlagWords = 3 * kNumFlags;

struct DeviceState {
  int ordinal = -1;  // local CUDA ordinal; -1: a member in another process (IPC-mapped)
  int64_t id = -1;   // global device id
  int sm_count = 0;
  cudaStream_t copy_stream = nullptr;  // pushes (copy engine), on a hardware queue of its own
  CopyStreamReport copy_stream_report;  // how copy_stream was chosen (copy_stream.h)
  cudaEvent_t fork = nullptr, join = nullptr;
  cudaEvent_t stage_done = nullptr;  // copy ring: the chunk to send is ready
  uint8_t* workspace = nullptr;
  size_t workspace_bytes = 0;
  Epoch* flags = nullptr;
  void* gemm_scratch = nullptr;
  Epoch epoch = 0;
  int last_rs_path = 0;  // the RsPath (workspace.h) of this device's last ReduceScatter call
  // Members in other processes: what this process mapped of theirs (cudaIpcOpenMemHandle),
  // and which allocation of the owner that was (its generation), to re-map after it grew.
  int64_t ipc_generation = -1;
};

// The ReduceScatter rings' data flags of `d` (written by its left neighbour only; see above).
inline Epoch* RingFlags(const DeviceState& d) { return d.flags + kRingFlagsOffset; }

class PeerGroup {
 public:
  // ids: the members' global device ids in rank order; ordinals: their local CUDA ordinals,
  // -1 for members driven by another process (then exactly one member is local).
  PeerGroup(std::vector<int64_t> ids, std::vector<int> ordinals);
  ~PeerGroup();

  int tp() const { return static_cast<int>(devs_.size()); }
  DeviceState& dev(int rank) { return devs_[rank]; }
  bool cross_process() const { return cross_process_; }
  ErrorRecord* error() const { return error_; }

  // Makes sure every device of the group holds a workspace of at least `bytes`, the flags,
  // copy stream and loaded kernels.  Called by each device's handler thread with its `rank`;
  // when anything must be (re)allocated, the TP threads meet (keyed by run_id): each drains
  // its own streams, then allocates, so no kernel of ours is spinning during cudaMalloc.
  // Across processes (cross_process()), the members meet in POSIX shared memory instead
  // (peer_ipc.cc), with at least kCrossProcessSetupTimeoutMs per step: processes reach their
  // first call seconds apart.
  std::string EnsureReady(int rank, size_t bytes, cudaStream_t stream, int64_t run_id,
                          int64_t timeout_ms);

  // Host view of a sticky error left by a timed-out wait ("" if none).
  std::string PendingError() const;
  // Drains this process's devices, moves their epochs past any a late peer can still write
  // (peer_state.cc) and clears the error.  No call of this process may be in flight; across
  // processes every process must reset.
  std::string Reset();

  static constexpr size_t kGemmScratchBytes = 4u << 20;
  static constexpr int64_t kCrossProcessSetupTimeoutMs = 60000;

 private:
  // First use of the device: peer access, copy stream (probed against `stream`, XLA's compute
  // stream, which must hold nothing of ours), events, flags, scratch, kernels.
  std::string InitDevice(int rank, cudaStream_t stream);
  // (Re)allocates this device's workspace to hold `bytes` (rounded up); all of the group's
  // kernels and copies must be drained.
  std::string AllocateWorkspace(DeviceState& d, size_t bytes);
  std::string EnsureReadyCrossProcess(int rank, size_t bytes, bool need_init, bool need_grow,
                                      cudaStream_t stream, int64_t timeout_ms);  // peer_ipc.cc

  std::vector<int64_t> ids_;
  std::vector<int> ordinals_;
  bool cross_process_ = false;
  std::vector<DeviceState> devs_;
  ErrorRecord* error_ = nullptr;  // mapped pinned memory, shared by this process's members
  std::mutex mu_;
  int64_t setup_meetings_ = 0;  // cross-process setup meetings so far (same in every process)
};

// The process-wide group for these members (global ids and local ordinals, -1 for members in
// other processes, in rank order), created on first use.
PeerGroup* GetPeerGroup(const std::vector<int64_t>& ids, const std::vector<int>& ordinals);
// Every group created so far (for reset()).
std::vector<PeerGroup*> AllPeerGroups();

// cuStreamWriteValue64 / 32 through the driver entry point (no link-time dependency on
// libcuda); the default flags fence the stream's earlier work before the write.
cudaError_t StreamWriteValue64(cudaStream_t stream, Epoch* address, Epoch value);
cudaError_t StreamWriteValue32(cudaStream_t stream, uint32_t* address, uint32_t value);
// cuStreamWaitValue64 / 32 (GEQ): later work on `stream` waits until *address >= value.
// NOTE: a blocked wait can hold up other streams that share its hardware queue: enqueue it only
// after the work that will satisfy it has been enqueued.
cudaError_t StreamWaitValue64(cudaStream_t stream, const Epoch* address, Epoch value);
cudaError_t StreamWaitValue32(cudaStream_t stream, const uint32_t* address, uint32_t value);

}  // namespace jax_distgemm::cuda

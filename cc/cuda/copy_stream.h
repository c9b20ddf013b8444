// A device's copy stream, on a hardware queue of its own (apart from XLA's compute stream).
//
// CUDA maps streams onto a few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default) in
// creation order, and a queue runs its commands in submission order whichever stream they
// came from.  So when the copy stream shares XLA's compute stream's queue, each of its waits
// (an event wait for a chunk GEMM, a cuStreamWaitValue32 for the fused grid's mark, the
// copy before a flag write) also holds up every main-stream launch submitted after it: the
// chunk GEMMs of a `copy_ring` call then run one at a time behind the copies instead of
// beside them.  Which queue a stream lands on depends on how many streams the process made
// before it (XLA's, torch's, ...), so the stall comes and goes between processes.
//
// NOTE: the probe needs `main` idle (the caller synchronized it) and nothing of ours in flight
// on this device: it blocks a candidate stream on a host word for up to kProbeMs.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace jax_distgemm::cuda {

struct CopyStreamReport {
  int candidates = 0;  // streams created to find one (rejected ones are destroyed)
  // 1: a blocked wait on the kept stream did not hold up `main`; 0: it did; -1: not probed.
  int independent = -1;
  std::string note;  // why it was not probed ("" when it was)
};

// kProbe (default): try up to kMaxCandidates streams and keep the first whose blocked wait
// leaves `main` free; if none does, keep the last.  kUnchecked: keep the first stream without
// blocking anything (independent -1), for ranks that share one GPU
// (tests/cuda/virtual_group_check.cu): there another rank's setup (cudaDeviceSynchronize) can
// wait on the blocked stream while the probe waits on it.
enum class CopyStreamMode : int { kProbe = 0, kUnchecked = 1 };

// The mode of the copy streams created from now on (process-wide; set before the first call).
void SetCopyStreamMode(CopyStreamMode mode);
CopyStreamMode GetCopyStreamMode();

// Creates the copy stream of the current device in `mode`.  Where the probe itself cannot run
// (no mapped host memory, no stream-memory wait on it), falls back to one unprobed stream
// (independent -1).
std::string CreateCopyStream(cudaStream_t main, CopyStreamMode mode, cudaStream_t* out,
                             CopyStreamReport* report);

}  // namespace jax_distgemm::cuda

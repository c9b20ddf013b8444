// The CUDA executor: turns one device's view of a distributed GEMM (Problem, rank) into the
// stage kernels, copy-engine pushes and flag traffic of its schedule.  No FFI types here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/common/problem.h"
#include "cc/common/rs_path.h"
#include "cc/cuda/peer_state.h"

namespace jax_distgemm::cuda {

struct CallBuffers {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* c = nullptr;  // output dtype, output shape; AllGather only
  void* out = nullptr;
  // AllGather only, optional: the gathered operand (problem.h CheckGathered), nullptr if not
  // asked for; filled from the shards the stages receive (executor.cc, CopyGathered).
  void* gathered = nullptr;
};

struct CallOptions {
  int64_t timeout_ms = 30000;
  bool skip_signals = false;  // fault injection (tests): never deliver to peers
  bool skip_push_done = false;  // fault injection (tests): never mark own pushes done
  bool poison_output = false;  // tests: fill out with NaN first, so unwritten tiles show
  // Overrides of the per-shape choices (executor.cc, ChooseRsPath / AgChunks); from the
  // environment (JAX_DISTGEMM_RS_PATH, JAX_DISTGEMM_AG_CHUNKS), 0 / empty = automatic.
  int rs_path = 0;
  int ag_chunks = 0;
  // kRsCopyRing only: row chunks per stage (clamped to [1, kMaxChunks], at most one per 128
  // rows); JAX_DISTGEMM_RS_CHUNKS (read per call) overrides the default.
  int rs_chunks = 2;
  // Later launches of a call that read nothing the launch before them writes start their GEMM
  // as soon as they are resident (StageSync::overlap_previous); JAX_DISTGEMM_STAGE_OVERLAP=0
  // makes every launch wait for the previous one to finish first.
  bool overlap_stages = true;
  // AllGather: all stages of a call in one persistent grid (sm90_fused_gemm.cuh) where a fused
  // kernel is compiled for the types (and for the config JAX_DISTGEMM_GEMM_CONFIG forces, if
  // any), the call has one batch and 1 < TP <= 8 (the shard may arrive in chunks: AgChunks);
  // JAX_DISTGEMM_AG_FUSED=0 (or set_fused_stages(False)) launches one GEMM per stage.
  bool fuse_stages = true;
  // AllGather, fused: the grid itself waits for this device's pushes before it completes
  // (FusedStages::exit_wait_flag) instead of the main stream waiting on an event of the copy
  // stream.  JAX_DISTGEMM_AG_JOIN=event (read per call) restores the event.
  bool ag_kernel_join = true;
};

// ReduceScatter data paths (ChooseRsPath, executor.cc).  kRemoteC: the running sum stays in
// its producer's slot and the consumer's epilogue reads it over NVLink as C (CUTLASS's
// RemoteC).  kCopyRing: each stage writes its running sum locally, in row chunks; after each
// chunk the copy engine pushes it into the right neighbour's local receive slot and sets its
// flag, and the neighbour's matching chunk GEMM reads it locally as C: no SM touches NVLink.
// kGather (TilingA, one batch; RsGatherChosen in problem.h): no running sum travels; at the
// call's start every device pushes each peer the x rows and the w shard it needs to sum its
// own output rows over every K shard (EnqueueRsGather, executor.cc).  The RsPath enum and its
// names are cc/common/rs_path.h's, shared with the CPU executor.

// Symmetric workspace bytes one device needs for `p` (double-buffered slots) with the data path
// `options` select (executor.cc, SlotsPerParity).
size_t WorkspaceBytes(const Problem& p, const CallOptions& options);

// Enqueues the whole call on `stream` (and this device's copy stream).  The group must be
// ready (PeerGroup::EnsureReady) for WorkspaceBytes(p, options).  Returns "" or an error.
std::string EnqueueDistGemm(const Problem& p, int rank, PeerGroup& group,
                            const CallBuffers& buffers, const CallOptions& options,
                            cudaStream_t stream);

}  // namespace jax_distgemm::cuda

// The CUDA executor: turns one device's view of a distributed GEMM (Problem, rank) into the
// stage kernels, copy-engine pushes and flag traffic of its schedule.  No FFI types here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/common/problem.h"
#include "cc/common/workspace.h"
#include "cc/cuda/peer_state.h"

namespace jax_distgemm::cuda {

struct CallBuffers {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* c = nullptr;  // output dtype, output shape; AllGather only
  void* out = nullptr;
  // AllGather only, optional: the gathered operand (problem.h CheckGathered), nullptr if not
  // asked for; filled from the shards the stages receive (all_gather.cc, CopyGathered).
  void* gathered = nullptr;
  // fp8 (Problem::scaling): the fp32 scales of x and w.  NOTE: fp8 wgmma reads B K-major, so
  // w [wk, wn] is stored transposed (column-major; w^T row-major), and its block scales
  // [wk/128, wn/128] alike; the lowering asks XLA for these layouts (primitives.py).
  const float* x_scale = nullptr;
  const float* w_scale = nullptr;
};

// How a call runs.  The handler takes the defaults except for rs_path (the call's attribute);
// tests and tests/cuda/virtual_group_check.cu force the others.
struct CallOptions {
  int64_t timeout_ms = 30000;
  bool skip_signals = false;  // fault injection (tests): never deliver to peers
  bool skip_push_done = false;  // fault injection (tests): never mark own pushes done
  bool poison_output = false;  // tests: fill out with NaN first, so unwritten tiles show
  // Tests: the copy stream waits for *copy_gate >= 1 (mapped host memory) before it copies
  // shards into a gathered result, so that a test can hold those copies; nullptr: no gate.
  const uint32_t* copy_gate = nullptr;
  // Overrides of the per-shape choices (workspace.h ChooseRsPath, all_gather.cc AgChunks);
  // 0 = automatic.
  int rs_path = 0;  // RsPath
  int ag_chunks = 0;
  // Later launches of a call that read nothing the launch before them writes start their GEMM
  // as soon as they are resident (StageSync::overlap_previous); false makes every launch wait
  // for the previous one to finish first.
  bool overlap_stages = true;
  // AllGather: all stages of a call in one persistent grid (sm90_fused_gemm.cuh), which waits
  // for this device's own pushes before it completes, where a fused kernel is compiled for the
  // types (and for the config JAX_DISTGEMM_GEMM_CONFIG forces, if any), the call has one batch
  // and 1 < TP <= 8; false: one GEMM per stage, joined to the copy stream by an event.
  bool fuse_stages = true;
};

// ReduceScatter data paths (cc/common/workspace.h: RsPath, ChooseRsPath and the slots each
// path needs).  kRemoteC: the running sum stays in
// its producer's slot and the consumer's epilogue reads it over NVLink as C (CUTLASS's
// RemoteC).  kCopyRing: each stage writes its running sum locally, in row chunks; after each
// chunk the copy engine pushes it into the right neighbour's local receive slot and sets its
// flag, and the neighbour's matching chunk GEMM reads it locally as C: no SM touches NVLink.
// kGather (TilingA, one batch): no running sum travels; at the call's start every device
// pushes each peer the x rows and the w shard it needs to sum its own output rows over every
// K shard (EnqueueRsGather, reduce_scatter.cc).

// Enqueues the whole call on `stream` (and this device's copy stream).  The group must be
// ready (PeerGroup::EnsureReady) for WorkspaceBytes(p, options.rs_path).  Returns "" or an
// error.
std::string EnqueueDistGemm(const Problem& p, int rank, PeerGroup& group,
                            const CallBuffers& buffers, const CallOptions& options,
                            cudaStream_t stream);

}  // namespace jax_distgemm::cuda

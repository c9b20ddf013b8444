// Internals of the CUDA executor shared by its files: executor.cc (scratch, launches and the
// call's dispatch), all_gather.cc and reduce_scatter.cc (the schedules' stage plans).  Host
// code; not part of the executor's interface (executor.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/common/problem.h"
#include "cc/common/workspace.h"
#include "cc/cuda/executor.h"
#include "cc/cuda/gemm_kernels.h"
#include "cc/cuda/peer_state.h"

namespace jax_distgemm::cuda::internal {

// -- Slots ----------------------------------------------------------------------------------------
// Slots are indexed [parity][slot] with parity = epoch % 2 (peer_state.h explains why that
// suffices without a trailing barrier; EnqueueRsCopyRing repeats the argument for its slots);
// their sizes and counts are cc/common/workspace.h's.
//
// NOTE: parity p's slots start at p * (half the allocated workspace), not at an offset that
// depends on this call's slot size: with shape-dependent offsets, call e (parity 0) of a larger
// shape could overlap call e-1's parity-1 slots, which a slow peer may still read.  Every member
// holds the same workspace size (same history), so both sides agree on the halves.
inline uint8_t* ParityBase(DeviceState& d, Epoch epoch) {
  const size_t half = (d.workspace_bytes / 2) / kSlotAlign * kSlotAlign;
  return d.workspace + static_cast<size_t>(epoch & 1u) * half;
}
inline uint8_t* Slot(DeviceState& d, const Problem& p, Epoch epoch, int index) {
  return ParityBase(d, epoch) + static_cast<size_t>(index) * SlotBytes(p);
}

// kGather: the slot that holds source `index + 1`'s operands (stage index + 1), and running sum j.
inline uint8_t* GatherSlot(DeviceState& d, const Problem& p, Epoch epoch, int index) {
  return ParityBase(d, epoch) + static_cast<size_t>(index) * GatherSlotBytes(p);
}
inline uint8_t* GatherSum(DeviceState& d, const Problem& p, Epoch epoch, int j) {
  return ParityBase(d, epoch) + (p.tp - 1) * GatherSlotBytes(p) + j * GatherSumBytes(p);
}

// -- Operands -------------------------------------------------------------------------------------

inline const uint8_t* At(const void* base, int64_t elem_offset, ElemType t) {
  return static_cast<const uint8_t*>(base) + elem_offset * ElemSize(t);
}

// Operand setters: the first element, with the leading dimension and batch stride of `v`
// (whose offset the caller has already applied).
inline void SetA(GemmOperands& o, const void* first, const MatrixView& v) {
  o.a = first;
  o.lda = v.ld;
  o.batch_stride_a = v.batch_stride;
}
inline void SetB(GemmOperands& o, const void* first, const MatrixView& v) {
  o.b = first;
  o.ldb = v.ld;
  o.batch_stride_b = v.batch_stride;
}
inline void SetC(GemmOperands& o, const void* first, const MatrixView& v, float beta) {
  o.c = first;
  o.ldc = v.ld;
  o.batch_stride_c = v.batch_stride;
  o.beta = beta;
}
inline void SetD(GemmOperands& o, const void* first, const MatrixView& v) {
  o.d = const_cast<void*>(first);
  o.ldd = v.ld;
  o.batch_stride_d = v.batch_stride;
}

// The launch waits (StageSync) for stage `stage`, chunk `chunk` of call `epoch` to land in
// this device's slots, on this device's flag row `flags` (me.flags, or RingFlags(me) for a
// ReduceScatter ring); `peer` is the rank that delivers it (named if the wait times out).
inline void SetWait(StageSync& s, const Epoch* flags, int stage, int chunk, Epoch epoch,
             int peer) {
  s.wait_flag = flags + FlagIndex(stage, chunk);
  s.wait_epoch = epoch;
  s.stage = stage;
  s.peer = peer;
}

// -- Launches -------------------------------------------------------------------------------------

// The fused grid's pointer table of call `epoch` in this device's GEMM scratch (executor.cc).
void** FusedTable(const DeviceState& d, Epoch epoch);

// [begin, end) of chunk c of `extent` split in `chunks`, aligned to 128.
void ChunkRange(int64_t extent, int chunks, int c, int64_t* begin, int64_t* end);

// The largest n <= want (and >= 1) for which no chunk of ChunkRange(extent, n, .) is empty: the
// 128-row rounding can leave the last chunk empty (extent 640 in 4: 256, 256, 128, 0).
int NonEmptyChunks(int64_t extent, int want);

// A stage GEMM of `p` on device `d` (shape, types, scratch, timeout), operands and waits unset.
GemmLaunch BaseLaunch(const Problem& p, const DeviceState& d, const CallOptions& o,
                      ErrorRecord* error, int rank);

// fp8: the scales of a stage of `tile` whose A scales start at `a` and B's at `b` (scalars, or
// block scales laid out as the call's x_scale and w_scale; Problem::AScaleView, BScaleView).
void SetStageScales(GemmLaunch& g, const Problem& p, int tile, const float* a, const float* b);

// Tunes (first use of a shape; fp8: the first compiled config) and enqueues one stage GEMM;
// errors name `stage`.
std::string Launch(GemmLaunch& g, cudaStream_t stream, int stage);

// The failure of the last CUDA call, named after what it was doing.
std::string CudaFailure(const char* what);

// -- Stage plans ----------------------------------------------------------------------------------
// Enqueue call `epoch` of an AllGather (all_gather.cc) or ReduceScatter (reduce_scatter.cc)
// problem on `stream` and this device's copy stream.
std::string EnqueueAllGather(const Problem& p, int rank, PeerGroup& group, const CallBuffers& b,
                             const CallOptions& o, cudaStream_t stream, Epoch epoch);
std::string EnqueueReduceScatter(const Problem& p, int rank, PeerGroup& group,
                                 const CallBuffers& b, const CallOptions& o, cudaStream_t stream,
                                 Epoch epoch);

}  // namespace jax_distgemm::cuda::internal

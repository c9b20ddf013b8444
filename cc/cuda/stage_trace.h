// Opt-in device timeline of the executor (JAX_DISTGEMM_TRACE=1), to see where a call's time
// goes without a profiler.  Every stage GEMM leaves three %globaltimer stamps (ns):
//
//   start  the first CTA began                 (launch, and the wait for the previous grid)
//   ready  the last CTA got past its flag wait  (> start + a little: it waited for a peer)
//   end    the last CTA finished
//
// in a per-device buffer of kTraceCapacity records, allocated at the group's setup (when no
// kernel of ours runs).  Host code only; the stamps are written by StageKernel (sm90_gemm.cuh)
// and, one record per stage, by the fused AllGather grid (sm90_fused_gemm.cuh), where start is
// the first CTA to reach the stage and end the last CTA to move on from it (FusedStages::trace).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jax_distgemm::cuda {

inline constexpr int kTraceCapacity = 1 << 16;  // records per device; later launches go untraced

struct TraceRecord {
  int device;      // CUDA ordinal
  int64_t call;    // the device's call epoch
  int32_t stage;   // stage of the schedule; -1: the handler's host time (start, end)
  int32_t chunk;   // row/column chunk within the stage (0 when unchunked)
  uint64_t start, ready, end;  // ns, %globaltimer (0: not written)
};

// JAX_DISTGEMM_TRACE=1 (read once).
bool TraceEnabled();
// Allocates and zeroes device `ordinal`'s buffer, once.  Call only while the device is drained.
std::string TraceInit(int ordinal);
// The next record's 3 words for a stage GEMM of device `ordinal`, or nullptr (tracing off or
// buffer full).  Word 0 holds ~start (so that atomicMax over a zeroed word takes the minimum).
uint64_t* TraceReserve(int ordinal, int64_t call, int stage, int chunk);
// Host side of one call (stage -1 in the dump): steady-clock ns when the handler of device
// `ordinal` was entered and when it returned.
void TraceHostCall(int ordinal, int64_t call, uint64_t begin_ns, uint64_t end_ns);
// Synchronizes the traced devices and appends every record so far to `out`; with `clear`, the
// buffers start over.  No call may be in flight.  Returns "" or an error.
std::string TraceDump(bool clear, std::vector<TraceRecord>* out);

}  // namespace jax_distgemm::cuda

// Cross-device synchronization at the head of every stage kernel, and the error record that a
// timed-out wait leaves for the host.  Included by host and device code.
//
// Flags hold call epochs (64-bit; 1, 2, 3, ...), never reset and never wrapping: "stage data of
// call e is ready" is flag >= e, so a fast peer that already announced call e+1 is no hazard,
// and neither is a word no call has written for a long time.
//
// NOTE: memory ordering.  Waits load with ld.acquire.sys; in-kernel signals store with
// st.release.sys after griddepcontrol.wait, i.e. after the previous stage grid on this stream
// completed and flushed; copy-engine signals use cuStreamWriteValue64, whose default flags put
// a system-scope fence between prior stream work (the payload copy) and the write.
#pragma once

#include <cstdint>

namespace jax_distgemm::cuda {

// A call's epoch, and the type of every flag word.
using Epoch = uint64_t;

// Written by the first CTA whose wait times out (mapped pinned host memory, shared by a group).
struct ErrorRecord {
  uint32_t code;      // 0: none, 1: flag wait timed out
  int32_t rank;       // rank of the device that timed out
  int32_t stage;      // stage whose wait timed out, or kPushDoneStage
  int32_t peer;       // rank that should have signalled
  Epoch expected;     // epoch waited for
  Epoch observed;     // last flag value seen
};

// ErrorRecord::stage of a wait for this device's own pushes (a fused AllGather grid's join).
inline constexpr int32_t kPushDoneStage = -1;

struct StageSync {
  // Wait: every cluster's leader spins until *wait_flag >= wait_epoch.
  const Epoch* wait_flag = nullptr;
  Epoch wait_epoch = 0;
  // Signal: block (0,0,0) stores signal_epoch to *signal_flag (usually a peer's) once the
  // previous grid on this stream has completed.
  Epoch* signal_flag = nullptr;
  Epoch signal_epoch = 0;
  // Mark (this device's word, peer_state.h SeenMark): every cluster's leader stores wait_epoch
  // to *seen_flag once its wait has ended, arrived or timed out; nullptr: no mark.
  Epoch* seen_flag = nullptr;
  uint64_t timeout_ns = 0;
  ErrorRecord* error = nullptr;  // device pointer of the group's record
  int32_t rank = 0, stage = 0, peer = -1;
  // The grid reads nothing that the previous grid on its stream writes (a later AllGather
  // stage, a kCopyRing chunk after the call's first): it starts its GEMM as soon as its CTAs
  // are resident, filling the previous grid's tail, and waits for that grid (griddepcontrol)
  // only before it exits, so grids still complete in stream order.  NOTE: safe only because
  // every grid triggers its dependents after its own wait: the call's first grid waited for the
  // kernels that produced x and w.
  bool overlap_previous = false;
};

}  // namespace jax_distgemm::cuda

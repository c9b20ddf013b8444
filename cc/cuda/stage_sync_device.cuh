// Device side of StageSync: flag loads/stores with system scope and the bounded wait.
// Included by every kernel file that synchronizes with peers.
#pragma once

#include <cstdint>

#include "cc/cuda/stage_sync.h"

namespace jax_distgemm::cuda {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ Epoch LoadAcquireSys(const Epoch* p) {
  Epoch v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(Epoch* p, Epoch v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Programmatic dependent launch (PTX griddepcontrol; sm_90+).  The build leaves CUTLASS's own
// calls off (no CUTLASS_ENABLE_GDC_FOR_SM90): its mainloop producer would wait for the
// previous grid again, which StageSync::overlap_previous must be able to skip.
__device__ __forceinline__ void WaitForPreviousGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void LaunchNextGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Spins until *flag reaches `epoch` or `timeout_ns` passes.  Returns true on arrival; on
// timeout the first waiter of the group fills the ErrorRecord (rank, stage, peer name it).
__device__ __forceinline__ bool WaitFlagUntil(const Epoch* flag, Epoch epoch,
                                              uint64_t timeout_ns, ErrorRecord* error,
                                              int32_t rank, int32_t stage, int32_t peer) {
  const uint64_t start = GlobalTimerNs();
  Epoch v = LoadAcquireSys(flag);
  while (v < epoch) {
    if (GlobalTimerNs() - start > timeout_ns) {
      if (error != nullptr && atomicCAS_system(&error->code, 0u, 1u) == 0u) {
        error->rank = rank;
        error->stage = stage;
        error->peer = peer;
        error->expected = epoch;
        error->observed = v;
        __threadfence_system();
      }
      return false;
    }
    __nanosleep(100);
    v = LoadAcquireSys(flag);
  }
  return true;
}

__device__ __forceinline__ bool WaitFlag(const StageSync& s) {
  return WaitFlagUntil(s.wait_flag, s.wait_epoch, s.timeout_ns, s.error, s.rank, s.stage,
                       s.peer);
}

}  // namespace jax_distgemm::cuda

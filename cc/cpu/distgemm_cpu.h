// XLA FFI handler for platform "cpu": the distributed GEMM run as a real rotation between the
// fake CPU devices of one process.
#pragma once

#include <cstdint>

#include "xla/ffi/api/api.h"

namespace jax_distgemm {

XLA_FFI_DECLARE_HANDLER_SYMBOL(DistGemmCpu);

// Fault injection for tests: the handler on this device (global id; in one process the same as
// its ordinal) stops just before barrier `phase` (-1: returns at once, never meeting its peers),
// like a peer that never arrives.  -1 disables.
void SetCpuFaultDevice(int64_t device, int phase);

}  // namespace jax_distgemm

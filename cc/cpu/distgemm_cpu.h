// XLA FFI handler for platform "cpu": the distributed GEMM run as a real rotation between the
// fake CPU devices of one process.
#pragma once

#include "xla/ffi/api/api.h"

namespace jax_distgemm {

XLA_FFI_DECLARE_HANDLER_SYMBOL(DistGemmCpu);

// Fault injection for tests: the handler on this device ordinal returns at once, without
// meeting its peers (a peer that never arrives).  -1 disables.
void SetCpuFaultDevice(int ordinal);

}  // namespace jax_distgemm

// XLA FFI handler for platform "cpu": the distributed GEMM run as a real rotation between the
// fake CPU devices of one process.
#pragma once

#include <cstdint>

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

namespace jax_distgemm {

// The instantiate stage (one CallSite state per custom-call instruction of an executable) and
// the execute stage; register both for the target, after the state type (CallSiteTypeId,
// CallSiteTypeInfo; jax.ffi.register_ffi_type).
XLA_FFI_DECLARE_HANDLER_SYMBOL(DistGemmCpuInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DistGemmCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DistGemmFp8Cpu);  // fp8 x and w with their scales
XLA_FFI_TypeId* CallSiteTypeId();
const XLA_FFI_TypeInfo* CallSiteTypeInfo();

// Fault injection for tests: the handler on this device (global id; in one process the same as
// its ordinal) stops just before barrier `phase` (-1: returns at once, never meeting its peers),
// like a peer that never arrives.  -1 disables.
void SetCpuFaultDevice(int64_t device, int phase);

}  // namespace jax_distgemm

// XLA FFI handler for platform "CUDA": the distributed GEMM on Hopper GPUs of one process.
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/api.h"

namespace jax_distgemm::cuda {

XLA_FFI_DECLARE_HANDLER_SYMBOL(DistGemmCuda);

// Test hooks and recovery (exposed by the nanobind module).
// Test hook: device `ordinal` (-1: none) misbehaves.  kind 0: it never delivers to its peers
// (no pushes, no signals); kind 1: its AllGather pushes land but its copy stream never marks
// them done, so its own fused grid's join times out.
void SetCudaFaultDevice(int ordinal, int kind = 0);
void SetSyncCheck(bool on);            // synchronize after each call to report errors at once
void SetFuseStages(bool on);           // AllGather: one fused grid per call (CallOptions)
std::string ResetAll();                // drain, zero flags and epochs, clear sticky errors
std::string PendingErrors();           // "" or the sticky error of any group
// (ordinal, candidates, independent, note) of every initialized local device of every group:
// how its copy stream was chosen (copy_stream.h).  No call may be in flight.
std::vector<std::tuple<int, int, int, std::string>> CopyStreamReports();

}  // namespace jax_distgemm::cuda

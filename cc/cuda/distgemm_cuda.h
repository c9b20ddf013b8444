// XLA FFI handler for platform "CUDA": the distributed GEMM on Hopper GPUs of one process.
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/api.h"

namespace jax_distgemm::cuda {

XLA_FFI_DECLARE_HANDLER_SYMBOL(DistGemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DistGemmFp8Cuda);  // fp8 x and w with their scales

// Test hooks and recovery (exposed by the nanobind module).
// Test hook: device `ordinal` (-1: none) misbehaves.  kind 0: it never delivers to its peers
// (no pushes, no signals); kind 1: its AllGather pushes land but its copy stream never marks
// them done, so its own fused grid's join times out.
void SetCudaFaultDevice(int ordinal, int kind = 0);
void SetSyncCheck(bool on);            // synchronize after each call to report errors at once
std::string ResetAll();                // PeerGroup::Reset of every group
std::string PendingErrors();           // "" or the sticky error of any group
// (ordinal, candidates, independent, note, group, rank) of every initialized local device of
// every group: how its copy stream was chosen (copy_stream.h); group: the members' local
// ordinals in rank order (-1 for a member in another process), rank: this device's.  Each
// group has its own copy stream per device, so a GPU in two groups (TP=1 and TP=2) has two.
// No call may be in flight.
using CopyStreamRow = std::tuple<int, int, int, std::string, std::vector<int>, int>;
std::vector<CopyStreamRow> CopyStreamReports();

// (ordinal, group, path) of every initialized local device of every group: the ReduceScatter
// data path (cc/common/workspace.h, RsPathName) of its last ReduceScatter call, "" if none yet.
std::vector<std::tuple<int, std::vector<int>, std::string>> LastRsPaths();

}  // namespace jax_distgemm::cuda

// FFI binding of the CUDA executor: decode, validate, make the peer group ready, enqueue.
#include "cc/cuda/distgemm_cuda.h"

#include <cuda_runtime.h>

#include <atomic>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "cc/common/device_ids.h"
#include "cc/common/env.h"
#include "cc/common/ffi_helpers.h"
#include "cc/common/shm_exchange.h"
#include "cc/cuda/executor.h"
#include "cc/cuda/peer_state.h"

namespace jax_distgemm::cuda {
namespace {

std::atomic<int> g_fault_device{-1};
std::atomic<int> g_fault_kind{0};  // SetCudaFaultDevice
std::atomic<int> g_sync_check{-1};  // -1: read JAX_DISTGEMM_SYNC_CHECK once

bool SyncCheck() {
  int v = g_sync_check.load();
  if (v < 0) {
    v = EnvFlag("JAX_DISTGEMM_SYNC_CHECK") ? 1 : 0;
    g_sync_check.store(v);
  }
  return v == 1;
}

// Checks what both targets share, then meets the group and enqueues the call.
ffi::Error RunCall(cudaStream_t stream, ffi::RunId run_id, int32_t device_ordinal,
                   const Problem& p, const CallAttrs& attrs, const CallBuffers& buffers) {
  const int64_t tp = attrs.tp, timeout_ms = attrs.timeout_ms;
  const ffi::Span<const int64_t>& groups = attrs.groups;
  if (p.has_c && !IsAllGather(p.schedule)) {
    return InvalidArgument("c: the CUDA ReduceScatter executor takes no c (the Python wrapper "
                           "adds beta * c after the call)");
  }
  if (tp > kMaxTp) return InvalidArgument("tp: at most 64 on CUDA");

  // Rank and group: the attribute holds global device ids; map them to local ordinals.
  const int64_t my_id = GlobalDeviceId(kPlatformCuda, device_ordinal);
  int rank = -1, group_index = -1;
  if (auto err = LocateDevice(attrs, my_id, &rank, &group_index); err.failure()) return err;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  std::vector<int64_t> ids(groups.begin() + group_index * tp,
                           groups.begin() + (group_index + 1) * tp);
  std::vector<int> ordinals(tp);
  int local_members = 0;
  for (int r = 0; r < tp; ++r) {
    const int32_t o = LocalOrdinal(kPlatformCuda, ids[r]);
    ordinals[r] = (o >= 0 && o < count) ? o : -1;
    local_members += ordinals[r] >= 0;
  }
  if (local_members < tp) {
    // Members in other processes: mapped through CUDA IPC (peer_ipc.cc).
    if (ShmJobToken().empty()) {
      return InvalidArgument("the TP group of device " + std::to_string(my_id) +
                             " spans processes: call jax_distgemm.initialize_multiprocess() "
                             "after jax.distributed.initialize() in every process (or use "
                             "implementation='xla')");
    }
    if (local_members != 1) {
      return InvalidArgument("a TP group that spans processes must have one GPU per process "
                             "on CUDA; this process drives " + std::to_string(local_members) +
                             " of its devices (use implementation='xla' for this mesh)");
    }
  }
  PeerGroup* group = GetPeerGroup(ids, ordinals);
  if (std::string err = group->PendingError(); !err.empty()) return Internal(err);

  if (cudaSetDevice(device_ordinal) != cudaSuccess) {
    return Internal("cudaSetDevice failed: " + std::string(cudaGetErrorString(cudaGetLastError())));
  }
  CallOptions options;
  options.timeout_ms = timeout_ms;
  const int fault_kind = device_ordinal == g_fault_device.load() ? g_fault_kind.load() : -1;
  options.skip_signals = fault_kind == 0;
  options.skip_push_done = fault_kind == 1;
  static const bool poison = EnvFlag("JAX_DISTGEMM_POISON_OUTPUT");
  options.poison_output = poison;
  options.rs_path = attrs.rs_path;
  if (std::string err = group->EnsureReady(rank, WorkspaceBytes(p, options.rs_path), stream,
                                           run_id.run_id, timeout_ms);
      !err.empty()) {
    return Internal("device " + std::to_string(device_ordinal) + ": " + err);
  }
  if (std::string err = EnqueueDistGemm(p, rank, *group, buffers, options, stream); !err.empty()) {
    return Internal("device " + std::to_string(device_ordinal) + ": " + err);
  }
  if (SyncCheck()) {
    cudaError_t e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) return Internal(std::string("CUDA error: ") + cudaGetErrorString(e));
    if (std::string err = group->PendingError(); !err.empty()) return Internal(err);
  }
  return ffi::Error::Success();
}

// No exception may cross the FFI boundary (std::terminate would take the process down).
template <class F>
ffi::Error Guarded(int32_t device_ordinal, F&& call) {
  try {
    return call();
  } catch (const std::exception& e) {
    return Internal("device " + std::to_string(device_ordinal) + ": " + e.what());
  }
}

ffi::Error DistGemmCudaImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device_ordinal,
                            ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer c,
                            ffi::Result<ffi::AnyBuffer> out,
                            std::optional<ffi::Result<ffi::AnyBuffer>> gathered,
                            int32_t schedule, int64_t tp, ffi::Span<const int64_t> groups,
                            float alpha, float beta, int64_t call_id, int64_t timeout_ms,
                            int32_t rs_path) {
  return Guarded(device_ordinal, [&]() -> ffi::Error {
    const CallAttrs attrs{schedule, tp, groups, alpha, beta, call_id, timeout_ms, rs_path};
    Problem p;
    if (auto err = DecodeProblem(x, w, c, *out, attrs, &p); err.failure()) return err;
    if (p.in_type == ElemType::kF32) {
      return InvalidArgument("x, w: float32 inputs are not supported by the CUDA executor "
                             "(bfloat16 or float16; implementation='xla' runs float32)");
    }
    if (gathered.has_value()) {
      if (auto err = DecodeGathered(x, w, **gathered, p); err.failure()) return err;
    }
    CallBuffers buffers{x.untyped_data(), w.untyped_data(),
                        p.has_c ? c.untyped_data() : nullptr, out->untyped_data(),
                        gathered.has_value() ? (*gathered)->untyped_data() : nullptr};
    return RunCall(stream, run_id, device_ordinal, p, attrs, buffers);
  });
}

ffi::Error DistGemmFp8CudaImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device_ordinal,
                               ffi::AnyBuffer x, ffi::AnyBuffer x_scale, ffi::AnyBuffer w,
                               ffi::AnyBuffer w_scale, ffi::AnyBuffer c,
                               ffi::Result<ffi::AnyBuffer> out, int32_t schedule,
                               int64_t tp, ffi::Span<const int64_t> groups, float alpha,
                               float beta, int64_t call_id, int64_t timeout_ms,
                               int32_t rs_path) {
  return Guarded(device_ordinal, [&]() -> ffi::Error {
    const CallAttrs attrs{schedule, tp, groups, alpha, beta, call_id, timeout_ms, rs_path};
    Problem p;
    if (auto err = DecodeFp8Problem(x, x_scale, w, w_scale, c, *out, attrs, &p); err.failure()) {
      return err;
    }
    if (p.scaling == Scaling::kBlock &&
        (p.in_type != ElemType::kF8E4M3 || p.w_type != ElemType::kF8E4M3)) {
      return InvalidArgument("x, w: block-scaled fp8 on CUDA is float8_e4m3fn x float8_e4m3fn");
    }
    if (p.w_type != ElemType::kF8E4M3) {
      return InvalidArgument("w: fp8 on CUDA takes a float8_e4m3fn w (x: e4m3 or e5m2)");
    }
    if (p.xk % 16 != 0 || p.wn % 16 != 0) {
      return InvalidArgument("x, w: fp8 on CUDA needs K and the local N to be multiples of 16 "
                             "(the transposed w's rows and columns)");
    }
    CallBuffers buffers{x.untyped_data(), w.untyped_data(),
                        p.has_c ? c.untyped_data() : nullptr, out->untyped_data(), nullptr,
                        static_cast<const float*>(x_scale.untyped_data()),
                        static_cast<const float*>(w_scale.untyped_data())};
    return RunCall(stream, run_id, device_ordinal, p, attrs, buffers);
  });
}

}  // namespace

void SetCudaFaultDevice(int ordinal, int kind) {
  g_fault_kind.store(kind);
  g_fault_device.store(ordinal);
}
void SetSyncCheck(bool on) { g_sync_check.store(on ? 1 : 0); }

std::string ResetAll() {
  for (PeerGroup* g : AllPeerGroups()) {
    if (std::string err = g->Reset(); !err.empty()) return err;
  }
  return "";
}

std::string PendingErrors() {
  for (PeerGroup* g : AllPeerGroups()) {
    if (std::string err = g->PendingError(); !err.empty()) return err;
  }
  return "";
}

// The group's members' local ordinals in rank order (-1: another process's): the `group` of
// LastRsPaths' and CopyStreamReports' rows.
namespace {
std::vector<int> MemberOrdinals(PeerGroup& g) {
  std::vector<int> members;
  for (int r = 0; r < g.tp(); ++r) members.push_back(g.dev(r).ordinal);
  return members;
}
}  // namespace

std::vector<std::tuple<int, std::vector<int>, std::string>> LastRsPaths() {
  std::vector<std::tuple<int, std::vector<int>, std::string>> out;
  for (PeerGroup* g : AllPeerGroups()) {
    const std::vector<int> members = MemberOrdinals(*g);
    for (int r = 0; r < g->tp(); ++r) {
      const DeviceState& d = g->dev(r);
      if (d.ordinal >= 0) out.emplace_back(d.ordinal, members, RsPathName(d.last_rs_path));
    }
  }
  return out;
}

std::vector<CopyStreamRow> CopyStreamReports() {
  std::vector<CopyStreamRow> out;
  for (PeerGroup* g : AllPeerGroups()) {
    const std::vector<int> members = MemberOrdinals(*g);
    for (int r = 0; r < g->tp(); ++r) {
      const DeviceState& d = g->dev(r);
      if (d.ordinal < 0 || d.copy_stream == nullptr) continue;
      const CopyStreamReport& c = d.copy_stream_report;
      out.emplace_back(d.ordinal, c.candidates, c.independent, c.note, members, r);
    }
  }
  return out;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DistGemmCuda, DistGemmCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .Ctx<ffi::RunId>()                         // rendezvous key for workspace setup
        .Ctx<ffi::DeviceOrdinal>()                 // this device
        .Arg<ffi::AnyBuffer>()                     // x
        .Arg<ffi::AnyBuffer>()                     // w
        .Arg<ffi::AnyBuffer>()                     // c (output dtype; 0 elements if absent)
        .Ret<ffi::AnyBuffer>()                     // out
        .OptionalRet<ffi::AnyBuffer>()             // gathered operand (AllGather; if asked)
        .Attr<int32_t>("schedule")                 // ScheduleKind
        .Attr<int64_t>("tp")                       // TP group size
        .Attr<ffi::Span<const int64_t>>("groups")  // global device ids, [G, tp]
        .Attr<float>("alpha")                      // out = alpha * x @ w ...
        .Attr<float>("beta")                       // ... + beta * c
        .Attr<int64_t>("call_id")                  // call site (unused on CUDA)
        .Attr<int64_t>("timeout_ms")               // bound on every flag wait
        .Attr<int32_t>("rs_path"));                // RsPath asked for; 0: automatic

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DistGemmFp8Cuda, DistGemmFp8CudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .Ctx<ffi::RunId>()                         // rendezvous key for workspace setup
        .Ctx<ffi::DeviceOrdinal>()                 // this device
        .Arg<ffi::AnyBuffer>()                     // x (fp8)
        .Arg<ffi::AnyBuffer>()                     // x_scale (fp32, [] or blocks)
        .Arg<ffi::AnyBuffer>()                     // w (fp8; laid out K-major)
        .Arg<ffi::AnyBuffer>()                     // w_scale (fp32, [] or blocks; K-major)
        .Arg<ffi::AnyBuffer>()                     // c (output dtype; 0 elements if absent)
        .Ret<ffi::AnyBuffer>()                     // out (bf16 or fp32)
        .Attr<int32_t>("schedule")                 // ScheduleKind
        .Attr<int64_t>("tp")                       // TP group size
        .Attr<ffi::Span<const int64_t>>("groups")  // global device ids, [G, tp]
        .Attr<float>("alpha")                      // out = alpha * x @ w ...
        .Attr<float>("beta")                       // ... + beta * c
        .Attr<int64_t>("call_id")                  // call site (unused on CUDA)
        .Attr<int64_t>("timeout_ms")               // bound on every flag wait
        .Attr<int32_t>("rs_path"));                // RsPath asked for; 0: automatic

}  // namespace jax_distgemm::cuda

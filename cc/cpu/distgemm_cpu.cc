// CPU executor.  Every device's handler runs on its own XLA thread (docs/design.md, "Probe");
// the TP handlers of one call meet in an Exchange, expose what peers read (a copy of the
// rotating shard, or the running sums), and then run the schedule stage by stage, reading
// peers' buffers in place.  The Exchange is a host Session when the whole TP group is in this
// process, POSIX shared memory when some members are in other processes (cc/common/shm_exchange.h):
//
//   AllGather:     publish x, w  | barrier | TP stages, each reading one peer's shard | barrier
//   ReduceScatter: publish x, w, running sums | TP stages, a barrier after each (the right
//                  neighbour reads what this stage wrote) | barrier
//
// The closing barrier keeps every buffer unchanged until no peer reads it any more.
#include "cc/cpu/distgemm_cpu.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <new>
#include <chrono>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cc/common/device_ids.h"
#include "cc/common/ffi_helpers.h"
#include "cc/common/rendezvous.h"
#include "cc/common/shm_exchange.h"
#include "cc/cpu/gemm_cpu.h"
#include "cc/schedules/ring_1d.h"

namespace jax_distgemm {
namespace {

std::atomic<int64_t> g_fault_device{-1};
std::atomic<int> g_fault_phase{-1};

// Test hook: on the faulty device (global id), stop before barrier `phase` (-1: skip the whole
// call).
bool Faulty(int64_t device, int phase) {
  return device == g_fault_device.load() && phase == g_fault_phase.load();
}

// Argument block for one stage's GEMM, before the per-stage pointers are filled in.
CpuGemmArgs StageGemm(const Problem& p) {
  CpuGemmArgs g;
  g.batch = p.batch;
  g.m = p.sm();
  g.n = p.sn();
  g.k = p.sk();
  g.ab_type = p.in_type;
  g.alpha = p.alpha;
  return g;
}

template <class Sched>
std::string RunAllGather(const Problem& p, int rank, int64_t device, Exchange& s, const void* x,
                         const void* w, const void* c, void* out,
                         std::chrono::milliseconds timeout) {
  constexpr bool kRotatingA = Sched::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  // Peers read a copy of the rotating shard owned by the exchange, never XLA's buffer: after a
  // timed-out barrier this handler returns and XLA may free its inputs.
  const size_t bytes = (kRotatingA ? p.XElems() : p.WElems()) * ElemSize(p.in_type);
  void* shard = s.Buffer(rank, bytes);
  std::memcpy(shard, kRotatingA ? x : w, bytes);
  if (Faulty(device, 0)) return "";
  if (auto e = s.Barrier(rank, 0, "pointer exchange", timeout); !e.empty()) return e;
  for (int i = 0; i < p.tp; ++i) {
    const int src = Sched::Source(rank, i, p.tp);
    const int tile = Sched::OutputTile(rank, i, p.tp);
    CpuGemmArgs g = StageGemm(p);
    const void* rotating = s.PeerBuffer(src, bytes);
    g.a = kRotatingA ? rotating : x;
    g.a_view = p.AView(tile);
    g.b = kRotatingA ? w : rotating;
    g.b_view = p.BView(tile);
    g.d_type = p.out_type;
    g.d = out;
    g.d_view = p.OutView(tile);
    if (c) {
      g.c = c;
      g.c_type = p.out_type;
      g.c_view = g.d_view;
      g.beta = p.beta;
    }
    GemmCpu(g);
  }
  if (Faulty(device, 1)) return "";
  return s.Barrier(rank, 1, "the closing barrier (peers still reading this shard)", timeout);
}

template <class Sched>
std::string RunReduceScatter(const Problem& p, int rank, int64_t device, Exchange& s, const void* x,
                             const void* w, const void* c, void* out,
                             std::chrono::milliseconds timeout) {
  // Running sums of stages 0..TP-2, read by the right neighbour one stage later (owned by
  // the exchange, which keeps them while any reader is left).
  const size_t bytes = static_cast<size_t>((p.tp - 1) * p.PartialElems()) * sizeof(float);
  float* partials = static_cast<float*>(s.Buffer(rank, bytes));
  if (Faulty(device, 0)) return "";
  if (auto e = s.Barrier(rank, 0, "pointer exchange", timeout); !e.empty()) return e;
  const MatrixView pv = p.PartialView();
  for (int i = 0; i < p.tp; ++i) {
    const int tile = Sched::OutputTile(rank, i, p.tp);
    const bool last = i == p.tp - 1;
    CpuGemmArgs g = StageGemm(p);
    g.a = x;
    g.a_view = p.AView(tile);
    g.b = w;
    g.b_view = p.BView(tile);
    if (i > 0) {
      const int left = Sched::Source(rank, i, p.tp);
      g.running_sum =
          static_cast<const float*>(s.PeerBuffer(left, bytes)) + (i - 1) * p.PartialElems();
      g.running_sum_view = pv;
    }
    if (last) {
      g.d_type = p.out_type;
      g.d = out;
      g.d_view = p.OutView(tile);
      if (c) {
        g.c = c;
        g.c_type = p.out_type;
        g.c_view = g.d_view;
        g.beta = p.beta;
      }
    } else {
      g.d_type = ElemType::kF32;
      g.d = partials + i * p.PartialElems();
      g.d_view = pv;
    }
    GemmCpu(g);
    if (!last) {
      if (Faulty(device, i + 1)) return "";
      std::ostringstream what;
      what << "stage " << i << " (right neighbour rank " << Sched::PushTarget(rank, i, p.tp)
           << " waits for this running sum)";
      if (auto e = s.Barrier(rank, i + 1, what.str(), timeout); !e.empty()) return e;
    }
  }
  if (Faulty(device, p.tp)) return "";
  return s.Barrier(rank, p.tp, "the closing barrier (peers still reading running sums)",
                   timeout);
}

ffi::Error DistGemmCpuImpl(ffi::RunId run_id, int32_t device_ordinal, ffi::AnyBuffer x,
                           ffi::AnyBuffer w, ffi::AnyBuffer c,
                           ffi::Result<ffi::AnyBuffer> out, int32_t schedule, int64_t tp,
                           ffi::Span<const int64_t> groups, float alpha, float beta,
                           int64_t call_id, int64_t timeout_ms) {
  const CallAttrs attrs{schedule, tp, groups, alpha, beta, call_id, timeout_ms};
  Problem p;
  if (auto err = DecodeProblem(x, w, c, *out, attrs, &p); err.failure()) return err;
  const int64_t device_id = GlobalDeviceId(kPlatformCpu, device_ordinal);
  int rank = -1, group = -1;
  if (auto err = LocateDevice(attrs, device_id, &rank, &group); err.failure()) return err;
  const void* cptr = p.has_c ? c.untyped_data() : nullptr;
  const auto timeout = std::chrono::milliseconds(timeout_ms);

  // Runs the schedule through `ex`; "" or a timeout message (other failures throw).
  auto run = [&](Exchange& ex) -> std::string {
    return VisitSchedule(p.schedule, [&](auto sched) {
      using S = decltype(sched);
      if constexpr (S::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingA ||
                    S::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingB) {
        return RunAllGather<S>(p, rank, device_id, ex, x.untyped_data(), w.untyped_data(),
                               cptr, out->untyped_data(), timeout);
      } else {
        return RunReduceScatter<S>(p, rank, device_id, ex, x.untyped_data(),
                                   w.untyped_data(), cptr, out->untyped_data(), timeout);
      }
    });
  };

  const std::vector<int64_t> members(groups.begin() + static_cast<int64_t>(group) * tp,
                                     groups.begin() + static_cast<int64_t>(group + 1) * tp);
  const bool cross_process = std::any_of(members.begin(), members.end(), [](int64_t id) {
    return !IsLocalDeviceId(kPlatformCpu, id);
  });
  std::string err;
  try {
    if (!cross_process) {
      if (Faulty(device_id, -1)) return ffi::Error::Success();  // test hook
      std::ostringstream key;
      key << run_id.run_id << "/" << call_id << "/"
          << NextOccurrence(device_id, run_id.run_id, call_id) << "/" << group;
      std::shared_ptr<Session> session = JoinSession(key.str(), static_cast<int>(tp));
      SessionExchange ex(*session);
      err = run(ex);
    } else {
      // RunIds differ between processes: the channel (group, call_id) and its occurrence on
      // this device key the meeting (docs/design.md, "Multi-process (CPU)").
      if (ShmJobToken().empty()) {
        return InvalidArgument(
            "device " + std::to_string(device_id) + ": the TP group of this call spans "
            "processes; call jax_distgemm.initialize_multiprocess() after "
            "jax.distributed.initialize() in every process, or use implementation='xla'");
      }
      const int64_t occurrence = NextChannelOccurrence(device_id, members, call_id);
      if (Faulty(device_id, -1)) {  // test hook: counts the call, never meets the peers
        ShmExchange::Skip(members, call_id, occurrence, rank);
        return ffi::Error::Success();
      }
      std::unique_ptr<ShmExchange> ex;
      bool timed_out = false;
      err = ShmExchange::Join(members, call_id, occurrence, rank, timeout, &ex, &timed_out);
      if (!err.empty() && !timed_out) {
        return Internal("CPU executor, device " + std::to_string(device_id) + ": " + err);
      }
      if (err.empty()) err = run(*ex);
    }
  } catch (const std::bad_alloc&) {
    return Internal("CPU executor, device " + std::to_string(device_id) +
                    ": out of host memory for the shards peers read");
  } catch (const std::exception& e) {
    return Internal("CPU executor, device " + std::to_string(device_id) + ": " + e.what());
  }
  if (!err.empty()) {
    return DeadlineExceeded("CPU executor, device " + std::to_string(device_id) + ": " + err);
  }
  return ffi::Error::Success();
}

}  // namespace

void SetCpuFaultDevice(int64_t device, int phase) {
  g_fault_phase.store(phase);
  g_fault_device.store(device);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistGemmCpu, DistGemmCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()          // rendezvous key, same on all devices
                                  .Ctx<ffi::DeviceOrdinal>()  // this device
                                  .Arg<ffi::AnyBuffer>()      // x
                                  .Arg<ffi::AnyBuffer>()      // w
                                  .Arg<ffi::AnyBuffer>()      // c (output dtype; 0 elements if absent)
                                  .Ret<ffi::AnyBuffer>()      // out
                                  .Attr<int32_t>("schedule")  // ScheduleKind
                                  .Attr<int64_t>("tp")        // TP group size
                                  .Attr<ffi::Span<const int64_t>>("groups")  // ids, [G, tp]
                                  .Attr<float>("alpha")       // out = alpha * x @ w ...
                                  .Attr<float>("beta")        // ... + beta * c
                                  .Attr<int64_t>("call_id")   // call site, rendezvous key
                                  .Attr<int64_t>("timeout_ms"));  // bound on peer waits

}  // namespace jax_distgemm

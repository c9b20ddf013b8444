// CPU executor.  XLA calls every device's handler (docs/design.md, "Probe"), which hands the
// call to a thread of its own and returns a future (DistGemmCpuImpl says why); those threads of
// the TP handlers of one call meet in an Exchange, expose what peers read (a copy of the
// rotating shard, or the running sums), and then run the schedule stage by stage, reading
// peers' buffers in place.  The Exchange is a host Session when the whole TP group is in this
// process, POSIX shared memory when some members are in other processes (cc/common/shm_exchange.h):
//
//   AllGather:     publish x, w  | barrier | TP stages, each reading one peer's shard (and,
//                  if asked, copying it into the gathered result) | barrier
//   ReduceScatter: publish x, w, running sums | TP stages, a barrier after each (the right
//                  neighbour reads what this stage wrote) | barrier
//   ReduceScatter by gathering (TilingA, one batch; RsGatherRequested): publish x, w | barrier
//                  | TP stages, each reading one peer's x rows and w | barrier
//
// The closing barrier keeps every buffer unchanged until no peer reads it any more.
#include "cc/cpu/distgemm_cpu.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "cc/common/device_ids.h"
#include "cc/common/ffi_helpers.h"
#include "cc/common/rendezvous.h"
#include "cc/common/shm_exchange.h"
#include "cc/common/workspace.h"
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
  g.a_type = p.in_type;
  g.b_type = p.w_type;
  g.scaling = p.scaling;
  g.alpha = p.alpha;
  return g;
}

// The scales of a stage's A (those of the x they come from) and B (of w), fp8 only.
void SetStageScales(const Problem& p, int tile, const float* x_scale, const float* w_scale,
                    CpuGemmArgs* g) {
  g->a_scale = x_scale;
  g->b_scale = w_scale;
  if (p.scaling == Scaling::kBlock) {
    g->a_scale_view = p.AScaleView(tile);
    g->b_scale_view = p.BScaleView(tile);
  }
}

// A shard as peers read it: its values, then (fp8) its scales from 16 bytes on.
struct ShardLayout {
  size_t value_bytes = 0, scale_offset = 0, bytes = 0;
  ShardLayout(int64_t values, ElemType type, int64_t scales) {
    value_bytes = static_cast<size_t>(values * ElemSize(type));
    scale_offset = (value_bytes + 15) / 16 * 16;
    bytes = scales > 0 ? scale_offset + static_cast<size_t>(scales) * sizeof(float) : value_bytes;
  }
  void Fill(void* dst, const void* values, const float* scales) const {
    std::memcpy(dst, values, value_bytes);
    if (scales != nullptr) std::memcpy(Scales(dst), scales, bytes - scale_offset);
  }
  float* Scales(void* shard) const {
    return reinterpret_cast<float*>(static_cast<uint8_t*>(shard) + scale_offset);
  }
  const float* Scales(const void* shard) const {
    return reinterpret_cast<const float*>(static_cast<const uint8_t*>(shard) + scale_offset);
  }
};

// Copies rank `src`'s shard (packed) into its block of the gathered result (Problem's
// GatheredRows / GatheredWidth).
void CopyIntoGathered(const Problem& p, int src, const void* shard, void* gathered) {
  const int64_t rows = p.GatheredRows(), width = p.GatheredWidth();
  const size_t esz = ElemSize(p.in_type);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(static_cast<uint8_t*>(gathered) + ((r * p.tp + src) * width) * esz,
                static_cast<const uint8_t*>(shard) + r * width * esz, width * esz);
  }
}

// The operands of one call on this device; scales for fp8 only.
struct Operands {
  const void* x = nullptr;
  const float* x_scale = nullptr;
  const void* w = nullptr;
  const float* w_scale = nullptr;
  const void* c = nullptr;
  void* out = nullptr;
};

template <class Sched>
std::string RunAllGather(const Problem& p, int rank, int64_t device, Exchange& s,
                         const Operands& o, void* gathered, std::chrono::milliseconds timeout) {
  constexpr bool kRotatingA = Sched::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  const bool scaled = p.scaling != Scaling::kNone;
  // Peers read a copy of the rotating shard (and its scales) owned by the exchange, never
  // XLA's buffer: after a timed-out barrier this handler returns and XLA may free its inputs.
  const ShardLayout layout(kRotatingA ? p.XElems() : p.WElems(), p.in_type,
                           !scaled ? 0 : kRotatingA ? p.XScaleElems() : p.WScaleElems());
  void* shard = s.Buffer(rank, layout.bytes);
  layout.Fill(shard, kRotatingA ? o.x : o.w, kRotatingA ? o.x_scale : o.w_scale);
  if (Faulty(device, 0)) return "";
  if (auto e = s.Barrier(rank, 0, "pointer exchange", timeout); !e.empty()) return e;
  for (int i = 0; i < p.tp; ++i) {
    const int src = Sched::Source(rank, i, p.tp);
    const int tile = Sched::OutputTile(rank, i, p.tp);
    CpuGemmArgs g = StageGemm(p);
    const void* rotating = s.PeerBuffer(src, layout.bytes);
    if (gathered != nullptr) CopyIntoGathered(p, src, rotating, gathered);
    g.a = kRotatingA ? rotating : o.x;
    g.a_view = p.AView(tile);
    g.b = kRotatingA ? o.w : rotating;
    g.b_view = p.BView(tile);
    if (scaled) {
      const float* travelled = layout.Scales(rotating);
      SetStageScales(p, tile, kRotatingA ? travelled : o.x_scale,
                     kRotatingA ? o.w_scale : travelled, &g);
    }
    g.d_type = p.out_type;
    g.d = o.out;
    g.d_view = p.OutView(tile);
    if (o.c) {
      g.c = o.c;
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
std::string RunReduceScatter(const Problem& p, int rank, int64_t device, Exchange& s,
                             const Operands& o, std::chrono::milliseconds timeout) {
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
    g.a = o.x;
    g.a_view = p.AView(tile);
    g.b = o.w;
    g.b_view = p.BView(tile);
    SetStageScales(p, tile, o.x_scale, o.w_scale, &g);
    if (i > 0) {
      const int left = Sched::Source(rank, i, p.tp);
      g.running_sum =
          static_cast<const float*>(s.PeerBuffer(left, bytes)) + (i - 1) * p.PartialElems();
      g.running_sum_view = pv;
    }
    if (last) {
      g.d_type = p.out_type;
      g.d = o.out;
      g.d_view = p.OutView(tile);
      if (o.c) {
        g.c = o.c;
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

// Whether the call gathers where the CUDA executor would (ChooseRsPath, the one rule of both
// executors; `rs_path` is the call's attribute).  ReduceScatter TilingA by gathering operands,
// as the CUDA executor's kGather path runs it (ReduceScatter1D_TilingA_Gather,
// cc/schedules/ring_1d.h).
bool RsGatherRequested(const Problem& p, int rs_path) {
  return ChooseRsPath(p, rs_path) == kRsGather;
}

std::string RunReduceScatterGather(const Problem& p, int rank, int64_t device, Exchange& s,
                                   const Operands& o, std::chrono::milliseconds timeout) {
  using G = ReduceScatter1D_TilingA_Gather;
  const bool scaled = p.scaling != Scaling::kNone;
  // Peers read copies of x and w (and their scales) owned by the exchange (RunAllGather says
  // why): x's layout, then w's from x's end on.
  const ShardLayout xl(p.XElems(), p.in_type, scaled ? p.XScaleElems() : 0);
  const ShardLayout wl(p.WElems(), p.w_type, scaled ? p.WScaleElems() : 0);
  const size_t x_bytes = (xl.bytes + 15) / 16 * 16;
  const size_t bytes = x_bytes + wl.bytes;
  auto* mine = static_cast<uint8_t*>(s.Buffer(rank, bytes));
  xl.Fill(mine, o.x, o.x_scale);
  wl.Fill(mine + x_bytes, o.w, o.w_scale);
  if (Faulty(device, 0)) return "";
  if (auto e = s.Barrier(rank, 0, "pointer exchange", timeout); !e.empty()) return e;
  const int tile = ReduceScatter1D_TilingA_RotatingC::OutputTile(rank, p.tp - 1, p.tp);
  const MatrixView pv = p.PartialView();
  std::vector<float> sum(static_cast<size_t>(p.PartialElems()));  // fp32, in place
  for (int i = 0; i < p.tp; ++i) {
    const bool last = i == p.tp - 1;
    const auto* src = static_cast<const uint8_t*>(s.PeerBuffer(G::Source(rank, i, p.tp), bytes));
    CpuGemmArgs g = StageGemm(p);
    g.a = src;
    g.a_view = p.AView(tile);  // the source's x rows of this device's block
    g.b = src + x_bytes;
    g.b_view = p.BView(tile);
    if (scaled) SetStageScales(p, tile, xl.Scales(src), wl.Scales(src + x_bytes), &g);
    if (i > 0) {
      g.running_sum = sum.data();
      g.running_sum_view = pv;
    }
    if (last) {
      g.d_type = p.out_type;
      g.d = o.out;
      g.d_view = p.OutView(tile);
    } else {
      g.d_type = ElemType::kF32;
      g.d = sum.data();
      g.d_view = pv;
    }
    if (o.c != nullptr && last) {  // beta C once (on CUDA at stage 0; the sum is the same)
      g.c = o.c;
      g.c_type = p.out_type;
      g.c_view = p.OutView(tile);
      g.beta = p.beta;
    }
    GemmCpu(g);
  }
  if (Faulty(device, 1)) return "";
  return s.Barrier(rank, 1, "the closing barrier (peers still reading this x and w)", timeout);
}

// The schedule of one call, run to completion on its own thread (see DistGemmCpuImpl):
// JoinSession/ShmExchange::Join, then RunAllGather/RunReduceScatter.  Owns copies of everything
// it reads from the handler's frame; the buffers stay valid until the call's future completes.
struct CpuCall {
  Problem p;
  int rank = -1;
  int64_t device_id = -1;
  Operands ops;
  void* gathered = nullptr;  // AllGather's optional second result
  int rs_path = kRsAuto;  // the call's attribute
  std::chrono::milliseconds timeout{0};
  // In-process meeting: the session key.  Cross-process: the channel and its occurrence.
  bool cross_process = false;
  std::string session_key;
  std::vector<int64_t> members;
  int64_t call_id = 0;
  int64_t occurrence = 0;

  // "" or a timeout message (other failures throw).
  std::string RunSchedule(Exchange& ex) const {
    return VisitSchedule(p.schedule, [&](auto sched) {
      using S = decltype(sched);
      if constexpr (S::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingA ||
                    S::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingB) {
        return RunAllGather<S>(p, rank, device_id, ex, ops, gathered, timeout);
      } else {
        if (RsGatherRequested(p, rs_path)) {
          return RunReduceScatterGather(p, rank, device_id, ex, ops, timeout);
        }
        return RunReduceScatter<S>(p, rank, device_id, ex, ops, timeout);
      }
    });
  }

  // What every rank of a cross-process meeting must agree on (ShmExchange compares it).
  std::string Signature() const {
    std::string s = CallSignature(p) + (gathered != nullptr ? " gathered=yes" : " gathered=no");
    if (p.schedule == ScheduleKind::kReduceScatter1D_TilingA_RotatingC ||
        p.schedule == ScheduleKind::kReduceScatter1D_TilingB_RotatingC) {
      s += RsGatherRequested(p, rs_path) ? " rs_path=gather" : " rs_path=ring";
    }
    return s;
  }

  // The prefix of every error this call reports.
  std::string Where() const { return "CPU executor, device " + std::to_string(device_id) + ": "; }

  ffi::Error Run() const {
    const std::string where = Where();
    std::string err;
    try {
      if (!cross_process) {
        std::shared_ptr<Session> session = JoinSession(session_key, p.tp);
        SessionExchange ex(*session);
        err = RunSchedule(ex);
      } else {
        std::unique_ptr<ShmExchange> ex;
        bool timed_out = false;
        err = ShmExchange::Join(members, call_id, occurrence, rank, timeout, &ex, &timed_out,
                                Signature());
        if (!err.empty() && !timed_out) return Internal(where + err);
        if (err.empty()) err = RunSchedule(*ex);
      }
    } catch (const CallMismatch& e) {
      return InvalidArgument(where + e.what());
    } catch (const std::bad_alloc&) {
      return Internal(where + "out of host memory for the shards peers read");
    } catch (const std::exception& e) {
      return Internal(where + e.what());
    }
    if (!err.empty()) return DeadlineExceeded(where + err);
    return ffi::Error::Success();
  }
};

// -- Call sites ------------------------------------------------------------------------------
// NOTE: call_id does not tell a program's call sites apart.  JAX lowers an identical sub-jaxpr
// once (a shard_map body, a jit reused in one program; mlir._lower_jaxpr_to_fun_cached) and
// XLA inlines it at every use, so e.g. three same-shaped projections of one input carry one
// call_id.  XLA:CPU runs independent thunks in any order, different on each device, so pairing
// them by occurrence alone can meet one device's call with another call of its peer (wrong
// shards, no error).  The instantiate stage runs once per
// instruction and its state is shared by the process's devices: its index among the sites of
// its call_id joins the rendezvous key.
// ASSUMPTION (across processes): every process builds the same executables in the same order
// (SPMD), so that the same instruction gets the same index in each.
struct CallSite {
  static ffi::TypeId id;
  int64_t index = 0;  // among this process's sites of the same call_id, in instantiation order
};
ffi::TypeId CallSite::id = {};
constexpr XLA_FFI_TypeInfo kCallSiteTypeInfo = ffi::MakeTypeInfo<CallSite>();

ffi::ErrorOr<std::unique_ptr<CallSite>> DistGemmCpuInstantiateImpl(ffi::Dictionary attrs) {
  ffi::ErrorOr<int64_t> call_id = attrs.get<int64_t>("call_id");
  if (!call_id.has_value()) return call_id.error();
  static std::mutex mu;
  static auto* next = new std::map<int64_t, int64_t>();
  std::lock_guard<std::mutex> lock(mu);
  auto site = std::make_unique<CallSite>();
  site->index = (*next)[*call_id]++;
  return site;
}

// The rendezvous key of a call site: call_id's low 32 bits hold a channel < 2^16 (JAX's
// new_channel), so the site index takes bits 16-31.
int64_t SiteKey(int64_t call_id, const CallSite& site) {
  return call_id | (site.index << 16);
}

// Completes `promise` with `error` (success or failure).
void Fulfil(ffi::Promise& promise, ffi::Error error) {
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(std::move(error));
  }
}

// A future that is already complete (checks that fail before the call starts).
ffi::Future Completed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  Fulfil(promise, std::move(error));
  return future;
}

// Asynchronous: checks the call, counts its occurrence (in XLA's order on this device), then
// hands the meeting and the GEMMs to a thread of its own and returns a future.
//
// NOTE: a blocking handler deadlocks XLA:CPU.  Its parallel thunk executor runs thunks that
// are ready together on the intra-op pool, which has about as many threads as the host has
// cores and serves every fake device.  On a 2-core host, two ranks of a group can block the
// whole pool waiting for peers whose thunks are queued behind them.  Here no XLA thread ever
// waits for a peer.
//
// `call` holds the decoded problem, operands and gathered result; the rest is filled in here.
ffi::Future StartCall(ffi::RunId run_id, int32_t device_ordinal, const CallSite& site,
                      const CallAttrs& attrs, std::shared_ptr<CpuCall> call) {
  const int64_t call_id_attr = attrs.call_id, tp = attrs.tp;
  const ffi::Span<const int64_t>& groups = attrs.groups;
  if (site.index >= (int64_t{1} << 15) || (call_id_attr & 0xffff0000) != 0) {
    return Completed(InvalidArgument(
        "call_id " + std::to_string(call_id_attr) + " / call site " +
        std::to_string(site.index) + ": more call sites of one call_id than the key holds"));
  }
  const int64_t call_id = SiteKey(call_id_attr, site);
  const int64_t device_id = GlobalDeviceId(kPlatformCpu, device_ordinal);
  int rank = -1, group = -1;
  if (auto err = LocateDevice(attrs, device_id, &rank, &group); err.failure()) {
    return Completed(std::move(err));
  }
  call->rank = rank;
  call->device_id = device_id;
  call->rs_path = attrs.rs_path;
  call->timeout = std::chrono::milliseconds(attrs.timeout_ms);
  call->call_id = call_id;
  call->members.assign(groups.begin() + static_cast<int64_t>(group) * tp,
                       groups.begin() + static_cast<int64_t>(group + 1) * tp);
  call->cross_process = std::any_of(call->members.begin(), call->members.end(),
                                    [](int64_t id) { return !IsLocalDeviceId(kPlatformCpu, id); });
  if (!call->cross_process) {
    if (Faulty(device_id, -1)) return Completed(ffi::Error::Success());  // test hook
    std::ostringstream key;
    key << run_id.run_id << "/" << call_id << "/"
        << NextOccurrence(device_id, run_id.run_id, call_id) << "/" << group;
    call->session_key = key.str();
  } else {
    // RunIds differ between processes: the channel (group, call_id) and its occurrence on
    // this device key the meeting (docs/design.md, "Multi-process (CPU)").
    if (ShmJobToken().empty()) {
      return Completed(InvalidArgument(
          "device " + std::to_string(device_id) + ": the TP group of this call spans "
          "processes; call jax_distgemm.initialize_multiprocess() after "
          "jax.distributed.initialize() in every process, or use implementation='xla'"));
    }
    call->occurrence = NextChannelOccurrence(device_id, call->members, call_id);
    if (Faulty(device_id, -1)) {  // test hook: counts the call, never meets the peers
      ShmExchange::Skip(call->members, call_id, call->occurrence, rank);
      return Completed(ffi::Error::Success());
    }
  }

  ffi::Promise promise;
  ffi::Future future(promise);
  try {
    std::thread([call, promise]() mutable { Fulfil(promise, call->Run()); }).detach();
  } catch (const std::system_error& e) {
    promise.SetError(Internal(call->Where() + "cannot start a thread for the call: " + e.what()));
  }
  return future;
}

ffi::Future DistGemmCpuImpl(ffi::RunId run_id, int32_t device_ordinal, CallSite* site,
                            ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer c,
                            ffi::Result<ffi::AnyBuffer> out,
                            std::optional<ffi::Result<ffi::AnyBuffer>> gathered,
                            int32_t schedule, int64_t tp, ffi::Span<const int64_t> groups,
                            float alpha, float beta, int64_t call_id, int64_t timeout_ms,
                            int32_t rs_path) {
  const CallAttrs attrs{schedule, tp, groups, alpha, beta, call_id, timeout_ms, rs_path};
  auto call = std::make_shared<CpuCall>();
  if (auto err = DecodeProblem(x, w, c, *out, attrs, &call->p); err.failure()) {
    return Completed(std::move(err));
  }
  if (gathered.has_value()) {
    if (auto err = DecodeGathered(x, w, **gathered, call->p); err.failure()) {
      return Completed(std::move(err));
    }
    call->gathered = (*gathered)->untyped_data();
  }
  call->ops = {x.untyped_data(), nullptr, w.untyped_data(), nullptr,
               call->p.has_c ? c.untyped_data() : nullptr, out->untyped_data()};
  return StartCall(run_id, device_ordinal, *site, attrs, std::move(call));
}

ffi::Future DistGemmFp8CpuImpl(ffi::RunId run_id, int32_t device_ordinal, CallSite* site,
                               ffi::AnyBuffer x, ffi::AnyBuffer x_scale, ffi::AnyBuffer w,
                               ffi::AnyBuffer w_scale, ffi::AnyBuffer c,
                               ffi::Result<ffi::AnyBuffer> out, int32_t schedule, int64_t tp,
                               ffi::Span<const int64_t> groups, float alpha, float beta,
                               int64_t call_id, int64_t timeout_ms, int32_t rs_path) {
  const CallAttrs attrs{schedule, tp, groups, alpha, beta, call_id, timeout_ms, rs_path};
  auto call = std::make_shared<CpuCall>();
  if (auto err = DecodeFp8Problem(x, x_scale, w, w_scale, c, *out, attrs, &call->p);
      err.failure()) {
    return Completed(std::move(err));
  }
  call->ops = {x.untyped_data(), static_cast<const float*>(x_scale.untyped_data()),
               w.untyped_data(), static_cast<const float*>(w_scale.untyped_data()),
               call->p.has_c ? c.untyped_data() : nullptr, out->untyped_data()};
  return StartCall(run_id, device_ordinal, *site, attrs, std::move(call));
}

}  // namespace

void SetCpuFaultDevice(int64_t device, int phase) {
  g_fault_phase.store(phase);
  g_fault_device.store(device);
}

XLA_FFI_TypeId* CallSiteTypeId() { return &CallSite::id; }
const XLA_FFI_TypeInfo* CallSiteTypeInfo() { return &kCallSiteTypeInfo; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistGemmCpuInstantiate, DistGemmCpuInstantiateImpl,
                              ffi::Ffi::BindInstantiate()
                                  .Attrs());  // the call's attributes; reads call_id

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistGemmCpu, DistGemmCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()          // rendezvous key, same on all devices
                                  .Ctx<ffi::DeviceOrdinal>()  // this device
                                  .Ctx<ffi::State<CallSite>>()  // this call site (instantiate)
                                  .Arg<ffi::AnyBuffer>()      // x
                                  .Arg<ffi::AnyBuffer>()      // w
                                  .Arg<ffi::AnyBuffer>()      // c (output dtype; 0 elements if absent)
                                  .Ret<ffi::AnyBuffer>()      // out
                                  .OptionalRet<ffi::AnyBuffer>()  // gathered operand (AllGather)
                                  .Attr<int32_t>("schedule")  // ScheduleKind
                                  .Attr<int64_t>("tp")        // TP group size
                                  .Attr<ffi::Span<const int64_t>>("groups")  // ids, [G, tp]
                                  .Attr<float>("alpha")       // out = alpha * x @ w ...
                                  .Attr<float>("beta")        // ... + beta * c
                                  .Attr<int64_t>("call_id")   // call site, rendezvous key
                                  .Attr<int64_t>("timeout_ms")  // bound on peer waits
                                  .Attr<int32_t>("rs_path"));   // RsPath; 0: automatic

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistGemmFp8Cpu, DistGemmFp8CpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()          // rendezvous key, same on all devices
                                  .Ctx<ffi::DeviceOrdinal>()  // this device
                                  .Ctx<ffi::State<CallSite>>()  // this call site (instantiate)
                                  .Arg<ffi::AnyBuffer>()      // x (fp8)
                                  .Arg<ffi::AnyBuffer>()      // x_scale (fp32, [] or blocks)
                                  .Arg<ffi::AnyBuffer>()      // w (fp8)
                                  .Arg<ffi::AnyBuffer>()      // w_scale (fp32, [] or blocks)
                                  .Arg<ffi::AnyBuffer>()      // c (output dtype; 0 elements if absent)
                                  .Ret<ffi::AnyBuffer>()      // out (bf16 or fp32)
                                  .Attr<int32_t>("schedule")  // ScheduleKind
                                  .Attr<int64_t>("tp")        // TP group size
                                  .Attr<ffi::Span<const int64_t>>("groups")  // ids, [G, tp]
                                  .Attr<float>("alpha")       // out = alpha * x @ w ...
                                  .Attr<float>("beta")        // ... + beta * c
                                  .Attr<int64_t>("call_id")   // call site, rendezvous key
                                  .Attr<int64_t>("timeout_ms")  // bound on peer waits
                                  .Attr<int32_t>("rs_path"));   // RsPath; 0: automatic

}  // namespace jax_distgemm

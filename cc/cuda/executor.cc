// Stage plans of the four schedules on CUDA (see cc/schedules/ring_1d.h for the index math).
//
// AllGather (push into the symmetric workspace, copy engine):
//
//   main stream  : [stage 0: own shard]  [stage 1: wait flag[1] | slot 0]  ...  <wait join>
//   copy stream  :  push shard -> (r-1)%TP slot 0, flag[1]=e;  push -> (r-2)%TP slot 1, ...
//
//   Stage 0 starts at once on the local shard while the copy engine pushes this device's
//   shard into every peer's slot (the peer that needs it soonest first).
//
// ReduceScatter (ring; running sums pushed by the epilogue's TMA store into the right
// neighbour's workspace):
//
//   stage 0      : D -> right's slot 0                         (no C)
//   stage i      : signal right.flag[i] (stage i-1 done) | wait flag[i] (left's stage i-1 in
//                  my slot i-1) | C = my slot i-1, D -> right's slot i
//   stage TP-1   : ...                                         C = my slot TP-2, D -> out
//
// Slots are indexed [parity][stage] with parity = epoch % 2 (peer_state.h explains why that
// suffices without a trailing barrier).
#include "cc/cuda/executor.h"

#include <sstream>

#include "cc/cuda/autotune.h"
#include "cc/cuda/gemm_kernels.h"
#include "cc/schedules/ring_1d.h"

namespace jax_distgemm::cuda {
namespace {

constexpr size_t kSlotAlign = 256;

size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

// Bytes of one slot: the rotating shard (AllGather) or one running sum (ReduceScatter).
size_t SlotBytes(const Problem& p) {
  if (IsAllGather(p.schedule)) {
    const bool rot_a = p.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
    return RoundUp((rot_a ? p.XElems() : p.WElems()) * ElemSize(p.in_type), kSlotAlign);
  }
  return RoundUp(p.PartialElems() * ElemSize(p.out_type), kSlotAlign);
}

uint8_t* Slot(DeviceState& d, const Problem& p, uint32_t epoch, int index) {
  const int per_parity = p.tp - 1;
  return d.workspace + (static_cast<size_t>(epoch & 1u) * per_parity + index) * SlotBytes(p);
}

const uint8_t* At(const void* base, int64_t elem_offset, ElemType t) {
  return static_cast<const uint8_t*>(base) + elem_offset * ElemSize(t);
}

GemmLaunch BaseLaunch(const Problem& p, const DeviceState& d, const CallOptions& o,
                      ErrorRecord* error, int rank) {
  GemmLaunch g;
  g.ab_type = p.in_type;
  g.d_type = p.out_type;
  g.device = d.ordinal;
  g.sm_count = d.sm_count;
  g.workspace = d.gemm_scratch;
  g.ops.m = p.sm();
  g.ops.n = p.sn();
  g.ops.k = p.sk();
  g.ops.batch = p.batch;
  g.ops.alpha = p.alpha;
  g.sync.timeout_ns = static_cast<uint64_t>(o.timeout_ms) * 1000000ull;
  g.sync.error = error;
  g.sync.rank = rank;
  return g;
}

std::string Launch(GemmLaunch& g, cudaStream_t stream, int stage) {
  if (std::string err = ChooseConfig(g, stream); !err.empty()) return err;
  if (GemmWorkspaceBytes(g) > PeerGroup::kGemmScratchBytes) {
    return "stage GEMM needs more CUTLASS workspace than reserved";
  }
  std::string err = LaunchGemm(g, stream);
  if (!err.empty()) {
    std::ostringstream m;
    m << "stage " << stage << ": " << err;
    return m.str();
  }
  return "";
}

template <class Sched>
std::string EnqueueAllGather(const Problem& p, int rank, PeerGroup& group, const CallBuffers& b,
                             const CallOptions& o, cudaStream_t stream, uint32_t epoch) {
  constexpr bool kRotA = Sched::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  DeviceState& me = group.dev(rank);
  const int tp = p.tp;
  const void* shard = kRotA ? b.x : b.w;
  const size_t shard_bytes = (kRotA ? p.XElems() : p.WElems()) * ElemSize(p.in_type);

  // Pushes on the copy stream, after the inputs are ready on the main stream.
  if (tp > 1) {
    if (cudaEventRecord(me.fork, stream) != cudaSuccess ||
        cudaStreamWaitEvent(me.copy_stream, me.fork, 0) != cudaSuccess) {
      return std::string("fork copy stream: ") + cudaGetErrorString(cudaGetLastError());
    }
    for (int i = 1; i < tp && !o.skip_signals; ++i) {
      DeviceState& target = group.dev(Sched::PushTarget(rank, i, tp));
      cudaError_t e = cudaMemcpyAsync(Slot(target, p, epoch, i - 1), shard, shard_bytes,
                                      cudaMemcpyDeviceToDevice, me.copy_stream);
      if (e == cudaSuccess) e = StreamWriteValue32(me.copy_stream, target.flags + i, epoch);
      if (e != cudaSuccess) return std::string("push to peer: ") + cudaGetErrorString(e);
    }
    if (cudaEventRecord(me.join, me.copy_stream) != cudaSuccess) {
      return std::string("join copy stream: ") + cudaGetErrorString(cudaGetLastError());
    }
  }

  for (int i = 0; i < tp; ++i) {
    const int tile = Sched::OutputTile(rank, i, tp);
    GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
    const MatrixView av = p.AView(tile), bv = p.BView(tile), ov = p.OutView(tile);
    const void* rotating = i == 0 ? shard : Slot(me, p, epoch, i - 1);
    g.ops.a = kRotA ? rotating : At(b.x, av.offset, p.in_type);
    g.ops.lda = av.ld;
    g.ops.batch_stride_a = av.batch_stride;
    g.ops.b = kRotA ? At(b.w, bv.offset, p.in_type) : rotating;
    g.ops.ldb = bv.ld;
    g.ops.batch_stride_b = bv.batch_stride;
    g.ops.d = const_cast<uint8_t*>(At(b.out, ov.offset, p.out_type));
    g.ops.ldd = ov.ld;
    g.ops.batch_stride_d = ov.batch_stride;
    if (b.c != nullptr) {
      g.ops.c = At(b.c, ov.offset, p.out_type);
      g.ops.ldc = ov.ld;
      g.ops.batch_stride_c = ov.batch_stride;
      g.ops.beta = p.beta;
    }
    if (i > 0) {
      g.sync.wait_flag = me.flags + i;
      g.sync.wait_epoch = epoch;
      g.sync.stage = i;
      g.sync.peer = Sched::Source(rank, i, tp);
    }
    if (std::string err = Launch(g, stream, i); !err.empty()) return err;
  }
  // XLA may reuse the shard's buffer once we return: the pushes must be done by then.
  if (tp > 1 && cudaStreamWaitEvent(stream, me.join, 0) != cudaSuccess) {
    return std::string("join: ") + cudaGetErrorString(cudaGetLastError());
  }
  return "";
}

template <class Sched>
std::string EnqueueReduceScatter(const Problem& p, int rank, PeerGroup& group,
                                 const CallBuffers& b, const CallOptions& o,
                                 cudaStream_t stream, uint32_t epoch) {
  DeviceState& me = group.dev(rank);
  const int tp = p.tp;
  const int right = Sched::PushTarget(rank, 0, tp);
  DeviceState& next = group.dev(right);
  const MatrixView pv = p.PartialView();
  for (int i = 0; i < tp; ++i) {
    const int tile = Sched::OutputTile(rank, i, tp);
    const bool last = i == tp - 1;
    GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
    const MatrixView av = p.AView(tile), bv = p.BView(tile);
    g.ops.a = At(b.x, av.offset, p.in_type);
    g.ops.lda = av.ld;
    g.ops.batch_stride_a = av.batch_stride;
    g.ops.b = At(b.w, bv.offset, p.in_type);
    g.ops.ldb = bv.ld;
    g.ops.batch_stride_b = bv.batch_stride;
    if (last) {
      const MatrixView ov = p.OutView(tile);
      g.ops.d = const_cast<uint8_t*>(At(b.out, ov.offset, p.out_type));
      g.ops.ldd = ov.ld;
      g.ops.batch_stride_d = ov.batch_stride;
    } else {
      g.ops.d = Slot(next, p, epoch, i);  // remote: the right neighbour's workspace
      g.ops.ldd = pv.ld;
      g.ops.batch_stride_d = pv.batch_stride;
    }
    if (i > 0) {
      g.ops.c = Slot(me, p, epoch, i - 1);  // the left neighbour's running sum, pushed here
      g.ops.ldc = pv.ld;
      g.ops.batch_stride_c = pv.batch_stride;
      g.ops.beta = 1.f;
      g.sync.wait_flag = me.flags + i;
      g.sync.wait_epoch = epoch;
      g.sync.stage = i;
      g.sync.peer = Sched::Source(rank, i, tp);
      if (!o.skip_signals) {
        g.sync.signal_flag = next.flags + i;  // my stage i-1 output is complete in its slot
        g.sync.signal_epoch = epoch;
      }
    }
    if (std::string err = Launch(g, stream, i); !err.empty()) return err;
  }
  return "";
}

}  // namespace

size_t WorkspaceBytes(const Problem& p) {
  return p.tp <= 1 ? 0 : 2 * static_cast<size_t>(p.tp - 1) * SlotBytes(p);
}

std::string EnqueueDistGemm(const Problem& p, int rank, PeerGroup& group,
                            const CallBuffers& buffers, const CallOptions& options,
                            cudaStream_t stream) {
  const uint32_t epoch = ++group.dev(rank).epoch;
  if (options.poison_output) {
    // 0xFF bytes are NaN in bfloat16, float16 and float32 alike.
    const size_t bytes = static_cast<size_t>(p.OutElems()) * ElemSize(p.out_type);
    if (cudaMemsetAsync(buffers.out, 0xFF, bytes, stream) != cudaSuccess) {
      return std::string("poison: ") + cudaGetErrorString(cudaGetLastError());
    }
  }
  return VisitSchedule(p.schedule, [&](auto sched) {
    using S = decltype(sched);
    if constexpr (S::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingA ||
                  S::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingB) {
      return EnqueueAllGather<S>(p, rank, group, buffers, options, stream, epoch);
    } else {
      return EnqueueReduceScatter<S>(p, rank, group, buffers, options, stream, epoch);
    }
  });
}

}  // namespace jax_distgemm::cuda

// ReduceScatter on CUDA: the stage plans of ReduceScatter1D_TilingA_RotatingC and _TilingB
// (index math: cc/schedules/ring_1d.h), one per data path (cc/common/workspace.h chooses).
//
// The ring paths: the running sum of stage i feeds the right neighbour's stage i+1.
//
//   kRemoteC  stage i: signal right.flag(i) (my stage i-1 is done) | wait flag(i) |
//             C = left's slot i-1 (remote read), D = my slot i (out at the last)
//   kCopyRing each stage split into row chunks c (kRsChunks):
//             stage i chunk c: wait flag(i,c) (i > 0) | C = my recv slot i, rows c (i > 0) |
//             D = my send slot i, rows c (out at the last); then, if i < TP-1, copy engine:
//             send slot i rows c -> right's recv slot i+1 rows c, right.flag(i+1,c)=e
//
//     main stream : [s0 c0][s0 c1] [s1 c0: wait f(1,0)][s1 c1: wait f(1,1)] ...      <join>
//     copy stream :        push s0 c0, f(1,0)=e  push s0 c1, f(1,1)=e  push s1 c0 ...
//
//   kGather   TilingA, one batch: every device pushes each peer the x rows and w it needs at
//             the call's start; no running sum travels (EnqueueRsGather).
#include "cc/cuda/executor_internal.h"

#include <algorithm>
#include <sstream>

#include "cc/cuda/cuda_check.h"
#include "cc/schedules/ring_1d.h"

namespace jax_distgemm::cuda::internal {
namespace {

// kCopyRing: where stage i's running sum is written (i < TP-1) and received (i >= 1).
int RsSendSlot(int i) { return i; }
int RsRecvSlot(const Problem& p, int i) { return p.tp - 1 + (i - 1); }

// kCopyRing: row chunks per stage (rows of the partial, i.e. of A and of D), so that the push
// of one chunk overlaps the next one's GEMM.  Whole multiples of 128 rows except the last, no
// empty chunk, at most kMaxChunks (one flag each).
constexpr int kRsChunks = 2;
static_assert(kRsChunks <= kMaxChunks);
int RsChunks(const Problem& p) {
  if (p.tp == 1) return 1;
  const int want = static_cast<int>(std::clamp<int64_t>(p.sm() / 128, 1, kRsChunks));
  return NonEmptyChunks(p.sm(), want);
}

// Copies rows [lo, hi) of every batch of a packed [L, sm, sn] running sum (PartialView) from
// `src` to `dst` (same layout) on `stream`: one copy when the rows are contiguous (L = 1 or all
// rows), else one 2-D copy (a row block per batch).
cudaError_t CopyPartialRows(const Problem& p, void* dst, const void* src, int64_t lo, int64_t hi,
                            cudaStream_t stream) {
  const MatrixView pv = p.PartialView();
  const size_t esz = ElemSize(p.out_type);
  const size_t width = static_cast<size_t>(hi - lo) * pv.ld * esz;
  const size_t pitch = static_cast<size_t>(pv.batch_stride) * esz;
  uint8_t* d = static_cast<uint8_t*>(dst) + lo * pv.ld * esz;
  const uint8_t* s = static_cast<const uint8_t*>(src) + lo * pv.ld * esz;
  if (p.batch == 1 || width == pitch) {
    return cudaMemcpyAsync(d, s, width * (width == pitch ? p.batch : 1),
                           cudaMemcpyDeviceToDevice, stream);
  }
  if (pitch <= static_cast<size_t>(INT32_MAX)) {  // cudaMemcpy2D's pitch limit (memPitch)
    return cudaMemcpy2DAsync(d, pitch, s, pitch, width, p.batch, cudaMemcpyDeviceToDevice,
                             stream);
  }
  for (int64_t l = 0; l < p.batch; ++l) {
    if (cudaError_t e = cudaMemcpyAsync(d + l * pitch, s + l * pitch, width,
                                        cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

// kCopyRing, stage i chunk c of `chunks`: rows [lo, hi) of the running sum, the send slot its
// GEMM writes (nullptr at the last stage, which writes out) and the receive-slot rows it reads
// as C (nullptr at stage 0: no running sum yet).
struct CopyRingChunk {
  int64_t lo = 0, hi = 0;
  uint8_t* send = nullptr;
  const uint8_t* recv_rows = nullptr;
};
CopyRingChunk CopyRingChunkAt(const Problem& p, DeviceState& me, Epoch epoch, int i, int c,
                              int chunks) {
  CopyRingChunk k;
  ChunkRange(p.sm(), chunks, c, &k.lo, &k.hi);
  if (i + 1 < p.tp) k.send = Slot(me, p, epoch, RsSendSlot(i));
  if (i > 0) {
    k.recv_rows = Slot(me, p, epoch, RsRecvSlot(p, i)) +
                  k.lo * p.PartialView().ld * ElemSize(p.out_type);
  }
  return k;
}

// kCopyRing, one chunk: m and A, B, D of its GEMM; D = the chunk's send-slot rows (out rows at
// the last stage).  C and the waits are the caller's.
void SetCopyRingChunkOperands(GemmOperands& o, const Problem& p, const CallBuffers& b, int tile,
                              const CopyRingChunk& k) {
  const MatrixView av = p.AView(tile), bv = p.BView(tile), ov = p.OutView(tile);
  const MatrixView pv = p.PartialView();
  o.m = k.hi - k.lo;
  SetA(o, At(b.x, av.offset + k.lo * av.ld, p.in_type), av);
  SetB(o, At(b.w, bv.offset, p.w_type), bv);
  if (k.send == nullptr) {
    SetD(o, At(b.out, ov.offset + k.lo * ov.ld, p.out_type), ov);
  } else {
    SetD(o, k.send + k.lo * pv.ld * ElemSize(p.out_type), pv);
  }
}

// kCopyRing: after my stage i's GEMM of chunk c (stream order on `copy`), push its rows from my
// send slot into `next`'s receive slot i+1 and set its flag(i+1, c).
cudaError_t PushCopyRingChunk(const Problem& p, DeviceState& me, DeviceState& next,
                              Epoch epoch, int i, int c, const CopyRingChunk& k) {
  cudaError_t e = CopyPartialRows(p, Slot(next, p, epoch, RsRecvSlot(p, i + 1)), k.send, k.lo,
                                  k.hi, me.copy_stream);
  if (e == cudaSuccess) {
    e = StreamWriteValue64(me.copy_stream, RingFlags(next) + FlagIndex(i + 1, c), epoch);
  }
  return e;
}

// ReduceScatter, kCopyRing (diagram at the top).  Stage i, chunk c (rows [lo, hi) of the
// partial): D = my send slot i (out at the last stage), C = my receive slot i (i > 0, after
// flag(i, c)); then the copy engine pushes those rows into the right neighbour's receive slot
// i+1 and sets its flag(i+1, c).  SMs only touch local memory.
//
// NOTE: why the slots need no more than epoch parity.  Within a call every slot is written once:
// send slot i by my stage i (read only by my copy engine, after an event on that chunk's GEMM),
// receive slot i by my left neighbour's copy engine (read only by my stage i, after the flag).
// Across calls: my send slots of parity e%2 were last read by my copies of call e-2, which
// the main stream joined before call e-2 returned.  My receive slots of parity e%2 are written
// in call e by the left neighbour's copy engine only after its call e GEMM of that chunk, i.e.
// after it finished call e-1, whose last stage waited (through the ring: left-left's stage
// TP-2, ..., right's stage 1) on my stage 0 of call e-1, which ran after I finished call e-2,
// the last reader of those slots.  And a flag >= e cannot be satisfied early by call e+1: that
// write follows the same chunk's call e copy on the same copy stream.
template <class Sched>
std::string EnqueueRsCopyRing(const Problem& p, int rank, PeerGroup& group, const CallBuffers& b,
                              const CallOptions& o, cudaStream_t stream, Epoch epoch) {
  DeviceState& me = group.dev(rank);
  const int tp = p.tp;
  DeviceState& next = group.dev(Sched::PushTarget(rank, 0, tp));
  const MatrixView pv = p.PartialView();
  const int chunks = RsChunks(p);
  for (int i = 0; i < tp; ++i) {
    for (int c = 0; c < chunks; ++c) {
      const CopyRingChunk k = CopyRingChunkAt(p, me, epoch, i, c, chunks);
      GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
      const int tile = Sched::OutputTile(rank, i, tp);
      SetCopyRingChunkOperands(g.ops, p, b, tile, k);
      if (p.scaling != Scaling::kNone) {
        SetStageScales(g, p, tile, b.x_scale, b.w_scale);
        g.fp8.a_view.offset += k.lo * g.fp8.a_view.ld;  // the chunk's rows (block scales)
      }
      if (i > 0) {
        // The left neighbour's running sum, pushed here.
        SetC(g.ops, k.recv_rows, pv, 1.f);
        SetWait(g.sync, RingFlags(me), i, c, epoch, Sched::Source(rank, i, tp));
      }
      // Chunk GEMMs read x, w and (after its flag) their receive slot, and write their own
      // send-slot or out rows: none reads what the launch before it writes.
      g.sync.overlap_previous = o.overlap_stages && (i > 0 || c > 0);
      if (std::string err = Launch(g, stream, i); !err.empty()) return err;
      if (k.send == nullptr || o.skip_signals) continue;  // the last stage writes out
      // Push this chunk while the next ones compute.  One event suffices: cudaStreamWaitEvent
      // waits for the event's most recent record at the time of the call.
      if (cudaEventRecord(me.stage_done, stream) != cudaSuccess ||
          cudaStreamWaitEvent(me.copy_stream, me.stage_done, 0) != cudaSuccess) {
        return CudaFailure("fork copy stream");
      }
      if (cudaError_t e = PushCopyRingChunk(p, me, next, epoch, i, c, k); e != cudaSuccess) {
        return std::string("push to peer: ") + cudaGetErrorString(e);
      }
    }
  }
  // Our pushes read only workspace slots (parity keeps the next call off them), but join
  // anyway, as the AllGather path does: nothing of this call outlives it on the copy stream.
  if (tp > 1 && (cudaEventRecord(me.join, me.copy_stream) != cudaSuccess ||
                 cudaStreamWaitEvent(stream, me.join, 0) != cudaSuccess)) {
    return CudaFailure("join copy stream");
  }
  return "";
}

// ReduceScatter stage i of tile `tile`: A = my x rows (TilingA) or columns (TilingB) of that
// tile, B = w's matching block, D = the running sum's slot `sum_slot` (pv), or out at the last
// stage.
void SetRsStageOperands(GemmOperands& o, const Problem& p, const CallBuffers& b, int tile,
                        bool last, void* sum_slot) {
  const MatrixView av = p.AView(tile), bv = p.BView(tile);
  SetA(o, At(b.x, av.offset, p.in_type), av);
  SetB(o, At(b.w, bv.offset, p.w_type), bv);
  if (last) {
    const MatrixView ov = p.OutView(tile);
    SetD(o, At(b.out, ov.offset, p.out_type), ov);
  } else {
    SetD(o, sum_slot, p.PartialView());
  }
}

// ReduceScatter, kRemoteC (diagram at the top).  Stage i: D = my slot i (out at the last
// stage); for i > 0, C = the left neighbour's slot i-1, read over NVLink after flag(i), which
// the neighbour's stage i launch sets once its stage i-1 is done.
template <class Sched>
std::string EnqueueRsRemoteC(const Problem& p, int rank, PeerGroup& group, const CallBuffers& b,
                             const CallOptions& o, cudaStream_t stream, Epoch epoch) {
  DeviceState& me = group.dev(rank);
  const int tp = p.tp;
  DeviceState& next = group.dev(Sched::PushTarget(rank, 0, tp));
  DeviceState& prev = group.dev(Sched::Source(rank, 1, tp));
  const MatrixView pv = p.PartialView();
  for (int i = 0; i < tp; ++i) {
    const bool last = i == tp - 1;
    GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
    const int tile = Sched::OutputTile(rank, i, tp);
    SetRsStageOperands(g.ops, p, b, tile, last, last ? nullptr : Slot(me, p, epoch, i));
    if (p.scaling != Scaling::kNone) SetStageScales(g, p, tile, b.x_scale, b.w_scale);
    if (i > 0) {
      SetC(g.ops, Slot(prev, p, epoch, i - 1), pv, 1.f);  // the left neighbour's running sum
      SetWait(g.sync, RingFlags(me), i, 0, epoch, Sched::Source(rank, i, tp));
      if (!o.skip_signals) {
        g.sync.signal_flag = RingFlags(next) + FlagIndex(i, 0);  // my stage i-1 output is done
        g.sync.signal_epoch = epoch;
      }
    }
    if (std::string err = Launch(g, stream, i); !err.empty()) return err;
  }
  return "";
}

// ReduceScatter TilingA by gathering operands (kGather; the index math and its diagram are
// ReduceScatter1D_TilingA_Gather's, cc/schedules/ring_1d.h).  At the call's start device s
// pushes each peer t x_s's rows of t's block (sm x xk, contiguous) and the whole w_s (wk x wn)
// into t's slot, then sets t's flag.  Stage i of device d: A = x_s rows of blk d, B = w_s
// (its own at stage 0, else slot i-1 after flag(i)); C = running sum i-1 (beta 1; stage 0:
// the caller's C, beta); D = running sum i, or out at the last stage.  Bytes per peer: sm*xk +
// wk*wn against the ring's sm*sn per stage, the same at RS 8192,4096,4096 (TP=2), but they
// travel from the call's start, as an AllGather's shard does, instead of behind a stage.
// Slots, flags and epochs as the AllGather path: a push of call e into
// parity e%2 needs the target to have started call e-1 (its stage 1 of call e-1 waited for
// this device's push of e-1), so its reads of call e-2 are done.  The running sums are local.
// NOTE: D is never C, so the tuner's trial launches (which scribble on D) cannot spoil a
// stage's input.
// Stage i reads the sum stage i-1 wrote, so no launch overlaps the previous one.
using RsGatherIndex = ReduceScatter1D_TilingA_Gather;

template <class Sched>
std::string EnqueueRsGather(const Problem& p, int rank, PeerGroup& group, const CallBuffers& b,
                            const CallOptions& o, cudaStream_t stream, Epoch epoch) {
  DeviceState& me = group.dev(rank);
  const int tp = p.tp;
  const size_t x_bytes = static_cast<size_t>(p.sm() * p.xk) * ElemSize(p.in_type);
  const size_t w_bytes = static_cast<size_t>(p.WElems()) * ElemSize(p.w_type);
  const size_t w_at = GatherWOffset(p);  // the w shard's offset in a slot
  const int my_tile = Sched::OutputTile(rank, tp - 1, tp);
  // fp8: the x rows' scales and w's travel after them (GatherXScaleOffset, GatherWScaleOffset).
  const bool scaled = p.scaling != Scaling::kNone;
  const bool block = p.scaling == Scaling::kBlock;
  const size_t xs_bytes = (block ? p.sm() * (p.xk / kScaleBlock) : 1) * sizeof(float);
  const size_t ws_bytes = p.WScaleElems() * sizeof(float);

  // Pushes on the copy stream, after the inputs are ready on the main stream.
  if (cudaEventRecord(me.fork, stream) != cudaSuccess ||
      cudaStreamWaitEvent(me.copy_stream, me.fork, 0) != cudaSuccess) {
    return CudaFailure("fork copy stream");
  }
  for (int i = 1; i < tp && !o.skip_signals; ++i) {
    const int t = RsGatherIndex::PushTarget(rank, i, tp);
    DeviceState& target = group.dev(t);
    uint8_t* dst = GatherSlot(target, p, epoch, i - 1);
    const MatrixView av = p.AView(Sched::OutputTile(t, tp - 1, tp));
    cudaError_t e = cudaMemcpyAsync(dst, At(b.x, av.offset, p.in_type), x_bytes,
                                    cudaMemcpyDeviceToDevice, me.copy_stream);
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(dst + w_at, b.w, w_bytes, cudaMemcpyDeviceToDevice, me.copy_stream);
    }
    if (e == cudaSuccess && scaled) {
      const float* xs = block ? b.x_scale + p.AScaleView(Sched::OutputTile(t, tp - 1, tp)).offset
                              : b.x_scale;
      e = cudaMemcpyAsync(dst + GatherXScaleOffset(p), xs, xs_bytes, cudaMemcpyDeviceToDevice,
                          me.copy_stream);
      if (e == cudaSuccess) {
        e = cudaMemcpyAsync(dst + GatherWScaleOffset(p), b.w_scale, ws_bytes,
                            cudaMemcpyDeviceToDevice, me.copy_stream);
      }
    }
    if (e == cudaSuccess) {
      e = StreamWriteValue64(me.copy_stream, target.flags + FlagIndex(i, 0), epoch);
    }
    if (e != cudaSuccess) return std::string("push to peer: ") + cudaGetErrorString(e);
  }
  if (cudaEventRecord(me.join, me.copy_stream) != cudaSuccess) {
    return CudaFailure("join copy stream");
  }

  const MatrixView av = p.AView(my_tile), bv = p.BView(my_tile), ov = p.OutView(my_tile);
  const MatrixView pv = p.PartialView();
  // Stage i's A, B (its own shard at stage 0, else slot i-1), their scales (fp8) and D
  // (running sum i, or out).
  auto set_stage = [&](GemmLaunch& g, int i) {
    GemmOperands& ops = g.ops;
    if (i == 0) {
      SetA(ops, At(b.x, av.offset, p.in_type), av);
      SetB(ops, At(b.w, bv.offset, p.w_type), bv);
      if (scaled) SetStageScales(g, p, my_tile, b.x_scale, b.w_scale);
    } else {
      const uint8_t* slot = GatherSlot(me, p, epoch, i - 1);
      SetA(ops, slot, MatrixView{0, p.xk, p.sm() * p.xk});
      SetB(ops, slot + w_at, MatrixView{0, bv.ld, 0});
      if (scaled) {
        SetStageScales(g, p, my_tile,
                       reinterpret_cast<const float*>(slot + GatherXScaleOffset(p)),
                       reinterpret_cast<const float*>(slot + GatherWScaleOffset(p)));
        g.fp8.a_view.offset = 0;  // the slot holds the block's rows only
      }
    }
    if (i == tp - 1) {
      SetD(ops, At(b.out, ov.offset, p.out_type), ov);
    } else {
      SetD(ops, GatherSum(me, p, epoch, i), pv);
    }
  };
  for (int i = 0; i < tp; ++i) {
    GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
    set_stage(g, i);
    if (i == 0) {
      if (b.c != nullptr) SetC(g.ops, At(b.c, ov.offset, p.out_type), ov, p.beta);
    } else {
      SetC(g.ops, GatherSum(me, p, epoch, i - 1), pv, 1.f);
      SetWait(g.sync, me.flags, i, 0, epoch, RsGatherIndex::Source(rank, i, tp));
    }
    if (std::string err = Launch(g, stream, i); !err.empty()) return err;
  }
  // XLA may reuse x and w once we return: the pushes that read them must be done by then.
  if (cudaStreamWaitEvent(stream, me.join, 0) != cudaSuccess) return CudaFailure("join");
  return "";
}

template <class Sched>
std::string EnqueueReduceScatterOf(const Problem& p, int rank, PeerGroup& group,
                                 const CallBuffers& b, const CallOptions& o,
                                 cudaStream_t stream, Epoch epoch) {
  const RsPath path = ChooseRsPath(p, o.rs_path);
  group.dev(rank).last_rs_path = path;
  if (path == kRsGather) return EnqueueRsGather<Sched>(p, rank, group, b, o, stream, epoch);
  if (path == kRsCopyRing) return EnqueueRsCopyRing<Sched>(p, rank, group, b, o, stream, epoch);
  return EnqueueRsRemoteC<Sched>(p, rank, group, b, o, stream, epoch);
}

}  // namespace

std::string EnqueueReduceScatter(const Problem& p, int rank, PeerGroup& group,
                                 const CallBuffers& b, const CallOptions& o, cudaStream_t stream,
                                 Epoch epoch) {
  return VisitSchedule(p.schedule, [&](auto sched) -> std::string {
    using S = decltype(sched);
    if constexpr (S::kKind == ScheduleKind::kReduceScatter1D_TilingA_RotatingC ||
                  S::kKind == ScheduleKind::kReduceScatter1D_TilingB_RotatingC) {
      return EnqueueReduceScatterOf<S>(p, rank, group, b, o, stream, epoch);
    } else {
      return "EnqueueReduceScatter: not a ReduceScatter schedule";
    }
  });
}

}  // namespace jax_distgemm::cuda::internal

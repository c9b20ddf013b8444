// AllGather on CUDA: the stage plan of AllGather1D_TilingCD_RotatingA and _RotatingB (index
// math: cc/schedules/ring_1d.h).  Each device pushes its shard into the symmetric workspace
// with the copy engine:
//
//   main stream  : [stage 0: own shard] [stage 1: chunk 0 | chunk 1 ...] ...        <join>
//   copy stream  :  push chunk 0 -> (r-1)%TP, flag(1,0)=e; chunk 1, flag(1,1)=e; ...
//                   push -> (r-2)%TP for its stage 2 ...
//
//   Stage 0 starts at once on the local shard while the copy engine pushes this device's
//   shard into every peer's slot (the peer that needs it soonest first).  With a gathered
//   result (CallBuffers::gathered) the copy stream then copies the own shard into it, and
//   each slot i-1 once stage i's GEMM has marked its wait done (SeenMark): local copies
//   under the stages, before the join.  The shard may travel in chunks, each with its own flag
//   (AgChunks): in the fused grid each tile of stage i waits only for the chunk it reads; with
//   stage launches stage i runs one GEMM per chunk.
#include "cc/cuda/executor_internal.h"

#include <algorithm>

#include "cc/cuda/autotune.h"
#include "cc/cuda/cuda_check.h"
#include "cc/schedules/ring_1d.h"

namespace jax_distgemm::cuda::internal {
namespace {

// Chunks the rotating shard travels in (CallOptions::ag_chunks overrides).  Stage launches
// (`fused` false): 1; splitting a stage into per-chunk GEMMs costs more than the earlier start
// gains.  Fused grid: 2 where the push lasts about as long as stage 0, so that tiles of the
// shard's first half need not wait for the second: the ratio of push to stage time is about
// 1650 / (the stage's n for RotatingA, m for RotatingB), and from 0.6 on CTAs wait for it.
int AgChunks(const Problem& p, const CallOptions& o, bool fused) {
  const bool rot_a = p.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  // Chunks are row blocks of x (RotatingA) or column blocks of w (RotatingB) of one batch;
  // fp8 shards travel whole, their scales after them.
  if (p.tp == 1 || p.batch != 1 || (!rot_a && p.w_batched) || p.scaling != Scaling::kNone) {
    return 1;
  }
  int asked = o.ag_chunks;
  if (asked <= 0) asked = fused && 1650.0 / static_cast<double>(rot_a ? p.sn() : p.sm()) >= 0.6
                              ? 2 : 1;
  if (asked <= 1) return 1;
  const int64_t extent = rot_a ? p.xm : p.wn;
  const int want = std::min(asked, kMaxChunks);
  // Keep chunks whole tiles (256 rows or columns) so the split costs no partial tiles, and
  // none empty (ChunkRange rounds chunk sizes up to 128).
  return NonEmptyChunks(extent, static_cast<int>(std::clamp<int64_t>(extent / 256, 1, want)));
}

// Copies rank `src`'s shard (packed, as pushed) into its block of the gathered result
// (Problem::GatheredRows / GatheredWidth): one copy where the block is contiguous (one row, or
// TP = 1: the result is the shard), else a 2-D copy.
cudaError_t CopyIntoGathered(const Problem& p, int src, const void* shard, void* gathered,
                             cudaStream_t stream) {
  const size_t esz = ElemSize(p.in_type);
  const size_t width = static_cast<size_t>(p.GatheredWidth()) * esz;
  const size_t pitch = width * p.tp;
  const int64_t rows = p.GatheredRows();
  uint8_t* d = static_cast<uint8_t*>(gathered) + src * width;
  const uint8_t* s = static_cast<const uint8_t*>(shard);
  if (rows == 1 || p.tp == 1) {
    return cudaMemcpyAsync(d, s, width * rows, cudaMemcpyDeviceToDevice, stream);
  }
  if (pitch <= static_cast<size_t>(INT32_MAX)) {  // cudaMemcpy2D's pitch limit (memPitch)
    return cudaMemcpy2DAsync(d, pitch, s, width, width, rows, cudaMemcpyDeviceToDevice, stream);
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (cudaError_t e = cudaMemcpyAsync(d + r * pitch, s + r * width, width,
                                        cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

// AllGather with a gathered result, on the copy stream after the pushes and the stage GEMMs
// are enqueued: the own shard, then each slot i-1 after stage i's mark of chunk `chunks`-1
// (its GEMM waited for that chunk, the last to land: chunks travel in order).
// NOTE: the stream waits on marks of our own grids, whose flag waits are bounded (and mark
// even after a timeout), never on a peer's flag: a dead peer cannot hang the copy stream.
template <class Sched>
std::string CopyGathered(const Problem& p, int rank, DeviceState& me, const void* shard,
                         void* gathered, int chunks, Epoch epoch, const uint32_t* gate) {
  if (gate != nullptr) {
    if (cudaError_t e = StreamWaitValue32(me.copy_stream, gate, 1); e != cudaSuccess) {
      return CudaError("copy gate", e);
    }
  }
  if (cudaError_t e = CopyIntoGathered(p, rank, shard, gathered, me.copy_stream);
      e != cudaSuccess) {
    return CudaError("copy own shard into gathered", e);
  }
  for (int i = 1; i < p.tp; ++i) {
    cudaError_t e = StreamWaitValue64(me.copy_stream, me.flags + SeenMark(i, chunks - 1), epoch);
    if (e == cudaSuccess) {
      e = CopyIntoGathered(p, Sched::Source(rank, i, p.tp), Slot(me, p, epoch, i - 1), gathered,
                           me.copy_stream);
    }
    if (e != cudaSuccess) return CudaError("copy slot into gathered", e);
  }
  return "";
}

template <class Sched>
std::string EnqueueAllGatherOf(const Problem& p, int rank, PeerGroup& group, const CallBuffers& b,
                             const CallOptions& o, cudaStream_t stream, Epoch epoch) {
  constexpr bool kRotA = Sched::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  DeviceState& me = group.dev(rank);
  const int tp = p.tp;
  const void* shard = kRotA ? b.x : b.w;
  const size_t shard_bytes = (kRotA ? p.XElems() : p.WElems()) * ElemSize(p.in_type);
  const bool fused = o.fuse_stages && tp > 1 && tp <= kMaxFusedStages && p.batch == 1 &&
                     CanFuse(p.in_type, p.out_type);
  const int chunks = AgChunks(p, o, fused);
  const int64_t extent = kRotA ? p.xm : p.wn;  // split dimension of the shard
  const size_t isz = ElemSize(p.in_type);
  const size_t scale_bytes = (kRotA ? p.XScaleElems() : p.WScaleElems()) * sizeof(float);
  const bool gather_out = b.gathered != nullptr && tp > 1;
  if (b.gathered != nullptr && tp == 1) {  // the gathered operand is the shard itself
    if (cudaError_t e = CopyIntoGathered(p, 0, shard, b.gathered, stream); e != cudaSuccess) {
      return CudaError("copy shard into gathered", e);
    }
  }

  // Pushes on the copy stream, after the inputs are ready on the main stream.
  if (tp > 1) {
    if (cudaEventRecord(me.fork, stream) != cudaSuccess ||
        cudaStreamWaitEvent(me.copy_stream, me.fork, 0) != cudaSuccess) {
      return CudaFailure("fork copy stream");
    }
    for (int i = 1; i < tp && !o.skip_signals; ++i) {
      DeviceState& target = group.dev(Sched::PushTarget(rank, i, tp));
      uint8_t* dst = Slot(target, p, epoch, i - 1);
      for (int c = 0; c < chunks; ++c) {
        cudaError_t e;
        if (chunks == 1) {
          e = cudaMemcpyAsync(dst, shard, shard_bytes, cudaMemcpyDeviceToDevice, me.copy_stream);
        } else {
          int64_t lo, hi;
          ChunkRange(extent, chunks, c, &lo, &hi);
          if (kRotA) {  // rows of x: contiguous
            e = cudaMemcpyAsync(dst + lo * p.xk * isz, At(shard, lo * p.xk, p.in_type),
                                (hi - lo) * p.xk * isz, cudaMemcpyDeviceToDevice, me.copy_stream);
          } else {  // columns of w [K, wn]: a 2-D copy
            e = cudaMemcpy2DAsync(dst + lo * isz, p.wn * isz, At(shard, lo, p.in_type),
                                  p.wn * isz, (hi - lo) * isz, p.wk, cudaMemcpyDeviceToDevice,
                                  me.copy_stream);
          }
        }
        if (e == cudaSuccess && p.scaling != Scaling::kNone) {  // (one chunk: AgChunks)
          e = cudaMemcpyAsync(dst + SlotScaleOffset(p), kRotA ? b.x_scale : b.w_scale,
                              scale_bytes, cudaMemcpyDeviceToDevice, me.copy_stream);
        }
        if (e == cudaSuccess) {
          e = StreamWriteValue64(me.copy_stream, target.flags + FlagIndex(i, c), epoch);
        }
        if (e != cudaSuccess) return std::string("push to peer: ") + cudaGetErrorString(e);
      }
    }
  }
  // How the main stream learns that the copy stream's work (the pushes, which read the
  // caller's shard, and any gathered copies) is done: the fused grid waits for kPushDoneFlag
  // before it completes, or an event join at the end (both enqueued below, after the GEMMs).
  // NOTE: with a gathered result always the event.  The grid's wait is bounded, and a call that
  // returned with copies into the caller's buffer still queued would write into memory XLA may
  // already have reused; the event always completes, since the copy stream waits only for this
  // device's own marks, which its grid sets even after a timeout.
  const bool kernel_join = fused && !gather_out;

  if (fused) {
    // All stages in one grid: stage i is batch i of a ptr-array GEMM and waits for its flag in
    // the producer warp (sm90_fused_gemm.cuh).  Every stage has the same shape and pitches.
    GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
    FusedStages& f = g.fused;
    f.count = tp;
    f.table = FusedTable(me, epoch);
    for (int i = 0; i < tp; ++i) {
      const int tile = Sched::OutputTile(rank, i, tp);
      const MatrixView av = p.AView(tile), bv = p.BView(tile), ov = p.OutView(tile);
      const void* rotating = i == 0 ? shard : Slot(me, p, epoch, i - 1);
      SetA(g.ops, kRotA ? rotating : At(b.x, av.offset, p.in_type), av);
      SetB(g.ops, kRotA ? At(b.w, bv.offset, p.in_type) : rotating, bv);
      SetD(g.ops, At(b.out, ov.offset, p.out_type), ov);
      if (b.c != nullptr) SetC(g.ops, At(b.c, ov.offset, p.out_type), ov, p.beta);
      f.a[i] = g.ops.a;
      f.b[i] = g.ops.b;
      f.c[i] = g.ops.c;
      f.d[i] = g.ops.d;
      if (i > 0) {
        f.wait_flag[i] = me.flags + FlagIndex(i, 0);
        f.peer[i] = Sched::Source(rank, i, tp);
        if (gather_out) f.seen_flag[i] = me.flags + SeenMark(i, 0);
      }
    }
    if (kernel_join) f.exit_wait_flag = me.flags + kPushDoneFlag;
    if (chunks > 1) {  // each tile waits for the chunk of the shard it reads (FlagWaitMainloop)
      int64_t lo, hi;
      ChunkRange(extent, chunks, 0, &lo, &hi);
      f.shard_chunks = chunks;
      f.shard_dim = kRotA ? 0 : 1;
      f.shard_chunk_size = hi - lo;
      f.shard_extent = extent;
    }
    g.sync.wait_epoch = epoch;
    if (std::string err = Launch(g, stream, 0); !err.empty()) return err;
  } else {
    for (int i = 0; i < tp; ++i) {
      const int tile = Sched::OutputTile(rank, i, tp);
      const MatrixView av = p.AView(tile), bv = p.BView(tile), ov = p.OutView(tile);
      const void* rotating = i == 0 ? shard : Slot(me, p, epoch, i - 1);
      const int n_chunks = i == 0 ? 1 : chunks;
      for (int c = 0; c < n_chunks; ++c) {
        int64_t lo = 0, hi = extent;
        if (n_chunks > 1) ChunkRange(extent, n_chunks, c, &lo, &hi);
        GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
        // The chunk is a row block of A and D (RotatingA) or a column block of B and D
        // (RotatingB).
        const int64_t a_off = kRotA ? lo * p.xk : 0, b_off = kRotA ? 0 : lo;
        const int64_t d_off = kRotA ? lo * ov.ld : lo;
        if (kRotA) g.ops.m = hi - lo; else g.ops.n = hi - lo;
        SetA(g.ops, kRotA ? At(rotating, a_off, p.in_type) : At(b.x, av.offset, p.in_type), av);
        SetB(g.ops, kRotA ? At(b.w, bv.offset, p.w_type) : At(rotating, b_off, p.w_type), bv);
        SetD(g.ops, At(b.out, ov.offset + d_off, p.out_type), ov);
        if (b.c != nullptr) SetC(g.ops, At(b.c, ov.offset + d_off, p.out_type), ov, p.beta);
        if (p.scaling != Scaling::kNone) {  // the rotating shard's scales came with it
          const float* rot = i == 0 ? (kRotA ? b.x_scale : b.w_scale)
                                    : reinterpret_cast<const float*>(
                                          Slot(me, p, epoch, i - 1) + SlotScaleOffset(p));
          SetStageScales(g, p, tile, kRotA ? rot : b.x_scale, kRotA ? b.w_scale : rot);
        }
        if (i > 0) {
          SetWait(g.sync, me.flags, i, c, epoch, Sched::Source(rank, i, tp));
          if (gather_out) g.sync.seen_flag = me.flags + SeenMark(i, c);
        }
        // Every launch after the call's first writes its own rows or columns of out and reads
        // x, w and peers' slots only: it may run into the previous launch's tail.
        g.sync.overlap_previous = o.overlap_stages && (i > 0 || c > 0);
        if (std::string err = Launch(g, stream, i); !err.empty()) return err;
      }
    }
  }
  if (tp > 1) {
    // After the GEMMs' enqueue: CopyGathered waits for their marks.
    if (gather_out) {
      if (std::string err = CopyGathered<Sched>(p, rank, me, shard, b.gathered, chunks, epoch,
                                                o.copy_gate);
          !err.empty()) {
        return err;
      }
    }
    cudaError_t e = cudaSuccess;
    if (!kernel_join) {
      e = cudaEventRecord(me.join, me.copy_stream);
    } else if (!o.skip_push_done) {  // (the fault hook skips the mark)
      e = StreamWriteValue64(me.copy_stream, me.flags + kPushDoneFlag, epoch);
    }
    if (e != cudaSuccess) return CudaError("join copy stream", e);
  }
  // XLA may reuse the shard's buffer once we return: the pushes must be done by then.
  if (tp > 1 && !kernel_join && cudaStreamWaitEvent(stream, me.join, 0) != cudaSuccess) {
    return CudaFailure("join");
  }
  return "";
}

}  // namespace

std::string EnqueueAllGather(const Problem& p, int rank, PeerGroup& group, const CallBuffers& b,
                             const CallOptions& o, cudaStream_t stream, Epoch epoch) {
  return VisitSchedule(p.schedule, [&](auto sched) -> std::string {
    using S = decltype(sched);
    if constexpr (S::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingA ||
                  S::kKind == ScheduleKind::kAllGather1D_TilingCD_RotatingB) {
      return EnqueueAllGatherOf<S>(p, rank, group, b, o, stream, epoch);
    } else {
      return "EnqueueAllGather: not an AllGather schedule";
    }
  });
}

}  // namespace jax_distgemm::cuda::internal

// Stage plans of the four schedules on CUDA (see cc/schedules/ring_1d.h for the index math).
//
// AllGather (push into the symmetric workspace, copy engine):
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
//
// ReduceScatter (ring; the running sum of stage i feeds the right neighbour's stage i+1):
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
//
// Slots are indexed [parity][slot] with parity = epoch % 2 (peer_state.h explains why that
// suffices without a trailing barrier; EnqueueRsCopyRing repeats the argument for its slots).
#include "cc/cuda/executor.h"

#include <algorithm>
#include <sstream>

#include "cc/cuda/autotune.h"
#include "cc/cuda/cuda_check.h"
#include "cc/cuda/gemm_kernels.h"
#include "cc/schedules/ring_1d.h"

namespace jax_distgemm::cuda {
namespace {

// kCopyRing: where stage i's running sum is written (i < TP-1) and received (i >= 1).
int RsSendSlot(int i) { return i; }
int RsRecvSlot(const Problem& p, int i) { return p.tp - 1 + (i - 1); }

// NOTE: parity p's slots start at p * (half the allocated workspace), not at an offset that
// depends on this call's slot size: with shape-dependent offsets, call e (parity 0) of a larger
// shape could overlap call e-1's parity-1 slots, which a slow peer may still read.  Every member
// holds the same workspace size (same history), so both sides agree on the halves.
uint8_t* ParityBase(DeviceState& d, uint32_t epoch) {
  const size_t half = (d.workspace_bytes / 2) / kSlotAlign * kSlotAlign;
  return d.workspace + static_cast<size_t>(epoch & 1u) * half;
}
uint8_t* Slot(DeviceState& d, const Problem& p, uint32_t epoch, int index) {
  return ParityBase(d, epoch) + static_cast<size_t>(index) * SlotBytes(p);
}

// kGather: the slot that holds source `index + 1`'s operands (stage index + 1), and running sum j.
uint8_t* GatherSlot(DeviceState& d, const Problem& p, uint32_t epoch, int index) {
  return ParityBase(d, epoch) + static_cast<size_t>(index) * GatherSlotBytes(p);
}
uint8_t* GatherSum(DeviceState& d, const Problem& p, uint32_t epoch, int j) {
  return ParityBase(d, epoch) + (p.tp - 1) * GatherSlotBytes(p) + j * GatherSumBytes(p);
}

const uint8_t* At(const void* base, int64_t elem_offset, ElemType t) {
  return static_cast<const uint8_t*>(base) + elem_offset * ElemSize(t);
}

// Operand setters: the first element, with the leading dimension and batch stride of `v`
// (whose offset the caller has already applied).
void SetA(GemmOperands& o, const void* first, const MatrixView& v) {
  o.a = first;
  o.lda = v.ld;
  o.batch_stride_a = v.batch_stride;
}
void SetB(GemmOperands& o, const void* first, const MatrixView& v) {
  o.b = first;
  o.ldb = v.ld;
  o.batch_stride_b = v.batch_stride;
}
void SetC(GemmOperands& o, const void* first, const MatrixView& v, float beta) {
  o.c = first;
  o.ldc = v.ld;
  o.batch_stride_c = v.batch_stride;
  o.beta = beta;
}
void SetD(GemmOperands& o, const void* first, const MatrixView& v) {
  o.d = const_cast<void*>(first);
  o.ldd = v.ld;
  o.batch_stride_d = v.batch_stride;
}

// The launch waits (StageSync) for stage `stage`, chunk `chunk` of call `epoch` to land in
// this device's slots, on this device's flag row `flags` (me.flags, or RingFlags(me) for a
// ReduceScatter ring); `peer` is the rank that delivers it (named if the wait times out).
void SetWait(StageSync& s, const uint32_t* flags, int stage, int chunk, uint32_t epoch,
             int peer) {
  s.wait_flag = flags + FlagIndex(stage, chunk);
  s.wait_epoch = epoch;
  s.stage = stage;
  s.peer = peer;
}

// GEMM scratch: [CUTLASS workspace | pointer table x 2].  The fused grid's pointer tables
// (FusedStages::table) alternate by call parity.
constexpr size_t kFusedTableBytes = kFusedTableEntries * sizeof(void*);
constexpr size_t kCutlassWorkspaceBytes = PeerGroup::kGemmScratchBytes - 2 * kFusedTableBytes;
void** FusedTable(const DeviceState& d, uint32_t epoch) {
  return reinterpret_cast<void**>(static_cast<uint8_t*>(d.gemm_scratch) +
                                  kCutlassWorkspaceBytes + (epoch & 1u) * kFusedTableBytes);
}

// [begin, end) of chunk c of `extent` split in `chunks`, aligned to 128.
void ChunkRange(int64_t extent, int chunks, int c, int64_t* begin, int64_t* end) {
  const int64_t size = RoundUp(static_cast<size_t>((extent + chunks - 1) / chunks), 128);
  *begin = std::min<int64_t>(extent, c * size);
  *end = c == chunks - 1 ? extent : std::min<int64_t>(extent, (c + 1) * size);
}

// The largest n <= want (and >= 1) for which no chunk of ChunkRange(extent, n, .) is empty: the
// 128-row rounding can leave the last chunk empty (extent 640 in 4: 256, 256, 128, 0).
int NonEmptyChunks(int64_t extent, int want) {
  int n = std::max(want, 1);
  while (n > 1) {
    int64_t lo, hi;
    ChunkRange(extent, n, n - 1, &lo, &hi);
    if (lo < hi) break;
    --n;
  }
  return n;
}

// Chunks the rotating shard travels in (CallOptions::ag_chunks overrides).  Stage launches
// (`fused` false): 1; splitting a stage into per-chunk GEMMs costs more than the earlier start
// gains.  Fused grid: 2 where the push lasts about as long as stage 0, so that tiles of the
// shard's first half need not wait for the second: the ratio of push to stage time is about
// 1650 / (the stage's n for RotatingA, m for RotatingB), and from 0.6 on CTAs wait for it.
int AgChunks(const Problem& p, const CallOptions& o, bool fused) {
  const bool rot_a = p.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  // Chunks are row blocks of x (RotatingA) or column blocks of w (RotatingB) of one batch.
  if (p.tp == 1 || p.batch != 1 || (!rot_a && p.w_batched)) return 1;
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

// Tunes (first use of a shape) and enqueues one stage GEMM.
std::string Launch(GemmLaunch& g, cudaStream_t stream, int stage) {
  if (std::string err = ChooseConfig(g, stream); !err.empty()) return err;
  if (GemmWorkspaceBytes(g) > kCutlassWorkspaceBytes) {
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

// The failure of the last CUDA call, named after what it was doing.
std::string CudaFailure(const char* what) { return CudaError(what, cudaGetLastError()); }

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
                         void* gathered, int chunks, uint32_t epoch) {
  if (cudaError_t e = CopyIntoGathered(p, rank, shard, gathered, me.copy_stream);
      e != cudaSuccess) {
    return CudaError("copy own shard into gathered", e);
  }
  for (int i = 1; i < p.tp; ++i) {
    cudaError_t e = StreamWaitValue32(me.copy_stream, me.flags + SeenMark(i, chunks - 1), epoch);
    if (e == cudaSuccess) {
      e = CopyIntoGathered(p, Sched::Source(rank, i, p.tp), Slot(me, p, epoch, i - 1), gathered,
                           me.copy_stream);
    }
    if (e != cudaSuccess) return CudaError("copy slot into gathered", e);
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
  const bool fused = o.fuse_stages && tp > 1 && tp <= kMaxFusedStages && p.batch == 1 &&
                     CanFuse(p.in_type, p.out_type);
  const int chunks = AgChunks(p, o, fused);
  const int64_t extent = kRotA ? p.xm : p.wn;  // split dimension of the shard
  const size_t isz = ElemSize(p.in_type);
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
        if (e == cudaSuccess) {
          e = StreamWriteValue32(me.copy_stream, target.flags + FlagIndex(i, c), epoch);
        }
        if (e != cudaSuccess) return std::string("push to peer: ") + cudaGetErrorString(e);
      }
    }
  }
  // How the main stream learns that the copy stream's work (the pushes, which read the
  // caller's shard, and any gathered copies) is done: the fused grid waits for kPushDoneFlag
  // before it completes, or an event join at the end (both enqueued below, after the GEMMs).
  const bool kernel_join = fused;

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
        SetB(g.ops, kRotA ? At(b.w, bv.offset, p.in_type) : At(rotating, b_off, p.in_type), bv);
        SetD(g.ops, At(b.out, ov.offset + d_off, p.out_type), ov);
        if (b.c != nullptr) SetC(g.ops, At(b.c, ov.offset + d_off, p.out_type), ov, p.beta);
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
      if (std::string err = CopyGathered<Sched>(p, rank, me, shard, b.gathered, chunks, epoch);
          !err.empty()) {
        return err;
      }
    }
    cudaError_t e = cudaSuccess;
    if (!kernel_join) {
      e = cudaEventRecord(me.join, me.copy_stream);
    } else if (!o.skip_push_done) {  // (the fault hook skips the mark)
      e = StreamWriteValue32(me.copy_stream, me.flags + kPushDoneFlag, epoch);
    }
    if (e != cudaSuccess) return CudaError("join copy stream", e);
  }
  // XLA may reuse the shard's buffer once we return: the pushes must be done by then.
  if (tp > 1 && !kernel_join && cudaStreamWaitEvent(stream, me.join, 0) != cudaSuccess) {
    return CudaFailure("join");
  }
  return "";
}

// kCopyRing, stage i chunk c of `chunks`: rows [lo, hi) of the running sum, the send slot its
// GEMM writes (nullptr at the last stage, which writes out) and the receive-slot rows it reads
// as C (nullptr at stage 0: no running sum yet).
struct CopyRingChunk {
  int64_t lo = 0, hi = 0;
  uint8_t* send = nullptr;
  const uint8_t* recv_rows = nullptr;
};
CopyRingChunk CopyRingChunkAt(const Problem& p, DeviceState& me, uint32_t epoch, int i, int c,
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
  SetB(o, At(b.w, bv.offset, p.in_type), bv);
  if (k.send == nullptr) {
    SetD(o, At(b.out, ov.offset + k.lo * ov.ld, p.out_type), ov);
  } else {
    SetD(o, k.send + k.lo * pv.ld * ElemSize(p.out_type), pv);
  }
}

// kCopyRing: after my stage i's GEMM of chunk c (stream order on `copy`), push its rows from my
// send slot into `next`'s receive slot i+1 and set its flag(i+1, c).
cudaError_t PushCopyRingChunk(const Problem& p, DeviceState& me, DeviceState& next,
                              uint32_t epoch, int i, int c, const CopyRingChunk& k) {
  cudaError_t e = CopyPartialRows(p, Slot(next, p, epoch, RsRecvSlot(p, i + 1)), k.send, k.lo,
                                  k.hi, me.copy_stream);
  if (e == cudaSuccess) {
    e = StreamWriteValue32(me.copy_stream, RingFlags(next) + FlagIndex(i + 1, c), epoch);
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
                              const CallOptions& o, cudaStream_t stream, uint32_t epoch) {
  DeviceState& me = group.dev(rank);
  const int tp = p.tp;
  DeviceState& next = group.dev(Sched::PushTarget(rank, 0, tp));
  const MatrixView pv = p.PartialView();
  const int chunks = RsChunks(p);
  for (int i = 0; i < tp; ++i) {
    for (int c = 0; c < chunks; ++c) {
      const CopyRingChunk k = CopyRingChunkAt(p, me, epoch, i, c, chunks);
      GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
      SetCopyRingChunkOperands(g.ops, p, b, Sched::OutputTile(rank, i, tp), k);
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
  SetB(o, At(b.w, bv.offset, p.in_type), bv);
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
                             const CallOptions& o, cudaStream_t stream, uint32_t epoch) {
  DeviceState& me = group.dev(rank);
  const int tp = p.tp;
  DeviceState& next = group.dev(Sched::PushTarget(rank, 0, tp));
  DeviceState& prev = group.dev(Sched::Source(rank, 1, tp));
  const MatrixView pv = p.PartialView();
  for (int i = 0; i < tp; ++i) {
    const bool last = i == tp - 1;
    GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
    SetRsStageOperands(g.ops, p, b, Sched::OutputTile(rank, i, tp), last,
                       last ? nullptr : Slot(me, p, epoch, i));
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
                            const CallOptions& o, cudaStream_t stream, uint32_t epoch) {
  DeviceState& me = group.dev(rank);
  const int tp = p.tp;
  const size_t isz = ElemSize(p.in_type);
  const size_t x_bytes = static_cast<size_t>(p.sm() * p.xk) * isz;
  const size_t w_bytes = static_cast<size_t>(p.WElems()) * isz;
  const size_t w_at = GatherWOffset(p);  // the w shard's offset in a slot
  const int my_tile = Sched::OutputTile(rank, tp - 1, tp);

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
    if (e == cudaSuccess) {
      e = StreamWriteValue32(me.copy_stream, target.flags + FlagIndex(i, 0), epoch);
    }
    if (e != cudaSuccess) return std::string("push to peer: ") + cudaGetErrorString(e);
  }
  if (cudaEventRecord(me.join, me.copy_stream) != cudaSuccess) {
    return CudaFailure("join copy stream");
  }

  const MatrixView av = p.AView(my_tile), bv = p.BView(my_tile), ov = p.OutView(my_tile);
  const MatrixView pv = p.PartialView();
  // Stage i's A, B (its own shard at stage 0, else slot i-1) and D (running sum i, or out).
  auto set_stage = [&](GemmOperands& ops, int i) {
    if (i == 0) {
      SetA(ops, At(b.x, av.offset, p.in_type), av);
      SetB(ops, At(b.w, bv.offset, p.in_type), bv);
    } else {
      const uint8_t* slot = GatherSlot(me, p, epoch, i - 1);
      SetA(ops, slot, MatrixView{0, p.xk, p.sm() * p.xk});
      SetB(ops, slot + w_at, MatrixView{0, p.wn, 0});
    }
    if (i == tp - 1) {
      SetD(ops, At(b.out, ov.offset, p.out_type), ov);
    } else {
      SetD(ops, GatherSum(me, p, epoch, i), pv);
    }
  };
  for (int i = 0; i < tp; ++i) {
    GemmLaunch g = BaseLaunch(p, me, o, group.error(), rank);
    set_stage(g.ops, i);
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
std::string EnqueueReduceScatter(const Problem& p, int rank, PeerGroup& group,
                                 const CallBuffers& b, const CallOptions& o,
                                 cudaStream_t stream, uint32_t epoch) {
  const RsPath path = ChooseRsPath(p, o.rs_path);
  group.dev(rank).last_rs_path = path;
  if (path == kRsGather) return EnqueueRsGather<Sched>(p, rank, group, b, o, stream, epoch);
  if (path == kRsCopyRing) return EnqueueRsCopyRing<Sched>(p, rank, group, b, o, stream, epoch);
  return EnqueueRsRemoteC<Sched>(p, rank, group, b, o, stream, epoch);
}

}  // namespace

std::string EnqueueDistGemm(const Problem& p, int rank, PeerGroup& group,
                            const CallBuffers& buffers, const CallOptions& options,
                            cudaStream_t stream) {
  // NOTE: a member whose workspace growth failed in an earlier call (cudaMalloc, while the
  // others' succeeded; or, across processes, a setup that timed out after the peers' unmapping)
  // holds less than this call needs, or none: pushes and remote stores into it would hit a
  // null or short address.  Fail before anything is enqueued (no epoch taken).
  const size_t need = WorkspaceBytes(p, options.rs_path);
  for (int q = 0; q < group.tp(); ++q) {
    const DeviceState& d = group.dev(q);
    if (d.workspace_bytes < need) {
      std::ostringstream m;
      m << "the symmetric workspace of device " << d.id << " holds " << d.workspace_bytes
        << " bytes, this call needs " << need << " (its allocation, or the group's setup, failed "
        << "in an earlier call); the group cannot run calls this large in this process";
      return m.str();
    }
  }
  const uint32_t epoch = ++group.dev(rank).epoch;
  if (options.poison_output) {
    // 0xFF bytes are NaN in bfloat16, float16 and float32 alike.
    const size_t bytes = static_cast<size_t>(p.OutElems()) * ElemSize(p.out_type);
    if (cudaMemsetAsync(buffers.out, 0xFF, bytes, stream) != cudaSuccess) {
      return CudaFailure("poison");
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

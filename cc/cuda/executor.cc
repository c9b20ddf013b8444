// The CUDA executor's entry point: one call of a schedule on one device.  The stage plans are
// all_gather.cc and reduce_scatter.cc (the index math is cc/schedules/ring_1d.h, the slots and
// the path choice cc/common/workspace.h, the kernels sm90_gemm.cuh and sm90_fused_gemm.cuh,
// the FFI binding distgemm_cuda.cc); here are the launches they share and the dispatch.
#include "cc/cuda/executor.h"

#include <algorithm>
#include <sstream>

#include "cc/cuda/autotune.h"
#include "cc/cuda/cuda_check.h"
#include "cc/cuda/executor_internal.h"
#include "cc/cuda/fp8_gemm.h"

namespace jax_distgemm::cuda {
namespace internal {

// GEMM scratch: [CUTLASS workspace | pointer table x 2].  The fused grid's pointer tables
// (FusedStages::table) alternate by call parity.
namespace {
constexpr size_t kFusedTableBytes = kFusedTableEntries * sizeof(void*);
constexpr size_t kCutlassWorkspaceBytes = PeerGroup::kGemmScratchBytes - 2 * kFusedTableBytes;
}  // namespace

void** FusedTable(const DeviceState& d, Epoch epoch) {
  return reinterpret_cast<void**>(static_cast<uint8_t*>(d.gemm_scratch) +
                                  kCutlassWorkspaceBytes + (epoch & 1u) * kFusedTableBytes);
}

void ChunkRange(int64_t extent, int chunks, int c, int64_t* begin, int64_t* end) {
  const int64_t size = RoundUp(static_cast<size_t>((extent + chunks - 1) / chunks), 128);
  *begin = std::min<int64_t>(extent, c * size);
  *end = c == chunks - 1 ? extent : std::min<int64_t>(extent, (c + 1) * size);
}

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

namespace {

Fp8Type ToFp8Type(ElemType t) { return t == ElemType::kF8E5M2 ? Fp8Type::kE5M2 : Fp8Type::kE4M3; }

// An fp8 stage: the launch as fp8_gemm.h's, on the config Fp8PickConfig picks (no tuning).
std::string LaunchFp8Stage(const GemmLaunch& g, cudaStream_t stream) {
  Fp8GemmLaunch f;
  f.scaling = g.fp8.scaling == Scaling::kBlock ? Fp8Scaling::kBlock : Fp8Scaling::kTensor;
  f.a_type = ToFp8Type(g.ab_type);
  f.b_type = ToFp8Type(g.fp8.b_type);
  f.d_type = g.d_type;
  Fp8Config configs[kNumFp8Configs];
  const int count = Fp8AvailableConfigs(f.scaling, f.a_type, f.b_type, f.d_type,
                                        g.ops.c != nullptr, configs, kNumFp8Configs);
  if (count == 0) {
    return std::string("no ") + Fp8ScalingName(f.scaling) + " fp8 stage GEMM is compiled for " +
           ElemName(g.ab_type) + " x " + ElemName(g.fp8.b_type) + " -> " + ElemName(g.d_type);
  }
  f.config = Fp8PickConfig(f.scaling, configs, count, g.ops.m, g.ops.n, g.ops.batch,
                           g.sm_count);
  const GemmOperands& o = g.ops;
  Fp8GemmOperands& q = f.ops;
  q.m = o.m, q.n = o.n, q.k = o.k, q.batch = o.batch;
  q.a = o.a, q.lda = o.lda, q.batch_stride_a = o.batch_stride_a;
  q.b = o.b, q.ldb = o.ldb, q.batch_stride_b = o.batch_stride_b;
  q.c = o.c, q.ldc = o.ldc, q.batch_stride_c = o.batch_stride_c;
  q.d = o.d, q.ldd = o.ldd, q.batch_stride_d = o.batch_stride_d;
  q.alpha = o.alpha, q.beta = o.beta;
  if (f.scaling == Fp8Scaling::kTensor) {
    q.scale_a = g.fp8.a;
    q.scale_b = g.fp8.b;
  } else {
    q.sfa = g.fp8.a + g.fp8.a_view.offset;
    q.ld_sfa = g.fp8.a_view.ld;
    q.batch_stride_sfa = g.fp8.a_view.batch_stride;
    q.sfb = g.fp8.b + g.fp8.b_view.offset;
    q.ld_sfb = g.fp8.b_view.ld;
    q.batch_stride_sfb = g.fp8.b_view.batch_stride;
  }
  f.sync = g.sync;
  f.device = g.device;
  f.sm_count = g.sm_count;
  f.pdl = g.pdl;
  f.workspace = g.workspace;
  if (Fp8GemmWorkspaceBytes(f) > kCutlassWorkspaceBytes) {
    return "fp8 stage GEMM needs more CUTLASS workspace than reserved";
  }
  return LaunchFp8Gemm(f, stream);
}

}  // namespace

void SetStageScales(GemmLaunch& g, const Problem& p, int tile, const float* a, const float* b) {
  g.fp8.scaling = p.scaling;
  g.fp8.b_type = p.w_type;
  g.fp8.a = a;
  g.fp8.b = b;
  if (p.scaling == Scaling::kBlock) {
    g.fp8.a_view = p.AScaleView(tile);
    g.fp8.b_view = p.BScaleView(tile);
  }
}

std::string Launch(GemmLaunch& g, cudaStream_t stream, int stage) {
  std::string err;
  if (IsFp8(g.ab_type)) {
    err = LaunchFp8Stage(g, stream);
  } else {
    if (std::string e = ChooseConfig(g, stream); !e.empty()) return e;
    if (GemmWorkspaceBytes(g) > kCutlassWorkspaceBytes) {
      return "stage GEMM needs more CUTLASS workspace than reserved";
    }
    err = LaunchGemm(g, stream);
  }
  if (!err.empty()) {
    std::ostringstream m;
    m << "stage " << stage << ": " << err;
    return m.str();
  }
  return "";
}

std::string CudaFailure(const char* what) { return CudaError(what, cudaGetLastError()); }

}  // namespace internal

std::string EnqueueDistGemm(const Problem& p, int rank, PeerGroup& group,
                            const CallBuffers& buffers, const CallOptions& options,
                            cudaStream_t stream) {
  // NOTE: a member whose workspace growth failed in an earlier call (cudaMalloc, while the
  // others' succeeded; or, across processes, a setup that timed out after the peers' unmapping)
  // holds less than this call needs, or none: pushes into it and reads of it would hit a
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
  const Epoch epoch = ++group.dev(rank).epoch;
  if (options.poison_output) {
    // 0xFF bytes are NaN in bfloat16, float16 and float32 alike.
    const size_t bytes = static_cast<size_t>(p.OutElems()) * ElemSize(p.out_type);
    if (cudaMemsetAsync(buffers.out, 0xFF, bytes, stream) != cudaSuccess) {
      return internal::CudaFailure("poison");
    }
  }
  // fp8 wgmma reads B K-major: an fp8 w (and its block scales) arrives transposed in memory
  // (CallBuffers), so every view of w, and a RotatingB shard in its slot, is [wn, wk].
  Problem q = p;
  q.w_k_major = p.scaling != Scaling::kNone;
  if (IsAllGather(q.schedule)) {
    return internal::EnqueueAllGather(q, rank, group, buffers, options, stream, epoch);
  }
  return internal::EnqueueReduceScatter(q, rank, group, buffers, options, stream, epoch);
}

}  // namespace jax_distgemm::cuda

// Test program, not part of the package: the CUDA executor at any TP from 2 to 8 on ONE GPU,
// every rank of the group a "virtual device" on the same ordinal.  Checks every schedule and
// data path against a naive fp32 GEMM on the same GPU, over several calls (both parities,
// rising epochs).
// AllGather cases with a gathered result check it bit-exactly against the shards.
//
// What it exercises: the executor's index math, slot and flag traffic, epochs, fused grids and
// copy-engine pushes at TP > 2, which the lent two-GPU machines cannot reach (the CPU suite runs
// the schedules at TP=4/8 on another executor).  What it does not: NVLink, peer access between
// GPUs, timing.  The ranks share one GPU's SMs, so each rank's persistent grids are capped to
// 132 / (2 TP) SMs (DeviceState::sm_count), and every launch waits for the previous one
// (CallOptions::overlap_stages off), which keeps every rank's grids resident at once: our
// kernels spin on flags that other ranks' grids and copies set.
//
// NOTE: set before the CUDA context exists: CUDA_DEVICE_MAX_CONNECTIONS=32 (main does), so
// that the group's 2 TP streams (each rank's main and copy stream, created in that order, 16 at
// TP=8) land on distinct hardware queues: CUDA assigns queues round-robin in creation order,
// and a queue shared with a rank whose grid spins on a flag would hold up the copy that sets it
// (with 8 or 4 queues TP=8 runs stall).
//
//   cmake -S . -B build -DJAX_DISTGEMM_BUILD_TESTS=ON && ninja -C build virtual_group_check
//   build/virtual_group_check [--tp 4] [--m 2048 --n 2048 --k 1024] [--calls 3]
//       [--batch L] [--f16 1] [--out-f32 1] [--timeout-ms 3000] [--case I] [--verbose 1]
//       [--control 1] [--fault 1 [--start-epoch E | --late-peer 1 | --hold-copies 1]]
//       [--group-per-case 1] [--sequence 1] [--max-lead 2] [--fp8 tensor|block]
//       [--progress 1] [--deadline-s S]
// Prints one line per (schedule, path) and "ALL OK" / "FAILED"; exit status 0 / 1.
// --sequence 1: instead, every case once per round (--calls rounds), all enqueued back to back
// by each rank with no synchronization between calls, then every call checked (RunSequence).
// --fault 1: rank 0 never pushes (CallOptions::skip_signals) in the "+gathered" cases; each
// passes if every rank returns (no hang: the copy stream's waits on its own grid's marks must
// end, all_gather.cc CopyGathered) and ranks 1..TP-1 report the peer timeout.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cc/common/problem.h"
#include "cc/common/workspace.h"
#include "cc/cuda/copy_stream.h"
#include "cc/cuda/executor.h"
#include "cc/cuda/peer_state.h"
#include "tests/cuda/fp8_transpose.h"

namespace jdg = jax_distgemm;
namespace jc = jax_distgemm::cuda;
using jdg::ScheduleKind;

namespace {

// The run's types and batch (--f16, --out-f32, --batch): inputs bf16 or f16, output the inputs'
// type or f32, x and out with L batches, w shared across them.
bool g_f16 = false;
bool g_out_f32 = false;
int64_t g_batch = 1;
// --fp8 tensor|block: x and w float8_e4m3fn with their scales (distinct per rank and, for
// block, per block, so that a scale applied to another shard's values is far off); the
// reference multiplies the dequantized operands in fp32.
jdg::Scaling g_fp8 = jdg::Scaling::kNone;

__device__ float ToF(float v) { return v; }
__device__ float ToF(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ float ToF(__half v) { return __half2float(v); }
__device__ void FromF(float f, __nv_bfloat16* p) { *p = __float2bfloat16(f); }
__device__ void FromF(float f, __half* p) { *p = __float2half(f); }

// -- Reference: D[m, n] (+)= A[m, k] B[k, n], 16-bit in, fp32 out, row-major with leading dims --
template <class T>
__global__ void RefGemm(const T* a, int64_t lda, const T* b, int64_t ldb, float* d, int64_t ldd,
                        int64_t m, int64_t n, int64_t k, bool accumulate) {
  const int64_t i = blockIdx.y * int64_t(blockDim.y) + threadIdx.y;
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= m || j >= n) return;
  float acc = 0.f;
  for (int64_t t = 0; t < k; ++t) acc += ToF(a[i * lda + t]) * ToF(b[t * ldb + j]);
  d[i * ldd + j] = accumulate ? d[i * ldd + j] + acc : acc;
}

// Offsets in elements of the input type.
void Ref(const void* a, int64_t a_off, int64_t lda, const void* b, int64_t b_off, int64_t ldb,
         float* d, int64_t ldd, int64_t m, int64_t n, int64_t k, bool accumulate) {
  dim3 block(32, 8);
  dim3 grid(unsigned((n + 31) / 32), unsigned((m + 7) / 8));
  if (g_fp8 != jdg::Scaling::kNone) {  // the dequantized operands (fp32)
    RefGemm<<<grid, block>>>(static_cast<const float*>(a) + a_off, lda,
                             static_cast<const float*>(b) + b_off, ldb, d, ldd, m, n, k,
                             accumulate);
  } else if (g_f16) {
    RefGemm<<<grid, block>>>(static_cast<const __half*>(a) + a_off, lda,
                             static_cast<const __half*>(b) + b_off, ldb, d, ldd, m, n, k,
                             accumulate);
  } else {
    RefGemm<<<grid, block>>>(static_cast<const __nv_bfloat16*>(a) + a_off, lda,
                             static_cast<const __nv_bfloat16*>(b) + b_off, ldb, d, ldd, m, n, k,
                             accumulate);
  }
}

// The output as fp32, whatever its type.
template <class T>
__global__ void ToFloatKernel(const T* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = ToF(src[i]);
  }
}

#define CHECK_CUDA(expr)                                                                   \
  do {                                                                                     \
    cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr,                   \
                   cudaGetErrorString(e_));                                                \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

// A helper that returns "" or an error (fp8_transpose.h): exit on the error.
void CheckOk(const std::string& err) {
  if (!err.empty()) {
    std::fprintf(stderr, "%s\n", err.c_str());
    std::exit(2);
  }
}

struct Case {
  ScheduleKind schedule;
  int rs_path;       // RsPath (ReduceScatter), kRsAuto for AllGather
  bool fuse_stages;  // AllGather: one fused grid
  int ag_chunks;     // AllGather: pushed chunks (0: automatic)
  bool gathered = false;  // AllGather: also return the gathered operand (CallBuffers::gathered)
};

struct Shapes {
  int64_t m, n, k;  // global
};

// Per-rank shapes (design.md, "Semantics"), one batch.
void LocalShapes(ScheduleKind s, int tp, const Shapes& g, int64_t x[2], int64_t w[2],
                 int64_t o[2]) {
  switch (s) {
    case ScheduleKind::kAllGather1D_TilingCD_RotatingA:
      x[0] = g.m / tp, x[1] = g.k, w[0] = g.k, w[1] = g.n / tp, o[0] = g.m, o[1] = g.n / tp;
      break;
    case ScheduleKind::kAllGather1D_TilingCD_RotatingB:
      x[0] = g.m / tp, x[1] = g.k, w[0] = g.k, w[1] = g.n / tp, o[0] = g.m / tp, o[1] = g.n;
      break;
    case ScheduleKind::kReduceScatter1D_TilingA_RotatingC:
      x[0] = g.m, x[1] = g.k / tp, w[0] = g.k / tp, w[1] = g.n, o[0] = g.m / tp, o[1] = g.n;
      break;
    case ScheduleKind::kReduceScatter1D_TilingB_RotatingC:
      x[0] = g.m, x[1] = g.k / tp, w[0] = g.k / tp, w[1] = g.n, o[0] = g.m, o[1] = g.n / tp;
      break;
  }
}

// The expected output of rank r, fp32, from every rank's x and w (alpha applied on the host);
// batch l of x and out follows batch l-1, w is shared.
void Expected(ScheduleKind s, int tp, int r, const Shapes& g, const std::vector<void*>& x,
              const std::vector<void*>& w, float* ref_all) {
  int64_t xs[2], ws[2], os[2];
  LocalShapes(s, tp, g, xs, ws, os);
  for (int64_t l = 0; l < g_batch; ++l) {
    const int64_t xl = l * xs[0] * xs[1];
    float* ref = ref_all + l * os[0] * os[1];
    for (int j = 0; j < tp; ++j) {
      switch (s) {
        case ScheduleKind::kAllGather1D_TilingCD_RotatingA:  // rows j of out = x_j @ w_r
          Ref(x[j], xl, xs[1], w[r], 0, ws[1], ref + j * xs[0] * os[1], os[1], xs[0], ws[1],
              xs[1], false);
          break;
        case ScheduleKind::kAllGather1D_TilingCD_RotatingB:  // columns j of out = x_r @ w_j
          Ref(x[r], xl, xs[1], w[j], 0, ws[1], ref + j * ws[1], os[1], xs[0], ws[1], xs[1],
              false);
          break;
        case ScheduleKind::kReduceScatter1D_TilingA_RotatingC:  // sum_j x_j[rows r] @ w_j
          Ref(x[j], xl + r * os[0] * xs[1], xs[1], w[j], 0, ws[1], ref, os[1], os[0], os[1],
              xs[1], j > 0);
          break;
        case ScheduleKind::kReduceScatter1D_TilingB_RotatingC:  // sum_j x_j @ w_j[:, cols r]
          Ref(x[j], xl, xs[1], w[j], r * os[1], ws[1], ref, os[1], os[0], os[1], xs[1], j > 0);
          break;
      }
    }
  }
}

template <class T>
__global__ void FillKernel(T* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed * 2246822519u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    FromF((float(h & 0xFFFF) / 65535.f - 0.5f) * 2.f, p + i);  // uniform [-1, 1]
  }
}

void Fill(void* p, int64_t n, uint32_t seed) {
  if (g_f16) {
    FillKernel<<<264, 256>>>(static_cast<__half*>(p), n, seed);
  } else {
    FillKernel<<<264, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  }
}

// fp8: values e4m3 of uniform [-4, 4]; scales 2^(e - 2), e in 0..4, from `seed` (one per
// tensor, or per block).
__global__ void FillFp8Kernel(__nv_fp8_e4m3* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed * 2246822519u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    p[i] = __nv_fp8_e4m3((float(h & 0xFFFF) / 65535.f - 0.5f) * 8.f);
  }
}
void FillScales(float* s, int64_t n, uint32_t seed) {
  std::vector<float> h(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t v = uint32_t(i) * 2654435761u ^ (seed + 77u) * 2246822519u;
    v ^= v >> 15, v *= 2246822519u, v ^= v >> 13;
    h[i] = std::ldexp(1.f, int(v % 5u) - 2);
  }
  CHECK_CUDA(cudaMemcpy(s, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
}
// out[r, c] = v[r, c] * scale of its block: per tensor s[0]; per block s[(r / br) ld + c / bc]
// (x: br 1, bc 128; w: br bc 128), per batch `batch_stride` elements of v.
__global__ void DequantizeKernel(const __nv_fp8_e4m3* v, const float* s, float* out,
                                 int64_t rows, int64_t cols, int64_t batch, bool block,
                                 int64_t br, int64_t bc) {
  const int64_t n = batch * rows * cols;
  const int64_t ld = cols / 128, per_batch = (rows / br) * ld;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t l = i / (rows * cols), r = i / cols % rows, c = i % cols;
    const float sc = block ? s[l * per_batch + (r / br) * ld + c / bc] : s[0];
    out[i] = float(v[i]) * sc;
  }
}

const char* PathName(const Case& c) {
  static thread_local std::string s;
  if (c.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA ||
      c.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingB) {
    s = std::string(c.fuse_stages ? "fused" : "per-stage") + " chunks=" +
        std::to_string(c.ag_chunks) + (c.gathered ? " +gathered" : "");
  } else {
    const char* p = jdg::RsPathName(c.rs_path);
    s = *p ? p : "auto";
  }
  return s.c_str();
}

bool verbose = false;  // --verbose 1: a line per rank and call
// --control 1: compare each rank's output with its right neighbour's expected output instead,
// so that every case must FAIL: shows that the check can fail (printed as "control ...").
bool control = false;
bool fault = false;  // --fault 1 (see the file comment)
// With --fault 1, one of (the faults of the flag protocol's edges; docs/design.md):
// --start-epoch E: every rank's call counter starts at E (a wait must not pass on a word that
//   holds an old epoch, at any epoch: E = 2^31 + 5 caught a 32-bit wrapping compare).
uint64_t g_start_epoch = 0;
// --late-peer 1: one clean call, then reset(), then every flag word holds that call's epoch,
//   as a peer still landing it after the reset would leave it: the next call must not pass.
bool g_late_peer = false;
// --hold-copies 1: the copy stream's copies into the gathered result wait on a gate that opens
//   5 timeouts after the call starts; whatever the call returns, nothing may write into the
//   gathered result after that (it is poisoned at the return and checked after the gate).
bool g_hold_copies = false;
uint32_t* g_gate = nullptr;  // mapped pinned: the copy gate
uint32_t* g_gate_dev = nullptr;
cudaStream_t g_side_stream = nullptr;  // created first: a hardware queue no rank's stream shares
// --group-per-case 0 (default): one group (and one main stream per rank) for the whole run,
// reset between cases (flags, epochs, error record: PeerGroup::Reset), so that the run creates
// 2 TP streams in all, as a process under XLA does.  1: a fresh group per case, whose copy
// streams live on (groups are process-lifetime) while each case creates 2 TP more, which at
// TP=8 can exhaust the hardware queues (a case then times out now and then).
bool group_per_case = false;

// Where each rank's thread is (the watchdog prints it when a call stalls).
enum Phase : int { kIdle = 0, kSetup = 1, kEnqueue = 2, kSync = 3, kDone = 4, kLead = 5 };
const char* kPhaseNames[] = {"idle", "EnsureReady", "EnqueueDistGemm", "cudaStreamSynchronize",
                             "done", "lead wait"};
std::atomic<int> g_phase[8];
std::atomic<int> g_call{-1};

// --sequence 1 progress, readable without a CUDA call: calls each rank has enqueued (host), and
// calls each rank's main and copy streams have finished, written by the streams themselves
// (cuStreamWriteValue32 into mapped host memory) after each call.
std::atomic<int> g_enqueued[8];
volatile uint32_t* g_done_main = nullptr;  // [8], mapped pinned
volatile uint32_t* g_done_copy = nullptr;  // [8], mapped pinned
uint32_t* g_done_main_dev = nullptr;
uint32_t* g_done_copy_dev = nullptr;
jc::PeerGroup* g_seq_group = nullptr;  // the sequence's group (the watchdog reads its error record)
// --max-lead N: rank r enqueues call k only once every rank's main stream has finished call
// k - N (0: no bound).  NOTE: the ranks share one CUDA context, and a thread blocked in a
// launch on a full queue holds that context's lock: unbounded, the ranks that ran ahead fill
// their queues with calls that wait for a lagging rank, which then cannot enqueue the data they
// wait for (each wait times out instead).  Separate GPUs have separate contexts.
int g_max_lead = 2;
// --progress 0: no stream writes of the counters (they sit between calls on every stream).
bool g_progress = true;

uint32_t MinDoneMain(int tp) {
  uint32_t m = UINT32_MAX;
  for (int r = 0; r < tp; ++r) m = std::min<uint32_t>(m, uint32_t(g_done_main[r]));
  return m;
}

constexpr float kAlpha = 1.5f;

// One call of one case on every rank: its problem, options and each rank's buffers.
struct CallData {
  Case c;
  jdg::Problem p;
  jc::CallOptions opt;
  int tp = 0;
  int64_t xs[2], ws[2], os[2];
  int64_t x_elems = 0, out_elems = 0, shard_elems = 0;
  std::vector<void*> x, w, out, gathered;
  std::vector<float*> ref, got;

  // "" or why the case does not apply at these shapes (MakeProblem's refusal: a SKIP).
  std::string Init(const Case& cs, int tp_, const Shapes& g, int64_t timeout_ms) {
    c = cs;
    tp = tp_;
    LocalShapes(c.schedule, tp, g, xs, ws, os);
    const bool fp8 = g_fp8 != jdg::Scaling::kNone;
    const jdg::ElemType in_type = fp8     ? jdg::ElemType::kF8E4M3
                                  : g_f16 ? jdg::ElemType::kF16
                                          : jdg::ElemType::kBF16;
    const jdg::ElemType out_type =
        g_out_f32 ? jdg::ElemType::kF32 : fp8 ? jdg::ElemType::kBF16 : in_type;
    const int64_t x_dims[3] = {g_batch, xs[0], xs[1]}, out_dims[3] = {g_batch, os[0], os[1]};
    const int rank = g_batch > 1 ? 3 : 2;  // x and out [L, ., .] only when batched
    if (std::string err = jdg::MakeProblem(c.schedule, tp, x_dims + 3 - rank, rank, ws, 2,
                                           out_dims + 3 - rank, rank, in_type, in_type,
                                           out_type, false, nullptr, 0, kAlpha, 0.f, &p);
        !err.empty()) {
      return err;
    }
    if (fp8) {
      const int64_t xs_dims[3] = {g_batch, xs[0], xs[1] / 128}, ws_dims[2] = {ws[0] / 128,
                                                                              ws[1] / 128};
      const bool block = g_fp8 == jdg::Scaling::kBlock;
      if (std::string err = jdg::SetScales(xs_dims + 3 - rank, block ? rank : 0,
                                           jdg::ElemType::kF32, ws_dims, block ? 2 : 0,
                                           jdg::ElemType::kF32, &p);
          !err.empty()) {
        return err;
      }
      if (c.gathered) return "fp8 calls return no gathered operand";
    }
    opt.timeout_ms = timeout_ms;
    opt.poison_output = true;  // unwritten tiles read NaN
    opt.rs_path = c.rs_path;
    opt.fuse_stages = c.fuse_stages;
    opt.ag_chunks = c.ag_chunks;
    // NOTE: every launch waits for the one before it.  With overlap (the default), each stage
    // launch lets the next one start at once (programmatic dependent launch), so one rank can
    // hold many grids spinning on flags, and on a shared GPU they take the SMs that the ranks
    // that set those flags need (copy_ring timed out at TP >= 4).  (On separate
    // GPUs the flag's producer never needs this GPU's SMs.)  Waiting bounds a rank to two
    // resident grids, which the SM cap (Run*) leaves room for.
    opt.overlap_stages = false;
    x_elems = g_batch * xs[0] * xs[1];
    out_elems = g_batch * os[0] * os[1];
    // The gathered operand: x's rows (RotatingA, [L, TP xm, xk]) or w's columns (RotatingB,
    // [wk, TP wn]) of every rank, 16-bit like the shards; rank j's shard is row block j of each
    // of p.GatheredRows() rows (Problem::GatheredRows / GatheredWidth).
    shard_elems = RotA() ? x_elems : ws[0] * ws[1];
    return "";
  }
  bool RotA() const { return c.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA; }
  bool AllGather() const {
    return RotA() || c.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingB;
  }
  size_t OutSize() const { return g_out_f32 ? 4 : 2; }
  size_t InSize() const { return g_fp8 != jdg::Scaling::kNone ? 1 : 2; }

  // fp8: each rank's scales, the dequantized operands (the reference's), and w and its scales
  // K-major, as the executor reads them (executor.h CallBuffers).
  std::vector<float*> x_scale, w_scale, x_deq, w_deq, w_scale_t;
  std::vector<void*> w_t;

  void Alloc() {
    x.assign(tp, nullptr), w.assign(tp, nullptr), out.assign(tp, nullptr);
    gathered.assign(tp, nullptr), ref.assign(tp, nullptr), got.assign(tp, nullptr);
    x_scale.assign(tp, nullptr), w_scale.assign(tp, nullptr), x_deq.assign(tp, nullptr);
    w_deq.assign(tp, nullptr), w_t.assign(tp, nullptr), w_scale_t.assign(tp, nullptr);
    for (int r = 0; r < tp && g_fp8 != jdg::Scaling::kNone; ++r) {
      CHECK_CUDA(cudaMalloc(&x_scale[r], p.XScaleElems() * sizeof(float)));
      CHECK_CUDA(cudaMalloc(&w_scale[r], p.WScaleElems() * sizeof(float)));
      CHECK_CUDA(cudaMalloc(&x_deq[r], x_elems * sizeof(float)));
      CHECK_CUDA(cudaMalloc(&w_deq[r], ws[0] * ws[1] * sizeof(float)));
      CHECK_CUDA(cudaMalloc(&w_t[r], ws[0] * ws[1]));
      CHECK_CUDA(cudaMalloc(&w_scale_t[r], p.WScaleElems() * sizeof(float)));
    }
    for (int r = 0; r < tp; ++r) {
      CHECK_CUDA(cudaMalloc(&x[r], x_elems * InSize()));
      CHECK_CUDA(cudaMalloc(&w[r], ws[0] * ws[1] * InSize()));
      CHECK_CUDA(cudaMalloc(&out[r], out_elems * OutSize()));
      CHECK_CUDA(cudaMalloc(&ref[r], out_elems * 4));
      CHECK_CUDA(cudaMalloc(&got[r], out_elems * 4));
      if (c.gathered) CHECK_CUDA(cudaMalloc(&gathered[r], tp * shard_elems * 2));
    }
  }
  void Free() {
    for (int r = 0; r < int(x.size()); ++r) {
      cudaFree(x[r]), cudaFree(w[r]), cudaFree(out[r]), cudaFree(ref[r]), cudaFree(got[r]);
      if (gathered[r] != nullptr) cudaFree(gathered[r]);
      cudaFree(x_scale[r]), cudaFree(w_scale[r]), cudaFree(x_deq[r]), cudaFree(w_deq[r]);
      cudaFree(w_t[r]), cudaFree(w_scale_t[r]);
    }
    x.clear(), w.clear(), out.clear(), gathered.clear(), ref.clear(), got.clear();
  }

  // Fresh operands from `seed` (a stale slot of an earlier call cannot pass), the gathered
  // result poisoned, and every rank's expected output (--control: its right neighbour's).
  // Enqueued on the legacy stream: synchronize before the ranks' streams read them.
  void Prepare(uint32_t seed, const Shapes& g) {
    const bool fp8 = g_fp8 != jdg::Scaling::kNone, block = g_fp8 == jdg::Scaling::kBlock;
    for (int r = 0; r < tp; ++r) {
      if (fp8) {
        auto* xv = static_cast<__nv_fp8_e4m3*>(x[r]);
        auto* wv = static_cast<__nv_fp8_e4m3*>(w[r]);
        FillFp8Kernel<<<264, 256>>>(xv, x_elems, seed + 2u * r + 1u);
        FillFp8Kernel<<<264, 256>>>(wv, ws[0] * ws[1], seed + 2u * r + 2u);
        FillScales(x_scale[r], p.XScaleElems(), seed + 2u * r + 1u);
        FillScales(w_scale[r], p.WScaleElems(), seed + 2u * r + 2u);
        DequantizeKernel<<<264, 256>>>(xv, x_scale[r], x_deq[r], xs[0], xs[1], g_batch, block, 1,
                                       128);
        DequantizeKernel<<<264, 256>>>(wv, w_scale[r], w_deq[r], ws[0], ws[1], 1, block, 128,
                                       128);
        CheckOk(jc::Fp8TransposeWeights(wv, ws[1], 0, w_t[r], ws[0], 0, ws[0], ws[1], 1, 0));
        if (block) {
          const int64_t kb = ws[0] / 128, nb = ws[1] / 128;
          CheckOk(jc::Fp8TransposeBlockScales(w_scale[r], nb, 0, w_scale_t[r], kb, 0, kb, nb, 1,
                                              0));
        }
      } else {
        Fill(x[r], x_elems, seed + 2u * r + 1u);
        Fill(w[r], ws[0] * ws[1], seed + 2u * r + 2u);
      }
      if (c.gathered) CHECK_CUDA(cudaMemset(gathered[r], 0xff, tp * shard_elems * 2));  // NaNs
    }
    for (int r = 0; r < tp; ++r) {
      const int want = control ? (r + 1) % tp : r;
      if (fp8) {
        Expected(c.schedule, tp, want, g, std::vector<void*>(x_deq.begin(), x_deq.end()),
                 std::vector<void*>(w_deq.begin(), w_deq.end()), ref[r]);
      } else {
        Expected(c.schedule, tp, want, g, x, w, ref[r]);
      }
    }
  }

  // Rank r's call: its buffers and options (rank 0 skips its signals with --fault, unless
  // `clean`).
  std::string Enqueue(int r, jc::PeerGroup& group, cudaStream_t stream, bool clean = false) const {
    jc::CallOptions mine = opt;
    mine.skip_signals = fault && !clean && r == 0;
    if (g_hold_copies && !clean) mine.copy_gate = g_gate_dev;
    const bool fp8 = g_fp8 != jdg::Scaling::kNone;
    const jc::CallBuffers b{x[r], fp8 ? w_t[r] : w[r], nullptr, out[r], gathered[r], x_scale[r],
                            g_fp8 == jdg::Scaling::kBlock ? w_scale_t[r] : w_scale[r]};
    return jc::EnqueueDistGemm(p, r, group, b, mine, stream);
  }

  // "" or "<label> rank R: <first mismatch>", the ranks in order; raises *worst.
  // |out - alpha ref| against the reference's largest magnitude.  Each 16-bit rounding costs up
  // to 2^-8 of it (bf16; f16 less): the output's, and on ReduceScatter each of the TP - 1
  // running sums' (slots of the output type; fp32 output: fp32 sums).  A missing or misplaced
  // tile or partial is O(1).  The gathered operand must equal the shards bit for bit.
  std::string Check(const std::string& label, double* worst) {
    const double tol = 1e-3 + (g_out_f32 ? 0.0 : std::ldexp(1.0, -8) * (AllGather() ? 1 : tp));
    std::vector<float> h(out_elems), hr(out_elems);
    std::vector<uint16_t> want_g, got_g;
    if (c.gathered) {  // from every rank's shard (--control: rank j+1's in block j)
      const int64_t g_rows = p.GatheredRows(), g_width = p.GatheredWidth();
      want_g.resize(tp * shard_elems);
      got_g.resize(tp * shard_elems);
      std::vector<uint16_t> shard(shard_elems);
      for (int j = 0; j < tp; ++j) {
        const int src = control ? (j + 1) % tp : j;
        CHECK_CUDA(cudaMemcpy(shard.data(), RotA() ? x[src] : w[src], shard_elems * 2,
                              cudaMemcpyDeviceToHost));
        for (int64_t row = 0; row < g_rows; ++row) {
          std::memcpy(&want_g[(row * tp + j) * g_width], &shard[row * g_width], g_width * 2);
        }
      }
    }
    for (int r = 0; r < tp; ++r) {
      const std::string where = label + " rank " + std::to_string(r) + ": ";
      if (c.gathered) {
        CHECK_CUDA(cudaMemcpy(got_g.data(), gathered[r], tp * shard_elems * 2,
                              cudaMemcpyDeviceToHost));
        int64_t bad = 0, first = -1;
        for (int64_t i = 0; i < tp * shard_elems; ++i) {
          if (got_g[i] != want_g[i]) {
            if (first < 0) first = i;
            ++bad;
          }
        }
        if (bad > 0) {
          return where + "gathered differs from the shards at " + std::to_string(bad) +
                 " elements (first " + std::to_string(first) + ")";
        }
      }
      if (g_out_f32) {
        CHECK_CUDA(cudaMemcpy(got[r], out[r], out_elems * 4, cudaMemcpyDeviceToDevice));
      } else if (g_f16) {
        ToFloatKernel<<<264, 256>>>(static_cast<const __half*>(out[r]), got[r], out_elems);
      } else {
        ToFloatKernel<<<264, 256>>>(static_cast<const __nv_bfloat16*>(out[r]), got[r], out_elems);
      }
      CHECK_CUDA(cudaMemcpy(h.data(), got[r], out_elems * 4, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(hr.data(), ref[r], out_elems * 4, cudaMemcpyDeviceToHost));
      double max_ref = 0, max_err = 0;
      for (int64_t i = 0; i < out_elems; ++i) {
        const float v = h[i];
        const double want = double(kAlpha) * hr[i];
        max_ref = std::max(max_ref, std::fabs(want));
        const double e = std::isfinite(v) ? std::fabs(v - want) : INFINITY;
        max_err = std::max(max_err, e);
      }
      const double rel = max_err / std::max(max_ref, 1e-30);
      *worst = std::max(*worst, rel);
      if (!(rel <= tol)) {
        return where + "max |out - ref| / max |ref| = " + std::to_string(rel) + " > " +
               std::to_string(tol);
      }
    }
    return "";
  }
};

// The run's one group (global ids 1000 + r, all on ordinal 0), reset (flags, epochs, error
// record) after whatever ran on it before; or, with --group-per-case 1, a fresh group whose
// flags and epochs start at 0 (distinct ids from `group_base`).
jc::PeerGroup* GroupFor(int tp, int group_base, std::string* err) {
  std::vector<int64_t> ids(tp);
  for (int r = 0; r < tp; ++r) ids[r] = (group_per_case ? group_base : 1000) + r;
  jc::PeerGroup* group = jc::GetPeerGroup(ids, std::vector<int>(tp, 0));
  if (!group_per_case) *err = group->Reset();
  return group;
}

// The ranks share one GPU's SMs: each rank's persistent grids get at most 132 / (2 TP), so that
// every rank's two resident grids (CallData::Init's NOTE) fit at once.
int SmCap(int tp) { return std::max(2, (132 / (2 * tp)) & ~1); }

// Every rank's host thread, as XLA's per-device threads: the group's setup for `ws_bytes`
// (`run_id` keys its meeting), `enqueue(r, stream)`, one synchronization, then the group's
// pending error.  Returns each rank's error ("" if none); a slow or failed rank prints a line
// (`call` labels it; -1 for a whole sequence).
template <class Enqueue>
std::vector<std::string> RunRanks(jc::PeerGroup* group, const std::vector<cudaStream_t>& streams,
                                  size_t ws_bytes, int64_t run_id, int64_t timeout_ms, int call,
                                  const Enqueue& enqueue) {
  const int tp = group->tp();
  std::vector<std::string> errors(tp);
  for (int r = 0; r < tp; ++r) g_phase[r] = kIdle;
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      const auto start = std::chrono::steady_clock::now();
      cudaSetDevice(0);
      cudaStream_t stream = streams[r];
      g_phase[r] = kSetup;
      std::string err = group->EnsureReady(r, ws_bytes, stream, run_id, timeout_ms);
      group->dev(r).sm_count = std::min(group->dev(r).sm_count, SmCap(tp));
      g_phase[r] = kEnqueue;
      if (err.empty()) err = enqueue(r, stream);
      g_phase[r] = kSync;
      if (cudaError_t e = cudaStreamSynchronize(stream); err.empty() && e != cudaSuccess) {
        err = cudaGetErrorString(e);
      }
      g_phase[r] = kDone;
      if (err.empty()) err = group->PendingError();
      errors[r] = err;
      const double ms = std::chrono::duration<double, std::milli>(
                            std::chrono::steady_clock::now() - start).count();
      if (ms > 1000 || !err.empty() || verbose) {
        const jc::CopyStreamReport& cs = group->dev(r).copy_stream_report;
        std::printf("  call %d rank %d: %.0f ms, copy stream independent %d (%d candidates)%s%s\n",
                    call, r, ms, cs.independent, cs.candidates, err.empty() ? "" : ": ",
                    err.c_str());
        std::fflush(stdout);
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Runs `calls` calls of one case (on the run's group and its main streams `run_streams`, or,
// with --group-per-case 1, a fresh group and streams of its own), synchronizing every rank
// after each; returns whether every output matched.
bool RunCase(const Case& c, int tp, const Shapes& g, int calls, int64_t timeout_ms,
             int group_base, const std::vector<cudaStream_t>& run_streams) {
  CallData d;
  if (std::string err = d.Init(c, tp, g, timeout_ms); !err.empty()) {
    std::printf("%-36s %-22s SKIP (%s)\n", jdg::ScheduleName(c.schedule), PathName(c),
                err.c_str());
    return true;
  }
  std::string reset_err;
  jc::PeerGroup* group = GroupFor(tp, group_base, &reset_err);
  if (!reset_err.empty()) {
    std::printf("%-36s %-22s FAIL  reset: %s\n", jdg::ScheduleName(c.schedule), PathName(c),
                reset_err.c_str());
    return false;
  }
  const size_t ws_bytes = jdg::WorkspaceBytes(d.p, d.opt.rs_path);
  d.Alloc();
  // Each rank's main stream, created before the group's copy streams (first call's setup):
  // the run's (main), or this case's own with --group-per-case 1.
  std::vector<cudaStream_t> streams = run_streams;
  if (group_per_case) {
    streams.resize(tp);
    for (int r = 0; r < tp; ++r) {
      CHECK_CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    }
  }
  bool ok = true;
  double worst = 0;
  std::string first_error;
  if (fault && g_start_epoch > 0) {
    for (int r = 0; r < tp; ++r) group->dev(r).epoch = decltype(group->dev(r).epoch)(g_start_epoch);
  }
  if (fault && g_late_peer) {
    d.Prepare(7u, g);
    CHECK_CUDA(cudaDeviceSynchronize());
    RunRanks(group, streams, ws_bytes, group_base * 100 + 99, timeout_ms, -1,
             [&](int r, cudaStream_t stream) { return d.Enqueue(r, *group, stream, true); });
    const uint64_t late = group->dev(0).epoch;  // the clean call's epoch, as a late peer lands it
    if (std::string e = group->Reset(); !e.empty()) {
      std::printf("%-36s %-22s FAIL  reset: %s\n", jdg::ScheduleName(c.schedule), PathName(c),
                  e.c_str());
      return false;
    }
    using Word = std::remove_pointer_t<decltype(group->dev(0).flags)>;
    std::vector<Word> stale(jc::kFlagWords, Word(late));
    for (int r = 0; r < tp; ++r) {
      CHECK_CUDA(cudaMemcpy(group->dev(r).flags, stale.data(), stale.size() * sizeof(Word),
                            cudaMemcpyHostToDevice));
    }
  }
  for (int call = 0; call < calls && ok; ++call) {
    d.Prepare(1000u * call, g);
    CHECK_CUDA(cudaDeviceSynchronize());
    g_call = group_base * 100 + call;
    std::thread gate;
    if (fault && g_hold_copies) {
      *reinterpret_cast<volatile uint32_t*>(g_gate) = 0;
      gate = std::thread([timeout_ms] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5 * timeout_ms));
        *reinterpret_cast<volatile uint32_t*>(g_gate) = 1;
      });
    }
    // run_id keys the group's setup meeting (by ordinals): unique per case and call.
    const std::vector<std::string> errors =
        RunRanks(group, streams, ws_bytes, group_base * 100 + call, timeout_ms, call,
                 [&](int r, cudaStream_t stream) { return d.Enqueue(r, *group, stream); });
    std::string late_write;  // --hold-copies: a write into a gathered result after the return
    if (fault && g_hold_copies) {
      const size_t bytes = size_t(tp) * d.shard_elems * 2;
      for (int r = 0; r < tp; ++r) {
        CHECK_CUDA(cudaMemsetAsync(d.gathered[r], 0xEE, bytes, g_side_stream));
      }
      CHECK_CUDA(cudaStreamSynchronize(g_side_stream));
      gate.join();
      CHECK_CUDA(cudaDeviceSynchronize());  // every copy the calls enqueued has run
      std::vector<uint8_t> h(bytes);
      for (int r = 0; r < tp && late_write.empty(); ++r) {
        CHECK_CUDA(cudaMemcpy(h.data(), d.gathered[r], bytes, cudaMemcpyDeviceToHost));
        const int64_t bad = std::count_if(h.begin(), h.end(), [](uint8_t v) { return v != 0xEE; });
        if (bad > 0) {
          late_write = " | rank " + std::to_string(r) + ": " + std::to_string(bad) +
                       " bytes of the gathered result written after the call returned";
        }
      }
    }
    if (fault) {
      // Every rank came back (else the watchdog ends the run); each rank but 0, whose peers all
      // delivered, must report the timeout.  Rank 0 sees the group's shared error record only
      // if it looks after the others' waits ended, so it is not counted.
      int reported = 0;
      std::string others;  // what the ranks that did not report the timeout returned
      for (int r = 1; r < tp; ++r) {
        if (errors[r].find("a wait on a peer timed out") != std::string::npos) {
          ++reported;
        } else {
          others += " | rank " + std::to_string(r) + ": " +
                    (errors[r].empty() ? std::string("no error") : errors[r]);
        }
      }
      ok = reported == tp - 1 && late_write.empty();
      std::printf("%-36s %-22s fault %s  %d of ranks 1-%d returned the timeout error: %s%s%s\n",
                  jdg::ScheduleName(c.schedule), PathName(c), ok ? "OK  " : "FAIL", reported,
                  tp - 1, errors[tp - 1].c_str(), others.c_str(), late_write.c_str());
      break;
    }
    for (int r = 0; r < tp; ++r) {
      if (!errors[r].empty() && first_error.empty()) {
        first_error = "rank " + std::to_string(r) + ": " + errors[r];
      }
    }
    if (first_error.empty()) first_error = d.Check("call " + std::to_string(call), &worst);
    ok = first_error.empty();
  }
  if (fault) {
    // printed above
  } else if (control) {  // the check must have caught the wrong reference on the first call
    const bool caught = !ok && first_error.rfind("call 0 rank 0:", 0) == 0;
    std::printf("%-36s %-22s control %s  %s\n", jdg::ScheduleName(c.schedule), PathName(c),
                caught ? "OK (caught)" : "FAIL (not caught)", first_error.c_str());
    ok = caught;
  } else {
    std::printf("%-36s %-22s %s  worst rel err %.2e%s%s\n", jdg::ScheduleName(c.schedule),
                PathName(c), ok ? "OK  " : "FAIL", worst, first_error.empty() ? "" : "  ",
                first_error.c_str());
  }
  std::fflush(stdout);
  if (group_per_case) {
    for (int r = 0; r < tp; ++r) cudaStreamDestroy(streams[r]);
  }
  d.Free();
  // A timed-out group keeps its error record until the next case resets it (--group-per-case 1:
  // until the end; later cases use fresh groups).
  return ok;
}

// --sequence 1: every case, `rounds` times in a row, one call each, which every rank enqueues
// back to back with no synchronization between calls, as XLA's per-device threads do; then
// one synchronization per rank and a check of every call.  What the per-case runs cannot reach:
// a rank starting a call (of another schedule and data path) while its peers still work on the
// previous one, so that two calls' flag writes and slot parities meet (design.md, "Epochs
// instead of resets": one writer per flag word; RingFlags).  Rank 0's stream counts finished
// calls for the watchdog (a host function after each call).
bool RunSequence(const Case* cases, int n_cases, int tp, const Shapes& g, int rounds,
                 int64_t timeout_ms, std::vector<cudaStream_t> streams) {
  for (int r = int(streams.size()); r < tp; ++r) {  // --group-per-case 1: streams of its own
    cudaStream_t s;
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    streams.push_back(s);
  }
  std::vector<CallData> seq;
  size_t ws_bytes = 0;
  for (int round = 0; round < rounds; ++round) {
    for (int i = 0; i < n_cases; ++i) {
      CallData d;
      if (!d.Init(cases[i], tp, g, timeout_ms).empty()) continue;  // SKIPs: see the case runs
      ws_bytes = std::max(ws_bytes, jdg::WorkspaceBytes(d.p, d.opt.rs_path));
      d.Alloc();
      d.Prepare(7919u * uint32_t(seq.size() + 1), g);
      seq.push_back(d);
    }
  }
  std::string err;
  jc::PeerGroup* group = GroupFor(tp, 100, &err);
  if (!err.empty()) {
    std::printf("sequence FAIL  reset: %s\n", err.c_str());
    return false;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  g_call = 0;
  g_seq_group = group;
  const std::vector<std::string> errors = RunRanks(
      group, streams, ws_bytes, /*run_id=*/1, timeout_ms, -1, [&](int r, cudaStream_t stream) {
        std::string e;
        cudaStream_t copy = group->dev(r).copy_stream;
        for (size_t k = 0; k < seq.size() && e.empty(); ++k) {
          if (g_max_lead > 0 && k >= size_t(g_max_lead)) {
            g_phase[r] = kLead;
            while (MinDoneMain(tp) < k - g_max_lead) std::this_thread::yield();
            g_phase[r] = kEnqueue;
          }
          e = seq[k].Enqueue(r, *group, stream);
          if (!e.empty()) {
            e = "enqueueing call " + std::to_string(k) + ": " + e;
            break;
          }
          g_enqueued[r].fetch_add(1);
          if (g_progress &&
              (jc::StreamWriteValue32(stream, g_done_main_dev + r, uint32_t(k + 1)) != cudaSuccess ||
               jc::StreamWriteValue32(copy, g_done_copy_dev + r, uint32_t(k + 1)) != cudaSuccess)) {
            e = "progress write";
          }
          if (r == 0 && e.empty()) {
            auto bump = [](void*) { g_call.fetch_add(1); };
            if (cudaLaunchHostFunc(stream, bump, nullptr) != cudaSuccess) e = "cudaLaunchHostFunc";
          }
        }
        return e;
      });
  bool ok = true;
  for (int r = 0; r < tp; ++r) {
    if (!errors[r].empty()) {
      std::printf("sequence FAIL  rank %d: %s\n", r, errors[r].c_str());
      ok = false;
    }
  }
  double worst = 0;
  int bad = 0;
  for (size_t k = 0; k < seq.size() && ok; ++k) {
    const std::string e = seq[k].Check("call " + std::to_string(k), &worst);
    if (!e.empty()) {
      ++bad;
      std::printf("  %-36s %-22s FAIL  %s\n", jdg::ScheduleName(seq[k].c.schedule),
                  PathName(seq[k].c), e.c_str());
    }
  }
  ok = ok && bad == 0;
  std::printf("sequence of %zu calls (%d rounds of every case) back to back on %d ranks: %s  "
              "%d calls wrong, worst rel err %.2e\n",
              seq.size(), rounds, tp, ok ? "OK  " : "FAIL", bad, worst);
  std::fflush(stdout);
  for (CallData& d : seq) d.Free();
  return ok;
}

int64_t Arg(int argc, char** argv, const char* name, int64_t def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  }
  return def;
}

}  // namespace

int main(int argc, char** argv) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  // NOTE: no copy-stream probe (copy_stream.h): its blocked wait can deadlock ranks that share
  // one GPU, and here each rank's streams take distinct hardware queues anyway.
  jc::SetCopyStreamMode(jc::CopyStreamMode::kUnchecked);
  // One fixed kernel: the tuner would time candidates on a GPU the other ranks share.
  setenv("JAX_DISTGEMM_GEMM_CONFIG", "0:1:1", 0);
  const int tp = int(Arg(argc, argv, "--tp", 4));
  const Shapes g{Arg(argc, argv, "--m", 2048), Arg(argc, argv, "--n", 2048),
                 Arg(argc, argv, "--k", 1024)};
  const int calls = int(Arg(argc, argv, "--calls", 3));
  const int64_t timeout_ms = Arg(argc, argv, "--timeout-ms", 3000);
  const int only = int(Arg(argc, argv, "--case", -1));  // one case by index, -1: all
  verbose = Arg(argc, argv, "--verbose", 0) != 0;
  control = Arg(argc, argv, "--control", 0) != 0;
  fault = Arg(argc, argv, "--fault", 0) != 0;
  g_start_epoch = uint64_t(Arg(argc, argv, "--start-epoch", 0));
  g_late_peer = Arg(argc, argv, "--late-peer", 0) != 0;
  g_hold_copies = Arg(argc, argv, "--hold-copies", 0) != 0;
  if (!fault && (g_start_epoch > 0 || g_late_peer || g_hold_copies)) {
    std::fprintf(stderr, "--start-epoch, --late-peer and --hold-copies need --fault 1\n");
    return 2;
  }
  group_per_case = Arg(argc, argv, "--group-per-case", 0) != 0;
  g_f16 = Arg(argc, argv, "--f16", 0) != 0;
  g_out_f32 = Arg(argc, argv, "--out-f32", 0) != 0;
  g_batch = std::max<int64_t>(1, Arg(argc, argv, "--batch", 1));
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--fp8") != 0) continue;
    if (std::strcmp(argv[i + 1], "tensor") == 0) {
      g_fp8 = jdg::Scaling::kTensor;
    } else if (std::strcmp(argv[i + 1], "block") == 0) {
      g_fp8 = jdg::Scaling::kBlock;
    } else {
      std::fprintf(stderr, "--fp8: tensor or block\n");
      return 2;
    }
  }
  if (g_fp8 != jdg::Scaling::kNone && (g_f16 || fault)) {
    std::fprintf(stderr, "--fp8 takes neither --f16 nor --fault\n");
    return 2;
  }
  const bool sequence = Arg(argc, argv, "--sequence", 0) != 0;
  if (sequence && (control || fault || only >= 0)) {
    std::fprintf(stderr, "--sequence 1 takes none of --control, --fault, --case\n");
    return 2;
  }
  if (tp < 2 || tp > 8 || g.m % tp || g.n % tp || g.k % tp) {
    std::fprintf(stderr, "--tp must be 2-8 and divide --m, --n and --k\n");
    return 2;
  }
  g_max_lead = int(Arg(argc, argv, "--max-lead", g_max_lead));
  g_progress = Arg(argc, argv, "--progress", 1) != 0;
  if (g_max_lead > 0 && !g_progress) {
    std::fprintf(stderr, "--max-lead needs the progress counters (--progress 1)\n");
    return 2;
  }
  const int64_t deadline_s = Arg(argc, argv, "--deadline-s", 0);  // 0: none
  CHECK_CUDA(cudaStreamCreateWithFlags(&g_side_stream, cudaStreamNonBlocking));
  {
    void* h = nullptr;
    CHECK_CUDA(cudaHostAlloc(&h, sizeof(uint32_t), cudaHostAllocMapped));
    g_gate = static_cast<uint32_t*>(h);
    *g_gate = 1;
    void* d = nullptr;
    CHECK_CUDA(cudaHostGetDevicePointer(&d, h, 0));
    g_gate_dev = static_cast<uint32_t*>(d);
  }
  {
    void* h = nullptr;
    CHECK_CUDA(cudaHostAlloc(&h, 2 * 8 * sizeof(uint32_t), cudaHostAllocMapped));
    std::memset(h, 0, 2 * 8 * sizeof(uint32_t));
    g_done_main = static_cast<uint32_t*>(h);
    g_done_copy = g_done_main + 8;
    void* d = nullptr;
    CHECK_CUDA(cudaHostGetDevicePointer(&d, h, 0));
    g_done_main_dev = static_cast<uint32_t*>(d);
    g_done_copy_dev = g_done_main_dev + 8;
  }
  // Watchdog: when nothing moves for two periods of --timeout-ms + 2 s (no call counted by the
  // host function, enqueued, or finished on any stream), or past --deadline-s, prints where
  // every rank is, its counters and the group's error record (mapped host memory: no CUDA
  // call), then whether the driver still answers, then ends the process (exit status 3).
  std::thread([tp, timeout_ms, deadline_s] {
    const auto start = std::chrono::steady_clock::now();
    auto signature = [tp] {
      uint64_t s = uint64_t(uint32_t(g_call.load()));
      for (int r = 0; r < tp; ++r) {
        s = s * 1000003u + uint64_t(g_enqueued[r].load()) * 7919u + g_done_main[r] * 31u +
            g_done_copy[r] + uint64_t(g_phase[r].load()) * 104729u;
      }
      return s;
    };
    uint64_t last = signature();
    auto last_change = std::chrono::steady_clock::now();
    const auto stall_after = std::chrono::milliseconds(2 * (timeout_ms + 2000));
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const auto now = std::chrono::steady_clock::now();
      const uint64_t sig = signature();
      if (sig != last) last = sig, last_change = now;
      const bool stalled = now - last_change > stall_after;
      const bool late = deadline_s > 0 && now - start > std::chrono::seconds(deadline_s);
      if (!stalled && !late) continue;
      std::printf("WATCHDOG: %s: call %d (host function count)\n",
                  stalled ? "stalled" : "past --deadline-s", g_call.load());
      for (int r = 0; r < tp; ++r) {
        std::printf("  rank %d: in %s; enqueued %d; main stream finished %u; copy stream "
                    "finished %u\n",
                    r, kPhaseNames[g_phase[r]], g_enqueued[r].load(), g_done_main[r],
                    g_done_copy[r]);
      }
      if (g_seq_group != nullptr && g_seq_group->error() != nullptr) {
        const volatile jc::ErrorRecord* e = g_seq_group->error();
        std::printf("  error record: code %u rank %d stage %d peer %d expected %llu observed %llu\n",
                    e->code, e->rank, e->stage, e->peer,
                    static_cast<unsigned long long>(e->expected),
                    static_cast<unsigned long long>(e->observed));
      }
      std::fflush(stdout);
      // Does the driver answer?  A query on a fresh thread, given 2 s; then every rank's flag
      // words that are nonzero (a copy on a fresh stream, given 2 s more).
      static std::atomic<int> answered{0};
      static std::atomic<int> copied{0};
      static std::vector<jc::Epoch> words;
      jc::PeerGroup* group = g_seq_group;
      std::thread([group, tp] {
        cudaStream_t s;
        if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
          answered = 2;
          return;
        }
        cudaStreamQuery(s);
        answered = 1;
        if (group == nullptr) return;
        words.assign(size_t(tp) * jc::kFlagWords, 0u);
        jc::Epoch* host = nullptr;
        if (cudaMallocHost(&host, words.size() * sizeof(jc::Epoch)) != cudaSuccess) return;
        for (int r = 0; r < tp; ++r) {
          cudaMemcpyAsync(host + size_t(r) * jc::kFlagWords, group->dev(r).flags,
                          jc::kFlagWords * sizeof(jc::Epoch), cudaMemcpyDeviceToHost, s);
        }
        if (cudaStreamSynchronize(s) == cudaSuccess) {
          std::memcpy(words.data(), host, words.size() * sizeof(jc::Epoch));
          copied = 1;
        }
      }).detach();
      for (int i = 0; i < 40 && copied == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      std::printf("  driver: %s\n", answered == 1 ? "answers (cudaStreamCreate + cudaStreamQuery)"
                                      : answered == 2 ? "answers with an error"
                                                      : "no answer in 4 s (a host lock is held)");
      if (copied == 1) {
        for (int r = 0; r < tp; ++r) {
          std::printf("  rank %d flags (host epoch %llu):", r,
                      static_cast<unsigned long long>(g_seq_group->dev(r).epoch));
          for (int w = 0; w < jc::kFlagWords; ++w) {
            const jc::Epoch v = words[size_t(r) * jc::kFlagWords + w];
            if (v == 0) continue;
            const int row = w / jc::kNumFlags, f = w % jc::kNumFlags;
            std::printf(" %s(%d,%d)=%llu", row == 0 ? "data" : row == 1 ? "seen" : "ring",
                        f / jc::kMaxChunks, f % jc::kMaxChunks, static_cast<unsigned long long>(v));
          }
          std::printf("\n");
        }
      } else if (answered == 1) {
        std::printf("  flags: the copy did not finish in 4 s\n");
      }
      std::fflush(stdout);
      std::_Exit(3);
    }
  }).detach();
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("virtual TP=%d on one %s (sm_%d%d, %d SMs), M=%lld N=%lld K=%lld, batch %lld, "
              "%s in, %s out, %d calls each\n",
              tp, prop.name, prop.major, prop.minor, prop.multiProcessorCount, (long long)g.m,
              (long long)g.n, (long long)g.k, (long long)g_batch, g_f16 ? "f16" : "bf16",
              g_out_f32 ? "f32" : (g_f16 ? "f16" : "bf16"), calls);
  std::fflush(stdout);
  using S = ScheduleKind;
  const S kAgA = S::kAllGather1D_TilingCD_RotatingA, kAgB = S::kAllGather1D_TilingCD_RotatingB;
  const S kRsA = S::kReduceScatter1D_TilingA_RotatingC;
  const S kRsB = S::kReduceScatter1D_TilingB_RotatingC;
  const Case cases[] = {
      // schedule, RsPath, AllGather fused grid, AllGather chunks
      {kAgA, 0, true, 0},
      {kAgA, 0, true, 2},
      {kAgA, 0, false, 0},
      {kAgB, 0, true, 0},
      {kAgB, 0, true, 2},
      {kAgB, 0, false, 2},
      {kRsA, jdg::kRsAuto, true, 0},
      {kRsA, jdg::kRsRemoteC, true, 0},
      {kRsA, jdg::kRsCopyRing, true, 0},
      {kRsA, jdg::kRsGather, true, 0},
      {kRsB, jdg::kRsAuto, true, 0},
      {kRsB, jdg::kRsRemoteC, true, 0},
      {kRsB, jdg::kRsCopyRing, true, 0},
      // AllGather with the gathered operand (the ReduceScatter backward's; CopyGathered)
      {kAgA, 0, true, 0, true},
      {kAgA, 0, true, 2, true},
      {kAgA, 0, false, 0, true},
      {kAgB, 0, true, 0, true},
      {kAgB, 0, true, 2, true},
      {kAgB, 0, false, 2, true},
  };
  // The run's main streams (one per rank, for the whole run, created before any group's copy
  // streams), unless each case makes its own (--group-per-case 1).
  std::vector<cudaStream_t> run_streams;
  for (int r = 0; r < tp && !group_per_case; ++r) {
    cudaStream_t s;
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    run_streams.push_back(s);
  }
  if (sequence) {
    const bool ok = RunSequence(cases, int(sizeof(cases) / sizeof(cases[0])), tp, g, calls,
                                timeout_ms, run_streams);
    std::printf("%s\n", ok ? "ALL OK" : "FAILED");
    return ok ? 0 : 1;
  }
  bool all = true;
  int base = 1000;
  for (int i = 0; i < int(sizeof(cases) / sizeof(cases[0])); ++i, base += 100) {
    if (only >= 0 && i != only) continue;
    if (fault && !cases[i].gathered) continue;
    all = RunCase(cases[i], tp, g, calls, timeout_ms, base, run_streams) && all;
  }
  std::printf("%s\n", all ? "ALL OK" : "FAILED");
  return all ? 0 : 1;
}

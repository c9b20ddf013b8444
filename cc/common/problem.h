// The distributed GEMM problem as one device sees it: shapes, dtypes, and per-stage operand views.
//
// Shared by the CPU and CUDA executors.  Pure host code, no FFI or CUDA types, so that it can
// be unit-tested and reused by both handlers.  The Python wrapper validates the same rules first
// (jax_distgemm/_src/validation.py) with friendlier messages; this is the last line of defence
// before pointers are dereferenced.
#pragma once

#include <cstdint>
#include <string>

#include "cc/schedules/ring_1d.h"

namespace jax_distgemm {

enum class ElemType : int32_t {
  kBF16 = 0,
  kF16 = 1,
  kF32 = 2,
  kF8E4M3 = 3,  // float8_e4m3fn
  kF8E5M2 = 4,  // float8_e5m2
  kUnsupported = -1
};

inline bool IsFp8(ElemType t) { return t == ElemType::kF8E4M3 || t == ElemType::kF8E5M2; }
inline int64_t ElemSize(ElemType t) {
  return t == ElemType::kF32 ? 4 : IsFp8(t) ? 1 : 2;
}

// How fp8 operands are scaled (jax_distgemm/_src/fp8.py): fp32 scales, one per shard
// ([] each), or per block: x [L, xm, xk/128] (1x128), w [(L,) wk/128, wn/128] (128x128).
enum class Scaling : int32_t { kNone = 0, kTensor = 1, kBlock = 2 };
inline constexpr int64_t kScaleBlock = 128;
const char* ElemName(ElemType t);
const char* ScheduleName(ScheduleKind s);  // the Python Schedule's name, e.g. "AllGather1D_..."

// A matrix inside a (possibly batched) buffer, in elements: element (l, r, c) is at
// offset + l * batch_stride + r * ld + c.
struct MatrixView {
  int64_t offset = 0;
  int64_t ld = 0;
  int64_t batch_stride = 0;
};

// Shapes of the local operands, as stored on this device (row-major, batch dims folded to L):
//   x: [L, xm, xk]    w: [wk, wn] or [L, wk, wn]    out, c: [L, om, on]
struct Problem {
  ScheduleKind schedule = ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  int tp = 1;
  int64_t batch = 1;
  bool w_batched = false;
  int64_t xm = 0, xk = 0, wk = 0, wn = 0, om = 0, on = 0;
  ElemType in_type = ElemType::kBF16, out_type = ElemType::kBF16;
  ElemType w_type = ElemType::kBF16;  // in_type but for fp8, where x and w may differ
  Scaling scaling = Scaling::kNone;   // fp8 operands only (SetScales)
  // w (and its block scales) as the executor holds it: [wk, wn] row-major, or transposed,
  // [wn, wk] (the CUDA executor's fp8 GEMMs read B K-major); BView and BScaleView follow.
  bool w_k_major = false;
  bool has_c = false;
  float alpha = 1.f, beta = 0.f;

  // Per-stage GEMM extents: D[sm, sn] (+)= A[sm, sk] @ B[sk, sn].
  int64_t sm() const;
  int64_t sn() const;
  int64_t sk() const;

  // Views of the stage operands.  For AllGather the rotating operand (A for RotatingA, B for
  // RotatingB) is a whole shard, addressed through `ShardView` on whichever buffer holds it.
  MatrixView AView(int tile) const;    // into x (ReduceScatter, RotatingB) or a shard of x
  MatrixView BView(int tile) const;    // into w (AllGather RotatingA, ReduceScatter) or a shard
  MatrixView OutView(int tile) const;  // into out (and c): where this stage's tile lands
  // ReduceScatter running sums: packed [L, sm, sn] fp32 buffers, one per stage < TP-1.
  MatrixView PartialView() const;
  int64_t PartialElems() const { return batch * sm() * sn(); }

  // The gathered operand (CheckGathered) as rows: rank r's shard (packed, GatheredRows() rows
  // of GatheredWidth() elements) fills elements [r W, (r + 1) W) of each row of TP W.
  // RotatingA: a row per batch, W = xm xk; RotatingB: a row per row of w, W = wn.
  int64_t GatheredRows() const;
  int64_t GatheredWidth() const;

  // fp8 scales (elements of fp32) and the views of a stage's A and B scales, block scaling
  // only: a row of scales per row of x, one per 128-column block of w.
  int64_t XScaleElems() const;
  int64_t WScaleElems() const;
  MatrixView AScaleView(int tile) const;
  MatrixView BScaleView(int tile) const;

  int64_t XElems() const { return batch * xm * xk; }
  int64_t WElems() const { return (w_batched ? batch : 1) * wk * wn; }
  int64_t OutElems() const { return batch * om * on; }
  double Flops() const { return 2.0 * tp * batch * sm() * sn() * sk(); }
};

// What peers of a cross-process meeting must agree on, as text for the error that names a
// disagreement: schedule, TP, dtypes, local extents, c, alpha and beta.
std::string CallSignature(const Problem& p);

// Builds the problem from the local buffer shapes.  Returns an empty string on success, else a
// message that names the offending argument and the rule it breaks.
std::string MakeProblem(ScheduleKind schedule, int tp, const int64_t* x_dims, int x_rank,
                        const int64_t* w_dims, int w_rank, const int64_t* out_dims, int out_rank,
                        ElemType x_type, ElemType w_type, ElemType out_type, bool has_c,
                        const int64_t* c_dims, int c_rank, float alpha, float beta,
                        Problem* problem);

// fp8 operands: checks x_scale and w_scale (fp32; both scalars, or block scales of the shapes
// above) and the output dtype (bf16 or fp32) against `p`, and sets p->scaling.  "" or a
// message that names the argument and the rule.
std::string SetScales(const int64_t* xs_dims, int xs_rank, ElemType xs_type,
                      const int64_t* ws_dims, int ws_rank, ElemType ws_type, Problem* p);

// The gathered operand an AllGather call may also return (its second result): the rotating
// shard of every rank in rank order, i.e. x with TP * xm rows (RotatingA: [L, TP xm, xk]) or w
// with TP * wn columns (RotatingB: [wk, TP wn] or [L, wk, TP wn]), in the input dtype.  Checks
// `dims` (its shape) and `type` against `p`; "" or a message naming the rule.
std::string CheckGathered(const Problem& p, const int64_t* x_dims, int x_rank,
                          const int64_t* w_dims, int w_rank, const int64_t* dims, int rank,
                          ElemType type);

// Finds `device_id` in `groups` (num_groups x tp, row-major).  Returns its rank and group
// index, or -1 if absent.
int FindRank(const int64_t* groups, int64_t groups_size, int tp, int64_t device_id,
             int* group_index);

}  // namespace jax_distgemm

#include "cc/common/problem.h"

#include <sstream>

namespace jax_distgemm {

const char* ElemName(ElemType t) {
  switch (t) {
    case ElemType::kBF16: return "bfloat16";
    case ElemType::kF16: return "float16";
    case ElemType::kF32: return "float32";
    case ElemType::kF8E4M3: return "float8_e4m3fn";
    case ElemType::kF8E5M2: return "float8_e5m2";
    default: return "unsupported";
  }
}

const char* ScheduleName(ScheduleKind s) {
  switch (s) {
    case ScheduleKind::kAllGather1D_TilingCD_RotatingA: return "AllGather1D_TilingCD_RotatingA";
    case ScheduleKind::kAllGather1D_TilingCD_RotatingB: return "AllGather1D_TilingCD_RotatingB";
    case ScheduleKind::kReduceScatter1D_TilingA_RotatingC:
      return "ReduceScatter1D_TilingA_RotatingC";
    case ScheduleKind::kReduceScatter1D_TilingB_RotatingC:
      return "ReduceScatter1D_TilingB_RotatingC";
  }
  return "?";
}

std::string CallSignature(const Problem& p) {
  std::ostringstream s;
  s << ScheduleName(p.schedule) << " TP=" << p.tp << " " << ElemName(p.in_type);
  if (p.w_type != p.in_type) s << "x" << ElemName(p.w_type);
  if (p.scaling != Scaling::kNone) s << (p.scaling == Scaling::kTensor ? "/tensor" : "/block");
  s << "->" << ElemName(p.out_type) << " x[" << p.batch << "," << p.xm << "," << p.xk << "] w["
    << (p.w_batched ? std::to_string(p.batch) + "," : std::string()) << p.wk << "," << p.wn
    << "] c=" << (p.has_c ? "yes" : "no") << " alpha=" << p.alpha << " beta=" << p.beta;
  return s.str();
}

namespace {

std::string Dims(const int64_t* d, int r) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < r; ++i) s << (i ? ", " : "") << d[i];
  s << "]";
  return s.str();
}

}  // namespace

int64_t Problem::sm() const {
  return schedule == ScheduleKind::kReduceScatter1D_TilingA_RotatingC ? xm / tp : xm;
}
int64_t Problem::sn() const {
  return schedule == ScheduleKind::kReduceScatter1D_TilingB_RotatingC ? wn / tp : wn;
}
int64_t Problem::sk() const { return xk; }

MatrixView Problem::AView(int tile) const {
  MatrixView v{0, xk, xm * xk};
  if (schedule == ScheduleKind::kReduceScatter1D_TilingA_RotatingC) v.offset = tile * sm() * xk;
  return v;
}

MatrixView Problem::BView(int tile) const {
  const int64_t col = schedule == ScheduleKind::kReduceScatter1D_TilingB_RotatingC ? tile * sn()
                                                                                   : 0;
  if (w_k_major) return MatrixView{col * wk, wk, w_batched ? wk * wn : 0};
  return MatrixView{col, wn, w_batched ? wk * wn : 0};
}

MatrixView Problem::OutView(int tile) const {
  MatrixView v{0, on, om * on};
  switch (schedule) {
    case ScheduleKind::kAllGather1D_TilingCD_RotatingA: v.offset = tile * xm * on; break;
    case ScheduleKind::kAllGather1D_TilingCD_RotatingB: v.offset = tile * wn; break;
    default: break;  // ReduceScatter: the last stage writes the whole local output.
  }
  return v;
}

int64_t Problem::GatheredRows() const {
  return schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA ? batch
                                                                     : (w_batched ? batch : 1) * wk;
}
int64_t Problem::GatheredWidth() const {
  return schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA ? xm * xk : wn;
}

int64_t Problem::XScaleElems() const {
  return scaling == Scaling::kBlock ? batch * xm * (xk / kScaleBlock) : 1;
}
int64_t Problem::WScaleElems() const {
  return scaling == Scaling::kBlock ? (w_batched ? batch : 1) * (wk / kScaleBlock) *
                                          (wn / kScaleBlock)
                                    : 1;
}

MatrixView Problem::AScaleView(int tile) const {
  const int64_t kb = xk / kScaleBlock;
  return MatrixView{AView(tile).offset / xk * kb, kb, xm * kb};  // A's first row, its scales
}

MatrixView Problem::BScaleView(int tile) const {
  const int64_t kb = wk / kScaleBlock, nb = wn / kScaleBlock;
  const int64_t col_block =
      schedule == ScheduleKind::kReduceScatter1D_TilingB_RotatingC ? tile * sn() / kScaleBlock : 0;
  if (w_k_major) return MatrixView{col_block * kb, kb, w_batched ? kb * nb : 0};
  return MatrixView{col_block, nb, w_batched ? kb * nb : 0};
}

MatrixView Problem::PartialView() const { return MatrixView{0, sn(), sm() * sn()}; }

std::string MakeProblem(ScheduleKind schedule, int tp, const int64_t* x_dims, int x_rank,
                        const int64_t* w_dims, int w_rank, const int64_t* out_dims, int out_rank,
                        ElemType x_type, ElemType w_type, ElemType out_type, bool has_c,
                        const int64_t* c_dims, int c_rank, float alpha, float beta,
                        Problem* p) {
  std::ostringstream err;
  if (static_cast<int32_t>(schedule) < 0 || static_cast<int32_t>(schedule) >= kNumSchedules) {
    err << "schedule: unknown value " << static_cast<int32_t>(schedule);
    return err.str();
  }
  const char* name = ScheduleName(schedule);
  if (tp < 1) return "tp: must be >= 1";
  if (x_rank < 2) return "x: must have rank >= 2 ([..., rows, contraction]), got " +
                         Dims(x_dims, x_rank);
  if (w_rank != 2 && w_rank != x_rank)
    return "w: must have rank 2 or the rank of x (" + std::to_string(x_rank) + "), got " +
           Dims(w_dims, w_rank);
  if (x_type == ElemType::kUnsupported || w_type == ElemType::kUnsupported)
    return "x, w: dtype must be bfloat16, float16 or float32 (or, with scales, float8_e4m3fn "
           "or float8_e5m2)";
  if (x_type != w_type && !(IsFp8(x_type) && IsFp8(w_type)))
    return std::string("x, w: dtypes must match (or both be fp8), got ") + ElemName(x_type) +
           " and " + ElemName(w_type);
  if (out_type == ElemType::kUnsupported || IsFp8(out_type))
    return "out: dtype must be bfloat16, float16 or float32";

  p->schedule = schedule;
  p->tp = tp;
  p->batch = 1;
  for (int i = 0; i < x_rank - 2; ++i) p->batch *= x_dims[i];
  p->w_batched = w_rank > 2;
  if (p->w_batched) {
    for (int i = 0; i < x_rank - 2; ++i) {
      if (w_dims[i] != x_dims[i])
        return "w: batch dims must equal those of x, got x " + Dims(x_dims, x_rank) + " and w " +
               Dims(w_dims, w_rank);
    }
  }
  p->xm = x_dims[x_rank - 2];
  p->xk = x_dims[x_rank - 1];
  p->wk = w_dims[w_rank - 2];
  p->wn = w_dims[w_rank - 1];
  p->in_type = x_type;
  p->w_type = w_type;
  p->scaling = Scaling::kNone;
  p->out_type = out_type;
  p->has_c = has_c;
  p->alpha = alpha;
  p->beta = beta;

  if (p->xk != p->wk) {
    err << "x, w: contraction dims must match (x[..., K] with w[K, N]), got x "
        << Dims(x_dims, x_rank) << " and w " << Dims(w_dims, w_rank);
    return err.str();
  }
  const bool ag = IsAllGather(schedule);
  if (ag) {
    p->om = schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA ? p->xm * tp : p->xm;
    p->on = schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA ? p->wn : p->wn * tp;
  } else {
    if (schedule == ScheduleKind::kReduceScatter1D_TilingA_RotatingC && p->xm % tp != 0) {
      err << name << ": rows of x (M=" << p->xm << ") must be divisible by TP=" << tp;
      return err.str();
    }
    if (schedule == ScheduleKind::kReduceScatter1D_TilingB_RotatingC && p->wn % tp != 0) {
      err << name << ": columns of w (N=" << p->wn << ") must be divisible by TP=" << tp;
      return err.str();
    }
    p->om = schedule == ScheduleKind::kReduceScatter1D_TilingA_RotatingC ? p->xm / tp : p->xm;
    p->on = schedule == ScheduleKind::kReduceScatter1D_TilingB_RotatingC ? p->wn / tp : p->wn;
  }
  // out: [batch dims of x..., om, on]
  bool out_ok = out_rank == x_rank && out_dims[out_rank - 2] == p->om &&
                out_dims[out_rank - 1] == p->on;
  for (int i = 0; out_ok && i < x_rank - 2; ++i) out_ok = out_dims[i] == x_dims[i];
  if (!out_ok) {
    err << "out: expected shape [..., " << p->om << ", " << p->on << "] for " << name
        << " with TP=" << tp << ", got " << Dims(out_dims, out_rank);
    return err.str();
  }
  if (has_c) {
    bool c_ok = c_rank == out_rank;
    for (int i = 0; c_ok && i < c_rank; ++i) c_ok = c_dims[i] == out_dims[i];
    if (!c_ok) return "c: must have the output's shape " + Dims(out_dims, out_rank) + ", got " +
                      Dims(c_dims, c_rank);
  }
  return "";
}

std::string SetScales(const int64_t* xs_dims, int xs_rank, ElemType xs_type,
                      const int64_t* ws_dims, int ws_rank, ElemType ws_type, Problem* p) {
  if (!IsFp8(p->in_type) || !IsFp8(p->w_type)) {
    return std::string("x, w: scaled operands must be float8_e4m3fn or float8_e5m2, got ") +
           ElemName(p->in_type) + " and " + ElemName(p->w_type);
  }
  if (xs_type != ElemType::kF32 || ws_type != ElemType::kF32) {
    return "x_scale, w_scale: must be float32";
  }
  if (p->out_type != ElemType::kBF16 && p->out_type != ElemType::kF32) {
    return std::string("out: an fp8 call writes bfloat16 or float32, not ") +
           ElemName(p->out_type);
  }
  if (xs_rank == 0 && ws_rank == 0) {
    p->scaling = Scaling::kTensor;
    return "";
  }
  std::ostringstream err;
  if (p->xk % kScaleBlock != 0 || p->wn % kScaleBlock != 0) {
    err << "x, w: block scaling needs K=" << p->xk << " and N=" << p->wn
        << " to be multiples of " << kScaleBlock;
    return err.str();
  }
  if (p->schedule == ScheduleKind::kReduceScatter1D_TilingB_RotatingC &&
      p->sn() % kScaleBlock != 0) {
    err << "w: block scaling with " << ScheduleName(p->schedule) << " needs N/TP=" << p->sn()
        << " to be a multiple of " << kScaleBlock;
    return err.str();
  }
  const int64_t kb = p->xk / kScaleBlock, nb = p->wn / kScaleBlock;
  // x_scale: x's dims with K / 128 last; w_scale: w's batch dims, then [K / 128, N / 128].
  bool ok = xs_rank >= 2 && xs_dims[xs_rank - 1] == kb && xs_dims[xs_rank - 2] == p->xm &&
            ws_rank >= 2 && ws_dims[ws_rank - 2] == kb && ws_dims[ws_rank - 1] == nb &&
            (ws_rank == 2) == !p->w_batched;
  int64_t xs_batch = 1, ws_batch = 1;
  for (int i = 0; ok && i < xs_rank - 2; ++i) xs_batch *= xs_dims[i];
  for (int i = 0; ok && i < ws_rank - 2; ++i) ws_batch *= ws_dims[i];
  ok = ok && xs_batch == p->batch && ws_batch == (p->w_batched ? p->batch : 1);
  if (!ok) {
    err << "x_scale, w_scale: expected both scalars (per-tensor scaling) or block scales [..., "
        << p->xm << ", " << kb << "] and [" << (p->w_batched ? "..., " : "") << kb << ", " << nb
        << "], got " << Dims(xs_dims, xs_rank) << " and " << Dims(ws_dims, ws_rank);
    return err.str();
  }
  p->scaling = Scaling::kBlock;
  return "";
}

std::string CheckGathered(const Problem& p, const int64_t* x_dims, int x_rank,
                          const int64_t* w_dims, int w_rank, const int64_t* dims, int rank,
                          ElemType type) {
  if (!IsAllGather(p.schedule)) {
    return std::string("gathered: only an AllGather schedule returns its gathered operand, not ") +
           ScheduleName(p.schedule);
  }
  if (type != p.in_type) {
    return std::string("gathered: must have the inputs' dtype ") + ElemName(p.in_type) +
           ", got " + ElemName(type);
  }
  const bool rot_a = p.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  const int64_t* like = rot_a ? x_dims : w_dims;
  const int like_rank = rot_a ? x_rank : w_rank;
  const int scaled = rot_a ? like_rank - 2 : like_rank - 1;  // rows of x, columns of w
  bool ok = rank == like_rank;
  for (int i = 0; ok && i < rank; ++i) {
    ok = dims[i] == (i == scaled ? like[i] * p.tp : like[i]);
  }
  if (!ok) {
    std::ostringstream err;
    err << "gathered: expected " << (rot_a ? "x" : "w") << "'s shape " << Dims(like, like_rank)
        << " with dim " << scaled << " times TP=" << p.tp << ", got " << Dims(dims, rank);
    return err.str();
  }
  return "";
}

int FindRank(const int64_t* groups, int64_t groups_size, int tp, int64_t device_id,
             int* group_index) {
  if (tp <= 0 || groups_size % tp != 0) return -1;
  for (int64_t i = 0; i < groups_size; ++i) {
    if (groups[i] == device_id) {
      *group_index = static_cast<int>(i / tp);
      return static_cast<int>(i % tp);
    }
  }
  return -1;
}

}  // namespace jax_distgemm

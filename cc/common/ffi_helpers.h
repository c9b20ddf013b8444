// FFI-facing helpers shared by the CPU and CUDA handlers: dtype mapping, errors, decoding of
// the common buffers and attributes into a Problem.  Header-only; no CUDA here.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "cc/common/problem.h"
#include "cc/common/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace jax_distgemm {

namespace ffi = ::xla::ffi;

inline ElemType ToElemType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return ElemType::kBF16;
    case ffi::DataType::F16: return ElemType::kF16;
    case ffi::DataType::F32: return ElemType::kF32;
    case ffi::DataType::F8E4M3FN: return ElemType::kF8E4M3;
    case ffi::DataType::F8E5M2: return ElemType::kF8E5M2;
    default: return ElemType::kUnsupported;
  }
}

inline ffi::Error InvalidArgument(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_distgemm: " + msg);
}
inline ffi::Error Internal(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInternal, "jax_distgemm: " + msg);
}
inline ffi::Error DeadlineExceeded(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, "jax_distgemm: " + msg);
}

// The attributes every distgemm call carries (see jax_distgemm/_src/primitives.py).
struct CallAttrs {
  int32_t schedule;
  int64_t tp;
  ffi::Span<const int64_t> groups;  // num_groups x tp device ids, mesh order along the TP axis
  float alpha;
  float beta;
  int64_t call_id;     // identifies the call site within the program (rendezvous key)
  int64_t timeout_ms;  // bound on every wait for a peer
  int32_t rs_path;     // RsPath: the ReduceScatter path asked for, kRsAuto to choose per shape
};

// Decodes buffers + attributes into `problem`, fp8 operands too (DecodeFp8Problem adds
// their scales); the error names the argument at fault.
inline ffi::Error DecodeOperands(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                const ffi::AnyBuffer& c, const ffi::AnyBuffer& out,
                                const CallAttrs& a, Problem* problem) {
  if (a.tp < 1 || a.tp > 1024) return InvalidArgument("tp: must be in [1, 1024]");
  if (a.timeout_ms <= 0) return InvalidArgument("timeout_ms: must be positive");
  if (RsPathName(a.rs_path)[0] == '\0' && a.rs_path != kRsAuto) {
    return InvalidArgument("rs_path: unknown value " + std::to_string(a.rs_path) +
                           " (0 automatic, 1 remote_c, 2 copy_ring, 3 gather)");
  }
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out.dimensions();
  auto cd = c.dimensions();
  const bool has_c = c.element_count() > 0;
  if (has_c && c.element_type() != out.element_type())
    return InvalidArgument("c: must have the output dtype");
  std::string err = MakeProblem(
      static_cast<ScheduleKind>(a.schedule), static_cast<int>(a.tp), xd.begin(),
      static_cast<int>(xd.size()), wd.begin(), static_cast<int>(wd.size()), od.begin(),
      static_cast<int>(od.size()), ToElemType(x.element_type()), ToElemType(w.element_type()),
      ToElemType(out.element_type()), has_c, cd.begin(), static_cast<int>(cd.size()), a.alpha,
      a.beta, problem);
  if (!err.empty()) return InvalidArgument(err);
  return ffi::Error::Success();
}

// DecodeOperands for the unscaled targets.
inline ffi::Error DecodeProblem(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                const ffi::AnyBuffer& c, const ffi::AnyBuffer& out,
                                const CallAttrs& a, Problem* problem) {
  if (ffi::Error e = DecodeOperands(x, w, c, out, a, problem); e.failure()) return e;
  if (IsFp8(problem->in_type)) {
    return InvalidArgument("x, w: fp8 operands go with their scales (the fp8 target)");
  }
  return ffi::Error::Success();
}

// DecodeProblem for the fp8 target: x and w fp8 with their fp32 scales (SetScales).
inline ffi::Error DecodeFp8Problem(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scale,
                                   const ffi::AnyBuffer& w, const ffi::AnyBuffer& w_scale,
                                   const ffi::AnyBuffer& c, const ffi::AnyBuffer& out,
                                   const CallAttrs& a, Problem* problem) {
  Problem p;
  if (ffi::Error e = DecodeOperands(x, w, c, out, a, &p); e.failure()) return e;
  auto xs = x_scale.dimensions();
  auto ws = w_scale.dimensions();
  std::string err = SetScales(xs.begin(), static_cast<int>(xs.size()),
                              ToElemType(x_scale.element_type()), ws.begin(),
                              static_cast<int>(ws.size()), ToElemType(w_scale.element_type()), &p);
  if (!err.empty()) return InvalidArgument(err);
  *problem = p;
  return ffi::Error::Success();
}

// Checks an AllGather call's optional second result, the gathered operand (CheckGathered).
inline ffi::Error DecodeGathered(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                 const ffi::AnyBuffer& gathered, const Problem& p) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto gd = gathered.dimensions();
  std::string err = CheckGathered(p, xd.begin(), static_cast<int>(xd.size()), wd.begin(),
                                  static_cast<int>(wd.size()), gd.begin(),
                                  static_cast<int>(gd.size()),
                                  ToElemType(gathered.element_type()));
  if (!err.empty()) return InvalidArgument(err);
  return ffi::Error::Success();
}

// Rank of `device_id` in the call's TP groups and the index of its group, or an error.
inline ffi::Error LocateDevice(const CallAttrs& a, int64_t device_id, int* rank, int* group) {
  *rank = FindRank(a.groups.begin(), static_cast<int64_t>(a.groups.size()),
                   static_cast<int>(a.tp), device_id, group);
  if (*rank < 0) {
    return InvalidArgument("device " + std::to_string(device_id) +
                           " is not in the TP groups of this call");
  }
  return ffi::Error::Success();
}

}  // namespace jax_distgemm

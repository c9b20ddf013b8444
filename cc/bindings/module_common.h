// Helpers shared by the nanobind modules (CPU and CUDA).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cc/common/device_ids.h"
#include "cc/common/problem.h"
#include "cc/common/shm_exchange.h"
#include "cc/common/workspace.h"
#include "cc/schedules/ring_1d.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/c_api.h"

namespace jax_distgemm {

template <typename T>
nanobind::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// The multi-process hooks (each module has its own copy of the shared-memory state, so Python
// sets the job token in both): job token and this process's segments.
inline void AddShmBindings(nanobind::module_& m) {
  m.def("set_job_token", [](const std::string& token) {
    if (std::string err = SetShmJobToken(token); !err.empty()) {
      throw nanobind::value_error(err.c_str());
    }
  }, "Names the shared-memory segments of cross-process TP groups (same in every process).");
  m.def("job_token", &ShmJobToken);
  m.def("shm_segments", &OwnShmSegments,
        "Shared-memory segments this process created and has not unlinked.");
  m.def("release_shm_segments", &ReleaseShmSegments,
        "Unlinks this process's shared-memory segments (also done at exit); returns their names.");
  m.def("sweep_stale_shm_segments", &SweepStaleShmSegments,
        "Unlinks segments left by processes that no longer exist; returns their names.");
}

// The schedule table as a list of (device, stage, output_tile, source, push_target).
inline std::vector<std::tuple<int, int, int, int, int>> ScheduleTableList(int schedule, int tp) {
  std::vector<ScheduleEntry> entries(static_cast<size_t>(tp) * tp);
  ScheduleTable(static_cast<ScheduleKind>(schedule), tp, entries.data());
  std::vector<std::tuple<int, int, int, int, int>> out;
  for (const auto& e : entries) {
    out.emplace_back(e.device, e.stage, e.output_tile, e.source, e.push_target);
  }
  return out;
}

// The problem of one device from the local shapes Python has before lowering: x [..., xm, xk],
// w [wk, wn] or batched like x, dtypes by name ("bfloat16", "float16", "float32"); out follows
// from the schedule.  Raises ValueError with MakeProblem's message where they do not fit.
inline Problem LocalProblem(int schedule, int tp, const std::vector<int64_t>& x,
                            const std::vector<int64_t>& w, const std::string& in_dtype,
                            const std::string& out_dtype, const std::string& scaling = "") {
  auto elem = [](const std::string& name) {
    for (ElemType t : {ElemType::kBF16, ElemType::kF16, ElemType::kF32, ElemType::kF8E4M3,
                       ElemType::kF8E5M2}) {
      if (name == ElemName(t)) return t;
    }
    throw nanobind::value_error(
        ("dtype: bfloat16, float16, float32, float8_e4m3fn or float8_e5m2, got " + name).c_str());
  };
  const ElemType in = elem(in_dtype), out = elem(out_dtype);
  if (x.size() < 2 || w.size() < 2 || tp < 1) {
    throw nanobind::value_error("x_shape, w_shape: rank >= 2; tp: >= 1");
  }
  std::vector<int64_t> o(x.begin(), x.end() - 2);
  const int64_t xm = x[x.size() - 2], wn = w.back();
  switch (static_cast<ScheduleKind>(schedule)) {
    case ScheduleKind::kAllGather1D_TilingCD_RotatingA: o.insert(o.end(), {xm * tp, wn}); break;
    case ScheduleKind::kAllGather1D_TilingCD_RotatingB: o.insert(o.end(), {xm, wn * tp}); break;
    case ScheduleKind::kReduceScatter1D_TilingA_RotatingC: o.insert(o.end(), {xm / tp, wn}); break;
    case ScheduleKind::kReduceScatter1D_TilingB_RotatingC: o.insert(o.end(), {xm, wn / tp}); break;
    default: o.insert(o.end(), {xm, wn});  // MakeProblem names the schedule
  }
  Problem p;
  const std::string err = MakeProblem(
      static_cast<ScheduleKind>(schedule), tp, x.data(), static_cast<int>(x.size()), w.data(),
      static_cast<int>(w.size()), o.data(), static_cast<int>(o.size()), in, in, out,
      /*has_c=*/false, nullptr, 0, 1.f, 0.f, &p);
  if (!err.empty()) throw nanobind::value_error(err.c_str());
  if (scaling == "tensor" || scaling == "block") {
    p.scaling = scaling == "tensor" ? Scaling::kTensor : Scaling::kBlock;
  } else if (!scaling.empty()) {
    throw nanobind::value_error(("scaling: '', 'tensor' or 'block', got " + scaling).c_str());
  }
  return p;
}

inline void CheckRsPath(int rs_path) {
  if (rs_path != kRsAuto && RsPathName(rs_path)[0] == '\0') {
    throw nanobind::value_error(("override: unknown RsPath " + std::to_string(rs_path)).c_str());
  }
}

// The ReduceScatter path and the workspace size of a call, from cc/common/workspace.h: the one
// rule of both executors, which Python asks (through the CPU module, always built) to check
// the workspace cap before launch.  Shapes are the local (per-device) ones.
inline void AddWorkspaceBindings(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "rs_path",
      [](int schedule, int tp, const std::vector<int64_t>& x_shape,
         const std::vector<int64_t>& w_shape, int override_path) -> std::string {
        CheckRsPath(override_path);
        const Problem p = LocalProblem(schedule, tp, x_shape, w_shape, "bfloat16", "bfloat16");
        if (IsAllGather(p.schedule)) return "";
        return RsPathName(ChooseRsPath(p, override_path));
      },
      nb::arg("schedule"), nb::arg("tp"), nb::arg("x_shape"), nb::arg("w_shape"),
      nb::arg("override") = 0,
      "The ReduceScatter data path ('remote_c', 'copy_ring' or 'gather') of a call of `schedule` "
      "(its int value) at `tp` on local operands of these shapes, with `override` the RsPath the "
      "call asks for (0: automatic; the rs_path attribute); '' for an AllGather schedule.  "
      "ValueError where the shapes do not make a call.");
  m.def(
      "workspace_bytes",
      [](int schedule, int tp, const std::vector<int64_t>& x_shape,
         const std::vector<int64_t>& w_shape, const std::string& in_dtype,
         const std::string& out_dtype, int override_path,
         const std::string& scaling) -> uint64_t {
        CheckRsPath(override_path);
        return WorkspaceBytes(
            LocalProblem(schedule, tp, x_shape, w_shape, in_dtype, out_dtype, scaling),
            override_path);
      },
      nb::arg("schedule"), nb::arg("tp"), nb::arg("x_shape"), nb::arg("w_shape"),
      nb::arg("in_dtype"), nb::arg("out_dtype"), nb::arg("override") = 0,
      nb::arg("scaling") = "",
      "Bytes of symmetric workspace per device the CUDA executor needs for a call of `schedule` "
      "at `tp` on local operands of these shapes and dtypes (names: 'bfloat16', 'float16', "
      "'float32', 'float8_e4m3fn', 'float8_e5m2'), with `override` as for rs_path; fp8: "
      "`scaling` 'tensor' or 'block' (their scales travel in the slots).  ValueError where they "
      "do not make a call.");
}

}  // namespace jax_distgemm

// Helpers shared by the nanobind modules (CPU and CUDA).
#pragma once

#include <tuple>
#include <type_traits>
#include <vector>

#include "cc/common/device_ids.h"
#include "cc/common/shm_exchange.h"
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

}  // namespace jax_distgemm

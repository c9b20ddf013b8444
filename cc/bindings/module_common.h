// Helpers shared by the nanobind modules (CPU and CUDA).
#pragma once

#include <tuple>
#include <type_traits>
#include <vector>

#include "cc/common/device_ids.h"
#include "cc/schedules/ring_1d.h"
#include "nanobind/nanobind.h"
#include "xla/ffi/api/c_api.h"

namespace jax_distgemm {

template <typename T>
nanobind::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
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

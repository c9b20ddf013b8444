// Python module for the CPU executor: the FFI registrations, plus the small host-side hooks the
// Python package needs (device-id table, the multi-process job token and shared-memory segments,
// schedule table for tests, fault injection for tests).
#include <cstdint>
#include <string>
#include <vector>

#include "cc/bindings/module_common.h"
#include "cc/cpu/distgemm_cpu.h"
#include "cc/cpu/shm_exchange.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"

namespace nb = nanobind;

NB_MODULE(_distgemm_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_distgemm_v1"] = jax_distgemm::EncapsulateFfiHandler(jax_distgemm::DistGemmCpu);
    return d;
  });
  m.def("set_device_ids", [](std::vector<int32_t> ordinals, std::vector<int64_t> ids) {
    jax_distgemm::SetDeviceIds(jax_distgemm::kPlatformCpu, ordinals, ids);
  });
  m.def("set_job_token", [](const std::string& token) {
    if (std::string err = jax_distgemm::SetShmJobToken(token); !err.empty()) {
      throw nb::value_error(err.c_str());
    }
  }, "Names the shared-memory segments of cross-process TP groups (same in every process).");
  m.def("job_token", &jax_distgemm::ShmJobToken);
  m.def("shm_segments", &jax_distgemm::OwnShmSegments,
        "Shared-memory segments this process created and has not unlinked.");
  m.def("release_shm_segments", &jax_distgemm::ReleaseShmSegments,
        "Unlinks this process's shared-memory segments (also done at exit); returns their names.");
  m.def("sweep_stale_shm_segments", &jax_distgemm::SweepStaleShmSegments,
        "Unlinks segments left by processes that no longer exist; returns their names.");
  m.def("schedule_table", &jax_distgemm::ScheduleTableList);
  m.def("set_fault_device", &jax_distgemm::SetCpuFaultDevice, nb::arg("device"),
        nb::arg("phase") = -1,
        "Test hook: the handler on this device (global id, the ordinal in one process) stops "
        "before barrier `phase` (-1: skips its peers entirely); -1 disables.");
}

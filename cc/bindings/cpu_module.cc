// Python module for the CPU executor: the FFI registrations, plus the small host-side hooks the
// Python package needs (device-id table, the multi-process job token and shared-memory segments,
// schedule table for tests, fault injection for tests).
#include <cstdint>
#include <string>
#include <vector>

#include "cc/bindings/module_common.h"
#include "cc/cpu/distgemm_cpu.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"

namespace nb = nanobind;

NB_MODULE(_distgemm_cpu, m) {
  m.def("registrations", []() {
    nb::dict stages;  // per call site: the instantiate stage's state names it (distgemm_cpu.cc)
    stages["instantiate"] =
        jax_distgemm::EncapsulateFfiHandler(jax_distgemm::DistGemmCpuInstantiate);
    stages["execute"] = jax_distgemm::EncapsulateFfiHandler(jax_distgemm::DistGemmCpu);
    nb::dict d;
    d["jax_distgemm_v1"] = stages;
    // The same handler, for calls that also return the gathered operand (primitives.py says
    // why they have a name of their own).
    d["jax_distgemm_gathered_v1"] = stages;
    nb::dict fp8_stages;  // fp8 x and w with their scales: operands of their own
    fp8_stages["instantiate"] = stages["instantiate"];
    fp8_stages["execute"] = jax_distgemm::EncapsulateFfiHandler(jax_distgemm::DistGemmFp8Cpu);
    d["jax_distgemm_fp8_v1"] = fp8_stages;
    return d;
  });
  m.def("types", []() {  // the FFI state types, for jax.ffi.register_ffi_type
    nb::dict site;
    site["type_id"] = nb::capsule(reinterpret_cast<void*>(jax_distgemm::CallSiteTypeId()));
    site["type_info"] = nb::capsule(
        const_cast<void*>(reinterpret_cast<const void*>(jax_distgemm::CallSiteTypeInfo())));
    nb::dict d;
    d["jax_distgemm_cpu_call_site"] = site;
    return d;
  });
  m.def("set_device_ids", [](std::vector<int32_t> ordinals, std::vector<int64_t> ids) {
    jax_distgemm::SetDeviceIds(jax_distgemm::kPlatformCpu, ordinals, ids);
  });
  jax_distgemm::AddShmBindings(m);
  m.def("schedule_table", &jax_distgemm::ScheduleTableList);
  jax_distgemm::AddWorkspaceBindings(m);  // the CUDA executor's path and workspace rule
  m.def("set_fault_device", &jax_distgemm::SetCpuFaultDevice, nb::arg("device"),
        nb::arg("phase") = -1,
        "Test hook: the handler on this device (global id, the ordinal in one process) stops "
        "before barrier `phase` (-1: skips its peers entirely); -1 disables.");
}

// Python module for the CUDA executor: the FFI registrations plus the host hooks the package
// needs (device-id table, recovery, tuning report, test hooks).
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime.h>

#include "cc/bindings/module_common.h"
#include "cc/cuda/autotune.h"
#include "cc/cuda/distgemm_cuda.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"

namespace nb = nanobind;

NB_MODULE(_distgemm_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_distgemm_v1"] = jax_distgemm::EncapsulateFfiHandler(jax_distgemm::cuda::DistGemmCuda);
    // The same handler, for calls that also return the gathered operand (primitives.py).
    d["jax_distgemm_gathered_v1"] =
        jax_distgemm::EncapsulateFfiHandler(jax_distgemm::cuda::DistGemmCuda);
    // fp8 x and w with their scales, and a scratch result for w^T (primitives.py).
    d["jax_distgemm_fp8_v1"] =
        jax_distgemm::EncapsulateFfiHandler(jax_distgemm::cuda::DistGemmFp8Cuda);
    return d;
  });
  m.def("set_device_ids", [](std::vector<int32_t> ordinals, std::vector<int64_t> ids) {
    jax_distgemm::SetDeviceIds(jax_distgemm::kPlatformCuda, ordinals, ids);
  });
  jax_distgemm::AddShmBindings(m);  // cross-process groups: the setup meeting (peer_ipc.cc)
  m.def("schedule_table", &jax_distgemm::ScheduleTableList);
  jax_distgemm::AddWorkspaceBindings(m);
  m.def("reset", &jax_distgemm::cuda::ResetAll,
        "Drain all devices, move their epochs past any a late peer can write, clear the "
        "sticky error. Returns '' or an error.");
  m.def("pending_error", &jax_distgemm::cuda::PendingErrors);
  m.def("describe_tuning", &jax_distgemm::cuda::DescribeTuning);
  m.def(
      "export_tuning",
      []() {
        // Every settled choice as a dict (autotune.h, TuningRecord; jax_distgemm.save_tuning).
        nb::list out;
        for (const auto& r : jax_distgemm::cuda::ExportTuning()) {
          nb::dict d;
          d["gpu"] = r.gpu;
          d["sm_count"] = r.sm_count;
          d["ab_type"] = r.ab_type;
          d["d_type"] = r.d_type;
          d["has_c"] = r.has_c;
          d["m"] = r.m;
          d["n"] = r.n;
          d["k"] = r.k;
          d["batch"] = r.batch;
          d["shared_b"] = r.shared_b;
          d["fused_stages"] = r.fused_stages;
          d["config"] = r.config;
          d["raster"] = r.raster;
          d["swizzle"] = r.swizzle;
          d["ms"] = r.ms;
          out.append(d);
        }
        return out;
      });
  m.def(
      "import_tuning",
      [](nb::list records) {
        // The inverse of export_tuning (jax_distgemm.load_tuning, which checks the fields'
        // presence and types first).  Returns how many (record, device) pairs were installed.
        std::vector<jax_distgemm::cuda::TuningRecord> rs;
        for (nb::handle h : records) {
          nb::dict d = nb::cast<nb::dict>(h);
          jax_distgemm::cuda::TuningRecord r;
          r.gpu = nb::cast<std::string>(d["gpu"]);
          r.sm_count = nb::cast<int>(d["sm_count"]);
          r.ab_type = nb::cast<std::string>(d["ab_type"]);
          r.d_type = nb::cast<std::string>(d["d_type"]);
          r.has_c = nb::cast<bool>(d["has_c"]);
          r.m = nb::cast<int64_t>(d["m"]);
          r.n = nb::cast<int64_t>(d["n"]);
          r.k = nb::cast<int64_t>(d["k"]);
          r.batch = nb::cast<int64_t>(d["batch"]);
          r.shared_b = nb::cast<bool>(d["shared_b"]);
          r.fused_stages = nb::cast<int>(d["fused_stages"]);
          r.config = nb::cast<std::string>(d["config"]);
          r.raster = nb::cast<int>(d["raster"]);
          r.swizzle = nb::cast<int>(d["swizzle"]);
          r.ms = nb::cast<float>(d["ms"]);
          rs.push_back(r);
        }
        int installed = 0;
        if (std::string err = jax_distgemm::cuda::ImportTuning(rs, &installed); !err.empty()) {
          throw nb::value_error(err.c_str());
        }
        return installed;
      },
      nb::arg("records"));
  m.def("clear_tuning", &jax_distgemm::cuda::ClearTuning,
        "Forget every tuned choice: each shape tunes again at its next call.");
  m.def("copy_stream_reports", &jax_distgemm::cuda::CopyStreamReports,
        "(ordinal, candidates, independent, note, group, rank) per initialized device of each "
        "peer group: how many streams were tried for its copy stream and whether a blocked wait "
        "on the kept one leaves XLA's compute stream free (1 yes, 0 no, -1 not probed); group: "
        "the members' local ordinals in rank order (-1: another process's), rank: this "
        "device's.");
  m.def("last_rs_paths", &jax_distgemm::cuda::LastRsPaths,
        "(ordinal, group, path) per initialized device of each peer group: the ReduceScatter "
        "data path its last ReduceScatter call took (remote_c, copy_ring, gather; '' if none "
        "yet); group as in copy_stream_reports.");
  m.def("set_fault_device", &jax_distgemm::cuda::SetCudaFaultDevice, nb::arg("ordinal"),
        nb::arg("kind") = 0,
        "Test hook: this device ordinal (-1: none) misbehaves; kind 0: it never delivers to its "
        "peers, kind 1: it never marks its own AllGather pushes done (its grid's join times out).");
  m.def("mem_get_info", [](int ordinal) {
    // (free, total) bytes of a device, counting memory outside XLA's pool (our workspace).
    size_t free_b = 0, total_b = 0;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(ordinal);
    cudaMemGetInfo(&free_b, &total_b);
    cudaSetDevice(prev);
    return std::make_tuple(free_b, total_b);
  });
  m.def("set_sync_check", &jax_distgemm::cuda::SetSyncCheck,
        "Synchronize after every call so that a timed-out wait fails that same call.");
}

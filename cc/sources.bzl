# Source lists of the C++/CUDA extension: the single source of truth for both builds.
# cc/BUILD load()s this file; CMakeLists.txt exec()s it as Python.  Keep it valid Starlark AND
# valid Python: assignments of plain lists of strings, paths relative to cc/.
# tests/build_sources_test.py fails if a file under cc/ is missing here or in either build.

# Host code shared by the CPU and CUDA executors.
COMMON_SRCS = [
    "common/device_ids.cc",
    "common/problem.cc",
    "common/rendezvous.cc",
]
COMMON_HDRS = [
    "common/device_ids.h",
    "common/ffi_helpers.h",
    "common/problem.h",
    "common/rendezvous.h",
    "schedules/ring_1d.h",
]

# CPU executor (always built).
CPU_SRCS = [
    "cpu/distgemm_cpu.cc",
    "cpu/gemm_cpu.cc",
]
CPU_HDRS = [
    "cpu/distgemm_cpu.h",
    "cpu/gemm_cpu.h",
]
CPU_MODULE_SRCS = [
    "bindings/cpu_module.cc",
]
MODULE_HDRS = [
    "bindings/module_common.h",
]

# CUDA executor (built when nvcc is found; sm_90a).
CUDA_HOST_SRCS = []
CUDA_KERNEL_SRCS = []
CUDA_HDRS = []
CUDA_MODULE_SRCS = []

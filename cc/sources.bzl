# Source lists of the C++/CUDA extension: the single source of truth for both builds.
# cc/BUILD load()s this file; CMakeLists.txt exec()s it as Python.  Keep it valid Starlark AND
# valid Python: assignments of plain lists of strings, paths relative to cc/.
# tests/build_sources_test.py fails if a file under cc/ is missing here or in either build.

# Host code shared by the CPU and CUDA executors.
COMMON_SRCS = [
    "common/device_ids.cc",
    "common/problem.cc",
    "common/rendezvous.cc",
    "common/workspace.cc",
    "common/shm_exchange.cc",
]
COMMON_HDRS = [
    "common/device_ids.h",
    "common/env.h",
    "common/ffi_helpers.h",
    "common/problem.h",
    "common/rendezvous.h",
    "common/shm_exchange.h",
    "common/workspace.h",
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
CUDA_HOST_SRCS = [
    "cuda/all_gather.cc",
    "cuda/autotune.cc",
    "cuda/copy_stream.cc",
    "cuda/distgemm_cuda.cc",
    "cuda/executor.cc",
    "cuda/gemm_registry.cc",
    "cuda/peer_ipc.cc",
    "cuda/peer_state.cc",
    "cuda/reduce_scatter.cc",
]
CUDA_KERNEL_SRCS = [
    "cuda/sm90_fused_gemm_bf16_bf16_coop128x256.cu",
    "cuda/sm90_fused_gemm_bf16_bf16_coop128x256_c1x1.cu",
    "cuda/sm90_fused_gemm_bf16_bf16_coop256x128_c2x1.cu",
    "cuda/sm90_fused_gemm_bf16_bf16_coop256x192_c1x1.cu",
    "cuda/sm90_fused_gemm_bf16_bf16_pingpong128x128_c1x2.cu",
    "cuda/sm90_gemm_bf16_bf16_coop128x256.cu",
    "cuda/sm90_gemm_bf16_bf16_coop128x256_c1x1.cu",
    "cuda/sm90_gemm_bf16_bf16_coop128x256_c1x2.cu",
    "cuda/sm90_gemm_bf16_bf16_coop256x128.cu",
    "cuda/sm90_gemm_bf16_bf16_coop256x128_c2x1.cu",
    "cuda/sm90_gemm_bf16_bf16_coop256x192_c1x1.cu",
    "cuda/sm90_gemm_bf16_bf16_pingpong128x128_c1x2.cu",
    "cuda/sm90_gemm_bf16_bf16_pingpong128x128_c2x1.cu",
    "cuda/sm90_gemm_bf16_f32_coop128x256.cu",
    "cuda/sm90_gemm_f16_f16_coop128x256.cu",
    "cuda/sm90_gemm_f16_f32_coop128x256.cu",
]
CUDA_HDRS = [
    "cuda/autotune.h",
    "cuda/copy_stream.h",
    "cuda/cuda_check.h",
    "cuda/distgemm_cuda.h",
    "cuda/executor.h",
    "cuda/executor_internal.h",
    "cuda/gemm_kernels.h",
    "cuda/peer_state.h",
    "cuda/sm90_fused_gemm.cuh",
    "cuda/sm90_gemm.cuh",
    "cuda/stage_sync.h",
    "cuda/stage_sync_device.cuh",
]
CUDA_MODULE_SRCS = [
    "bindings/cuda_module.cc",
]

# fp8 stage GEMMs (cuda/fp8_gemm.h) with their registry: part of the kernel library, a list of
# their own.
CUDA_FP8_SRCS = [
    "cuda/fp8_gemm.cc",
    "cuda/sm90_fp8_gemm_block_e4m3_e4m3_coop128x128_c1x2.cu",
    "cuda/sm90_fp8_gemm_block_e4m3_e4m3_split128x256_c2x1.cu",
    "cuda/sm90_fp8_gemm_tensor_e4m3_e4m3_split128x256.cu",
    "cuda/sm90_fp8_gemm_tensor_e4m3_e4m3_stagger128x192.cu",
    "cuda/sm90_fp8_gemm_tensor_e5m2_e4m3_split128x256.cu",
    "cuda/sm90_fp8_gemm_tensor_e5m2_e4m3_stagger128x192.cu",
]
CUDA_FP8_HDRS = [
    "cuda/fp8_gemm.h",
    "cuda/sm90_fp8_gemm.cuh",
    "cuda/sm90_fp8_split_mainloop.cuh",
    "cuda/sm90_fp8_staggered_mainloop.cuh",
    "cuda/sm90_fp8_warpgroup_operands.cuh",
]

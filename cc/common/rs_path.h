// ReduceScatter data-path switches (JAX_DISTGEMM_RS_PATH, JAX_DISTGEMM_RS_FUSED): their values'
// names, read in one place for both executors.
//
// The CUDA executor runs every path (executor.h says what each does, ChooseRsPath picks one);
// the CPU executor runs only the gather path's order of events, where RsGatherChosen
// (problem.h) says the CUDA executor would gather.  Pure host code.
#pragma once

namespace jax_distgemm {

// JAX_DISTGEMM_RS_PATH=remote_c|push|copy_add|copy_ring|gather; unset or any other value is
// kRsAuto (the executor chooses per shape).
enum RsPath : int {
  kRsAuto = 0, kRsRemoteC = 1, kRsPush = 2, kRsCopyAdd = 3, kRsCopyRing = 4, kRsGather = 5
};

// JAX_DISTGEMM_RS_FUSED=0|1|all; unset or any other value is kRsFusedOff.
enum RsFused : int { kRsFusedOff = 0, kRsFusedOn = 1, kRsFusedAll = 2 };

// The environment variable's value for `path` ("" for kRsAuto or an unknown value).
const char* RsPathName(int path);

// NOTE: read per call, not cached, so that a benchmark or test can compare paths in one
// process.  Every process of a group must see the same values (the paths' slots differ).
RsPath RsPathFromEnv();
RsFused RsFusedFromEnv();

}  // namespace jax_distgemm

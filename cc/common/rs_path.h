// ReduceScatter data-path switch (JAX_DISTGEMM_RS_PATH): its values' names, read in one place
// for both executors.
//
// The CUDA executor runs every path (executor.h says what each does, ChooseRsPath picks one);
// the CPU executor runs only the gather path's order of events, where RsGatherChosen
// (problem.h) says the CUDA executor would gather.  Pure host code.
#pragma once

namespace jax_distgemm {

// JAX_DISTGEMM_RS_PATH=remote_c|copy_ring|gather; unset or any other value is kRsAuto (the
// executor chooses per shape).
enum RsPath : int { kRsAuto = 0, kRsRemoteC = 1, kRsCopyRing = 2, kRsGather = 3 };

// The environment variable's value for `path` ("" for kRsAuto or an unknown value).
const char* RsPathName(int path);

// NOTE: read per call, not cached, so that a benchmark or test can compare paths in one
// process.  Every process of a group must see the same values (the paths' slots differ).
RsPath RsPathFromEnv();

}  // namespace jax_distgemm

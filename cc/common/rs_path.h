// The ReduceScatter data paths by name, for both executors.  A call carries the path it asks for
// as its `rs_path` attribute (jax_distgemm/_src/config.py reads JAX_DISTGEMM_RS_PATH at
// lowering, so that every device of the call agrees).
//
// The CUDA executor runs every path (executor.h says what each does, ChooseRsPath picks one);
// the CPU executor runs only the gather path's order of events, where RsGatherChosen
// (problem.h) says the CUDA executor would gather.  Pure host code.
#pragma once

namespace jax_distgemm {

// kRsAuto: the executor chooses per shape.  The values are the attribute's (and Python's
// config.RS_PATHS).
enum RsPath : int { kRsAuto = 0, kRsRemoteC = 1, kRsCopyRing = 2, kRsGather = 3 };

// JAX_DISTGEMM_RS_PATH's name for `path` ("" for kRsAuto or an unknown value).
const char* RsPathName(int path);

}  // namespace jax_distgemm

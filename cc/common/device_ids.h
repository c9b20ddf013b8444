// Maps this process's device ordinals (what ffi::DeviceOrdinal gives a handler) to the global
// device ids that the `groups` attribute is written in.  Python fills it once per platform at
// import (jax_distgemm/ffi/__init__.py); with one process the two are equal, which is the
// default when nothing was registered.
#pragma once

#include <cstdint>
#include <vector>

namespace jax_distgemm {

// Registers pairs (ordinal[i] -> global_id[i]) for one platform table.
void SetDeviceIds(int platform, const std::vector<int32_t>& ordinals,
                  const std::vector<int64_t>& global_ids);
// Global id of `ordinal`, or `ordinal` itself when no table was registered.
int64_t GlobalDeviceId(int platform, int32_t ordinal);
// The local ordinal of global id `id`: its registered ordinal, -1 when a table is registered
// and `id` is not in it (a device of another process), `id` itself when none is (one process).
int32_t LocalOrdinal(int platform, int64_t id);
// Whether global id `id` is a device of this process: one of the registered ids, or any id
// when no table was registered (one process).  The CPU executor meets a TP group with a
// member that is not local across processes (cc/common/shm_exchange.h).
bool IsLocalDeviceId(int platform, int64_t id);

inline constexpr int kPlatformCpu = 0;
inline constexpr int kPlatformCuda = 1;

}  // namespace jax_distgemm

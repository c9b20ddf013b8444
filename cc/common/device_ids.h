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

inline constexpr int kPlatformCpu = 0;
inline constexpr int kPlatformCuda = 1;

}  // namespace jax_distgemm

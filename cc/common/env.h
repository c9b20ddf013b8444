// Environment switches (JAX_DISTGEMM_*), read the same way everywhere.
#pragma once

#include <cstdlib>
#include <cstring>

namespace jax_distgemm {

// True when `name` is set to exactly `value`.
inline bool EnvEquals(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e != nullptr && std::strcmp(e, value) == 0;
}

// True when `name` is set to "1".
inline bool EnvFlag(const char* name) { return EnvEquals(name, "1"); }

}  // namespace jax_distgemm

#include "cc/common/rs_path.h"

#include "cc/common/env.h"

namespace jax_distgemm {
namespace {

// -- The one table of JAX_DISTGEMM_RS_PATH's names ------------------------------------------------

struct RsPathEntry {
  RsPath path;
  const char* name;
};
constexpr RsPathEntry kRsPathNames[] = {
    {kRsRemoteC, "remote_c"}, {kRsCopyRing, "copy_ring"}, {kRsGather, "gather"}};

}  // namespace

const char* RsPathName(int path) {
  for (const RsPathEntry& e : kRsPathNames) {
    if (e.path == path) return e.name;
  }
  return "";
}

RsPath RsPathFromEnv() {
  for (const RsPathEntry& e : kRsPathNames) {
    if (EnvEquals("JAX_DISTGEMM_RS_PATH", e.name)) return e.path;
  }
  return kRsAuto;
}

}  // namespace jax_distgemm

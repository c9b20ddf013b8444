#include "cc/common/rs_path.h"

namespace jax_distgemm {
namespace {

// -- The one table of the paths' names ------------------------------------------------------------

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

}  // namespace jax_distgemm

#include "cc/common/device_ids.h"

#include <map>
#include <mutex>

namespace jax_distgemm {
namespace {

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
std::map<int, std::map<int32_t, int64_t>>& Table() {
  static auto* table = new std::map<int, std::map<int32_t, int64_t>>();
  return *table;
}

}  // namespace

void SetDeviceIds(int platform, const std::vector<int32_t>& ordinals,
                  const std::vector<int64_t>& global_ids) {
  std::lock_guard<std::mutex> lock(Mu());
  auto& t = Table()[platform];
  t.clear();
  for (size_t i = 0; i < ordinals.size() && i < global_ids.size(); ++i) {
    t[ordinals[i]] = global_ids[i];
  }
}

int64_t GlobalDeviceId(int platform, int32_t ordinal) {
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Table().find(platform);
  if (it == Table().end()) return ordinal;
  auto jt = it->second.find(ordinal);
  return jt == it->second.end() ? ordinal : jt->second;
}

int32_t LocalOrdinal(int platform, int64_t id) {
  std::lock_guard<std::mutex> lock(Mu());
  auto it = Table().find(platform);
  if (it == Table().end() || it->second.empty()) return static_cast<int32_t>(id);
  for (const auto& [ordinal, global] : it->second) {
    if (global == id) return ordinal;
  }
  return -1;
}

bool IsLocalDeviceId(int platform, int64_t id) { return LocalOrdinal(platform, id) >= 0; }

}  // namespace jax_distgemm

#include "cc/common/rendezvous.h"

#include <algorithm>
#include <deque>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

namespace jax_distgemm {

Session::Session(int size) : size_(size), values_(size), owned_(size), reached_(size, -1) {}

void* Session::Allocate(int rank, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  owned_[rank].emplace_back(new char[bytes > 0 ? bytes : 1]);
  return owned_[rank].back().get();
}

void Session::Publish(int rank, std::vector<void*> values) {
  std::lock_guard<std::mutex> lock(mu_);
  values_[rank] = std::move(values);
}

std::string Session::Barrier(int rank, int phase, const std::string& what,
                             std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  reached_[rank] = std::max(reached_[rank], phase);
  cv_.notify_all();
  auto all_reached = [&] {
    return std::all_of(reached_.begin(), reached_.end(), [&](int p) { return p >= phase; });
  };
  const bool ok = cv_.wait_for(lock, timeout, [&] { return all_reached() || !poisoned_.empty(); });
  if (ok && poisoned_.empty()) return "";
  if (!poisoned_.empty()) return PeerGaveUpMessage(rank, size_, poisoned_);
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r) {
    if (reached_[r] < phase) missing.push_back(r);
  }
  poisoned_ = TimeoutMessage(rank, size_, timeout, what, missing);
  cv_.notify_all();
  return poisoned_;
}

std::string TimeoutMessage(int rank, int size, std::chrono::milliseconds timeout,
                           const std::string& what, const std::vector<int>& missing) {
  std::ostringstream msg;
  msg << "rank " << rank << " of " << size << " timed out after " << timeout.count()
      << " ms waiting for peers at " << what << "; missing ranks:";
  for (int r : missing) msg << " " << r;
  msg << ". Every device of the TP group must run the same sequence of distgemm calls; raise "
         "the timeout (the call's timeout_ms=, else JAX_DISTGEMM_TIMEOUT_MS) if peers are only "
         "slow.";
  return msg.str();
}

std::string PeerGaveUpMessage(int rank, int size, const std::string& peer_message) {
  return "rank " + std::to_string(rank) + " of " + std::to_string(size) +
         " stopped waiting: " + peer_message;
}

void* SessionExchange::Buffer(int rank, size_t bytes) {
  void* p = s_.Allocate(rank, bytes);
  s_.Publish(rank, {p});
  return p;
}

const void* SessionExchange::PeerBuffer(int peer, size_t /*bytes*/) {
  return s_.Values(peer)[0];
}

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, std::weak_ptr<Session>> sessions;
};

Registry& GetRegistry() {
  static auto* r = new Registry();
  return *r;
}

}  // namespace

std::shared_ptr<Session> JoinSession(const std::string& key, int size) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  // Drop sessions whose participants have all left.
  for (auto it = r.sessions.begin(); it != r.sessions.end();) {
    it = it->second.expired() ? r.sessions.erase(it) : std::next(it);
  }
  auto& slot = r.sessions[key];
  std::shared_ptr<Session> s = slot.lock();
  if (!s) {
    s = std::make_shared<Session>(size);
    slot = s;
  }
  return s;
}

int64_t NextOccurrence(int64_t device, int64_t run_id, int64_t call_id) {
  // Per device: counts for the most recent runs only (a device runs one program at a time, a
  // few runs of history guard against reordering between threads).
  constexpr size_t kRunsKept = 8;
  static std::mutex mu;
  static auto* per_device =
      new std::map<int64_t, std::deque<std::pair<int64_t, std::map<int64_t, int64_t>>>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& runs = (*per_device)[device];
  auto it = std::find_if(runs.begin(), runs.end(),
                         [&](const auto& e) { return e.first == run_id; });
  if (it == runs.end()) {
    runs.emplace_back(run_id, std::map<int64_t, int64_t>());
    if (runs.size() > kRunsKept) runs.pop_front();
    it = std::prev(runs.end());
  }
  return it->second[call_id]++;
}

}  // namespace jax_distgemm

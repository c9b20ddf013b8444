// Timed host rendezvous between the per-device threads of one process.
//
// XLA runs one host thread per local device and calls each device's handler concurrently with
// the same RunId (docs/design.md, "Probe").  A Session is the meeting point of the TP handlers of
// one call: each publishes a few pointers, then they pass numbered barriers.  Every wait is
// bounded: on timeout the session is poisoned, so every participant returns an error naming the
// phase and the missing ranks, and the next call (a new key) starts clean.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace jax_distgemm {

// What the executor's schedules need from the meeting of one call's TP handlers, whatever carries
// it: a Session between the threads of one process (SessionExchange below), or POSIX shared
// memory between processes (cc/common/shm_exchange.h).  Each rank exposes one buffer that its peers
// read; barriers are numbered and bounded as in Session::Barrier.
class Exchange {
 public:
  virtual ~Exchange() = default;
  // This rank's buffer of `bytes` for peers to read after the next barrier.  It stays valid and
  // unchanged while any peer of this meeting still reads it, also after this rank gave up on a
  // timed-out barrier.  Throws std::bad_alloc or std::runtime_error when it cannot be had.
  virtual void* Buffer(int rank, size_t bytes) = 0;
  // The buffer rank `peer` exposed (`bytes` long), valid after barrier 0.
  virtual const void* PeerBuffer(int peer, size_t bytes) = 0;
  // As Session::Barrier.
  virtual std::string Barrier(int rank, int phase, const std::string& what,
                              std::chrono::milliseconds timeout) = 0;
};

class Session {
 public:
  explicit Session(int size);

  // Publishes this rank's pointers (visible to peers after the next barrier).
  void Publish(int rank, std::vector<void*> values);
  const std::vector<void*>& Values(int rank) const { return values_[rank]; }

  // Scratch owned by the session, for anything peers read: it outlives every participant,
  // so a peer still reading after this rank gave up on a timed-out barrier reads valid memory.
  void* Allocate(int rank, size_t bytes);

  // Blocks until all ranks reached `phase` (phases are passed in increasing order).  Returns
  // "" or an error naming `what`, the phase and the ranks that did not arrive.
  std::string Barrier(int rank, int phase, const std::string& what,
                      std::chrono::milliseconds timeout);

  int size() const { return size_; }

 private:
  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<void*>> values_;
  std::vector<std::vector<std::unique_ptr<char[]>>> owned_;
  std::vector<int> reached_;  // highest phase each rank reached, -1 before the first
  std::string poisoned_;      // non-empty once a participant timed out
};

// The in-process Exchange: one session-owned buffer per rank, published as a pointer.
class SessionExchange final : public Exchange {
 public:
  explicit SessionExchange(Session& s) : s_(s) {}
  void* Buffer(int rank, size_t bytes) override;
  const void* PeerBuffer(int peer, size_t bytes) override;
  std::string Barrier(int rank, int phase, const std::string& what,
                      std::chrono::milliseconds timeout) override {
    return s_.Barrier(rank, phase, what, timeout);
  }

 private:
  Session& s_;
};

// The message every timed-out barrier returns (in-process and cross-process alike): names the
// phase (`what`), the waiting rank and the ranks that did not arrive.
std::string TimeoutMessage(int rank, int size, std::chrono::milliseconds timeout,
                           const std::string& what, const std::vector<int>& missing);

// What a rank returns when a peer gave up first: its own rank, then the peer's TimeoutMessage
// (the reporting device is then the rank the message starts with).
std::string PeerGaveUpMessage(int rank, int size, const std::string& peer_message);

// Process-wide table of sessions.  The key must be identical on every participant of one call
// and distinct between calls (RunId, call site, occurrence of that call site in the run).
std::shared_ptr<Session> JoinSession(const std::string& key, int size);

// n-th execution of call site `call_id` on `device` within run `run_id` (0, 1, 2, ...): a call
// site inside a loop runs several times per run, in the same order on every device.
int64_t NextOccurrence(int64_t device, int64_t run_id, int64_t call_id);

}  // namespace jax_distgemm

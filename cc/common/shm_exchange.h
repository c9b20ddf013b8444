// Cross-process meeting of one call's TP handlers through POSIX shared memory (CPU executor).
//
// Used when a TP group has members in other processes of the same host (jax.distributed, one or
// more CPU devices per process).  RunIds differ between processes, so a meeting is keyed by the
// *channel* (the group's global device ids, call_id) and the occurrence of that channel on the
// device (0, 1, 2, ... across runs): identical in every process when all run the same programs
// in the same order (SPMD).
//
// Every rank of a channel owns one segment, created and sized only by its own process:
//
//   /jdg_<job token>_<hash of the group's ids>_<call_id>_r<rank>
//   [ header (4 KiB): magic, owner pid, doorbell, reached, left, poisoned, message | data ]
//
// `reached` = epoch * kPhaseStride + phase + 1 (epoch = occurrence + 1) only grows, so nothing is
// ever reset; `left` = last epoch this rank left; `poisoned` = the epoch this rank gave up on,
// with the reason in `message`.  A rank only writes its own header, except that it bumps a
// peer's doorbell (a futex word) to wake it.  Meeting e of a channel starts only when every rank
// has left meeting e-1 (the gate), so one channel never has two meetings in flight and a rank
// overwrites its data only when no peer can still read it.  The data area (rotating shard or
// ReduceScatter running sums) grows when a larger problem comes (never shrinks; older mappings
// stay mapped, so pointers handed out stay valid).
//
// The job token (set once per process from Python, jax_distgemm.initialize_multiprocess) holds
// a nonce agreed through JAX's key-value store, so a job never meets the segments of another or
// of a crashed run.  A process unlinks the segments it created at exit; SweepStaleShmSegments
// removes those whose owner process is gone.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/common/rendezvous.h"

namespace jax_distgemm {

// Sets the job token (1-32 characters of [A-Za-z0-9]); returns "" or what is wrong with it.
// Changing it later only affects channels not used yet.
std::string SetShmJobToken(const std::string& token);
// The token, "" while none was set (the cross-process path then refuses to run).
std::string ShmJobToken();

// Peers of one meeting run different calls (a process out of step with the others: another
// program, other shapes, other JAX_DISTGEMM_* settings); what() names both sides.
class CallMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ShmExchange final : public Exchange {
 public:
  // Joins meeting `occurrence` of the channel (group: the TP group's global device ids in rank
  // order, call_id) as `rank`, after the gate.  Returns "" and sets *out, or an error;
  // *timed_out tells a timeout at the gate from a failure to set up this rank's segment.
  // `signature` (what this rank runs, < kSignatureBytes; "" for none) is published with the
  // meeting and compared with every peer's when the first barrier completes: a difference
  // throws CallMismatch there, on every rank, before any peer's data is read.
  static std::string Join(const std::vector<int64_t>& group, int64_t call_id, int64_t occurrence,
                          int rank, std::chrono::milliseconds timeout,
                          std::unique_ptr<ShmExchange>* out, bool* timed_out,
                          const std::string& signature = "");
  // Marks meeting `occurrence` as left by `rank` without taking part in it (fault injection:
  // the device runs the call but never meets its peers).
  static std::string Skip(const std::vector<int64_t>& group, int64_t call_id, int64_t occurrence,
                          int rank);

  ShmExchange(const ShmExchange&) = delete;
  ShmExchange& operator=(const ShmExchange&) = delete;
  ~ShmExchange() override;  // leaves the meeting (lets the channel's next meeting start)

  void* Buffer(int rank, size_t bytes) override;
  const void* PeerBuffer(int peer, size_t bytes) override;
  std::string Barrier(int rank, int phase, const std::string& what,
                      std::chrono::milliseconds timeout) override;

  struct Segment;

 private:
  ShmExchange() = default;
  std::shared_ptr<Segment> Peer(int rank);  // nullptr while rank's segment does not exist
  void RingPeers();
  std::string CrossProcessNote(const std::vector<int>& missing) const;
  void CompareSignatures();  // throws CallMismatch

  std::vector<int64_t> group_;
  std::vector<std::string> names_;
  std::vector<std::shared_ptr<Segment>> segs_;  // segs_[rank_] is ours
  int rank_ = 0;
  int64_t epoch_ = 0;
  std::string signature_;  // "" : not compared
  bool compared_ = false;  // signatures compared (at the first completed barrier)
};

// The next occurrence (0, 1, ...) of the channel (group, call_id) on `device`.
int64_t NextChannelOccurrence(int64_t device, const std::vector<int64_t>& group, int64_t call_id);

// Names of the segments this process created and has not unlinked yet.
std::vector<std::string> OwnShmSegments();
// Unlinks every segment this process created (also run at exit); returns their names.  Peers
// that mapped them keep their mappings; nothing new can meet this process afterwards.
std::vector<std::string> ReleaseShmSegments();
// Unlinks segments of ours (by magic) that are left over from processes that no longer exist
// (same PID namespace, owner PID gone); returns their names.
std::vector<std::string> SweepStaleShmSegments();

}  // namespace jax_distgemm

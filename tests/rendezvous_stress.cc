// Stress of the host meetings the executors build on (cc/common/rendezvous.h: Session and
// SessionExchange between the threads of one process; cc/common/shm_exchange.h: ShmExchange
// through POSIX shared memory), with no XLA, so that a thread sanitizer sees every access of
// ours on both sides (under Python, XLA's uninstrumented threads hide them).
//
// TP threads run `meetings` meetings each, the same random sequence on every thread: write a
// rank-tagged buffer, barrier 0, read every peer's, barrier 1.  About one meeting in ten, one
// rank stops before barrier 0 or 1 (or, in shared memory, skips the meeting: ShmExchange::Skip)
// and the others must time out (50-100 ms bounds) and go on with the next meeting; buffers
// grow over the shared-memory run.  Exit 1 on a wrong peer value, an error where no rank
// stopped, or none where one did.  Built and run by tests/rendezvous_stress_test.py
// under -fsanitize=thread and -fsanitize=address,undefined:
//
//   c++ -std=c++17 -fsanitize=thread -O1 -g -I. tests/rendezvous_stress.cc \
//       cc/common/rendezvous.cc cc/common/shm_exchange.cc -lpthread -lrt -o stress
//   ./stress 150
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/common/rendezvous.h"
#include "cc/common/shm_exchange.h"

namespace jax_distgemm {
namespace {

using std::chrono::milliseconds;

constexpr int kTp = 4;
std::atomic<int> errors{0};
std::atomic<int> timeouts{0};

void Fail(const std::string& what) {
  ++errors;
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
}

// One meeting of `ex` as `rank`; `stop` >= 0: that rank returns before barrier `stop_phase`.
std::string Meet(Exchange& ex, int rank, size_t n, int meeting, int stop, int stop_phase,
                 milliseconds timeout) {
  auto* mine = static_cast<int*>(ex.Buffer(rank, n * sizeof(int)));
  for (size_t j = 0; j < n; ++j) mine[j] = meeting * 1000 + rank;
  if (rank == stop && stop_phase == 0) return "";
  if (std::string e = ex.Barrier(rank, 0, "barrier 0", timeout); !e.empty()) return e;
  for (int q = 0; q < kTp; ++q) {
    const auto* peer = static_cast<const int*>(ex.PeerBuffer(q, n * sizeof(int)));
    for (size_t j = 0; j < n; j += 97) {
      if (peer[j] != meeting * 1000 + q) {
        Fail("meeting " + std::to_string(meeting) + ": rank " + std::to_string(rank) +
             " read " + std::to_string(peer[j]) + " from rank " + std::to_string(q));
        break;
      }
    }
  }
  if (rank == stop && stop_phase == 1) return "";
  return ex.Barrier(rank, 1, "barrier 1", timeout);
}

// What one meeting's outcome says: an error is due exactly where a rank stopped.
void Check(const std::string& err, int rank, int stop, int meeting) {
  if (!err.empty()) ++timeouts;
  if (!err.empty() && stop < 0) {
    Fail("meeting " + std::to_string(meeting) + " rank " + std::to_string(rank) + ": " + err);
  }
  if (err.empty() && stop >= 0 && rank != stop) {
    Fail("meeting " + std::to_string(meeting) + " rank " + std::to_string(rank) +
         ": no error although rank " + std::to_string(stop) + " stopped");
  }
}

void InProcess(int meetings) {
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kTp; ++rank) {
    threads.emplace_back([=] {
      std::mt19937 rng(42);  // the same draws on every thread
      for (int m = 0; m < meetings; ++m) {
        const int stop = rng() % 10 == 0 ? static_cast<int>(rng() % kTp) : -1;
        const int phase = static_cast<int>(rng() % 2);
        const size_t n = 1 + rng() % 5000;
        std::shared_ptr<Session> s = JoinSession("stress/" + std::to_string(m), kTp);
        SessionExchange ex(*s);
        Check(Meet(ex, rank, n, m, stop, phase, stop >= 0 ? milliseconds(50) :
                                                             milliseconds(10000)),
              rank, stop, m);
      }
    });
  }
  for (auto& t : threads) t.join();
}

void SharedMemory(int meetings) {
  std::vector<int64_t> group;
  for (int r = 0; r < kTp; ++r) group.push_back(100 + r);
  constexpr int64_t kCallId = 7;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kTp; ++rank) {
    threads.emplace_back([=] {
      std::mt19937 rng(7);
      for (int m = 0; m < meetings; ++m) {
        const int stop = rng() % 10 == 0 ? static_cast<int>(rng() % kTp) : -1;
        const int phase = static_cast<int>(rng() % 3);  // 2: skip the whole meeting
        const size_t n = 1 + (rng() % 8) * (m * 300 + 1);  // segments grow
        if (rank == stop && phase == 2) {
          if (std::string e = ShmExchange::Skip(group, kCallId, m, rank); !e.empty()) Fail(e);
          continue;
        }
        const milliseconds timeout = stop >= 0 ? milliseconds(100) : milliseconds(10000);
        std::unique_ptr<ShmExchange> ex;
        bool timed_out = false;
        std::string e = ShmExchange::Join(group, kCallId, m, rank, timeout, &ex, &timed_out,
                                          "stress");
        if (e.empty()) {
          try {
            e = Meet(*ex, rank, n, m, stop, phase, timeout);
          } catch (const std::exception& x) {
            Fail(std::string("meeting threw: ") + x.what());
          }
        }
        Check(e, rank, stop, m);
      }
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace
}  // namespace jax_distgemm

int main(int argc, char** argv) {
  using namespace jax_distgemm;
  const int meetings = argc > 1 ? std::atoi(argv[1]) : 150;
  InProcess(meetings);
  const int in_process_timeouts = timeouts.load();
  std::printf("in process: %d meetings, %d timed-out waits, %d errors\n", meetings,
              in_process_timeouts, errors.load());
  if (std::string e = SetShmJobToken("stress" + std::to_string(getpid())); !e.empty()) Fail(e);
  SharedMemory(meetings);
  std::printf("shared memory: %d meetings, %d timed-out waits, %d errors\n", meetings,
              timeouts.load() - in_process_timeouts, errors.load());
  ReleaseShmSegments();
  if (in_process_timeouts == 0 || timeouts.load() == in_process_timeouts) {
    Fail("no wait timed out: no rank stopped");
  }
  return errors.load() == 0 ? 0 : 1;
}

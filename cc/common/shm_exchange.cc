#include "cc/common/shm_exchange.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>

namespace jax_distgemm {
namespace {

constexpr uint64_t kMagic = 0x316d68736d67646aULL;  // "jdgmshm1", little-endian
constexpr uint32_t kVersion = 2;  // 2: the call signature
constexpr size_t kHeaderBytes = 4096;               // data starts here (page aligned)
constexpr size_t kDataGranule = size_t{64} << 10;   // data capacity grows in 64 KiB steps
constexpr int64_t kPhaseStride = int64_t{1} << 16;  // > any phase (TP <= 1024)
constexpr size_t kMessageBytes = 2048;
constexpr size_t kSignatureBytes = 1024;
constexpr auto kWaitSlice = std::chrono::milliseconds(20);  // futex waits re-check this often

// The header of a rank's segment.  Zero (a fresh ftruncate) reads as "not arrived, left
// nothing, not poisoned", so peers need no initialization handshake.  Fields after `tp` change
// over the segment's life and are accessed with atomics.
struct Header {
  uint64_t magic;     // kMagic, written last by the owner at creation
  uint32_t version;
  int32_t owner_pid;
  uint64_t pid_ns;    // inode of the owner's /proc/self/ns/pid (stale-segment sweep)
  int64_t call_id;
  int32_t rank;
  int32_t tp;
  uint32_t doorbell;  // futex word: peers bump it after changing their state
  uint32_t reserved;
  int64_t reached;    // epoch * kPhaseStride + phase + 1 of the last barrier reached
  int64_t left;       // last epoch this rank left (monotonic)
  int64_t poisoned;   // epoch this rank gave up on (timed out), 0: none
  int64_t data_bytes; // capacity of the data area
  char message[kMessageBytes];  // why it gave up (valid when `poisoned` is the epoch asked)
  int64_t signature_epoch;      // the epoch whose call `signature` describes
  char signature[kSignatureBytes];  // what this rank runs in that epoch ("" : not compared)
};
static_assert(sizeof(Header) <= kHeaderBytes, "header must fit its page");

template <class T>
T Load(const T* p) {
  return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
template <class T>
void Store(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
}
void StoreMax(int64_t* p, int64_t v) {
  int64_t cur = Load(p);
  while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST,
                                                 __ATOMIC_SEQ_CST)) {
  }
}

void Ring(Header* h) {
  __atomic_add_fetch(&h->doorbell, 1u, __ATOMIC_SEQ_CST);
#if defined(__linux__)
  syscall(SYS_futex, &h->doorbell, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#endif
}

// Sleeps until the doorbell moves from `seen`, at most `d`.
void WaitDoorbell(Header* h, uint32_t seen, std::chrono::nanoseconds d) {
#if defined(__linux__)
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(d.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(d.count() % 1000000000);
  syscall(SYS_futex, &h->doorbell, FUTEX_WAIT, seen, &ts, nullptr, 0);
#else
  (void)h;
  (void)seen;
  std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(d, std::chrono::microseconds(200)));
#endif
}

std::string Errno(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

uint64_t PidNamespace() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

uint64_t GroupHash(const std::vector<int64_t>& group) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (int64_t id : group) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(id >> (8 * b)) & 0xff;
      h *= 1099511628211ULL;
    }
  }
  return h;
}

struct State {
  std::mutex mu;  // guards everything below, and every shm_open of a segment
  std::string token;
  std::map<std::string, std::shared_ptr<ShmExchange::Segment>> segments;
  std::vector<std::string> own;  // created here, not unlinked yet
  bool atexit_registered = false;
  std::map<std::tuple<int64_t, int64_t, std::vector<int64_t>>, int64_t> occurrences;
};

State& GetState() {
  static auto* s = new State();  // leaked: used from atexit and from XLA's threads at exit
  return *s;
}

void UnlinkAtExit() { ReleaseShmSegments(); }

}  // namespace

// One segment as this process sees it.  `header` is the first mapping and is never unmapped;
// `base` is the largest mapping so far (older ones are kept: the same pages, so pointers that
// were handed out stay valid).
struct ShmExchange::Segment {
  std::string name;
  bool owned = false;
  Header* header = nullptr;
  std::mutex mu;  // guards base, mapped, retired
  char* base = nullptr;
  size_t mapped = 0;
  std::vector<std::pair<void*, size_t>> retired;

  // A mapping of at least kHeaderBytes + bytes; throws when the segment is smaller.
  char* Data(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    const size_t need = kHeaderBytes + bytes;
    if (mapped >= need) return base + kHeaderBytes;
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error(Errno("shm_open " + name, errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int e = errno;
      close(fd);
      throw std::runtime_error(Errno("fstat " + name, e));
    }
    const size_t size = static_cast<size_t>(st.st_size);
    if (size < need) {
      close(fd);
      std::ostringstream m;
      m << "shared-memory segment " << name << " holds " << size << " bytes, " << need
        << " expected (do all processes run the same program?)";
      throw std::runtime_error(m.str());
    }
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int e = errno;
    close(fd);
    if (p == MAP_FAILED) throw std::runtime_error(Errno("mmap " + name, e));
    if (base != nullptr) retired.emplace_back(base, mapped);
    base = static_cast<char*>(p);
    mapped = size;
    return base + kHeaderBytes;
  }

  // Owner only: makes the data area hold `bytes`, reserving the memory (posix_fallocate), so a
  // full /dev/shm is an error here rather than a SIGBUS later.
  char* Grow(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (static_cast<size_t>(Load(&header->data_bytes)) >= bytes &&
          mapped >= kHeaderBytes + bytes) {
        return base + kHeaderBytes;
      }
    }
    const size_t cap = std::max(RoundUp(std::max<size_t>(bytes, 1), kDataGranule),
                                static_cast<size_t>(Load(&header->data_bytes)));  // never shrink
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error(Errno("shm_open " + name, errno));
    const off_t total = static_cast<off_t>(kHeaderBytes + cap);
    int err = ftruncate(fd, total) == 0 ? 0 : errno;
    if (err == 0) err = posix_fallocate(fd, 0, total);
    close(fd);
    if (err != 0) {
      std::ostringstream m;
      m << "could not reserve " << total << " bytes of POSIX shared memory for " << name << " ("
        << std::strerror(err) << "); the cross-process CPU executor keeps each device's "
        << "rotating shard or running sums there: is /dev/shm large enough?";
      throw std::runtime_error(m.str());
    }
    char* data = Data(cap);
    Store(&header->data_bytes, static_cast<int64_t>(cap));
    return data;
  }
};

std::string SetShmJobToken(const std::string& token) {
  if (token.empty() || token.size() > 32 ||
      !std::all_of(token.begin(), token.end(),
                   [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; })) {
    return "job token must be 1-32 characters of [A-Za-z0-9], got '" + token + "'";
  }
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.token = token;
  return "";
}

std::string ShmJobToken() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.token;
}

namespace {

std::string SegmentName(const std::string& token, const std::vector<int64_t>& group,
                        int64_t call_id, int rank) {
  std::ostringstream n;
  n << "/jdg_" << token << "_" << std::hex << GroupHash(group) << "_"
    << static_cast<uint64_t>(call_id) << std::dec << "_r" << rank;
  return n.str();
}

// This process's segment `name` (rank `rank` of the channel), created on first use.
std::shared_ptr<ShmExchange::Segment> OwnSegment(const std::string& name, int rank, int tp,
                                                 int64_t call_id, std::string* err) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.segments.find(name);
  if (it != s.segments.end()) {
    if (it->second->owned) return it->second;
    *err = "the shared-memory segment " + name + " existed before this process created it " +
           "(left over from a job with the same token?)";
    return nullptr;
  }
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    const int e = errno;
    *err = Errno("could not create the shared-memory segment " + name, e);
    if (e == EEXIST) {
      *err += " (left over from a job with the same token? initialize_multiprocess() draws a "
              "fresh nonce per job)";
    }
    return nullptr;
  }
  int e = ftruncate(fd, kHeaderBytes) == 0 ? 0 : errno;
  if (e == 0) e = posix_fallocate(fd, 0, kHeaderBytes);
  void* p = e == 0 ? mmap(nullptr, kHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  if (e == 0 && p == MAP_FAILED) e = errno;
  close(fd);
  if (e != 0) {
    shm_unlink(name.c_str());
    *err = Errno("could not set up the shared-memory segment " + name, e);
    return nullptr;
  }
  auto seg = std::make_shared<ShmExchange::Segment>();
  seg->name = name;
  seg->owned = true;
  seg->header = static_cast<Header*>(p);
  seg->base = static_cast<char*>(p);
  seg->mapped = kHeaderBytes;
  Header* h = seg->header;
  h->version = kVersion;
  h->owner_pid = static_cast<int32_t>(getpid());
  h->pid_ns = PidNamespace();
  h->call_id = call_id;
  h->rank = rank;
  h->tp = tp;
  Store(&h->magic, kMagic);
  s.segments[name] = seg;
  s.own.push_back(name);
  if (!s.atexit_registered) {
    s.atexit_registered = true;
    std::atexit(UnlinkAtExit);
  }
  return seg;
}

// A peer's segment, or nullptr while its owner has not created it (or not sized its header).
std::shared_ptr<ShmExchange::Segment> OpenPeer(const std::string& name) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.segments.find(name);
  if (it != s.segments.end()) return it->second;
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return nullptr;
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < kHeaderBytes) {
    close(fd);
    return nullptr;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return nullptr;
  auto seg = std::make_shared<ShmExchange::Segment>();
  seg->name = name;
  seg->header = static_cast<Header*>(p);
  seg->base = static_cast<char*>(p);
  seg->mapped = size;
  s.segments[name] = seg;
  return seg;
}

template <class Pred>
bool WaitFor(Header* own, std::chrono::steady_clock::time_point deadline, Pred pred) {
  for (;;) {
    const uint32_t seen = Load(&own->doorbell);
    if (pred()) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    WaitDoorbell(own, seen,
                 std::min<std::chrono::nanoseconds>(deadline - now, kWaitSlice));
  }
}

std::string Ids(const std::vector<int64_t>& ids) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ids.size(); ++i) s << (i ? ", " : "") << ids[i];
  s << "]";
  return s.str();
}

}  // namespace

std::shared_ptr<ShmExchange::Segment> ShmExchange::Peer(int rank) {
  if (!segs_[rank]) segs_[rank] = OpenPeer(names_[rank]);
  return segs_[rank];
}

void ShmExchange::RingPeers() {
  for (int q = 0; q < static_cast<int>(group_.size()); ++q) {
    if (q == rank_) continue;
    if (auto seg = Peer(q)) Ring(seg->header);
  }
}

std::string ShmExchange::CrossProcessNote(const std::vector<int>& missing) const {
  std::vector<int64_t> ids;
  for (int r : missing) ids.push_back(group_[r]);
  return " (TP group " + Ids(group_) + " spans processes; the missing ranks are devices " +
         Ids(ids) + ")";
}

std::string ShmExchange::Join(const std::vector<int64_t>& group, int64_t call_id,
                              int64_t occurrence, int rank, std::chrono::milliseconds timeout,
                              std::unique_ptr<ShmExchange>* out, bool* timed_out,
                              const std::string& signature) {
  *timed_out = false;
  if (signature.size() >= kSignatureBytes) return "call signature too long: " + signature;
  const std::string token = ShmJobToken();
  if (token.empty()) return "no job token: call jax_distgemm.initialize_multiprocess()";
  const int tp = static_cast<int>(group.size());
  std::unique_ptr<ShmExchange> ex(new ShmExchange());
  ex->group_ = group;
  ex->rank_ = rank;
  ex->epoch_ = occurrence + 1;
  ex->segs_.resize(tp);
  for (int q = 0; q < tp; ++q) ex->names_.push_back(SegmentName(token, group, call_id, q));
  std::string err;
  ex->segs_[rank] = OwnSegment(ex->names_[rank], rank, tp, call_id, &err);
  if (!ex->segs_[rank]) return err;
  // The gate: every rank has left this channel's previous meeting (nobody still reads data or
  // messages of epoch - 1 when this one starts writing them).  It allows twice the timeout: a
  // peer may itself wait up to the timeout in that meeting (for a rank that skipped it, say)
  // before it gives up and leaves.
  Header* own = ex->segs_[rank]->header;
  const auto gate_timeout = 2 * timeout;
  const int64_t prev = ex->epoch_ - 1;
  ShmExchange* e = ex.get();
  auto all_left = [&] {
    for (int q = 0; q < tp; ++q) {
      auto seg = e->Peer(q);
      const int64_t left = seg ? Load(&seg->header->left) : 0;
      if (left < prev) return false;
    }
    return true;
  };
  if (!WaitFor(own, std::chrono::steady_clock::now() + gate_timeout, all_left)) {
    std::vector<int> missing;
    for (int q = 0; q < tp; ++q) {
      auto seg = e->Peer(q);
      if ((seg ? Load(&seg->header->left) : 0) < prev) missing.push_back(q);
    }
    *timed_out = true;
    const std::string msg =
        TimeoutMessage(rank, tp, gate_timeout,
                       "the start of this call (peers still in the previous call of this call "
                       "site)",
                       missing) +
        e->CrossProcessNote(missing);
    // ~ShmExchange marks this meeting left, so the channel's next meeting can start.
    return msg;
  }
  // NOTE: written after the gate (no peer still reads epoch - 1's) and before this rank reaches
  // any barrier of this epoch; peers read it only once every rank reached the first one.
  ex->signature_ = signature;
  std::memset(own->signature, 0, kSignatureBytes);
  std::memcpy(own->signature, signature.data(), signature.size());
  Store(&own->signature_epoch, ex->epoch_);
  *out = std::move(ex);
  return "";
}

std::string ShmExchange::Skip(const std::vector<int64_t>& group, int64_t call_id,
                              int64_t occurrence, int rank) {
  const std::string token = ShmJobToken();
  if (token.empty()) return "no job token: call jax_distgemm.initialize_multiprocess()";
  const int tp = static_cast<int>(group.size());
  std::string err;
  auto seg =
      OwnSegment(SegmentName(token, group, call_id, rank), rank, tp, call_id, &err);
  if (!seg) return err;
  StoreMax(&seg->header->left, occurrence + 1);
  for (int q = 0; q < tp; ++q) {
    if (q == rank) continue;
    if (auto p = OpenPeer(SegmentName(token, group, call_id, q))) Ring(p->header);
  }
  return "";
}

ShmExchange::~ShmExchange() {
  if (segs_.empty() || !segs_[rank_]) return;
  StoreMax(&segs_[rank_]->header->left, epoch_);
  RingPeers();
}

void* ShmExchange::Buffer(int rank, size_t bytes) { return segs_[rank]->Grow(bytes); }

const void* ShmExchange::PeerBuffer(int peer, size_t bytes) {
  auto seg = Peer(peer);
  if (!seg) throw std::runtime_error("the segment of rank " + std::to_string(peer) + " vanished");
  return seg->Data(bytes);
}

std::string ShmExchange::Barrier(int rank, int phase, const std::string& what,
                                 std::chrono::milliseconds timeout) {
  const int tp = static_cast<int>(group_.size());
  Header* own = segs_[rank]->header;
  const int64_t target = epoch_ * kPhaseStride + phase + 1;
  Store(&own->reached, target);
  RingPeers();
  std::string poison;
  auto done = [&] {
    for (int q = 0; q < tp; ++q) {
      if (q == rank) continue;
      auto seg = Peer(q);
      if (seg && Load(&seg->header->poisoned) == epoch_) {
        char buf[kMessageBytes];
        std::memcpy(buf, seg->header->message, kMessageBytes);
        buf[kMessageBytes - 1] = '\0';
        poison = buf;
        return true;
      }
    }
    for (int q = 0; q < tp; ++q) {
      auto seg = Peer(q);
      if (!seg || Load(&seg->header->reached) < target) return false;
    }
    return true;
  };
  if (WaitFor(own, std::chrono::steady_clock::now() + timeout, done)) {
    if (poison.empty() && !compared_) CompareSignatures();
    return poison.empty() ? poison : PeerGaveUpMessage(rank, tp, poison);
  }
  std::vector<int> missing;
  for (int q = 0; q < tp; ++q) {
    auto seg = Peer(q);
    if (!seg || Load(&seg->header->reached) < target) missing.push_back(q);
  }
  const std::string msg =
      TimeoutMessage(rank, tp, timeout, what, missing) + CrossProcessNote(missing);
  std::memset(own->message, 0, kMessageBytes);
  std::memcpy(own->message, msg.data(), std::min(msg.size(), kMessageBytes - 1));
  Store(&own->poisoned, epoch_);
  RingPeers();
  return msg;
}

void ShmExchange::CompareSignatures() {
  compared_ = true;
  if (signature_.empty()) return;
  for (int q = 0; q < static_cast<int>(group_.size()); ++q) {
    if (q == rank_) continue;
    auto seg = Peer(q);
    std::string theirs = "(no signature)";
    if (seg && Load(&seg->header->signature_epoch) == epoch_) {
      char buf[kSignatureBytes];
      std::memcpy(buf, seg->header->signature, kSignatureBytes);
      buf[kSignatureBytes - 1] = '\0';
      theirs = buf;
    }
    if (theirs == signature_) continue;
    std::ostringstream m;
    m << "the ranks of this call run different calls: rank " << q << " (device " << group_[q]
      << ") runs " << theirs << ", this rank " << rank_ << " (device " << group_[rank_]
      << ") runs " << signature_ << ". Every process must run the same programs in the same "
      << "order, with the same JAX_DISTGEMM_* settings (TP group " << Ids(group_)
      << " spans processes)";
    throw CallMismatch(m.str());
  }
}

int64_t NextChannelOccurrence(int64_t device, const std::vector<int64_t>& group,
                              int64_t call_id) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.occurrences[std::make_tuple(device, call_id, group)]++;
}

std::vector<std::string> OwnShmSegments() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.own;
}

std::vector<std::string> ReleaseShmSegments() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<std::string> names;
  names.swap(s.own);
  for (const auto& n : names) shm_unlink(n.c_str());
  return names;
}

std::vector<std::string> SweepStaleShmSegments() {
  std::vector<std::string> removed;
  const uint64_t ns = PidNamespace();
  if (ns == 0) return removed;  // cannot tell whose processes these are
  const std::string live_prefix = "jdg_" + ShmJobToken() + "_";
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return removed;
  while (struct dirent* ent = readdir(dir)) {
    const std::string entry = ent->d_name;
    if (entry.rfind("jdg_", 0) != 0 || entry.rfind(live_prefix, 0) == 0) continue;
    const std::string name = "/" + entry;
    const int fd = shm_open(name.c_str(), O_RDONLY, 0);
    if (fd < 0) continue;
    struct stat st;
    Header h{};
    bool read_ok = false;
    if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= kHeaderBytes) {
      void* p = mmap(nullptr, kHeaderBytes, PROT_READ, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        const Header* src = static_cast<const Header*>(p);
        h.magic = Load(&src->magic);
        h.owner_pid = src->owner_pid;
        h.pid_ns = src->pid_ns;
        munmap(p, kHeaderBytes);
        read_ok = true;
      }
    }
    close(fd);
    if (!read_ok || h.magic != kMagic || h.pid_ns != ns || h.owner_pid <= 0) continue;
    if (kill(h.owner_pid, 0) == 0 || errno != ESRCH) continue;  // owner alive (or not ours)
    if (shm_unlink(name.c_str()) == 0) removed.push_back(name);
  }
  closedir(dir);
  return removed;
}

}  // namespace jax_distgemm

// Many peers, over tcp and over shm: one hub engine connected to many peer engines (held by a
// few peer processes, tcp_scale_peer), all transferring to and from it at once, byte-exact.
// The test prints the hub's thread count with 0, 1, 100 and all peers connected and checks
// that the data path keeps it fixed (tcp: the I/O pool, tcp_io_pool.h; shm: copies run in the
// caller's thread); it also prints the hub's memory, descriptors and memory mappings per
// connected peer and its CPU time while idle. Over shm the memory each side reaches is a
// ShareableBuffer (memfd), so that every peer maps the hub's region once and the hub maps one
// region per peer: the test checks that each peer's transport is shm and that a peer costs the
// hub a bounded number of mappings and descriptors. A second test connects and disconnects a
// peer in a loop and checks that no thread, descriptor, mapping or memory is left behind.
// Both run once per transport (gtest parameter: tcp, shm), and the tcp ones once per readiness
// backend of the tcp I/O pool (KVWIRE_TCP_IO_BACKEND, tests/support/tcp_backend.h: ctest runs
// them again with io_uring, the peer processes too; skipped, saying why, where io_uring is
// refused). The shm data path does not use the tcp I/O pool, so it runs once.
//
// KVWIRE_SCALE_PEERS (default 100) and KVWIRE_SCALE_PROCS (default 2) size the first test;
// KVWIRE_SCALE_CYCLES (default 200) sizes the second. `make tcp-scale` runs 1000 peers over 4
// processes and 1000 cycles over tcp, once per backend (`make shm-scale`: the same over shm).
#include <sys/resource.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <fcntl.h>
#include <fstream>
#include <map>
#include <memory>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"
#include "tests/integration/tcp_scale_pattern.h"
#include "tests/support/tcp_backend.h"

extern char** environ;

// Under ASan, freed memory waits in the allocator's quarantine (256 MiB by default) and reads
// as resident: the cycles' RSS bound would measure ASan, not the engine. A small quarantine
// keeps the bound meaningful there too (ASAN_OPTIONS from the environment still win).
#if defined(__SANITIZE_ADDRESS__)
#define KVWIRE_SCALE_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVWIRE_SCALE_TEST_ASAN 1
#endif
#endif
#ifdef KVWIRE_SCALE_TEST_ASAN
extern "C" const char* __asan_default_options() {
  return "quarantine_size_mb=4:thread_local_quarantine_size_kb=64";
}
#endif

namespace kvwire {
namespace {

const ::testing::Environment* const kBackendEnvironment = ::testing::AddGlobalTestEnvironment(
    new testing::TcpBackendEnvironment);  // NOLINT: gtest owns it

constexpr uint64_t kSlotBytes = 16 << 10;
constexpr absl::Duration kWait = absl::Seconds(240);

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  uint64_t n = 0;
  return v != nullptr && absl::SimpleAtoi(v, &n) && n > 0 ? n : fallback;
}

size_t CountEntries(const char* dir) {
  DIR* d = opendir(dir);
  if (d == nullptr) return 0;
  size_t n = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}
size_t Threads() { return CountEntries("/proc/self/task"); }
size_t Descriptors() { return CountEntries("/proc/self/fd") - 1; }  // less opendir's own

// Lines of /proc/self/maps: the process's memory mappings (shm maps a peer's region once).
// Mappings of memfds (a peer's shared memory, shm's epoch tables): what a leaked shm region
// leaves behind. Anonymous mappings are left out: the allocator (ASan's above all) maps more
// of them as the heap grows, which says nothing about leaks.
size_t Mappings() {
  std::ifstream maps("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(maps, line);) {
    n += line.find("/memfd:") != std::string::npos ? 1 : 0;
  }
  return n;
}

// What each of this process's descriptors is, counted by kind ("tcp ESTABLISHED", "unix
// @kvwire-shm.hub...", "anon_inode:[eventfd]", "/memfd:..."), and its memfd mappings by name:
// printed when the cycles leave something behind, to say what.
using KindCounts = std::map<std::string, int>;

// inode -> kind, from /proc/net/{tcp,tcp6,unix}.
std::map<std::string, std::string> SocketKinds() {
  static const char* const kTcpStates[] = {"?",          "ESTABLISHED", "SYN_SENT",  "SYN_RECV",
                                           "FIN_WAIT1",  "FIN_WAIT2",   "TIME_WAIT", "CLOSE",
                                           "CLOSE_WAIT", "LAST_ACK",    "LISTEN",    "CLOSING"};
  std::map<std::string, std::string> kinds;
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 10) continue;
      unsigned state = 0;
      if (!absl::SimpleHexAtoi(f[3], &state) || state >= std::size(kTcpStates)) state = 0;
      kinds[f[9]] = absl::StrCat("tcp ", kTcpStates[state]);
    }
  }
  std::ifstream unix_sockets("/proc/net/unix");
  std::string line;
  std::getline(unix_sockets, line);
  while (std::getline(unix_sockets, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() < 7) continue;
    // The abstract name without its pid and random suffix ("@kvwire-shm.hub.<pid>.<hex>").
    std::string name = f.size() > 7 ? f[7].substr(0, f[7].find('.', f[7].find('.') + 1)) : "";
    kinds[f[6]] = absl::StrCat("unix ", name.empty() ? "(unnamed)" : name);
  }
  return kinds;
}

KindCounts DescriptorKinds() {
  const std::map<std::string, std::string> sockets = SocketKinds();
  KindCounts counts;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return counts;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char target[256];
    const std::string path = absl::StrCat("/proc/self/fd/", e->d_name);
    const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    std::string kind(target, n);
    if (kind.rfind("socket:[", 0) == 0) {
      auto it = sockets.find(kind.substr(8, kind.size() - 9));
      kind = it == sockets.end() ? "socket (not tcp or unix)" : it->second;
    } else if (kind.rfind("/proc/", 0) == 0) {
      continue;  // opendir's own
    }
    ++counts[kind];
  }
  closedir(d);
  return counts;
}

KindCounts MappingKinds() {
  KindCounts counts;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const size_t at = line.find("/memfd:");
    if (at != std::string::npos) ++counts[line.substr(at)];
  }
  return counts;
}

// "+2 tcp ESTABLISHED, -1 unix (unnamed)": what changed from `before` to `after`.
std::string KindDiff(const KindCounts& before, const KindCounts& after) {
  std::string out;
  KindCounts all = before;
  for (const auto& [kind, n] : after) all[kind] += 0;
  for (const auto& [kind, n] : all) {
    const auto b = before.find(kind), a = after.find(kind);
    const int delta = (a == after.end() ? 0 : a->second) - (b == before.end() ? 0 : b->second);
    if (delta != 0)
      absl::StrAppend(&out, out.empty() ? "" : ", ", delta > 0 ? "+" : "", delta, " ", kind);
  }
  return out.empty() ? "none" : out;
}

const char* TransportName(TransportKind kind) {
  return kind == TransportKind::kShm ? "shm" : "tcp";
}

// Memory a peer reaches: shareable (memfd) where shm should map it, plain memory for tcp.
class PeerMemory {
 public:
  PeerMemory(size_t bytes, TransportKind kind) {
    if (kind == TransportKind::kShm) {
      auto b = ShareableBuffer::Create(bytes, "scale-test");
      EXPECT_TRUE(b.ok()) << b.status();
      if (b.ok()) shared_ = std::move(*b);
      data_ = shared_.data();
    } else {
      plain_.resize(bytes);
      data_ = plain_.data();
    }
  }
  std::byte* data() const { return data_; }

 private:
  ShareableBuffer shared_;
  std::vector<std::byte> plain_;
  std::byte* data_ = nullptr;
};

// Waits (at most 10 s) until the thread and descriptor counts stayed the same for 0.5 s.
void SettleCounts() {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  size_t threads = Threads(), fds = Descriptors();
  absl::Time since = absl::Now();
  while (absl::Now() < deadline && absl::Now() - since < absl::Milliseconds(500)) {
    absl::SleepFor(absl::Milliseconds(20));
    const size_t t = Threads(), f = Descriptors();
    if (t != threads || f != fds) {
      threads = t;
      fds = f;
      since = absl::Now();
    }
  }
}

// Resident memory of this process, bytes.
uint64_t Rss() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long size = 0, resident = 0;
  const int got = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return got == 2 ? resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

double CpuSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
         (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

void RaiseOpenFiles() {
  rlimit lim{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &lim), 0);
  lim.rlim_cur = lim.rlim_max;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lim), 0);
}

// One tcp_scale_peer process, driven over its stdin and stdout.
class PeerProcess {
 public:
  PeerProcess(const std::vector<std::string>& args) {
    int in[2], out[2];
    EXPECT_EQ(pipe2(in, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(out, O_CLOEXEC), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    std::vector<std::string> all = {KVWIRE_SCALE_PEER};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    EXPECT_EQ(posix_spawn(&pid_, KVWIRE_SCALE_PEER, &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    in_ = in[1];
    out_ = out[0];
  }
  ~PeerProcess() {
    CloseInput();
    if (pid_ > 0 && !Exited(absl::Seconds(60))) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }
  void Send(const std::string& line) {
    const std::string l = line + "\n";
    EXPECT_EQ(write(in_, l.data(), l.size()), static_cast<ssize_t>(l.size()));
  }
  // The next line it prints, or "" at the deadline / end of output.
  std::string ReadLine(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      const size_t nl = buffered_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffered_.substr(0, nl);
        buffered_.erase(0, nl + 1);
        return line;
      }
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (ms <= 0) return "";
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1000))) <= 0) continue;
      char buf[256];
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) return "";
      buffered_.append(buf, n);
    }
  }
  void CloseInput() {
    if (in_ >= 0) close(in_);
    in_ = -1;
  }
  bool Exited(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return true;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

 private:
  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string buffered_;
};

EngineOptions HubOptions(uint64_t peers, TransportKind kind) {
  EngineOptions options;
  options.name = "hub";
  options.transport = TransportName(kind);
  options.tcp().connections = 1;
  options.tcp().io_threads = 2;
  // The peer processes read the same variable (tcp_scale_peer.cc).
  options.tcp().io_backend = testing::TcpTestBackend();
  const int connections = static_cast<int>(4 * peers + 64);
  options.tcp().max_data_connections = connections;
  options.max_control_connections = connections;
  // Heartbeats are the control channel's per-peer timer: slowed down so that the idle CPU
  // measured is the data path's.
  options.heartbeat_interval = absl::Seconds(30);
  options.peer_lease = absl::Seconds(120);
  return options;
}

size_t AlivePeers(const Engine& engine) {
  size_t n = 0;
  for (const PeerInfo& p : engine.Peers()) n += p.alive ? 1 : 0;
  return n;
}

bool WaitAlivePeers(const Engine& engine, size_t want, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (AlivePeers(engine) != want) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

class PeerScaleTest : public ::testing::TestWithParam<TransportKind> {};

TEST_P(PeerScaleTest, ThreadsStayFixedFromOnePeerToMany) {
  const TransportKind kind = GetParam();
  RaiseOpenFiles();
  const uint64_t peers = std::max<uint64_t>(2, EnvOr("KVWIRE_SCALE_PEERS", 100));
  const uint64_t procs = std::min(peers - 1, EnvOr("KVWIRE_SCALE_PROCS", 2));
  const size_t base_threads = Threads();
  const uint64_t rss_before = Rss();
  EngineOptions options = HubOptions(peers, kind);
  auto created = Engine::Create(options);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> hub = std::move(*created);
  // Area A: written by the peers; B: read by them; C: the hub's READs of their buffers.
  PeerMemory region(3 * peers * kSlotBytes, kind);
  for (uint64_t slot = 0; slot < peers; ++slot) {
    testing::FillPattern(region.data() + (peers + slot) * kSlotBytes, kSlotBytes, slot, 2);
  }
  RegionOptions region_options;
  region_options.export_to_all_peers = true;
  auto hub_region = hub->RegisterMemory(region.data(), 3 * peers * kSlotBytes, region_options);
  ASSERT_TRUE(hub_region.ok()) << hub_region.status();

  struct Count {
    uint64_t peers;
    size_t threads;
    uint64_t rss;
    size_t fds = 0;
    size_t maps = 0;
  };
  std::vector<Count> counts;
  const auto count = [&](uint64_t n) {
    ASSERT_TRUE(WaitAlivePeers(*hub, n, kWait)) << AlivePeers(*hub) << " of " << n;
    // Peers count as alive a moment before their data path settles (descriptors, mappings).
    SettleCounts();
    counts.push_back({n, Threads() - base_threads, Rss(), Descriptors(), Mappings()});
    std::printf(
        "%s hub engine with %4lu peers: %3zu threads, RSS %.1f MiB, %zu descriptors, %zu "
        "mappings\n",
        TransportName(kind), static_cast<unsigned long>(n), counts.back().threads,
        counts.back().rss / 1048576.0, counts.back().fds, counts.back().maps);
  };
  count(0);

  // Peer processes: the first holds one engine; the others share the rest.
  std::vector<std::unique_ptr<PeerProcess>> children;
  const auto spawn = [&](uint64_t first, uint64_t n) {
    children.push_back(std::make_unique<PeerProcess>(std::vector<std::string>{
        hub->address(), absl::StrCat(first), absl::StrCat(n), absl::StrCat(kSlotBytes),
        absl::StrCat(*hub_region), absl::StrCat(peers), TransportName(kind)}));
    const std::string line = children.back()->ReadLine(kWait);
    ASSERT_EQ(line, "READY") << "peer process for slots " << first << ".." << first + n - 1;
  };
  spawn(0, 1);
  count(1);
  uint64_t next = 1;
  const auto spawn_up_to = [&](uint64_t total, uint64_t processes) {
    const uint64_t each = (total - next + processes - 1) / processes;
    while (next < total) {
      const uint64_t n = std::min(each, total - next);
      spawn(next, n);
      next += n;
    }
  };
  if (peers > 100) {
    spawn_up_to(100, 1);
    count(100);
  }
  spawn_up_to(peers, procs);
  if (HasFatalFailure()) return;
  count(peers);

  // Idle: nothing moves; the hub's threads should sleep (no per-peer timer of the data path).
  const double cpu0 = CpuSeconds();
  absl::SleepFor(absl::Seconds(3));
  const double idle_cpu_ms = (CpuSeconds() - cpu0) * 1000;
  std::printf("%s hub idle for 3 s with %lu peers: %.1f ms CPU\n", TransportName(kind),
              static_cast<unsigned long>(peers), idle_cpu_ms);
  // Loose bounds, far above what an idle hub costs (measured in the closing notes), so that a
  // per-peer timer or a spinning loop shows, never the machine's load (CPU time, not wall).
  EXPECT_LT(idle_cpu_ms, 300) << "the hub burns CPU while nothing moves";
  const double per_peer_kib =
      (static_cast<double>(counts.back().rss) - static_cast<double>(counts[1].rss)) /
      static_cast<double>(peers - 1) / 1024;
  const double per_peer_fds =
      (static_cast<double>(counts.back().fds) - counts[1].fds) / static_cast<double>(peers - 1);
  const double per_peer_maps =
      (static_cast<double>(counts.back().maps) - counts[1].maps) / static_cast<double>(peers - 1);
  std::printf(
      "%s hub per connected peer: %.1f KiB, %.2f descriptors, %.2f memfd mappings (1 -> %lu peers; "
      "RSS before the engine %.1f MiB)\n",
      TransportName(kind), per_peer_kib, per_peer_fds, per_peer_maps,
      static_cast<unsigned long>(peers), rss_before / 1048576.0);
  EXPECT_LT(per_peer_kib, 1024) << "an idle peer costs the hub a MiB or more";
  // A control connection and the data path's own: a handful, not one per op or per region.
  EXPECT_LE(per_peer_fds, 8) << "descriptors per peer";
  if (kind == TransportKind::kShm) {
    // One region per peer: the hub maps each peer's buffer once (a few mappings at most).
    EXPECT_LE(per_peer_maps, 4) << "mappings per peer";
    for (const PeerInfo& p : hub->Peers()) {
      if (!p.alive) continue;
      EXPECT_EQ(p.transport.rfind("shm", 0), 0u) << p.name << " uses " << p.transport;
    }
  }

  // Everything at once: the peers WRITE area A and READ area B; the hub READs each peer's
  // first half into area C and WRITEs its second half.
  std::vector<std::byte> out(peers * kSlotBytes);
  for (uint64_t slot = 0; slot < peers; ++slot) {
    testing::FillPattern(out.data() + slot * kSlotBytes, kSlotBytes, slot, 3);
  }
  auto out_region = hub->RegisterMemory(out.data(), out.size());
  ASSERT_TRUE(out_region.ok()) << out_region.status();
  for (auto& child : children) child->Send("GO");
  const absl::Time start = absl::Now();
  std::vector<std::pair<std::string, TransferId>> ids;
  for (const PeerInfo& p : hub->Peers()) {
    if (!p.alive) continue;
    uint64_t slot = 0;
    ASSERT_TRUE(absl::SimpleAtoi(p.name.substr(1), &slot)) << p.name;
    auto remote = hub->RemoteRegions(p.id);
    ASSERT_TRUE(remote.ok() && remote->size() == 1) << p.name;
    const RegionId r = (*remote)[0].id;
    auto read = hub->Transfer(p.id, OpKind::kRead,
                              {Op{*hub_region, (2 * peers + slot) * kSlotBytes, r, 0, kSlotBytes}});
    auto write = hub->Transfer(p.id, OpKind::kWrite,
                               {Op{*out_region, slot * kSlotBytes, r, kSlotBytes, kSlotBytes}});
    ASSERT_TRUE(read.ok() && write.ok()) << p.name << ": " << read.status() << write.status();
    ids.push_back({p.name, *read});
    ids.push_back({p.name, *write});
  }
  ASSERT_EQ(ids.size(), 2 * peers);
  for (const auto& [name, id] : ids) {
    const absl::Status s = hub->Wait(id, kWait);
    EXPECT_TRUE(s.ok()) << name << ": " << s;
  }
  for (auto& child : children) EXPECT_EQ(child->ReadLine(kWait), "DONE 0");
  std::printf("%s: %lu peers x 4 transfers of %lu KiB, all at once: %.0f ms\n", TransportName(kind),
              static_cast<unsigned long>(peers), static_cast<unsigned long>(kSlotBytes >> 10),
              absl::ToDoubleMilliseconds(absl::Now() - start));
  for (uint64_t slot = 0; slot < peers; ++slot) {
    EXPECT_TRUE(testing::CheckPattern(region.data() + slot * kSlotBytes, kSlotBytes, slot, 1))
        << "area A slot " << slot;
    EXPECT_TRUE(
        testing::CheckPattern(region.data() + (2 * peers + slot) * kSlotBytes, kSlotBytes, slot, 0))
        << "area C slot " << slot;
  }
  for (auto& child : children) child->Send("CHECK");
  for (auto& child : children) EXPECT_EQ(child->ReadLine(kWait), "CHECKED 0");
  // Counted again after every peer moved data both ways: no thread per active connection.
  counts.push_back({peers, Threads() - base_threads, Rss()});
  std::printf("%s hub engine after the transfers: %zu threads\n", TransportName(kind),
              counts.back().threads);

  // The thread count does not grow with the peers: equal for 1 and for all, give or take the
  // pool (a thread starting or ending at the moment of the count).
  const int64_t one = static_cast<int64_t>(counts[1].threads);
  for (size_t c = 2; c < counts.size(); ++c) {
    const int64_t all = static_cast<int64_t>(counts[c].threads);
    EXPECT_LE(std::abs(all - one), options.tcp().io_threads)
        << "threads with 1 peer: " << one << ", with " << counts[c].peers << ": " << all
        << (c + 1 == counts.size() ? " (after the transfers)" : "");
  }

  for (auto& child : children) child->CloseInput();
  for (auto& child : children) EXPECT_TRUE(child->Exited(kWait));
  EXPECT_TRUE(WaitAlivePeers(*hub, 0, kWait));
  std::printf("%s hub after the peers left: %zu threads, %zu descriptors, %zu memfd mappings\n",
              TransportName(kind), Threads() - base_threads, Descriptors(), Mappings());
}

// True once the hub's one alive peer has its data path (a transport) set up.
bool HubDataPathUp(const Engine& hub, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    for (const PeerInfo& p : hub.Peers()) {
      if (p.alive && !p.transport.empty()) return true;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

TEST_P(PeerScaleTest, ConnectDisconnectCyclesLeaveNothingBehind) {
  const TransportKind kind = GetParam();
  RaiseOpenFiles();
  const uint64_t cycles = EnvOr("KVWIRE_SCALE_CYCLES", 200);
  auto hub = Engine::Create(HubOptions(16, kind));
  ASSERT_TRUE(hub.ok()) << hub.status();
  EngineOptions peer_options = HubOptions(16, kind);
  peer_options.name = "cycler";
  peer_options.tcp().connections = 2;
  auto peer = Engine::Create(peer_options);
  ASSERT_TRUE(peer.ok()) << peer.status();
  PeerMemory remote(1 << 20, kind);
  std::vector<std::byte> local(1 << 20);
  testing::FillPattern(remote.data(), 1 << 20, 1, 0);
  RegionOptions exported;
  exported.export_to_all_peers = true;
  auto remote_id = (*hub)->RegisterMemory(remote.data(), 1 << 20, exported);
  auto local_id = (*peer)->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(remote_id.ok() && local_id.ok());

  // Three kinds of cycle, in turn, so that a disconnect meets the hub at every stage of its
  // side of the set-up: right after Connect returns (the hub may still be opening its own data
  // path to the peer, which then fails against a forgotten session), after a transfer (often
  // still setting up under load), and after a transfer once the hub's data path is up.
  const auto cycle = [&](uint64_t i) {
    auto id = (*peer)->Connect((*hub)->address());
    ASSERT_TRUE(id.ok()) << "cycle " << i << ": " << id.status();
    if (i % 3 != 0) {
      ASSERT_TRUE((*peer)->WaitForRemoteRegion(*id, *remote_id, absl::Seconds(30)).ok());
      // Moves bytes, so that its data connections really open.
      auto t = (*peer)->Transfer(*id, OpKind::kRead, {Op{*local_id, 0, *remote_id, 0, 64 << 10}});
      ASSERT_TRUE(t.ok()) << t.status();
      ASSERT_TRUE((*peer)->Wait(*t, absl::Seconds(30)).ok());
    }
    if (i % 3 == 2) {
      ASSERT_TRUE(HubDataPathUp(**hub, absl::Seconds(30))) << "cycle " << i;
    }
    ASSERT_TRUE((*peer)->Disconnect(*id).ok());
  };
  // Warm-up: allocator pools, the engines' first peer structures, the I/O threads.
  for (uint64_t i = 0; i < 20; ++i) {
    cycle(i);
    if (HasFatalFailure()) return;
  }
  ASSERT_TRUE(WaitAlivePeers(**hub, 0, kWait));
  // The last warm-up's connections may still be closing on the I/O threads (the peer is gone
  // from the hub's table before its sockets are): counted once the counts held still a while,
  // or a socket on its way out would read as one the cycles freed.
  SettleCounts();
  const size_t threads = Threads();
  const size_t fds = Descriptors();
  const size_t maps = Mappings();
  const KindCounts fd_kinds = DescriptorKinds();
  const KindCounts map_kinds = MappingKinds();
  const uint64_t rss = Rss();
  const absl::Time start = absl::Now();
  for (uint64_t i = 0; i < cycles; ++i) {
    cycle(i);
    if (HasFatalFailure()) return;
  }
  EXPECT_TRUE(testing::CheckPattern(local.data(), 64 << 10, 1, 0));
  ASSERT_TRUE(WaitAlivePeers(**hub, 0, kWait));
  // Ended connections are let go of on the I/O threads shortly after the peers closed.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while ((Threads() != threads || Descriptors() != fds || Mappings() != maps) &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  const uint64_t rss_after = Rss();
  std::printf(
      "%s: %lu connect/disconnect cycles in %.1f s: threads %zu -> %zu, descriptors %zu -> "
      "%zu, memfd mappings %zu -> %zu, RSS %.1f -> %.1f MiB\n",
      TransportName(kind), static_cast<unsigned long>(cycles),
      absl::ToDoubleSeconds(absl::Now() - start), threads, Threads(), fds, Descriptors(), maps,
      Mappings(), rss / 1048576.0, rss_after / 1048576.0);
  EXPECT_EQ(Threads(), threads);
  EXPECT_EQ(Descriptors(), fds) << "descriptors: " << KindDiff(fd_kinds, DescriptorKinds());
  EXPECT_EQ(Mappings(), maps) << "memfd mappings: " << KindDiff(map_kinds, MappingKinds());
  // Both engines live in this process, so a peer's mapping of a memfd (the hub's buffer, an
  // engine's epoch table) is a second mapping of a memfd the process maps already. A closed
  // peer is kept a while (closed_peers_kept) but holds none of its channels' mappings: after
  // the cycles each memfd is mapped once, however far each cycle's set-up got.
  for (const auto& [memfd, n] : MappingKinds()) {
    EXPECT_EQ(n, 1) << memfd << " mapped " << n << " times: closed peers' channels still map it";
  }
  // Memory: allocator slack is fine, growth with the cycles is not (1000 leaked connections
  // of even 16 KiB each would be 16 MiB).
  // Under ASan the allocator keeps more per cycle (measured: 6.5 MiB over 200 cycles, 8.9
  // over 600, 0 without ASan); LeakSanitizer checks for real leaks at exit there.
#ifdef KVWIRE_SCALE_TEST_ASAN
  constexpr uint64_t kSlack = 16 << 20;
#else
  constexpr uint64_t kSlack = 8 << 20;
#endif
  EXPECT_LT(rss_after, rss + kSlack) << rss << " -> " << rss_after;
}

INSTANTIATE_TEST_SUITE_P(Transports, PeerScaleTest,
                         ::testing::Values(TransportKind::kTcp, TransportKind::kShm),
                         [](const ::testing::TestParamInfo<TransportKind>& info) {
                           return std::string(TransportName(info.param));
                         });

}  // namespace
}  // namespace kvwire

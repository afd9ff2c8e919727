// The engine's own transfers on a shared buffer while the buffer is moved onto fresh memfds
// (shm revocation, transport/shm/shareable_registry.h): every op that reports success has its
// bytes in the owner's memory, whichever transport carried it. Four kinds of op run at once,
// each on its own slice of the owner's buffer, while the owner revokes a third peer's export
// again and again (each Unexport moves the whole buffer):
//   - the owner READs over tcp into the buffer (its own transfer: held during a move);
//   - a tcp peer WRITEs into it (an incoming op: held by the target's serving thread);
//   - the owner READs over shm into it (its own shm copy: held);
//   - a shm peer WRITEs into it through its mapping (follows the move: epoch table).
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"
#include "transport/shm/shareable_registry.h"
#include "transport/shm/write_guard.h"

namespace kvwire::testing {
namespace {

constexpr uint64_t kSlice = 64 << 10;           // one op's part of the owner's buffer
constexpr size_t kSubs = 16;                    // slices per worker
constexpr uint64_t kBufferBytes = 32ull << 20;  // large enough that a move takes a while
constexpr int kMinMoves = 30;
constexpr int kMinOverlapped = 3;  // ops per worker that ran while a move completed

std::unique_ptr<Engine> MakeEngine(const std::string& name, const std::string& transport) {
  EngineOptions options;
  options.name = name;
  options.transport = transport;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

absl::Status RunOne(Engine& engine, PeerId peer, OpKind kind, const Op& op) {
  absl::StatusOr<TransferId> id = engine.Transfer(peer, kind, {op});
  if (!id.ok()) return id.status();
  return engine.Wait(*id, absl::Seconds(60));
}

void Fill(std::byte* data, uint64_t length, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (uint64_t i = 0; i < length; i += 8) {
    const uint64_t word = rng();
    std::memcpy(data + i, &word, std::min<uint64_t>(8, length - i));
  }
}

bool Sees(Engine& engine, PeerId peer, RegionId region) {
  absl::StatusOr<std::vector<RemoteRegion>> regions = engine.RemoteRegions(peer);
  if (!regions.ok()) return false;
  for (const RemoteRegion& r : *regions) {
    if (r.id == region) return true;
  }
  return false;
}

struct Worker {
  const char* name;
  std::atomic<int> ok{0};
  std::atomic<int> overlapped{0};  // succeeded with a move completing while it ran
  std::atomic<int> wrong{0};       // succeeded, but the owner's memory holds other bytes
  std::atomic<int> failed{0};      // any other failure
  std::string first_error = {};    // written by the worker's thread only, read after join
};

TEST(ShmMoveEngineTest, TransfersDuringMovesLandInTheOwnersMemory) {
  std::unique_ptr<Engine> owner = MakeEngine("owner", "auto");
  std::unique_ptr<Engine> tcp_peer = MakeEngine("tcp-peer", "tcp");
  std::unique_ptr<Engine> shm_peer = MakeEngine("shm-peer", "auto");
  std::unique_ptr<Engine> revoked = MakeEngine("revoked", "auto");
  ASSERT_TRUE(owner && tcp_peer && shm_peer && revoked);

  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kBufferBytes, "moved");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memset(buffer->data(), 0, buffer->size());
  RegionOptions rw;
  rw.access = kRemoteReadWrite;
  absl::StatusOr<RegionId> owned = owner->RegisterMemory(buffer->data(), buffer->size(), rw);
  ASSERT_TRUE(owned.ok()) << owned.status();

  // The peers' own memory: exported to all, so the owner can READ from it.
  RegionOptions source_options;
  source_options.access = kRemoteReadWrite;
  source_options.export_to_all_peers = true;
  std::vector<std::byte> tcp_memory(2 * kSlice);
  absl::StatusOr<RegionId> tcp_source =
      tcp_peer->RegisterMemory(tcp_memory.data(), tcp_memory.size(), source_options);
  absl::StatusOr<ShareableBuffer> shm_memory = ShareableBuffer::Create(2 * kSlice, "shm-peer");
  ASSERT_TRUE(tcp_source.ok() && shm_memory.ok());
  absl::StatusOr<RegionId> shm_source =
      shm_peer->RegisterMemory(shm_memory->data(), shm_memory->size(), source_options);
  std::vector<std::byte> revoked_memory(4096);
  absl::StatusOr<RegionId> revoked_local =
      revoked->RegisterMemory(revoked_memory.data(), revoked_memory.size());
  ASSERT_TRUE(shm_source.ok() && revoked_local.ok());

  absl::StatusOr<PeerId> to_tcp = owner->Connect(tcp_peer->address());
  absl::StatusOr<PeerId> to_shm = owner->Connect(shm_peer->address());
  absl::StatusOr<PeerId> to_revoked = owner->Connect(revoked->address());
  ASSERT_TRUE(to_tcp.ok() && to_shm.ok() && to_revoked.ok());
  ASSERT_TRUE(owner->Export(*to_tcp, {*owned}).ok());
  ASSERT_TRUE(owner->Export(*to_shm, {*owned}).ok());
  const absl::Duration wait = absl::Seconds(20);
  ASSERT_TRUE(owner->WaitForRemoteRegion(*to_tcp, *tcp_source, wait).ok());
  ASSERT_TRUE(owner->WaitForRemoteRegion(*to_shm, *shm_source, wait).ok());
  // The peers' ids for the owner: each has one peer.
  auto only_peer = [](Engine& engine) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    for (;;) {
      const EngineStats stats = engine.Stats();
      if (!stats.peers.empty() || absl::Now() > until) {
        return stats.peers.empty() ? PeerId{0} : PeerId{stats.peers[0].peer_id};
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
  };
  const PeerId tcp_to_owner = only_peer(*tcp_peer);
  const PeerId shm_to_owner = only_peer(*shm_peer);
  const PeerId revoked_to_owner = only_peer(*revoked);
  ASSERT_TRUE(tcp_to_owner != 0 && shm_to_owner != 0 && revoked_to_owner != 0);
  ASSERT_TRUE(tcp_peer->WaitForRemoteRegion(tcp_to_owner, *owned, wait).ok());
  ASSERT_TRUE(shm_peer->WaitForRemoteRegion(shm_to_owner, *owned, wait).ok());

  std::atomic<bool> stop{false};
  Worker workers[4] = {
      {"owner READ over tcp"}, {"tcp peer WRITE"}, {"owner READ over shm"}, {"shm peer WRITE"}};
  // Each worker owns kSubs slices of the buffer and writes them in turn: a write that went
  // into the memfd being given up shows only once the owner's range is mapped over (the
  // move's end), so each slice is checked when the worker comes back to it, kSubs ops later
  // (nobody else writes it meanwhile), and all of them at the end.
  std::vector<std::vector<std::byte>> last(4 * kSubs);
  auto check = [&](Worker& me, size_t index) {
    if (last[index].empty()) return;
    // The owner's tcp serving thread wrote the tcp peer's WRITEs: ordered before the check.
    if (index / kSubs == 1 && !owner->WaitForServedOps(*to_tcp, absl::Seconds(20)).ok()) {
      ++me.failed;
      return;
    }
    if (std::memcmp(buffer->data() + index * kSlice, last[index].data(), kSlice) != 0) ++me.wrong;
  };
  auto work = [&](int w) {
    Worker& me = workers[w];
    std::vector<std::byte> expected(kSlice);
    for (uint64_t round = 1; !stop.load(); ++round) {
      const size_t index = w * kSubs + round % kSubs;
      const uint64_t at = index * kSlice;
      check(me, index);
      const uint64_t seed = w * 1000003 + round;
      absl::Status status;
      const uint64_t moves_before = transport::shm::RebackCount();
      switch (w) {
        case 0:  // the tcp peer's memory holds the next bytes; the owner reads them in
          // Its serving thread's last send of the previous bytes is over (the sanitizer cannot
          // see that through the socket), and the new bytes are published to it.
          status = tcp_peer->WaitForServedOps(tcp_to_owner, absl::Seconds(20));
          if (!status.ok()) break;
          Fill(tcp_memory.data(), kSlice, seed);
          tcp_peer->PublishMemory();
          std::memcpy(expected.data(), tcp_memory.data(), kSlice);
          status = RunOne(*owner, *to_tcp, OpKind::kRead, Op{*owned, at, *tcp_source, 0, kSlice});
          break;
        case 1:  // the tcp peer writes from the upper half of its memory
          Fill(tcp_memory.data() + kSlice, kSlice, seed);
          std::memcpy(expected.data(), tcp_memory.data() + kSlice, kSlice);
          status = RunOne(*tcp_peer, tcp_to_owner, OpKind::kWrite,
                          Op{*tcp_source, kSlice, *owned, at, kSlice});
          break;
        case 2:
          Fill(shm_memory->data(), kSlice, seed);
          std::memcpy(expected.data(), shm_memory->data(), kSlice);
          status = RunOne(*owner, *to_shm, OpKind::kRead, Op{*owned, at, *shm_source, 0, kSlice});
          break;
        default:
          Fill(shm_memory->data() + kSlice, kSlice, seed);
          std::memcpy(expected.data(), shm_memory->data() + kSlice, kSlice);
          status = RunOne(*shm_peer, shm_to_owner, OpKind::kWrite,
                          Op{*shm_source, kSlice, *owned, at, kSlice});
          break;
      }
      if (!status.ok()) {
        // The slice may hold part of it: not checked until written again.
        last[index].clear();
        if (me.failed++ == 0) me.first_error = status.ToString();
        continue;
      }
      ++me.ok;
      if (transport::shm::RebackCount() != moves_before) ++me.overlapped;
      last[index] = expected;
    }
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) threads.emplace_back(work, w);

  // Each cycle: the revoked peer maps the buffer (one READ through shm), then the owner
  // withdraws the export, which moves the buffer.
  const uint64_t moves_at_start = transport::shm::RebackCount();
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  int cycles = 0;
  auto enough = [&] {
    if (cycles < kMinMoves) return false;
    for (const Worker& w : workers) {
      if (w.overlapped.load() < kMinOverlapped) return false;
    }
    return true;
  };
  while (!enough() && absl::Now() < deadline) {
    ASSERT_TRUE(owner->Export(*to_revoked, {*owned}).ok());
    ASSERT_TRUE(revoked->WaitForRemoteRegion(revoked_to_owner, *owned, wait).ok());
    const absl::Status read =
        RunOne(*revoked, revoked_to_owner, OpKind::kRead, Op{*revoked_local, 0, *owned, 0, 4096});
    ASSERT_TRUE(read.ok()) << read;
    ASSERT_TRUE(owner->Unexport(*to_revoked, {*owned}).ok());
    ++cycles;
    const absl::Time gone = absl::Now() + wait;
    while (Sees(*revoked, revoked_to_owner, *owned) && absl::Now() < gone) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_FALSE(Sees(*revoked, revoked_to_owner, *owned)) << "the revoked peer still sees it";
  }
  stop = true;
  for (std::thread& t : threads) t.join();
  for (int w = 0; w < 4; ++w) {
    for (size_t k = 0; k < kSubs; ++k) check(workers[w], w * kSubs + k);
  }
  const uint64_t moves = transport::shm::RebackCount() - moves_at_start;
  std::printf("%d unexports, %llu moves of %llu MiB\n", cycles,
              static_cast<unsigned long long>(moves),
              static_cast<unsigned long long>(kBufferBytes >> 20));
  EXPECT_EQ(moves, static_cast<uint64_t>(cycles)) << "each unexport must move the buffer once";
  for (const Worker& w : workers) {
    std::printf("%-20s ok %d (during a move %d), wrong %d, failed %d\n", w.name, w.ok.load(),
                w.overlapped.load(), w.wrong.load(), w.failed.load());
    EXPECT_EQ(w.wrong.load(), 0) << w.name << ": a successful op is not in the owner's memory";
    EXPECT_EQ(w.failed.load(), 0) << w.name << ": " << w.first_error;
    EXPECT_GE(w.overlapped.load(), kMinOverlapped)
        << w.name << ": too few ops ran while the buffer was moved (" << cycles << " moves)";
  }
  // The engines before the memory they serve (their threads' last accesses end with them).
  revoked.reset();
  shm_peer.reset();
  tcp_peer.reset();
  owner.reset();
}

// The write guard off (as on a kernel without it) for one test, via the transport's test hook;
// engines created meanwhile see it unavailable.
class GuardDisabled {
 public:
  explicit GuardDisabled(bool disabled) : disabled_(disabled) {
    transport::shm::SetWriteGuardDisabledForTesting(disabled_);
  }
  ~GuardDisabled() { transport::shm::SetWriteGuardDisabledForTesting(false); }

 private:
  bool disabled_;
};

// A peer that closes its control connection (its engine goes away) while something of it kept
// a mapping of the owner's buffer: with the default options (revoke_on_close, where the write
// guard works) the owner moves the buffer off that memfd, so the kept mapping sees none of the
// owner's later writes and its writes never reach the owner. With revoke_on_close off, or the
// write guard unavailable (the fallback: a test hook here), the mapping keeps sharing the
// owner's memory.
enum class CloseCase { kDefaults, kOptionOff, kGuardUnavailable };

class PeerCloseTest : public ::testing::TestWithParam<CloseCase> {};

TEST_P(PeerCloseTest, AKeptMappingOfAClosedPeerReachesNothingOfTheOwner) {
  GuardDisabled hook(GetParam() == CloseCase::kGuardUnavailable);
  EngineOptions owner_options;
  owner_options.name = "owner";
  if (GetParam() == CloseCase::kOptionOff) owner_options.shm().revoke_on_close = false;
  const absl::Status guard = transport::shm::WriteGuardAvailable();
  const bool revoke = GetParam() != CloseCase::kOptionOff && guard.ok();
  if (GetParam() == CloseCase::kDefaults && !guard.ok()) {
    std::printf("the write guard is not available here (%s): the default is the fallback\n",
                guard.ToString().c_str());
  }
  absl::StatusOr<std::unique_ptr<Engine>> owner = Engine::Create(owner_options);
  ASSERT_TRUE(owner.ok()) << owner.status();
  constexpr uint64_t kBytes = 1 << 20;
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kBytes, "closed");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memset(buffer->data(), 'A', kBytes);
  RegionOptions rw;
  rw.access = kRemoteReadWrite;
  absl::StatusOr<RegionId> owned = (*owner)->RegisterMemory(buffer->data(), kBytes, rw);
  ASSERT_TRUE(owned.ok()) << owned.status();

  std::unique_ptr<Engine> peer = MakeEngine("closing-peer", "auto");
  ASSERT_NE(peer, nullptr);
  std::vector<std::byte> local(4096);
  absl::StatusOr<RegionId> local_id = peer->RegisterMemory(local.data(), local.size());
  absl::StatusOr<PeerId> to_owner = peer->Connect((*owner)->address());
  ASSERT_TRUE(local_id.ok() && to_owner.ok());
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while ((*owner)->Stats().peers.empty() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_FALSE((*owner)->Stats().peers.empty());
  const PeerId to_peer = (*owner)->Stats().peers[0].peer_id;
  ASSERT_TRUE((*owner)->Export(to_peer, {*owned}).ok());
  ASSERT_TRUE(peer->WaitForRemoteRegion(*to_owner, *owned, absl::Seconds(20)).ok());
  // Over shm: the peer maps the buffer's memfd.
  const absl::Status read =
      RunOne(*peer, *to_owner, OpKind::kRead, Op{*local_id, 0, *owned, 0, 4096});
  ASSERT_TRUE(read.ok()) << read;
  EXPECT_EQ(local[0], std::byte{'A'});
  EXPECT_EQ(peer->Stats().peers.at(0).transport.rfind("shm", 0), 0u)
      << peer->Stats().peers.at(0).transport;

  // What the peer could keep: a mapping of the memfd it was handed (the buffer's, now).
  auto* kept = static_cast<char*>(
      mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, buffer->fd(), 0));
  ASSERT_NE(kept, MAP_FAILED);
  std::memset(buffer->data(), 'B', kBytes);
  ASSERT_EQ(kept[kBytes / 2], 'B') << "the kept mapping did not share the owner's memory";

  const uint64_t moves = transport::shm::RebackCount();
  peer.reset();  // closes its control connection
  if (revoke) {
    const absl::Time moved_by = absl::Now() + absl::Seconds(20);
    while (transport::shm::RebackCount() == moves && absl::Now() < moved_by) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(transport::shm::RebackCount(), moves + 1) << "the peer's close moved nothing";
  } else {
    // The owner noticed the close (its peer is gone) and moved nothing.
    auto peer_alive = [&] {
      const EngineStats stats = (*owner)->Stats();
      return std::any_of(stats.peers.begin(), stats.peers.end(),
                         [](const PeerStats& p) { return p.alive; });
    };
    while (peer_alive() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_FALSE(peer_alive()) << "the owner did not notice the close";
    absl::SleepFor(absl::Milliseconds(200));  // a move, were one queued, would have run
    EXPECT_EQ(transport::shm::RebackCount(), moves);
  }
  std::memset(buffer->data(), 'O', kBytes);  // the owner's later write
  const ptrdiff_t seen = std::count(kept, kept + kBytes, 'O');
  std::memset(kept, 'X', kBytes);  // the kept mapping's write
  const ptrdiff_t reached = std::count(buffer->data(), buffer->data() + kBytes, std::byte{'X'});
  std::printf(
      "revoke_on_close=%d: the kept mapping saw %td of the owner's %llu later bytes; "
      "%td of its writes reached the owner\n",
      revoke, seen, static_cast<unsigned long long>(kBytes), reached);
  if (revoke) {
    EXPECT_EQ(seen, 0) << "the owner's later write reached the closed peer's mapping";
    EXPECT_EQ(reached, 0) << "the closed peer's mapping wrote into the owner's memory";
    EXPECT_EQ(std::count(buffer->data(), buffer->data() + kBytes, std::byte{'O'}),
              static_cast<ptrdiff_t>(kBytes));
  } else {
    EXPECT_EQ(seen, static_cast<ptrdiff_t>(kBytes));
    EXPECT_EQ(reached, static_cast<ptrdiff_t>(kBytes));
  }
  munmap(kept, kBytes);
}

INSTANTIATE_TEST_SUITE_P(ShmMoveEngineTest, PeerCloseTest,
                         ::testing::Values(CloseCase::kDefaults, CloseCase::kOptionOff,
                                           CloseCase::kGuardUnavailable),
                         [](const ::testing::TestParamInfo<CloseCase>& info) {
                           switch (info.param) {
                             case CloseCase::kDefaults:
                               return std::string("DefaultOptions");
                             case CloseCase::kOptionOff:
                               return std::string("RevokeOnCloseOff");
                             default:
                               return std::string("GuardUnavailable");
                           }
                         });

// The application's own writer threads, each writing increasing numbers into one word per page
// of its own slice of the owner's buffer, in turn; before each write it reads the word back,
// which must still hold its previous write there (a write that landed in a memfd given up by a
// move shows as an older value once the new memfd is mapped over the range).
constexpr int kWriters = 3;
constexpr uint64_t kWriterPages = 64;
constexpr uint64_t kWriterSlice = 1 << 20;  // writer w's slice starts at (w + 1) MiB

struct Writer {
  std::atomic<uint64_t> writes{0};
  std::atomic<uint64_t> lost{0};          // a word did not hold this writer's last write there
  std::atomic<uint64_t> during_moves{0};  // writes begun while a move was under way
  std::vector<uint64_t> last = std::vector<uint64_t>(kWriterPages, 0);  // the writer's own
};

// Not instrumented by ThreadSanitizer: these writes race with the move's copy (a pwrite from
// the owner's range, which the sanitizer sees as a read) by design; the kernel's write guard
// is what orders them, invisibly to it. Volatile: every read and write reaches memory.
__attribute__((no_sanitize("thread"))) void WriteLoop(std::byte* slice, size_t page, Writer* me,
                                                      const std::atomic<bool>* stop,
                                                      const std::atomic<bool>* moving) {
  for (uint64_t n = 1; !stop->load(std::memory_order_relaxed); ++n) {
    const uint64_t k = n % kWriterPages;
    volatile uint64_t* word = reinterpret_cast<volatile uint64_t*>(slice + k * page);
    if (*word != me->last[k]) me->lost.fetch_add(1, std::memory_order_relaxed);
    if (moving->load(std::memory_order_relaxed)) {
      me->during_moves.fetch_add(1, std::memory_order_relaxed);
    }
    *word = n;
    me->last[k] = n;
    me->writes.fetch_add(1, std::memory_order_relaxed);
    if (n % 64 == 0) std::this_thread::yield();  // the engines' threads share two cores
  }
}

// Application threads write into a shared buffer continuously while the owner moves it at least
// 30 times, by peers' closes and by Unexport: with the write guard every writer's words hold its
// last write at the end and no write was ever lost. With the guard disabled (test hook), a
// peer's close moves nothing (the fallback) and the unexports' moves lose writes: that the test
// sees them is what makes the guarded run's zero mean something.
class WritesDuringMovesTest : public ::testing::TestWithParam<bool> {};

TEST_P(WritesDuringMovesTest, TheApplicationsWritesDuringMovesAreKept) {
  const bool guarded = GetParam();
  if (guarded) {
    if (absl::Status guard = transport::shm::WriteGuardAvailable(); !guard.ok()) {
      GTEST_SKIP() << "the write guard is not available here: " << guard;
    }
  }
  GuardDisabled hook(!guarded);
  EngineOptions owner_options;
  owner_options.name = "owner";
  owner_options.shm().revoke_on_close = true;
  absl::StatusOr<std::unique_ptr<Engine>> owner_or = Engine::Create(owner_options);
  ASSERT_TRUE(owner_or.ok()) << owner_or.status();
  std::unique_ptr<Engine> owner = *std::move(owner_or);
  std::unique_ptr<Engine> revoked = MakeEngine("revoked", "auto");
  ASSERT_TRUE(revoked);

  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kBufferBytes, "written");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memset(buffer->data(), 0, buffer->size());
  RegionOptions rw;
  rw.access = kRemoteReadWrite;
  absl::StatusOr<RegionId> owned = owner->RegisterMemory(buffer->data(), buffer->size(), rw);
  ASSERT_TRUE(owned.ok()) << owned.status();
  std::vector<std::byte> revoked_memory(4096);
  absl::StatusOr<RegionId> revoked_local =
      revoked->RegisterMemory(revoked_memory.data(), revoked_memory.size());
  ASSERT_TRUE(revoked_local.ok());
  absl::StatusOr<PeerId> to_revoked = owner->Connect(revoked->address());
  ASSERT_TRUE(to_revoked.ok()) << to_revoked.status();
  const absl::Duration wait = absl::Seconds(20);
  auto peer_ids = [&] {
    std::vector<uint64_t> ids;
    for (const PeerStats& p : owner->Stats().peers) ids.push_back(p.peer_id);
    return ids;
  };
  PeerId revoked_to_owner = 0;
  for (const absl::Time until = absl::Now() + wait; revoked_to_owner == 0 && absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(1))) {
    const EngineStats stats = revoked->Stats();
    if (!stats.peers.empty()) revoked_to_owner = stats.peers[0].peer_id;
  }
  ASSERT_NE(revoked_to_owner, 0u);

  // The peer (`to` on the owner, `from` on the peer) maps the buffer: one READ over shm.
  auto map_it = [&](Engine& peer, PeerId to, PeerId from, RegionId local) {
    EXPECT_TRUE(owner->Export(to, {*owned}).ok());
    EXPECT_TRUE(peer.WaitForRemoteRegion(from, *owned, wait).ok());
    const absl::Status read = RunOne(peer, from, OpKind::kRead, Op{local, 0, *owned, 0, 4096});
    EXPECT_TRUE(read.ok()) << read;
    const std::vector<PeerStats> peers = peer.Stats().peers;
    EXPECT_TRUE(!peers.empty() && peers[0].transport.rfind("shm", 0) == 0);
  };

  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::atomic<bool> stop{false};
  std::atomic<bool> moving{false};
  Writer writers[kWriters];
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back(WriteLoop, buffer->data() + (w + 1) * kWriterSlice, page, &writers[w],
                         &stop, &moving);
  }
  auto total_writes = [&] {
    uint64_t sum = 0;
    for (const Writer& w : writers) sum += w.writes.load();
    return sum;
  };
  auto total_lost = [&] {
    uint64_t sum = 0;
    for (const Writer& w : writers) sum += w.lost.load();
    return sum;
  };

  const uint64_t moves_at_start = transport::shm::RebackCount();
  const uint64_t guarded_at_start = transport::shm::GuardedRebackCount();
  // Guarded: every other move by a peer's close. Unguarded, a close moves nothing: one cycle in
  // four checks that, the others unexport.
  const int close_every = guarded ? 2 : 4;
  int unexports = 0, closes = 0, moves_with_writes = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(150);
  auto enough = [&] {
    const uint64_t moves = transport::shm::RebackCount() - moves_at_start;
    if (moves < static_cast<uint64_t>(kMinMoves) || moves_with_writes < kMinMoves / 2) {
      return false;
    }
    return guarded ? closes >= kMinMoves / 2 : total_lost() > 0;
  };
  for (int cycle = 1; !enough() && absl::Now() < deadline; ++cycle) {
    const uint64_t moves_before = transport::shm::RebackCount();
    const uint64_t writes_before = total_writes();
    if (cycle % close_every == 0) {
      std::unique_ptr<Engine> peer = MakeEngine(absl::StrCat("closing-", cycle), "auto");
      ASSERT_TRUE(peer);
      std::vector<std::byte> local(4096);
      absl::StatusOr<RegionId> local_id = peer->RegisterMemory(local.data(), local.size());
      ASSERT_TRUE(local_id.ok());
      const std::vector<uint64_t> known = peer_ids();
      absl::StatusOr<PeerId> from = peer->Connect(owner->address());
      ASSERT_TRUE(from.ok()) << from.status();
      PeerId to = 0;
      for (const absl::Time until = absl::Now() + wait; to == 0 && absl::Now() < until;
           absl::SleepFor(absl::Milliseconds(1))) {
        for (uint64_t id : peer_ids()) {
          if (std::find(known.begin(), known.end(), id) == known.end()) to = id;
        }
      }
      ASSERT_NE(to, 0u) << "the owner never saw the new peer";
      map_it(*peer, to, *from, *local_id);
      moving = true;
      peer.reset();  // closes its connections: the owner's transport moves the buffer
      ++closes;
      if (guarded) {
        const absl::Time moved_by = absl::Now() + wait;
        while (transport::shm::RebackCount() == moves_before && absl::Now() < moved_by) {
          absl::SleepFor(absl::Microseconds(200));
        }
        ASSERT_EQ(transport::shm::RebackCount(), moves_before + 1)
            << "the peer's close did not move the buffer";
      } else {
        auto alive = [&] {
          for (const PeerStats& p : owner->Stats().peers) {
            if (p.peer_id == to) return p.alive;
          }
          return false;
        };
        const absl::Time noticed_by = absl::Now() + wait;
        while (alive() && absl::Now() < noticed_by) absl::SleepFor(absl::Microseconds(200));
        ASSERT_FALSE(alive()) << "the owner did not notice the close";
      }
    } else {
      map_it(*revoked, *to_revoked, revoked_to_owner, *revoked_local);
      moving = true;
      ASSERT_TRUE(owner->Unexport(*to_revoked, {*owned}).ok());
      ++unexports;
      ASSERT_EQ(transport::shm::RebackCount(), moves_before + 1)
          << "the unexport did not move the buffer";
      const absl::Time gone = absl::Now() + wait;
      while (Sees(*revoked, revoked_to_owner, *owned) && absl::Now() < gone) {
        absl::SleepFor(absl::Milliseconds(1));
      }
    }
    moving = false;
    if (total_writes() != writes_before) ++moves_with_writes;
  }
  stop = true;
  for (std::thread& t : threads) t.join();
  // At the end, every word holds its writer's last write.
  uint64_t lost_at_end = 0;
  for (int w = 0; w < kWriters; ++w) {
    const std::byte* slice = buffer->data() + (w + 1) * kWriterSlice;
    for (uint64_t k = 0; k < kWriterPages; ++k) {
      uint64_t word;
      std::memcpy(&word, slice + k * page, sizeof(word));
      if (word != writers[w].last[k]) ++lost_at_end;
    }
  }
  const uint64_t moves = transport::shm::RebackCount() - moves_at_start;
  const uint64_t guarded_moves = transport::shm::GuardedRebackCount() - guarded_at_start;
  uint64_t during = 0;
  for (const Writer& w : writers) during += w.during_moves.load();
  std::printf(
      "guard %s: %llu moves (%llu guarded; %d unexports, %d closes), writes went on during "
      "%d cycles; %llu writes (%llu begun during a move), %llu lost while running, %llu words "
      "without their last write at the end\n",
      guarded ? "on" : "off", static_cast<unsigned long long>(moves),
      static_cast<unsigned long long>(guarded_moves), unexports, closes, moves_with_writes,
      static_cast<unsigned long long>(total_writes()), static_cast<unsigned long long>(during),
      static_cast<unsigned long long>(total_lost()), static_cast<unsigned long long>(lost_at_end));
  EXPECT_GE(moves, static_cast<uint64_t>(kMinMoves));
  EXPECT_GE(moves_with_writes, kMinMoves / 2) << "the writers were not writing during the moves";
  if (guarded) {
    EXPECT_EQ(guarded_moves, moves) << "a move ran without the write guard";
    EXPECT_EQ(moves, static_cast<uint64_t>(unexports + closes)) << "each cycle moves once";
    EXPECT_EQ(total_lost(), 0u) << "writes made during a move were lost";
    EXPECT_EQ(lost_at_end, 0u) << "words lost their writer's last write";
  } else {
    EXPECT_EQ(guarded_moves, 0u);
    EXPECT_EQ(moves, static_cast<uint64_t>(unexports)) << "without the guard a close moved";
    EXPECT_GT(total_lost() + lost_at_end, 0u)
        << "without the guard no write was lost: the test cannot tell the guard works";
  }
  revoked.reset();
  owner.reset();
}

INSTANTIATE_TEST_SUITE_P(ShmMoveEngineTest, WritesDuringMovesTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "Guarded" : "GuardDisabled");
                         });

}  // namespace
}  // namespace kvwire::testing

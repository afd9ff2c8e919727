// A read-mode release carries what the reader did (read_bytes: the bytes it READ under its
// grant), and the prefill frees the blocks once its engine served that many, without waiting
// on the message path: here the release overtakes the reader's READ altogether (sent before
// it, as when the op is still unread in the prefill's socket). The prefill (a connector in this
// process) must keep the blocks and the grant until the READ was served, then free them;
// another peer's messages are handled meanwhile; a count never reached is bounded by that
// request's own deadline; a release without a count (an older peer) revokes at once.
// The readers are hand-driven engines (tcp; grant-guarded regions go over tcp whatever the
// transport).
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "kvwire/connector.h"
#include "kvwire/deepseek.h"
#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "kvwire/memory.h"
#include "transport/shm/write_guard.h"

namespace kvwire::testing {
namespace {

using nlohmann::json;

constexpr char kTopic[] = "kvwire.connector";
constexpr uint64_t kTokens = 70;
constexpr uint64_t kBlocks = 8, kStateBlocks = 4;
constexpr absl::Duration kWait = absl::Seconds(60);

Layout TestLayout() { return DeepSeekV4Layout("release-count-test", {0, 4, 128}); }

// Request `n`'s blocks (n = 0 or 1): disjoint per request.
BlockTable Blocks(const Layout& l, int n) {
  BlockTable t;
  for (const CacheGroup& g : l.groups) {
    if (g.per_request_state) {
      t[g.name] = {n};
      continue;
    }
    const uint64_t count = (kTokens + g.tokens_per_block - 1) / g.tokens_per_block;
    for (uint64_t i = 0; i < count; ++i) t[g.name].push_back(static_cast<int64_t>(n * 4 + i));
  }
  return t;
}

struct Span {
  uint64_t base, length;
  RegionId id;
};

// A decode engine driven by hand: the connector handshake, read_start, READs, release.
class Reader {
 public:
  Reader(const std::string& name, const std::string& prefill_address, uint64_t bytes) {
    EngineOptions o;
    o.name = absl::StrCat(name, "-", getpid());
    o.transport = "tcp";
    o.peer_lease = absl::Seconds(5);
    o.heartbeat_interval = absl::Milliseconds(200);
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    auto inbox = engine_->OpenInbox(kTopic);
    EXPECT_TRUE(inbox.ok()) << inbox.status();
    inbox_ = std::move(*inbox);
    auto buf = ShareableBuffer::Create(bytes, name);
    EXPECT_TRUE(buf.ok()) << buf.status();
    into_.emplace(std::move(*buf));
    RegionOptions ro;
    ro.export_to_all_peers = true;
    auto region = engine_->RegisterMemory(into_->data(), bytes, ro);
    EXPECT_TRUE(region.ok()) << region.status();
    into_region_ = *region;
    auto peer = engine_->Connect(prefill_address);
    EXPECT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    Layout mine = TestLayout();
    AssignBacking(&mine, reinterpret_cast<uint64_t>(into_->data()), kBlocks, kStateBlocks);
    const json hello = {
        {"t", "hello"},
        {"engine_id", o.name},
        {"mode", "auto"},
        {"layout", json::parse(LayoutToJson(mine))},
        {"regions", json::array({json::array(
                        {reinterpret_cast<uint64_t>(into_->data()), bytes, into_region_})})}};
    EXPECT_TRUE(Send(hello).ok());
    auto ack = Next("hello_ack");
    EXPECT_TRUE(ack.ok()) << ack.status();
    if (!ack.ok()) return;
    for (const json& r : (*ack)["regions"]) {
      remote_.push_back({r[0].get<uint64_t>(), r[1].get<uint64_t>(), r[2].get<uint64_t>()});
      EXPECT_TRUE(engine_->WaitForRemoteRegion(peer_, remote_.back().id, kWait).ok());
    }
  }

  absl::Status Send(const json& m) { return engine_->SendMessage(peer_, kTopic, m.dump()); }

  // The next connector message for `tid`, or of type `type` when tid is "".
  absl::StatusOr<json> Next(const std::string& type, const std::string& tid = "") {
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      for (InboxEvent& e : inbox_->Wait(absl::Milliseconds(20))) {
        if (e.kind == InboxEvent::Kind::kPeerClosed) {
          return absl::AbortedError(absl::StrCat("the prefill closed the reader: ", e.payload));
        }
        if (e.kind != InboxEvent::Kind::kMessage) continue;
        json m = json::parse(e.payload, nullptr, false);
        if (!m.is_object()) continue;
        if (tid.empty() ? m.value("t", "") == type : m.value("transfer_id", "") == tid) return m;
      }
    }
    return absl::DeadlineExceededError(absl::StrCat("no '", type, "' message"));
  }

  absl::StatusOr<GrantId> ReadStart(const std::string& tid) {
    if (absl::Status s = Send(json{{"t", "read_start"}, {"transfer_id", tid}}); !s.ok()) return s;
    absl::StatusOr<json> m = Next("read_ok", tid);
    if (!m.ok()) return m.status();
    if (m->value("t", "") != "read_ok") {
      return absl::FailedPreconditionError(m->value("reason", "?"));
    }
    return (*m)["grant"].get<GrantId>();
  }

  // Every page of `blocks` in `layout` (the prefill's), READ whole under `grant` in one
  // transfer, into this reader's buffer at the prefill's offsets from `base`.
  std::vector<Op> Ops(const Layout& layout, const BlockTable& blocks, uint64_t base) {
    std::vector<Op> ops;
    for (const CacheGroup& g : layout.groups) {
      for (int64_t block : blocks.at(g.name)) {
        for (size_t l = 0; l < g.layers.size(); ++l) {
          for (int c = 0; c < g.components; ++c) {
            const uint64_t addr = g.BlockAddress(l, block, c);
            for (const Span& s : remote_) {
              if (addr >= s.base && addr + g.page_bytes <= s.base + s.length) {
                ops.push_back({into_region_, addr - base, s.id, addr - s.base, g.page_bytes});
              }
            }
          }
        }
      }
    }
    return ops;
  }
  absl::Status Read(const std::vector<Op>& ops, GrantId grant) {
    absl::StatusOr<TransferId> id = StartRead(ops, grant);
    if (!id.ok()) return id.status();
    return Wait(*id);
  }
  absl::StatusOr<TransferId> StartRead(const std::vector<Op>& ops, GrantId grant) {
    TransferOptions to;
    to.grant = grant;
    to.timeout = kWait;
    return engine_->Transfer(peer_, OpKind::kRead, ops, to);
  }
  absl::Status Wait(TransferId id) { return engine_->Wait(id, kWait); }
  const uint8_t* data() const { return reinterpret_cast<const uint8_t*>(into_->data()); }
  void* buffer() { return into_->data(); }

 private:
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Inbox> inbox_;
  std::optional<ShareableBuffer> into_;
  RegionId into_region_ = 0;
  PeerId peer_ = 0;
  std::vector<Span> remote_;
};

uint64_t Bytes(const std::vector<Op>& ops) {
  uint64_t n = 0;
  for (const Op& op : ops) n += op.length;
  return n;
}

class ReleaseCountTest : public ::testing::Test {
 protected:
  void StartPrefill(absl::Duration request_timeout,
                    absl::Duration handshake_timeout = absl::Seconds(20),
                    absl::Duration tcp_io_timeout = absl::Seconds(5)) {
    layout_ = TestLayout();
    bytes_ = AssignBacking(&layout_, 0, kBlocks, kStateBlocks);
    auto h = ShareableBuffer::Create(bytes_, "release-count");
    ASSERT_TRUE(h.ok()) << h.status();
    host_.emplace(std::move(*h));
    base_ = reinterpret_cast<uint64_t>(host_->data());
    AssignBacking(&layout_, base_, kBlocks, kStateBlocks);
    std::memset(host_->data(), 0x3C, bytes_);
    ConnectorOptions o;
    o.role = "prefill";
    o.engine.name = absl::StrCat("release-count-prefill-", getpid());
    o.engine.transport = "tcp";
    o.engine.peer_lease = absl::Seconds(5);
    o.engine.heartbeat_interval = absl::Milliseconds(200);
    o.request_timeout = request_timeout;
    o.handshake_timeout = handshake_timeout;
    o.engine.tcp().io_timeout = tcp_io_timeout;
    auto c = Connector::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    prefill_ = std::move(*c);
    ASSERT_TRUE(prefill_->RegisterKvCaches(layout_, {KvMemory{host_->data(), bytes_}}).ok());
  }

  std::string Hold(const std::string& id, int n) {
    auto done =
        prefill_->RequestFinished(id, Blocks(layout_, n), kTokens, R"({"do_remote_decode":true})");
    EXPECT_TRUE(done.ok()) << done.status();
    if (!done.ok()) return "";
    auto params = KvTransferParams::FromJson(done->kv_transfer_params);
    EXPECT_TRUE(params.ok()) << params.status();
    return params.ok() ? params->transfer_id : "";
  }

  json Stats() { return json::parse(prefill_->StatsJson()); }

  // Waits for the prefill's requests in kReleasing to be `n`.
  void WaitReleasing(uint64_t n) {
    const absl::Time deadline = absl::Now() + kWait;
    while (Stats().value("releasing", uint64_t{99}) != n && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    ASSERT_EQ(Stats().value("releasing", uint64_t{99}), n);
  }

  // Collects the prefill's finished_sending until `id` is among them (or kWait passed).
  bool WaitFreed(const std::string& id) {
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      for (const std::string& r : prefill_->GetFinished().finished_sending) freed_.push_back(r);
      for (const std::string& r : freed_) {
        if (r == id) return true;
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
    return false;
  }
  bool Freed(const std::string& id) {
    for (const std::string& r : prefill_->GetFinished().finished_sending) freed_.push_back(r);
    for (const std::string& r : freed_) {
      if (r == id) return true;
    }
    return false;
  }

  Layout layout_;
  uint64_t bytes_ = 0, base_ = 0;
  std::optional<ShareableBuffer> host_;
  std::unique_ptr<Connector> prefill_;
  std::vector<std::string> freed_;
};

TEST_F(ReleaseCountTest, TheBlocksGoOnlyOnceTheReadersLastOpWasServed) {
  ASSERT_NO_FATAL_FAILURE(StartPrefill(kWait));
  const std::string tid = Hold("a", 0);
  Reader reader("count-reader", prefill_->engine().address(), bytes_);
  absl::StatusOr<GrantId> grant = reader.ReadStart(tid);
  ASSERT_TRUE(grant.ok()) << grant.status();
  const std::vector<Op> ops = reader.Ops(layout_, Blocks(layout_, 0), base_);
  ASSERT_FALSE(ops.empty());
  // The release overtakes the READ: the prefill hears "I read N bytes" before the op exists.
  ASSERT_TRUE(reader
                  .Send(json{{"t", "release"},
                             {"transfer_id", tid},
                             {"ok", true},
                             {"reason", ""},
                             {"read_bytes", Bytes(ops)}})
                  .ok());
  ASSERT_NO_FATAL_FAILURE(WaitReleasing(1));
  EXPECT_FALSE(Freed("a")) << "freed before the reader's op was served";

  // Meanwhile another peer's messages are handled: its hand-off is granted while "a" waits.
  const std::string other = Hold("b", 1);
  Reader second("count-other", prefill_->engine().address(), bytes_);
  const absl::Time asked = absl::Now();
  absl::StatusOr<GrantId> other_grant = second.ReadStart(other);
  ASSERT_TRUE(other_grant.ok()) << other_grant.status();
  std::cout << "another peer's read_start answered in " << absl::FormatDuration(absl::Now() - asked)
            << " while 'a' waits\n";
  EXPECT_FALSE(Freed("a"));
  EXPECT_EQ(Stats().value("releasing", uint64_t{99}), 1u);

  // The op comes: the grant is still live (it is revoked only once its bytes were served),
  // the READ is served whole, and only then do the blocks go.
  absl::Status read = reader.Read(ops, *grant);
  ASSERT_TRUE(read.ok()) << read;
  for (const Op& op : ops) {
    const uint8_t* p = reader.data() + op.local_offset;
    for (uint64_t i = 0; i < op.length; i += 97) {
      if (p[i] != 0x3C && p[i] != 0) FAIL() << "byte " << i << " of an op: " << int{p[i]};
    }
  }
  EXPECT_TRUE(WaitFreed("a"));
  EXPECT_EQ(Stats().value("releasing", uint64_t{99}), 0u);
  // Revoked now: the same READ again is refused by the prefill's engine (which closes the
  // reader for it).
  EXPECT_EQ(prefill_->engine().Stats().grant_refused, 0u);
  EXPECT_FALSE(reader.Read(ops, *grant).ok());
  EXPECT_GT(prefill_->engine().Stats().grant_refused, 0u);

  // The other hand-off ends as usual (its release carries its count after the READ).
  const std::vector<Op> other_ops = second.Ops(layout_, Blocks(layout_, 1), base_);
  ASSERT_TRUE(second.Read(other_ops, *other_grant).ok());
  ASSERT_TRUE(second
                  .Send(json{{"t", "release"},
                             {"transfer_id", other},
                             {"ok", true},
                             {"read_bytes", Bytes(other_ops)}})
                  .ok());
  EXPECT_TRUE(WaitFreed("b"));
  const json stats = Stats();
  EXPECT_EQ(stats.value("completed", 0), 2);
  EXPECT_EQ(stats["machine"].value("refused", 1), 0);
  EXPECT_EQ(stats["machine"].value("diverged", 1), 0);
}

TEST_F(ReleaseCountTest, ALyingCountIsBoundedByItsRequestsDeadlineAlone) {
  // Long enough for the honest hand-off to end first on a loaded sanitizer run.
  ASSERT_NO_FATAL_FAILURE(StartPrefill(absl::Seconds(15)));
  const std::string liar = Hold("liar", 0);
  const std::string honest = Hold("honest", 1);
  Reader a("liar-reader", prefill_->engine().address(), bytes_);
  Reader b("honest-reader", prefill_->engine().address(), bytes_);
  absl::StatusOr<GrantId> ga = a.ReadStart(liar);
  absl::StatusOr<GrantId> gb = b.ReadStart(honest);
  ASSERT_TRUE(ga.ok() && gb.ok());
  const std::vector<Op> ops_a = a.Ops(layout_, Blocks(layout_, 0), base_);
  ASSERT_TRUE(a.Read(ops_a, *ga).ok());
  // Says it read ten times what it did: never reached.
  ASSERT_TRUE(a.Send(json{{"t", "release"},
                          {"transfer_id", liar},
                          {"ok", true},
                          {"read_bytes", 10 * Bytes(ops_a)}})
                  .ok());
  ASSERT_NO_FATAL_FAILURE(WaitReleasing(1));
  const std::vector<Op> ops_b = b.Ops(layout_, Blocks(layout_, 1), base_);
  ASSERT_TRUE(b.Read(ops_b, *gb).ok());
  ASSERT_TRUE(b.Send(json{{"t", "release"},
                          {"transfer_id", honest},
                          {"ok", true},
                          {"read_bytes", Bytes(ops_b)}})
                  .ok());
  EXPECT_TRUE(WaitFreed("honest"));
  EXPECT_FALSE(Freed("liar")) << "a count never reached freed the blocks before the deadline";
  // The liar's deadline (the request's lease) revokes its grant, then frees its blocks,
  // failed: its grant no longer reads them.
  EXPECT_TRUE(WaitFreed("liar"));
  EXPECT_FALSE(a.Read(ops_a, *ga).ok());
  const json stats = Stats();
  EXPECT_EQ(stats.value("completed", 0), 1);
  EXPECT_EQ(stats.value("failed", 0), 1);
  EXPECT_EQ(stats.value("releasing", uint64_t{99}), 0u);
  EXPECT_EQ(stats["machine"].value("refused", 1), 0);
  EXPECT_EQ(stats["machine"].value("diverged", 1), 0);
}

TEST_F(ReleaseCountTest, AReleaseWithoutACountRevokesAtOnce) {
  // An older peer says nothing of what it read: the grant is revoked when its release is
  // handled (after the ops it had in flight then), so a READ after it is refused.
  ASSERT_NO_FATAL_FAILURE(StartPrefill(kWait));
  const std::string tid = Hold("old", 0);
  Reader reader("old-reader", prefill_->engine().address(), bytes_);
  absl::StatusOr<GrantId> grant = reader.ReadStart(tid);
  ASSERT_TRUE(grant.ok()) << grant.status();
  const std::vector<Op> ops = reader.Ops(layout_, Blocks(layout_, 0), base_);
  ASSERT_TRUE(reader.Read(ops, *grant).ok());
  ASSERT_TRUE(reader.Send(json{{"t", "release"}, {"transfer_id", tid}, {"ok", true}}).ok());
  EXPECT_TRUE(WaitFreed("old"));
  EXPECT_EQ(prefill_->engine().Stats().grant_refused, 0u);
  EXPECT_FALSE(reader.Read(ops, *grant).ok());
  EXPECT_GT(prefill_->engine().Stats().grant_refused, 0u);
  EXPECT_EQ(Stats().value("completed", 0), 1);
}

// A reader that stops draining its data connection in the middle of a READ (its receiving
// thread held in the kernel by a userfaultfd write-protection of its buffer: alive, heartbeats
// going, but not one more byte taken off the socket), past the lease and past the revocation.
// tcp's own cut (io_timeout) is set longer than both, as a deployment may. The second deadline
// must close that reader before the blocks go, so that no op under its grant is still being
// served from them when they do (freed_while_served, the engine's own count, is 0; with the
// close taken out this test fails there, the blocks freed a deadline later under a live op).
// Once it drains again its READ fails, and nothing the next request writes reaches it.
TEST_F(ReleaseCountTest, AReaderThatStopsDrainingIsClosedBeforeTheBlocksGo) {
  if (absl::Status guard = transport::shm::WriteGuardAvailable(); !guard.ok()) {
    GTEST_SKIP() << "no userfaultfd write-protection here, so no way to stall a reader: " << guard;
  }
  if (transport::shm::WriteGuardMode() != "userfaultfd write-protect") {
    GTEST_SKIP() << "the write guard holds user-mode writes only ("
                 << transport::shm::WriteGuardMode()
                 << "): a recv into the guarded buffer would fail, not stall";
  }
  // Lease 2 s, then 2 s more for the ops under the revoked grant; tcp would cut at 120 s.
  ASSERT_NO_FATAL_FAILURE(
      StartPrefill(absl::Seconds(2), absl::Seconds(2), /*tcp_io_timeout=*/absl::Seconds(120)));
  const std::string tid = Hold("stall", 0);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t buffer_bytes = (bytes_ + page - 1) / page * page;
  Reader reader("stall-reader", prefill_->engine().address(), buffer_bytes);
  absl::StatusOr<GrantId> grant = reader.ReadStart(tid);
  ASSERT_TRUE(grant.ok()) << grant.status();
  // The request's pages, read again and again under the grant: far more than the socket
  // buffers of every lane hold, so the prefill is still sending when the reader stops.
  const std::vector<Op> pages = reader.Ops(layout_, Blocks(layout_, 0), base_);
  ASSERT_FALSE(pages.empty());
  const uint64_t repeats = (uint64_t{96} << 20) / Bytes(pages) + 1;
  std::vector<Op> ops;
  for (uint64_t i = 0; i < repeats; ++i) ops.insert(ops.end(), pages.begin(), pages.end());
  std::cout << ops.size() << " ops, " << Bytes(ops) / (1 << 20) << " MiB under the grant\n";

  absl::StatusOr<transport::shm::WriteGuard> stall =
      transport::shm::WriteGuard::Arm(reader.buffer(), buffer_bytes);
  ASSERT_TRUE(stall.ok()) << stall.status();
  absl::StatusOr<TransferId> read = reader.StartRead(ops, *grant);
  ASSERT_TRUE(read.ok()) << read.status();

  // No release: the lease revokes the grant, the ops under it are still served a deadline
  // later, the reader is closed, and only then (its ops ended with its connections) the
  // blocks go.
  const absl::Time held = absl::Now();
  EXPECT_TRUE(WaitFreed("stall"));
  std::cout << "freed " << absl::FormatDuration(absl::Now() - held) << " after the stall\n";
  const json stats = Stats();
  EXPECT_EQ(stats["served_past_deadline"].value("readers_closed", 0), 1) << stats.dump();
  EXPECT_EQ(stats["served_past_deadline"].value("freed_while_served", 1), 0) << stats.dump();
  EXPECT_EQ(stats.value("failed", 0), 1);
  EXPECT_EQ(stats.value("lease_expired", 0), 1);
  EXPECT_EQ(stats["machine"].value("refused", 1), 0);
  EXPECT_EQ(stats["machine"].value("diverged", 1), 0);

  // The next request's bytes go into the freed blocks; then the reader drains again.
  std::memset(host_->data(), 0x5A, bytes_);
  stall->Lift();
  const absl::Status ended = reader.Wait(*read);
  EXPECT_FALSE(ended.ok()) << "the stalled READ completed from freed blocks";
  std::cout << "the stalled READ ended: " << ended << "\n";
  for (uint64_t i = 0; i < bytes_; ++i) {
    if (reader.data()[i] == 0x5A) FAIL() << "byte " << i << " written after the free arrived";
  }
}

}  // namespace
}  // namespace kvwire::testing

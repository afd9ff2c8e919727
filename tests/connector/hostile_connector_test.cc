// The KV connector as a trust boundary, attacked the way a hostile peer would: a third engine
// that completed the engine and connector handshakes like anyone else forges `release`,
// `read_start`, `write_req`, `layer`, `done` and `fail` for transfers bound to another peer,
// sends wrong-typed fields in every message kind, reuses transfer ids, and a metrics client
// that never reads. Each attack must fail cleanly: the offending peer is closed with the
// reason in its Goodbye, the process survives, and the legitimate transfer still completes
// byte-exact. Prefill runs in a child process (kvwire_connector_peer); the attackers, the
// hand-driven decode and the connector decode run here, on loopback.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <deque>
#include <fcntl.h>
#include <poll.h>
#include <set>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "kvwire/connector.h"
#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "tests/connector/child.h"
#include "tests/connector/kv_sim.h"

namespace kvwire::testing {
namespace {

using nlohmann::json;

constexpr char kTopic[] = "kvwire.connector";
constexpr char kLayout[] = "deepseek-v3";
constexpr uint64_t kBlocks = 16, kStateBlocks = 2, kTokens = 200;
constexpr absl::Duration kWait = absl::Seconds(60);

// An engine in this process that speaks the connector protocol by hand: the attacker, and a
// decode whose every step the test controls.
class RawPeer {
 public:
  // `layout`: a kv_sim spec (its tensor-parallel place, "<preset>@tp:<size>:<rank>", is the
  // decode rank this peer claims when it reads).
  RawPeer(const std::string& name, const std::string& transport, const std::string& secret = "",
          const std::string& layout = kLayout)
      : name_(name) {
    EngineOptions o;
    o.name = name;
    o.shared_secret = secret;
    o.transport = transport;
    o.peer_lease = absl::Seconds(3);
    o.heartbeat_interval = absl::Milliseconds(200);
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    auto inbox = engine_->OpenInbox(kTopic);
    EXPECT_TRUE(inbox.ok()) << inbox.status();
    inbox_ = std::move(*inbox);
    auto kv = KvCache::Create(layout, kBlocks + 8, kStateBlocks + 1, 99);
    EXPECT_TRUE(kv.ok()) << kv.status();
    cache_ = std::move(*kv);
    for (const KvMemory& m : cache_->memory()) {
      RegionOptions ro;
      ro.export_to_all_peers = true;
      ro.kind = m.kind;
      auto id = engine_->RegisterMemory(m.ptr, m.length, ro);
      EXPECT_TRUE(id.ok()) << id.status();
      local_.push_back({reinterpret_cast<uint64_t>(m.ptr), m.length, id.ok() ? *id : 0});
    }
  }

  absl::Status Connect(const std::string& address) {
    auto p = engine_->Connect(address);
    if (!p.ok()) return p.status();
    peer_ = *p;
    return absl::OkStatus();
  }

  absl::Status Send(std::string payload) {
    return engine_->SendMessage(peer_, kTopic, std::move(payload));
  }
  absl::Status Send(const json& m) { return Send(m.dump()); }

  // The connector handshake, done right: this peer is then as trusted as any other.
  absl::Status Hello() {
    json regions = json::array();
    for (const Span& r : local_) regions.push_back({r.base, r.length, r.id});
    json hello = {{"t", "hello"},
                  {"engine_id", name_},
                  {"mode", "auto"},
                  {"layout", json::parse(LayoutToJson(cache_->layout()))},
                  {"regions", regions}};
    if (absl::Status s = Send(hello); !s.ok()) return s;
    auto ack = Next("hello_ack");
    if (!ack.ok()) return ack.status();
    auto layout = LayoutFromJson((*ack)["layout"].dump());
    if (!layout.ok()) return layout.status();
    remote_layout_ = *layout;
    for (const json& r : (*ack)["regions"]) {
      remote_.push_back({r[0].get<uint64_t>(), r[1].get<uint64_t>(), r[2].get<uint64_t>()});
      if (absl::Status s = engine_->WaitForRemoteRegion(peer_, remote_.back().id, kWait); !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  // The next connector message of type `type` (others are kept for later).
  absl::StatusOr<json> Next(const std::string& type, absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    for (InboxEvent& e : inbox_->Take()) events_.push_back(std::move(e));
    while (true) {
      for (auto it = events_.begin(); it != events_.end(); ++it) {
        if (it->kind != InboxEvent::Kind::kMessage) continue;
        json m = json::parse(it->payload, nullptr, false);
        if (m.is_object() && m.value("t", "") == type) {
          events_.erase(it);
          return m;
        }
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("no '", type, "' message"));
      }
      for (InboxEvent& e : inbox_->Wait(absl::Milliseconds(50))) events_.push_back(std::move(e));
    }
  }

  // read_start for `tid`, as a reader does: the grant the prefill answers with (read_ok), or
  // PermissionDenied with the reason of its "fail".
  absl::StatusOr<GrantId> ReadStart(const std::string& tid) {
    if (absl::Status s = Send(json{{"t", "read_start"}, {"transfer_id", tid}}); !s.ok()) return s;
    const absl::Time deadline = absl::Now() + kWait;
    while (true) {
      for (InboxEvent& e : inbox_->Take()) events_.push_back(std::move(e));
      for (auto it = events_.begin(); it != events_.end(); ++it) {
        if (it->kind != InboxEvent::Kind::kMessage) continue;
        json m = json::parse(it->payload, nullptr, false);
        if (!m.is_object() || m.value("transfer_id", "") != tid) continue;
        const std::string t = m.value("t", "");
        if (t == "read_ok") {
          events_.erase(it);
          return m["grant"].get<GrantId>();
        }
        if (t == "fail") {
          events_.erase(it);
          return absl::PermissionDeniedError(m.value("reason", "?"));
        }
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("no answer to read_start ", tid));
      }
      for (InboxEvent& e : inbox_->Wait(absl::Milliseconds(20))) events_.push_back(std::move(e));
    }
  }

  // Waits for the peer to close this one; returns the reason it gave.
  absl::StatusOr<std::string> WaitClosed(absl::Duration timeout = absl::Seconds(15)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      for (const InboxEvent& e : events_) {
        if (e.kind == InboxEvent::Kind::kPeerClosed && e.peer == peer_) return e.payload;
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(name_, " was never closed"));
      }
      for (InboxEvent& e : inbox_->Wait(absl::Milliseconds(50))) events_.push_back(std::move(e));
    }
  }

  // Reads `layers` of the request described by `params` into this peer's blocks `mine`.
  absl::Status ReadLayers(const KvTransferParams& params, const BlockTable& mine,
                          const std::vector<int>& layers, GrantId grant) {
    auto plan = PlanTransfer(remote_layout_, params.block_ids, cache_->layout(), mine, kTokens);
    if (!plan.ok()) return plan.status();
    for (int layer : layers) {
      std::vector<Op> ops;
      for (const ByteRange& br : plan->LayerRanges(layer)) {
        auto l = Find(local_, br.dst, br.length);
        auto r = Find(remote_, br.src, br.length);
        if (!l.ok() || !r.ok()) return absl::InternalError("range outside the regions");
        ops.push_back({l->first, l->second, r->first, r->second, br.length});
      }
      if (ops.empty()) continue;
      TransferOptions to;
      to.grant = grant;
      auto id = engine_->Transfer(peer_, OpKind::kRead, ops, to);
      if (!id.ok()) return id.status();
      if (absl::Status s = engine_->Wait(*id, kWait); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  std::vector<int> Layers() const {
    std::set<int> all;
    for (const CacheGroup& g : cache_->layout().groups)
      all.insert(g.layers.begin(), g.layers.end());
    return std::vector<int>(all.begin(), all.end());
  }

  Engine& engine() { return *engine_; }
  KvCache& cache() { return *cache_; }

 private:
  struct Span {
    uint64_t base, length;
    RegionId id;
  };
  static absl::StatusOr<std::pair<RegionId, uint64_t>> Find(const std::vector<Span>& spans,
                                                            uint64_t addr, uint64_t len) {
    for (const Span& s : spans) {
      if (addr >= s.base && addr + len <= s.base + s.length) {
        return std::make_pair(s.id, addr - s.base);
      }
    }
    return absl::NotFoundError("no region");
  }

  std::string name_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Inbox> inbox_;
  std::unique_ptr<KvCache> cache_;
  std::vector<Span> local_, remote_;
  Layout remote_layout_;
  PeerId peer_ = 0;
  std::deque<InboxEvent> events_;
};

// A decode instance (kvwire::Connector) in this process.
class Decode {
 public:
  explicit Decode(const std::string& transport, const std::string& secret = "") {
    ConnectorOptions o;
    o.engine.shared_secret = secret;
    o.role = "decode";
    o.engine.name = absl::StrCat("decode-", getpid());
    o.engine.transport = transport;
    o.engine.peer_lease = absl::Seconds(3);
    o.engine.heartbeat_interval = absl::Milliseconds(200);
    o.request_timeout = kWait;
    o.handshake_timeout = absl::Seconds(20);
    auto c = Connector::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    connector = std::move(*c);
    auto kv = KvCache::Create(kLayout, kBlocks + 8, kStateBlocks + 1, 99);
    EXPECT_TRUE(kv.ok()) << kv.status();
    cache = std::move(*kv);
    EXPECT_TRUE(connector->RegisterKvCaches(cache->layout(), cache->memory()).ok());
  }

  absl::Status Start(const std::string& id, const std::string& params) {
    auto match = connector->GetNumNewMatchedTokens(id, kTokens, 0, params);
    if (!match.ok()) return match.status();
    absl::StatusOr<BlockTable> blocks = cache->Allocate(id, kTokens);
    if (!blocks.ok()) return blocks.status();
    if (absl::Status s = connector->UpdateStateAfterAlloc(id, *blocks, match->num_external_tokens);
        !s.ok()) {
      cache->Release(id);
      return s;
    }
    if (absl::Status s = connector->BindConnectorMeta(connector->BuildConnectorMeta()); !s.ok()) {
      return s;
    }
    return connector->StartLoadKv();
  }

  // "" when the load completed, else its failure reason.
  absl::StatusOr<std::string> WaitDone(const std::string& id, absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      FinishedRequests f = connector->GetFinished();
      std::optional<std::string> result;
      for (const std::string& r : f.finished_recving) {
        if (r == id) result = "";
      }
      for (const FailedLoad& fl : f.failed_loads) {
        if (fl.request_id == id) result = fl.reason;
      }
      if (result) return *result;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return absl::DeadlineExceededError(absl::StrCat("request ", id, " never finished"));
  }

  std::unique_ptr<Connector> connector;
  std::unique_ptr<KvCache> cache;
};

void ExpectPrefillClean(Child& p) {
  const absl::Time deadline = absl::Now() + kWait;
  std::string last;
  while (absl::Now() < deadline) {
    p.Send("acct");
    auto line = p.Expect("ACCT ");
    ASSERT_TRUE(line.ok()) << line.status();
    last = *line;
    if (last == "ACCT ok live=0 connector_live=0") return;
    ASSERT_EQ(last.rfind("ACCT ok ", 0), 0u) << last;
    absl::SleepFor(absl::Milliseconds(20));
  }
  FAIL() << "prefill never became clean: " << last;
}

class HostileConnectorTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::string transport() const { return GetParam(); }

  std::unique_ptr<Child> Prefill(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--layout=" + std::string(kLayout),
                                     "--transport=" + transport(),
                                     absl::StrCat("--blocks=", kBlocks),
                                     absl::StrCat("--state_blocks=", kStateBlocks),
                                     "--seed=7",
                                     "--name=prefill"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto c = Child::Start(KVWIRE_CONNECTOR_PEER, args);
    EXPECT_TRUE(c.ok()) << c.status();
    auto ready = (*c)->Expect("READY ", absl::Seconds(60));
    EXPECT_TRUE(ready.ok()) << ready.status();
    address_ = ready.ok() ? ready->substr(6) : "";
    return std::move(*c);
  }

  // A read-mode hand-off of `id` on prefill: its kv_transfer_params.
  absl::StatusOr<KvTransferParams> Handoff(Child& p, const std::string& id) {
    p.Send(absl::StrCat("req ", id, " ", kTokens, " read - all"));
    auto line = p.Expect("PARAMS " + id + " ");
    if (!line.ok()) return line.status();
    return KvTransferParams::FromJson(line->substr(8 + id.size()));
  }

  // An attacker that completed both handshakes with the engine at `address`.
  std::unique_ptr<RawPeer> Attacker(const std::string& address, const std::string& name) {
    auto a = std::make_unique<RawPeer>(name, transport());
    EXPECT_TRUE(a->Connect(address).ok());
    absl::Status s = a->Hello();
    EXPECT_TRUE(s.ok()) << s;
    return a;
  }

  // A legitimate read-mode request through a real decode connector, checked byte for byte.
  void ExpectServesLegitimatePeer(Child& p, const std::string& id) {
    auto params = Handoff(p, id);
    ASSERT_TRUE(params.ok()) << params.status();
    Decode d(transport());
    ASSERT_TRUE(d.Start(id, params->ToJson()).ok());
    auto r = d.WaitDone(id);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(*r, "");
    EXPECT_EQ(d.cache->Verify(id, d.cache->live().at(id), kTokens, 0), "");
    EXPECT_TRUE(p.Expect("FREED " + id).ok());
  }

  std::string address_;
};

// The attack of the issue: while decode reads prefill's blocks, a third peer that knows the
// transfer id sends `release`. Before the fix prefill freed the blocks at once (a later
// request could overwrite them under the reader); now the forger is closed and the blocks
// stay until the reader releases them.
TEST_P(HostileConnectorTest, ForgedReleaseWhileDecodeReadsIsRefused) {
  auto prefill = Prefill();
  auto params = Handoff(*prefill, "r1");
  ASSERT_TRUE(params.ok()) << params.status();

  RawPeer decode("raw-decode", transport());
  ASSERT_TRUE(decode.Connect(address_).ok());
  ASSERT_TRUE(decode.Hello().ok());
  auto mine = decode.cache().Allocate("r1", kTokens);
  ASSERT_TRUE(mine.ok()) << mine.status();
  absl::StatusOr<GrantId> grant = decode.ReadStart(params->transfer_id);
  ASSERT_TRUE(grant.ok()) << grant.status();
  const std::vector<int> layers = decode.Layers();
  ASSERT_GE(layers.size(), 2u);
  const std::vector<int> first(layers.begin(), layers.begin() + layers.size() / 2);
  const std::vector<int> rest(layers.begin() + layers.size() / 2, layers.end());
  ASSERT_TRUE(decode.ReadLayers(*params, *mine, first, *grant).ok());

  // Mid-read: a forged release, and a forged read_start trying to take the transfer over.
  auto forger = Attacker(address_, "forger");
  ASSERT_TRUE(
      forger
          ->Send(json{
              {"t", "release"}, {"transfer_id", params->transfer_id}, {"ok", true}, {"reason", ""}})
          .ok());
  auto reason = forger->WaitClosed();
  EXPECT_TRUE(reason.ok()) << reason.status();
  if (reason.ok()) EXPECT_TRUE(absl::StrContains(*reason, "release")) << *reason;
  auto thief = Attacker(address_, "thief");
  ASSERT_TRUE(thief->Send(json{{"t", "read_start"}, {"transfer_id", params->transfer_id}}).ok());
  reason = thief->WaitClosed();
  EXPECT_TRUE(reason.ok()) << reason.status();
  if (reason.ok()) EXPECT_TRUE(absl::StrContains(*reason, "read_start")) << *reason;
  // The blocks are still held for the reader.
  auto freed = prefill->Expect("FREED r1", absl::Seconds(2));
  EXPECT_FALSE(freed.ok()) << "prefill freed blocks still being read: " << *freed;

  // The reader finishes, byte-exact, and its own release frees them.
  ASSERT_TRUE(decode.ReadLayers(*params, *mine, rest, *grant).ok());
  EXPECT_EQ(decode.cache().Verify("r1", *mine, kTokens, 0), "");
  ASSERT_TRUE(
      decode
          .Send(json{
              {"t", "release"}, {"transfer_id", params->transfer_id}, {"ok", true}, {"reason", ""}})
          .ok());
  EXPECT_TRUE(prefill->Expect("FREED r1").ok());
  ExpectServesLegitimatePeer(*prefill, "r2");
  ExpectPrefillClean(*prefill);
}

// The attack of issue 30, finding 2: a peer that completed both handshakes (with the
// deployment's secret when there is one) and knows another request's block ids (they travel in
// kv_transfer_params) reads none of that request's KV: a made-up transfer id gets "fail" and
// no grant; a READ of the blocks without a grant, with a guessed grant id, or with the grant of
// a request of its own is refused by the prefill's engine; and a grant is dead once its request
// is released. Each refusal also closes the peer (a refused op is a protocol error), so every
// attempt is a new peer. Counted: the connector's reads_refused, the engine's grant_refused.
// The victim's real reader still gets its KV byte-exact.
TEST_P(HostileConnectorTest, MadeUpTransferIdReadsNothing) {
  for (const std::string secret : {"", "deployment-secret"}) {
    SCOPED_TRACE(secret.empty() ? "no secret" : "with a shared secret");
    // A read_start for a transfer not held waits this long for its hold, then is refused.
    std::vector<std::string> extra = {"--handshake_ms=1500"};
    if (!secret.empty()) extra.push_back("--secret=" + secret);
    auto prefill = Prefill(extra);
    auto victim = Handoff(*prefill, "v1");
    ASSERT_TRUE(victim.ok()) << victim.status();
    int n = 0;
    const auto thief = [&] {
      auto t = std::make_unique<RawPeer>(absl::StrCat("thief-", n++), transport(), secret);
      EXPECT_TRUE(t->Connect(address_).ok());
      absl::Status s = t->Hello();
      EXPECT_TRUE(s.ok()) << s;
      return t;
    };
    // A READ of the victim's blocks that must be refused, and leave no victim byte here.
    const auto expect_refused = [&](RawPeer& t, const KvTransferParams& of, GrantId grant,
                                    const std::string& says) {
      auto mine = t.cache().Allocate(absl::StrCat("x", n), kTokens);
      ASSERT_TRUE(mine.ok()) << mine.status();
      const absl::Status s = t.ReadLayers(of, *mine, t.Layers(), grant);
      EXPECT_FALSE(s.ok());
      EXPECT_TRUE(absl::StrContains(s.message(), says)) << s;
      EXPECT_NE(t.cache().Verify(of.remote_request_id, *mine, kTokens, 0), "")
          << "the other request's KV arrived";
    };

    // The repro: a made-up transfer id and the victim's block ids.
    auto t1 = thief();
    absl::StatusOr<GrantId> none = t1->ReadStart("made-up-transfer-id");
    EXPECT_EQ(none.status().code(), absl::StatusCode::kPermissionDenied) << none.status();
    EXPECT_TRUE(absl::StrContains(none.status().message(), "holds no blocks")) << none.status();
    EXPECT_TRUE(absl::StrContains(none.status().message(), "unknown or released")) << none.status();
    expect_refused(*t1, *victim, 0, "presented none");
    for (GrantId guess : {GrantId{1}, GrantId{2}, GrantId{77}}) {
      auto t = thief();
      expect_refused(*t, *victim, guess, "not live");
    }

    // A request of its own: its grant covers its own blocks, not the victim's.
    auto own = Handoff(*prefill, "t2");
    ASSERT_TRUE(own.ok()) << own.status();
    auto t2 = thief();
    absl::StatusOr<GrantId> g2 = t2->ReadStart(own->transfer_id);
    ASSERT_TRUE(g2.ok()) << g2.status();
    expect_refused(*t2, *victim, *g2, "does not cover");
    EXPECT_TRUE(prefill->Expect("FREED t2").ok());  // bound to t2, which was closed

    // And nothing once released: the grant dies with the hand-off.
    auto own3 = Handoff(*prefill, "t3");
    ASSERT_TRUE(own3.ok()) << own3.status();
    auto t3 = thief();
    absl::StatusOr<GrantId> g3 = t3->ReadStart(own3->transfer_id);
    ASSERT_TRUE(g3.ok()) << g3.status();
    auto mine3 = t3->cache().Allocate("t3", kTokens);
    ASSERT_TRUE(mine3.ok()) << mine3.status();
    ASSERT_TRUE(t3->ReadLayers(*own3, *mine3, t3->Layers(), *g3).ok());
    EXPECT_EQ(t3->cache().Verify("t3", *mine3, kTokens, 0), "");
    ASSERT_TRUE(
        t3
            ->Send(json{
                {"t", "release"}, {"transfer_id", own3->transfer_id}, {"ok", true}, {"reason", ""}})
            .ok());
    EXPECT_TRUE(prefill->Expect("FREED t3").ok());
    expect_refused(*t3, *own3, *g3, "not live");
    // Its release was the last word on t3: read_start for it again is refused too.
    auto t4 = thief();
    // As released (the retired id is known), not as an id never held after handshake_ms.
    const absl::Status again = t4->ReadStart(own3->transfer_id).status();
    EXPECT_EQ(again.code(), absl::StatusCode::kPermissionDenied) << again;
    EXPECT_TRUE(absl::StrContains(again.message(), "it was released")) << again;

    // The victim's reader is served, byte-exact.
    Decode d(transport(), secret);
    ASSERT_TRUE(d.Start("v1", victim->ToJson()).ok());
    auto r = d.WaitDone("v1");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(*r, "");
    EXPECT_EQ(d.cache->Verify("v1", d.cache->live().at("v1"), kTokens, 0), "");
    EXPECT_TRUE(prefill->Expect("FREED v1").ok());

    prefill->Send("stats");
    auto stats = prefill->Expect("STATS ");
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(json::parse(stats->substr(6))["reads_refused"].get<int>(), 2) << *stats;
    prefill->Send("engine_stats");
    auto estats = prefill->Expect("ESTATS ");
    ASSERT_TRUE(estats.ok()) << estats.status();
    EXPECT_GE(json::parse(estats->substr(7))["grant_refused"].get<int>(), 6) << *estats;
    EXPECT_EQ(json::parse(estats->substr(7))["grants_live"].get<int>(), 0) << *estats;
    ExpectPrefillClean(*prefill);
  }
}

// ConnectorOptions::read_grants off (a trusted fabric, for zero-copy shm and rdma READs): the
// KV is registered without grants, so the repro above reads the victim's blocks with a
// made-up transfer id and no grant. What the option trades away, shown rather than claimed.
TEST_P(HostileConnectorTest, WithoutReadGrantsAnyPeerReadsTheKv) {
  auto prefill = Prefill({"--read_grants=0"});
  auto victim = Handoff(*prefill, "v1");
  ASSERT_TRUE(victim.ok()) << victim.status();
  RawPeer thief("thief", transport(), "");
  ASSERT_TRUE(thief.Connect(address_).ok());
  ASSERT_TRUE(thief.Hello().ok());
  auto mine = thief.cache().Allocate("x", kTokens);
  ASSERT_TRUE(mine.ok()) << mine.status();
  const absl::Status s = thief.ReadLayers(*victim, *mine, thief.Layers(), /*grant=*/0);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(thief.cache().Verify(victim->remote_request_id, *mine, kTokens, 0), "")
      << "without read grants the victim's KV is readable by any peer";
  prefill->Send("engine_stats");
  auto estats = prefill->Expect("ESTATS ");
  ASSERT_TRUE(estats.ok()) << estats.status();
  const json e = json::parse(estats->substr(7));
  EXPECT_EQ(e["grant_refused"].get<int>(), 0) << *estats;
  // Over shm the READ was the thief's own copy from its mapping (zero-copy: the prefill's
  // engine served no op); over tcp the prefill served every op.
  if (transport() == "shm") {
    EXPECT_EQ(e["incoming_ops"].get<int>(), 0) << "the READ did not go over shm: " << *estats;
  } else {
    EXPECT_GT(e["incoming_ops"].get<int>(), 0) << *estats;
  }
}

// Write mode, both directions: while prefill streams layers to decode, a third peer forges
// decode's `write_req` (to get the KV written into its own memory) and `fail` (to abort it) at
// prefill, and prefill's `layer`, `done` and `fail` at decode. Each forger is closed; the
// load completes byte-exact.
TEST_P(HostileConnectorTest, ForgedWriteModeMessagesAreRefused) {
  auto prefill = Prefill();
  Decode d(transport());
  const std::string tid = "tw-1";
  prefill->Send(absl::StrCat("req w1 ", kTokens, " write ", tid, " 1"));
  ASSERT_TRUE(prefill->Expect("SAVED w1 1").ok());
  ASSERT_TRUE(d.Start("w1", WriteParams(address_, tid, kTokens).ToJson()).ok());
  // Decode's write_req has bound the transfer at prefill once the first layer arrived.
  std::set<int> layers;
  for (const CacheGroup& g : d.cache->layout().groups)
    layers.insert(g.layers.begin(), g.layers.end());
  ASSERT_TRUE(d.connector->WaitForLayerLoad(*layers.begin()).ok());
  ASSERT_FALSE(d.WaitDone("w1", absl::Milliseconds(100)).ok()) << "the load ended early";

  const std::string decode_address = d.connector->engine().address();
  struct Forgery {
    std::string target;  // "prefill" or "decode"
    json message;
    std::string in_reason;
  };
  json blocks = json::object();
  std::vector<Forgery> forgeries = {
      {"prefill",
       {{"t", "write_req"}, {"transfer_id", tid}, {"blocks", blocks}, {"num_cached", 0}},
       "write_req"},
      {"prefill", {{"t", "fail"}, {"transfer_id", tid}, {"reason", "forged"}}, "fail"},
      {"decode", {{"t", "layer"}, {"transfer_id", tid}, {"layer", 1}}, "layer"},
      {"decode", {{"t", "done"}, {"transfer_id", tid}, {"bytes", 1}}, "done"},
      {"decode", {{"t", "fail"}, {"transfer_id", tid}, {"reason", "forged"}}, "fail"},
  };
  int n = 0;
  for (const Forgery& f : forgeries) {
    SCOPED_TRACE(f.message.dump());
    auto forger =
        Attacker(f.target == "prefill" ? address_ : decode_address, absl::StrCat("forger-", n++));
    ASSERT_TRUE(forger->Send(f.message).ok());
    auto reason = forger->WaitClosed();
    ASSERT_TRUE(reason.ok()) << reason.status();
    EXPECT_TRUE(absl::StrContains(*reason, f.in_reason)) << *reason;
  }
  // Nothing forged ended the load.
  auto early = d.WaitDone("w1", absl::Seconds(1));
  EXPECT_FALSE(early.ok()) << "the load ended on a forged message: '" << *early << "'";

  prefill->Send("finish w1");
  ASSERT_TRUE(prefill->Expect("SAVED w1 all").ok());
  auto r = d.WaitDone("w1");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "");
  EXPECT_EQ(d.cache->Verify("w1", d.cache->live().at("w1"), kTokens, 0), "");
  ExpectPrefillClean(*prefill);
}

// Wrong-typed, null, missing, huge, negative and oversized fields in every message kind, and
// messages that are no message at all: each closes only its sender, naming what was wrong,
// and prefill goes on serving.
TEST_P(HostileConnectorTest, MalformedMessagesCloseOnlyTheSender) {
  auto prefill = Prefill();
  auto probe = KvCache::Create(kLayout, kBlocks, kStateBlocks, 1);
  ASSERT_TRUE(probe.ok()) << probe.status();
  json layout = json::parse(LayoutToJson((*probe)->layout()));
  json bad_layout = layout;
  bad_layout["groups"][0]["page_bytes"] = "big";
  json hello = {{"t", "hello"},
                {"engine_id", "x"},
                {"mode", "auto"},
                {"layout", layout},
                {"regions", json::array()}};
  auto with = [](json m, const std::string& k, json v) {
    m[k] = std::move(v);
    return m;
  };
  std::string deep(100000, '[');
  struct Case {
    std::string payload;
    std::string in_reason;
    bool hello_first;
  };
  const std::vector<Case> cases = {
      {"not json", "JSON", false},
      {"[1,2,3]", "object", false},
      {deep, "nested", false},
      {R"({"t":7})", "'t'", false},
      {R"({"no_type":1})", "'t'", false},
      {R"({"t":"bogus"})", "bogus", true},
      {with(hello, "mode", 5).dump(), "'mode'", false},
      {with(hello, "mode", "sideways").dump(), "sideways", false},
      {with(hello, "engine_id", json::array()).dump(), "'engine_id'", false},
      {with(hello, "regions", json::array({json::array({1, 2, "x"})})).dump(), "regions", false},
      {with(hello, "regions", json::array({json::array({-1, 2, 3})})).dump(), "regions", false},
      {with(hello, "regions", "none").dump(), "'regions'", false},
      {with(hello, "layout", bad_layout).dump(), "page_bytes", false},
      {with(hello, "layout", 3).dump(), "layout", false},
      {R"({"t":"hello_ack","engine_id":"x"})", "hello_ack", true},
      {R"({"t":"hello_err","error":5})", "hello_err", true},
      {R"({"t":"read_start","transfer_id":["x"]})", "'transfer_id'", true},
      {R"({"t":"release","transfer_id":5})", "'transfer_id'", true},
      {R"({"t":"release","transfer_id":"x","ok":"yes"})", "'ok'", true},
      {R"({"t":"release","transfer_id":null})", "'transfer_id'", true},
      {R"({"t":"write_req","transfer_id":"x","blocks":"no"})", "'blocks'", true},
      {R"({"t":"write_req","transfer_id":"x","blocks":{"g":[1,"2"]}})", "blocks", true},
      {R"({"t":"write_req","transfer_id":"x","blocks":{},"num_cached":-1})", "'num_cached'", true},
      {R"({"t":"write_req","transfer_id":"x","blocks":{},"num_cached":1e300})", "'num_cached'",
       true},
      {R"({"t":"write_req","transfer_id":"x","blocks":{"g":[99999999999999999999999]}})", "blocks",
       true},
      {R"({"t":"layer","transfer_id":"x","layer":"1"})", "'layer'", true},
      {R"({"t":"layer","transfer_id":"x","layer":-7})", "'layer'", true},
      {R"({"t":"done","transfer_id":{}})", "'transfer_id'", true},
      {R"({"t":"fail","transfer_id":"x","reason":5})", "'reason'", true},
      {absl::StrCat(R"({"t":"fail","transfer_id":")", std::string(100000, 'x'), R"("})"),
       "'transfer_id'", true},
      {R"({"t":"read_start","transfer_id":"never-handed-out"})", "", false},  // before hello
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.payload.substr(0, 120));
    RawPeer attacker(absl::StrCat("attacker-", n++), transport());
    ASSERT_TRUE(attacker.Connect(address_).ok());
    if (c.hello_first) ASSERT_TRUE(attacker.Hello().ok());
    ASSERT_TRUE(attacker.Send(c.payload).ok());
    auto reason = attacker.WaitClosed(absl::Seconds(5));
    EXPECT_TRUE(reason.ok()) << reason.status();
    if (!reason.ok()) continue;
    EXPECT_TRUE(absl::StrContains(*reason, c.in_reason)) << *reason;
    EXPECT_TRUE(absl::StrContains(*reason, "connector")) << *reason;
  }
  ExpectServesLegitimatePeer(*prefill, "after");
  ExpectPrefillClean(*prefill);
}

// A hello naming regions that were never exported is answered only at the handshake
// deadline; meanwhile the connector goes on serving everyone else (before the fix its
// progress thread waited for those regions, so no other request moved).
TEST_P(HostileConnectorTest, HelloWithRegionsThatNeverArriveStallsNobody) {
  auto prefill = Prefill();
  RawPeer staller("staller", transport());
  ASSERT_TRUE(staller.Connect(address_).ok());
  auto probe = KvCache::Create(kLayout, kBlocks, kStateBlocks, 1);
  ASSERT_TRUE(probe.ok()) << probe.status();
  ASSERT_TRUE(staller
                  .Send(json{{"t", "hello"},
                             {"engine_id", "staller"},
                             {"mode", "auto"},
                             {"layout", json::parse(LayoutToJson((*probe)->layout()))},
                             {"regions", json::array({json::array({4096, 4096, 987654})})}})
                  .ok());
  ExpectServesLegitimatePeer(*prefill, "meanwhile");
  // The staller is still waiting for its answer.
  EXPECT_FALSE(staller.Next("hello_ack", absl::ZeroDuration()).ok());
  EXPECT_FALSE(staller.Next("hello_err", absl::ZeroDuration()).ok());
  ExpectPrefillClean(*prefill);
}

// A transfer id names one request: a second one with the same id is refused with a clear
// error (on prefill and on decode) instead of silently replacing the first.
TEST_P(HostileConnectorTest, DuplicateTransferIdIsRefused) {
  auto prefill = Prefill();
  prefill->Send(absl::StrCat("req a ", kTokens, " write dup-1 0"));
  ASSERT_TRUE(prefill->Expect("SAVED a 0").ok());
  prefill->Send(absl::StrCat("req b ", kTokens, " write dup-1 0"));
  auto line = prefill->Expect("", absl::Seconds(10));
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_TRUE(absl::StartsWith(*line, "ERROR b ")) << *line;
  EXPECT_TRUE(absl::StrContains(*line, "dup-1")) << *line;

  Decode d(transport());
  const std::string params = WriteParams(address_, "dup-1", kTokens).ToJson();
  ASSERT_TRUE(d.Start("a", params).ok());
  absl::Status again = d.Start("a2", params);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
  EXPECT_TRUE(absl::StrContains(again.message(), "dup-1")) << again;

  // The first request is untouched: it completes byte-exact.
  prefill->Send("finish a");
  ASSERT_TRUE(prefill->Expect("SAVED a all").ok());
  auto r = d.WaitDone("a");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "");
  EXPECT_EQ(d.cache->Verify("a", d.cache->live().at("a"), kTokens, 0), "");
  ExpectPrefillClean(*prefill);
}

// A decode with tensor parallelism reads a hand-off from each of its ranks: the prefill takes
// one reader per rank, as many as the first reader's layout says (at most 64, the same for
// every reader), each with a grant of its own, and frees the blocks only once every one of them
// released. A layout claiming too many ranks, a size other than the first reader's, or a rank
// already bound is closed, and the readers still read byte-exact.
TEST_P(HostileConnectorTest, ReadersOfAHandOffAreTheDecodesRanks) {
  auto prefill = Prefill();
  auto params = Handoff(*prefill, "m1");
  ASSERT_TRUE(params.ok()) << params.status();
  const std::string tid = params->transfer_id;
  const auto peer = [&](const std::string& name, const std::string& layout) {
    auto p = std::make_unique<RawPeer>(name, transport(), "", layout);
    EXPECT_TRUE(p->Connect(address_).ok());
    absl::Status s = p->Hello();
    EXPECT_TRUE(s.ok()) << s;
    return p;
  };
  const auto expect_closed = [&](RawPeer& p, const std::string& says) {
    ASSERT_TRUE(p.Send(json{{"t", "read_start"}, {"transfer_id", tid}}).ok());
    auto why = p.WaitClosed();
    ASSERT_TRUE(why.ok()) << why.status();
    EXPECT_TRUE(absl::StrContains(*why, says)) << *why;
  };
  auto huge = peer("huge", std::string(kLayout) + "@tp:65:0");
  expect_closed(*huge, "at most 64");
  auto r0 = peer("rank0", std::string(kLayout) + "@tp:2:0");
  absl::StatusOr<GrantId> g0 = r0->ReadStart(tid);
  ASSERT_TRUE(g0.ok()) << g0.status();
  auto odd = peer("odd", std::string(kLayout) + "@tp:3:1");
  expect_closed(*odd, "its first reader's 2");
  auto twin = peer("twin", std::string(kLayout) + "@tp:2:0");
  expect_closed(*twin, "bound to another peer");

  // Rank 0 reads and releases: the blocks stay for rank 1, which reads under its own grant.
  auto mine0 = r0->cache().Allocate("m1", kTokens);
  ASSERT_TRUE(mine0.ok()) << mine0.status();
  ASSERT_TRUE(r0->ReadLayers(*params, *mine0, r0->Layers(), *g0).ok());
  EXPECT_EQ(r0->cache().Verify("m1", *mine0, kTokens, 0), "");
  ASSERT_TRUE(
      r0->Send(json{{"t", "release"}, {"transfer_id", tid}, {"ok", true}, {"reason", ""}}).ok());
  auto early = prefill->Expect("FREED m1", absl::Seconds(1));
  EXPECT_FALSE(early.ok()) << "freed while rank 1 has not read";
  auto r1 = peer("rank1", std::string(kLayout) + "@tp:2:1");
  absl::StatusOr<GrantId> g1 = r1->ReadStart(tid);
  ASSERT_TRUE(g1.ok()) << g1.status();
  EXPECT_NE(*g1, *g0);
  auto mine1 = r1->cache().Allocate("m1", kTokens);
  ASSERT_TRUE(mine1.ok()) << mine1.status();
  ASSERT_TRUE(r1->ReadLayers(*params, *mine1, r1->Layers(), *g1).ok());
  EXPECT_EQ(r1->cache().Verify("m1", *mine1, kTokens, 0), "");
  ASSERT_TRUE(
      r1->Send(json{{"t", "release"}, {"transfer_id", tid}, {"ok", true}, {"reason", ""}}).ok());
  EXPECT_TRUE(prefill->Expect("FREED m1").ok());
  prefill->Send("engine_stats");
  auto estats = prefill->Expect("ESTATS ");
  ASSERT_TRUE(estats.ok()) << estats.status();
  EXPECT_EQ(json::parse(estats->substr(7))["grants_live"].get<int>(), 0) << *estats;
  ExpectPrefillClean(*prefill);
}

// Prefill-generated transfer ids (read mode) cannot be guessed from the request id.
TEST_P(HostileConnectorTest, ReadModeTransferIdsAreUnpredictable) {
  auto prefill = Prefill();
  auto a = Handoff(*prefill, "u1");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(absl::StrContains(a->transfer_id, "u1")) << a->transfer_id;
  EXPECT_GE(a->transfer_id.size(), 32u) << a->transfer_id;
  // Released (it is never read) so that the prefill is clean.
  RawPeer decode("raw-decode", transport());
  ASSERT_TRUE(decode.Connect(address_).ok());
  ASSERT_TRUE(decode.Hello().ok());
  ASSERT_TRUE(
      decode.Send(json{{"t", "release"}, {"transfer_id", a->transfer_id}, {"ok", true}}).ok());
  EXPECT_TRUE(prefill->Expect("FREED u1").ok());
  ExpectPrefillClean(*prefill);
}

// A metrics client that sends a request and never reads the (large) answer, and clients that
// connect and send nothing, must not keep the connector from shutting down or from serving
// other clients.
TEST_P(HostileConnectorTest, MetricsClientThatNeverReadsDoesNotBlockShutdown) {
  auto prefill =
      Prefill({"--metrics=127.0.0.1:0", "--timeout_ms=100", "--blocks=64", "--state_blocks=32"});
  auto metrics = prefill->Expect("METRICS ");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const std::string address = metrics->substr(8);
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  // A stats snapshot (about 7.5 MB) larger than the socket buffers can take: 256 retired
  // requests with long ids (their lease of 100 ms expires). Two at a time, so that the
  // commands never fill the child's stdin pipe while it waits for us to read its stdout.
  for (int batch = 0; batch < 128; ++batch) {
    for (int i = 0; i < 2; ++i) {
      prefill->Send(absl::StrCat("req ", std::string(30000, 'a' + batch % 26), batch, "-", i,
                                 " 1 read - all"));
    }
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(prefill->Expect("FREED ").ok());
  }
  // Connects within 2 s (a wedged server's full backlog must not hang the test), or -1.
  auto dial = [&](bool tiny_window) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (tiny_window) {
      const int small = 1;
      setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    }
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof(err);
      if (errno != EINPROGRESS || poll(&p, 1, 2000) != 1 ||
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
        close(fd);
        return -1;
      }
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
  };
  std::vector<int> fds;
  for (int i = 0; i < 4; ++i) {
    const int fd = dial(/*tiny_window=*/true);
    ASSERT_GE(fd, 0) << "metrics endpoint does not accept";
    const std::string get = "GET /stats.json HTTP/1.1\r\nHost: x\r\n\r\n";
    EXPECT_EQ(send(fd, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
    fds.push_back(fd);
  }
  for (int i = 0; i < 64; ++i) {  // silent ones
    const int fd = dial(/*tiny_window=*/false);
    if (fd >= 0) fds.push_back(fd);
  }

  // Another client is still served (after the silent ones' deadline at the latest).
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  std::string answer;
  while (absl::Now() < deadline && answer.find("kvwire_connector") == std::string::npos) {
    const int fd = dial(false);
    if (fd < 0) continue;
    const std::string get = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    (void)send(fd, get.data(), get.size(), MSG_NOSIGNAL);
    timeval tv{2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[4096];
    answer.clear();
    ssize_t got;
    while ((got = recv(fd, buf, sizeof(buf), 0)) > 0) answer.append(buf, got);
    close(fd);
    if (answer.find("kvwire_connector") == std::string::npos)
      absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_NE(answer.find("kvwire_connector"), std::string::npos) << "metrics never served";

  // Shutdown is bounded although the clients still hold their connections unread.
  prefill->Send("quit");
  auto gone = prefill->Expect("NEVER-PRINTED", absl::Seconds(15));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable)
      << "the prefill process did not exit: " << gone.status();
  for (int fd : fds) close(fd);
}

INSTANTIATE_TEST_SUITE_P(Transports, HostileConnectorTest, ::testing::Values("tcp", "shm"));

}  // namespace
}  // namespace kvwire::testing

// Prefill in a child process (kvwire_connector_peer), decode in this process, real sockets:
// every byte decode loads is checked against what prefill wrote, and after every scenario
// each block on both sides is free or owned by exactly one live request.
#include "kvwire/connector.h"

#include <atomic>
#include <functional>
#include <random>
#include <set>
#include <signal.h>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "kvwire/deepseek.h"
#include "tests/connector/child.h"
#include "tests/connector/kv_sim.h"
#include "tests/support/promtool.h"

namespace kvwire::testing {
namespace {

constexpr absl::Duration kWait = absl::Seconds(90);

struct SimSetup {
  std::string layout;
  uint64_t blocks;
  uint64_t state_blocks;
};

SimSetup SetupFor(const std::string& layout) {
  if (layout.rfind("deepseek-v4", 0) == 0) return {layout, 16, 2};
  if (layout.rfind("random", 0) == 0) return {layout, 48, 2};
  return {layout, 16, 2};
}

uint64_t MaxTokens(const Layout& l, uint64_t blocks) {
  uint64_t max = 4000;
  for (const CacheGroup& g : l.groups) {
    if (g.full_history()) max = std::min<uint64_t>(max, blocks * g.tokens_per_block - 1);
  }
  return max;
}

class Decode {
 public:
  Decode(const std::string& transport, const SimSetup& setup, KvMode mode,
         absl::Duration timeout = absl::Seconds(60), const std::string& role = "decode",
         const std::string& name = "") {
    ConnectorOptions o;
    o.role = role;
    o.mode = mode;
    o.engine.name = name.empty() ? absl::StrCat("decode-", getpid()) : name;
    o.engine.transport = transport;
    o.engine.peer_lease = absl::Seconds(3);
    o.engine.heartbeat_interval = absl::Milliseconds(200);
    o.request_timeout = timeout;
    o.handshake_timeout = absl::Seconds(20);
    auto c = Connector::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    connector = std::move(*c);
    auto kv = KvCache::Create(setup.layout, setup.blocks + 8, setup.state_blocks + 1, 99);
    EXPECT_TRUE(kv.ok()) << kv.status();
    cache = std::move(*kv);
    EXPECT_TRUE(connector->RegisterKvCaches(cache->layout(), cache->memory()).ok());
  }

  // The scheduler's and worker's steps for a remote-prefill request; returns the load's
  // reason when it failed ("" on success).
  absl::StatusOr<std::string> Load(const std::string& id, const std::string& params,
                                   uint64_t tokens, uint64_t cached,
                                   const std::function<void()>& after_start = nullptr) {
    if (absl::Status s = Start(id, params, tokens, cached); !s.ok()) return s;
    if (after_start) after_start();
    return WaitDone(id);
  }

  // The steps up to StartLoadKv.
  absl::Status Start(const std::string& id, const std::string& params, uint64_t tokens,
                     uint64_t cached, const std::function<void()>& before_load = nullptr) {
    auto match = connector->GetNumNewMatchedTokens(id, tokens, cached, params);
    if (!match.ok()) return match.status();
    absl::StatusOr<BlockTable> blocks = cache->Allocate(id, tokens);
    if (!blocks.ok()) return blocks.status();
    if (absl::Status s = connector->UpdateStateAfterAlloc(id, *blocks, match->num_external_tokens);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = connector->BindConnectorMeta(connector->BuildConnectorMeta()); !s.ok()) {
      return s;
    }
    if (before_load) before_load();
    return connector->StartLoadKv();
  }

  absl::StatusOr<std::string> WaitDone(const std::string& id) {
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      FinishedRequests f = connector->GetFinished();
      std::optional<std::string> result;
      for (const std::string& r : f.finished_recving) {
        if (r == id) result = "";
        done.insert(r);
      }
      for (const FailedLoad& fl : f.failed_loads) {
        if (fl.request_id == id) result = fl.reason;
        cache->Release(fl.request_id);  // failed loads free their blocks at once
      }
      if (result) return *result;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return absl::DeadlineExceededError(absl::StrCat("request ", id, " never finished"));
  }

  void ExpectClean() {
    EXPECT_EQ(cache->CheckAccounting(), "");
    EXPECT_EQ(connector->LiveRequests(), 0u);
    EXPECT_EQ(MachineErrors(*connector), "");
  }

  std::unique_ptr<Connector> connector;
  std::unique_ptr<KvCache> cache;
  std::set<std::string> done;
};

// A prefill instance in this process (for the tests that kill decode, which then runs in the
// child): the scheduler's and worker's steps of connector_peer, without the pipe.
class PrefillHere {
 public:
  PrefillHere(const std::string& transport, const SimSetup& setup) {
    ConnectorOptions o;
    o.role = "prefill";
    o.engine.name = absl::StrCat("prefill-", getpid());
    o.engine.transport = transport;
    o.engine.peer_lease = absl::Seconds(3);
    o.engine.heartbeat_interval = absl::Milliseconds(200);
    o.request_timeout = absl::Seconds(60);  // far beyond the lease: peer death must free first
    auto c = Connector::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    connector = std::move(*c);
    auto kv = KvCache::Create(setup.layout, setup.blocks, setup.state_blocks, 7);
    EXPECT_TRUE(kv.ok()) << kv.status();
    cache = std::move(*kv);
    EXPECT_TRUE(connector->RegisterKvCaches(cache->layout(), cache->memory()).ok());
  }

  // Read mode: prefill is done; returns the kv_transfer_params for decode.
  std::string Handoff(const std::string& id, uint64_t tokens) {
    absl::StatusOr<BlockTable> blocks = cache->Allocate(id, tokens);
    EXPECT_TRUE(blocks.ok()) << blocks.status();
    cache->Fill(id, *blocks);
    KvTransferParams in;
    in.do_remote_decode = true;
    in.mode = KvMode::kRead;
    auto done = connector->RequestFinished(id, *blocks, tokens, in.ToJson());
    EXPECT_TRUE(done.ok()) << done.status();
    EXPECT_TRUE(done->delay_free);
    return done.ok() ? done->kv_transfer_params : "";
  }

  // Write mode: the request is scheduled and its first `layers` layers are saved.
  void StartWrite(const std::string& id, const std::string& tid, uint64_t tokens, int layers) {
    KvTransferParams in;
    in.do_remote_decode = true;
    in.mode = KvMode::kWrite;
    in.transfer_id = tid;
    write_params_ = in.ToJson();
    absl::StatusOr<BlockTable> blocks = cache->Allocate(id, tokens);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    cache->Fill(id, *blocks);
    ASSERT_TRUE(connector->GetNumNewMatchedTokens(id, tokens, 0, write_params_).ok());
    ASSERT_TRUE(connector->UpdateStateAfterAlloc(id, *blocks, 0).ok());
    ASSERT_TRUE(connector->BindConnectorMeta(connector->BuildConnectorMeta()).ok());
    std::set<int> all;
    for (const CacheGroup& g : cache->layout().groups) all.insert(g.layers.begin(), g.layers.end());
    for (int layer : all) {
      if (layers-- <= 0) break;
      ASSERT_TRUE(connector->SaveKvLayer(layer).ok());
    }
  }

  // Waits until the connector lets go of every request, frees what GetFinished reports (and
  // what the scheduler finishes now, for write requests that failed before it finished them);
  // returns how long that took.
  absl::StatusOr<absl::Duration> WaitAllFreed(const std::string& id, bool scheduler_finishes) {
    const absl::Time start = absl::Now();
    while (absl::Now() < start + kWait) {
      // Live count first, then the finished list: a request retires and joins the list under
      // one lock, so none that left the count can be missed by the drain after it.
      const bool none_live = connector->LiveRequests() == 0;
      for (const std::string& r : connector->GetFinished().finished_sending) cache->Release(r);
      if (none_live) {
        const absl::Duration took = absl::Now() - start;
        if (scheduler_finishes && cache->live().count(id) != 0) {
          auto done = connector->RequestFinished(id, cache->live().at(id), 0, write_params_);
          if (!done.ok()) return done.status();
          if (done->delay_free) return absl::InternalError("a failed request still holds blocks");
          cache->Release(id);
        }
        return took;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    return absl::DeadlineExceededError("prefill never let go of its requests");
  }

  // "<outcome>: <reason>" of a retired request, from the stats snapshot.
  std::string Outcome(const std::string& id) {
    nlohmann::json j = nlohmann::json::parse(connector->StatsJson());
    for (const nlohmann::json& r : j["requests"]) {
      if (r["request_id"] == id) {
        return absl::StrCat(r["outcome"].get<std::string>(), ": ", r["reason"].get<std::string>());
      }
    }
    return "unknown";
  }

  void ExpectClean() {
    EXPECT_EQ(cache->CheckAccounting(), "");
    EXPECT_EQ(cache->live().size(), 0u);
    EXPECT_EQ(connector->LiveRequests(), 0u);
    EXPECT_EQ(MachineErrors(*connector), "");
  }

  std::unique_ptr<Connector> connector;
  std::unique_ptr<KvCache> cache;

 private:
  std::string write_params_;
};

// Prefill's accounting line: "ok" and no live requests once everything is freed.
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

class ConnectorTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::string transport() const { return GetParam(); }

  // Starts the prefill child and learns its address.
  std::unique_ptr<Child> Prefill(const SimSetup& s, const std::string& mode = "auto",
                                 int timeout_ms = 60000, const std::string& layout = "",
                                 const std::string& name = "prefill") {
    auto c = Child::Start(
        KVWIRE_CONNECTOR_PEER,
        {"--layout=" + (layout.empty() ? s.layout : layout), "--transport=" + transport(),
         "--mode=" + mode, absl::StrCat("--blocks=", s.blocks),
         absl::StrCat("--state_blocks=", s.state_blocks), "--seed=7",
         absl::StrCat("--timeout_ms=", timeout_ms), "--name=" + name});
    EXPECT_TRUE(c.ok()) << c.status();
    auto ready = (*c)->Expect("READY ", absl::Seconds(60));
    EXPECT_TRUE(ready.ok()) << ready.status();
    address_ = ready.ok() ? ready->substr(6) : "";
    return std::move(*c);
  }

  // One request in `mode`; returns the failure reason or "".
  std::string Run(Child& p, Decode& d, const std::string& id, uint64_t tokens, uint64_t cached,
                  const std::string& mode) {
    if (mode == "read") {
      p.Send(absl::StrCat("req ", id, " ", tokens, " read - all"));
      auto params = p.Expect("PARAMS " + id + " ");
      EXPECT_TRUE(params.ok()) << params.status();
      if (!params.ok()) return "no params";
      auto r = d.Load(id, params->substr(8 + id.size()), tokens, cached);
      EXPECT_TRUE(r.ok()) << r.status();
      return r.ok() ? *r : std::string(r.status().message());
    }
    const std::string tid = absl::StrCat("t-", id);
    const std::string params = WriteParams(address_, tid, tokens).ToJson();
    // Prefill first or decode first, alternately: both orders must work.
    const bool prefill_first = std::hash<std::string>()(id) % 2 == 0;
    if (prefill_first) {
      p.Send(absl::StrCat("req ", id, " ", tokens, " write ", tid, " all"));
      EXPECT_TRUE(p.Expect("SAVED " + id).ok());
    }
    auto r = d.Load(id, params, tokens, cached, [&] {
      if (!prefill_first) {
        p.Send(absl::StrCat("req ", id, " ", tokens, " write ", tid, " all"));
      }
    });
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : std::string(r.status().message());
  }

  // A decode instance in a child process.
  std::unique_ptr<Child> DecodeChild(const SimSetup& s) {
    auto c = Child::Start(KVWIRE_CONNECTOR_PEER,
                          {"--role=decode", "--name=decode-child", "--layout=" + s.layout,
                           "--transport=" + transport(), absl::StrCat("--blocks=", s.blocks + 8),
                           absl::StrCat("--state_blocks=", s.state_blocks + 1), "--seed=99"});
    EXPECT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE((*c)->Expect("READY ", absl::Seconds(60)).ok());
    return std::move(*c);
  }

  std::string address_;
};

// The oracle the byte checks start from (KvCache::CheckSelection) is an independent
// token-by-token rule, so it fails when the selection under test is wrong: a block missed, a
// block too many, or a prefix hit ignored, in every DeepSeek-V4-Pro group.
TEST(KvSimOracle, CatchesAWrongBlockSelection) {
  const Layout layout = DeepSeekV4ProLayout();
  int checked = 0;
  for (const CacheGroup& g : layout.groups) {
    if (g.per_request_state) continue;
    for (uint64_t tokens : {1u, 63u, 64u, 65u, 700u, 8192u}) {
      for (uint64_t cached : {0u, 256u}) {
        if (cached >= tokens) continue;
        const BlockSelection right = SelectBlocks(g, tokens, cached);
        EXPECT_EQ(KvCache::CheckSelection(g, right, tokens, cached), "")
            << g.name << " " << tokens << " " << cached;
        if (right.logical_blocks.empty()) continue;
        BlockSelection missed = right;
        missed.logical_blocks.pop_back();
        EXPECT_NE(KvCache::CheckSelection(g, missed, tokens, cached), "") << g.name << " missed";
        BlockSelection extra = right;
        extra.logical_blocks.push_back(right.logical_blocks.back() + 1);
        EXPECT_NE(KvCache::CheckSelection(g, extra, tokens, cached), "") << g.name << " extra";
        ++checked;
      }
    }
    // A prefix hit ignored: the blocks of the cached prefix selected again.
    const BlockSelection whole = SelectBlocks(g, 8192, 0);
    const BlockSelection hit = SelectBlocks(g, 8192, 4096);
    if (whole.logical_blocks != hit.logical_blocks) {
      EXPECT_NE(KvCache::CheckSelection(g, whole, 8192, 4096), "") << g.name << " prefix";
    }
  }
  EXPECT_GT(checked, 0);
}

TEST_P(ConnectorTest, EveryByteArrivesInBothModes) {
  std::vector<std::string> layouts = {"deepseek-v4-flash", "deepseek-v3.2", "mha"};
  for (int i = 1; i <= 4; ++i) layouts.push_back(absl::StrCat("random:", i * 7919 + 3));
  std::mt19937_64 rng(2026);
  int n = 0;
  for (const std::string& layout : layouts) {
    SCOPED_TRACE(layout);
    const SimSetup s = SetupFor(layout);
    auto p = Prefill(s);
    Decode d(transport(), s, KvMode::kAuto);
    const uint64_t max = MaxTokens(d.cache->layout(), s.blocks);
    // Boundaries of windows and compression plus random lengths.
    std::vector<uint64_t> lengths = {1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 383, 384, 1000};
    std::shuffle(lengths.begin(), lengths.end(), rng);
    lengths.resize(3);
    lengths.push_back(1 + rng() % max);
    for (uint64_t tokens : lengths) {
      tokens = std::min(tokens, max);
      for (const char* mode : {"read", "write"}) {
        const std::string id = absl::StrCat("r", ++n);
        // Sometimes a prefix hit: decode holds the first tokens already.
        const uint64_t cached = rng() % 3 == 0 ? rng() % tokens : 0;
        SCOPED_TRACE(absl::StrCat(id, " mode=", mode, " tokens=", tokens, " cached=", cached));
        ASSERT_EQ(Run(*p, d, id, tokens, cached, mode), "");
        EXPECT_EQ(d.cache->Verify(id, d.cache->live().at(id), tokens, cached), "");
        d.cache->Release(id);
        ASSERT_TRUE(p->Expect("FREED " + id).ok());
      }
    }
    d.ExpectClean();
    ExpectPrefillClean(*p);
    const std::string stats = d.connector->StatsJson();
    EXPECT_NE(stats.find("\"completed\""), std::string::npos);
    // Every request stepped decode's transition table at run time: at least match, alloc,
    // start_load, connected and one transfer end or layer each (ExpectClean: none refused).
    const nlohmann::json machine = nlohmann::json::parse(stats)["machine"];
    EXPECT_GE(machine["steps"].get<uint64_t>(), 5u * lengths.size() * 2) << machine.dump();
    EXPECT_NE(d.connector->StatsPrometheus().find("kvwire_connector_group_bytes_total"),
              std::string::npos);
  }
}

// Decode waits layer by layer, so that an engine computes layer i while later layers load.
// Write mode: layer 0 is in place, byte for byte, while prefill has not even saved layer 1
// (whose wait goes on). Read mode (one transfer per layer): each wait ends with its layer in
// place.
TEST_P(ConnectorTest, DecodeWaitsLayerByLayer) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s);
  Decode d(transport(), s, KvMode::kAuto);
  std::set<int> all;
  for (const CacheGroup& g : d.cache->layout().groups) all.insert(g.layers.begin(), g.layers.end());
  const std::vector<int> layers(all.begin(), all.end());
  ASSERT_GE(layers.size(), 2u);
  constexpr uint64_t kTokens = 700;

  p->Send(absl::StrCat("req lw ", kTokens, " write t-lw 1"));
  ASSERT_TRUE(p->Expect("SAVED lw 1").ok());
  ASSERT_TRUE(d.Start("lw", WriteParams(address_, "t-lw", kTokens).ToJson(), kTokens, 0).ok());
  ASSERT_TRUE(d.connector->WaitForLayerLoad(layers[0]).ok());
  EXPECT_EQ(d.cache->Verify("lw", d.cache->live().at("lw"), kTokens, 0, layers[0]), "");
  std::atomic<bool> second{false};
  std::thread waiter([&] {
    EXPECT_TRUE(d.connector->WaitForLayerLoad(layers[1]).ok());
    second = true;
  });
  // Layer 1 is not saved: its wait cannot end, and the load is not complete.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(second.load());
  EXPECT_EQ(d.connector->LiveRequests(), 1u);
  p->Send("finish lw");
  ASSERT_TRUE(p->Expect("SAVED lw all").ok());
  waiter.join();
  EXPECT_TRUE(second.load());
  EXPECT_EQ(d.cache->Verify("lw", d.cache->live().at("lw"), kTokens, 0, layers[1]), "");
  auto r = d.WaitDone("lw");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(*r, "");
  EXPECT_EQ(d.cache->Verify("lw", d.cache->live().at("lw"), kTokens, 0), "");
  d.cache->Release("lw");
  // Prefill's "FREED lw" may come before "SAVED lw all" (the last layers can complete before
  // the scheduler finishes the request): its accounting below covers it.

  p->Send(absl::StrCat("req lr ", kTokens, " read - all"));
  auto params = p->Expect("PARAMS lr ");
  ASSERT_TRUE(params.ok()) << params.status();
  const uint64_t transfers_before = d.connector->engine().Stats().transfers_succeeded;
  ASSERT_TRUE(d.Start("lr", params->substr(10), kTokens, 0).ok());
  for (int layer : layers) {
    ASSERT_TRUE(d.connector->WaitForLayerLoad(layer).ok());
    EXPECT_EQ(d.cache->Verify("lr", d.cache->live().at("lr"), kTokens, 0, layer), "")
        << "layer " << layer;
  }
  r = d.WaitDone("lr");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(*r, "");
  // One READ per layer.
  EXPECT_EQ(d.connector->engine().Stats().transfers_succeeded - transfers_before, layers.size());
  EXPECT_EQ(d.cache->Verify("lr", d.cache->live().at("lr"), kTokens, 0), "");
  d.cache->Release("lr");
  ASSERT_TRUE(p->Expect("FREED lr").ok());
  d.ExpectClean();
  ExpectPrefillClean(*p);
}

TEST_P(ConnectorTest, DeepSeekV4ProRequest) {
  const SimSetup s = SetupFor("deepseek-v4-pro");
  auto p = Prefill(s);
  Decode d(transport(), s, KvMode::kAuto);
  for (const char* mode : {"read", "write"}) {
    const std::string id = absl::StrCat("pro-", mode);
    ASSERT_EQ(Run(*p, d, id, 2999, 0, mode), "");
    EXPECT_EQ(d.cache->Verify(id, d.cache->live().at(id), 2999, 0), "");
    d.cache->Release(id);
    ASSERT_TRUE(p->Expect("FREED " + id).ok());
  }
  d.ExpectClean();
  ExpectPrefillClean(*p);
}

// An event the transition table does not take in the request's state (here: blocks allocated
// twice) is refused by the call, and counted and logged by the connector: the stats and the
// metrics say so, and the request goes on as it was.
TEST_P(ConnectorTest, AnEventTheTableRefusesIsCounted) {
  const SimSetup s = SetupFor("deepseek-v3");
  Decode d(transport(), s, KvMode::kAuto);
  // Never started: no prefill is reached.
  const std::string params = WriteParams("127.0.0.1:1", "t-twice", 300).ToJson();
  auto match = d.connector->GetNumNewMatchedTokens("twice", 300, 0, params);
  ASSERT_TRUE(match.ok()) << match.status();
  absl::StatusOr<BlockTable> blocks = d.cache->Allocate("twice", 300);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  ASSERT_TRUE(
      d.connector->UpdateStateAfterAlloc("twice", *blocks, match->num_external_tokens).ok());
  EXPECT_EQ(MachineErrors(*d.connector), "");
  const absl::Status again =
      d.connector->UpdateStateAfterAlloc("twice", *blocks, match->num_external_tokens);
  EXPECT_TRUE(absl::IsFailedPrecondition(again)) << again;
  EXPECT_EQ(MachineErrors(*d.connector), "request machine: refused=1 diverged=0");
  EXPECT_NE(d.connector->StatsPrometheus().find(
                absl::StrCat("kvwire_connector_machine_events_total{engine=\"decode-", getpid(),
                             "\",result=\"refused\"} 1")),
            std::string::npos)
      << d.connector->StatsPrometheus();
  // Still pending: the scheduler takes it back, and it leaves the table as withdrawn.
  auto done = d.connector->RequestFinished("twice", *blocks, 300, params);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(done->delay_free);
  d.cache->Release("twice");
  EXPECT_EQ(d.connector->LiveRequests(), 0u);
  EXPECT_EQ(MachineErrors(*d.connector), "request machine: refused=1 diverged=0");
}

TEST_P(ConnectorTest, ModeConflictIsAClearError) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s, "read");
  Decode d(transport(), s, KvMode::kWrite);
  auto r = d.Load("c1", WriteParams(address_, "t-c1", 300).ToJson(), 300, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->find("mode conflict"), std::string::npos) << *r;
  EXPECT_NE(r->find("prefill is 'read'"), std::string::npos) << *r;
  EXPECT_NE(r->find("decode is 'write'"), std::string::npos) << *r;
  d.ExpectClean();
  ExpectPrefillClean(*p);
}

TEST_P(ConnectorTest, LayoutMismatchIsRefusedNamingTheGroup) {
  const SimSetup s = SetupFor("deepseek-v3.2");
  auto p = Prefill(s, "auto", 3000, "deepseek-v3");
  Decode d(transport(), s, KvMode::kAuto);
  p->Send("req m1 300 read - all");
  auto params = p->Expect("PARAMS m1 ");
  ASSERT_TRUE(params.ok());
  auto r = d.Load("m1", params->substr(10), 300, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->find("indexer_k"), std::string::npos) << *r;
  d.ExpectClean();
  // Decode never reached prefill's blocks: the lease frees them.
  ASSERT_TRUE(p->Expect("FREED m1").ok());
  ExpectPrefillClean(*p);
}

TEST_P(ConnectorTest, CorruptedKvTransferParams) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s);
  Decode d(transport(), s, KvMode::kAuto);
  // Not JSON, wrong types, missing fields: refused before anything is allocated.
  for (const char* bad : {"{not json", R"({"do_remote_prefill": true})",
                          R"({"do_remote_prefill": true, "remote_host": "127.0.0.1",
                              "remote_port": 5, "transfer_id": "x", "num_tokens": "many"})",
                          R"({"do_remote_prefill": true, "remote_host": "127.0.0.1",
                              "remote_port": 5, "transfer_id": "x", "num_tokens": 10,
                              "mode": "read", "block_ids": {"mla_kv": "zero"}})"}) {
    auto m = d.connector->GetNumNewMatchedTokens("bad", 100, 0, bad);
    EXPECT_FALSE(m.ok()) << bad;
    EXPECT_NE(m.status().message().find("request bad"), std::string::npos) << m.status();
  }
  // Valid JSON pointing at blocks prefill does not have: the load fails naming the group.
  p->Send("req k1 300 read - all");
  auto params = p->Expect("PARAMS k1 ");
  ASSERT_TRUE(params.ok());
  auto parsed = KvTransferParams::FromJson(params->substr(10));
  ASSERT_TRUE(parsed.ok());
  parsed->block_ids["mla_kv"][1] = 100000;
  auto r = d.Load("k1", parsed->ToJson(), 300, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->find("mla_kv"), std::string::npos) << *r;
  ASSERT_TRUE(p->Expect("FREED k1").ok());  // released by decode's failure message
  // Nobody listening at the address.
  parsed->port = 1;
  r = d.Load("k2", parsed->ToJson(), 300, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->empty());
  d.ExpectClean();
  ExpectPrefillClean(*p);
}

TEST_P(ConnectorTest, AbortsOnEitherSideAtEachPhase) {
  const SimSetup s = SetupFor("deepseek-v4-flash");
  auto p = Prefill(s, "auto", 4000);
  Decode d(transport(), s, KvMode::kAuto);
  // Decode aborts before the load starts (read): fails at once; prefill's lease frees.
  p->Send("req a1 700 read - all");
  auto params = p->Expect("PARAMS a1 ");
  ASSERT_TRUE(params.ok());
  {
    auto m = d.connector->GetNumNewMatchedTokens("a1", 700, 0, params->substr(10));
    ASSERT_TRUE(m.ok());
    auto blocks = d.cache->Allocate("a1", 700);
    ASSERT_TRUE(blocks.ok());
    ASSERT_TRUE(d.connector->UpdateStateAfterAlloc("a1", *blocks, m->num_external_tokens).ok());
    ASSERT_TRUE(d.connector->Abort("a1").ok());
    auto r = d.WaitDone("a1");
    ASSERT_TRUE(r.ok());
    EXPECT_NE(r->find("aborted on decode"), std::string::npos) << *r;
    (void)d.connector->BuildConnectorMeta();
    ASSERT_TRUE(p->Expect("FREED a1").ok());
  }
  // Decode aborts right after starting the read: either it completed or it failed; the
  // blocks come back on both sides in every case.
  p->Send("req a2 900 read - all");
  params = p->Expect("PARAMS a2 ");
  ASSERT_TRUE(params.ok());
  auto r = d.Load("a2", params->substr(10), 900, 0, [&] { (void)d.connector->Abort("a2"); });
  ASSERT_TRUE(r.ok()) << r.status();
  d.cache->Release("a2");
  ASSERT_TRUE(p->Expect("FREED a2").ok());
  // Write mode, decode aborts while prefill is half way through its layers.
  p->Send("req a3 900 write t-a3 5");
  ASSERT_TRUE(p->Expect("SAVED a3 5").ok());
  r = d.Load("a3", WriteParams(address_, "t-a3", 900).ToJson(), 900, 0,
             [&] { (void)d.connector->Abort("a3"); });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->find("aborted on decode"), std::string::npos) << *r;
  p->Send("finish a3");
  ASSERT_TRUE(p->Expect("SAVED a3 all").ok());
  // Write mode, prefill aborts half way: decode's load fails with prefill's reason.
  p->Send("req a4 900 write t-a4 3");
  ASSERT_TRUE(p->Expect("SAVED a4 3").ok());
  r = d.Load("a4", WriteParams(address_, "t-a4", 900).ToJson(), 900, 0,
             [&] { p->Send("abort a4"); });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->find("aborted on prefill"), std::string::npos) << *r;
  // Prefill aborts a read-mode request after the hand-off: the blocks stay until the
  // reader releases them, so the load still succeeds.
  p->Send("req a5 500 read - all");
  params = p->Expect("PARAMS a5 ");
  ASSERT_TRUE(params.ok());
  p->Send("abort a5");
  r = d.Load("a5", params->substr(10), 500, 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, "");
  EXPECT_EQ(d.cache->Verify("a5", d.cache->live().at("a5"), 500, 0), "");
  d.cache->Release("a5");
  d.ExpectClean();
  ExpectPrefillClean(*p);
}

TEST_P(ConnectorTest, DeadlineFailsTheLoadAndFreesBothSides) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s);
  Decode d(transport(), s, KvMode::kAuto, absl::Seconds(2));
  // Prefill writes one layer and then stalls.
  p->Send("req d1 500 write t-d1 1");
  ASSERT_TRUE(p->Expect("SAVED d1 1").ok());
  auto r = d.Load("d1", WriteParams(address_, "t-d1", 500).ToJson(), 500, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->find("deadline"), std::string::npos) << *r;
  p->Send("finish d1");
  ASSERT_TRUE(p->Expect("SAVED d1 all").ok());
  d.ExpectClean();
  ExpectPrefillClean(*p);
}

// Decode asks for a write-mode transfer that no prefill request ever claims: prefill keeps the
// request for its request timeout, then tells decode, whose load fails then rather than at its
// own (60 s) deadline.
TEST_P(ConnectorTest, UnclaimedWriteRequestFailsAtPrefillsTimeout) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s, "auto", 1500);
  Decode d(transport(), s, KvMode::kAuto);
  auto r = d.Load("u1", WriteParams(address_, "t-nobody", 300).ToJson(), 300, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->find("has no request for this transfer"), std::string::npos) << *r;
  d.ExpectClean();
  ExpectPrefillClean(*p);
}

TEST_P(ConnectorTest, PrefillLeaseFreesBlocksWhenDecodeNeverReads) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s, "auto", 1500);
  p->Send("req l1 500 read - all");
  ASSERT_TRUE(p->Expect("PARAMS l1 ").ok());
  ASSERT_TRUE(p->Expect("FREED l1").ok());
  ExpectPrefillClean(*p);
}

TEST_P(ConnectorTest, PrefillKilledMidTransfer) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s);
  Decode d(transport(), s, KvMode::kAuto);
  p->Send("req k1 900 write t-k1 2");
  ASSERT_TRUE(p->Expect("SAVED k1 2").ok());
  absl::Time killed;
  auto r = d.Load("k1", WriteParams(address_, "t-k1", 900).ToJson(), 900, 0, [&] {
    p->Kill();
    killed = absl::Now();
  });
  ASSERT_TRUE(r.ok()) << r.status();
  // Within the lease (3 s), far before the request deadline (60 s), naming the peer.
  EXPECT_LT(absl::Now() - killed, absl::Seconds(10));
  EXPECT_NE(r->find("prefill"), std::string::npos) << *r;
  EXPECT_TRUE(r->find("died") != std::string::npos || r->find("closed") != std::string::npos ||
              r->find("lost") != std::string::npos)
      << *r;
  d.ExpectClean();
}

TEST_P(ConnectorTest, PrefillKilledMidReadFailsOrCompletesTheLoad) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s);
  Decode d(transport(), s, KvMode::kAuto);
  p->Send("req k2 900 read - all");
  auto params = p->Expect("PARAMS k2 ");
  ASSERT_TRUE(params.ok());
  absl::Time killed;
  auto r = d.Load("k2", params->substr(10), 900, 0, [&] {
    p->Kill();
    killed = absl::Now();
  });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LT(absl::Now() - killed, absl::Seconds(10));
  if (r->empty()) {
    // The READ finished before the kill took effect (over shm it needs no help from prefill):
    // then every byte is in place.
    EXPECT_EQ(d.cache->Verify("k2", d.cache->live().at("k2"), 900, 0), "");
    d.cache->Release("k2");
  } else {
    EXPECT_TRUE(r->find("died") != std::string::npos || r->find("closed") != std::string::npos ||
                r->find("lost") != std::string::npos)
        << *r;
  }
  d.ExpectClean();
}

// The failure path of a read-mode load, forced on every transport (over shm a kill cannot
// catch a READ in flight: decode copies inside StartLoadKv, so the test above may see it
// complete): prefill dies after decode matched the request and allocated its blocks, before
// the READ is started. The load must fail naming prefill's address, and nothing leaks.
TEST_P(ConnectorTest, PrefillKilledBeforeTheReadFailsTheLoad) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s);
  Decode d(transport(), s, KvMode::kAuto);
  p->Send("req k3 900 read - all");
  auto params = p->Expect("PARAMS k3 ");
  ASSERT_TRUE(params.ok());
  // Kill() reaps the process: prefill is surely gone when StartLoadKv runs.
  const absl::Status started = d.Start("k3", params->substr(10), 900, 0, [&] { p->Kill(); });
  std::string reason;
  if (started.ok()) {
    auto r = d.WaitDone("k3");
    ASSERT_TRUE(r.ok()) << r.status();
    reason = *r;
  } else {
    reason = started.ToString();
    d.cache->Release("k3");  // the scheduler frees a request whose load could not start
  }
  EXPECT_FALSE(reason.empty()) << "the load completed from a dead prefill";
  // Decode never handshook with it: the reason names prefill's address (from the params).
  EXPECT_NE(reason.find(address_), std::string::npos)
      << reason << " (prefill at " << address_ << ")";
  d.ExpectClean();
}

TEST_P(ConnectorTest, DecodeKilledMidReadFreesPrefillBlocksAtOnce) {
  const SimSetup s = SetupFor("deepseek-v3");
  PrefillHere p(transport(), s);
  auto d = DecodeChild(s);
  const std::string params = p.Handoff("x1", 900);
  d->Send("load x1 900 " + params);
  ASSERT_TRUE(d->Expect("STARTED x1").ok());
  d->Kill();
  // The reader said it started: its death frees the blocks within the lease, not after the
  // 60 s hold.
  absl::StatusOr<absl::Duration> took = p.WaitAllFreed("x1", false);
  ASSERT_TRUE(took.ok()) << took.status();
  EXPECT_LT(*took, absl::Seconds(10));
  const std::string outcome = p.Outcome("x1");
  // The decode says STARTED once its load is under way, which may be before its read_start
  // reached the prefill: the prefill then learns of the death from its peer's close, or from
  // the engine refusing the grant for a peer that closed.
  const bool died =
      outcome.rfind("failed: peer decode-child died", 0) == 0 ||
      outcome.rfind("failed: granting the blocks: Grant: peer decode-child closed", 0) == 0;
  if (transport() == "shm") {
    // Over shm decode copies inside its Transfer call, before it says STARTED: the release
    // may beat the kill. Either way the blocks came back at once.
    EXPECT_TRUE(outcome == "completed: " || died) << outcome;
  } else {
    // Over tcp prefill serves the READ (tens of MB): decode dies while it is in flight.
    EXPECT_TRUE(died) << outcome;
  }
  p.ExpectClean();
  // The prefill instance goes on serving a new decode.
  auto d2 = DecodeChild(s);
  d2->Send("load x2 300 " + p.Handoff("x2", 300));
  ASSERT_TRUE(d2->Expect("LOADED x2 ok").ok());
  ASSERT_TRUE(p.WaitAllFreed("x2", false).ok());
  EXPECT_EQ(p.Outcome("x2"), "completed: ");
  p.ExpectClean();
}

TEST_P(ConnectorTest, DecodeKilledMidWriteFreesPrefillBlocksAtOnce) {
  const SimSetup s = SetupFor("deepseek-v3");
  PrefillHere p(transport(), s);
  auto d = DecodeChild(s);
  // Prefill saved 2 layers and waits for the rest; decode asks for the KV and dies.
  p.StartWrite("w1", "t-w1", 900, 2);
  const uint64_t writes_before = p.connector->engine().Stats().transfers_started;
  KvTransferParams params = WriteParams(p.connector->engine().address(), "t-w1", 900);
  d->Send("load w1 900 " + params.ToJson());
  ASSERT_TRUE(d->Expect("STARTED w1").ok());
  // Kill decode once the write request has reached prefill and its layers are going out
  // (a condition, not a sleep): the write is then surely in flight when decode dies.
  for (const absl::Time until = absl::Now() + kWait;
       p.connector->engine().Stats().transfers_started == writes_before && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GT(p.connector->engine().Stats().transfers_started, writes_before)
      << "prefill never started writing";
  d->Kill();
  absl::StatusOr<absl::Duration> took = p.WaitAllFreed("w1", true);
  ASSERT_TRUE(took.ok()) << took.status();
  EXPECT_LT(*took, absl::Seconds(10));
  const std::string outcome = p.Outcome("w1");
  EXPECT_EQ(outcome.rfind("failed: ", 0), 0u) << outcome;
  EXPECT_NE(outcome.find("decode-child"), std::string::npos) << outcome;
  p.ExpectClean();
}

// Tensor-parallel MHA: prefill on two ranks (4 of the 8 KV heads each), decode on one rank
// (all 8): decode reads each half of every page from the rank that holds it, byte for byte,
// in both page shapes (tokens outside heads, and heads outside tokens). Every other hand-off
// gives both ranks the same transfer id, as vLLM's scheduler-side connector does (each rank's
// read grant is then told apart by its peer).
TEST_P(ConnectorTest, DecodeReadsHeadsFromTwoPrefillRanks) {
  int n = 0;
  for (const std::string kind : {"mha-tp", "mha-hnd-tp"}) {
    SCOPED_TRACE(kind);
    const SimSetup s{kind + ":1:0", 48, 2};
    auto p0 = Prefill(s, "auto", 60000, kind + ":2:0", "prefill-r0");
    auto p1 = Prefill(s, "auto", 60000, kind + ":2:1", "prefill-r1");
    Decode d(transport(), s, KvMode::kAuto);
    auto handoff = [&](Child& p, const std::string& id, uint64_t tokens,
                       const std::string& tid = "-") {
      p.Send(absl::StrCat("req ", id, " ", tokens, " read ", tid, " all"));
      auto line = p.Expect("PARAMS " + id + " ");
      EXPECT_TRUE(line.ok()) << line.status();
      auto params = KvTransferParams::FromJson(line.ok() ? line->substr(8 + id.size()) : "");
      EXPECT_TRUE(params.ok()) << params.status();
      return params.ok() ? *params : KvTransferParams();
    };
    for (auto [tokens, cached] :
         std::vector<std::pair<uint64_t, uint64_t>>{{1, 0}, {17, 0}, {300, 0}, {700, 129}}) {
      const std::string id = absl::StrCat("tp", ++n);
      SCOPED_TRACE(absl::StrCat(id, " tokens=", tokens, " cached=", cached));
      const std::string tid = n % 2 == 0 ? absl::StrCat("shared-", kind, "-", id) : "-";
      KvTransferParams merged = handoff(*p0, id, tokens, tid);
      merged.AddTpSource(handoff(*p1, id, tokens, tid));
      // Through JSON, as a router would pass it on.
      auto r = d.Load(id, merged.ToJson(), tokens, cached);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(*r, "");
      EXPECT_EQ(d.cache->Verify(id, d.cache->live().at(id), tokens, cached), "");
      d.cache->Release(id);
      ASSERT_TRUE(p0->Expect("FREED " + id).ok());
      ASSERT_TRUE(p1->Expect("FREED " + id).ok());
    }
    // Only one rank's hand-off: half of decode's heads would be missing. A clear error, and
    // both sides get their blocks back (prefill at once, through decode's release).
    const std::string id = absl::StrCat("tp", ++n);
    auto r = d.Load(id, handoff(*p0, id, 100).ToJson(), 100, 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NE(r->find("cache group 'kv'"), std::string::npos) << *r;
    EXPECT_NE(r->find("of this decode rank's heads"), std::string::npos) << *r;
    ASSERT_TRUE(p0->Expect("FREED " + id).ok());
    d.ExpectClean();
    ExpectPrefillClean(*p0);
    ExpectPrefillClean(*p1);
  }
}

// Tensor parallelism the other way: prefill on one rank (all 8 KV heads), decode on two
// (4 each, or the whole replicated page of an MLA-style cache on each): both decode engines
// read their part of the one prefill rank's hand-off, byte for byte against the source heads.
// The hand-off has two readers (the decode's tensor-parallel size, from its layout), each with
// its own grant: the blocks stay until both released, a third engine that knows the transfer
// id and claims a rank already bound is refused (closed), and a reader's failure ends its own
// read only.
TEST_P(ConnectorTest, TwoDecodeRanksReadOnePrefillRank) {
  int n = 0;
  for (const std::string kind : {"mha-tp", "mha-hnd-tp", "deepseek-v3@tp"}) {
    SCOPED_TRACE(kind);
    const bool mla = kind == "deepseek-v3@tp";
    const uint64_t blocks = mla ? 16 : 48;
    const SimSetup s{kind + ":1:0", blocks, 2};
    auto p = Prefill(s, "auto", 60000, "", "prefill-tp1");
    Decode d0(transport(), SimSetup{kind + ":2:0", blocks, 2}, KvMode::kAuto, absl::Seconds(60),
              "decode", "decode-r0");
    Decode d1(transport(), SimSetup{kind + ":2:1", blocks, 2}, KvMode::kAuto, absl::Seconds(60),
              "decode", "decode-r1");
    const uint64_t max = MaxTokens(d0.cache->layout(), blocks);
    auto handoff = [&](const std::string& id, uint64_t tokens) {
      p->Send(absl::StrCat("req ", id, " ", tokens, " read - all"));
      auto line = p->Expect("PARAMS " + id + " ");
      EXPECT_TRUE(line.ok()) << line.status();
      return line.ok() ? line->substr(8 + id.size()) : std::string();
    };
    auto verify = [&](Decode& d, const std::string& id, uint64_t tokens, uint64_t cached) {
      EXPECT_EQ(d.cache->Verify(id, d.cache->live().at(id), tokens, cached), "");
      d.cache->Release(id);
    };
    for (auto [tokens, cached] :
         std::vector<std::pair<uint64_t, uint64_t>>{{1, 0}, {17, 0}, {300, 0}, {700, 129}}) {
      tokens = std::min(tokens, max);
      cached = std::min(cached, tokens - 1);
      const std::string id = absl::StrCat("tp", ++n);
      SCOPED_TRACE(absl::StrCat(id, " tokens=", tokens, " cached=", cached));
      const std::string params = handoff(id, tokens);
      if (n % 2 == 1) {
        // One rank after the other: the first one's release leaves the blocks held.
        auto r0 = d0.Load(id, params, tokens, cached);
        ASSERT_TRUE(r0.ok()) << r0.status();
        ASSERT_EQ(*r0, "");
        verify(d0, id, tokens, cached);
        auto early = p->Expect("FREED " + id, absl::Milliseconds(500));
        EXPECT_FALSE(early.ok()) << "freed with one of its two readers still to read";
        auto r1 = d1.Load(id, params, tokens, cached);
        ASSERT_TRUE(r1.ok()) << r1.status();
        ASSERT_EQ(*r1, "");
        verify(d1, id, tokens, cached);
      } else {
        // Both at once.
        ASSERT_TRUE(d1.Start(id, params, tokens, cached).ok());
        ASSERT_TRUE(d0.Start(id, params, tokens, cached).ok());
        for (Decode* d : {&d0, &d1}) {
          auto r = d->WaitDone(id);
          ASSERT_TRUE(r.ok()) << r.status();
          ASSERT_EQ(*r, "");
          verify(*d, id, tokens, cached);
        }
      }
      ASSERT_TRUE(p->Expect("FREED " + id).ok());
    }
    {
      // A third engine with the transfer id, claiming rank 0 while rank 0 reads: closed, its
      // load fails, and the two readers load byte-exact.
      const std::string id = absl::StrCat("tp", ++n);
      const uint64_t tokens = std::min<uint64_t>(300, max);
      const std::string params = handoff(id, tokens);
      ASSERT_TRUE(d0.Start(id, params, tokens, 0).ok());
      Decode intruder(transport(), SimSetup{kind + ":2:0", blocks, 2}, KvMode::kAuto,
                      absl::Seconds(60), "decode", "intruder");
      auto ri = intruder.Load(id, params, tokens, 0);
      ASSERT_TRUE(ri.ok()) << ri.status();
      EXPECT_NE(ri->find("bound to another peer"), std::string::npos) << *ri;
      auto r0 = d0.WaitDone(id);
      ASSERT_TRUE(r0.ok()) << r0.status();
      ASSERT_EQ(*r0, "");
      verify(d0, id, tokens, 0);
      auto r1 = d1.Load(id, params, tokens, 0);
      ASSERT_TRUE(r1.ok()) << r1.status();
      ASSERT_EQ(*r1, "");
      verify(d1, id, tokens, 0);
      ASSERT_TRUE(p->Expect("FREED " + id).ok());
    }
    {
      // Rank 1 fails before it reads (its copy of the params lacks the last block, so it
      // cannot plan, and its release says so): rank 0 still reads byte-exact, and the
      // hand-off ends once both were heard from.
      const std::string id = absl::StrCat("tp", ++n);
      const uint64_t tokens = std::min<uint64_t>(300, max);
      const std::string params = handoff(id, tokens);
      auto bad = KvTransferParams::FromJson(params);
      ASSERT_TRUE(bad.ok()) << bad.status();
      for (auto& [group, ids] : bad->block_ids) ids.pop_back();
      auto r1 = d1.Load(id, bad->ToJson(), tokens, 0);
      ASSERT_TRUE(r1.ok()) << r1.status();
      EXPECT_NE(r1->find("lacks logical block"), std::string::npos) << *r1;
      auto early = p->Expect("FREED " + id, absl::Milliseconds(500));
      EXPECT_FALSE(early.ok()) << "freed by one reader's failure while the other reads";
      auto r0 = d0.Load(id, params, tokens, 0);
      ASSERT_TRUE(r0.ok()) << r0.status();
      ASSERT_EQ(*r0, "");
      verify(d0, id, tokens, 0);
      ASSERT_TRUE(p->Expect("FREED " + id).ok());
    }
    d0.ExpectClean();
    d1.ExpectClean();
    ExpectPrefillClean(*p);
  }
}

// Role "both" (the default): one instance is prefill for one request and decode for the next,
// in both directions between two such instances, byte for byte, and both end clean.
TEST_P(ConnectorTest, RoleBothServesAsPrefillAndAsDecode) {
  const SimSetup s = SetupFor("deepseek-v3");
  Decode a(transport(), s, KvMode::kAuto, absl::Seconds(60), "both", "both-a");
  Decode b(transport(), s, KvMode::kAuto, absl::Seconds(60), "both", "both-b");
  constexpr uint64_t kTokens = 500;
  for (const auto& [from, to, id] :
       {std::tuple<Decode*, Decode*, std::string>{&a, &b, "a-to-b"}, {&b, &a, "b-to-a"}}) {
    SCOPED_TRACE(id);
    // Prefill's steps on `from` (read mode): fill, finish, hand the params over.
    absl::StatusOr<BlockTable> blocks = from->cache->Allocate(id, kTokens);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    from->cache->Fill(id, *blocks);
    KvTransferParams in;
    in.do_remote_decode = true;
    in.mode = KvMode::kRead;
    auto done = from->connector->RequestFinished(id, *blocks, kTokens, in.ToJson());
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_TRUE(done->delay_free);
    // Decode's steps on `to`.
    auto r = to->Load(id, done->kv_transfer_params, kTokens, 0);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(*r, "");
    EXPECT_EQ(to->cache->Verify(id, to->cache->live().at(id), kTokens, 0), "");
    to->cache->Release(id);
    // The prefill side lets go of the blocks once decode released them.
    bool freed = false;
    for (const absl::Time until = absl::Now() + kWait; !freed && absl::Now() < until;) {
      for (const std::string& f : from->connector->GetFinished().finished_sending) {
        from->cache->Release(f);
        freed = freed || f == id;
      }
      if (!freed) absl::SleepFor(absl::Milliseconds(2));
    }
    ASSERT_TRUE(freed) << "the prefill side never finished sending " << id;
  }
  a.ExpectClean();
  b.ExpectClean();
  EXPECT_EQ(a.cache->live().size(), 0u);
  EXPECT_EQ(b.cache->live().size(), 0u);
}

// The connector's and its engine's Prometheus output pass promtool after real traffic in
// both modes, with a prefill peer whose name needs escaping in a label value.
TEST_P(ConnectorTest, PrometheusOutputPassesPromtool) {
  const SimSetup s = SetupFor("deepseek-v3");
  auto p = Prefill(s, "auto", 60000, "", "prefill \"q\" \\b\nc");
  Decode d(transport(), s, KvMode::kAuto);
  int n = 0;
  for (const char* mode : {"read", "write"}) {
    const std::string id = absl::StrCat("m", ++n);
    ASSERT_EQ(Run(*p, d, id, 200, 0, mode), "");
    d.cache->Release(id);
    ASSERT_TRUE(p->Expect("FREED " + id).ok());
  }
  const std::string connector = d.connector->StatsPrometheus();
  EXPECT_NE(connector.find("kvwire_connector_group_bytes_total"), std::string::npos);
  const absl::Status c = PromtoolCheckMetrics(connector);
  EXPECT_TRUE(c.ok()) << c.message();
  Engine& engine = d.connector->engine();
  const std::string text = engine.Stats().ToPrometheus(engine.name());
  const absl::Status e = PromtoolCheckMetrics(text);
  EXPECT_TRUE(e.ok()) << e.message();
  EXPECT_NE(text.find("peer=\"prefill \\\"q\\\" \\\\b\\nc\""), std::string::npos) << text;
}

INSTANTIATE_TEST_SUITE_P(Transports, ConnectorTest, ::testing::Values("tcp", "shm"));

}  // namespace
}  // namespace kvwire::testing

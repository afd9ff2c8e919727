// The connector with GPU events and GPU KV memory, on the emulated GPU runtime
// (tests/support/emulated_gpu.h: streams run on their own threads, so events really complete
// later). Prefill and decode are two connectors in this process (the emulated runtime is
// process-wide), or prefill runs in a child process with its own emulated GPU.
//
// Event-gated saves keep prefill's KV in host memory, so that they depend on no transport's
// GPU support: the "compute stream" writes part of each gated layer (a device-to-host copy
// behind a slow queue) and records the layer's event after it. Sent early, decode would get
// the stale bytes.
#include <atomic>
#include <cstring>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "kvwire/connector.h"
#include "src/gpu/runtime.h"
#include "tests/connector/child.h"
#include "tests/connector/kv_sim.h"
#include "tests/support/emulated_gpu.h"

namespace kvwire::testing {
namespace {

constexpr absl::Duration kWait = absl::Seconds(60);
constexpr absl::Duration kCopyDelay = absl::Milliseconds(300);
constexpr uint64_t kBlocks = 16, kStateBlocks = 2;

// An emulated GPU that is this process's default runtime while it lives (engines and
// connectors keep the runtime they were created with, so it must outlive them).
class GpuScope {
 public:
  explicit GpuScope(EmulatedGpuOptions options) : gpu_(options) {
    gpu::SetDefaultRuntime(&gpu_.runtime());
  }
  ~GpuScope() { gpu::SetDefaultRuntime(nullptr); }
  EmulatedGpu& gpu() { return gpu_; }
  gpu::Runtime& runtime() { return gpu_.runtime(); }

 private:
  EmulatedGpu gpu_;
};

struct Side {
  std::unique_ptr<KvCache> cache;  // outlives the connector, which registered its memory
  std::unique_ptr<Connector> connector;
};

// One connector over a simulated KV cache (in GPU memory of `kv_gpu` when given).
Side MakeSide(const std::string& role, const std::string& transport, const std::string& layout,
              absl::Duration timeout, gpu::Runtime* kv_gpu, uint64_t extra_blocks, uint64_t seed,
              const std::string& name = "") {
  ConnectorOptions o;
  o.role = role;
  o.engine.name = absl::StrCat(name.empty() ? role : name, "-", getpid());
  o.engine.transport = transport;
  o.engine.peer_lease = absl::Seconds(3);
  o.engine.heartbeat_interval = absl::Milliseconds(200);
  o.request_timeout = timeout;
  o.handshake_timeout = absl::Seconds(20);
  Side s;
  auto c = Connector::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return s;
  s.connector = std::move(*c);
  auto kv =
      KvCache::Create(layout, kBlocks + extra_blocks, kStateBlocks + extra_blocks, seed, kv_gpu);
  EXPECT_TRUE(kv.ok()) << kv.status();
  if (!kv.ok()) return s;
  s.cache = std::move(*kv);
  absl::Status reg = s.connector->RegisterKvCaches(s.cache->layout(), s.cache->memory());
  EXPECT_TRUE(reg.ok()) << reg;
  return s;
}

// Decode's scheduler and worker steps up to StartLoadKv.
absl::Status StartLoad(Side& d, const std::string& id, const std::string& params, uint64_t tokens) {
  auto match = d.connector->GetNumNewMatchedTokens(id, tokens, 0, params);
  if (!match.ok()) return match.status();
  absl::StatusOr<BlockTable> blocks = d.cache->Allocate(id, tokens);
  if (!blocks.ok()) return blocks.status();
  if (absl::Status s = d.connector->UpdateStateAfterAlloc(id, *blocks, match->num_external_tokens);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = d.connector->BindConnectorMeta(d.connector->BuildConnectorMeta()); !s.ok()) {
    return s;
  }
  return d.connector->StartLoadKv();
}

// Decode: "" once the load completed, else the failure reason (its blocks are freed then).
absl::StatusOr<std::string> WaitLoaded(Side& d, const std::string& id) {
  const absl::Time deadline = absl::Now() + kWait;
  while (absl::Now() < deadline) {
    FinishedRequests f = d.connector->GetFinished();
    std::optional<std::string> result;
    for (const std::string& r : f.finished_recving) {
      if (r == id) result = "";
    }
    for (const FailedLoad& fl : f.failed_loads) {
      if (fl.request_id == id) result = fl.reason;
      d.cache->Release(fl.request_id);
    }
    if (result) return *result;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return absl::DeadlineExceededError(absl::StrCat("request ", id, " never finished"));
}

// Prefill, write mode: the scheduler's steps for a request whose KV this side computes.
std::string StartSave(Side& p, const std::string& id, const std::string& tid, uint64_t tokens) {
  KvTransferParams in;
  in.do_remote_decode = true;
  in.mode = KvMode::kWrite;
  in.transfer_id = tid;
  absl::StatusOr<BlockTable> blocks = p.cache->Allocate(id, tokens);
  EXPECT_TRUE(blocks.ok()) << blocks.status();
  if (!blocks.ok()) return "";
  p.cache->Fill(id, *blocks);
  EXPECT_TRUE(p.connector->GetNumNewMatchedTokens(id, tokens, 0, in.ToJson()).ok());
  EXPECT_TRUE(p.connector->UpdateStateAfterAlloc(id, *blocks, 0).ok());
  EXPECT_TRUE(p.connector->BindConnectorMeta(p.connector->BuildConnectorMeta()).ok());
  return in.ToJson();
}

// Prefill: waits until the connector lets go of every request and frees their blocks (those
// it reports, and those of write requests that ended before the scheduler finished them).
void WaitPrefillFreed(Side& p, const std::string& id, const std::string& params) {
  const absl::Time deadline = absl::Now() + kWait;
  while (absl::Now() < deadline) {
    // Live count before the finished list (a request leaves one and joins the other under one
    // lock), so the last drain sees every request that left the count.
    const bool none_live = p.connector->LiveRequests() == 0;
    for (const std::string& r : p.connector->GetFinished().finished_sending) p.cache->Release(r);
    if (none_live) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(p.connector->LiveRequests(), 0u) << "prefill never let go of its requests";
  if (p.cache->live().count(id) != 0) {
    auto done = p.connector->RequestFinished(id, p.cache->live().at(id), 0, params);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_FALSE(done->delay_free) << "an ended request still holds blocks";
    p.cache->Release(id);
  }
}

void ExpectClean(Side& s) {
  EXPECT_EQ(s.cache->CheckAccounting(), "");
  EXPECT_EQ(s.cache->live().size(), 0u);
  EXPECT_EQ(s.connector->LiveRequests(), 0u);
}

std::vector<int> AllLayers(const Layout& l) {
  std::set<int> all;
  for (const CacheGroup& g : l.groups) all.insert(g.layers.begin(), g.layers.end());
  return {all.begin(), all.end()};
}

// "<outcome>: <reason>" of a retired request, from the stats snapshot.
std::string Outcome(Connector& c, const std::string& id) {
  nlohmann::json j = nlohmann::json::parse(c.StatsJson());
  for (const nlohmann::json& r : j["requests"]) {
    if (r["request_id"] == id) {
      return absl::StrCat(r["outcome"].get<std::string>(), ": ", r["reason"].get<std::string>());
    }
  }
  return "unknown";
}

bool Done(const gpu::Event& e) {
  absl::StatusOr<bool> done = e.Done();
  EXPECT_TRUE(done.ok()) << done.status();
  return done.ok() && *done;
}

class GpuConnectorTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::string transport() const { return GetParam(); }
};

// SaveKvLayer(layer, event): returns while the event is pending; the layer's bytes do not
// leave before it completes (prefill's engine starts no WRITE for it until then, and the
// page's final bytes exist only after the stream's copy, so decode would get stale ones);
// layers go out in call order (plain saves queue behind gated ones); WaitForSave covers the
// gated saves; every byte arrives and both sides' blocks are accounted for.
TEST_P(GpuConnectorTest, EventGatedSaveSendsTheLayerOnlyAfterItsEvent) {
  GpuScope scope({.devices = 1, .copy_delay = kCopyDelay});
  gpu::Runtime& rt = scope.runtime();
  Side p = MakeSide("prefill", transport(), "deepseek-v3", absl::Seconds(60), nullptr, 0, 7);
  Side d = MakeSide("decode", transport(), "deepseek-v3", absl::Seconds(60), nullptr, 8, 99);
  ASSERT_TRUE(p.connector && p.cache && d.connector && d.cache);
  constexpr uint64_t kTokens = 700;
  const std::string params = StartSave(p, "g1", "t-g1", kTokens);
  ASSERT_TRUE(StartLoad(d, "g1",
                        WriteParams(p.connector->engine().address(), "t-g1", kTokens).ToJson(),
                        kTokens)
                  .ok());

  // Gated: the first three layers of the first group; one page of each gets its final bytes
  // only from the compute stream (device -> host, each copy 300 ms behind the previous).
  const CacheGroup& g = p.cache->layout().groups[0];
  ASSERT_GE(g.layers.size(), 3u);
  const std::vector<int64_t>& ids = p.cache->live().at("g1").at(g.name);
  ASSERT_GE(ids[0], 0);
  const uint64_t pb = g.page_bytes;
  auto scratch = gpu::DeviceBuffer::Allocate(rt, 0, 3 * pb);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  auto compute = gpu::Stream::Create(rt, 0);
  ASSERT_TRUE(compute.ok()) << compute.status();
  std::vector<gpu::Event> events;
  for (int k = 0; k < 3; ++k) {
    uint8_t* page = p.cache->Host(g.BlockAddress(k, ids[0], 0));
    auto* dev = static_cast<std::byte*>(scratch->data()) + k * pb;
    ASSERT_TRUE(scope.gpu().WriteDevice(dev, page, pb).ok());
    std::memset(page, 0, pb);
    ASSERT_TRUE(compute->CopyAsync(page, dev, pb).ok());
    auto e = gpu::Event::Create(rt, 0);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE(e->Record(*compute).ok());
    ASSERT_TRUE(p.connector->SaveKvLayer(g.layers[k], GpuEvent{e->native(), 0}).ok());
    // An ordering check, not a speed check: the copy ahead of the event waits 300 ms.
    if (k == 0) {
      ASSERT_FALSE(Done(*e)) << "SaveKvLayer returned only after the event completed";
    }
    events.push_back(std::move(*e));
  }
  for (int layer : AllLayers(p.cache->layout())) {
    if (layer == g.layers[0] || layer == g.layers[1] || layer == g.layers[2]) continue;
    ASSERT_TRUE(p.connector->SaveKvLayer(layer).ok());
  }
  auto finished = p.connector->RequestFinished("g1", p.cache->live().at("g1"), kTokens, params);
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_TRUE(finished->delay_free);

  // WaitForSave returns only once every gated save went out (its event completed).
  std::atomic<bool> saved{false}, all_done_at_save{false};
  std::thread save_waiter([&] {
    EXPECT_TRUE(p.connector->WaitForSave().ok());
    all_done_at_save = Done(events[0]) && Done(events[1]) && Done(events[2]);
    saved = true;
  });
  // Each layer is one WRITE, and layer k's may start only after event k (and, in order,
  // events 0..k-1) completed: a WRITE counted before the events are looked at must have a
  // completed event. (Prefill's own engine counts; decode's memory is not read while the
  // transport may write it.)
  int pending_samples = 0, early = 0;
  const absl::Time deadline = absl::Now() + kWait;
  while (absl::Now() < deadline) {
    const uint64_t started = p.connector->engine().Stats().transfers_started;
    uint64_t done = 0;
    while (done < 3 && Done(events[done])) ++done;
    if (done == 0) ++pending_samples;
    if (done < 3 && started > done) {
      ++early;
      ADD_FAILURE() << started << " layer WRITEs started with " << done << " events completed";
    }
    if (done == 3 || early > 0) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_GT(pending_samples, 0);
  EXPECT_EQ(early, 0);
  save_waiter.join();
  EXPECT_TRUE(saved.load());
  EXPECT_TRUE(all_done_at_save.load());

  auto r = WaitLoaded(d, "g1");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(*r, "");
  EXPECT_EQ(d.cache->Verify("g1", d.cache->live().at("g1"), kTokens, 0), "");
  d.cache->Release("g1");
  WaitPrefillFreed(p, "g1", params);
  EXPECT_EQ(Outcome(*p.connector, "g1"), "completed: ");
  ExpectClean(p);
  ExpectClean(d);
  EXPECT_GE(scope.gpu().counters().events_recorded, 3u);
}

// A request that ends while its layer's event is pending (prefill aborts, decode aborts, the
// deadline passes, decode's engine goes away) releases everything at once: the connector stops
// waiting for the event, WaitForSave does not wait for it, both sides get their blocks back.
TEST_P(GpuConnectorTest, AbortOrDeadlineWhileTheEventIsPendingReleasesEverything) {
  GpuScope scope({.devices = 1, .copy_delay = kCopyDelay});
  gpu::Runtime& rt = scope.runtime();
  // The deadline case's prefill (`q`, 2 s) fails the request long before its event (12
  // copies, 3.6 s); decode starts first, so that the connection is up before the request's
  // clock runs. The other cases use `p`, whose deadline is far away.
  Side p60 = MakeSide("prefill", transport(), "deepseek-v3", absl::Seconds(60), nullptr, 0, 7);
  Side q = MakeSide("prefill", transport(), "deepseek-v3", absl::Seconds(2), nullptr, 0, 8,
                    "prefill-2s");
  Side d = MakeSide("decode", transport(), "deepseek-v3", absl::Seconds(60), nullptr, 8, 99);
  ASSERT_TRUE(p60.connector && p60.cache && q.connector && q.cache && d.connector && d.cache);
  const std::vector<int> layers = AllLayers(p60.cache->layout());
  auto scratch = gpu::DeviceBuffer::Allocate(rt, 0, 4096);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  std::vector<uint8_t> sink(4096);

  // "peer" (decode's engine goes away) comes last: decode is gone after it.
  for (const std::string how : {"prefill", "decode", "deadline", "peer"}) {
    SCOPED_TRACE(how);
    Side& p = how == "deadline" ? q : p60;
    const std::string id = "e-" + how, tid = "t-e-" + how;
    constexpr uint64_t kTokens = 500;
    ASSERT_TRUE(StartLoad(d, id,
                          WriteParams(p.connector->engine().address(), tid, kTokens).ToJson(),
                          kTokens)
                    .ok());
    const std::string params = StartSave(p, id, tid, kTokens);
    auto compute = gpu::Stream::Create(rt, 0);
    ASSERT_TRUE(compute.ok()) << compute.status();
    // The aborts need the event pending for a moment only; the deadline for over a second,
    // decode's shutdown for a little more than a moment.
    for (int i = 0; i < (how == "deadline" ? 12 : how == "peer" ? 5 : 3); ++i) {
      ASSERT_TRUE(compute->CopyAsync(sink.data(), scratch->data(), 64).ok());
    }
    auto e = gpu::Event::Create(rt, 0);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE(e->Record(*compute).ok());
    ASSERT_TRUE(p.connector->SaveKvLayer(layers[0], GpuEvent{e->native(), 0}).ok());
    for (size_t i = 1; i < layers.size(); ++i)
      ASSERT_TRUE(p.connector->SaveKvLayer(layers[i]).ok());
    ASSERT_FALSE(Done(*e));
    ASSERT_EQ(p.connector->LiveRequests(), 1u) << Outcome(*p.connector, id);

    std::string want;
    if (how == "prefill") {
      ASSERT_TRUE(p.connector->Abort(id).ok());
      want = "aborted on prefill";
    } else if (how == "decode") {
      ASSERT_TRUE(d.connector->Abort(id).ok());
      want = "aborted by decode";
    } else if (how == "peer") {
      d.connector.reset();  // its engine says goodbye: prefill sees the peer close
      want = "died";
    } else {
      want = "deadline";
    }
    // Prefill lets go while the event is still pending.
    const absl::Time deadline = absl::Now() + kWait;
    while (p.connector->LiveRequests() != 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    ASSERT_EQ(p.connector->LiveRequests(), 0u);
    EXPECT_NE(Outcome(*p.connector, id).find(want), std::string::npos) << Outcome(*p.connector, id);
    ASSERT_TRUE(p.connector->WaitForSave().ok());
    EXPECT_FALSE(Done(*e)) << "WaitForSave waited for the event of a request that had ended";
    if (d.connector) {
      auto r = WaitLoaded(d, id);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_FALSE(r->empty());
      ExpectClean(d);
    } else {
      d.cache->Release(id);
      EXPECT_EQ(d.cache->CheckAccounting(), "");
    }
    WaitPrefillFreed(p, id, params);
    ExpectClean(p);
    ASSERT_TRUE(compute->Synchronize().ok());  // before the event and stream go
  }
}

// Registering GPU KV memory reaches the engine as GPU memory: either a transport of the
// engine moves GPU memory and the region counts in the GPU stats, or the engine refuses it
// naming the transports that declined (never a silent host registration).
TEST_P(GpuConnectorTest, GpuKvMemoryIsRegisteredAsGpuMemory) {
  GpuScope scope({.devices = 2});
  ConnectorOptions o;
  o.engine.name = absl::StrCat("gpu-reg-", getpid());
  o.engine.transport = transport();
  auto c = Connector::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto kv = KvCache::Create("deepseek-v3", kBlocks, kStateBlocks, 1, &scope.runtime(), 1);
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_EQ((*kv)->memory()[0].kind, MemoryKind::kGpu);
  ASSERT_EQ((*kv)->memory()[0].gpu_device, 1);
  absl::Status s = (*c)->RegisterKvCaches((*kv)->layout(), (*kv)->memory());
  if (s.ok()) {
    EXPECT_EQ((*c)->engine().Stats().gpu.regions, 1u);
  } else {
    EXPECT_NE(s.message().find("GPU memory (declined: "), std::string::npos) << s;
    EXPECT_NE(s.message().find(transport()), std::string::npos) << s;
  }
  // The wrong device is refused whatever the transports can do.
  std::vector<KvMemory> wrong = (*kv)->memory();
  wrong[0].gpu_device = 0;
  EXPECT_FALSE((*c)->RegisterKvCaches((*kv)->layout(), wrong).ok());
}

// GPU KV memory end to end: prefill in a child process with its own emulated GPU and its KV
// in device memory, decode here with its KV in device memory too (and once in host memory),
// both modes, every byte checked, every block accounted for.
//
// Uses the tcp and shm transports' GPU support (staging; IPC handles).
TEST_P(GpuConnectorTest, GpuKvMemoryEndToEnd) {
  GpuScope scope({.devices = 1});
  auto child = Child::Start(
      KVWIRE_CONNECTOR_PEER,
      {"--layout=deepseek-v4-flash", "--transport=" + transport(), "--mode=auto",
       absl::StrCat("--blocks=", kBlocks), absl::StrCat("--state_blocks=", kStateBlocks),
       "--seed=7", "--timeout_ms=60000", "--name=prefill-gpu", "--gpu=emulated"});
  ASSERT_TRUE(child.ok()) << child.status();
  Child& p = **child;
  auto ready = p.Expect("READY ", absl::Seconds(60));
  ASSERT_TRUE(ready.ok()) << ready.status();
  const std::string address = ready->substr(6);
  int n = 0;
  for (bool decode_on_gpu : {true, false}) {
    SCOPED_TRACE(decode_on_gpu ? "decode KV on the GPU" : "decode KV in host memory");
    Side d = MakeSide("decode", transport(), "deepseek-v4-flash", absl::Seconds(60),
                      decode_on_gpu ? &scope.runtime() : nullptr, 8, 99);
    ASSERT_TRUE(d.connector && d.cache);
    for (uint64_t tokens : {1, 129, 500}) {
      for (const std::string mode : {"read", "write"}) {
        const std::string id = absl::StrCat("gpu", ++n);
        SCOPED_TRACE(absl::StrCat(id, " ", mode, " tokens=", tokens));
        std::string params;
        if (mode == "read") {
          p.Send(absl::StrCat("req ", id, " ", tokens, " read - all"));
          auto line = p.Expect("PARAMS " + id + " ");
          ASSERT_TRUE(line.ok()) << line.status();
          params = line->substr(8 + id.size());
        } else {
          p.Send(absl::StrCat("req ", id, " ", tokens, " write t-", id, " all"));
          ASSERT_TRUE(p.Expect("SAVED " + id).ok());
          params = WriteParams(address, "t-" + id, tokens).ToJson();
        }
        ASSERT_TRUE(StartLoad(d, id, params, tokens).ok());
        auto r = WaitLoaded(d, id);
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_EQ(*r, "");
        EXPECT_EQ(d.cache->Verify(id, d.cache->live().at(id), tokens, 0), "");
        d.cache->Release(id);
        ASSERT_TRUE(p.Expect("FREED " + id).ok());
      }
    }
    ExpectClean(d);
    if (decode_on_gpu) {
      EXPECT_EQ(d.connector->engine().Stats().gpu.regions, 1u);
    }
  }
  p.Send("acct");
  auto acct = p.Expect("ACCT ");
  ASSERT_TRUE(acct.ok()) << acct.status();
  EXPECT_EQ(*acct, "ACCT ok live=0 connector_live=0");
}

INSTANTIATE_TEST_SUITE_P(Transports, GpuConnectorTest, ::testing::Values("tcp", "shm"));

}  // namespace
}  // namespace kvwire::testing

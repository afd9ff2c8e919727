// Completion is pushed, not polled: the connector learns that a transfer ended from the
// engine's completion callback (TransferOptions::on_complete) and a peer's message from the
// inbox's on_event, never by waiting out a poll period. Both connectors run in this process
// (Connector::Impl directly, for its progress counters) over real loopback sockets / shm.
//
// Asserted as event counts only: each transfer of a request is reported exactly once by the
// engine, and the request completes without the progress thread waking on a timer (its only
// timed wakeups are request deadlines, seconds away, and handshake checks, done before the
// measured request). Latencies are printed, never asserted.
#include <iostream>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/connector/connector_impl.h"
#include "tests/connector/kv_sim.h"

namespace kvwire::testing {
namespace {

constexpr char kLayout[] = "random:11";
constexpr uint64_t kBlocks = 48;
constexpr uint64_t kTokens = 200;
constexpr absl::Duration kWait = absl::Seconds(60);

struct Side {
  std::unique_ptr<Connector::Impl> impl;
  std::unique_ptr<KvCache> cache;
};

Side MakeSide(const std::string& role, const std::string& transport, KvMode mode, uint64_t seed) {
  ConnectorOptions o;
  o.role = role;
  o.mode = mode;
  o.engine.name = absl::StrCat(role, "-", getpid());
  o.engine.transport = transport;
  o.request_timeout = absl::Seconds(30);
  o.handshake_timeout = absl::Seconds(20);
  Side s;
  s.impl = std::make_unique<Connector::Impl>(o);
  absl::Status started = s.impl->Init();
  EXPECT_TRUE(started.ok()) << started;
  auto kv = KvCache::Create(kLayout, role == "decode" ? kBlocks + 8 : kBlocks,
                            2 + (role == "decode"), seed);
  EXPECT_TRUE(kv.ok()) << kv.status();
  s.cache = std::move(*kv);
  absl::Status registered = s.impl->RegisterKvCaches(s.cache->layout(), s.cache->memory());
  EXPECT_TRUE(registered.ok()) << registered;
  return s;
}

int LayersOf(const Layout& l) {
  std::set<int> layers;
  for (const CacheGroup& g : l.groups) layers.insert(g.layers.begin(), g.layers.end());
  return static_cast<int>(layers.size());
}

// Waits (bounded) until `side` reports `id` as received (decode) or sent (prefill); returns the
// failure reason, "" on success.
std::string WaitFinished(Side& side, const std::string& id, bool decode) {
  const absl::Time deadline = absl::Now() + kWait;
  while (absl::Now() < deadline) {
    FinishedRequests f = side.impl->GetFinished();
    for (const std::string& r : decode ? f.finished_recving : f.finished_sending) {
      if (!decode) side.cache->Release(r);
      if (r == id) return "";
    }
    for (const FailedLoad& fl : f.failed_loads) {
      if (fl.request_id == id) return fl.reason.empty() ? "failed" : fl.reason;
    }
    absl::SleepFor(absl::Microseconds(200));
  }
  return "never finished";
}

class PushedCompletionTest : public ::testing::TestWithParam<std::string> {};

// Read mode: decode READs one transfer per layer; each end reaches decode's progress thread
// through the engine's callback, and the load completes with no timed wakeup.
TEST_P(PushedCompletionTest, ReadEndsArePushedToTheConnector) {
  Side prefill = MakeSide("prefill", GetParam(), KvMode::kRead, 7);
  Side decode = MakeSide("decode", GetParam(), KvMode::kRead, 99);
  const int layers = LayersOf(decode.cache->layout());
  for (int round = 0; round < 3; ++round) {
    const std::string id = absl::StrCat("r", round);
    absl::StatusOr<BlockTable> held = prefill.cache->Allocate(id, kTokens);
    ASSERT_TRUE(held.ok()) << held.status();
    prefill.cache->Fill(id, *held);
    KvTransferParams in;
    in.do_remote_decode = true;
    in.mode = KvMode::kRead;
    auto handoff = prefill.impl->RequestFinished(id, *held, kTokens, in.ToJson(), false, "");
    ASSERT_TRUE(handoff.ok()) << handoff.status();
    prefill.impl->WakeProgress();

    auto match = decode.impl->GetNumNewMatchedTokens(id, kTokens, 0, handoff->kv_transfer_params);
    ASSERT_TRUE(match.ok()) << match.status();
    absl::StatusOr<BlockTable> blocks = decode.cache->Allocate(id, kTokens);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    ASSERT_TRUE(decode.impl->UpdateStateAfterAlloc(id, *blocks, match->num_external_tokens).ok());
    ASSERT_TRUE(decode.impl->BindConnectorMeta(decode.impl->BuildConnectorMeta()).ok());
    const connector_internal::ProgressSignal::Counters before = decode.impl->progress_counters();
    const absl::Time start = absl::Now();
    ASSERT_TRUE(decode.impl->StartLoadKv().ok());
    ASSERT_EQ(WaitFinished(decode, id, /*decode=*/true), "");
    const absl::Duration took = absl::Now() - start;
    const connector_internal::ProgressSignal::Counters after = decode.impl->progress_counters();
    EXPECT_EQ(decode.cache->Verify(id, *blocks, kTokens, 0), "");
    ASSERT_EQ(WaitFinished(prefill, id, /*decode=*/false), "");
    decode.cache->Release(id);
    std::cout << GetParam() << " read request " << round << ": " << layers << " layers in "
              << absl::FormatDuration(took) << "\n";
    // Every layer's transfer was reported by the engine, once.
    EXPECT_EQ(after.transfer_ends - before.transfer_ends, static_cast<uint64_t>(layers));
    // The first round's handshake checks for the hello's regions on a timer; after that,
    // nothing but a push woke the thread.
    if (round > 0) EXPECT_EQ(after.timed_wakeups, before.timed_wakeups);
  }
  EXPECT_EQ(decode.impl->LiveRequests(), 0u);
  EXPECT_EQ(prefill.impl->LiveRequests(), 0u);
  EXPECT_EQ(prefill.cache->CheckAccounting(), "");
  EXPECT_EQ(decode.cache->CheckAccounting(), "");
}

// Write mode: prefill WRITEs each layer; its transfer ends are pushed to prefill's progress
// thread, which tells decode ("layer", "done") at once; decode's thread wakes on the inbox.
TEST_P(PushedCompletionTest, WriteEndsArePushedToTheConnector) {
  Side prefill = MakeSide("prefill", GetParam(), KvMode::kWrite, 7);
  Side decode = MakeSide("decode", GetParam(), KvMode::kWrite, 99);
  const int layers = LayersOf(decode.cache->layout());
  for (int round = 0; round < 3; ++round) {
    const std::string id = absl::StrCat("w", round);
    const std::string tid = absl::StrCat("t-", id);
    // Prefill: scheduled, every layer final (saved) before decode asks.
    KvTransferParams pin;
    pin.do_remote_decode = true;
    pin.mode = KvMode::kWrite;
    pin.transfer_id = tid;
    absl::StatusOr<BlockTable> held = prefill.cache->Allocate(id, kTokens);
    ASSERT_TRUE(held.ok()) << held.status();
    prefill.cache->Fill(id, *held);
    ASSERT_TRUE(prefill.impl->GetNumNewMatchedTokens(id, kTokens, 0, pin.ToJson()).ok());
    ASSERT_TRUE(prefill.impl->UpdateStateAfterAlloc(id, *held, 0).ok());
    ASSERT_TRUE(prefill.impl->BindConnectorMeta(prefill.impl->BuildConnectorMeta()).ok());
    std::set<int> all;
    for (const CacheGroup& g : prefill.cache->layout().groups) {
      all.insert(g.layers.begin(), g.layers.end());
    }
    for (int layer : all) ASSERT_TRUE(prefill.impl->SaveKvLayer(layer).ok());
    prefill.impl->WakeProgress();

    const std::string params = WriteParams(prefill.impl->engine().address(), tid, kTokens).ToJson();
    auto match = decode.impl->GetNumNewMatchedTokens(id, kTokens, 0, params);
    ASSERT_TRUE(match.ok()) << match.status();
    absl::StatusOr<BlockTable> blocks = decode.cache->Allocate(id, kTokens);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    ASSERT_TRUE(decode.impl->UpdateStateAfterAlloc(id, *blocks, match->num_external_tokens).ok());
    ASSERT_TRUE(decode.impl->BindConnectorMeta(decode.impl->BuildConnectorMeta()).ok());
    const auto prefill_before = prefill.impl->progress_counters();
    const auto decode_before = decode.impl->progress_counters();
    const absl::Time start = absl::Now();
    ASSERT_TRUE(decode.impl->StartLoadKv().ok());
    ASSERT_EQ(WaitFinished(decode, id, /*decode=*/true), "");
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(decode.cache->Verify(id, *blocks, kTokens, 0), "");
    // Prefill's request ends (its "done" sent) before decode completes; the scheduler then
    // finishes it.
    auto finished = prefill.impl->RequestFinished(id, *held, kTokens, pin.ToJson(), false, "");
    ASSERT_TRUE(finished.ok()) << finished.status();
    if (finished->delay_free) {
      ASSERT_EQ(WaitFinished(prefill, id, /*decode=*/false), "");
    } else {
      prefill.cache->Release(id);
    }
    decode.cache->Release(id);
    const auto prefill_after = prefill.impl->progress_counters();
    const auto decode_after = decode.impl->progress_counters();
    std::cout << GetParam() << " write request " << round << ": " << layers << " layers in "
              << absl::FormatDuration(took) << "\n";
    EXPECT_EQ(prefill_after.transfer_ends - prefill_before.transfer_ends,
              static_cast<uint64_t>(layers));
    if (round > 0) {
      EXPECT_EQ(prefill_after.timed_wakeups, prefill_before.timed_wakeups);
      EXPECT_EQ(decode_after.timed_wakeups, decode_before.timed_wakeups);
    }
  }
  EXPECT_EQ(decode.impl->LiveRequests(), 0u);
  EXPECT_EQ(prefill.impl->LiveRequests(), 0u);
  EXPECT_EQ(prefill.cache->CheckAccounting(), "");
  EXPECT_EQ(decode.cache->CheckAccounting(), "");
}

INSTANTIATE_TEST_SUITE_P(Transports, PushedCompletionTest, ::testing::Values("shm", "tcp"));

}  // namespace
}  // namespace kvwire::testing

// Region arrival is an event (issue 24, "no polling on the request path"): an inbox opened
// with region_events learns when a peer's exported regions become usable, and
// WaitForRemoteRegion sleeps until then instead of polling. Real engines on loopback.
#include <sys/resource.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

#include "kvwire/engine.h"

namespace kvwire::testing {
namespace {

std::unique_ptr<Engine> MakeEngine(const std::string& name) {
  EngineOptions options;
  options.name = name;
  options.transport = "tcp";
  auto engine = Engine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

// Waits (bounded) for a kRegionsReady event of `peer` in `inbox`; false if none came.
bool GotRegionsReady(Inbox& inbox, PeerId peer, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    for (const InboxEvent& e : inbox.Wait(deadline - absl::Now())) {
      if (e.kind == InboxEvent::Kind::kRegionsReady && e.peer == peer) return true;
    }
  }
  return false;
}

// The calling thread's voluntary context switches (each sleep that ended).
long VoluntarySwitches() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_nvcsw;
}

TEST(RegionEventsTest, ExportRaisesTheEventOnlyForInboxesThatAskedAndWakesTheWaiter) {
  // Region memory outlives both engines (declared first).
  std::vector<std::byte> first(8192), second(8192);
  auto a = MakeEngine("events-a");
  auto b = MakeEngine("events-b");
  ASSERT_TRUE(a && b);
  InboxOptions wants;
  wants.region_events = true;
  std::atomic<int> signalled{0};
  wants.on_event = [&signalled] { signalled.fetch_add(1); };
  auto events = b->OpenInbox("events", wants);
  auto plain = b->OpenInbox("plain", InboxOptions());
  ASSERT_TRUE(events.ok() && plain.ok());

  auto r1 = a->RegisterMemory(first.data(), first.size());
  auto r2 = a->RegisterMemory(second.data(), second.size());
  ASSERT_TRUE(r1.ok() && r2.ok());
  ConnectOptions connect;
  connect.exports = {*r1};
  auto to_b = a->Connect(b->address(), connect);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  auto to_a = b->WaitForPeer("events-a", absl::Seconds(10));
  ASSERT_TRUE(to_a.ok()) << to_a.status();
  ASSERT_TRUE(GotRegionsReady(**events, *to_a, absl::Seconds(10)));
  ASSERT_TRUE(b->WaitForRemoteRegion(*to_a, *r1, absl::ZeroDuration()).ok());

  // A waiter for r2 (not exported yet) sleeps until the export: it returns OK once a exports
  // it, and the event follows.
  std::atomic<bool> waiting{false};
  absl::Status waited = absl::UnknownError("not run");
  std::thread waiter([&] {
    waiting = true;
    waited = b->WaitForRemoteRegion(*to_a, *r2, absl::Seconds(30));
  });
  while (!waiting) absl::SleepFor(absl::Milliseconds(1));
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(a->Export(*to_b, {*r2}).ok());
  waiter.join();
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_TRUE(GotRegionsReady(**events, *to_a, absl::Seconds(10)));
  EXPECT_GE(signalled.load(), 2);

  // The inbox that did not ask never sees the kind (a consumer written before it existed).
  for (const InboxEvent& e : (*plain)->Take()) {
    EXPECT_NE(e.kind, InboxEvent::Kind::kRegionsReady);
  }
}

// A region that never comes: the waiter sleeps to its deadline without waking on a timer
// (the wait used to look again every 50 ms: 10 wake-ups in 500 ms).
TEST(RegionEventsTest, WaitForAMissingRegionSleepsUntilItsDeadline) {
  std::vector<std::byte> memory(8192);
  auto a = MakeEngine("sleep-a");
  auto b = MakeEngine("sleep-b");
  ASSERT_TRUE(a && b);
  auto r = a->RegisterMemory(memory.data(), memory.size());
  ASSERT_TRUE(r.ok());
  auto to_b = a->Connect(b->address());
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  auto to_a = b->WaitForPeer("sleep-a", absl::Seconds(10));
  ASSERT_TRUE(to_a.ok()) << to_a.status();
  const absl::Duration timeout = absl::Milliseconds(500);
  const long before = VoluntarySwitches();
  const absl::Time start = absl::Now();
  absl::Status s = b->WaitForRemoteRegion(*to_a, *r, timeout);
  const absl::Duration took = absl::Now() - start;
  const long switches = VoluntarySwitches() - before;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(took, timeout);
  // One sleep, plus a few for locks contended with the engine's threads; a 50 ms poll is 10.
  EXPECT_LT(switches, 5) << "wake-ups while waiting " << absl::FormatDuration(took);
}

}  // namespace
}  // namespace kvwire::testing

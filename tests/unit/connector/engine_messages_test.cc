// Engine messages (Engine::SendMessage / OpenInbox): real engines on loopback in one process.
// Order per peer, topics that never steal each other's messages, limits a hostile or runaway
// peer cannot get past, and peer-close events after the messages that preceded them.
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"

namespace kvwire {
namespace {

constexpr absl::Duration kWait = absl::Seconds(20);

std::unique_ptr<Engine> MakeEngine(const std::string& name, uint32_t max_message_bytes = 1 << 20) {
  EngineOptions o;
  o.name = name;
  o.transport = "tcp";
  o.tcp().connections = 1;
  o.max_message_bytes = max_message_bytes;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

// Collects events from `inbox` until `n` of them arrived or the wait ends.
std::vector<InboxEvent> Collect(Inbox& inbox, size_t n) {
  std::vector<InboxEvent> out;
  const absl::Time deadline = absl::Now() + kWait;
  while (out.size() < n && absl::Now() < deadline) {
    for (InboxEvent& e : inbox.Wait(absl::Milliseconds(50))) out.push_back(std::move(e));
  }
  return out;
}

// The first kPeerClosed event, or nullopt when none came within the wait.
std::optional<InboxEvent> WaitClosed(Inbox& inbox) {
  const absl::Time deadline = absl::Now() + kWait;
  while (absl::Now() < deadline) {
    for (InboxEvent& e : inbox.Wait(absl::Milliseconds(50))) {
      if (e.kind == InboxEvent::Kind::kPeerClosed) return e;
    }
  }
  return std::nullopt;
}

TEST(EngineMessagesTest, TopicsKeepTheirOwnMessagesInOrder) {
  auto a = MakeEngine("msg-a");
  auto b = MakeEngine("msg-b");
  auto in1 = b->OpenInbox("one");
  auto in2 = b->OpenInbox("two");
  ASSERT_TRUE(in1.ok() && in2.ok());
  auto back = a->OpenInbox("reply");
  ASSERT_TRUE(back.ok());
  auto peer = a->Connect(b->address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  constexpr int kN = 500;
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(a->SendMessage(*peer, i % 2 == 0 ? "one" : "two", absl::StrCat(i)).ok());
  }
  std::vector<InboxEvent> one = Collect(**in1, kN / 2);
  std::vector<InboxEvent> two = Collect(**in2, kN / 2);
  ASSERT_EQ(one.size(), size_t{kN / 2});
  ASSERT_EQ(two.size(), size_t{kN / 2});
  for (int i = 0; i < kN / 2; ++i) {
    EXPECT_EQ(one[i].kind, InboxEvent::Kind::kMessage);
    EXPECT_EQ(one[i].payload, absl::StrCat(2 * i));
    EXPECT_EQ(two[i].payload, absl::StrCat(2 * i + 1));
    EXPECT_EQ(one[i].peer_name, "msg-a");
  }
  // An answer goes back to the sender over the same peer.
  ASSERT_TRUE(b->SendMessage(one[0].peer, "reply", "pong").ok());
  std::vector<InboxEvent> r = Collect(**back, 1);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].payload, "pong");
  EXPECT_EQ(r[0].peer, *peer);
  EXPECT_TRUE((*in1)->Take().empty());
}

TEST(EngineMessagesTest, OneInboxPerTopicAndClearSendErrors) {
  auto a = MakeEngine("msg-c");
  auto b = MakeEngine("msg-d");
  auto first = b->OpenInbox("t");
  ASSERT_TRUE(first.ok());
  auto second = b->OpenInbox("t");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists) << second.status();
  EXPECT_FALSE(b->OpenInbox("").ok());
  EXPECT_FALSE(b->OpenInbox(std::string(65, 'x')).ok());
  auto peer = a->Connect(b->address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(a->SendMessage(*peer + 100, "t", "x").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a->SendMessage(*peer, "", "x").code(), absl::StatusCode::kInvalidArgument);
  absl::Status big = a->SendMessage(*peer, "t", std::string((1 << 20) + 1, 'x'));
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(big.message().find("max_message_bytes"), std::string::npos) << big;
  // A message for a topic nobody opened is dropped there; the peer stays connected.
  ASSERT_TRUE(a->SendMessage(*peer, "nobody", "lost").ok());
  ASSERT_TRUE(a->SendMessage(*peer, "t", "kept").ok());
  std::vector<InboxEvent> got = Collect(**first, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].payload, "kept");
  // Closing the inbox frees its topic.
  first->reset();
  auto again = b->OpenInbox("t");
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(a->SendMessage(*peer, "t", "after").ok());
  got = Collect(**again, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].payload, "after");
}

TEST(EngineMessagesTest, PeerCloseComesAfterItsMessages) {
  auto a = MakeEngine("msg-e");
  auto b = MakeEngine("msg-f");
  auto in_b = b->OpenInbox("t");
  auto in_a = a->OpenInbox("t");
  ASSERT_TRUE(in_b.ok() && in_a.ok());
  auto peer = a->Connect(b->address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  // `b` sets up its own data path to `a` after Connect returned there; a Disconnect before
  // that would make `b` close the peer for a failed setup instead.
  ASSERT_TRUE(b->WaitForPeer("msg-e", kWait).ok());
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(a->SendMessage(*peer, "t", absl::StrCat(i)).ok());
  ASSERT_TRUE(a->Disconnect(*peer).ok());
  std::vector<InboxEvent> got = Collect(**in_b, 51);
  for (size_t i = 0; i + 1 < got.size(); ++i) {
    if (got[i].kind == InboxEvent::Kind::kPeerClosed) ADD_FAILURE() << "closed early: " << i;
  }
  ASSERT_EQ(got.size(), 51u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(got[i].payload, absl::StrCat(i));
  EXPECT_EQ(got[50].kind, InboxEvent::Kind::kPeerClosed);
  EXPECT_NE(got[50].payload.find("disconnected by msg-e"), std::string::npos) << got[50].payload;
  // The local side learns it too, and sending now fails at once.
  std::optional<InboxEvent> local = WaitClosed(**in_a);
  ASSERT_TRUE(local.has_value());
  EXPECT_EQ(local->peer, *peer);
  EXPECT_EQ(a->SendMessage(*peer, "t", "late").code(), absl::StatusCode::kUnavailable);
  // An engine that goes away says Goodbye: its peers get the event.
  auto c = MakeEngine("msg-g");
  ASSERT_TRUE(c->Connect(b->address()).ok());
  ASSERT_TRUE(b->WaitForPeer("msg-g", kWait).ok());  // its data path is up on both sides
  c.reset();
  std::optional<InboxEvent> gone = WaitClosed(**in_b);
  ASSERT_TRUE(gone.has_value());
  EXPECT_EQ(gone->peer_name, "msg-g");
  EXPECT_NE(gone->payload.find("shutting down"), std::string::npos) << gone->payload;
}

TEST(EngineMessagesTest, OversizedMessageClosesOnlyThatPeer) {
  // `a` allows itself 4 MiB messages; `b` accepts 64 KiB.
  auto a = MakeEngine("msg-big", 4 << 20);
  auto b = MakeEngine("msg-small", 64 << 10);
  auto in_a = a->OpenInbox("t");
  auto in_b = b->OpenInbox("t");
  ASSERT_TRUE(in_a.ok() && in_b.ok());
  auto peer = a->Connect(b->address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE(a->SendMessage(*peer, "t", std::string(100 << 10, 'x')).ok());
  std::optional<InboxEvent> at_b = WaitClosed(**in_b);
  ASSERT_TRUE(at_b.has_value());
  EXPECT_NE(at_b->payload.find("102400 bytes"), std::string::npos) << at_b->payload;
  EXPECT_NE(at_b->payload.find("max_message_bytes 65536"), std::string::npos) << at_b->payload;
  // The offender is told why (Goodbye), and nothing of its message was delivered.
  std::optional<InboxEvent> at_a = WaitClosed(**in_a);
  ASSERT_TRUE(at_a.has_value());
  EXPECT_NE(at_a->payload.find("max_message_bytes"), std::string::npos) << at_a->payload;
  // `b` still serves others.
  auto c = MakeEngine("msg-other");
  auto p2 = c->Connect(b->address());
  ASSERT_TRUE(p2.ok()) << p2.status();
  ASSERT_TRUE(c->SendMessage(*p2, "t", "fine").ok());
  std::vector<InboxEvent> got = Collect(**in_b, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].payload, "fine");
}

TEST(EngineMessagesTest, FloodingAnInboxClosesThePeer) {
  auto a = MakeEngine("msg-flood");
  auto b = MakeEngine("msg-slow");
  InboxOptions small;
  small.max_queued_bytes = 8 << 10;
  auto in_b = b->OpenInbox("t", small);
  auto in_a = a->OpenInbox("t");
  ASSERT_TRUE(in_b.ok() && in_a.ok());
  auto peer = a->Connect(b->address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  // `b` takes nothing: the ninth KiB overflows its inbox.
  for (int i = 0; i < 16; ++i) (void)a->SendMessage(*peer, "t", std::string(1024, 'x'));
  std::optional<InboxEvent> at_a = WaitClosed(**in_a);
  ASSERT_TRUE(at_a.has_value());
  EXPECT_NE(at_a->payload.find("overflowed inbox 't'"), std::string::npos) << at_a->payload;
  std::vector<InboxEvent> got = (*in_b)->Take();
  ASSERT_FALSE(got.empty());
  size_t messages = 0;
  for (const InboxEvent& e : got) messages += e.kind == InboxEvent::Kind::kMessage;
  EXPECT_EQ(messages, 8u);  // what fitted, then nothing more
}

TEST(EngineMessagesTest, ConcurrentSendersKeepEachSendersOrder) {
  auto a = MakeEngine("msg-threads");
  auto b = MakeEngine("msg-sink");
  auto in_b = b->OpenInbox("t");
  ASSERT_TRUE(in_b.ok());
  auto peer = a->Connect(b->address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  constexpr int kThreads = 4, kEach = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        EXPECT_TRUE(a->SendMessage(*peer, "t", absl::StrCat(t, ":", i)).ok());
      }
    });
  }
  // Taken while the senders run.
  std::vector<InboxEvent> got = Collect(**in_b, kThreads * kEach);
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(got.size(), size_t{kThreads * kEach});
  std::map<int, int> next;
  for (const InboxEvent& e : got) {
    std::vector<std::string> parts = absl::StrSplit(e.payload, ':');
    ASSERT_EQ(parts.size(), 2u);
    int t = 0, i = 0;
    ASSERT_TRUE(absl::SimpleAtoi(parts[0], &t) && absl::SimpleAtoi(parts[1], &i));
    EXPECT_EQ(i, next[t]++) << "sender " << t;
  }
}

TEST(EngineMessagesTest, InboxMayOutliveItsEngine) {
  auto a = MakeEngine("msg-owner");
  auto inbox = a->OpenInbox("t");
  ASSERT_TRUE(inbox.ok());
  a.reset();
  EXPECT_TRUE((*inbox)->Wait(absl::Milliseconds(1)).empty());
  inbox->reset();
}

}  // namespace
}  // namespace kvwire

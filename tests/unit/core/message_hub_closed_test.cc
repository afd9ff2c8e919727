// MessageHub marks every closed peer so that its late messages are dropped; those marks must
// not grow by one per closed peer for the life of a long-running engine.
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "src/core/message_hub.h"
#include "src/util/recent_set.h"

namespace kvwire::core {
namespace {

TEST(MessageHubClosedTest, ClosedPeerMarksAreBounded) {
  auto hub = std::make_shared<MessageHub>(1 << 20);
  constexpr PeerId kPeers = 3 * kClosedPeersRemembered;
  for (PeerId peer = 1; peer <= kPeers; ++peer) hub->PeerClosed(peer, "p", "closed");
  EXPECT_EQ(hub->closed_peers_remembered(), kClosedPeersRemembered);
}

TEST(MessageHubClosedTest, RecentlyClosedPeerIsStillDropped) {
  auto hub = std::make_shared<MessageHub>(1 << 20);
  absl::StatusOr<std::unique_ptr<Inbox>> inbox = hub->Open("t", InboxOptions{.peer_events = false});
  ASSERT_TRUE(inbox.ok()) << inbox.status();
  for (PeerId peer = 1; peer <= 2 * kClosedPeersRemembered; ++peer) {
    hub->PeerClosed(peer, "p", "closed");
  }
  // The most recently closed peer's late message is dropped, not queued.
  ASSERT_TRUE(hub->Deliver(2 * kClosedPeersRemembered, "p", "t", "late").ok());
  EXPECT_TRUE((*inbox)->Take().empty());
  // A live peer is delivered.
  ASSERT_TRUE(hub->Deliver(2 * kClosedPeersRemembered + 1, "q", "t", "hello").ok());
  EXPECT_EQ((*inbox)->Wait(absl::Seconds(5)).size(), 1u);
}

}  // namespace
}  // namespace kvwire::core

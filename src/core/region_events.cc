// Region arrival as an event: the engine wakes whoever waits for a peer's regions (its own
// WaitForRemoteRegion, and inboxes opened with region_events) when they become usable, so
// that no one polls for them.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/core/engine_impl.h"
#include "src/core/message_hub.h"

namespace kvwire {
namespace core {

void MessageHub::RegionsReady(PeerId peer, const std::string& peer_name) {
  MutexLock lock(&mu_);
  if (closed_.Contains(peer)) return;  // its kPeerClosed is the last event of that peer
  for (auto& [topic, inbox] : inboxes_) {
    if (!inbox->options().region_events) continue;
    // Carries no payload: never refused.
    inbox->Push(InboxEvent{InboxEvent::Kind::kRegionsReady, peer, peer_name, {}},
                /*limited=*/false);
  }
}

}  // namespace core

void Engine::Impl::PeersChangedLocked() {
  ++peers_epoch_;
  peers_cv_.SignalAll();
}

void Engine::Impl::RegionsReady(const std::shared_ptr<Peer>& peer) {
  {
    MutexLock lock(&peers_mu_);
    PeersChangedLocked();
  }
  messages_->RegionsReady(peer->id, peer->name);
}

absl::Status Engine::Impl::WaitForRemoteRegion(PeerId id, RegionId region, absl::Duration timeout) {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    uint64_t seen;
    {
      MutexLock lock(&peers_mu_);
      seen = peers_epoch_;
    }
    {
      MutexLock lock(&peer->mu);
      if (!peer->alive) {
        return absl::UnavailableError(
            absl::StrCat("peer ", peer->name, " closed: ", peer->close_reason));
      }
      auto it = peer->remote.find(region);
      if (peer->setup_done && it != peer->remote.end() && it->second.resolved) {
        return absl::OkStatus();
      }
    }
    // Every change that could satisfy the check (or close the peer) bumps the epoch after
    // it is made: sleeping until it moves past `seen` misses none, and needs no poll.
    MutexLock lock(&peers_mu_);
    while (peers_epoch_ == seen) {
      if (!peers_cv_.WaitUntil(&peers_mu_, deadline) && peers_epoch_ == seen) {
        return absl::DeadlineExceededError(absl::StrCat("peer ", peer->name,
                                                        " did not export region ", region,
                                                        " within ", absl::FormatDuration(timeout)));
      }
    }
  }
}

}  // namespace kvwire

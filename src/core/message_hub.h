// Engine messages on the receiving side: one queue (Inbox) per topic, fed by the control
// channel's EngineMessage frames and by peer closes. Kept apart from the engine so that the
// delivery rules (order, limits, hostile peers) are in one place.
#ifndef KVWIRE_CORE_MESSAGE_HUB_H_
#define KVWIRE_CORE_MESSAGE_HUB_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "kvwire/engine.h"
#include "src/util/mutex.h"
#include "src/util/recent_set.h"

namespace kvwire {
namespace core {
class MessageHub;
}

class Inbox::Impl {
 public:
  Impl(std::string topic, InboxOptions options, std::weak_ptr<core::MessageHub> hub)
      : topic_(std::move(topic)), options_(options), hub_(std::move(hub)) {}

  const std::string& topic() const { return topic_; }
  const InboxOptions& options() const { return options_; }

  // False (nothing queued) when `event` would take the queue past max_queued_bytes.
  bool Push(InboxEvent event, bool limited) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<InboxEvent> Take(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t queued_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::weak_ptr<core::MessageHub>& hub() const { return hub_; }

 private:
  const std::string topic_;
  const InboxOptions options_;
  const std::weak_ptr<core::MessageHub> hub_;
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<InboxEvent> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

namespace core {

// Topics are short names chosen by the consumer, e.g. "kvwire.connector".
inline constexpr size_t kMaxTopicBytes = 64;
absl::Status CheckTopic(const std::string& topic);

class MessageHub : public std::enable_shared_from_this<MessageHub> {
 public:
  explicit MessageHub(uint32_t max_message_bytes) : max_message_bytes_(max_message_bytes) {}

  absl::StatusOr<std::unique_ptr<Inbox>> Open(const std::string& topic, InboxOptions options)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets `inbox` if it is still the one open for its topic.
  void Close(const Inbox::Impl* inbox) ABSL_LOCKS_EXCLUDED(mu_);

  // A message from `peer` arrived. An error means the peer broke the rules (oversized
  // message, bad topic, flooded an inbox) and must be closed with that status.
  absl::Status Deliver(PeerId peer, const std::string& peer_name, const std::string& topic,
                       std::string payload) ABSL_LOCKS_EXCLUDED(mu_);
  // `peer` closed: every inbox that wants peer events learns it, and later messages of that
  // peer are dropped.
  void PeerClosed(PeerId peer, const std::string& peer_name, const std::string& reason)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Regions `peer` exported became usable: every inbox that wants region events learns it
  // (region_events.cc).
  void RegionsReady(PeerId peer, const std::string& peer_name) ABSL_LOCKS_EXCLUDED(mu_);

  uint32_t max_message_bytes() const { return max_message_bytes_; }
  // How many closed peers are remembered (bounded by kClosedPeersRemembered).
  size_t closed_peers_remembered() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return closed_.size();
  }

 private:
  const uint32_t max_message_bytes_;
  Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Inbox::Impl>> inboxes_ ABSL_GUARDED_BY(mu_);
  // Bounded (peer ids are never reused; a closed peer's control connection is closed before
  // it is marked, so nothing new can name an old one).
  RecentSet<PeerId> closed_ ABSL_GUARDED_BY(mu_){kClosedPeersRemembered};
  // Peers that broke a rule and are being closed.
  absl::flat_hash_set<PeerId> condemned_ ABSL_GUARDED_BY(mu_);
  // Messages dropped for want of an inbox, per peer (only the first is logged).
  absl::flat_hash_map<PeerId, uint64_t> dropped_ ABSL_GUARDED_BY(mu_);
};

}  // namespace core
}  // namespace kvwire

#endif  // KVWIRE_CORE_MESSAGE_HUB_H_

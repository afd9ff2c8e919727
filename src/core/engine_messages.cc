// Engine messages: SendMessage on the sending side, the per-topic inboxes on the receiving
// side (MessageHub), and the Inbox handle.
#include <utility>

#include "absl/strings/str_cat.h"

#include "src/core/engine_impl.h"
#include "src/core/message_hub.h"
#include "src/util/log.h"

namespace kvwire {

// --- Inbox --------------------------------------------------------------------------------

bool Inbox::Impl::Push(InboxEvent event, bool limited) {
  {
    MutexLock lock(&mu_);
    const uint64_t bytes = event.payload.size();
    if (limited && queued_bytes_ + bytes > options_.max_queued_bytes) return false;
    queued_bytes_ += bytes;
    queue_.push_back(std::move(event));
    cv_.SignalAll();
  }
  if (options_.on_event) options_.on_event();
  return true;
}

std::vector<InboxEvent> Inbox::Impl::Take(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  MutexLock lock(&mu_);
  while (queue_.empty() && timeout > absl::ZeroDuration()) {
    if (!cv_.WaitUntil(&mu_, deadline) && absl::Now() >= deadline) break;
  }
  std::vector<InboxEvent> out(std::make_move_iterator(queue_.begin()),
                              std::make_move_iterator(queue_.end()));
  queue_.clear();
  queued_bytes_ = 0;
  return out;
}

uint64_t Inbox::Impl::queued_bytes() const {
  MutexLock lock(&mu_);
  return queued_bytes_;
}

Inbox::Inbox(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
Inbox::~Inbox() {
  if (std::shared_ptr<core::MessageHub> hub = impl_->hub().lock()) hub->Close(impl_.get());
}
const std::string& Inbox::topic() const { return impl_->topic(); }
std::vector<InboxEvent> Inbox::Take() { return impl_->Take(absl::ZeroDuration()); }
std::vector<InboxEvent> Inbox::Wait(absl::Duration timeout) { return impl_->Take(timeout); }

// --- MessageHub ---------------------------------------------------------------------------

namespace core {

absl::Status CheckTopic(const std::string& topic) {
  if (topic.empty() || topic.size() > kMaxTopicBytes) {
    return absl::InvalidArgumentError(absl::StrCat("message topic of ", topic.size(),
                                                   " bytes (must be 1 to ", kMaxTopicBytes, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Inbox>> MessageHub::Open(const std::string& topic,
                                                        InboxOptions options) {
  if (absl::Status s = CheckTopic(topic); !s.ok()) return s;
  auto impl = std::make_shared<Inbox::Impl>(topic, options, weak_from_this());
  MutexLock lock(&mu_);
  if (!inboxes_.try_emplace(topic, impl).second) {
    return absl::AlreadyExistsError(absl::StrCat("an inbox of topic '", topic, "' is open"));
  }
  return std::make_unique<Inbox>(std::move(impl));
}

void MessageHub::Close(const Inbox::Impl* inbox) {
  MutexLock lock(&mu_);
  auto it = inboxes_.find(inbox->topic());
  if (it != inboxes_.end() && it->second.get() == inbox) inboxes_.erase(it);
}

absl::Status MessageHub::Deliver(PeerId peer, const std::string& peer_name,
                                 const std::string& topic, std::string payload) {
  MutexLock lock(&mu_);
  // Closed, or being closed for breaking a rule: nothing more of it is delivered.
  if (closed_.Contains(peer) || condemned_.contains(peer)) return absl::OkStatus();
  absl::Status broken;
  if (absl::Status s = CheckTopic(topic); !s.ok()) {
    broken = absl::InvalidArgumentError(absl::StrCat("peer ", peer_name, " sent a ", s.message()));
  } else if (payload.size() > max_message_bytes_) {
    broken = absl::InvalidArgumentError(
        absl::StrCat("peer ", peer_name, " sent a message of ", payload.size(), " bytes on topic '",
                     topic, "' (max_message_bytes ", max_message_bytes_, ")"));
  } else if (auto it = inboxes_.find(topic); it == inboxes_.end()) {
    if (dropped_[peer]++ == 0) {
      KVW_LOG(kWarning, "engine") << "message dropped: no inbox for its topic" << Kv("peer", peer)
                                  << Kv("name", peer_name) << Kv("topic", topic);
    }
  } else if (Inbox::Impl& inbox = *it->second; !inbox.Push(
                 InboxEvent{InboxEvent::Kind::kMessage, peer, peer_name, std::move(payload)},
                 /*limited=*/true)) {
    broken = absl::ResourceExhaustedError(
        absl::StrCat("peer ", peer_name, " overflowed inbox '", topic, "' (", inbox.queued_bytes(),
                     " bytes queued, max_queued_bytes ", inbox.options().max_queued_bytes, ")"));
  }
  if (!broken.ok()) condemned_.insert(peer);
  return broken;
}

void MessageHub::PeerClosed(PeerId peer, const std::string& peer_name, const std::string& reason) {
  MutexLock lock(&mu_);
  if (!closed_.Insert(peer)) return;
  dropped_.erase(peer);
  condemned_.erase(peer);
  for (auto& [topic, inbox] : inboxes_) {
    if (!inbox->options().peer_events) continue;
    // Never refused: a consumer must learn that a peer is gone.
    inbox->Push(InboxEvent{InboxEvent::Kind::kPeerClosed, peer, peer_name, reason},
                /*limited=*/false);
  }
}

}  // namespace core

// --- Engine::Impl -------------------------------------------------------------------------

absl::Status Engine::Impl::SendMessage(PeerId id, const std::string& topic, std::string payload) {
  if (absl::Status s = core::CheckTopic(topic); !s.ok()) return s;
  if (payload.size() > options_.max_message_bytes ||
      payload.size() + topic.size() + 64 > options_.max_frame_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("message of ", payload.size(), " bytes on topic '", topic,
                     "' exceeds max_message_bytes ", options_.max_message_bytes,
                     " (or the control frame limit ", options_.max_frame_bytes, ")"));
  }
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("message: unknown peer ", id));
  {
    MutexLock lock(&peer->mu);
    if (!peer->alive) {
      return absl::UnavailableError(
          absl::StrCat("message: peer ", peer->name, " closed: ", peer->close_reason));
    }
  }
  pb::Envelope envelope;
  envelope.mutable_engine_message()->set_topic(topic);
  envelope.mutable_engine_message()->set_payload(std::move(payload));
  if (absl::Status s = peer->conn->Send(envelope); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("message: peer ", peer->name, " closed: ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Inbox>> Engine::Impl::OpenInbox(const std::string& topic,
                                                               InboxOptions options) {
  return messages_->Open(topic, options);
}

void Engine::Impl::OnEngineMessage(const std::shared_ptr<Peer>& peer,
                                   const pb::EngineMessage& message) {
  // The payload is copied once here: the envelope belongs to the connection's reader.
  absl::Status s = messages_->Deliver(peer->id, peer->name, message.topic(), message.payload());
  if (s.ok()) return;
  KVW_LOG(kWarning, "engine") << "closing peer: bad engine message" << Kv("engine", name_)
                              << Kv("peer", peer->name) << Kv("error", s);
  worker_->Post([this, peer, s] { ClosePeer(peer, s); });
}

absl::Status Engine::SendMessage(PeerId peer, const std::string& topic, std::string payload) {
  return impl_->SendMessage(peer, topic, std::move(payload));
}
absl::StatusOr<std::unique_ptr<Inbox>> Engine::OpenInbox(const std::string& topic,
                                                         InboxOptions options) {
  return impl_->OpenInbox(topic, options);
}

}  // namespace kvwire

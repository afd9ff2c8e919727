#include "src/core/served_ops.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/core/engine_impl.h"

namespace kvwire::core {

// Ends its op when the transport lets go of the memory (after its last access).
struct ServedOps::OpPin {
  OpPin(std::shared_ptr<ServedOps> o, PeerId p, uint64_t s, std::shared_ptr<const void> i)
      : owner(std::move(o)), peer(p), seq(s), inner(std::move(i)) {}
  ~OpPin() {
    inner.reset();
    owner->End(peer, seq);
  }
  OpPin(const OpPin&) = delete;
  OpPin& operator=(const OpPin&) = delete;

  std::shared_ptr<ServedOps> owner;
  PeerId peer;
  uint64_t seq;
  std::shared_ptr<const void> inner;
};

std::shared_ptr<const void> ServedOps::Begin(PeerId peer, std::shared_ptr<const void> inner) {
  uint64_t seq;
  {
    MutexLock lock(&mu_);
    seq = next_seq_++;
    live_[peer].insert(seq);
  }
  return std::make_shared<const OpPin>(shared_from_this(), peer, seq, std::move(inner));
}

void ServedOps::End(PeerId peer, uint64_t seq) {
  MutexLock lock(&mu_);
  auto it = live_.find(peer);
  if (it == live_.end()) return;
  it->second.erase(seq);
  if (it->second.empty()) live_.erase(it);
  ended_.SignalAll();
}

absl::Status ServedOps::WaitForPeer(PeerId peer, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  MutexLock lock(&mu_);
  // Ops that begin from now on are not waited for: the wait is bounded by the ones in flight.
  const uint64_t mark = next_seq_;
  ++waiters_;
  bool timed_out = false;
  while (!ServedLocked(peer, mark)) {
    if (!ended_.WaitUntil(&mu_, deadline) && absl::Now() >= deadline) {
      timed_out = !ServedLocked(peer, mark);
      break;
    }
  }
  --waiters_;
  if (!timed_out) return absl::OkStatus();
  size_t remaining = 0;
  for (uint64_t s : live_.at(peer)) remaining += s < mark ? 1 : 0;
  return absl::DeadlineExceededError(absl::StrCat(remaining, " op(s) of peer ", peer,
                                                  " still being served after ",
                                                  absl::FormatDuration(timeout)));
}

bool ServedOps::ServedLocked(PeerId peer, uint64_t mark) const {
  auto it = live_.find(peer);
  return it == live_.end() || *it->second.begin() >= mark;
}

size_t ServedOps::waiters() const {
  MutexLock lock(&mu_);
  return waiters_;
}

void ServedOps::Publish() { MutexLock lock(&mu_); }

size_t ServedOps::in_flight() const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [peer, seqs] : live_) n += seqs.size();
  return n;
}

}  // namespace kvwire::core

namespace kvwire {

absl::Status Engine::WaitForServedOps(PeerId peer, absl::Duration timeout) {
  return impl_->served_ops().WaitForPeer(peer, timeout);
}

void Engine::PublishMemory() { impl_->served_ops().Publish(); }

}  // namespace kvwire

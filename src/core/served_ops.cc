#include "src/core/served_ops.h"

#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/core/engine_impl.h"

namespace kvwire::core {
namespace {

// Called outside mu_. A `done` may be empty (a revoke nobody waits for, OutRevoke's ticket 0):
// its watch still settled the grant, and there is nothing to call.
void RunFired(std::vector<std::function<void()>>& fired) {
  for (std::function<void()>& f : fired) {
    if (f) f();
  }
}

}  // namespace

// Ends its op when the transport lets go of the memory (after its last access).
struct ServedOps::OpPin {
  OpPin(std::shared_ptr<ServedOps> o, PeerId p, uint64_t s, GrantId g, uint64_t b,
        std::shared_ptr<const void> i)
      : owner(std::move(o)), peer(p), seq(s), grant(g), bytes(b), inner(std::move(i)) {}
  ~OpPin() {
    inner.reset();
    owner->End(peer, seq, grant, bytes);
  }
  OpPin(const OpPin&) = delete;
  OpPin& operator=(const OpPin&) = delete;

  std::shared_ptr<ServedOps> owner;
  PeerId peer;
  uint64_t seq;
  GrantId grant;   // 0: not counted under a grant
  uint64_t bytes;  // served under `grant` when the pin goes
  std::shared_ptr<const void> inner;
};

std::shared_ptr<const void> ServedOps::Begin(PeerId peer, std::shared_ptr<const void> inner) {
  MutexLock lock(&mu_);
  return BeginLocked(peer, 0, 0, std::move(inner));
}

std::shared_ptr<const void> ServedOps::BeginGranted(PeerId peer, GrantId grant, uint64_t bytes,
                                                    bool required, const GrantTable& grants,
                                                    std::shared_ptr<const void> inner) {
  MutexLock lock(&mu_);
  if (grant == 0 || !grants.Live(peer, grant)) {
    if (required) return nullptr;
    return BeginLocked(peer, 0, 0, std::move(inner));
  }
  ++grants_[GrantKey{peer, grant}].in_flight;
  return BeginLocked(peer, grant, bytes, std::move(inner));
}

std::shared_ptr<const void> ServedOps::BeginLocked(PeerId peer, GrantId grant, uint64_t bytes,
                                                   std::shared_ptr<const void> inner) {
  const uint64_t seq = next_seq_++;
  auto [entry, added] = live_.try_emplace(peer);
  if (added && !spare_.empty()) {
    entry->second = std::move(spare_.back());
    spare_.pop_back();
  }
  entry->second.Add(seq);
  // From the pool (steady traffic allocates nothing here), under the lock: never a wait.
  return std::allocate_shared<OpPin>(PoolAllocator<OpPin>(pin_pool_), shared_from_this(), peer, seq,
                                     grant, bytes, std::move(inner));
}

void ServedOps::End(PeerId peer, uint64_t seq, GrantId grant, uint64_t bytes) {
  std::vector<std::function<void()>> fired;
  {
    MutexLock lock(&mu_);
    auto it = live_.find(peer);
    if (it != live_.end()) {
      it->second.End(seq);
      if (it->second.empty()) {
        constexpr size_t kSpareRings = 8;
        if (spare_.size() < kSpareRings) {
          if (spare_.capacity() < kSpareRings) spare_.reserve(kSpareRings);
          spare_.push_back(std::move(it->second));
        }
        live_.erase(it);
      }
    }
    if (grant != 0) {
      const GrantKey key{peer, grant};
      auto g = grants_.find(key);
      if (g != grants_.end()) {
        --g->second.in_flight;
        g->second.served += bytes;
        SettleLocked(key, g->second, fired);
      }
    }
    for (auto w = peer_watches_.begin(); w != peer_watches_.end();) {
      if (w->peer == peer && ServedLocked(peer, w->mark)) {
        fired.push_back(std::move(w->done));
        w = peer_watches_.erase(w);
      } else {
        ++w;
      }
    }
    ended_.SignalAll();
  }
  RunFired(fired);
}

bool ServedOps::WhenPeerServed(PeerId peer, std::function<void()> done) {
  MutexLock lock(&mu_);
  const uint64_t mark = next_seq_;
  if (ServedLocked(peer, mark)) return true;
  peer_watches_.push_back(PeerWatch{peer, mark, std::move(done)});
  return false;
}

void ServedOps::SettleLocked(const GrantKey& key, GrantUse& use,
                             std::vector<std::function<void()>>& fired) {
  if (use.in_flight == 0) {
    for (auto w = use.watches.begin(); w != use.watches.end();) {
      if (!use.revoked && use.served < w->bytes) {
        ++w;
        continue;
      }
      if (!use.revoked) {
        // Under mu_: no op under the grant is in flight, and none can begin before this
        // returns (BeginGranted checks liveness under mu_).
        if (grant_table_ != nullptr) (void)grant_table_->Remove(key.peer, key.grant);
        use.revoked = true;
      }
      fired.push_back(std::move(w->done));
      w = use.watches.erase(w);
    }
  }
  if (use.revoked && use.in_flight == 0 && use.watches.empty()) grants_.erase(key);
}

void ServedOps::MarkRevokedLocked(const GrantKey& key, std::vector<std::function<void()>>& fired) {
  auto g = grants_.find(key);
  if (g == grants_.end()) return;
  g->second.revoked = true;
  SettleLocked(key, g->second, fired);
}

bool ServedOps::RevokeWhenServed(PeerId peer, GrantId grant, uint64_t bytes, GrantTable& grants,
                                 std::function<void()> done) {
  std::vector<std::function<void()>> fired;
  bool now = false;
  {
    MutexLock lock(&mu_);
    grant_table_ = &grants;
    const GrantKey key{peer, grant};
    auto g = grants_.find(key);
    const uint64_t in_flight = g == grants_.end() ? 0 : g->second.in_flight;
    const uint64_t served = g == grants_.end() ? 0 : g->second.served;
    if (bytes == 0 || (in_flight == 0 && served >= bytes) || !grants.Live(peer, grant)) {
      // Revoked now (BeginGranted checks liveness under mu_: nothing begins under it after).
      (void)grants.Remove(peer, grant);
      if (in_flight == 0) {
        now = true;
        if (g != grants_.end()) MarkRevokedLocked(key, fired);
      } else {
        g->second.watches.push_back(GrantWatch{0, std::move(done)});
        MarkRevokedLocked(key, fired);
      }
    } else {
      grants_[key].watches.push_back(GrantWatch{bytes, std::move(done)});
    }
  }
  RunFired(fired);
  return now;
}

absl::Status ServedOps::Revoke(PeerId peer, GrantId grant, GrantTable& grants) {
  std::vector<std::function<void()>> fired;
  absl::Status s;
  {
    MutexLock lock(&mu_);
    s = grants.Remove(peer, grant);
    MarkRevokedLocked(GrantKey{peer, grant}, fired);
  }
  RunFired(fired);
  return s;
}

void ServedOps::ForgetPeer(PeerId peer, GrantTable& grants) {
  std::vector<std::function<void()>> fired;
  {
    MutexLock lock(&mu_);
    grants.ForgetPeer(peer);
    std::vector<GrantKey> keys;
    for (const auto& [key, use] : grants_) {
      if (key.peer == peer) keys.push_back(key);
    }
    for (const GrantKey& key : keys) MarkRevokedLocked(key, fired);
  }
  RunFired(fired);
}

uint64_t ServedOps::ServedBytes(PeerId peer, GrantId grant) const {
  MutexLock lock(&mu_);
  auto g = grants_.find(GrantKey{peer, grant});
  return g == grants_.end() ? 0 : g->second.served;
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
  auto it = live_.find(peer);
  const size_t remaining = it == live_.end() ? 0 : it->second.CountBelow(mark);
  return absl::DeadlineExceededError(absl::StrCat(remaining, " op(s) of peer ", peer,
                                                  " still being served after ",
                                                  absl::FormatDuration(timeout)));
}

bool ServedOps::ServedLocked(PeerId peer, uint64_t mark) const {
  auto it = live_.find(peer);
  return it == live_.end() || it->second.NoneBelow(mark);
}

size_t ServedOps::waiters() const {
  MutexLock lock(&mu_);
  return waiters_;
}

void ServedOps::Publish() { MutexLock lock(&mu_); }

size_t ServedOps::in_flight() const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [peer, seqs] : live_) n += seqs.live();
  return n;
}

}  // namespace kvwire::core

namespace kvwire {

absl::Status Engine::WaitForServedOps(PeerId peer, absl::Duration timeout) {
  return impl_->served_ops().WaitForPeer(peer, timeout);
}

void Engine::PublishMemory() { impl_->served_ops().Publish(); }

bool Engine::WhenServedOps(PeerId peer, std::function<void()> done) {
  return impl_->served_ops().WhenPeerServed(peer, std::move(done));
}

bool Engine::RevokeWhenServed(PeerId peer, GrantId grant, uint64_t bytes,
                              std::function<void()> done) {
  return impl_->served_ops().RevokeWhenServed(peer, grant, bytes, impl_->grants(), std::move(done));
}

}  // namespace kvwire

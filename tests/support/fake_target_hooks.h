// The engine's side of a transport's target, reduced to tables a test fills: which session
// tokens name which peer, which regions it serves (and to whom), and what the transport told
// it (WRITE arrivals, peer errors, pins it still holds). One fake for every transport test, so
// that a check the real engine makes (bounds, permission, export) is written once here.
#ifndef KVWIRE_TESTS_SUPPORT_FAKE_TARGET_HOOKS_H_
#define KVWIRE_TESTS_SUPPORT_FAKE_TARGET_HOOKS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "src/util/mutex.h"
#include "transport/transport.h"

namespace kvwire::testing {

// Who a FakeTargetHooks lets in, from the start.
struct FakeTargetHooksOptions {
  std::map<std::string, PeerId> tokens;  // session token -> the peer it names
  std::optional<PeerId> any_token_peer;  // every other token names this peer (a dialing side)
  uint32_t peer_pid = 0;                 // TargetHooks::PeerProcessId of every peer
};

// One peer behind one token, "handshook" from `pid` (by default this process: both ends of
// the test run here).
inline FakeTargetHooksOptions OnePeer(const std::string& token, PeerId peer,
                                      uint32_t pid = static_cast<uint32_t>(getpid())) {
  FakeTargetHooksOptions options;
  options.tokens[token] = peer;
  options.peer_pid = pid;
  return options;
}

// Every token names `peer`: a side that serves nothing (it only dials), or a benchmark.
inline FakeTargetHooksOptions AnyToken(PeerId peer) {
  FakeTargetHooksOptions options;
  options.any_token_peer = peer;
  return options;
}

class FakeTargetHooks final : public transport::TargetHooks {
 public:
  // Answers ResolveIncoming instead of the region table (e.g. the engine's own access check).
  using Resolver = std::function<absl::StatusOr<transport::IncomingAccess>(
      PeerId, RegionId, uint64_t offset, uint64_t length, OpKind, GrantId)>;

  explicit FakeTargetHooks(FakeTargetHooksOptions options = {})
      : tokens_(std::move(options.tokens)),
        any_token_peer_(options.any_token_peer),
        peer_pid_(options.peer_pid) {}

  // --- who is let in ---------------------------------------------------------------------

  void AddToken(const std::string& token, PeerId peer) {
    MutexLock lock(&mu_);
    tokens_[token] = peer;
  }
  // The pid a peer "handshook" from (TargetHooks::PeerProcessId); 0: not known (shm serves
  // no token then).
  void set_peer_pid(uint32_t pid) { peer_pid_.store(pid); }

  // --- what is served --------------------------------------------------------------------

  // A region whose memory the test owns; `exported`: to every peer.
  void AddRegion(const transport::LocalRegion& region, bool exported = true) {
    MutexLock lock(&mu_);
    regions_[region.id] = Entry{region, exported, {}, nullptr};
  }
  // A region of `length` zeroed bytes owned here, under the next free id (from 1).
  RegionId AllocateRegion(uint64_t length, uint32_t access, bool exported = true) {
    MutexLock lock(&mu_);
    RegionId id = 1;
    while (regions_.count(id) != 0) ++id;
    Entry& e = regions_[id];
    e.memory = std::make_unique<std::byte[]>(length);
    e.region.id = id;
    e.region.base = e.memory.get();
    e.region.length = length;
    e.region.access = access;
    e.exported = exported;
    return id;
  }
  void SetExported(RegionId id, bool exported) {
    MutexLock lock(&mu_);
    regions_[id].exported = exported;
  }
  // Withdraws (or restores) region `id` from `peer` only, as Engine::Unexport does.
  void SetExportedTo(RegionId id, PeerId peer, bool exported) {
    MutexLock lock(&mu_);
    if (exported) {
      regions_[id].withdrawn_from.erase(peer);
    } else {
      regions_[id].withdrawn_from.insert(peer);
    }
  }
  std::byte* data(RegionId id) {
    MutexLock lock(&mu_);
    return regions_.at(id).region.base;
  }
  void SetResolver(Resolver resolver) {
    MutexLock lock(&mu_);
    resolver_ = std::move(resolver);
  }
  // While closed, ResolveIncoming waits (lets tests hold ops on the target).
  void SetGate(bool open) {
    MutexLock lock(&mu_);
    gate_open_ = open;
    cv_.SignalAll();
  }
  void SetResolveDelay(absl::Duration delay) {
    MutexLock lock(&mu_);
    resolve_delay_ = delay;
  }

  // --- what the transport reported -------------------------------------------------------

  int arrivals(PeerId peer, TransferId transfer) {
    MutexLock lock(&mu_);
    auto it = arrivals_.find({peer, transfer});
    return it == arrivals_.end() ? 0 : it->second;
  }
  // Of `transfer`, from any peer.
  int arrivals(TransferId transfer) {
    MutexLock lock(&mu_);
    int n = 0;
    for (const auto& [key, count] : arrivals_) n += key.second == transfer ? count : 0;
    return n;
  }
  std::vector<std::pair<PeerId, absl::Status>> peer_errors() {
    MutexLock lock(&mu_);
    return peer_errors_;
  }
  // Waits until at least `n` peer errors were reported; false on timeout.
  bool WaitPeerErrors(size_t n, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    MutexLock lock(&mu_);
    while (peer_errors_.size() < n) {
      if (!cv_.WaitUntil(&mu_, deadline) && peer_errors_.size() < n) return false;
    }
    return true;
  }
  int pins_alive() const { return pins_alive_->load(); }
  // The transport releases a pin when it no longer touches that memory; a test (like an
  // engine) waits for that before it reuses target memory. False on timeout.
  bool WaitPinsReleased(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (pins_alive_->load() != 0) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Microseconds(200));
    }
    return true;
  }

  // --- TargetHooks -----------------------------------------------------------------------

  absl::StatusOr<PeerId> PeerForToken(const std::string& token) override {
    MutexLock lock(&mu_);
    auto it = tokens_.find(token);
    if (it != tokens_.end()) return it->second;
    if (any_token_peer_.has_value()) return *any_token_peer_;
    return absl::UnauthenticatedError(absl::StrCat("unknown session token \"", token, "\""));
  }

  absl::StatusOr<transport::IncomingAccess> ResolveIncoming(PeerId peer, RegionId region,
                                                            uint64_t offset, uint64_t length,
                                                            OpKind kind) override {
    return ResolveIncoming(peer, region, offset, length, kind, /*grant=*/0);
  }

  // As the engine checks an op: exported to the peer, within bounds, permitted. The grant is
  // ignored (the table has no grants) unless a resolver answers.
  absl::StatusOr<transport::IncomingAccess> ResolveIncoming(PeerId peer, RegionId region,
                                                            uint64_t offset, uint64_t length,
                                                            OpKind kind, GrantId grant) override {
    absl::Duration delay;
    Resolver resolver;
    {
      MutexLock lock(&mu_);
      while (!gate_open_) cv_.Wait(&mu_);
      delay = resolve_delay_;
      resolver = resolver_;
    }
    if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
    if (resolver) return resolver(peer, region, offset, length, kind, grant);
    MutexLock lock(&mu_);
    auto it = regions_.find(region);
    if (it == regions_.end() || !it->second.exported ||
        it->second.withdrawn_from.count(peer) != 0) {
      return absl::NotFoundError(
          absl::StrCat("remote region ", region, " is not exported to peer ", peer));
    }
    const transport::LocalRegion& r = it->second.region;
    if (offset > r.length || length > r.length - offset) {
      return absl::OutOfRangeError(absl::StrCat("remote region ", region, " offset ", offset,
                                                " length ", length, " exceeds region length ",
                                                r.length));
    }
    const uint32_t need = kind == OpKind::kWrite ? kRemoteWrite : kRemoteRead;
    if ((r.access & need) == 0) {
      return absl::PermissionDeniedError(absl::StrCat("remote region ", region,
                                                      " does not allow remote ",
                                                      kind == OpKind::kWrite ? "WRITE" : "READ"));
    }
    pins_alive_->fetch_add(1);
    auto counter = pins_alive_;
    transport::IncomingAccess access;
    access.data = r.base + offset;
    access.pin = std::shared_ptr<const void>(nullptr, [counter](const void*) { --*counter; });
    return access;
  }

  absl::StatusOr<transport::LocalRegion> ExportedRegion(PeerId peer, RegionId region) override {
    MutexLock lock(&mu_);
    auto it = regions_.find(region);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", region));
    if (!it->second.exported || it->second.withdrawn_from.count(peer) != 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("region ", region, " is not exported to peer ", peer));
    }
    return it->second.region;
  }

  void OnWriteArrived(PeerId peer, TransferId transfer_id) override {
    MutexLock lock(&mu_);
    ++arrivals_[{peer, transfer_id}];
  }

  void OnPeerError(PeerId peer, const absl::Status& error) override {
    MutexLock lock(&mu_);
    peer_errors_.emplace_back(peer, error);
    cv_.SignalAll();
  }

  uint32_t PeerProcessId(PeerId) override { return peer_pid_.load(); }

 private:
  struct Entry {
    transport::LocalRegion region;
    bool exported = true;
    std::set<PeerId> withdrawn_from;      // SetExportedTo
    std::unique_ptr<std::byte[]> memory;  // AllocateRegion's; null for the test's own memory
  };

  Mutex mu_;
  CondVar cv_;
  std::map<std::string, PeerId> tokens_ ABSL_GUARDED_BY(mu_);
  std::optional<PeerId> any_token_peer_ ABSL_GUARDED_BY(mu_);
  std::map<RegionId, Entry> regions_ ABSL_GUARDED_BY(mu_);
  Resolver resolver_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<PeerId, TransferId>, int> arrivals_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<PeerId, absl::Status>> peer_errors_ ABSL_GUARDED_BY(mu_);
  bool gate_open_ ABSL_GUARDED_BY(mu_) = true;
  absl::Duration resolve_delay_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint32_t> peer_pid_{0};
  std::shared_ptr<std::atomic<int>> pins_alive_ = std::make_shared<std::atomic<int>>(0);
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_FAKE_TARGET_HOOKS_H_

// Which regions each peer may reach over rdma, and the per-peer state those grants live in
// (the rdma transport: the peer's protection domains, and the MRs registered in them for it).
// Verbs-free so that every revocation path is unit-tested. Not thread-safe: the transport
// locks around it. Whatever a call removes is handed back, so that the caller destroys it
// (ibv_dereg_mr, ibv_dealloc_pd: system calls) after dropping its lock.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_GRANTS_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_GRANTS_H_

#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"

#include "kvwire/engine.h"

namespace kvwire::transport::rdma {

template <typename Domain, typename Grant>
class PeerGrants {
 public:
  // What DropPeer removes. Destroyed grants first, then the domain they live in.
  struct Dropped {
    std::optional<Domain> domain;
    std::vector<Grant> grants;
  };

  // The peer's domain; made by `make` on first use. `make`'s error leaves nothing behind.
  absl::StatusOr<Domain*> DomainOf(PeerId peer, absl::FunctionRef<absl::StatusOr<Domain>()> make) {
    auto it = peers_.find(peer);
    if (it == peers_.end()) {
      absl::StatusOr<Domain> made = make();
      if (!made.ok()) return made.status();
      it = peers_.emplace(peer, Entry{std::move(*made), {}}).first;
    }
    return &it->second.domain;
  }
  bool HasDomain(PeerId peer) const { return peers_.contains(peer); }

  const Grant* Find(PeerId peer, RegionId region) const {
    auto it = peers_.find(peer);
    if (it == peers_.end()) return nullptr;
    auto g = it->second.grants.find(region);
    return g == it->second.grants.end() ? nullptr : &g->second;
  }

  // Records a grant in the peer's domain (DomainOf made it). When the peer has no domain (it
  // was dropped meanwhile) or already holds a grant for `region`, `grant` comes back unused.
  std::optional<Grant> Add(PeerId peer, RegionId region, Grant grant) {
    auto it = peers_.find(peer);
    if (it == peers_.end() || it->second.grants.contains(region)) {
      return std::optional<Grant>(std::move(grant));
    }
    it->second.grants.emplace(region, std::move(grant));
    return std::nullopt;
  }

  // The export of `region` to `peer` was withdrawn.
  std::optional<Grant> Revoke(PeerId peer, RegionId region) {
    auto it = peers_.find(peer);
    if (it == peers_.end()) return std::nullopt;
    auto g = it->second.grants.find(region);
    if (g == it->second.grants.end()) return std::nullopt;
    std::optional<Grant> out(std::move(g->second));
    it->second.grants.erase(g);
    return out;
  }

  // The region is gone: every peer's grant of it.
  std::vector<Grant> RevokeRegion(RegionId region) {
    std::vector<Grant> out;
    for (auto& [peer, entry] : peers_) {
      auto g = entry.grants.find(region);
      if (g == entry.grants.end()) continue;
      out.push_back(std::move(g->second));
      entry.grants.erase(g);
    }
    return out;
  }

  // The peer is gone: its grants and its domain.
  Dropped DropPeer(PeerId peer) {
    Dropped out;
    auto it = peers_.find(peer);
    if (it == peers_.end()) return out;
    out.domain.emplace(std::move(it->second.domain));
    for (auto& [region, grant] : it->second.grants) out.grants.push_back(std::move(grant));
    peers_.erase(it);
    return out;
  }

  std::vector<Dropped> Clear() {
    std::vector<Dropped> out;
    while (!peers_.empty()) out.push_back(DropPeer(peers_.begin()->first));
    return out;
  }

  size_t peers() const { return peers_.size(); }
  size_t grants() const {
    size_t n = 0;
    for (const auto& [peer, entry] : peers_) n += entry.grants.size();
    return n;
  }

 private:
  struct Entry {
    Domain domain;
    std::map<RegionId, Grant> grants;
  };
  std::map<PeerId, Entry> peers_;
};

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_GRANTS_H_

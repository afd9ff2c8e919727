// Engine::Impl, exports: the regions this engine makes accessible to a peer (ExportRegions,
// with each transport's key for that peer) or withdraws (RevokeRegions), and the regions a peer
// exported to this engine.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/core/engine_impl.h"
#include "src/util/log.h"

namespace kvwire {
namespace {

// Regions one peer may export to this engine; a KV cache needs a few hundred at most.
constexpr size_t kMaxRemoteRegionsPerPeer = 1 << 16;

pb::RegionDescriptor Describe(const transport::LocalRegion& region) {
  pb::RegionDescriptor d;
  d.set_id(region.id);
  d.set_length(region.length);
  d.set_access(region.access);
  d.set_memory_kind(static_cast<uint32_t>(region.kind));
  d.set_address(reinterpret_cast<uint64_t>(region.base));
  d.set_reads_need_grant(region.reads_need_grant);
  return d;
}

// Ends the move when the transport is done with the range.
class MoveHold final : public transport::TargetHooks::RangeHold {
 public:
  MoveHold(core::RegionRegistry* regions, uint64_t id) : regions_(regions), id_(id) {}
  ~MoveHold() override { regions_->EndMove(id_); }

 private:
  core::RegionRegistry* const regions_;
  const uint64_t id_;
};

}  // namespace

std::unique_ptr<transport::TargetHooks::RangeHold> Engine::Impl::QuiesceRange(const std::byte* base,
                                                                              uint64_t length,
                                                                              absl::Time deadline) {
  core::RegionRegistry::Move move = regions_.BeginMove(base, length);
  auto hold = std::make_unique<MoveHold>(&regions_, move.id);
  // A pin is a reference to the region's entry: beyond the registry's and move.overlapping's
  // own, each one is an op of this engine (a transfer's, or an incoming op's) still running.
  auto running = [&move] {
    long n = 0;
    for (const auto& entry : move.overlapping) n += std::max(0L, entry.use_count() - 2);
    return n;
  };
  for (long n = running(); n > 0; n = running()) {
    if (absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(200));
      continue;
    }
    // Moving anyway: a peer's kept mapping must lose the memory. What still runs may miss
    // the new pages, so this engine's own transfers on it fail rather than report success.
    std::vector<RegionId> ids;
    for (const auto& entry : move.overlapping) ids.push_back(entry->region.id);
    const std::vector<core::TransferInfo> failed = transfers_.FailIf(
        [&ids](const core::TransferInfo& info) {
          return std::any_of(ids.begin(), ids.end(), [&info](RegionId id) {
            return std::find(info.local_regions.begin(), info.local_regions.end(), id) !=
                   info.local_regions.end();
          });
        },
        [](const core::TransferInfo& info) {
          return absl::AbortedError(absl::StrCat(
              "transfer ", info.id,
              ": its local memory was moved onto a fresh memfd (shm revocation) while the "
              "transfer still ran; its bytes may not have landed"));
        });
    KVW_LOG(kError, "engine") << "moving host memory with ops still running on it"
                              << Kv("engine", name_) << Kv("ops", n)
                              << Kv("transfers_failed", failed.size());
    return hold;
  }
  // use_count() is a relaxed load: a copy of each entry is an acq_rel increment of the same
  // count, read after the load that saw it drained, so the last op's writes (before its pin's
  // release) happen before the move reads the buffer.
  for (const auto& entry : move.overlapping) std::shared_ptr<const core::RegionEntry> sync = entry;
  return hold;
}

absl::Status Engine::Impl::SendExports(Peer& peer,
                                       const std::vector<transport::LocalRegion>& regions) {
  if (regions.empty()) return absl::OkStatus();
  pb::Envelope message;
  // A key that failed: the region goes without it (a transport that reaches every region
  // still reaches it).
  absl::Status keys_ok;
  // Keys may cost a registration per peer (rdma): none for a peer that will never use that
  // transport (it offers none, or the pair forced another).
  const std::string forced = ForcedName(peer.preference);
  std::vector<transport::Transport*> keyed;
  for (const auto& t : transports_) {
    if (!forced.empty() && t->caps().name != forced) continue;
    if (FindEndpoint(peer.hello, t->caps().name) == nullptr) continue;
    keyed.push_back(t.get());
  }
  for (const transport::LocalRegion& r : regions) {
    pb::RegionDescriptor* d = message.mutable_export_regions()->add_regions();
    *d = Describe(r);
    for (transport::Transport* t : keyed) {
      absl::StatusOr<std::string> key = t->ExportKey(peer.id, r.id);
      if (key.ok() && !key->empty()) (*d->mutable_transport_keys())[t->caps().name] = *key;
      if (!key.ok() && keys_ok.ok()) {
        keys_ok =
            absl::Status(key.status().code(),
                         absl::StrCat("exporting region ", r.id, " to peer ", peer.name, " over ",
                                      t->caps().name, ": ", key.status().message()));
      }
    }
  }
  {
    // A key made for a peer that closed meanwhile (after ClosePeer's DropPeer) is dropped again.
    MutexLock lock(&peer.mu);
    if (!peer.alive) {
      for (transport::Transport* t : keyed) t->DropPeer(peer.id);
      return absl::UnavailableError(absl::StrCat("peer ", peer.name, " closed"));
    }
  }
  if (!keys_ok.ok()) {
    KVW_LOG(kWarning, "engine") << "export without a transport key" << Kv("engine", name_)
                                << Kv("error", keys_ok.message());
  }
  absl::Status sent = peer.conn->Send(message);
  return sent.ok() ? keys_ok : sent;
}

absl::Status Engine::Impl::Export(PeerId id, absl::Span<const RegionId> regions) {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  auto exported = regions_.ExportTo(id, std::vector<RegionId>(regions.begin(), regions.end()));
  if (!exported.ok()) return exported.status();
  return SendExports(*peer, *exported);
}

absl::Status Engine::Impl::Unexport(PeerId id, absl::Span<const RegionId> regions) {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  const std::vector<RegionId> ids(regions.begin(), regions.end());
  if (absl::Status s = regions_.UnexportFrom(id, ids); !s.ok()) return s;
  // The keys stop working before we return; the peer learns it on the control channel (a
  // peer that ignores it just gets remote access errors).
  for (const auto& t : transports_) {
    for (RegionId r : ids) t->RevokeExport(id, r);
  }
  pb::Envelope revoke;
  for (RegionId r : ids) revoke.mutable_revoke_regions()->add_ids(r);
  (void)peer->conn->Send(revoke);
  return absl::OkStatus();
}

void Engine::Impl::OnExportRegions(const std::shared_ptr<Peer>& peer,
                                   const pb::ExportRegions& message) {
  for (const pb::RegionDescriptor& d : message.regions()) {
    if (d.memory_kind() > static_cast<uint32_t>(MemoryKind::kGpu)) {
      ClosePeerForProtocol(
          peer, absl::InvalidArgumentError(absl::StrCat(
                    "malformed ExportRegions from peer ", peer->name, ": region ", d.id(),
                    " has memory_kind ", d.memory_kind(), " (known: 0 host, 1 gpu)")));
      return;
    }
  }
  absl::Status too_many;
  {
    MutexLock lock(&peer->mu);
    if (peer->remote.size() + message.regions_size() > kMaxRemoteRegionsPerPeer) {
      too_many = absl::ResourceExhaustedError(absl::StrCat(
          "peer ", peer->name, " exported ", message.regions_size(), " more regions on top of ",
          peer->remote.size(), " (limit ", kMaxRemoteRegionsPerPeer, " per peer)"));
    }
    for (const pb::RegionDescriptor& d : message.regions()) {
      if (!too_many.ok()) break;
      RemoteRegionState state;
      state.desc.id = d.id();
      state.desc.length = d.length();
      state.desc.access = d.access();
      state.desc.kind = static_cast<MemoryKind>(d.memory_kind());
      state.desc.address = d.address();
      state.desc.reads_need_grant = d.reads_need_grant();
      state.transport_keys.insert(d.transport_keys().begin(), d.transport_keys().end());
      peer->remote[d.id()] = state;
    }
  }
  if (!too_many.ok()) {
    ClosePeerForProtocol(peer, too_many);
    return;
  }
  worker_->Post([this, peer] {
    bool ready;
    {
      MutexLock lock(&peer->mu);
      ready = peer->setup_done;
    }
    // Before setup, SetupChannels resolves everything known by then.
    if (ready) ResolveRemoteRegions(peer);
  });
}

void Engine::Impl::OnRevokeRegions(const std::shared_ptr<Peer>& peer,
                                   const pb::RevokeRegions& message) {
  std::vector<RegionId> ids(message.ids().begin(), message.ids().end());
  std::vector<std::shared_ptr<transport::Channel>> channels;
  {
    MutexLock lock(&peer->mu);
    for (RegionId id : ids) peer->remote.erase(id);
    channels = peer->channels;
  }
  for (auto& channel : channels) {
    if (channel) worker_->Post([channel, ids] { channel->RemoveRemoteRegions(ids); });
  }
}

absl::StatusOr<std::vector<RemoteRegion>> Engine::Impl::RemoteRegions(PeerId id) const {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  std::vector<RemoteRegion> out;
  MutexLock lock(&peer->mu);
  for (const auto& [rid, state] : peer->remote) {
    out.push_back(RemoteRegion{rid, state.desc.length, state.desc.access, state.desc.kind});
  }
  return out;
}

// WaitForRemoteRegion: region_events.cc.

}  // namespace kvwire

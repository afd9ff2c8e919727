#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

#include "src/util/log.h"
#include "transport/rdma/rdma_transport_impl.h"

// RdmaTransportImpl: region registration, and exports to peers in their own PDs.

namespace kvwire::transport::rdma {

absl::Status RdmaTransportImpl::RegisterRegion(const LocalRegion& region) {
  auto mr = std::make_shared<LocalMr>();
  mr->id = region.id;
  mr->base = reinterpret_cast<uint64_t>(region.base);
  mr->length = region.length;
  // This engine's own MRs: local access only, so their rkeys reach nothing from any QP.
  // Peers get MRs of their own (ExportKey), with the region's remote access.
  const int access = IBV_ACCESS_LOCAL_WRITE;
  mr->remote_access = IBV_ACCESS_LOCAL_WRITE;  // never remote atomics
  // A grant-guarded region: a one-sided READ is never checked by this host's CPU, so the
  // peers' MRs get no remote-read access at all (its READs go over a transport whose target
  // checks the grant of each op; docs/SECURITY.md, "Read grants").
  if ((region.access & kRemoteRead) && !region.reads_need_grant) {
    mr->remote_access |= IBV_ACCESS_REMOTE_READ;
  }
  if (region.access & kRemoteWrite) mr->remote_access |= IBV_ACCESS_REMOTE_WRITE;
  const absl::Time start = absl::Now();
  std::string gpu_reason;
  if (region.kind == MemoryKind::kGpu) {
    if (absl::Status s = RegisterGpuRegion(region, access, *mr, &gpu_reason); !s.ok()) return s;
  } else {
    for (const auto& d : devices_) {
      Mr m(verbs().reg_mr(d->pd.get(), region.base, region.length, access));
      if (!m) {
        return absl::ResourceExhaustedError(
            absl::StrCat("ibv_reg_mr of region ", region.id, " (", region.length, " bytes) on ",
                         d->Describe(), ": ", std::strerror(errno)));
      }
      mr->mrs.push_back(std::move(m));
    }
    if (!mr->mrs.empty()) mr->pinned = PinnedRange(region.base, region.length);
  }
  KVW_LOG(kDebug, "rdma") << "registered" << Kv("region", region.id) << Kv("bytes", region.length)
                          << Kv("devices", devices_.size())
                          << Kv("us", absl::ToDoubleMicroseconds(absl::Now() - start));
  MutexLock lock(&mrs_mu_);
  if (mr->gpu) {
    ++(mr->peer_memory ? gpu_peermem_regions_ : gpu_dmabuf_regions_);
    gpu_path_reason_ = std::move(gpu_reason);
  }
  mrs_[region.id] = mr;
  return absl::OkStatus();
}

absl::Status RdmaTransportImpl::RegisterGpuRegion(const LocalRegion& region, int access,
                                                  LocalMr& mr, std::string* reason) {
  const auto describe = [&] {
    return absl::StrCat("GPU region ", region.id, " (", region.length, " bytes at 0x",
                        absl::Hex(reinterpret_cast<uint64_t>(region.base)), " of GPU ",
                        region.gpu_device, ")");
  };
  if (options_.gpu_runtime == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(describe(), ": this rdma transport has no GPU runtime"));
  }
  // One export for every device; each registers its own MR on it (one per PD, as for host
  // memory). Its fd stays open while any MR uses it.
  absl::StatusOr<ExportedDmaBuf> dmabuf =
      ExportedDmaBuf::Export(*options_.gpu_runtime, region.gpu_device, region.base, region.length);
  absl::Status exported = dmabuf.status();
  DmaBufMrArgs args;
  if (dmabuf.ok()) {
    absl::StatusOr<DmaBufMrArgs> a = DmaBufArgsFor(dmabuf->range(), region.base, region.length);
    if (a.ok()) {
      args = *a;
      mr.dmabuf_args = args;
    } else {
      exported = a.status();
    }
    mr.dmabuf = std::move(*dmabuf);  // outlives the MRs, on failure too (LocalMr order)
  }
  mr.gpu = true;
  std::vector<std::string> reasons;
  bool any_dmabuf = false;
  for (const auto& d : devices_) {
    Mr m;
    absl::StatusOr<GpuMrChoice> choice = ChooseGpuMr(
        exported,
        [&] {
          m.reset(verbs().reg_dmabuf_mr(d->pd.get(), args.offset, args.length, args.iova, args.fd,
                                        access));
          return m ? absl::OkStatus()
                   : absl::UnavailableError(
                         absl::StrCat("ibv_reg_dmabuf_mr: ", std::strerror(errno)));
        },
        [&] {
          m.reset(verbs().reg_mr(d->pd.get(), region.base, region.length, access));
          return m ? absl::OkStatus()
                   : absl::UnavailableError(
                         absl::StrCat("ibv_reg_mr on the device pointer: ", std::strerror(errno)));
        });
    if (!choice.ok()) {
      KVW_LOG(kInfo, "rdma") << "GPU region not registered" << Kv("region", region.id)
                             << Kv("device", d->Describe()) << Kv("gpu", region.gpu_device)
                             << Kv("error", choice.status().message());
      return absl::Status(choice.status().code(), absl::StrCat(describe(), " on ", d->Describe(),
                                                               ": ", choice.status().message()));
    }
    KVW_LOG(kInfo, "rdma") << "GPU region registered" << Kv("region", region.id)
                           << Kv("device", d->Describe()) << Kv("gpu", region.gpu_device)
                           << Kv("path", GpuMrPathName(choice->path))
                           << Kv("reason", choice->reason);
    any_dmabuf = any_dmabuf || choice->path == GpuMrPath::kDmaBuf;
    mr.path.push_back(choice->path);
    mr.peer_memory = mr.peer_memory || choice->path == GpuMrPath::kPeerMemory;
    reasons.push_back(
        absl::StrCat(d->Describe(), " ", GpuMrPathName(choice->path), ": ", choice->reason));
    mr.mrs.push_back(std::move(m));
  }
  if (!any_dmabuf) mr.dmabuf.Reset();  // no MR uses it
  *reason = absl::StrJoin(reasons, "; ");
  return absl::OkStatus();
}

void RdmaTransportImpl::DeregisterRegion(RegionId id) {
  std::shared_ptr<LocalMr> mr;
  std::vector<std::shared_ptr<PeerMr>> granted;
  {
    MutexLock lock(&mrs_mu_);
    auto it = mrs_.find(id);
    if (it == mrs_.end()) return;
    mr = std::move(it->second);
    mrs_.erase(it);
    if (mr->gpu) --(mr->peer_memory ? gpu_peermem_regions_ : gpu_dmabuf_regions_);
  }
  // After the region left mrs_: an ExportKey racing with us either granted before this (and
  // loses it here) or finds the region gone after its grant (and revokes it itself).
  {
    MutexLock lock(&grants_mu_);
    granted = grants_.RevokeRegion(id);
  }
  // The peers' MRs are deregistered first (their rkeys stop working at once), then ours, then
  // a GPU region's dma-buf fd is closed (LocalMr order).
  granted.clear();
}

absl::StatusOr<PeerDomain> RdmaTransportImpl::DomainOf(PeerId peer) {
  MutexLock lock(&grants_mu_);
  absl::StatusOr<PeerDomain*> domain = grants_.DomainOf(peer, [&]() -> absl::StatusOr<PeerDomain> {
    PeerDomain made;
    for (const auto& d : devices_) {
      auto pd = std::make_shared<PeerPd>();
      pd->dev = d;
      pd->pd.reset(verbs().alloc_pd(d->ctx.get()));
      if (!pd->pd) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "ibv_alloc_pd for peer ", peer, " on ", d->Describe(), ": ", std::strerror(errno)));
      }
      made.push_back(std::move(pd));
    }
    return made;
  });
  if (!domain.ok()) return domain.status();
  return **domain;
}

absl::Status RdmaTransportImpl::RegisterFor(const LocalMr& region, PeerMr& out) {
  std::vector<std::string> keys;
  for (size_t i = 0; i < devices_.size(); ++i) {
    ibv_pd* pd = out.domain[i]->pd.get();
    Mr m;
    if (region.gpu && region.path[i] == GpuMrPath::kDmaBuf) {
      const DmaBufMrArgs& a = region.dmabuf_args;
      m.reset(verbs().reg_dmabuf_mr(pd, a.offset, a.length, a.iova, region.dmabuf.range().fd,
                                    region.remote_access));
    } else {
      m.reset(verbs().reg_mr(pd, reinterpret_cast<void*>(region.base), region.length,
                             region.remote_access));
    }
    if (!m) {
      return absl::ResourceExhaustedError(
          absl::StrCat("ibv_reg_mr of region ", region.id, " (", region.length, " bytes) on ",
                       devices_[i]->Describe(), " for a peer: ", std::strerror(errno)));
    }
    keys.push_back(absl::StrCat(m->rkey));
    out.mrs.push_back(std::move(m));
  }
  out.key = absl::StrJoin(keys, ",");
  return absl::OkStatus();
}

absl::StatusOr<std::string> RdmaTransportImpl::ExportKey(PeerId peer, RegionId id) {
  std::shared_ptr<const LocalMr> region;
  {
    MutexLock lock(&mrs_mu_);
    auto it = mrs_.find(id);
    if (it == mrs_.end()) return std::string();  // not registered with rdma: no key
    region = it->second;
  }
  {
    MutexLock lock(&grants_mu_);
    if (const auto* granted = grants_.Find(peer, id)) return (*granted)->key;
  }
  absl::StatusOr<PeerDomain> domain = DomainOf(peer);
  if (!domain.ok()) return domain.status();
  // Registration pins and maps the region again (a system call per device): outside the lock.
  const absl::Time start = absl::Now();
  auto mr = std::make_shared<PeerMr>();
  mr->region = region;
  mr->domain = std::move(*domain);
  if (absl::Status s = RegisterFor(*region, *mr); !s.ok()) return s;
  std::optional<std::shared_ptr<PeerMr>> unused;
  std::string key;
  {
    MutexLock lock(&grants_mu_);
    unused = grants_.Add(peer, id, mr);
    const auto* granted = grants_.Find(peer, id);
    if (granted != nullptr) key = (*granted)->key;
  }
  if (key.empty()) {
    // The peer was dropped while we registered: nothing is granted.
    return absl::UnavailableError(
        absl::StrCat("region ", id, " not exported to peer ", peer, " over rdma: the peer closed"));
  }
  bool registered;
  {
    MutexLock lock(&mrs_mu_);
    auto it = mrs_.find(id);
    registered = it != mrs_.end() && it->second == region;
  }
  if (!registered) {
    RevokeExport(peer, id);
    return absl::NotFoundError(
        absl::StrCat("region ", id, " deregistered while being exported to peer ", peer));
  }
  // A concurrent export of the same region won: `unused` is deregistered on return.
  KVW_LOG(kDebug, "rdma") << "region exported" << Kv("region", id) << Kv("peer", peer)
                          << Kv("bytes", region->length)
                          << Kv("us", absl::ToDoubleMicroseconds(absl::Now() - start));
  return key;
}

void RdmaTransportImpl::RevokeExport(PeerId peer, RegionId id) {
  std::optional<std::shared_ptr<PeerMr>> revoked;
  {
    MutexLock lock(&grants_mu_);
    revoked = grants_.Revoke(peer, id);
  }
  // Deregistered here: the peer's rkey stops working before we return.
}

absl::StatusOr<uint32_t> RdmaTransportImpl::LocalKey(RegionId region, uint64_t addr,
                                                     uint64_t length, uint32_t device) const {
  MutexLock lock(&mrs_mu_);
  auto it = mrs_.find(region);
  if (it == mrs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("local region ", region, " is not registered with the rdma transport"));
  }
  const LocalMr& mr = *it->second;
  // The engine resolved the range inside the region; a range outside it is a bug, refused.
  if (addr < mr.base || addr - mr.base > mr.length || length > mr.length - (addr - mr.base)) {
    return absl::InternalError(absl::StrCat("local range [0x", absl::Hex(addr), ", +", length,
                                            ") lies outside local region ", region));
  }
  return mr.mrs[device]->lkey;
}

}  // namespace kvwire::transport::rdma

#include "transport/shm/shm_channel.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#include "src/util/crc32c.h"
#include "src/util/fault_injection.h"
#include "src/util/log.h"
#include "transport/shm/cma.h"
#include "transport/shm/errno_text.h"
#include "transport/shm/fd_client.h"
#include "transport/shm/gpu_region_key.h"
#include "transport/shm/host_region_key.h"
#include "transport/shm/seqpacket.h"
#include "transport/shm/shareable_registry.h"
#include "transport/shm/shm_channel_internal.h"

namespace kvwire::transport::shm {
namespace {

// Whether this process may use cross-memory attach on the peer behind `socket`: both sides
// opted in, and the process that listens on the peer's socket (the one that proved the session
// token) has this process's uid and the pid the peer claimed. Without the pid check a peer
// could name another process of the same uid (its endpoint and probe word are public in that
// process's Hello) and have this engine write into it.
absl::Status CheckCma(const ShmChannel::Options& options, const ShmEndpoint& endpoint, pid_t pid,
                      int socket) {
  if (!options.allow_cma) {
    return absl::FailedPreconditionError("disabled by ShmTransportOptions::allow_cma");
  }
  if (!endpoint.cma) {
    return absl::FailedPreconditionError("the peer does not offer it (its allow_cma is off)");
  }
  ucred peer{};
  socklen_t size = sizeof(peer);
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &peer, &size) != 0) {
    return ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno,
                       "SO_PEERCRED of the peer's shm socket");
  }
  if (peer.uid != ::geteuid()) {
    return absl::FailedPreconditionError(absl::StrCat("the peer's shm socket belongs to uid ",
                                                      peer.uid, ", this process runs as uid ",
                                                      ::geteuid()));
  }
  if (peer.pid != pid || endpoint.pid != static_cast<uint32_t>(pid)) {
    return absl::FailedPreconditionError(absl::StrCat("the peer's shm socket belongs to pid ",
                                                      peer.pid, ", but the peer claims pid ", pid,
                                                      " (endpoint pid ", endpoint.pid, ")"));
  }
  return ProbeCma(pid, endpoint.probe_address, endpoint.probe_value);
}

// The peer's epoch table, from its Hello reply: read-only, and sealed so that its size
// cannot change under the mapping.
absl::StatusOr<Mapping> MapEpochTable(int fd) {
  if (fd < 0) return absl::FailedPreconditionError("the Hello reply carried no epoch table");
  const int seals = ::fcntl(fd, F_GET_SEALS);
  struct stat info;
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || ::fstat(fd, &info) != 0 ||
      static_cast<uint64_t>(info.st_size) < kEpochTableBytes) {
    return absl::FailedPreconditionError("the epoch table is not a sealed memfd of its size");
  }
  return Mapping::Create(fd, 0, kEpochTableBytes, PROT_READ, /*populate=*/false);
}

bool SameDesc(const RemoteRegionDesc& a, const RemoteRegionDesc& b) {
  return a.id == b.id && a.length == b.length && a.access == b.access && a.kind == b.kind &&
         a.address == b.address && a.Key() == b.Key();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Connect(const PeerLink& link,
                                                                const ShmEndpoint& endpoint,
                                                                const Options& options) {
  const std::string who = absl::StrCat("shm: peer ", link.peer, " (", link.peer_name, ")");
  // A peer that accepts but never answers must not hold Connect past a bounded wait.
  const absl::Time deadline = std::min(link.deadline, absl::Now() + options.request_timeout);
  absl::StatusOr<UniqueFd> socket = ConnectSeqpacket(endpoint.socket_name, deadline);
  if (!socket.ok()) {
    return absl::Status(socket.status().code(),
                        absl::StrCat(who, ": connecting to @", endpoint.socket_name, ": ",
                                     socket.status().message()));
  }
  FdRequest hello;
  hello.kind = FdRequestKind::kHello;
  hello.token = link.token;
  absl::StatusOr<FdResponse> response = CallFdServer(socket->get(), hello, deadline);
  if (!response.ok()) {
    return absl::Status(response.status().code(),
                        absl::StrCat(who, ": session check: ", response.status().message()));
  }
  if (response->reply.code != absl::StatusCode::kOk) {
    return absl::Status(response->reply.code,
                        absl::StrCat(who, " refused the session: ", response->reply.message));
  }
  const pid_t pid = static_cast<pid_t>(link.remote_pid != 0 ? link.remote_pid : endpoint.pid);
  absl::Status cma = CheckCma(options, endpoint, pid, socket->get());
  Mapping epochs;
  if (absl::StatusOr<Mapping> table = MapEpochTable(response->fd.get()); table.ok()) {
    epochs = *std::move(table);
  } else {
    KVW_LOG(kWarning, "shm") << "peer's epoch table not mapped: its memfd regions go over "
                                "another transport"
                             << Kv("peer", link.peer) << Kv("error", table.status());
  }
  auto channel = std::make_unique<ShmChannel>(PassKey(), link, options, *std::move(socket), pid,
                                              cma, std::move(epochs), endpoint.socket_name);
  KVW_LOG(kInfo, "shm") << "channel connected" << Kv("peer", link.peer)
                        << Kv("peer_name", link.peer_name) << Kv("pid", pid)
                        << Kv("path", channel->Describe());
  return channel;
}

ShmChannel::ShmChannel(PassKey, const PeerLink& link, const Options& options, UniqueFd socket,
                       pid_t pid, absl::Status cma, Mapping epochs, std::string socket_name)
    : link_(link),
      options_(options),
      socket_(std::move(socket)),
      pid_(pid),
      cma_(std::move(cma)),
      epochs_(std::move(epochs)),
      socket_name_(std::move(socket_name)),
      gpu_imports_(options.gpu_runtime == nullptr
                       ? nullptr
                       : std::make_unique<GpuImports>(options.gpu_runtime, options.gpu_counters)),
      copier_(options.gpu_runtime == nullptr
                  ? nullptr
                  : std::make_unique<GpuCopier>(options.gpu_runtime, options.gpu_counters)) {}

ShmChannel::~ShmChannel() { Close(absl::CancelledError("shm channel destroyed")); }

void ShmChannel::Post(PostRequest request, DoneCallback done) {
  GpuWork gpu;
  std::vector<size_t> served;
  std::shared_ptr<ServedLink> link;
  absl::Status status = Execute(request, &gpu, &served, &link);
  if (status.ok() && !served.empty()) {
    if (gpu.batch.empty()) {
      // The peer copies these (served copies). A one-op request still ends before Post
      // returns (Capabilities::ends_host_ops_inline); others end on the completions thread,
      // so that a caller's many requests are in flight together.
      if (request.ops.size() == 1) {
        link->Run(std::move(request), std::move(served), std::move(done));
      } else {
        link->Submit(std::move(request), std::move(served), std::move(done));
      }
      return;
    }
    status = OpError(request, served.front(), absl::StatusCode::kFailedPrecondition,
                     "device copies and served copies in one request");
  }
  if (gpu.batch.empty()) {
    // Unpin the local regions before reporting, so that whoever waits for the transfer to
    // end finds them released, and let go of the cancellation flag, so that the engine can
    // reuse it once the transfer is reported (what destroying the whole request would do).
    request.pins.clear();
    request.cancelled.reset();
    done(std::move(status));
    return;
  }
  // Device copies are queued: the request (its pins) and the peer regions they use stay held
  // until the device has finished them, then the copier reports.
  struct Held {
    PostRequest request;
    std::vector<std::shared_ptr<const RemoteRegion>> regions;
    std::vector<std::shared_ptr<const void>> buffers;
  };
  std::shared_ptr<std::atomic<bool>> cancelled = request.cancelled;
  auto held = std::make_shared<Held>(
      Held{std::move(request), std::move(gpu.regions), std::move(gpu.buffers)});
  copier_->Complete(std::move(gpu.batch), std::move(status), std::move(cancelled), std::move(held),
                    std::move(done));
}

// One process copies, so "end to end" is the copy itself: the CRC32C of the source before
// it and of the destination after it, both computed here (the owner of the other side never
// touches the bytes). It catches what corrupts them between the two reads (a faulty copy, a
// bad page, a mapping that is not what it should be) and a source changed while it was
// copied; docs/CHECKSUMS.md.
absl::Status ShmChannel::Execute(const PostRequest& request, GpuWork* gpu,
                                 std::vector<size_t>* served, std::shared_ptr<ServedLink>* link) {
  const bool write = request.kind == OpKind::kWrite;
  const uint32_t needed = write ? kRemoteWrite : kRemoteRead;
  const std::atomic<bool>* cancelled = request.cancelled.get();
  std::shared_ptr<const RemoteRegion> region;  // reused while consecutive ops share a region
  CmaBatch batch(pid_, request.kind);
  size_t failed_op = 0;
  for (size_t i = 0; i < request.ops.size(); ++i) {
    const WireOp& op = request.ops[i];
    if (closed_.load(std::memory_order_acquire)) {
      const absl::Status reason = ClosedError();
      return OpError(request, i, reason.code(), reason.message());
    }
    if (cancelled != nullptr && cancelled->load(std::memory_order_acquire)) {
      // The transfer already ended: for a READ, local memory must not change any more.
      return OpError(request, i, absl::StatusCode::kCancelled, "transfer cancelled");
    }
    if (region == nullptr || region->id != op.remote_region) {
      region = Find(op.remote_region);
      if (region == nullptr) {
        return OpError(request, i, absl::StatusCode::kNotFound,
                       "region not added to this channel (not exported, or removed)");
      }
    }
    // Defence in depth: the engine validated the op already.
    if ((region->access & needed) == 0) {
      return OpError(request, i, absl::StatusCode::kPermissionDenied,
                     absl::StrCat("region access is ", region->access, ", ", KindName(request.kind),
                                  " needs ", needed));
    }
    if (op.remote_offset > region->length || op.length > region->length - op.remote_offset) {
      return OpError(request, i, absl::StatusCode::kOutOfRange,
                     absl::StrCat("past the end of the region (", region->length, " bytes)"));
    }
    if (op.length == 0) continue;
    if (op.local == nullptr) {
      return OpError(request, i, absl::StatusCode::kInvalidArgument, "null local address");
    }
    if (region->served) {
      if (op.local_gpu_device >= 0) {
        return OpError(request, i, absl::StatusCode::kFailedPrecondition,
                       "local GPU memory and a grant-guarded peer region: the peer's copies "
                       "(served copies) move host memory only");
      }
      if (served->empty()) {
        served->reserve(request.ops.size() - i);
        // Every served region of this channel has the one link (ServedLinkFor): taken once,
        // not a reference count changed per op.
        *link = region->link;
      }
      served->push_back(i);
      continue;
    }
    if (op.local_gpu_device >= 0 || region->gpu != nullptr) {
      if (copier_ == nullptr) {
        return OpError(request, i, absl::StatusCode::kFailedPrecondition,
                       "GPU memory, and this shm channel has no GPU runtime");
      }
      const int device = op.local_gpu_device >= 0 ? op.local_gpu_device : region->gpu->device();
      if (region->gpu == nullptr && !region->mapped) {
        if (absl::Status staged = StageThroughHost(request, i, *region, device, gpu);
            !staged.ok()) {
          return staged;
        }
        continue;
      }
      if (region->mapped && LoadEpoch(region->epoch_word) != region->epoch) {
        // Checked when queued only: a move while the device copies is not seen (SECURITY-shm.md).
        absl::StatusOr<std::shared_ptr<const RemoteRegion>> moved = Remap(region);
        if (!moved.ok())
          return OpError(request, i, moved.status().code(), moved.status().message());
        region = *std::move(moved);
      }
      std::byte* remote = region->gpu != nullptr ? region->gpu_base + op.remote_offset
                                                 : region->mapping.data() + op.remote_offset;
      if (gpu->regions.empty() || gpu->regions.back() != region) gpu->regions.push_back(region);
      absl::Status copied = write ? copier_->Copy(&gpu->batch, device, remote, op.local, op.length)
                                  : copier_->Copy(&gpu->batch, device, op.local, remote, op.length);
      if (!copied.ok()) return OpError(request, i, copied.code(), copied.message());
      continue;
    }
    if (region->mapped) {
      if (absl::Status copied = CopyMapped(request, i, &region); !copied.ok()) return copied;
      continue;
    }
    batch.Add(i, op.local, region->address + op.remote_offset, op.length);
    if (batch.full()) {
      if (absl::Status moved = batch.Flush(&failed_op); !moved.ok()) {
        return OpError(request, failed_op, moved.code(), moved.message());
      }
    }
  }
  if (!batch.empty()) {
    if (cancelled != nullptr && cancelled->load(std::memory_order_acquire)) {
      return OpError(request, request.ops.size() - 1, absl::StatusCode::kCancelled,
                     "transfer cancelled");
    }
    if (absl::Status moved = batch.Flush(&failed_op); !moved.ok()) {
      return OpError(request, failed_op, moved.code(), moved.message());
    }
  }
  return absl::OkStatus();
}

absl::Status ShmChannel::StageThroughHost(const PostRequest& request, size_t index,
                                          const RemoteRegion& region, int device, GpuWork* gpu) {
  const WireOp& op = request.ops[index];
  auto buffer = std::make_shared<std::vector<std::byte>>(op.length);
  CmaBatch cma(pid_, request.kind);
  size_t failed_op = 0;
  cma.Add(index, buffer->data(), region.address + op.remote_offset, op.length);
  if (request.kind == OpKind::kWrite) {
    // The device's bytes must be in the buffer before the peer's memory is written.
    if (absl::Status copied =
            copier_->CopyAndWait(&gpu->batch, device, buffer->data(), op.local, op.length);
        !copied.ok()) {
      return OpError(request, index, copied.code(), copied.message());
    }
    if (absl::Status moved = cma.Flush(&failed_op); !moved.ok()) {
      return OpError(request, failed_op, moved.code(), moved.message());
    }
    return absl::OkStatus();
  }
  if (absl::Status moved = cma.Flush(&failed_op); !moved.ok()) {
    return OpError(request, failed_op, moved.code(), moved.message());
  }
  absl::Status copied = copier_->Copy(&gpu->batch, device, op.local, buffer->data(), op.length);
  // Queued or not, the buffer lives until the request's copies have ended.
  gpu->buffers.push_back(std::move(buffer));
  if (!copied.ok()) return OpError(request, index, copied.code(), copied.message());
  return absl::OkStatus();
}

bool ShmChannel::MovesDeviceMemory(RegionId region) const {
  // Served copies move host memory only: the engine routes a transfer with local device
  // memory to such a region over another transport.
  std::shared_ptr<const RemoteRegion> found = Find(region);
  return found == nullptr || !found->served;
}

std::shared_ptr<const ShmChannel::RemoteRegion> ShmChannel::Find(RegionId id) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

absl::Status ShmChannel::ClosedError() const {
  MutexLock lock(&mu_);
  return absl::Status(close_reason_.code(),
                      absl::StrCat("shm channel to peer ", link_.peer, " (", link_.peer_name,
                                   ") closed: ", close_reason_.message()));
}

absl::Status ShmChannel::AddRemoteRegions(const std::vector<RemoteRegionDesc>& regions) {
  std::vector<std::string> failures;
  absl::StatusCode first_code = absl::StatusCode::kOk;
  for (const RemoteRegionDesc& desc : regions) {
    if (closed_.load(std::memory_order_acquire)) return ClosedError();
    std::shared_ptr<const RemoteRegion> known = Find(desc.id);
    if (known != nullptr && SameDesc(known->desc, desc)) continue;  // mapped once per region
    absl::StatusOr<std::shared_ptr<const RemoteRegion>> added = AddOne(desc);
    if (!added.ok()) {
      if (first_code == absl::StatusCode::kOk) first_code = added.status().code();
      failures.emplace_back(added.status().message());
      continue;
    }
    bool inserted = false;
    {
      std::shared_ptr<const RemoteRegion> replaced;  // unmapped outside the lock
      MutexLock lock(&mu_);
      // Close may have run meanwhile: a region added now would never be unmapped by it.
      if (!closed_.load(std::memory_order_relaxed)) {
        replaced = std::exchange(regions_[desc.id], *std::move(added));
        inserted = true;
      }
    }
    if (!inserted) return ClosedError();
  }
  if (failures.empty()) return absl::OkStatus();
  if (failures.size() == 1) return absl::Status(first_code, failures[0]);
  return absl::Status(first_code,
                      absl::StrCat(failures.size(), " of ", regions.size(),
                                   " regions not added: ", absl::StrJoin(failures, "; ")));
}

absl::StatusOr<std::shared_ptr<const ShmChannel::RemoteRegion>> ShmChannel::AddOne(
    const RemoteRegionDesc& desc) {
  const std::string who =
      absl::StrCat("shm: region ", desc.id, " of peer ", link_.peer, " (", link_.peer_name, ")");
  if (desc.kind == MemoryKind::kGpu) return MapGpu(desc);
  if (desc.kind != MemoryKind::kHost) {
    return absl::UnimplementedError(absl::StrCat(who, " is of an unknown memory kind"));
  }
  absl::StatusOr<bool> shareable = ParseHostRegionKey(desc.Key());
  if (!shareable.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", shareable.status().message()));
  }
  if (desc.reads_need_grant) {
    // Never mapped (the peer's fd server refuses its memfd): the peer copies each op itself,
    // checking its grant (served copies), or the region goes over another transport.
    return ServedRegion(desc, desc.access, absl::StrCat(who, " is grant-guarded (never mapped)"));
  }
  if (*shareable) return MapShareable(desc);
  if (!cma_.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, " is not memfd-backed and cross-memory attach is refused: ", cma_.message()));
  }
  if (desc.length > 0 && (desc.address == 0 || desc.address > UINT64_MAX - desc.length)) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": invalid address 0x", absl::Hex(desc.address), " for ", desc.length, " bytes"));
  }
  auto region = std::make_shared<RemoteRegion>();
  region->id = desc.id;
  region->length = desc.length;
  region->access = desc.access;
  region->address = desc.address;
  region->desc = desc;
  return region;
}

absl::StatusOr<std::shared_ptr<ServedLink>> ShmChannel::ServedLinkFor() {
  MutexLock lock(&link_mu_);
  if (served_link_ != nullptr) return served_link_;
  if (!served_error_.ok()) return served_error_;
  absl::Status error;
  if (!options_.served_completions) {
    error = absl::FailedPreconditionError("this shm transport serves none");
  } else if (absl::StatusOr<std::shared_ptr<ServedCompletions>> completions =
                 options_.served_completions();
             !completions.ok()) {
    error = completions.status();
  } else if (absl::StatusOr<std::shared_ptr<ServedLink>> opened = ServedLink::Open(
                 socket_name_, link_.token, options_.request_timeout, options_.populate_mappings,
                 absl::Now() + options_.request_timeout, options_.served_counters);
             !opened.ok()) {
    error = opened.status();
  } else if (absl::Status added = (*completions)->Add(*opened); !added.ok()) {
    error = added;
  } else {
    // Close may have run meanwhile: a link made now would never be failed by it.
    if (closed_.load(std::memory_order_acquire)) {
      (*completions)->Remove(opened->get());
      return ClosedError();
    }
    served_link_ = *opened;
    completions_ = *completions;
    return served_link_;
  }
  // Kept for good, except a full house at the owner (its process bound on stagings): the next
  // op asks again.
  if (!absl::IsResourceExhausted(error)) served_error_ = error;
  return error;
}

absl::StatusOr<std::shared_ptr<const ShmChannel::RemoteRegion>> ShmChannel::ServedRegion(
    const RemoteRegionDesc& desc, uint32_t access, const std::string& why) {
  if (link_.verify_checksums) {
    // Nothing checks a served copy end to end (docs/CHECKSUMS.md); tcp does.
    return absl::FailedPreconditionError(
        absl::StrCat(why, ", and served copies are not checked end to end (checksums are on)"));
  }
  absl::StatusOr<std::shared_ptr<ServedLink>> link = ServedLinkFor();
  if (!link.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(why, ", and served copies are unavailable: ", link.status().message()));
  }
  auto region = std::make_shared<RemoteRegion>();
  region->id = desc.id;
  region->length = desc.length;
  region->access = access;
  region->served = true;
  region->link = *std::move(link);
  region->desc = desc;
  return region;
}

absl::StatusOr<std::shared_ptr<const ShmChannel::RemoteRegion>> ShmChannel::MapShareable(
    const RemoteRegionDesc& desc) {
  const std::string who =
      absl::StrCat("shm: region ", desc.id, " of peer ", link_.peer, " (", link_.peer_name, ")");
  FdResponse response;
  {
    MutexLock lock(&rpc_mu_);
    if (!rpc_broken_.ok()) {
      return absl::UnavailableError(
          absl::StrCat(who, ": the peer's shm socket failed earlier: ", rpc_broken_.message()));
    }
    FdRequest fetch;
    fetch.kind = FdRequestKind::kFetch;
    fetch.region = desc.id;
    fetch.token = link_.token;
    absl::StatusOr<FdResponse> called =
        CallFdServer(socket_.get(), fetch, absl::Now() + options_.request_timeout);
    if (!called.ok()) {
      rpc_broken_ = called.status();
      ::shutdown(socket_.get(), SHUT_RDWR);
      return absl::Status(called.status().code(),
                          absl::StrCat(who, ": fetching its memfd: ", called.status().message()));
    }
    response = *std::move(called);
  }
  const FdReply& reply = response.reply;
  if (reply.code != absl::StatusCode::kOk) {
    return absl::Status(reply.code, absl::StrCat(who, ": the peer refused: ", reply.message));
  }
  if ((reply.flags & kFetchServedCopies) != 0) {
    if (reply.length != desc.length) {
      return absl::FailedPreconditionError(
          absl::StrCat(who, ": described as ", desc.length, " bytes but served as ", reply.length));
    }
    // Its pages are pinned by a device of the peer (rdma), so it never maps them out: a
    // mapping could not be revoked (SECURITY-shm.md).
    return ServedRegion(desc, desc.access & reply.access,
                        absl::StrCat(who, " is pinned by a device of its owner (never mapped)"));
  }
  if (epochs_.data() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": the peer's epoch table is not mapped (see the channel's log)"));
  }
  if (reply.epoch_slot >= kEpochSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": epoch slot ", reply.epoch_slot, " out of range"));
  }
  if (!response.fd.valid()) {
    return absl::InternalError(absl::StrCat(who, ": reply carried no descriptor"));
  }
  if (reply.length != desc.length) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": described as ", desc.length, " bytes but served as ", reply.length));
  }
  // Mapping a file that can shrink would let the peer SIGBUS this process.
  const int seals = ::fcntl(response.fd.get(), F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": the peer's memfd is not sealed against shrinking"));
  }
  struct stat info;
  if (::fstat(response.fd.get(), &info) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, errno, absl::StrCat(who, ": fstat"));
  }
  const uint64_t file_size = static_cast<uint64_t>(info.st_size);
  if (reply.memfd_offset > file_size || reply.length > file_size - reply.memfd_offset) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": offset ", reply.memfd_offset, " + length ", reply.length,
                     " exceeds the memfd (", file_size, " bytes)"));
  }
  auto region = std::make_shared<RemoteRegion>();
  region->id = desc.id;
  region->length = desc.length;
  // What both the description and the target's reply allow.
  region->access = desc.access & reply.access;
  region->mapped = true;
  region->desc = desc;
  region->epoch_word = reinterpret_cast<const uint64_t*>(epochs_.data()) + reply.epoch_slot;
  region->epoch = reply.epoch;
  if (desc.length > 0) {
    const int prot = PROT_READ | ((region->access & kRemoteWrite) != 0 ? PROT_WRITE : 0);
    absl::StatusOr<Mapping> mapping = Mapping::Create(
        response.fd.get(), reply.memfd_offset, reply.length, prot, options_.populate_mappings);
    if (!mapping.ok()) {
      return absl::Status(mapping.status().code(),
                          absl::StrCat(who, ": ", mapping.status().message()));
    }
    region->mapping = *std::move(mapping);
  }
  KVW_LOG(kDebug, "shm") << "mapped peer region" << Kv("peer", link_.peer) << Kv("region", desc.id)
                         << Kv("length", desc.length) << Kv("access", region->access);
  return region;
}

absl::StatusOr<std::shared_ptr<const ShmChannel::RemoteRegion>> ShmChannel::MapGpu(
    const RemoteRegionDesc& desc) {
  const std::string who = absl::StrCat("shm: GPU region ", desc.id, " of peer ", link_.peer, " (",
                                       link_.peer_name, ")");
  if (gpu_imports_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": this engine has no GPU runtime for the shm transport"));
  }
  if (desc.key_length == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": the peer sent no shm key for it (its shm transport exports no GPU memory)"));
  }
  absl::StatusOr<GpuRegionKey> key = ParseGpuRegionKey(desc.Key());
  if (!key.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", key.status().message()));
  }
  if (key->length != desc.length) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": its key says ", key->length,
                                                   " B, its description ", desc.length, " B"));
  }
  if (key->backend != options_.gpu_runtime->backend()) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": exported by a ", GpuBackendWord(key->backend), " runtime, this engine's is ",
        GpuBackendWord(options_.gpu_runtime->backend())));
  }
  absl::StatusOr<std::shared_ptr<const GpuPeerAllocation>> allocation =
      gpu_imports_->Open(*key, desc.address);
  if (!allocation.ok()) {
    return absl::Status(allocation.status().code(),
                        absl::StrCat(who, ": ", allocation.status().message()));
  }
  auto region = std::make_shared<RemoteRegion>();
  region->id = desc.id;
  region->length = desc.length;
  region->access = desc.access;
  region->gpu = *std::move(allocation);
  region->gpu_base = region->gpu->base() + key->offset;
  region->desc = desc;
  KVW_LOG(kDebug, "shm") << "mapped peer GPU region" << Kv("peer", link_.peer)
                         << Kv("region", desc.id) << Kv("length", desc.length)
                         << Kv("device", region->gpu->device());
  return region;
}

void ShmChannel::RemoveRemoteRegions(const std::vector<RegionId>& ids) {
  std::vector<std::shared_ptr<const RemoteRegion>> removed;  // unmapped outside the lock
  removed.reserve(ids.size());
  MutexLock lock(&mu_);
  for (RegionId id : ids) {
    auto it = regions_.find(id);
    if (it == regions_.end()) continue;
    removed.push_back(std::move(it->second));
    regions_.erase(it);
  }
}

void ShmChannel::Close(const absl::Status& reason) {
  absl::flat_hash_map<RegionId, std::shared_ptr<const RemoteRegion>> removed;
  {
    MutexLock lock(&mu_);
    if (closed_.load(std::memory_order_relaxed)) return;
    close_reason_ = reason.ok() ? absl::CancelledError("closed") : reason;
    closed_.store(true, std::memory_order_release);
    removed.swap(regions_);
  }
  if (copier_ != nullptr) {
    // Requests whose device copies are queued are reported now (with the close reason), not
    // after Close returned: the caller may be tearing the engine down.
    copier_->Fail(reason.ok() ? absl::CancelledError("closed") : reason);
    copier_->Drain(absl::Seconds(60));
  }
  // Wakes a request waiting for a reply; the descriptor itself stays open until destruction,
  // so no other thread can see its number reused.
  ::shutdown(socket_.get(), SHUT_RDWR);
  std::shared_ptr<ServedLink> served_link;
  std::shared_ptr<ServedCompletions> completions;
  {
    MutexLock lock(&link_mu_);
    served_link = served_link_;
    completions = completions_;
  }
  if (served_link != nullptr) {
    // Its requests end now, with the close reason; the completions thread lets go of it.
    served_link->Fail(reason.ok() ? absl::CancelledError("closed") : reason);
    completions->Remove(served_link.get());
  }
  KVW_LOG(kInfo, "shm") << "channel closed" << Kv("peer", link_.peer)
                        << Kv("peer_name", link_.peer_name) << Kv("reason", reason);
}

std::string ShmChannel::Describe() const {
  const char* gpu = copier_ != nullptr ? "+gpu-ipc" : "";
  const char* crc = link_.verify_checksums ? " +crc32c" : "";
  bool serving;  // a served link was opened (Close keeps it, failed)
  {
    MutexLock lock(&link_mu_);
    serving = served_link_ != nullptr;
  }
  const char* served = serving ? "+served" : "";
  if (cma_.ok()) return absl::StrCat("shm memfd+cma", served, gpu, crc);
  return absl::StrCat("shm memfd", served, gpu, crc, " (cma refused: ", cma_.message(), ")");
}

}  // namespace kvwire::transport::shm

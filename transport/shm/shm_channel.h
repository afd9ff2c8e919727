// ShmChannel: the initiator's link to one peer on this host. Memfd-backed regions of the peer
// are mapped once (AddRemoteRegions) and each op is one memcpy in the caller's thread; the
// peer's grant-guarded regions, never mapped, are copied by the peer itself (served copies,
// served_copy.h) while the caller waits; other host regions move with cross-memory attach
// when the kernel permits it. GPU regions of the
// peer are opened from their allocation's IPC handle (once per allocation, gpu_imports.h), and
// every op whose local or remote side is device memory is a runtime copy on the channel's
// device streams, reported when the device has finished it (gpu_copier.h).
#ifndef KVWIRE_TRANSPORT_SHM_SHM_CHANNEL_H_
#define KVWIRE_TRANSPORT_SHM_SHM_CHANNEL_H_

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/gpu/runtime.h"
#include "src/util/mutex.h"
#include "transport/shm/gpu_copier.h"
#include "transport/shm/gpu_imports.h"
#include "transport/shm/mapping.h"
#include "transport/shm/served_completions.h"
#include "transport/shm/served_link.h"
#include "transport/shm/shm_endpoint.h"
#include "transport/shm/unique_fd.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

class ShmChannel final : public Channel {
 public:
  struct Options {
    bool allow_cma = false;  // ShmTransportOptions::allow_cma
    bool populate_mappings = true;
    absl::Duration request_timeout = absl::Seconds(10);
    // Null: the peer's GPU regions are refused (they go over another transport).
    gpu::Runtime* gpu_runtime = nullptr;
    std::shared_ptr<ShmGpuCounters> gpu_counters;  // not null when gpu_runtime is set
    // The transport's served-copy thread (started on first use); null: no served copies, the
    // peer's grant-guarded regions go over another transport.
    std::function<absl::StatusOr<std::shared_ptr<ServedCompletions>>()> served_completions;
    std::shared_ptr<ServedCopyCounters> served_counters;  // the transport's; may be null
  };

  // Connects to the peer's socket and proves the session token (within link.deadline), then
  // probes cross-memory attach once.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Connect(const PeerLink& link,
                                                             const ShmEndpoint& endpoint,
                                                             const Options& options);

  // For Connect only (std::make_unique needs a public constructor).
  class PassKey {
    friend class ShmChannel;
    PassKey() = default;
  };
  ShmChannel(PassKey, const PeerLink& link, const Options& options, UniqueFd socket, pid_t pid,
             absl::Status cma, Mapping epochs, std::string socket_name);
  ~ShmChannel() override;

  void Post(PostRequest request, DoneCallback done) override;
  // Regions that can be added are added even when others cannot; the error then names each
  // region that was not (e.g. FailedPrecondition for a non-memfd region without CMA), so the
  // engine can route those over another transport.
  absl::Status AddRemoteRegions(const std::vector<RemoteRegionDesc>& regions) override;
  void RemoveRemoteRegions(const std::vector<RegionId>& ids) override;
  bool MovesDeviceMemory(RegionId region) const override;
  void Close(const absl::Status& reason) override;
  std::string Describe() const override;

 private:
  struct RemoteRegion {
    RegionId id = 0;
    uint64_t length = 0;
    uint32_t access = kAccessNone;
    bool mapped = false;  // memfd-backed: copies go through `mapping`
    // Grant-guarded host memory: the peer copies each op (served copies, through `link`).
    bool served = false;
    std::shared_ptr<ServedLink> link;
    Mapping mapping;  // empty for a 0-byte region
    // Mapped: the peer's epoch word for the buffer, and its value for `mapping`'s memfd (the
    // peer moved the buffer when they differ: shareable_registry.h).
    const uint64_t* epoch_word = nullptr;
    uint64_t epoch = 0;
    uint64_t address = 0;  // CMA: base address in the peer
    // kGpu: the peer's allocation, mapped; the region starts at gpu_base.
    std::shared_ptr<const GpuPeerAllocation> gpu;
    std::byte* gpu_base = nullptr;
    RemoteRegionDesc desc;  // as described, to recognise a repeated AddRemoteRegions
  };
  // The device copies of one request, and the peer regions they use (kept mapped until the
  // copies have ended).
  struct GpuWork {
    GpuCopier::Batch batch;
    std::vector<std::shared_ptr<const RemoteRegion>> regions;
    // Host buffers that queued copies read (staged READs from cross-memory-attach regions).
    std::vector<std::shared_ptr<const void>> buffers;
  };

  // Moves every op it can now; the indices of ops on served regions go to `served`, for the
  // peer to copy through `link`.
  absl::Status Execute(const PostRequest& request, GpuWork* gpu, std::vector<size_t>* served,
                       std::shared_ptr<ServedLink>* link);
  // Op `index` of `request` between this process's memory and a mapping of the peer's, with
  // the end-to-end check when the link asks for it (DataLoss on a mismatch).
  absl::Status CopyChecked(const PostRequest& request, size_t index, std::byte* dst,
                           const std::byte* src);
  // Local device memory and a peer host region reached by cross-memory attach (which cannot
  // touch device memory): staged through a host buffer of this process.
  absl::Status StageThroughHost(const PostRequest& request, size_t index,
                                const RemoteRegion& region, int device, GpuWork* gpu);
  // The served-copy link to the peer (served_link.h), opened at the first grant-guarded
  // region; an error says why such regions go over another transport.
  absl::StatusOr<std::shared_ptr<ServedLink>> ServedLinkFor();
  absl::StatusOr<std::shared_ptr<const RemoteRegion>> AddOne(const RemoteRegionDesc& desc);
  absl::StatusOr<std::shared_ptr<const RemoteRegion>> MapShareable(const RemoteRegionDesc& desc);
  // A region the peer never maps out (grant-guarded, or pinned by its device), reached by
  // served copies with `access`; `why` starts the error when it cannot be.
  absl::StatusOr<std::shared_ptr<const RemoteRegion>> ServedRegion(const RemoteRegionDesc& desc,
                                                                   uint32_t access,
                                                                   const std::string& why);
  // The peer moved the buffer behind `stale` (its epoch word changed): maps the memfd it
  // serves now and puts it in place of `stale` (unless something newer is there already).
  absl::StatusOr<std::shared_ptr<const RemoteRegion>> Remap(
      const std::shared_ptr<const RemoteRegion>& stale);
  // One memcpy between local memory and a mapped region, redone on the new memfd when the
  // peer moves the buffer meanwhile; `region` is updated to the mapping used.
  absl::Status CopyMapped(const PostRequest& request, size_t index,
                          std::shared_ptr<const RemoteRegion>* region);
  absl::StatusOr<std::shared_ptr<const RemoteRegion>> MapGpu(const RemoteRegionDesc& desc);
  std::shared_ptr<const RemoteRegion> Find(RegionId id) const;
  absl::Status ClosedError() const;

  const PeerLink link_;
  const Options options_;
  const UniqueFd socket_;  // shut down by Close, closed by the destructor
  const pid_t pid_;
  const absl::Status cma_;  // OK when cross-memory attach works, else why not
  // The peer's epoch table (read-only); empty if its Hello reply carried none, and then no
  // region is mapped.
  const Mapping epochs_;

  // Set once by Close; Post checks it without the lock.
  std::atomic<bool> closed_{false};
  mutable Mutex mu_;
  absl::Status close_reason_ ABSL_GUARDED_BY(mu_);
  // Held by Post while copying, so RemoveRemoteRegions or Close never unmaps under a copy: the
  // mapping goes when the last holder lets go.
  absl::flat_hash_map<RegionId, std::shared_ptr<const RemoteRegion>> regions_ ABSL_GUARDED_BY(mu_);

  // Serialises requests on `socket_`: one reply outstanding at a time.
  Mutex rpc_mu_;
  // A request failed below the protocol (timeout, peer gone): a late reply could answer the
  // next request, so the socket is not used again.
  absl::Status rpc_broken_ ABSL_GUARDED_BY(rpc_mu_);

  const std::string socket_name_;  // the peer's fd server (a served-copy link connects too)
  mutable Mutex link_mu_;
  std::shared_ptr<ServedLink> served_link_ ABSL_GUARDED_BY(link_mu_);
  // Set when opening it failed: why the peer's grant-guarded regions go over another transport.
  absl::Status served_error_ ABSL_GUARDED_BY(link_mu_);
  std::shared_ptr<ServedCompletions> completions_ ABSL_GUARDED_BY(link_mu_);

  // Set when options_.gpu_runtime is. The copier is destroyed first: it waits for the copies
  // in flight and reports their requests.
  const std::unique_ptr<GpuImports> gpu_imports_;
  const std::unique_ptr<GpuCopier> copier_;
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_SHM_CHANNEL_H_

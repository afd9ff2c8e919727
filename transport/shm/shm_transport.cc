// ShmTransport: the shm Transport. The target side serves region memfds (FdServer) and exports
// GPU regions' IPC handles in their region keys (GpuExportTable); each Connect opens a
// ShmChannel that maps them and copies in the caller's thread (host memory) or on device
// streams (GPU memory).
#include "transport/shm/shm_transport.h"

#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "src/util/mutex.h"
#include "transport/shm/errno_text.h"
#include "transport/shm/fd_server.h"
#include "transport/shm/gpu_exports.h"
#include "transport/shm/gpu_imports.h"
#include "transport/shm/host_region_key.h"
#include "transport/shm/local_regions.h"
#include "transport/shm/seqpacket.h"
#include "transport/shm/served_completions.h"
#include "transport/shm/served_copy.h"
#include "transport/shm/shareable_registry.h"
#include "transport/shm/shm_channel.h"
#include "transport/shm/shm_endpoint.h"
#include "transport/shm/write_guard.h"

namespace kvwire::transport {
namespace {

using shm::ShmEndpoint;

// "kvwire-shm.<engine>.<pid>.<random>": readable in `ss -x`, unique even when two engines
// share a name (or a pid, across pid namespaces).
std::string SocketName(const std::string& engine_name, uint64_t random) {
  std::string name;
  for (char c : engine_name.substr(0, 48)) {
    name.push_back(
        absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ? c : '_');
  }
  return absl::StrCat("kvwire-shm.", name, ".", ::getpid(), ".", absl::Hex(random));
}

class ShmTransport final : public Transport {
 public:
  ShmTransport(const ShmTransportOptions& options, std::string host_id, uint64_t probe_value)
      : options_(options),
        host_id_(std::move(host_id)),
        probe_word_(probe_value),
        gpu_(options.gpu_runtime != nullptr && options.gpu_runtime->backend() != gpu::Backend::kNone
                 ? options.gpu_runtime
                 : nullptr),
        gpu_exports_(gpu_),
        revoke_on_peer_close_(options.revoke_on_peer_close && GuardForPeerCloses()) {
    caps_.name = "shm";
    caps_.one_sided_read = true;
    caps_.one_sided_write = true;
    caps_.same_host_only = true;
    caps_.rank = 10;  // one memcpy (or one device copy) per op
    // A WRITE is visible in the target's memory when the initiator's copy returns.
    caps_.counts_arrivals = false;
    // A grant-guarded region is never mapped: the target copies its ops itself after checking
    // each one's grant (served copies, served_copy.h), or the region goes over tcp.
    caps_.checks_grants = true;
    caps_.max_op_bytes = options.max_op_bytes;
    caps_.max_lanes = 1;
    // Device memory moves with runtime copies between IPC-mapped allocations (one host).
    caps_.gpu_memory = gpu_ != nullptr;
    // Host ops are copied in the caller's thread (ShmChannel::Post reports before it
    // returns); only device copies end later, on the copier's thread.
    caps_.ends_host_ops_inline = true;
  }
  ~ShmTransport() override { Shutdown(); }

  absl::Status Start(TargetHooks* hooks, uint64_t socket_random) {
    hooks_ = hooks;
    const std::string socket_name = SocketName(options_.engine_name, socket_random);
    absl::StatusOr<std::unique_ptr<shm::FdServer>> server =
        shm::FdServer::Start(socket_name, hooks, &regions_,
                             {.max_connections = options_.max_connections,
                              .max_unauthenticated_per_uid = options_.max_unauthenticated_per_uid,
                              .auth_timeout = options_.auth_timeout,
                              .max_stagings_per_process = options_.max_stagings_per_process},
                             served_counters_);
    if (!server.ok()) {
      return absl::Status(server.status().code(),
                          absl::StrCat("shm transport: ", server.status().message()));
    }
    server_ = *std::move(server);
    ShmEndpoint endpoint;
    endpoint.host_id = host_id_;
    endpoint.socket_name = socket_name;
    endpoint.pid = static_cast<uint32_t>(::getpid());
    endpoint.probe_address = reinterpret_cast<uintptr_t>(&probe_word_);
    endpoint.probe_value = probe_word_;
    endpoint.cma = options_.allow_cma;
    endpoint_ = shm::EncodeEndpoint(endpoint);
    KVW_LOG(kInfo, "shm") << "transport started" << Kv("socket", socket_name)
                          << Kv("host_id", host_id_) << Kv("cma", options_.allow_cma)
                          << Kv("deny_ptrace", options_.deny_ptrace)
                          << Kv("revoke_on_close", revoke_on_peer_close_)
                          << Kv("write_guard", shm::WriteGuardMode());
    return absl::OkStatus();
  }

  const Capabilities& caps() const override { return caps_; }
  std::string Endpoint() const override { return endpoint_; }

  absl::Status RegisterRegion(const LocalRegion& region) override {
    // A grant-guarded region is never mapped by a peer (a mapping reads it whole): no IPC
    // key for GPU memory, and the fd server asks the engine (ExportedRegion), which refuses
    // it for host memory. Its ops go over a transport whose target checks them.
    if (region.kind == MemoryKind::kGpu && region.reads_need_grant) return absl::OkStatus();
    if (region.kind == MemoryKind::kGpu) {
      absl::Status exported = gpu_exports_.Add(region);
      if (!exported.ok() && gpu_ == nullptr) return exported;  // GPU memory was not offered
      if (!exported.ok()) {
        // Declined, not failed: memory without an IPC handle (stream-ordered pools, VMM
        // allocations) stays registered with the other transports; its empty key makes peers
        // route it over them.
        KVW_LOG(kWarning, "shm") << "GPU region not reachable over shm" << Kv("region", region.id)
                                 << Kv("reason", exported.message());
        return absl::OkStatus();
      }
    }
    // Host memory from a ShareableBuffer: shm alone knows its memfd (peers map it).
    std::optional<ShareableBacking> backing;
    if (region.kind == MemoryKind::kHost) backing = FindShareable(region.base, region.length);
    absl::Status added = regions_.Add(region, backing);
    if (!added.ok() && region.kind == MemoryKind::kGpu) gpu_exports_.Remove(region.id);
    return added;
  }
  void DeregisterRegion(RegionId id) override {
    const std::byte* handed_out = regions_.Remove(id);
    gpu_exports_.Remove(id);
    if (handed_out != nullptr) Revoke(handed_out, absl::StrCat("region ", id, " deregistered"));
  }
  void RevokeExport(PeerId peer, RegionId id) override {
    for (const std::byte* base : regions_.Unserve(peer, id)) {
      Revoke(base, absl::StrCat("region ", id, " unexported from peer ", peer));
    }
  }
  std::string RegionKey(RegionId id) const override {
    std::shared_ptr<const shm::LocalRegionEntry> host = regions_.Find(id);
    if (host != nullptr && host->memfd_backed) return shm::EncodeHostRegionKey(true);
    return gpu_exports_.Key(id);
  }

  void AddStats(std::vector<TransportStat>* stats) const override {
    AddStat(stats, "gpu", "shm_ipc_opens",
            gpu_counters_->ipc_opens.load(std::memory_order_relaxed));
    AddStat(stats, "gpu", "shm_device_copies",
            gpu_counters_->device_copies.load(std::memory_order_relaxed));
    // Served copies (served_copy.h): grant-guarded or pinned regions, never mapped.
    const shm::ServedCopyCounters& c = *served_counters_;
    AddStat(stats, "shm", "served_copy_requests", c.requests.load(std::memory_order_relaxed));
    AddStat(stats, "shm", "served_copy_bytes", c.bytes.load(std::memory_order_relaxed));
    AddStat(stats, "shm", "served_copy_requests_answered",
            c.answered.load(std::memory_order_relaxed));
    AddStat(stats, "shm", "served_copy_bytes_answered",
            c.answered_bytes.load(std::memory_order_relaxed));
    AddStat(stats, "shm", "served_copy_requests_refused",
            c.refused.load(std::memory_order_relaxed));
  }

  absl::Status CanReach(const std::string& remote_endpoint) const override {
    absl::StatusOr<ShmEndpoint> endpoint = shm::ParseEndpoint(remote_endpoint);
    if (!endpoint.ok()) return endpoint.status();
    return SameHost(*endpoint);
  }

  absl::StatusOr<std::unique_ptr<Channel>> Connect(const PeerLink& link) override {
    if (shut_down_.load(std::memory_order_acquire)) {
      return absl::FailedPreconditionError("shm transport is shut down");
    }
    absl::StatusOr<ShmEndpoint> endpoint = shm::ParseEndpoint(link.remote_endpoint);
    if (!endpoint.ok()) return endpoint.status();
    if (absl::Status same = SameHost(*endpoint); !same.ok()) return same;
    shm::ShmChannel::Options options;
    options.allow_cma = options_.allow_cma;
    options.populate_mappings = options_.populate_mappings;
    options.request_timeout = options_.request_timeout;
    options.gpu_runtime = gpu_;
    options.gpu_counters = gpu_counters_;
    options.served_completions = [this] { return ServedCompletions(); };
    options.served_counters = served_counters_;
    absl::StatusOr<std::unique_ptr<shm::ShmChannel>> channel =
        shm::ShmChannel::Connect(link, *endpoint, options);
    if (!channel.ok()) return channel.status();
    return std::unique_ptr<Channel>(*std::move(channel));
  }

  void DropPeer(PeerId peer) override {
    // Refused first, so that no fetch of the peer is served after Unserve.
    if (server_ != nullptr) server_->DropPeer(peer);
    std::vector<const std::byte*> bases = regions_.Unserve(peer, std::nullopt);
    // A peer that never fetched a buffer's memfd has no mapping of it: nothing to move.
    if (bases.empty() || !revoke_on_peer_close_) return;
    // Off this thread (often the I/O thread that noticed the close, whose heartbeats must not
    // wait for a copy of many GiB): the mover thread moves each buffer once.
    MutexLock lock(&move_mu_);
    if (stopping_) return;
    for (const std::byte* base : bases) {
      // One move per buffer, however many of its regions the peer held.
      std::optional<shm::ShareableRange> buffer = shm::FindShareableRange(base);
      if (!buffer.has_value()) continue;
      const bool queued = std::any_of(move_queue_.begin(), move_queue_.end(),
                                      [&](const PendingMove& m) { return m.base == buffer->base; });
      if (!queued) {
        move_queue_.push_back(PendingMove{buffer->base, absl::StrCat("peer ", peer, " dropped"),
                                          shm::MoveGuard::kRequired});
      }
    }
    if (!mover_.joinable()) mover_ = std::thread([this] { MoverLoop(); });
    move_cv_.SignalAll();
  }

  void Stopping() override {
    // The owner's engine is going away: its peers' closes move nothing (docs/SECURITY-shm.md
    // says what that leaves); a move already running finishes.
    MutexLock lock(&move_mu_);
    stopping_ = true;
    if (!move_queue_.empty()) {
      KVW_LOG(kInfo, "shm") << "engine stopping: buffers of closed peers not moved"
                            << Kv("buffers", move_queue_.size());
    }
    move_queue_.clear();
    move_cv_.SignalAll();
  }

  void Shutdown() override {
    if (shut_down_.exchange(true, std::memory_order_acq_rel)) return;
    Stopping();
    if (mover_.joinable()) mover_.join();
    std::shared_ptr<shm::ServedCompletions> completions;
    {
      MutexLock lock(&completions_mu_);
      completions = std::move(completions_);
    }
    if (completions != nullptr) completions->Shutdown();
    if (server_ != nullptr) server_->Shutdown();
    regions_.Clear();
    gpu_exports_.Clear();
  }

 private:
  // The thread that handles every channel's served copies, started at the first.
  absl::StatusOr<std::shared_ptr<shm::ServedCompletions>> ServedCompletions() {
    MutexLock lock(&completions_mu_);
    if (shut_down_.load(std::memory_order_acquire)) {
      return absl::FailedPreconditionError("shm transport is shut down");
    }
    if (completions_ == nullptr) {
      absl::StatusOr<std::shared_ptr<shm::ServedCompletions>> started =
          shm::ServedCompletions::Start();
      if (!started.ok()) return started.status();
      completions_ = *std::move(started);
    }
    return completions_;
  }

  struct PendingMove {
    const std::byte* base = nullptr;
    std::string why;
    shm::MoveGuard guard = shm::MoveGuard::kIfAvailable;
  };

  // Whether a peer's close may move buffers here: only with the application's writes held off
  // during the move (write_guard.h); said once per process when not.
  static bool GuardForPeerCloses() {
    const absl::Status guard = shm::WriteGuardAvailable();
    if (guard.ok()) return true;
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      KVW_LOG(kWarning, "shm") << "revoke_on_close is off: a closed peer keeps its mapping of the "
                                  "buffers it was handed until they are unexported or "
                                  "deregistered, since the application's own writes into a "
                                  "buffer cannot be held off during a move here"
                               << Kv("reason", guard.message());
    }
    return false;
  }

  void MoverLoop() {
    for (;;) {
      PendingMove move;
      {
        MutexLock lock(&move_mu_);
        while (!stopping_ && move_queue_.empty()) {
          move_cv_.WaitUntil(&move_mu_, absl::Now() + absl::Seconds(1));
        }
        if (stopping_) return;
        move = std::move(move_queue_.front());
        move_queue_.pop_front();
      }
      Revoke(move.base, move.why, move.guard);
    }
  }

  // A peer was handed the memfd of the ShareableBuffer at `base` and may keep its mapping:
  // the owner moves onto a fresh memfd (shareable_registry.h). Peers still exported to
  // notice through the epoch table and map the new one.
  void Revoke(const std::byte* base, const std::string& why,
              shm::MoveGuard guard = shm::MoveGuard::kIfAvailable) {
    const absl::Time start = absl::Now();
    // The engine's own ops on the buffer (any transport's, any region inside it) are held
    // off while it moves, so none of their bytes lands in the memfd being given up.
    std::unique_ptr<TargetHooks::RangeHold> hold;
    if (std::optional<shm::ShareableRange> range = shm::FindShareableRange(base)) {
      hold = hooks_->QuiesceRange(range->base, range->size, start + kDrainWait);
    }
    const absl::Status moved = shm::RebackShareable(base, guard);
    hold.reset();
    const absl::Duration took = absl::Now() - start;
    if (moved.ok()) {
      KVW_LOG(kInfo, "shm") << "buffer moved off the memfd peers mapped" << Kv("why", why)
                            << Kv("ms", absl::ToDoubleMilliseconds(took));
    } else if (!absl::IsNotFound(moved)) {
      KVW_LOG(kError, "shm") << "revoking a mapped buffer failed: a peer that kept its mapping "
                                "still reaches it"
                             << Kv("why", why) << Kv("error", moved);
    }
  }

  absl::Status SameHost(const ShmEndpoint& endpoint) const {
    if (endpoint.host_id == host_id_) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("shm: peer host id \"", endpoint.host_id,
                                                      "\" differs from local host id \"", host_id_,
                                                      "\" (another host, container or namespace)"));
  }

  // How long a move waits for the engine's ops already running on the buffer.
  static constexpr absl::Duration kDrainWait = absl::Seconds(5);

  const ShmTransportOptions options_;
  TargetHooks* hooks_ = nullptr;  // set by Start; outlives the transport
  const std::string host_id_;
  // Peers read this word with process_vm_readv to find out whether CMA works (ShmEndpoint).
  const uint64_t probe_word_;
  gpu::Runtime* const gpu_;  // null unless options_.gpu_runtime is a real runtime
  Capabilities caps_;
  std::string endpoint_;  // set by Start, constant afterwards
  shm::LocalRegionTable regions_;
  shm::GpuExportTable gpu_exports_;
  const std::shared_ptr<shm::ShmGpuCounters> gpu_counters_ =
      std::make_shared<shm::ShmGpuCounters>();
  const std::shared_ptr<shm::ServedCopyCounters> served_counters_ =
      std::make_shared<shm::ServedCopyCounters>();
  // options_.revoke_on_peer_close where the write guard works (GuardForPeerCloses).
  const bool revoke_on_peer_close_;
  std::unique_ptr<shm::FdServer> server_;  // set by Start; stopped by Shutdown
  std::atomic<bool> shut_down_{false};
  // Moves after a peer's close, on mover_ (started at the first one).
  Mutex move_mu_;
  CondVar move_cv_;
  std::deque<PendingMove> move_queue_ ABSL_GUARDED_BY(move_mu_);
  bool stopping_ ABSL_GUARDED_BY(move_mu_) = false;
  std::thread mover_;
  Mutex completions_mu_;
  std::shared_ptr<shm::ServedCompletions> completions_ ABSL_GUARDED_BY(completions_mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateShmTransport(const ShmTransportOptions& options,
                                                              TargetHooks* hooks) {
  if (hooks == nullptr) return absl::InvalidArgumentError("shm transport needs TargetHooks");
  if (options.deny_ptrace) {
    if (options.allow_cma) {
      return absl::InvalidArgumentError(
          "shm transport: deny_ptrace and allow_cma together (peers could not attach to a "
          "non-dumpable process)");
    }
    if (::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
      return shm::ErrnoStatus(absl::StatusCode::kInternal, errno,
                              "shm transport: prctl(PR_SET_DUMPABLE, 0)");
    }
  }
  absl::BitGen random;
  // Non-zero, so that a zero-filled word (wrong process, wrong address) never matches.
  const uint64_t probe_value = absl::Uniform<uint64_t>(random, 1, UINT64_MAX);
  auto transport = std::make_unique<ShmTransport>(
      options, options.host_id.empty() ? LocalHostId() : options.host_id, probe_value);
  if (absl::Status started = transport->Start(hooks, absl::Uniform<uint64_t>(random));
      !started.ok()) {
    return started;
  }
  return std::unique_ptr<Transport>(std::move(transport));
}

std::vector<TransportStat> ShmTransportStats() {
  using Kind = TransportStat::Kind;
  return {
      DeclareStat("shm", "gpu", "shm_ipc_opens", Kind::kCounter, "gpu_shm_ipc_opens_total",
                  "Peer GPU allocations opened from IPC handles."),
      DeclareStat("shm", "gpu", "shm_device_copies", Kind::kCounter, "gpu_shm_device_copies_total",
                  "Copies on the shm transport's device streams."),
      DeclareStat("shm", "shm", "served_copy_requests", Kind::kCounter,
                  "shm_served_copy_requests_total",
                  "Served-copy requests sent to peers (their regions that are never mapped)."),
      DeclareStat("shm", "shm", "served_copy_bytes", Kind::kCounter, "shm_served_copy_bytes_total",
                  "Bytes named by the served-copy requests sent to peers."),
      DeclareStat("shm", "shm", "served_copy_requests_answered", Kind::kCounter,
                  "shm_served_copy_requests_answered_total",
                  "Served-copy requests of peers copied by this engine."),
      DeclareStat("shm", "shm", "served_copy_bytes_answered", Kind::kCounter,
                  "shm_served_copy_bytes_answered_total",
                  "Bytes this engine copied for peers' served-copy requests."),
      DeclareStat("shm", "shm", "served_copy_requests_refused", Kind::kCounter,
                  "shm_served_copy_requests_refused_total",
                  "Served-copy requests refused (an op the engine refused: the peer dropped)."),
  };
}

}  // namespace kvwire::transport

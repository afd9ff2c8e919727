#include "kvwire/engine.h"

#include <algorithm>
#include <unistd.h>

#include <openssl/rand.h>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

#include "kvwire/options_check.h"
#include "src/core/engine_impl.h"
#include "src/util/log.h"

namespace kvwire {
namespace {

// Splits "host:port"; the port defaults to 0.
absl::Status SplitHostPort(const std::string& address, std::string* host, uint16_t* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    *host = address;
    *port = 0;
    return absl::OkStatus();
  }
  *host = address.substr(0, colon);
  uint32_t value = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &value) || value > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad port in address \"", address, "\""));
  }
  *port = static_cast<uint16_t>(value);
  return absl::OkStatus();
}

}  // namespace

Engine::Impl::Impl(EngineOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::string> Engine::Impl::NewToken() {
  // A session token is a bearer credential for every region exported to its holder: it must
  // be unguessable, so there is no fallback when the CSPRNG fails.
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    return absl::InternalError(
        "the OpenSSL CSPRNG (RAND_bytes) failed; refusing to make a predictable session token");
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status Engine::Impl::Init() {
  // Also proves the CSPRNG works before anything listens: an engine that could not issue
  // tokens refuses to start.
  absl::StatusOr<std::string> probe = NewToken();
  if (!probe.ok()) {
    return absl::Status(probe.status().code(),
                        absl::StrCat("engine cannot start: ", probe.status().message()));
  }
  name_ = options_.name;
  if (name_.empty()) name_ = absl::StrCat("kvwire-", getpid(), "-", probe->substr(0, 8));
  handshake_.compat_hash = control::CompatibilityHash(options_.compat_salt);
  handshake_.shared_secret = options_.shared_secret;
  handshake_.max_frame_bytes = options_.max_frame_bytes;
  handshake_.timeout = options_.connect_timeout;
  handshake_.own_nonces = std::make_shared<control::OwnNonces>();
  handshake_.issue_token = [this] { return IssueToken(); };
  handshake_.revoke_token = [this](const std::string& token) { RevokeToken(token); };
  handshake_.max_pending_handshakes = options_.max_pending_handshakes;
  handshake_.max_pending_handshakes_per_source = options_.max_pending_handshakes_per_source;
  handshake_.max_connections = options_.max_control_connections;
  handshake_.max_send_queue_bytes = options_.max_control_send_queue_bytes;

  std::string host = "127.0.0.1";
  uint16_t port = 0;
  if (!options_.listen_address.empty()) {
    if (absl::Status s = SplitHostPort(options_.listen_address, &host, &port); !s.ok()) return s;
    if (host.empty()) host = "0.0.0.0";
  }

  transport::TransportContext context;
  context.options = &options_;
  context.engine_name = name_;
  context.listen_host = host;
  context.gpu_runtime = gpu_;
  context.hooks = this;
  std::vector<TransportFactory> factories = transport::BuiltinTransports();
  factories.insert(factories.end(), options_.extra_transports.begin(),
                   options_.extra_transports.end());
  for (const TransportFactory& factory : factories) {
    if (!factory) return absl::InvalidArgumentError("EngineOptions: an empty transport factory");
    absl::StatusOr<std::unique_ptr<transport::Transport>> created = factory(context);
    if (!created.ok()) return created.status();
    if (*created == nullptr) continue;  // cannot run here; the factory said why
    const transport::Capabilities& caps = (*created)->caps();
    for (const transport::Capabilities* other : caps_) {
      if (other->name == caps.name) {
        return absl::InvalidArgumentError(
            absl::StrCat("two transports are named \"", caps.name, "\""));
      }
    }
    if (caps_.size() == core::kMaxTransports) {
      return absl::InvalidArgumentError(
          absl::StrCat("more than ", core::kMaxTransports, " transports"));
    }
    if (caps.reaches_every_region && !caps.gpu_memory) incoming_gpu_ok_ = false;
    caps_.push_back(&caps);
    transports_.push_back(std::move(*created));
  }
  if (transports_.empty()) return absl::FailedPreconditionError("no transport could start");
  rank_order_ = core::RankOrder(caps_);

  work_ =
      std::make_unique<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>>(
          io_.get_executor());
  for (int i = 0; i < options_.io_threads; ++i) {
    io_threads_.emplace_back([this] { io_.run(); });
  }
  worker_ = std::make_unique<TaskRunner>();
  reaper_ = std::thread([this] { ReaperLoop(); });
  completer_ = std::thread([this] { transfers_.RunEndCallbacks(); });

  if (!options_.listen_address.empty()) {
    auto server = control::Listen(
        io_, host, port, handshake_,
        [this](const pb::Hello& remote) { return RespondToHello(remote); },
        [this](control::Accepted accepted) { OnAccepted(std::move(accepted)); });
    if (!server.ok()) return server.status();
    server_ = std::move(*server);
    address_ = absl::StrCat(host == "0.0.0.0" ? "127.0.0.1" : host, ":", server_->port());
    // Without a secret, whoever reaches the control port becomes a peer and reaches every
    // region exported to all peers (docs/SECURITY.md). Loopback (the default) keeps that to
    // this host; anything else is the operator's call, so it is said loudly.
    if (options_.shared_secret.empty() && host != "127.0.0.1" && host != "::1" &&
        host != "localhost") {
      KVW_LOG(kWarning, "engine")
          << "listening beyond loopback without a shared secret: any host that reaches " << host
          << " can connect and access regions exported to all peers; set "
          << "EngineOptions::shared_secret (KVWIRE_SECRET) on any shared network"
          << Kv("engine", name_);
    }
  }
  std::vector<std::string> names;
  for (const transport::Capabilities* caps : caps_) names.push_back(caps->name);
  KVW_LOG(kInfo, "engine") << "started" << Kv("engine", name_) << Kv("address", address_)
                           << Kv("transports", absl::StrJoin(names, ","));
  return absl::OkStatus();
}

Engine::Impl::~Impl() {
  stopping_ = true;
  for (auto& t : transports_) t->Stopping();
  if (server_) server_->Stop();
  std::vector<std::shared_ptr<Peer>> peers;
  {
    MutexLock lock(&peers_mu_);
    for (auto& [id, peer] : peers_) peers.push_back(peer);
  }
  for (auto& peer : peers) {
    ClosePeer(peer, absl::CancelledError(absl::StrCat("engine ", name_, " shutting down")));
  }
  if (worker_) worker_->Stop();
  for (auto& t : transports_) t->Shutdown();
  transfers_.FailIf([](const core::TransferInfo&) { return true; },
                    [this](const core::TransferInfo& info) {
                      return absl::CancelledError(
                          absl::StrCat("transfer ", info.id, ": engine ", name_, " shutting down"));
                    });
  transfers_.StopDeadlineWaits();
  if (reaper_.joinable()) reaper_.join();
  work_.reset();
  io_.stop();
  for (auto& t : io_threads_) t.join();
  // Last: every transfer has ended by now, and each end callback runs before the thread ends.
  transfers_.StopEndCallbacks();
  if (completer_.joinable()) completer_.join();
}

absl::Status Engine::Impl::DescribeGpuMemory(const RegionOptions& options,
                                             transport::LocalRegion* region) {
  absl::StatusOr<gpu::PointerInfo> info = gpu_->QueryPointer(region->base);
  if (!info.ok()) {
    return absl::Status(info.status().code(),
                        absl::StrCat("RegisterMemory(kGpu): ", info.status().message()));
  }
  if (options.gpu_device >= 0 && options.gpu_device != info->device) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterMemory(kGpu): the memory belongs to device ", info->device,
                     ", not to device ", options.gpu_device, " as the options say"));
  }
  auto* const alloc = static_cast<std::byte*>(info->allocation_base);
  if (region->base < alloc ||
      static_cast<uint64_t>(region->base - alloc) + region->length > info->allocation_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RegisterMemory(kGpu): ", region->length, " B at offset ", region->base - alloc,
        " run past the device allocation of ", info->allocation_size, " B"));
  }
  region->gpu_device = info->device;
  region->gpu_allocation_base = alloc;
  region->gpu_allocation_size = info->allocation_size;
  return absl::OkStatus();
}

absl::StatusOr<RegionId> Engine::Impl::RegisterMemory(void* ptr, size_t length,
                                                      RegionOptions options) {
  if (ptr == nullptr || length == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterMemory: null pointer or zero length (length ", length, ")"));
  }
  transport::LocalRegion region;
  region.base = static_cast<std::byte*>(ptr);
  region.length = length;
  region.access = options.access;
  region.kind = options.kind;
  region.reads_need_grant = options.reads_need_grant;
  if (options.kind == MemoryKind::kGpu) {
    if (absl::Status s = DescribeGpuMemory(options, &region); !s.ok()) return s;
  }
  const absl::Time start = absl::Now();
  // Unpublished (no peer reaches it) until every transport registered it below.
  const RegionId id = regions_.Add(region, options.export_to_all_peers, /*published=*/false);
  region.id = id;
  std::vector<std::string> declined;  // transports that cannot move this kind of memory
  bool registered = false;
  for (const auto& t : transports_) {
    if (region.kind == MemoryKind::kGpu ? !t->caps().gpu_memory : !t->caps().host_memory) {
      declined.push_back(t->caps().name);
      continue;
    }
    if (absl::Status s = t->RegisterRegion(region); !s.ok()) {
      for (const auto& u : transports_) u->DeregisterRegion(id);
      (void)regions_.Remove(id);
      return absl::Status(s.code(),
                          absl::StrCat("RegisterMemory with ", t->caps().name, ": ", s.message()));
    }
    registered = true;
  }
  if (!registered) {
    (void)regions_.Remove(id);
    return absl::FailedPreconditionError(
        absl::StrCat("RegisterMemory: no transport of engine ", name_, " can move ",
                     region.kind == MemoryKind::kGpu ? "GPU" : "host",
                     " memory (declined: ", absl::StrJoin(declined, ", "), ")"));
  }
  regions_.Publish(id);
  if (!declined.empty()) {
    KVW_LOG(kInfo, "engine") << "region not registered with every transport" << Kv("engine", name_)
                             << Kv("region", id) << Kv("declined", absl::StrJoin(declined, ","));
  }
  const double us = absl::ToDoubleMicroseconds(absl::Now() - start);
  {
    MutexLock lock(&stats_mu_);
    stats_.registration_us_total += us;
  }
  KVW_LOG(kInfo, "engine") << "registered region" << Kv("engine", name_) << Kv("region", id)
                           << Kv("length", length) << Kv("gpu_device", region.gpu_device)
                           << Kv("export_all", options.export_to_all_peers) << Kv("us", us);
  if (options.export_to_all_peers) {
    std::vector<std::shared_ptr<Peer>> peers;
    {
      MutexLock lock(&peers_mu_);
      for (auto& [pid, peer] : peers_) peers.push_back(peer);
    }
    for (auto& peer : peers) (void)SendExports(*peer, {region});
  }
  return id;
}

absl::Status Engine::Impl::DeregisterMemory(RegionId region) {
  auto entry = regions_.Remove(region);
  if (!entry.ok()) return entry.status();
  transfers_.FailIf(
      [region](const core::TransferInfo& info) {
        return std::find(info.local_regions.begin(), info.local_regions.end(), region) !=
               info.local_regions.end();
      },
      [region](const core::TransferInfo& info) {
        return absl::FailedPreconditionError(absl::StrCat("transfer ", info.id, ": local region ",
                                                          region, " deregistered while in flight"));
      });
  std::vector<std::shared_ptr<Peer>> peers;
  {
    MutexLock lock(&peers_mu_);
    for (auto& [pid, peer] : peers_) peers.push_back(peer);
  }
  pb::Envelope revoke;
  revoke.mutable_revoke_regions()->add_ids(region);
  for (auto& peer : peers) {
    if ((*entry)->export_to_all || (*entry)->exported_to.contains(peer->id)) {
      (void)peer->conn->Send(revoke);
    }
  }
  for (const auto& t : transports_) t->DeregisterRegion(region);
  // Incoming ops and local transfers pin the region while they touch it; the caller may free
  // the memory once we return, so wait for them.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (entry->use_count() > 1) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("region ", region, " removed but still in use by ", entry->use_count() - 1,
                       " operations after 10s; do not free its memory yet"));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return absl::OkStatus();
}

absl::StatusOr<Notification> Engine::Impl::WaitNotification(absl::Duration timeout) {
  Notification n;
  if (!arrivals_.WaitOne(absl::Now() + timeout, &n)) {
    return absl::DeadlineExceededError(
        absl::StrCat("no notification within ", absl::FormatDuration(timeout)));
  }
  return n;
}

EngineStats Engine::Impl::Stats() const {
  EngineStats out;
  std::map<std::string, std::pair<uint64_t, uint64_t>> bytes_by_transport;
  {
    MutexLock lock(&stats_mu_);
    out = stats_;
    for (size_t i = 0; i < caps_.size(); ++i) {
      const MovedBytes& moved = bytes_by_transport_[i];
      if (moved.used) bytes_by_transport[caps_[i]->name] = {moved.read, moved.written};
    }
  }
  // Read after the ends counted in stats_: started is never below succeeded + failed.
  out.transfers_started += transfers_started_.load(std::memory_order_relaxed);
  out.ops_submitted += ops_submitted_.load(std::memory_order_relaxed);
  out.ops_posted += ops_posted_.load(std::memory_order_relaxed);
  out.regions = regions_.size();
  out.registered_bytes = regions_.bytes();
  out.gpu.regions = regions_.gpu_regions();
  out.grants_live = grants_.live();
  out.notifications_delivered = arrivals_.delivered();
  out.control.notifications_dropped = arrivals_.dropped();
  out.control.peers_closed_for_protocol = peers_closed_for_protocol_.load();
  if (server_) {
    const control::ServerStats server = server_->stats();
    out.control.handshakes_in_flight = server.handshakes_in_flight;
    out.control.control_connections = server.connections;
    out.control.handshakes_failed = server.handshakes_failed;
    out.control.handshakes_refused = server.refused_over_limit;
  }
  // Every built-in transport's statistics, at zero for one that is not running (the output
  // keeps its shape); then the running ones add their values.
  out.transport_stats = transport::BuiltinTransportStats();
  for (const auto& t : transports_) t->AddStats(&out.transport_stats);
  // What each transport moved (completed transfers), whatever the peers' first choice: the
  // built-in ones declared at zero, so that the output keeps its shape.
  for (const char* name : {"rdma", "shm", "tcp"}) {
    for (const auto& [key, op] : {std::pair{"read", "READ"}, std::pair{"written", "WRITE"}}) {
      out.transport_stats.push_back(transport::DeclareStat(
          name, "bytes_by_transport", absl::StrCat(name, "_", key), TransportStat::Kind::kCounter,
          absl::StrCat(name, "_bytes_", key, "_total"),
          absl::StrCat("Bytes moved by completed ", op, " transfers over ", name, ".")));
    }
  }
  for (const auto& [name, moved] : bytes_by_transport) {
    transport::AddStat(&out.transport_stats, "bytes_by_transport", absl::StrCat(name, "_read"),
                       moved.first);
    transport::AddStat(&out.transport_stats, "bytes_by_transport", absl::StrCat(name, "_written"),
                       moved.second);
  }
  MutexLock lock(&peers_mu_);
  out.control.session_tokens = tokens_.size();
  for (const auto& [id, peer] : peers_) {
    MutexLock peer_lock(&peer->mu);
    PeerStats p;
    p.peer_id = id;
    p.name = peer->name;
    p.transport = peer->transport_desc;
    p.transport_reason = peer->transport_reason;
    p.alive = peer->alive;
    p.bytes_read = peer->bytes_read.load(std::memory_order_relaxed);
    p.bytes_written = peer->bytes_written.load(std::memory_order_relaxed);
    p.transfers = peer->transfers.load(std::memory_order_relaxed);
    out.peers.push_back(std::move(p));
  }
  return out;
}

// --- public API ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(EngineOptions options) {
  // Every option is checked here, once, before anything starts (kvwire/options_check.h).
  if (absl::Status s = ValidateEngineOptions(options); !s.ok()) return s;
  auto impl = std::make_unique<Impl>(std::move(options));
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::make_unique<Engine>(ConstructionKey(), std::move(impl));
}

Engine::Engine(ConstructionKey, std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;
const std::string& Engine::name() const { return impl_->name(); }
std::string Engine::address() const { return impl_->address(); }
uint64_t Engine::compatibility_hash() const { return impl_->compatibility_hash(); }
absl::StatusOr<RegionId> Engine::RegisterMemory(void* ptr, size_t length, RegionOptions options) {
  return impl_->RegisterMemory(ptr, length, options);
}
absl::Status Engine::DeregisterMemory(RegionId region) { return impl_->DeregisterMemory(region); }
absl::StatusOr<PeerId> Engine::Connect(const std::string& address, const ConnectOptions& options) {
  return impl_->Connect(address, options);
}
absl::Status Engine::Export(PeerId peer, absl::Span<const RegionId> regions) {
  return impl_->Export(peer, regions);
}

absl::Status Engine::Unexport(PeerId peer, absl::Span<const RegionId> regions) {
  return impl_->Unexport(peer, regions);
}
absl::Status Engine::Disconnect(PeerId peer) { return impl_->Disconnect(peer); }
absl::Status Engine::Disconnect(PeerId peer, const absl::Status& reason) {
  return impl_->Disconnect(peer, reason);
}
std::vector<PeerInfo> Engine::Peers() const { return impl_->Peers(); }
absl::StatusOr<PeerId> Engine::FindPeer(const std::string& name) const {
  return impl_->FindPeer(name);
}
absl::StatusOr<PeerId> Engine::WaitForPeer(const std::string& name, absl::Duration timeout) {
  return impl_->WaitForPeer(name, timeout);
}
absl::StatusOr<std::vector<RemoteRegion>> Engine::RemoteRegions(PeerId peer) const {
  return impl_->RemoteRegions(peer);
}
absl::Status Engine::WaitForRemoteRegion(PeerId peer, RegionId region, absl::Duration timeout) {
  return impl_->WaitForRemoteRegion(peer, region, timeout);
}
absl::StatusOr<TransferId> Engine::Transfer(PeerId peer, OpKind kind, absl::Span<const Op> ops,
                                            const TransferOptions& options) {
  return impl_->Transfer(peer, kind, ops, options);
}
absl::StatusOr<GrantId> Engine::Grant(PeerId peer, absl::Span<const GrantRange> ranges) {
  return impl_->Grant(peer, ranges);
}
absl::Status Engine::Revoke(PeerId peer, GrantId grant) { return impl_->Revoke(peer, grant); }
TransferState Engine::Poll(TransferId id, absl::Status* status) { return impl_->Poll(id, status); }
absl::Status Engine::Wait(TransferId id, absl::Duration timeout) {
  return impl_->Wait(id, timeout);
}
std::vector<Notification> Engine::TakeNotifications() { return impl_->TakeNotifications(); }
absl::StatusOr<Notification> Engine::WaitNotification(absl::Duration timeout) {
  return impl_->WaitNotification(timeout);
}
EngineStats Engine::Stats() const { return impl_->Stats(); }

}  // namespace kvwire

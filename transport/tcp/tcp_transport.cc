// TcpTransport: ties the target side (TcpServer) and the initiator side (TcpChannel) together
// and owns every thread either of them starts.
#include "transport/tcp/tcp_transport.h"

#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "src/util/mutex.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/tcp/tcp_client_connection.h"
#include "transport/tcp/tcp_io_pool.h"
#include "transport/tcp/tcp_server.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_staging.h"

namespace kvwire::transport {
namespace {

class TcpTransport final : public Transport {
 public:
  TcpTransport(const TcpTransportOptions& options, GpuStaging staging, std::shared_ptr<IoPool> pool,
               std::unique_ptr<TcpServer> server)
      : options_(options),
        staging_(std::move(staging)),
        pool_(std::move(pool)),
        server_(std::move(server)) {
    caps_.name = "tcp";
    caps_.rank = 30;  // kernel sockets: reaches any peer, costs the most
    // The target validates and serves every op itself (TargetHooks::ResolveIncoming).
    caps_.reaches_every_region = true;
    caps_.one_sided_read = true;
    caps_.one_sided_write = true;
    caps_.same_host_only = false;
    caps_.counts_arrivals = true;
    // Each op carries its read grant (tcp_wire.h), which the target checks (ResolveIncoming).
    caps_.checks_grants = true;
    caps_.max_op_bytes = options.max_op_bytes;
    caps_.max_lanes = options.max_lanes;
    caps_.lanes_per_peer = std::clamp<uint32_t>(options.connections_per_peer, 1, options.max_lanes);
    // Device memory is staged through pinned host buffers (tcp_staging.h).
    caps_.gpu_memory = options.gpu_runtime != nullptr;
  }
  ~TcpTransport() override { Shutdown(); }

  const Capabilities& caps() const override { return caps_; }
  std::string Endpoint() const override { return server_->endpoint(); }

  absl::Status RegisterRegion(const LocalRegion& region) override {
    if (region.base == nullptr && region.length > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tcp: region ", region.id, " of ", region.length, " bytes has no address"));
    }
    MutexLock lock(&mu_);
    if (!regions_.insert(region.id).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("tcp: region ", region.id, " is already registered"));
    }
    return absl::OkStatus();
  }

  void DeregisterRegion(RegionId id) override {
    MutexLock lock(&mu_);
    regions_.erase(id);
  }

  absl::Status CanReach(const std::string& remote_endpoint) const override {
    std::string host;
    uint16_t port = 0;
    if (absl::Status s = ParseEndpoint(remote_endpoint, &host, &port); !s.ok()) return s;
    KVW_LOG(kDebug, "tcp") << "reachable (tcp reaches any address)"
                           << Kv("endpoint", remote_endpoint);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Channel>> Connect(const PeerLink& link) override {
    if (link.lanes == 0 || link.lanes > caps_.max_lanes) {
      return absl::InvalidArgumentError(absl::StrCat("tcp connect to ", link.remote_endpoint, ": ",
                                                     link.lanes, " lanes requested, 1..",
                                                     caps_.max_lanes, " supported"));
    }
    {
      MutexLock lock(&mu_);
      if (shut_down_) {
        return absl::FailedPreconditionError(
            absl::StrCat("tcp connect to ", link.remote_endpoint, ": transport shut down"));
      }
      Reap();
    }
    std::vector<std::shared_ptr<ClientConnection>> connections;
    for (uint32_t lane = 0; lane < link.lanes; ++lane) {
      absl::StatusOr<std::shared_ptr<ClientConnection>> connection =
          OpenLane(link, lane, options_.socket_buffer_bytes, staging_, pool_);
      if (!connection.ok()) {
        for (const auto& c : connections) c->Close(connection.status());
        for (const auto& c : connections) c->Join();
        return connection.status();
      }
      connections.push_back(*std::move(connection));
    }
    {
      MutexLock lock(&mu_);
      if (shut_down_) {
        // Shutdown ran meanwhile and could not see these: end them here.
        const absl::Status down = absl::FailedPreconditionError(
            absl::StrCat("tcp connect to ", link.remote_endpoint, ": transport shut down"));
        for (const auto& c : connections) c->Close(down);
        for (const auto& c : connections) c->Join();
        return down;
      }
      clients_.insert(clients_.end(), connections.begin(), connections.end());
    }
    KVW_LOG(kInfo, "tcp") << "channel open" << Kv("peer", link.peer)
                          << Kv("endpoint", link.remote_endpoint) << Kv("lanes", link.lanes);
    return std::make_unique<TcpChannel>(link.remote_endpoint, std::move(connections),
                                        link.verify_checksums);
  }

  void DropPeer(PeerId peer) override { server_->DropPeer(peer); }

  void AddStats(std::vector<TransportStat>* stats) const override {
    AddStat(stats, "gpu", "tcp_staged_bytes",
            staging_.staged_bytes->load(std::memory_order_relaxed));
    const TcpListenerStats listener = server_->Stats();
    AddStat(stats, "tcp_listener", "connections", listener.connections);
    AddStat(stats, "tcp_listener", "refused_over_limit", listener.refused_over_limit);
    AddStat(stats, "tcp_listener", "hello_refused", listener.hello_refused);
    AddStat(stats, "tcp_listener", "hello_timeouts", listener.hello_timeouts);
    AddStat(stats, "tcp_listener", "thread_failures", listener.thread_failures);
    AddStat(stats, "tcp_listener", "stalled_dropped", listener.stalled_dropped);
  }

  void Shutdown() override {
    std::vector<std::shared_ptr<ClientConnection>> clients;
    {
      MutexLock lock(&mu_);
      shut_down_ = true;
      clients.swap(clients_);
    }
    server_->Shutdown();
    const absl::Status down = absl::UnavailableError("tcp transport shut down");
    for (const auto& c : clients) c->Close(down);
    for (const auto& c : clients) {
      if (!c->Join()) {
        KVW_LOG(kError, "tcp") << "Shutdown called on a tcp I/O thread; cannot join it"
                               << Kv("endpoint", c->endpoint());
      }
    }
    // Every connection let go of its I/O thread (or Shutdown runs on one of them): the
    // threads end here.
    pool_->Stop();
  }

 private:
  // Forgets client connections that their I/O thread let go of (closed channels), which
  // their channel could not join (it was destroyed on an I/O thread).
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (size_t i = 0; i < clients_.size();) {
      if (clients_[i]->Exited() && clients_[i]->Join()) {
        clients_[i] = std::move(clients_.back());
        clients_.pop_back();
      } else {
        ++i;
      }
    }
  }

  const TcpTransportOptions options_;
  // Shared with every connection (which may outlive a channel, never the counter).
  const GpuStaging staging_;
  Capabilities caps_;
  // The I/O threads of every data connection, both directions (tcp_io_pool.h).
  const std::shared_ptr<IoPool> pool_;
  const std::unique_ptr<TcpServer> server_;

  Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<RegionId> regions_ ABSL_GUARDED_BY(mu_);
  // Every client connection that may still have threads; joined by Shutdown at the latest.
  std::vector<std::shared_ptr<ClientConnection>> clients_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const TcpTransportOptions& options,
                                                              TargetHooks* hooks) {
  if (hooks == nullptr) return absl::InvalidArgumentError("tcp transport: no target hooks");
  if (options.max_op_bytes == 0 || options.max_lanes == 0) {
    return absl::InvalidArgumentError("tcp transport: max_op_bytes and max_lanes must be > 0");
  }
  if (options.max_data_connections == 0 || options.max_pending_hellos == 0 ||
      options.max_pending_hellos_per_address == 0 || options.max_data_connections_per_peer == 0) {
    return absl::InvalidArgumentError(
        "tcp transport: max_data_connections, max_pending_hellos, max_pending_hellos_per_address "
        "and max_data_connections_per_peer must be > 0");
  }
  if (options.hello_timeout <= absl::ZeroDuration() || options.io_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tcp transport: hello_timeout (", absl::FormatDuration(options.hello_timeout),
        ") and io_timeout (", absl::FormatDuration(options.io_timeout), ") must be > 0"));
  }
  GpuStaging staging;
  staging.runtime = options.gpu_runtime;
  staging.staged_bytes = std::make_shared<std::atomic<uint64_t>>(0);
  const uint32_t threads = options.io_threads > 0 ? options.io_threads : IoPool::DefaultThreads();
  IoBackend backend = IoBackend::kEpoll;
  if (options.io_backend == "io_uring") {
    if (absl::Status s = IoUringAvailable(); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("tcp.io_backend=io_uring: ", s.message()));
    }
    backend = IoBackend::kIoUring;
  } else if (options.io_backend == "auto") {
    if (absl::Status s = IoUringAvailable(); s.ok()) {
      backend = IoBackend::kIoUring;
    } else {
      KVW_LOG(kWarning, "tcp") << "tcp.io_backend=auto: io_uring unavailable, using epoll"
                               << Kv("reason", s.message());
    }
  } else if (options.io_backend != "epoll") {
    return absl::InvalidArgumentError(absl::StrCat(
        "tcp transport: io_backend \"", options.io_backend, "\" is not epoll, io_uring or auto"));
  }
  absl::StatusOr<std::shared_ptr<IoPool>> pool = IoPool::Create(threads, options.io_poll, backend);
  if (!pool.ok()) return pool.status();
  absl::StatusOr<std::unique_ptr<TcpServer>> server =
      TcpServer::Start(options, hooks, staging, *pool);
  if (!server.ok()) {
    (*pool)->Stop();
    return server.status();
  }
  return std::make_unique<TcpTransport>(options, std::move(staging), *std::move(pool),
                                        *std::move(server));
}

std::vector<TransportStat> TcpTransportStats() {
  using Kind = TransportStat::Kind;
  // The data listener's limits at work (see TcpTransportOptions): what it refused and why.
  const auto listener = [](const char* name, Kind kind, const char* metric, const char* help) {
    return DeclareStat("tcp", "tcp_listener", name, kind, metric, help);
  };
  return {
      DeclareStat("tcp", "gpu", "tcp_staged_bytes", Kind::kCounter, "gpu_tcp_staged_bytes_total",
                  "Bytes staged through pinned host buffers (tcp)."),
      listener("connections", Kind::kGauge, "tcp_data_connections",
               "tcp data connections open, every stage."),
      listener("refused_over_limit", Kind::kCounter, "tcp_refused_over_limit_total",
               "tcp data connections refused by a connection limit."),
      listener("hello_refused", Kind::kCounter, "tcp_hello_refused_total",
               "tcp data connections with a bad hello or unknown token."),
      listener("hello_timeouts", Kind::kCounter, "tcp_hello_timeouts_total",
               "tcp data connections cut at the hello deadline."),
      listener("thread_failures", Kind::kCounter, "tcp_thread_failures_total",
               "tcp data connections refused: no thread could start."),
      listener("stalled_dropped", Kind::kCounter, "tcp_stalled_dropped_total",
               "tcp data connections cut mid-op by the I/O deadline."),
  };
}

}  // namespace kvwire::transport

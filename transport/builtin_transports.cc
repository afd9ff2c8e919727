// The built-in transports (declared in transport/transport.h), and the options map that starts
// with their options (kvwire/transport_options.h).

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "kvwire/rdma_options.h"
#include "kvwire/shm_options.h"
#include "kvwire/tcp_options.h"
#include "kvwire/transport_options.h"
#include "src/util/log.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/transport.h"

namespace kvwire::transport {
namespace {

// What a tcp target accepts per op, whatever its peers' max_op_bytes (they split at their
// own setting, which EngineOptions caps at this).
constexpr uint64_t kMaxTcpOpBytes = 64 << 20;

absl::StatusOr<std::unique_ptr<Transport>> CreateTcp(const TransportContext& context) {
  const TcpOptions& options = context.options->tcp();
  TcpTransportOptions tcp;
  tcp.listen_host = context.listen_host;
  tcp.max_op_bytes = kMaxTcpOpBytes;
  tcp.gpu_runtime = context.gpu_runtime;
  // The ranges were checked by Engine::Create (TcpOptions::Validate): no clamping here.
  tcp.connections_per_peer = static_cast<uint32_t>(options.connections);
  tcp.io_threads = static_cast<uint32_t>(options.io_threads);
  tcp.io_poll = options.io_poll;
  tcp.io_backend = options.io_backend;
  tcp.max_data_connections = static_cast<uint32_t>(options.max_data_connections);
  tcp.max_data_connections_per_peer = static_cast<uint32_t>(options.max_data_connections_per_peer);
  tcp.max_pending_hellos = static_cast<uint32_t>(options.max_pending_hellos);
  tcp.max_pending_hellos_per_address =
      static_cast<uint32_t>(options.max_pending_hellos_per_address);
  tcp.hello_timeout = options.hello_timeout;
  tcp.io_timeout = options.io_timeout;
  // tcp reaches every peer: an engine without it does not start.
  return CreateTcpTransport(tcp, context.hooks);
}

absl::StatusOr<std::unique_ptr<Transport>> CreateShm(const TransportContext& context) {
  ShmTransportOptions shm;
  shm.engine_name = context.engine_name;
  shm.gpu_runtime = context.gpu_runtime;
  shm.allow_cma = context.options->shm().cma;
  shm.deny_ptrace = context.options->shm().deny_ptrace;
  shm.revoke_on_peer_close = context.options->shm().revoke_on_close;
  // Every shm peer holds a control connection too: the fd server serves as many peers as the
  // control channel admits (its fixed 256 refused the 257th of a thousand local peers).
  shm.max_connections = static_cast<size_t>(context.options->max_control_connections);
  auto created = CreateShmTransport(shm, context.hooks);
  if (!created.ok()) {
    KVW_LOG(kWarning, "engine") << "shm transport unavailable: " << created.status().message()
                                << Kv("engine", context.engine_name);
    return std::unique_ptr<Transport>();
  }
  return created;
}

absl::StatusOr<std::unique_ptr<Transport>> CreateRdma(const TransportContext& context) {
  const RdmaOptions& options = context.options->rdma();
  RdmaTransportOptions rdma;
  rdma.devices = options.devices;
  rdma.gpu_runtime = context.gpu_runtime;
  rdma.gid_index = options.gid_index;
  // In range (checked by Engine::Create: RdmaOptions::Validate), so the narrowing casts keep
  // every value.
  rdma.qps_per_device = static_cast<uint32_t>(options.qps_per_peer);
  rdma.send_queue_depth = static_cast<uint32_t>(options.send_queue_depth);
  rdma.qp_timeout = static_cast<uint8_t>(options.qp_timeout);
  rdma.retry_count = static_cast<uint8_t>(options.retry_count);
  rdma.rnr_retry = static_cast<uint8_t>(options.rnr_retry);
  rdma.max_qps_per_device = static_cast<uint32_t>(options.max_qps_per_device);
  auto created = CreateRdmaTransport(rdma, context.hooks);
  if (!created.ok()) {
    // The usual case on machines without RDMA NICs: a warning only when rdma was asked for.
    const LogLevel level =
        context.options->transport == RdmaOptions::kName || !options.devices.empty()
            ? LogLevel::kWarning
            : LogLevel::kInfo;
    if (LogEnabled(level)) {
      LogLine(level, "engine") << "rdma transport unavailable: " << created.status().message()
                               << Kv("engine", context.engine_name);
    }
    return std::unique_ptr<Transport>();
  }
  return created;
}

}  // namespace

std::vector<TransportFactory> BuiltinTransports() { return {CreateTcp, CreateShm, CreateRdma}; }

std::vector<TransportStat> BuiltinTransportStats() {
  std::vector<TransportStat> out;
  for (auto declared : {RdmaTransportStats, ShmTransportStats, TcpTransportStats}) {
    for (TransportStat& stat : declared()) out.push_back(std::move(stat));
  }
  return out;
}

}  // namespace kvwire::transport

namespace kvwire {

TransportOptionsMap::TransportOptionsMap() {
  Put(std::make_unique<TcpOptions>());
  Put(std::make_unique<ShmOptions>());
  Put(std::make_unique<RdmaOptions>());
}

TransportOptionsMap::TransportOptionsMap(const TransportOptionsMap& other) {
  for (const auto& [name, options] : other.map_) map_.emplace(name, options->Clone());
}

TransportOptionsMap& TransportOptionsMap::operator=(const TransportOptionsMap& other) {
  if (this != &other) {
    TransportOptionsMap copy(other);
    map_ = std::move(copy.map_);
  }
  return *this;
}

TransportOptionsMap::~TransportOptionsMap() = default;

TransportOptions* TransportOptionsMap::Find(absl::string_view transport) {
  auto it = map_.find(transport);
  return it == map_.end() ? nullptr : it->second.get();
}

const TransportOptions* TransportOptionsMap::Find(absl::string_view transport) const {
  auto it = map_.find(transport);
  return it == map_.end() ? nullptr : it->second.get();
}

void TransportOptionsMap::Put(std::unique_ptr<TransportOptions> options) {
  if (options == nullptr) return;
  std::string name(options->transport());
  map_[std::move(name)] = std::move(options);
}

absl::Status TransportOptionsMap::Set(absl::string_view transport, absl::string_view key,
                                      absl::string_view value) {
  TransportOptions* options = Find(transport);
  if (options == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown transport \"", transport,
                                                   "\" (options exist for ",
                                                   absl::StrJoin(Names(), ", "), ")"));
  }
  return options->Set(key, value);
}

absl::Status TransportOptionsMap::Validate() const {
  for (const auto& [name, options] : map_) {
    if (absl::Status s = options->Validate(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<std::string> TransportOptionsMap::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, options] : map_) names.push_back(name);
  return names;
}

}  // namespace kvwire

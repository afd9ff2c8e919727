// The built-in transports (declared in transport/transport.h).

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
  const EngineOptions& options = *context.options;
  TcpTransportOptions tcp;
  tcp.listen_host = context.listen_host;
  tcp.max_op_bytes = kMaxTcpOpBytes;
  tcp.gpu_runtime = context.gpu_runtime;
  // The ranges were checked by Engine::Create (src/core/options_check.cc): no clamping here.
  tcp.connections_per_peer = static_cast<uint32_t>(options.tcp_connections);
  tcp.io_threads = static_cast<uint32_t>(options.tcp_io_threads);
  tcp.io_poll = options.tcp_io_poll;
  tcp.max_data_connections = static_cast<uint32_t>(options.tcp_max_data_connections);
  tcp.max_data_connections_per_peer =
      static_cast<uint32_t>(options.tcp_max_data_connections_per_peer);
  tcp.max_pending_hellos = static_cast<uint32_t>(options.tcp_max_pending_hellos);
  tcp.max_pending_hellos_per_address =
      static_cast<uint32_t>(options.tcp_max_pending_hellos_per_address);
  tcp.hello_timeout = options.tcp_hello_timeout;
  tcp.io_timeout = options.tcp_io_timeout;
  // tcp reaches every peer: an engine without it does not start.
  return CreateTcpTransport(tcp, context.hooks);
}

absl::StatusOr<std::unique_ptr<Transport>> CreateShm(const TransportContext& context) {
  ShmTransportOptions shm;
  shm.engine_name = context.engine_name;
  shm.gpu_runtime = context.gpu_runtime;
  shm.allow_cma = context.options->shm_cma;
  shm.deny_ptrace = context.options->shm_deny_ptrace;
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
  const EngineOptions& options = *context.options;
  RdmaTransportOptions rdma;
  rdma.devices = options.rdma_devices;
  rdma.gpu_runtime = context.gpu_runtime;
  rdma.gid_index = options.rdma_gid_index;
  // In range (checked by Engine::Create), so the narrowing casts keep every value.
  rdma.qps_per_device = static_cast<uint32_t>(options.rdma_qps_per_peer);
  rdma.send_queue_depth = static_cast<uint32_t>(options.rdma_send_queue_depth);
  rdma.qp_timeout = static_cast<uint8_t>(options.rdma_qp_timeout);
  rdma.retry_count = static_cast<uint8_t>(options.rdma_retry_count);
  rdma.rnr_retry = static_cast<uint8_t>(options.rdma_rnr_retry);
  rdma.max_qps_per_device = static_cast<uint32_t>(options.rdma_max_qps_per_device);
  auto created = CreateRdmaTransport(rdma, context.hooks);
  if (!created.ok()) {
    // The usual case on machines without RDMA NICs: a warning only when rdma was asked for.
    const LogLevel level =
        options.transport == TransportKind::kRdma || !options.rdma_devices.empty()
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

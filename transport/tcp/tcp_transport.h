// tcp transport: one-sided READ/WRITE emulated over Boost.Asio TCP connections; the target
// validates every op (TargetHooks::ResolveIncoming) before touching memory. With a GPU
// runtime, ops on device memory (either side) are staged through pinned host buffers.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define KVWIRE_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "src/gpu/runtime.h"
#include "transport/transport.h"

namespace kvwire::transport {

struct TcpTransportOptions {
  // The runtime of kGpu regions (the engine's); null: GPU memory is refused
  // (caps().gpu_memory is false).
  gpu::Runtime* gpu_runtime = nullptr;
  // Data listener address; port 0 picks a free one. The host is what peers dial.
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;
  uint32_t max_lanes = 16;
  uint64_t max_op_bytes = 1 << 20;
  // Socket buffer sizes (0 = kernel default).
  int socket_buffer_bytes = 4 << 20;
};

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const TcpTransportOptions& options,
                                                              TargetHooks* hooks);

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_TRANSPORT_H_

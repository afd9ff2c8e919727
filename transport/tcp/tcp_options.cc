// TcpOptions (include/kvwire/tcp_options.h): its ranges and its by-name setter.
#include "kvwire/tcp_options.h"

#include "absl/strings/str_cat.h"

#include "src/util/option_range.h"
#include "src/util/options_by_name.h"

namespace kvwire {
namespace {

// Every option by its key (TransportOptions::Set), in the order of the struct.
template <typename Self, typename F>
void Fields(Self& o, F&& f) {
  f("connections", o.connections);
  f("io_threads", o.io_threads);
  f("io_poll", o.io_poll);
  f("io_backend", o.io_backend);
  f("max_data_connections", o.max_data_connections);
  f("max_data_connections_per_peer", o.max_data_connections_per_peer);
  f("max_pending_hellos", o.max_pending_hellos);
  f("max_pending_hellos_per_address", o.max_pending_hellos_per_address);
  f("hello_timeout", o.hello_timeout);
  f("io_timeout", o.io_timeout);
}

}  // namespace

absl::Status TcpOptions::Validate() const {
  const absl::Duration ms = absl::Milliseconds(1);
  const absl::Duration hour = absl::Hours(1);
  const absl::Status checks[] = {
      CheckOptionRange("tcp.connections", connections, 1, 64),
      CheckOptionRange("tcp.io_threads", io_threads, 0, 64),
      CheckOptionRange("tcp.io_poll", io_poll, absl::ZeroDuration(), absl::Milliseconds(10)),
      CheckOptionRange("tcp.max_data_connections", max_data_connections, 1, 1 << 20),
      CheckOptionRange("tcp.max_data_connections_per_peer", max_data_connections_per_peer, 1,
                       1 << 16),
      CheckOptionRange("tcp.max_pending_hellos", max_pending_hellos, 1, 1 << 16),
      CheckOptionRange("tcp.max_pending_hellos_per_address", max_pending_hellos_per_address, 1,
                       1 << 16),
      CheckOptionRange("tcp.hello_timeout", hello_timeout, ms, hour),
      CheckOptionRange("tcp.io_timeout", io_timeout, ms, hour),
  };
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  if (io_backend != "epoll" && io_backend != "io_uring" && io_backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp.io_backend: \"", io_backend, "\" is not epoll, io_uring or auto"));
  }
  return absl::OkStatus();
}

KVWIRE_OPTIONS_BY_NAME(TcpOptions)

}  // namespace kvwire

// The tcp transport's options (EngineOptions::transports["tcp"], or EngineOptions::tcp()),
// checked by their own Validate() (transport/tcp/tcp_options.cc).
#ifndef KVWIRE_TCP_OPTIONS_H_
#define KVWIRE_TCP_OPTIONS_H_

#include <string>

#include "absl/time/time.h"

#include "kvwire/transport_options.h"

namespace kvwire {

struct TcpOptions : TransportOptionsOf<TcpOptions> {
  static constexpr char kName[] = "tcp";

  // Parallel data connections per peer; a transfer is striped over them. 1..64.
  int connections = 4;
  // I/O threads that run every tcp data connection of the engine, whatever the number of
  // peers (epoll; see docs/ARCHITECTURE.md). 0: one per 8 cores, 1..4. 0..64.
  int io_threads = 0;
  // After its last event, a tcp I/O thread polls this long before it sleeps: a busy
  // connection's next bytes come within microseconds, and waking a sleeping thread costs more
  // than polling (loopback, 2-core VM, 1 MiB ops: 4.4 -> 7.2 GB/s). Spends CPU only while
  // data moves and only while the core is the thread's: a poll whose thread was preempted
  // stops, and the pool then sleeps at once for a while (src/util/spin_gate.h); zero: always
  // sleep at once. 0..10ms.
  absl::Duration io_poll = absl::Microseconds(20);
  // How those threads wait for readiness: "epoll"; "io_uring" (poll requests, multishot where
  // the kernel has them; the engine does not start where io_uring_queue_init fails, e.g. a
  // container whose seccomp profile refuses it); "auto": io_uring where it works, else epoll
  // (one log line says why). The same loop and handlers either way.
  std::string io_backend = "epoll";

  // Data listener limits: what a dialer that has not (yet) shown a valid session token, or a
  // peer that stops mid-op, can hold (details: transport/tcp/tcp_transport.h).
  // Data connections open at once in every stage (1..2^20); per peer once authenticated
  // (1..65536).
  int max_data_connections = 1024;
  int max_data_connections_per_peer = 64;
  // Data connections still in the hello stage, in total and per remote address (1..65536).
  int max_pending_hellos = 128;
  int max_pending_hellos_per_address = 32;
  // Absolute deadline for a data connection's hello (header and token). 1ms..1h.
  absl::Duration hello_timeout = absl::Seconds(10);
  // A data connection stuck this long inside one op (payload not arriving, responses not
  // taken) is cut, its pins released, and its peer dropped. Keep it below 10 s, the time
  // DeregisterMemory waits for ops in flight. 1ms..1h.
  absl::Duration io_timeout = absl::Seconds(5);

  absl::Status Validate() const override;
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::Status Get(absl::string_view key, std::string* value) const override;
  std::vector<std::string> Keys() const override;
};

}  // namespace kvwire

#endif  // KVWIRE_TCP_OPTIONS_H_

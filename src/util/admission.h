// Admission of inbound connections before they authenticate, written once for every listener
// of the library (the control channel's, src/control/listener.cc; the tcp transport's data
// port, transport/tcp/tcp_server.cc): a bound on the connections still in their handshake, on
// those from one source address (so that one host cannot take every unauthenticated slot),
// and on the connections open in every stage.
//
// Not thread-safe: each listener calls it from its accept path under its own lock (or from
// its one accept thread).
#ifndef KVWIRE_UTIL_ADMISSION_H_
#define KVWIRE_UTIL_ADMISSION_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"

namespace kvwire {

class Admission {
 public:
  struct Limits {
    size_t max_pending = 0;             // connections in the handshake stage, in total
    size_t max_pending_per_source = 0;  // ... from one source address
    size_t max_open = 0;                // connections open in every stage
  };
  // The first limit a new connection would break, in this order.
  enum class Refusal { kNone, kPending, kPendingFromSource, kOpen };

  explicit Admission(Limits limits) : limits_(limits) {}

  // Whether a new connection from `source` may start its handshake while `open` connections
  // (the listener's own count: every stage) are open.
  Refusal Check(const std::string& source, size_t open) const;
  // Counts a connection from `source` in the handshake stage (Check said kNone).
  void BeginPending(const std::string& source);
  // Its handshake stage ended, whatever the outcome.
  void EndPending(const std::string& source);
  // Forgets every pending connection (the listener stopped).
  void Clear();

  const Limits& limits() const { return limits_; }
  size_t pending() const { return pending_; }
  size_t pending_from(const std::string& source) const;

 private:
  const Limits limits_;
  size_t pending_ = 0;
  absl::flat_hash_map<std::string, uint32_t> pending_by_source_;
};

}  // namespace kvwire

#endif  // KVWIRE_UTIL_ADMISSION_H_

// The dialing side of the control channel.
#ifndef KVWIRE_CONTROL_DIALER_H_
#define KVWIRE_CONTROL_DIALER_H_

#include <string>

#include <boost/asio/io_context.hpp>

#include "absl/status/statusor.h"

#include "proto/kvwire.pb.h"
#include "src/control/control.h"

namespace kvwire::control {

// Implements Dial (see control.h). Blocking: resolve, connect and handshake run on a private
// io_context driven by the calling thread, so Dial neither needs nor occupies a thread of
// `io`; only the finished socket moves to `io` (the Connection's home). It may therefore be
// called from any thread, including one of `io`'s, though doing that stalls `io` for the
// duration of the handshake (and deadlocks against a listener served only by that thread
// until the timeout expires).
absl::StatusOr<Accepted> DialBlocking(boost::asio::io_context& io, const std::string& address,
                                      const pb::Hello& local_hello, const HandshakeConfig& config);

}  // namespace kvwire::control

#endif  // KVWIRE_CONTROL_DIALER_H_

// The listening side of the control channel: accepts TCP connections and runs each inbound
// handshake asynchronously on the caller's io_context, with a deadline.
#ifndef KVWIRE_CONTROL_LISTENER_H_
#define KVWIRE_CONTROL_LISTENER_H_

#include <cstdint>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>

#include "absl/status/statusor.h"

#include "src/control/control.h"

namespace kvwire::control {

// Implements Listen (see control.h). The returned Server stops on destruction; once Stop has
// returned, `on_accept` and `config.on_handshake_failure` are not running and will not run
// (unless Stop was called from inside one of them).
absl::StatusOr<std::unique_ptr<Server>> StartListener(boost::asio::io_context& io,
                                                      const std::string& host, uint16_t port,
                                                      const HandshakeConfig& config,
                                                      HelloResponder responder,
                                                      AcceptHandler on_accept);

}  // namespace kvwire::control

#endif  // KVWIRE_CONTROL_LISTENER_H_

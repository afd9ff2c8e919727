// Listen and Dial: argument checks in front of listener.cc and dialer.cc.
#include "src/control/control.h"

#include <utility>

#include "absl/strings/str_cat.h"

#include "src/control/dialer.h"
#include "src/control/listener.h"

namespace kvwire::control {
namespace {

absl::Status CheckConfig(const HandshakeConfig& config) {
  if (config.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("handshake timeout must be positive, got ",
                                                   absl::FormatDuration(config.timeout)));
  }
  // A Hello with a few transports must fit in one frame.
  constexpr uint32_t kMinFrameBytes = 4096;
  if (config.max_frame_bytes < kMinFrameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("max_frame_bytes ", config.max_frame_bytes,
                                                   " is below the minimum of ", kMinFrameBytes));
  }
  if (config.max_send_queue_bytes < uint64_t{config.max_frame_bytes} + 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_send_queue_bytes ", config.max_send_queue_bytes,
                     " cannot hold one frame of max_frame_bytes ", config.max_frame_bytes));
  }
  if (config.max_pending_handshakes < 1 || config.max_connections < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_pending_handshakes (", config.max_pending_handshakes,
                     ") and max_connections (", config.max_connections, ") must be at least 1"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Listen(boost::asio::io_context& io, const std::string& host,
                                               uint16_t port, const HandshakeConfig& config,
                                               HelloResponder responder, AcceptHandler on_accept) {
  if (absl::Status s = CheckConfig(config); !s.ok()) return s;
  if (!responder || !on_accept) {
    return absl::InvalidArgumentError("Listen needs a HelloResponder and an AcceptHandler");
  }
  return StartListener(io, host, port, config, std::move(responder), std::move(on_accept));
}

absl::StatusOr<Accepted> Dial(boost::asio::io_context& io, const std::string& address,
                              const pb::Hello& local_hello, const HandshakeConfig& config) {
  if (absl::Status s = CheckConfig(config); !s.ok()) return s;
  return DialBlocking(io, address, local_hello, config);
}

}  // namespace kvwire::control

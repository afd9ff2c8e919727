// "host:port" parsing and formatting for control-channel addresses.
#ifndef KVWIRE_CONTROL_ADDRESS_H_
#define KVWIRE_CONTROL_ADDRESS_H_

#include <cstdint>
#include <string>

#include <boost/asio/ip/tcp.hpp>

#include "absl/status/statusor.h"

namespace kvwire::control {

struct HostPort {
  std::string host;  // without IPv6 brackets
  uint16_t port = 0;
};

// Parses "host:port", "[v6addr]:port". Port 0 is accepted only with `allow_port_zero`
// (listening on any free port).
absl::StatusOr<HostPort> ParseHostPort(const std::string& address, bool allow_port_zero = false);

// "1.2.3.4:5" or "[::1]:5".
std::string FormatHostPort(const std::string& host, uint16_t port);
std::string FormatEndpoint(const boost::asio::ip::tcp::endpoint& endpoint);

}  // namespace kvwire::control

#endif  // KVWIRE_CONTROL_ADDRESS_H_

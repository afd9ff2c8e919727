#include "src/control/address.h"

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvwire::control {

absl::StatusOr<HostPort> ParseHostPort(const std::string& address, bool allow_port_zero) {
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid address \"", address, "\": ", why, " (expected host:port)"));
  };
  if (address.empty()) return invalid("empty");
  HostPort result;
  std::string port_text;
  if (address.front() == '[') {
    const size_t close = address.find(']');
    if (close == std::string::npos) return invalid("missing ']' after IPv6 host");
    result.host = address.substr(1, close - 1);
    if (close + 1 >= address.size() || address[close + 1] != ':') {
      return invalid("missing ':port' after ']'");
    }
    port_text = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return invalid("missing ':port'");
    result.host = address.substr(0, colon);
    if (result.host.find(':') != std::string::npos) {
      return invalid("IPv6 hosts must be written in brackets, e.g. [::1]:5000");
    }
    port_text = address.substr(colon + 1);
  }
  if (result.host.empty()) return invalid("empty host");
  if (port_text.empty()) return invalid("empty port");
  uint32_t port = 0;
  if (port_text.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(port_text, &port) || port > 65535) {
    return invalid(absl::StrCat("port \"", port_text, "\" is not a number in 0..65535"));
  }
  if (port == 0 && !allow_port_zero) return invalid("port 0 cannot be dialed");
  result.port = static_cast<uint16_t>(port);
  return result;
}

std::string FormatHostPort(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

std::string FormatEndpoint(const boost::asio::ip::tcp::endpoint& endpoint) {
  return FormatHostPort(endpoint.address().to_string(), endpoint.port());
}

}  // namespace kvwire::control

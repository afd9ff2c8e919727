#include "transport/shm/shm_endpoint.h"

#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvwire::transport::shm {
namespace {

constexpr absl::string_view kMagic = "kvwire-shm/1";

bool IsPlain(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
         c == ':' || c == '/' || c == '[' || c == ']';
}

std::string Escape(absl::string_view value) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (IsPlain(c)) {
      out.push_back(c);
    } else {
      const auto byte = static_cast<unsigned char>(c);
      out.push_back('%');
      out.push_back(kHex[byte >> 4]);
      out.push_back(kHex[byte & 0xF]);
    }
  }
  return out;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::optional<std::string> Unescape(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    if (value[i] != '%') {
      out.push_back(value[i]);
      continue;
    }
    if (i + 2 >= value.size()) return std::nullopt;  // "%" needs two hex digits
    const int high = HexDigit(value[i + 1]);
    const int low = HexDigit(value[i + 2]);
    if (high < 0 || low < 0) return std::nullopt;
    out.push_back(static_cast<char>(high * 16 + low));
    i += 2;
  }
  return out;
}

absl::Status Invalid(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("invalid shm endpoint \"", text.substr(0, 300), "\": ", why));
}

}  // namespace

std::string EncodeEndpoint(const ShmEndpoint& endpoint) {
  return absl::StrCat(kMagic, " host=", Escape(endpoint.host_id),
                      " socket=", Escape(endpoint.socket_name), " pid=", endpoint.pid,
                      " probe=", absl::Hex(endpoint.probe_address),
                      " nonce=", absl::Hex(endpoint.probe_value), " cma=", endpoint.cma ? 1 : 0);
}

absl::StatusOr<ShmEndpoint> ParseEndpoint(absl::string_view text) {
  std::vector<absl::string_view> fields = absl::StrSplit(text, ' ', absl::SkipEmpty());
  if (fields.empty() || fields[0] != kMagic) {
    return Invalid(text, absl::StrCat("does not start with \"", kMagic, "\""));
  }
  ShmEndpoint endpoint;
  bool has_host = false, has_socket = false, has_pid = false, has_probe = false, has_nonce = false;
  for (size_t i = 1; i < fields.size(); ++i) {
    const size_t eq = fields[i].find('=');
    if (eq == absl::string_view::npos) return Invalid(text, "field without '='");
    const absl::string_view key = fields[i].substr(0, eq);
    const std::optional<std::string> value = Unescape(fields[i].substr(eq + 1));
    if (!value.has_value()) return Invalid(text, absl::StrCat("bad escape in ", key));
    if (key == "host") {
      endpoint.host_id = *value;
      has_host = true;
    } else if (key == "socket") {
      endpoint.socket_name = *value;
      has_socket = !value->empty();
    } else if (key == "pid") {
      has_pid = absl::SimpleAtoi(*value, &endpoint.pid) && endpoint.pid > 0;
      if (!has_pid) return Invalid(text, "bad pid");
    } else if (key == "probe") {
      has_probe = absl::SimpleHexAtoi(*value, &endpoint.probe_address);
      if (!has_probe) return Invalid(text, "bad probe address");
    } else if (key == "cma") {
      if (*value != "0" && *value != "1") return Invalid(text, "bad cma (0 or 1)");
      endpoint.cma = *value == "1";
    } else if (key == "nonce") {
      has_nonce = absl::SimpleHexAtoi(*value, &endpoint.probe_value);
      if (!has_nonce) return Invalid(text, "bad nonce");
    }
    // Unknown keys are skipped: a newer peer may add fields.
  }
  if (!has_host || !has_socket || !has_pid || !has_probe || !has_nonce) {
    return Invalid(text, "missing one of host, socket, pid, probe, nonce");
  }
  return endpoint;
}

}  // namespace kvwire::transport::shm

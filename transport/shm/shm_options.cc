// ShmOptions (include/kvwire/shm_options.h): its checks and its by-name setter.
#include "kvwire/shm_options.h"

#include "src/util/option_range.h"

namespace kvwire {
namespace {

// Every option by its key (TransportOptions::Set), in the order of the struct.
template <typename Self, typename F>
void Fields(Self& o, F&& f) {
  f("cma", o.cma);
  f("deny_ptrace", o.deny_ptrace);
  f("revoke_on_close", o.revoke_on_close);
}

}  // namespace

absl::Status ShmOptions::Validate() const {
  if (cma && deny_ptrace) {
    return absl::InvalidArgumentError("shm.cma and shm.deny_ptrace cannot be combined");
  }
  return absl::OkStatus();
}

absl::Status ShmOptions::Set(absl::string_view key, absl::string_view value) {
  return SetOptionByName(kName, key, value, [this](auto&& f) { Fields(*this, f); });
}

absl::Status ShmOptions::Get(absl::string_view key, std::string* value) const {
  return GetOptionByName(kName, key, value, [this](auto&& f) { Fields(*this, f); });
}

std::vector<std::string> ShmOptions::Keys() const {
  return OptionKeys([this](auto&& f) { Fields(*this, f); });
}

}  // namespace kvwire

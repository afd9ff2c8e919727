// ShmOptions (include/kvwire/shm_options.h): its checks and its by-name setter.
#include "kvwire/shm_options.h"

#include "src/util/option_range.h"
#include "src/util/options_by_name.h"

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

KVWIRE_OPTIONS_BY_NAME(ShmOptions)

}  // namespace kvwire

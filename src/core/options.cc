#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

#include "kvwire/engine.h"
#include "src/util/log.h"
#include "src/util/option_range.h"

namespace kvwire {

const char* TransportKindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto:
      return "auto";
    case TransportKind::kTcp:
      return "tcp";
    case TransportKind::kShm:
      return "shm";
    case TransportKind::kRdma:
      return "rdma";
  }
  return "unknown";
}

absl::StatusOr<TransportKind> ParseTransportKind(const std::string& name) {
  for (TransportKind kind :
       {TransportKind::kAuto, TransportKind::kTcp, TransportKind::kShm, TransportKind::kRdma}) {
    if (name == TransportKindName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown transport \"", name, "\" (expected auto, tcp, shm or rdma)"));
}

absl::StatusOr<EngineOptions> EngineOptions::FromEnvironment(EngineOptions base) {
  auto env = [](const std::string& name) -> const char* {
    const char* value = std::getenv(name.c_str());
    return value != nullptr && *value != '\0' ? value : nullptr;
  };
  auto bad = [](const std::string& variable, const char* value, const absl::Status& why) {
    return absl::InvalidArgumentError(absl::StrCat(variable, "=", value, ": ", why.message()));
  };
  if (const char* v = env("KVWIRE_LISTEN")) base.listen_address = v;
  if (const char* v = env("KVWIRE_TRANSPORT")) base.transport = v;
  if (const char* v = env("KVWIRE_SECRET")) base.shared_secret = v;
  if (const char* v = env("KVWIRE_VERIFY_CHECKSUMS")) {
    if (absl::Status s = ParseOptionText("verify_checksums", v, &base.verify_checksums); !s.ok()) {
      return bad("KVWIRE_VERIFY_CHECKSUMS", v, s);
    }
  }
  if (const char* v = env("KVWIRE_WAIT_POLL_US")) {
    int64_t us = 0;
    if (absl::Status s = ParseOptionText("wait_poll", v, &us); !s.ok()) {
      return bad("KVWIRE_WAIT_POLL_US", v, s);
    }
    base.wait_poll = absl::Microseconds(us);
    if (absl::Status s = CheckOptionRange("wait_poll", base.wait_poll, absl::ZeroDuration(),
                                          absl::Milliseconds(10));
        !s.ok()) {
      return bad("KVWIRE_WAIT_POLL_US", v, s);
    }
  }
  // Every option of every transport, by name: KVWIRE_<TRANSPORT>_<KEY>. The older
  // KVWIRE_RDMA_QPS comes first, so that the full name wins when both are set.
  struct Variable {
    std::string name, transport, key;
  };
  std::vector<Variable> variables = {{"KVWIRE_RDMA_QPS", "rdma", "qps_per_peer"}};
  for (const std::string& transport : base.transports.Names()) {
    for (const std::string& key : base.transports.Find(transport)->Keys()) {
      variables.push_back(
          {absl::AsciiStrToUpper(absl::StrCat("KVWIRE_", transport, "_", key)), transport, key});
    }
  }
  for (const Variable& var : variables) {
    const char* v = env(var.name);
    TransportOptions* options = base.transports.Find(var.transport);
    if (v == nullptr || options == nullptr) continue;
    if (absl::Status s = options->Set(var.key, v); !s.ok()) return bad(var.name, v, s);
    // Range here too, so that the error names the variable that brought the value.
    if (absl::Status s = options->Validate(); !s.ok()) return bad(var.name, v, s);
  }
  if (const char* v = env("KVWIRE_LOG_LEVEL")) {
    LogLevel level;
    if (!ParseLogLevel(v, &level)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "KVWIRE_LOG_LEVEL=", v, ": not a log level (debug, info, warning, error, off)"));
    }
    SetLogLevel(level);
  }
  return base;
}

}  // namespace kvwire

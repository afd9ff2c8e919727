#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "kvwire/engine.h"
#include "src/util/log.h"

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

EngineOptions EngineOptions::FromEnvironment(EngineOptions base) {
  auto env = [](const char* name) -> const char* {
    const char* value = std::getenv(name);
    return value != nullptr && *value != '\0' ? value : nullptr;
  };
  if (const char* v = env("KVWIRE_LISTEN")) base.listen_address = v;
  if (const char* v = env("KVWIRE_TRANSPORT")) {
    if (auto kind = ParseTransportKind(v); kind.ok()) {
      base.transport = *kind;
    } else {
      KVW_LOG(kWarning, "options") << "ignoring KVWIRE_TRANSPORT: " << kind.status().message();
    }
  }
  if (const char* v = env("KVWIRE_TCP_CONNECTIONS")) {
    int n = 0;
    if (absl::SimpleAtoi(v, &n) && n > 0 && n <= 64) {
      base.tcp_connections = n;
    } else {
      KVW_LOG(kWarning, "options") << "ignoring KVWIRE_TCP_CONNECTIONS=" << v << " (1..64)";
    }
  }
  if (const char* v = env("KVWIRE_TCP_IO_THREADS")) {
    int n = 0;
    if (absl::SimpleAtoi(v, &n) && n >= 0 && n <= 64) {
      base.tcp_io_threads = n;
    } else {
      KVW_LOG(kWarning, "options") << "ignoring KVWIRE_TCP_IO_THREADS=" << v << " (0..64)";
    }
  }
  if (const char* v = env("KVWIRE_WAIT_POLL_US")) {
    int n = 0;
    if (absl::SimpleAtoi(v, &n) && n >= 0 && n <= 10000) {
      base.wait_poll = absl::Microseconds(n);
    } else {
      KVW_LOG(kWarning, "options") << "ignoring KVWIRE_WAIT_POLL_US=" << v << " (0..10000)";
    }
  }
  if (const char* v = env("KVWIRE_SECRET")) base.shared_secret = v;
  if (const char* v = env("KVWIRE_SHM_CMA")) base.shm_cma = std::string(v) == "1";
  if (const char* v = env("KVWIRE_SHM_DENY_PTRACE")) base.shm_deny_ptrace = std::string(v) == "1";
  if (const char* v = env("KVWIRE_RDMA_DEVICES")) {
    base.rdma_devices = absl::StrSplit(v, ',', absl::SkipEmpty());
  }
  if (const char* v = env("KVWIRE_RDMA_GID_INDEX")) {
    int n = 0;
    if (absl::SimpleAtoi(v, &n) && n >= -1 && n < 1024) {
      base.rdma_gid_index = n;
    } else {
      KVW_LOG(kWarning, "options") << "ignoring KVWIRE_RDMA_GID_INDEX=" << v << " (-1..1023)";
    }
  }
  if (const char* v = env("KVWIRE_RDMA_QPS")) {
    int n = 0;
    if (absl::SimpleAtoi(v, &n) && n > 0 && n <= 64) {
      base.rdma_qps_per_peer = n;
    } else {
      KVW_LOG(kWarning, "options") << "ignoring KVWIRE_RDMA_QPS=" << v << " (1..64)";
    }
  }
  if (const char* v = env("KVWIRE_LOG_LEVEL")) {
    LogLevel level;
    if (ParseLogLevel(v, &level)) {
      SetLogLevel(level);
    } else {
      KVW_LOG(kWarning, "options") << "ignoring KVWIRE_LOG_LEVEL=" << v;
    }
  }
  return base;
}

}  // namespace kvwire

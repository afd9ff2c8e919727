// ValidateConnectorOptions (kvwire/options_check.h), Connector::Create's one check of its
// options, and ConnectorOptions::FromEnvironment (kvwire/connector.h), the one reader of the
// KVWIRE_* environment.

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

#include "kvwire/connector.h"
#include "kvwire/options_check.h"
#include "src/discovery/etcd_client.h"
#include "src/discovery/instance.h"
#include "src/util/option_range.h"

namespace kvwire {

absl::Status ValidateConnectorOptions(const ConnectorOptions& o) {
  if (o.role != "prefill" && o.role != "decode" && o.role != "both") {
    return absl::InvalidArgumentError(
        absl::StrCat("role: \"", o.role, "\" is not a role (prefill, decode or both)"));
  }
  const absl::Duration ms = absl::Milliseconds(1);
  const absl::Duration day = absl::Hours(24);
  // Every range, in the order of ConnectorOptions (include/kvwire/connector.h).
  const absl::Status checks[] = {
      CheckOptionRange("mode", static_cast<uint32_t>(o.mode), 0, 2),
      CheckOptionRange("request_timeout", o.request_timeout, ms, day),
      CheckOptionRange("handshake_timeout", o.handshake_timeout, ms, day),
      CheckOptionRange("etcd_call_timeout", o.etcd_call_timeout, ms, absl::Minutes(10)),
      CheckOptionRange("etcd_lease_seconds", o.etcd_lease_seconds, 1, 86400),
  };
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  // Options that go together: half a pair, or discovery half configured, would be ignored
  // (or fail at the first etcd call) rather than do what the deployment meant.
  auto pair = [](const char* name, const std::string& value, const char* other,
                 const std::string& other_value) {
    if (value.empty() || !other_value.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(name, ": set without ", other));
  };
  const absl::Status pairs[] = {
      pair("etcd_user", o.etcd_user, "etcd_password", o.etcd_password),
      pair("etcd_password", o.etcd_password, "etcd_user", o.etcd_user),
      pair("etcd_cert_file", o.etcd_cert_file, "etcd_key_file", o.etcd_key_file),
      pair("etcd_key_file", o.etcd_key_file, "etcd_cert_file", o.etcd_cert_file),
      pair("etcd_user", o.etcd_user, "etcd_endpoints", o.etcd_endpoints),
      pair("etcd_ca_file", o.etcd_ca_file, "etcd_endpoints", o.etcd_endpoints),
      pair("etcd_cert_file", o.etcd_cert_file, "etcd_endpoints", o.etcd_endpoints),
      pair("etcd_endpoints", o.etcd_endpoints, "cluster", o.cluster),
      pair("cluster", o.cluster, "etcd_endpoints", o.etcd_endpoints),
  };
  for (const absl::Status& s : pairs) {
    if (!s.ok()) return s;
  }
  if (!o.cluster.empty()) {
    if (absl::Status s = discovery::CheckName("cluster", o.cluster); !s.ok()) return s;
  }
  return ValidateEngineOptions(o.engine);
}

absl::StatusOr<ConnectorOptions> ConnectorOptions::FromEnvironment(ConnectorOptions base) {
  absl::StatusOr<EngineOptions> engine = EngineOptions::FromEnvironment(std::move(base.engine));
  if (!engine.ok()) return engine.status();
  base.engine = *std::move(engine);
  auto env = [](const char* name) -> const char* {
    const char* value = std::getenv(name);
    return value != nullptr && *value != '\0' ? value : nullptr;
  };
  if (const char* v = env("KVWIRE_ETCD_USER")) base.etcd_user = v;
  if (const char* v = env("KVWIRE_ETCD_PASSWORD")) {
    base.etcd_password = v;
  } else if (const char* file = env("KVWIRE_ETCD_PASSWORD_FILE")) {
    absl::StatusOr<std::string> password = discovery::ReadPasswordFile(file);
    if (!password.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("KVWIRE_ETCD_PASSWORD_FILE=", file, ": ", password.status().message()));
    }
    base.etcd_password = *std::move(password);
  }
  if (const char* v = env("KVWIRE_ETCD_CACERT")) base.etcd_ca_file = v;
  if (const char* v = env("KVWIRE_ETCD_CERT")) base.etcd_cert_file = v;
  if (const char* v = env("KVWIRE_ETCD_KEY")) base.etcd_key_file = v;
  return base;
}

}  // namespace kvwire

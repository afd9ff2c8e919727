// What an instance publishes about itself in etcd, and where.
//
// Key layout (one key per instance, attached to the instance's lease):
//   /kvwire/<cluster>/instances/<engine id>  ->  InstanceRecord as JSON
// e.g. {"name": "dsv4-decode-1", "role": "decode", "kv_address": "127.0.0.1:40123",
//       "http_address": "127.0.0.1:8200", "transports": ["tcp", "shm"], "mode": "auto",
//       "compat_hash": "9f0c...", "layout": {"groups": 5, "layers": 4, ...}, "pid": 123}
// The engine id is the connector's engine name, the `engine_id` of kv_transfer_params, so a
// decode resolves a prefill named there with one key read.
#ifndef KVWIRE_SRC_DISCOVERY_INSTANCE_H_
#define KVWIRE_SRC_DISCOVERY_INSTANCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvwire::discovery {

struct InstanceRecord {
  std::string name;          // engine id
  std::string role;          // prefill | decode | both
  std::string kv_address;    // the engine's control channel, host:port
  std::string http_address;  // the serving API, host:port (empty: none)
  std::vector<std::string> transports;
  std::string mode;         // read | write | auto
  std::string compat_hash;  // hex of the handshake's compatibility hash
  nlohmann::json layout;    // summary of the KV layout (object; null when not registered)
  int64_t pid = 0;

  std::string ToJson() const;
  // Typed and bounded: a record another writer put under the prefix is an error, not a crash.
  static absl::StatusOr<InstanceRecord> FromJson(absl::string_view text);
};

// Cluster and instance names: 1 to 128 of [A-Za-z0-9._-] (they are path segments of keys).
absl::Status CheckName(absl::string_view what, absl::string_view name);
std::string ClusterPrefix(absl::string_view cluster);  // "/kvwire/<cluster>/instances/"
std::string InstanceKey(absl::string_view cluster, absl::string_view name);

}  // namespace kvwire::discovery

#endif  // KVWIRE_SRC_DISCOVERY_INSTANCE_H_

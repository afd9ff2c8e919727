// Typed, bounded parsing of what etcd's v3 JSON gateway answers (grpc-gateway's encoding of
// the etcdserverpb messages: keys and values are base64, 64-bit integers are decimal strings,
// fields at their default value are left out, and an error is {"error", "message", "code"}).
// etcd is trusted more than a peer, but a wrong endpoint (or a proxy in front of it) may answer
// anything: every field is type-checked and size-capped, nothing throws.
#ifndef KVWIRE_SRC_DISCOVERY_ETCD_JSON_H_
#define KVWIRE_SRC_DISCOVERY_ETCD_JSON_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvwire::discovery {

// What one answer may hold (a discovery prefix holds one small record per instance).
inline constexpr size_t kEtcdMaxBodyBytes = 8 << 20;
inline constexpr size_t kEtcdMaxKeyBytes = 1024;
inline constexpr size_t kEtcdMaxValueBytes = 64 << 10;
inline constexpr size_t kEtcdMaxKvs = 10000;

struct EtcdKv {
  std::string key, value;  // decoded from base64
  int64_t create_revision = 0, mod_revision = 0, version = 0, lease = 0;
};

struct EtcdRange {
  int64_t revision = 0;  // of the store when the range was read
  std::vector<EtcdKv> kvs;
  bool more = false;
};

struct EtcdLease {
  int64_t id = 0;
  int64_t ttl = 0;  // seconds; 0 from a keep-alive: the lease is gone
};

struct EtcdWatchEvent {
  bool deleted = false;  // else a put
  EtcdKv kv;
};

struct EtcdWatchMessage {
  int64_t revision = 0;
  int64_t watch_id = 0;
  bool created = false, canceled = false;
  int64_t compact_revision = 0;  // nonzero: the start revision was compacted away
  std::string cancel_reason;
  std::vector<EtcdWatchEvent> events;
};

// An answer that is {"error": ..., "message": ..., "code": N} (or a non-200 status) as a
// status whose code is etcd's gRPC code (NotFound for "requested lease not found", ...);
// OK when `body` is not an error.
absl::Status EtcdError(int http_status, absl::string_view body);

absl::StatusOr<EtcdRange> ParseRangeResponse(absl::string_view body);
// Put and deleterange: the store revision after the change (deleterange: and the count).
absl::StatusOr<int64_t> ParseHeaderRevision(absl::string_view body, int64_t* deleted = nullptr);
absl::StatusOr<EtcdLease> ParseLeaseGrantResponse(absl::string_view body);
// /v3/auth/authenticate: the token every later call carries.
absl::StatusOr<std::string> ParseAuthenticateResponse(absl::string_view body);
// /v3/lease/keepalive answers {"result": {...}} (a streaming call's one message).
absl::StatusOr<EtcdLease> ParseKeepAliveResponse(absl::string_view body);
// One message of the /v3/watch stream: {"result": {...}} or {"error": {...}}.
absl::StatusOr<EtcdWatchMessage> ParseWatchMessage(absl::string_view line);

// The range_end that selects every key starting with `prefix` (etcd's "prefix + 1").
std::string PrefixRangeEnd(absl::string_view prefix);

}  // namespace kvwire::discovery

#endif  // KVWIRE_SRC_DISCOVERY_ETCD_JSON_H_

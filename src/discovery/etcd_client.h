// A client of etcd's v3 API through its JSON gateway (POST /v3/kv/range, /v3/kv/put,
// /v3/kv/deleterange, /v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke, /v3/watch).
//
// Why the gateway and not gRPC: the gateway is part of every etcd v3 server (3.4 serves it
// at /v3/), so this needs nothing beyond Boost.Beast, which the tree already uses; libkvwire
// stays free of gRPC and of generated etcd stubs (Debian ships no C++ etcd client); and every
// call gets the same explicit deadline as the rest of kvwire's I/O. What the gateway costs
// (base64 keys, 64-bit integers as strings, a watch as a chunked HTTP stream) is contained in
// etcd_json.cc, which is fuzzed.
//
// Every call has a deadline (EtcdOptions::call_timeout); with several endpoints (members of
// one cluster) a call that cannot reach one member, or gets no answer from it in its share of
// the deadline, goes to the next, and the client remembers the member that answered.
#ifndef KVWIRE_SRC_DISCOVERY_ETCD_CLIENT_H_
#define KVWIRE_SRC_DISCOVERY_ETCD_CLIENT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/discovery/etcd_json.h"
#include "src/discovery/http_exchange.h"
#include "src/util/mutex.h"

namespace kvwire::discovery {

struct EtcdOptions {
  // "http://host:port" or "https://host:port" of one or more members, comma-separated.
  std::string endpoints;
  absl::Duration call_timeout = absl::Seconds(3);
  // etcd's own authentication (`etcdctl auth enable`): the client takes a token from
  // /v3/auth/authenticate with this user and password, sends it with every call, and takes a
  // new one when etcd says it expired. Empty user: no authentication.
  std::string user{};
  std::string password{};
  // TLS (https:// endpoints): the CA that signed the members' certificates (PEM; empty: the
  // system's CAs), and a client certificate and key (PEM) for members started with
  // --client-cert-auth. A member's certificate must be valid for the endpoint's host.
  // (The {} initializers let callers name only the fields they set.) The client reads no
  // environment: ConnectorOptions::FromEnvironment (kvwire/connector.h) is kvwire's one reader
  // of KVWIRE_ETCD_*.
  std::string ca_file{};
  std::string cert_file{};
  std::string key_file{};
};

// The first line of `path` (a password file, as etcd's and most tools' take it).
absl::StatusOr<std::string> ReadPasswordFile(const std::string& path);

// Stops a Watch in progress from another thread.
class WatchCancel {
 public:
  void Cancel();
  bool cancelled();

 private:
  friend class EtcdClient;
  Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  HttpExchange* current_ ABSL_GUARDED_BY(mu_) = nullptr;
};

class EtcdClient {
 public:
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdOptions options);

  const std::string& endpoints() const { return options_.endpoints; }
  // Takes a token now (OK without authentication), so that a wrong user or password shows
  // at start rather than at the first call.
  absl::Status Authenticate() { return Token().status(); }

  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value, int64_t lease = 0);
  absl::StatusOr<EtcdRange> Get(const std::string& key);
  absl::StatusOr<EtcdRange> GetPrefix(const std::string& prefix);
  // The number of keys deleted.
  absl::StatusOr<int64_t> Delete(const std::string& key);
  absl::StatusOr<EtcdLease> GrantLease(int64_t ttl_seconds);
  // One keep-alive; NotFound when the lease has expired or was revoked.
  absl::StatusOr<EtcdLease> KeepAlive(int64_t lease);
  // Revokes a lease, deleting every key attached to it.
  absl::Status Revoke(int64_t lease);

  // Watches every key under `prefix` from `start_revision` and hands each message to
  // `on_message` (false stops). Returns when `deadline` passes (OK: the caller resumes from
  // the last revision it saw), when `cancel` is cancelled (Cancelled), or on an error (the
  // stream broke: the caller lists again and resumes). Not retried on other members here.
  absl::Status Watch(const std::string& prefix, int64_t start_revision, absl::Time deadline,
                     const std::function<bool(const EtcdWatchMessage&)>& on_message,
                     WatchCancel* cancel);

 private:
  explicit EtcdClient(EtcdOptions options, std::vector<HttpEndpoint> endpoints,
                      std::shared_ptr<boost::asio::ssl::context> tls);
  // POSTs to the member that answered last, then to the others, within one call deadline;
  // with authentication, once more with a new token when etcd refused the one it had.
  absl::StatusOr<std::string> Call(const std::string& target, const std::string& body);
  absl::StatusOr<std::string> CallOnce(const std::string& target, const std::string& body,
                                       const std::string& token);
  // The token to send ("" without authentication): the one held, or a new one.
  absl::StatusOr<std::string> Token();
  // Forgets `token` (etcd refused it), so that the next Token() authenticates again.
  void DropToken(const std::string& token);
  HttpExchangeOptions ExchangeOptions(const std::string& token) const;

  const EtcdOptions options_;
  const std::vector<HttpEndpoint> endpoints_;
  const std::shared_ptr<boost::asio::ssl::context> tls_;
  std::atomic<size_t> preferred_{0};
  Mutex token_mu_;
  std::string token_ ABSL_GUARDED_BY(token_mu_);
};

}  // namespace kvwire::discovery

#endif  // KVWIRE_SRC_DISCOVERY_ETCD_CLIENT_H_

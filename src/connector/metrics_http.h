// Optional HTTP endpoint serving the connector's metrics (Prometheus text and JSON).
#ifndef KVWIRE_SRC_CONNECTOR_METRICS_HTTP_H_
#define KVWIRE_SRC_CONNECTOR_METRICS_HTTP_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvwire::connector_internal {

// GET /metrics (Prometheus text) and GET /stats.json (JSON snapshot), one request per
// connection, served by one Boost.Asio thread without a blocking call: a client that never
// sends or never reads holds one of `max_connections` slots until its deadline, and never the
// server or its destruction.
class MetricsServer {
 public:
  // handler(json) returns the JSON snapshot when `json`, else the Prometheus text.
  using Handler = std::function<std::string(bool json)>;
  struct Limits {
    // Connections served at once; more are closed as soon as they are accepted.
    size_t max_connections = 16;
    // From accept to the last byte of the answer; a slower client is dropped.
    absl::Duration deadline = absl::Seconds(10);
    // Request line and headers.
    size_t max_request_bytes = 8192;
  };
  // Listens on "host:port" (port 0 picks one; see address()).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              Handler handler);
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              Handler handler, Limits limits);
  // Stops at once: connections still open are dropped, whatever their clients do.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  const std::string& address() const { return address_; }

  class Impl;

 private:
  explicit MetricsServer(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
  std::string address_;
};

}  // namespace kvwire::connector_internal

#endif  // KVWIRE_SRC_CONNECTOR_METRICS_HTTP_H_

// Optional HTTP endpoint serving the connector's metrics (Prometheus text and JSON).
#ifndef KVWIRE_SRC_CONNECTOR_METRICS_HTTP_H_
#define KVWIRE_SRC_CONNECTOR_METRICS_HTTP_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace kvwire::connector_internal {

class MetricsServer {
 public:
  // handler(json) returns the JSON snapshot when `json`, else the Prometheus text.
  using Handler = std::function<std::string(bool json)>;
  // Listens on "host:port" (port 0 picks one; see address()).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              Handler handler);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  const std::string& address() const { return address_; }

 private:
  MetricsServer(int fd, Handler handler) : fd_(fd), handler_(std::move(handler)) {}
  void Loop();

  const int fd_;
  const Handler handler_;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvwire::connector_internal

#endif  // KVWIRE_SRC_CONNECTOR_METRICS_HTTP_H_

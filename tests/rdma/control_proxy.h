// A control-channel man in the middle for hostile-peer tests: it joins one client (a peer
// engine that dials it) to a target engine's control port, forwards every byte unchanged,
// shows each frame the target sends to an observer, and can slip extra frames to the client
// as if the target had sent them. A peer that owns its end of the connection can do exactly
// this, so a forged ExportRegions through the proxy is what a hostile peer's own modified
// engine would see: the data path (the rdma QPs) still goes straight to the target.
#ifndef KVWIRE_TESTS_RDMA_CONTROL_PROXY_H_
#define KVWIRE_TESTS_RDMA_CONTROL_PROXY_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "proto/kvwire.pb.h"
#include "src/util/mutex.h"

namespace kvwire::testing {

class ControlProxy {
 public:
  // Sees each complete frame the target sends to the client (proxy thread).
  using Observer = std::function<void(const pb::Envelope&)>;

  // Listens on 127.0.0.1 (a free port); the first client to connect within `accept_timeout`
  // is joined to `target` ("host:port").
  static absl::StatusOr<std::unique_ptr<ControlProxy>> Start(
      const std::string& target, Observer observer,
      absl::Duration accept_timeout = absl::Seconds(120));
  ~ControlProxy();
  ControlProxy(const ControlProxy&) = delete;
  ControlProxy& operator=(const ControlProxy&) = delete;

  // What the client dials, "127.0.0.1:port".
  std::string address() const;
  // Sends `envelope` to the client between two of the target's frames. FailedPrecondition
  // before a client connected or after either side closed.
  absl::Status Inject(const pb::Envelope& envelope);

 private:
  ControlProxy() = default;
  void Run(const std::string& target, absl::Duration accept_timeout);
  absl::Status WriteToClient(const char* data, size_t size);

  int listen_fd_ = -1;
  uint16_t port_ = 0;
  Observer observer_;
  std::atomic<bool> stop_{false};
  Mutex client_mu_;  // one frame at a time toward the client
  int client_fd_ ABSL_GUARDED_BY(client_mu_) = -1;
  bool open_ ABSL_GUARDED_BY(client_mu_) = false;
  int target_fd_ = -1;  // proxy thread only
  std::thread thread_;
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_RDMA_CONTROL_PROXY_H_

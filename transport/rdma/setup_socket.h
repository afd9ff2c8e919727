// The rdma transport's connection-setup socket: one length-prefixed protobuf request and one
// reply per TCP connection, with deadlines. Blocking; used by Connect (within its deadline),
// by QP re-creation (on a background thread) and by the accept thread.
#ifndef KVWIRE_TRANSPORT_RDMA_SETUP_SOCKET_H_
#define KVWIRE_TRANSPORT_RDMA_SETUP_SOCKET_H_

#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "google/protobuf/message_lite.h"

namespace kvwire::transport::rdma {

// Sends `request` to host:port and parses the reply into `reply`, all before `deadline`.
absl::Status SetupCall(const std::string& host, uint16_t port,
                       const google::protobuf::MessageLite& request,
                       google::protobuf::MessageLite* reply, absl::Time deadline);

class SetupServer {
 public:
  // Handles one request (serialized bytes) and returns the serialized reply.
  using Handler = std::function<std::string(const std::string& request)>;
  static absl::StatusOr<std::unique_ptr<SetupServer>> Listen(const std::string& host,
                                                             Handler handler);
  SetupServer() = default;  // use Listen
  ~SetupServer();
  uint16_t port() const { return port_; }
  void Stop();

 private:
  void Run();

  int listen_fd_ = -1;
  int wake_fd_ = -1;
  uint16_t port_ = 0;
  Handler handler_;
  std::thread thread_;
};

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_SETUP_SOCKET_H_

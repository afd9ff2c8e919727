// A tcp Channel: the initiator's link to one peer, made of `lanes` data connections
// (ClientConnection); a PostRequest goes to connection `lane % lanes`.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_CHANNEL_H_
#define KVWIRE_TRANSPORT_TCP_TCP_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "transport/tcp/tcp_client_connection.h"
#include "transport/transport.h"

namespace kvwire::transport {

// Dials one data connection of `link`, presents the token, and starts it. Errors name the
// endpoint and the lane: DeadlineExceeded, Unavailable, Unauthenticated (token refused), ...
// `staging` moves the connection's ops on device memory; `pool` runs the connection.
absl::StatusOr<std::shared_ptr<ClientConnection>> OpenLane(const PeerLink& link, uint32_t lane,
                                                           int socket_buffer_bytes,
                                                           const GpuStaging& staging,
                                                           const std::shared_ptr<IoPool>& pool);

class TcpChannel final : public Channel {
 public:
  // `verify_checksums`: the connections check every op end to end (shown by Describe).
  TcpChannel(std::string endpoint, std::vector<std::shared_ptr<ClientConnection>> connections,
             bool verify_checksums = false);
  // Closes and joins the connections (unless on a thread of their I/O pool: the transport
  // then reaps them later).
  ~TcpChannel() override;

  void Post(PostRequest request, DoneCallback done) override;
  // tcp needs nothing per remote region: the target validates every op.
  absl::Status AddRemoteRegions(const std::vector<RemoteRegionDesc>& regions) override {
    return absl::OkStatus();
  }
  void RemoveRemoteRegions(const std::vector<RegionId>& ids) override {}
  void Close(const absl::Status& reason) override;
  std::string Describe() const override;

 private:
  const std::string endpoint_;
  const std::vector<std::shared_ptr<ClientConnection>> connections_;
  const bool verify_checksums_;
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_CHANNEL_H_

// The initiator side of the fd protocol: one request, one reply, within a deadline.
#ifndef KVWIRE_TRANSPORT_SHM_FD_CLIENT_H_
#define KVWIRE_TRANSPORT_SHM_FD_CLIENT_H_

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "transport/shm/fd_protocol.h"
#include "transport/shm/unique_fd.h"

namespace kvwire::transport::shm {

struct FdResponse {
  FdReply reply;
  UniqueFd fd;  // the region's memfd on a successful fetch
};

// Sends `request` on `socket` and waits for its reply. An error here (as opposed to an error
// reply) leaves the connection unusable: a late reply would answer the next request.
absl::StatusOr<FdResponse> CallFdServer(int socket, const FdRequest& request, absl::Time deadline);

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_FD_CLIENT_H_

// One gather send of a tcp data connection: protocol headers and payloads in wire order, some
// payloads perhaps in device memory. The writer (requests) and the target (responses) build
// one per batch and call Send, which picks the path: a list of host memory only goes out
// zero-copy in one SendAll; a list with a device payload goes through the connection's
// staging buffers (tcp_staging.h). The loops that build it never branch on where memory is.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_GATHER_H_
#define KVWIRE_TRANSPORT_TCP_TCP_GATHER_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "transport/tcp/tcp_staging.h"

namespace kvwire::transport {

class GatherList {
 public:
  // Room for `entries` entries without reallocating.
  void Reserve(size_t entries);
  void Clear();

  // Host bytes (a header); joins the previous host entry when it ends where these begin, so
  // that a run of headers in one array is one iovec.
  void AddHeader(const std::byte* data, size_t length);
  // Payload bytes at `data`, in host memory (`device` < 0) or on GPU `device`.
  void AddPayload(const std::byte* data, uint64_t length, int device);

  // Sends every byte in order. `staging` is used only when a payload lies in device memory;
  // when this returns, no copy reads the list's memory any more (also on error).
  absl::Status Send(int fd, StagedSender& staging);

  // True when some payload lies in device memory (then only Send can send the list).
  bool staged() const { return staged_; }
  // Non-blocking send of a host-only list: sends what the socket takes, remembers where it
  // stopped, and returns true once every byte is out (false: wait until it is writable and
  // call again). The list's memory must stay valid until then.
  absl::StatusOr<bool> SendSome(int fd);

 private:
  std::vector<iovec> iov_;
  std::vector<int> devices_;  // by iov_ entry: -1 for host memory
  std::vector<StagedSender::Piece> pieces_;
  bool staged_ = false;  // some entry is device memory
  size_t sent_ = 0;      // SendSome: iov_ entries fully sent
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_GATHER_H_

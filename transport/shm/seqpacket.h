// Unix-domain SOCK_SEQPACKET sockets in the abstract namespace (no file to clean up, gone with
// the process), carrying whole messages and, optionally, one file descriptor each.
// All sockets are non-blocking; waiting is bounded by a deadline.
#ifndef KVWIRE_TRANSPORT_SHM_SEQPACKET_H_
#define KVWIRE_TRANSPORT_SHM_SEQPACKET_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

#include "transport/shm/unique_fd.h"

namespace kvwire::transport::shm {

// Longest abstract socket name (sun_path minus the leading NUL).
inline constexpr size_t kMaxSocketNameBytes = 107;

absl::StatusOr<UniqueFd> ListenSeqpacket(const std::string& name, int backlog);
// Retries while the listener's backlog is full, until `deadline`.
absl::StatusOr<UniqueFd> ConnectSeqpacket(const std::string& name, absl::Time deadline);
// Accepts one pending connection; Unavailable when none is pending.
absl::StatusOr<UniqueFd> AcceptSeqpacket(int listener);

// Sends `bytes` as one message, with `fd_to_pass` (if >= 0) as SCM_RIGHTS. Waits for buffer
// space until `deadline` (pass absl::Now() never to wait).
absl::Status SendMessage(int socket, absl::string_view bytes, int fd_to_pass, absl::Time deadline);

struct ReceivedMessage {
  bool eof = false;  // the peer closed the connection
  std::string bytes;
  UniqueFd fd;  // a descriptor that came with the message, if any (extra ones are closed)
};
// Waits until `deadline` for one message of at most `max_bytes` (longer: InvalidArgument).
// DeadlineExceeded when none came in time.
absl::StatusOr<ReceivedMessage> ReceiveMessage(int socket, size_t max_bytes, absl::Time deadline);

// The same into `buffer` (the caller's, kept from one message to the next; one byte larger
// than the longest message allowed, so that a longer one is recognised): `bytes` is the
// message within it. A deadline in the past (absl::InfinitePast()) only takes a message that
// is there already.
struct ReceivedView {
  bool eof = false;
  absl::string_view bytes;
  UniqueFd fd;
};
absl::StatusOr<ReceivedView> ReceiveMessageInto(int socket, absl::Span<char> buffer,
                                                absl::Time deadline);

// Waits until `socket` has `events` (POLLIN/POLLOUT) or `deadline`; false on timeout.
absl::StatusOr<bool> WaitFor(int socket, short events, absl::Time deadline);

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_SEQPACKET_H_

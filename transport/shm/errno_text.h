// Errno formatting for error messages and logs: "EPERM (Operation not permitted)".
#ifndef KVWIRE_TRANSPORT_SHM_ERRNO_TEXT_H_
#define KVWIRE_TRANSPORT_SHM_ERRNO_TEXT_H_

#include <string>

#include "absl/status/status.h"

namespace kvwire::transport::shm {

// Symbolic name and description of `err`.
std::string ErrnoText(int err);

// A status with `code` whose message is "<what>: <ErrnoText(err)>".
absl::Status ErrnoStatus(absl::StatusCode code, int err, const std::string& what);

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_ERRNO_TEXT_H_

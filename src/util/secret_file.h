// Reading a deployment's shared secret from a file, for the tools that take --secret-file
// (kvwire-perf, kvwire-dsv4). A file is the recommended way to pass a secret: argv is visible
// to every local user in /proc/<pid>/cmdline and in `ps`, and the environment to the same uid
// in /proc/<pid>/environ.
#ifndef KVWIRE_UTIL_SECRET_FILE_H_
#define KVWIRE_UTIL_SECRET_FILE_H_

#include <string>

#include "absl/status/statusor.h"

namespace kvwire {

inline constexpr size_t kMaxSecretFileBytes = 4096;

// The file's bytes less one trailing newline ("\n" or "\r\n"). Refused, with an error naming
// the file and the fix: not a regular file, writable by group or others, readable by others
// (chmod 600 or 640), empty, or larger than kMaxSecretFileBytes. Symlinks are followed
// (Kubernetes mounts secrets through them); the checks apply to the file they reach.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);

}  // namespace kvwire

#endif  // KVWIRE_UTIL_SECRET_FILE_H_

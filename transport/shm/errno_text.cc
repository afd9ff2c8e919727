#include "transport/shm/errno_text.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvwire::transport::shm {

std::string ErrnoText(int err) {
  const char* name = ::strerrorname_np(err);
  char buffer[128];
  // GNU strerror_r returns a pointer that may or may not point into `buffer`.
  const char* description = ::strerror_r(err, buffer, sizeof(buffer));
  if (name == nullptr) return absl::StrCat("errno ", err, " (", description, ")");
  return absl::StrCat(name, " (", description, ")");
}

absl::Status ErrnoStatus(absl::StatusCode code, int err, const std::string& what) {
  return absl::Status(code, absl::StrCat(what, ": ", ErrnoText(err)));
}

}  // namespace kvwire::transport::shm

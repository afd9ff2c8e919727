#include "src/util/secret_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvwire {

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open secret file ", path, ": ", std::strerror(errno)));
  }
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  // Checked on the opened file, not the name, so a rename in between cannot swap it.
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot stat secret file ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("secret file ", path, " is not a regular file"));
  }
  const unsigned mode = st.st_mode & 07777;
  if ((mode & (S_IWGRP | S_IWOTH | S_IROTH)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("secret file %s can be %s by other users (mode %04o): chmod 600 %s", path,
                        (mode & (S_IWGRP | S_IWOTH)) != 0 ? "written" : "read", mode, path));
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxSecretFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("secret file ", path, " is ", st.st_size,
                                                   " bytes (at most ", kMaxSecretFileBytes, ")"));
  }
  std::string secret;
  char buf[kMaxSecretFileBytes + 1];
  while (secret.size() <= kMaxSecretFileBytes) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot read secret file ", path, ": ", std::strerror(errno)));
    }
    if (n == 0) break;
    secret.append(buf, static_cast<size_t>(n));
  }
  // The size was checked before reading; a file that grew since is refused all the same.
  if (secret.size() > kMaxSecretFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("secret file ", path, " is larger than ", kMaxSecretFileBytes, " bytes"));
  }
  if (secret.ends_with("\r\n")) {
    secret.resize(secret.size() - 2);
  } else if (secret.ends_with('\n')) {
    secret.pop_back();
  }
  if (secret.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("secret file ", path, " is empty"));
  }
  return secret;
}

}  // namespace kvwire

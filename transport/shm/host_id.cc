// LocalHostId(): which peers can share memory with this process.
#include <cerrno>
#include <fcntl.h>
#include <string>
#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

#include "transport/shm/errno_text.h"
#include "transport/shm/shm_transport.h"
#include "transport/shm/unique_fd.h"

namespace kvwire::transport {
namespace {

std::string ReadBootId() {
  shm::UniqueFd fd(::open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return absl::StrCat("boot_id?(", shm::ErrnoText(errno), ")");
  char buffer[64];
  const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
  if (n <= 0) return "boot_id?";
  return std::string(absl::StripAsciiWhitespace(absl::string_view(buffer, n)));
}

// "ipc:[4026531839]": the namespace's inode, unique while it exists.
std::string NamespaceId(const char* name) {
  char buffer[128];
  const std::string path = absl::StrCat("/proc/self/ns/", name);
  const ssize_t n = ::readlink(path.c_str(), buffer, sizeof(buffer));
  if (n <= 0) return absl::StrCat(name, ":?");
  return std::string(buffer, static_cast<size_t>(n));
}

}  // namespace

std::string LocalHostId() {
  // Same boot: same kernel. Same IPC and mount namespaces: the same container (memfds pass
  // anywhere, but peers in other containers should not be treated as local). Same network
  // namespace: abstract Unix socket names live there, so a peer in another one cannot
  // reach our socket at all.
  // Not cached: a process may move to other namespaces (setns, unshare).
  return absl::StrCat(ReadBootId(), ",", NamespaceId("ipc"), ",", NamespaceId("mnt"), ",",
                      NamespaceId("net"));
}

}  // namespace kvwire::transport

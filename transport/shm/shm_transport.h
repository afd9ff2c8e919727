// shm transport: both engines on one host. memfd-backed regions are mapped once by the peer
// (fds passed over a Unix socket with SCM_RIGHTS) and data moves with one memcpy by the
// initiator; other host memory moves with cross-memory attach (process_vm_readv/writev) when
// the kernel permits it.
#ifndef KVWIRE_TRANSPORT_SHM_SHM_TRANSPORT_H_
#define KVWIRE_TRANSPORT_SHM_SHM_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "transport/transport.h"

namespace kvwire::transport {

struct ShmTransportOptions {
  // Identifies this host (and IPC namespace); equal on both sides = reachable.
  // Empty: derived from /proc/sys/kernel/random/boot_id and the IPC/mount namespace ids.
  std::string host_id;
  // Engine name, used to name the Unix socket in the abstract namespace.
  std::string engine_name;
  bool allow_cma = true;
};

absl::StatusOr<std::unique_ptr<Transport>> CreateShmTransport(const ShmTransportOptions& options,
                                                              TargetHooks* hooks);

// This host's identity as used by the shm transport (boot id + namespaces).
std::string LocalHostId();

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_SHM_SHM_TRANSPORT_H_

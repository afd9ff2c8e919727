// The shm transport's options (EngineOptions::transports["shm"], or EngineOptions::shm()),
// checked by their own Validate() (transport/shm/shm_options.cc); see docs/SECURITY-shm.md.
#ifndef KVWIRE_SHM_OPTIONS_H_
#define KVWIRE_SHM_OPTIONS_H_

#include "kvwire/transport_options.h"

namespace kvwire {

struct ShmOptions : TransportOptionsOf<ShmOptions> {
  static constexpr char kName[] = "shm";

  // Cross-memory attach for host memory that is not a whole ShareableBuffer, offered to and
  // used on peers that opt in too (ShmTransportOptions::allow_cma). Off: such regions move
  // over tcp, validated by the target, and the engine says so in its log and peer stats.
  // On: any peer that opted in too can read and write ALL of this process's memory.
  bool cma = false;
  // Makes the process non-dumpable so that other processes of the same uid cannot reach its
  // memory through ptrace access (process_vm_*, /proc/<pid>/mem, /proc/<pid>/fd); see
  // ShmTransportOptions::deny_ptrace for the side effects. Cannot be combined with cma.
  bool deny_ptrace = false;
  // A peer's close moves the buffers it was handed onto fresh memfds, as Unexport and
  // DeregisterMemory do (ShmTransportOptions::revoke_on_peer_close), so a closed peer's kept
  // mapping reaches none of the owner's later bytes. The application's own threads that write
  // into such a buffer through its pages during the move wait in the kernel until it is over
  // (userfaultfd write-protection: Linux 5.19+), so none of those writes is lost. Not covered:
  // writes that do not go through the CPU's page tables (a device's DMA into pinned pages:
  // keep such buffers off shm exports), and, where the kernel allows this process only a
  // user-mode guard (no CAP_SYS_PTRACE and vm.unprivileged_userfaultfd=0), a system call
  // that writes into the buffer during the move (a read(2) into it) fails with EFAULT
  // instead of waiting; the log says which guard is in use. Where no guard is available, the
  // shm transport turns this off and says why in its log: a closed peer then keeps its
  // mapping until the buffer is unexported or deregistered (docs/SECURITY-shm.md).
  bool revoke_on_close = true;

  absl::Status Validate() const override;
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::Status Get(absl::string_view key, std::string* value) const override;
  std::vector<std::string> Keys() const override;
};

}  // namespace kvwire

#endif  // KVWIRE_SHM_OPTIONS_H_

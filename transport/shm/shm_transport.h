// shm transport: both engines on one host. memfd-backed regions are mapped once by the peer
// (fds passed over a Unix socket with SCM_RIGHTS) and data moves with one memcpy by the
// initiator; other host memory moves with cross-memory attach (process_vm_readv/writev) when
// the kernel permits it. GPU memory (kGpu regions, with a gpu_runtime) moves with runtime
// copies on device streams between allocations opened from IPC handles, which the exporting
// side puts in its region keys (gpu_region_key.h).
#ifndef KVWIRE_TRANSPORT_SHM_SHM_TRANSPORT_H_
#define KVWIRE_TRANSPORT_SHM_SHM_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/gpu/runtime.h"
#include "transport/transport.h"

namespace kvwire::transport {

struct ShmTransportOptions {
  // The runtime of kGpu regions (the engine's); null (or the "none" runtime): GPU memory is
  // refused, caps().gpu_memory is false.
  gpu::Runtime* gpu_runtime = nullptr;
  // Identifies this host (and IPC namespace); equal on both sides = reachable.
  // Empty: derived from /proc/sys/kernel/random/boot_id and the IPC/mount namespace ids.
  std::string host_id;
  // Engine name, used to name the Unix socket in the abstract namespace.
  std::string engine_name;
  // Cross-memory attach (process_vm_readv/writev) for host regions that are not
  // memfd-backed, both ways: this engine offers it to peers (its endpoint says so) and uses it
  // on peers that offer it. Off by default: an initiator using it can read and write ANY
  // memory of the target, not only what was exported (the kernel checks ptrace access, not
  // regions), so a target must opt in. When both sides opt in, the initiator still checks that
  // the peer's shm socket belongs to a process of its own uid with the pid the peer claimed
  // (SO_PEERCRED), so a peer cannot point it at a third process. Without it such regions are
  // refused here (FailedPrecondition naming the reason) and the engine reports that it routes
  // them over tcp, where the target validates every access.
  bool allow_cma = false;
  // Moves a ShareableBuffer onto a fresh memfd when a peer that was handed its memfd closes
  // (docs/SECURITY-shm.md), as Unexport and DeregisterMemory always do. The move runs on the
  // transport's own thread (never the I/O thread that noticed the close), with the engine's
  // own ops on the buffer held off (TargetHooks::QuiesceRange) and the application's own
  // writes into it held in the kernel (shm/write_guard.h). Only where that write guard works:
  // elsewhere the transport turns this off, saying why in its log. Not when the owner's engine
  // is being destroyed (Transport::Stopping): its peers' closes then move nothing.
  bool revoke_on_peer_close = true;
  // Makes this process non-dumpable (prctl(PR_SET_DUMPABLE, 0)), so that the kernel denies
  // other processes of the same uid without CAP_SYS_PTRACE what the ptrace access check
  // guards: process_vm_readv/writev, /proc/<pid>/mem, and opening /proc/<pid>/fd/* (which
  // would reach every memfd of this process, exported or not). Without it a same-uid process
  // can reach all of this process's memory whatever kvwire does. Process-wide side effects:
  // no core dumps (unless fs.suid_dumpable says otherwise), no debugger/profiler attach by the
  // same user, /proc/<pid>/ files owned by root. Off by default for those reasons. Refused
  // together with allow_cma (peers could not use it).
  bool deny_ptrace = false;
  // Prefault the page tables of a peer's region when it is mapped (AddRemoteRegions), and
  // touch each page once through the new mapping, so the first copies into it do not pay one
  // page fault per 4 KiB (nor, on some VMs, a first-touch cost of ~10x a copy: mapping.h).
  // This allocates the region's pages in the peer's memfd if the peer has not touched them yet
  // (as RDMA registration would), and makes mapping a region cost about one pass over its
  // pages.
  bool populate_mappings = true;
  // Bound on each request for a region's memfd (AddRemoteRegions) and on Connect's handshake.
  absl::Duration request_timeout = absl::Seconds(10);
  // Longest op the engine should hand to Post (one memcpy each).
  uint64_t max_op_bytes = uint64_t{1} << 30;
  // Incoming connections served at once; more are refused (a local process could otherwise
  // exhaust this process's descriptors).
  size_t max_connections = 256;
  // The fd socket is in the abstract namespace, open to every local uid: a connection that has
  // not presented a valid session token (of a peer whose handshake pid is known and is the
  // connecting process's) within `auth_timeout` is closed, and one uid may hold at most
  // `max_unauthenticated_per_uid` such connections, so idle connections cannot keep legitimate
  // peers out of `max_connections`.
  absl::Duration auth_timeout = absl::Seconds(5);
  size_t max_unauthenticated_per_uid = 16;
  // Served copies: the staging memfds (4 MiB each, one per peer) one process's connections may
  // hold at once (256 MiB), so that a process handshaking as many peers cannot claim
  // max_connections of them (1 GiB). Beyond, the ask is refused (not reported), and asked again
  // by the next op. At least 1.
  size_t max_stagings_per_process = 64;
};

// The statistics the shm transport reports (group "gpu"), at zero.
std::vector<TransportStat> ShmTransportStats();

// Starts the transport's socket server. `hooks` (not null) must outlive the transport.
absl::StatusOr<std::unique_ptr<Transport>> CreateShmTransport(const ShmTransportOptions& options,
                                                              TargetHooks* hooks);

// This host's identity as used by the shm transport (boot id + namespaces).
std::string LocalHostId();

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_SHM_SHM_TRANSPORT_H_

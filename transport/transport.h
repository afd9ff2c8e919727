// The interface between the engine and a transport. A transport knows regions, peers'
// endpoints and ops; it knows nothing of KV caches, layouts or requests.
//
// Life of a transfer: the engine validates and plans the ops (merge, split, stripe into
// lanes), picks the transport from the Capabilities every transport declares
// (src/core/route.h), then calls Channel::Post once per lane. A Channel is this transport's link to
// one peer. On the target, a transport that carries data itself (tcp) asks the engine, through
// TargetHooks, to validate every incoming op before it touches memory.
#ifndef KVWIRE_TRANSPORT_TRANSPORT_H_
#define KVWIRE_TRANSPORT_TRANSPORT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

#include "kvwire/engine.h"
#include "kvwire/stats.h"

namespace kvwire::gpu {
class Runtime;
}  // namespace kvwire::gpu

namespace kvwire::transport {

// Sends one message of this transport's own to a peer on the engine's control channel (its
// setup messages, e.g. rdma's QP exchange, ride there: the channel already authenticated the
// peer). The bytes are opaque to the engine: it wraps them in a TransportControl envelope
// named after the transport and hands them to the same transport on the other side
// (Transport::OnControlMessage).
using ControlSender = std::function<absl::Status(std::string payload)>;

// What a transport can do and what it costs; the engine routes from this, never from the
// transport's name (src/core/route.h).
struct Capabilities {
  std::string name;  // "tcp", "shm", "rdma": in the Hello, logs, stats, forced preferences
  // Cost: among the transports that can carry a transfer, the lowest rank wins. Built-ins:
  // shm 10 (one memcpy), rdma 20 (NIC, zero copy), tcp 30 (kernel sockets).
  uint32_t rank = 100;
  // Which op kinds the transport carries; routing never hands it the other kind.
  bool one_sided_read = true;
  bool one_sided_write = true;
  // Reachability: only peers on this host (the transport's CanReach decides exactly).
  bool same_host_only = false;
  // The target serves every region exported to the peer (it validates each op itself through
  // TargetHooks::ResolveIncoming), so the channel reaches every region without a per-region
  // key. Without it a region is reachable only once Channel::AddRemoteRegions accepted it.
  // When the best transport to a peer lacks this, the engine also connects the best one that
  // has it, for the regions the first cannot reach.
  bool reaches_every_region = false;
  // The target learns of each arriving WRITE piece and reports it with
  // TargetHooks::OnWriteArrived; notifications are gated on that count.
  bool counts_arrivals = false;
  // The target checks the READ grant each op carries (PostRequest::grant, through
  // TargetHooks::ResolveIncoming): READs of grant-guarded regions are routed only here.
  bool checks_grants = false;
  uint64_t max_op_bytes = UINT64_MAX;  // the engine splits longer ops
  uint32_t max_lanes = 1;              // parallel streams per peer the engine may stripe over
  uint32_t lanes_per_peer = 1;         // streams to open per peer (PeerLink::lanes, <= max_lanes)
  // Memory kinds: moves host memory (MemoryKind::kHost) / device memory (MemoryKind::kGpu)
  // correctly. The engine registers a region only with transports that move its kind, and
  // never routes a transfer that touches local memory of a kind through a transport without it.
  bool host_memory = true;
  bool gpu_memory = false;
  // Channel::Post of a request whose ops are host memory on both sides always calls its
  // DoneCallback before it returns, in the calling thread (shm: memcpy or cross-memory
  // attach). The engine then keeps a one-op transfer out of its transfer table (issue 24).
  bool ends_host_ops_inline = false;
};

// A region of this engine, as registered with a transport.
struct LocalRegion {
  RegionId id = 0;
  std::byte* base = nullptr;
  uint64_t length = 0;
  uint32_t access = kAccessNone;
  MemoryKind kind = MemoryKind::kHost;
  // RegionOptions::reads_need_grant: READs only under a grant the target checks
  // (TargetHooks::ResolveIncoming). A transport whose target cannot check one per op never
  // lets a peer read the region (shm: no mapping, no key; rdma: no remote-read access).
  bool reads_need_grant = false;
  // kGpu: the device, and the runtime allocation around [base, base + length) (IPC handles
  // and dma-bufs cover whole allocations; a region may be any part of one).
  int gpu_device = -1;
  std::byte* gpu_allocation_base = nullptr;
  uint64_t gpu_allocation_size = 0;
};

// A region a peer exported to this engine.
struct RemoteRegionDesc {
  RegionId id = 0;
  uint64_t length = 0;
  uint32_t access = kAccessNone;
  MemoryKind kind = MemoryKind::kHost;
  uint64_t address = 0;  // base address in the peer's process
  // The peer serves READs of it only under a grant (LocalRegion::reads_need_grant): they are
  // routed only to transports with Capabilities::checks_grants.
  bool reads_need_grant = false;
  // The peer's Transport::RegionKey for the transport this desc is handed to (rdma: its
  // rkeys; shm: whether a memfd backs the region), opaque. A fixed array: the struct stays
  // trivially copyable.
  static constexpr size_t kMaxKeyBytes = 120;
  uint32_t key_length = 0;
  char key[kMaxKeyBytes] = {};
  // False (and no key) when `k` is longer than kMaxKeyBytes.
  bool SetKey(std::string_view k) {
    if (k.size() > kMaxKeyBytes) return false;
    std::memcpy(key, k.data(), k.size());
    key_length = static_cast<uint32_t>(k.size());
    return true;
  }
  std::string_view Key() const { return std::string_view(key, key_length); }
};

// One op after planning: validated, local address resolved, at most max_op_bytes long.
struct WireOp {
  std::byte* local = nullptr;
  RegionId remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
  int32_t local_gpu_device = -1;  // >= 0: `local` is memory of that device (kGpu region)
  // The registered region `local` lies in (the id the transport got in RegisterRegion): a
  // transport finds its own state for it (rdma: the MR's lkey) by id, never by address.
  RegionId local_region = 0;
};

// A lane's ops and a transfer's pins. Inline storage for the common small transfer (one op,
// one or two local regions), so that posting one does not allocate.
using WireOps = absl::InlinedVector<WireOp, 1>;
using Pins = absl::InlinedVector<std::shared_ptr<const void>, 2>;

// One lane's share of a transfer.
struct PostRequest {
  TransferId transfer_id = 0;
  OpKind kind = OpKind::kWrite;
  uint32_t lane = 0;
  // WRITE pieces are counted by the target (the transfer carries a notification).
  bool count_arrivals = false;
  // TransferOptions::grant, presented with every op (checks_grants transports carry it).
  GrantId grant = 0;
  WireOps ops;
  // Set by the engine when the transfer has already ended (deadline, deregistration, peer
  // death): a transport must not write into local memory for it any more (drain instead).
  std::shared_ptr<std::atomic<bool>> cancelled;
  // The transfer's deadline. A transport that waits in the caller's thread for the request to
  // end (Capabilities::ends_host_ops_inline) waits no longer than this: the engine watches no
  // deadline for a transfer that may end inline.
  absl::Time deadline = absl::InfiniteFuture();
  // Keeps the local regions of the ops alive; released when the request is destroyed.
  Pins pins;
};

// Runs exactly once per Post, on any thread, when all ops of the request completed (OK) or
// the first failed (its status names the op and the reason).
using DoneCallback = std::function<void(absl::Status)>;

// Memory the engine resolved for an incoming op; `pin` keeps it registered while in use.
struct IncomingAccess {
  std::byte* data = nullptr;
  int gpu_device = -1;  // >= 0: `data` is memory of that device (kGpu region)
  std::shared_ptr<const void> pin;
};

// One incoming op of a run (TargetHooks::ResolveIncomingRun): `length` bytes at `offset` of
// this engine's region `region`.
struct IncomingOp {
  RegionId region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// Where one op of a run lies (no pin of its own: the run's pin holds them all).
struct IncomingMemory {
  std::byte* data = nullptr;
  int gpu_device = -1;  // >= 0: `data` is memory of that device (kGpu region)
};

// What ResolveIncomingRun allowed: the leading ops [0, resolved), held by `pin` (their memory
// registered, and counted as ops being served until it is released); `status` says why op
// `resolved` was refused (OK when every op was resolved).
struct IncomingRun {
  size_t resolved = 0;
  absl::Status status;
  std::shared_ptr<const void> pin;
};

// Services of the engine for the target side of a transport.
class TargetHooks {
 public:
  virtual ~TargetHooks() = default;
  // Which peer owns a session token (handed out in the handshake); Unauthenticated if none.
  virtual absl::StatusOr<PeerId> PeerForToken(const std::string& token) = 0;
  // Validates an incoming op from `peer`: region exported to it, bounds, permission
  // (kRemoteRead for READ, kRemoteWrite for WRITE). The error names every value. GPU memory
  // is refused unless every transport that serves incoming ops (reaches_every_region) moves it.
  virtual absl::StatusOr<IncomingAccess> ResolveIncoming(PeerId peer, RegionId region,
                                                         uint64_t offset, uint64_t length,
                                                         OpKind kind) = 0;
  // The same for an op that carries a read grant (Capabilities::checks_grants): a READ of a
  // grant-guarded region is served only inside a live grant of `grant` to `peer`. The default
  // (hooks without grants, e.g. tests' fakes) ignores the grant.
  virtual absl::StatusOr<IncomingAccess> ResolveIncoming(PeerId peer, RegionId region,
                                                         uint64_t offset, uint64_t length,
                                                         OpKind kind, GrantId grant) {
    return ResolveIncoming(peer, region, offset, length, kind);
  }
  // ResolveIncoming with `grant` for each of `ops` in order, as one run served together (a
  // served copy's slot): stops at the first op refused. `memory` has one entry per op; those
  // of the resolved ops are set. The default asks ResolveIncoming once per op; the engine's
  // checks a run with one trip through each of its locks, not one per op.
  virtual IncomingRun ResolveIncomingRun(PeerId peer, absl::Span<const IncomingOp> ops, OpKind kind,
                                         GrantId grant, absl::Span<IncomingMemory> memory);
  // A number that changes whenever any access a peer had may have ended (a grant revoked, a
  // region unexported, deregistered or about to move): an access checked while it held one
  // value may be used for an op accepted later while it still holds it. The default (hooks
  // that take nothing back) never changes.
  virtual uint64_t AccessEpoch() { return 0; }
  // Looks up a region exported to `peer` (shm maps it); NotFound / PermissionDenied if not.
  virtual absl::StatusOr<LocalRegion> ExportedRegion(PeerId peer, RegionId region) = 0;
  // A WRITE piece of `transfer_id` from `peer` is now visible in memory.
  virtual void OnWriteArrived(PeerId peer, TransferId transfer_id) = 0;
  // The peer broke the protocol or was refused; the engine drops that peer (only it).
  virtual void OnPeerError(PeerId peer, const absl::Status& error) = 0;
  // The pid the peer announced in its handshake, 0 if unknown. The shm transport serves a
  // session token only to the process with that pid (SO_PEERCRED of its Unix socket), so a
  // token that leaked (e.g. read off the control connection) is no use to another process;
  // while it is 0 the token is not served (a request waits for it until the connection's
  // authentication deadline, then is refused).
  virtual uint32_t PeerProcessId(PeerId peer) { return 0; }
  // A transport is about to move the host memory [base, base + length) onto new pages at the
  // same addresses (shm revocation: a fresh memfd mapped over a ShareableBuffer). While the
  // returned hold lives, the engine starts no op of its own on a region overlapping the range
  // (its Transfer waits for the hold to end, within the transfer's deadline; ResolveIncoming
  // answers an incoming op with transport/region_moving.h's status, never waiting: the
  // transport tries the op again later, tcp parks it), and before it returns it waits, until
  // `deadline`, for the ops already running there to end. Ops still running at the deadline are the
  // engine's to fail (their bytes may miss the new pages); the move goes on regardless, since a
  // peer's kept mapping must lose the memory. Null: nothing to hold.
  class RangeHold {
   public:
    virtual ~RangeHold() = default;
  };
  virtual std::unique_ptr<RangeHold> QuiesceRange(const std::byte* base, uint64_t length,
                                                  absl::Time deadline) {
    return nullptr;
  }
};

inline IncomingRun TargetHooks::ResolveIncomingRun(PeerId peer, absl::Span<const IncomingOp> ops,
                                                   OpKind kind, GrantId grant,
                                                   absl::Span<IncomingMemory> memory) {
  IncomingRun run;
  auto pins = std::make_shared<std::vector<std::shared_ptr<const void>>>();
  pins->reserve(ops.size());
  for (const IncomingOp& op : ops) {
    absl::StatusOr<IncomingAccess> access =
        ResolveIncoming(peer, op.region, op.offset, op.length, kind, grant);
    if (!access.ok()) {
      run.status = access.status();
      break;
    }
    memory[run.resolved++] = IncomingMemory{access->data, access->gpu_device};
    pins->push_back(std::move(access->pin));
  }
  run.pin = std::move(pins);
  return run;
}

// What a Channel needs to reach one peer.
struct PeerLink {
  PeerId peer = 0;
  std::string peer_name;
  std::string remote_endpoint;  // the peer's Transport::Endpoint()
  std::string token;            // issued by the peer; presented on every data connection
  uint32_t remote_pid = 0;
  uint32_t lanes = 1;  // data connections to open (<= caps().max_lanes)
  // EngineOptions::verify_checksums of either side: every op of this channel is checked end
  // to end with CRC32C (src/util/crc32c.h) and a mismatch fails it with DataLoss. A transport
  // that cannot check some op says so in its Describe() and docs (docs/CHECKSUMS.md).
  bool verify_checksums = false;
  absl::Time deadline = absl::InfiniteFuture();
  ControlSender send_control;  // to this peer; valid while the channel lives
};

// This transport's link to one peer (initiator side).
class Channel {
 public:
  virtual ~Channel() = default;
  // Starts the ops of one lane; `done` runs exactly once. Never blocks on the network; may
  // complete inline (shm copies in the caller's thread).
  virtual void Post(PostRequest request, DoneCallback done) = 0;
  // The peer exported (or re-described) regions; called before any op targets them.
  virtual absl::Status AddRemoteRegions(const std::vector<RemoteRegionDesc>& regions) = 0;
  virtual void RemoveRemoteRegions(const std::vector<RegionId>& ids) = 0;
  // Whether ops between local device memory and `region` (added) can go over this channel.
  // False makes the engine route transfers with local device memory that touch it elsewhere
  // (shm's served copies, served_copy.h, move host memory only).
  virtual bool MovesDeviceMemory(RegionId region) const { return true; }
  // Fails everything in flight with `reason` and releases the connections. Idempotent.
  virtual void Close(const absl::Status& reason) = 0;
  // For logs and stats, e.g. "tcp x4 127.0.0.1:40123", "shm memfd+cma".
  virtual std::string Describe() const = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const Capabilities& caps() const = 0;
  // Data the peer needs to reach this transport (opaque to the engine), sent in the Hello.
  virtual std::string Endpoint() const = 0;
  // Called by RegisterMemory, before the region is visible to any peer.
  virtual absl::Status RegisterRegion(const LocalRegion& region) = 0;
  virtual void DeregisterRegion(RegionId id) = 0;
  // Opaque key a peer needs to access a registered region through this transport (rdma:
  // its rkeys), exported with the region; empty when the transport needs none.
  virtual std::string RegionKey(RegionId id) const { return std::string(); }
  // The key for `peer` when the engine exports region `id` to it (called on every export; the
  // same key again for a region already exported to it). A transport that can confine a key
  // to one peer does it here (rdma: an MR in that peer's own protection domain); the default
  // is the region's one key. Empty: the transport does not carry this region.
  virtual absl::StatusOr<std::string> ExportKey(PeerId peer, RegionId id) { return RegionKey(id); }
  // The export of `id` to `peer` is withdrawn: the key ExportKey gave it stops working before
  // this returns. DeregisterRegion does this for every peer, DropPeer for every region.
  virtual void RevokeExport(PeerId peer, RegionId id) {}
  // Whether this transport can reach a peer that advertised `remote_endpoint` (e.g. shm: same
  // host). The reason is logged and shown in stats either way.
  virtual absl::Status CanReach(const std::string& remote_endpoint) const = 0;
  // Opens the data path to one peer, within link.deadline.
  virtual absl::StatusOr<std::unique_ptr<Channel>> Connect(const PeerLink& link) = 0;
  // Stops serving: closes listeners and every incoming connection of the peer.
  virtual void DropPeer(PeerId peer) = 0;
  // The peer's control connection closed with `reason`: fail at once whatever waits for its
  // reply on that channel (e.g. rdma's QP exchange), which would otherwise wait out its
  // deadline while the engine's worker, busy with that very wait, cannot run the close.
  // Runs on the connection's I/O thread, only while the engine still counts the peer alive and
  // under its peer lock: must not block or call into the engine; DropPeer follows on the worker.
  virtual void AbortPending(PeerId peer, const absl::Status& reason) {}
  // A control message of this transport (a payload its peer sent with a ControlSender)
  // arrived from `peer`; `reply` sends on that peer's control channel. Runs on the channel's
  // I/O thread. Malformed payloads are this transport's to refuse (TargetHooks::OnPeerError).
  virtual void OnControlMessage(PeerId peer, const std::string& payload,
                                const ControlSender& reply) {}
  // Adds this transport's values to `stats`, which already lists every statistic its
  // declaration (see DeclareStat) named, at zero: AddStat / SetStatText below.
  virtual void AddStats(std::vector<TransportStat>* stats) const {}
  // The engine is being destroyed: what it does from now on (closing every peer, then
  // Shutdown) need not outlast it (shm: a peer's close moves no buffer any more).
  virtual void Stopping() {}
  // Stops everything (called before the engine is destroyed).
  virtual void Shutdown() = 0;
};

// What a transport factory (TransportFactory, kvwire/engine.h) gets from the engine that
// creates the transport; valid for the transport's life.
struct TransportContext {
  const EngineOptions* options = nullptr;
  std::string engine_name;
  std::string listen_host;  // host of the engine's control listener ("127.0.0.1" by default)
  gpu::Runtime* gpu_runtime = nullptr;
  TargetHooks* hooks = nullptr;
};

// Transport statistics. A transport declares what it reports in a function that needs no
// running transport (e.g. RdmaTransportStats()), so that the engine lists them, at zero,
// also when it is not running; its AddStats then adds the values.
inline TransportStat DeclareStat(std::string transport, std::string group, std::string name,
                                 TransportStat::Kind kind, std::string metric = "",
                                 std::string help = "") {
  TransportStat s;
  s.transport = std::move(transport);
  s.group = std::move(group);
  s.name = std::move(name);
  s.kind = kind;
  s.metric = std::move(metric);
  s.help = std::move(help);
  return s;
}

// The statistic `group`/`name` of `stats`; appended (a counter, JSON only) if no declaration
// listed it.
inline TransportStat& StatOf(std::vector<TransportStat>* stats, std::string_view group,
                             std::string_view name) {
  for (TransportStat& s : *stats) {
    if (s.group == group && s.name == name) return s;
  }
  stats->push_back(TransportStat{});
  stats->back().group = std::string(group);
  stats->back().name = std::string(name);
  return stats->back();
}
inline void AddStat(std::vector<TransportStat>* stats, std::string_view group,
                    std::string_view name, uint64_t value) {
  StatOf(stats, group, name).value += value;
}
inline void SetStatText(std::vector<TransportStat>* stats, std::string_view group,
                        std::string_view name, std::string text) {
  StatOf(stats, group, name).text = std::move(text);
}

// The transports every engine tries to create: the one list a new built-in transport is
// added to. Adding one is a folder (transport/<name>/: a Transport subclass declaring its
// Capabilities, and a factory) and one line in BuiltinTransports() (plus its folder's
// kvwire_component line in CMakeLists.txt); the core routes it from its Capabilities and never
// names it. Both are defined in transport/builtin_transports.cc, the one file that includes the
// concrete transports (it is linked into libkvwire; the core includes only this header). A
// transport from outside the library registers with one line instead:
// EngineOptions::extra_transports (tests/transport/pipe is one).
std::vector<TransportFactory> BuiltinTransports();

// The statistics every built-in transport declares, at zero: an engine lists them also for a
// transport that is not running on this machine (rdma without a device), so its stats keep
// their shape.
std::vector<TransportStat> BuiltinTransportStats();

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TRANSPORT_H_

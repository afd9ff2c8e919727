// kvwire::Engine: registers memory, connects to peers, and moves bytes between them with
// one-sided READ and WRITE transfers that always end.
#ifndef KVWIRE_ENGINE_H_
#define KVWIRE_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

#include "kvwire/memory.h"
#include "kvwire/rdma_options.h"
#include "kvwire/shm_options.h"
#include "kvwire/stats.h"
#include "kvwire/tcp_options.h"
#include "kvwire/transport_options.h"

namespace kvwire {

using RegionId = uint64_t;    // unique within one engine, never reused
using PeerId = uint64_t;      // unique within one engine, never reused
using TransferId = uint64_t;  // unique within one engine, never reused (64-bit: no wrap)
// A read grant (Engine::Grant): unique within the granting engine, never reused; 0 is none.
using GrantId = uint64_t;

enum class OpKind : uint32_t { kRead = 0, kWrite = 1 };

// The built-in transports, for tools that take one from their users (perf). Options name a
// transport by its name (EngineOptions::transport, ConnectOptions::transport: "auto", "tcp",
// "shm", "rdma", or an outside transport's), so this enum only converts: TransportKindName
// gives the name; ParseTransportKind names the accepted values when it refuses one.
enum class TransportKind : uint32_t { kAuto = 0, kTcp = 1, kShm = 2, kRdma = 3 };
const char* TransportKindName(TransportKind kind);
absl::StatusOr<TransportKind> ParseTransportKind(const std::string& name);

namespace transport {
class Transport;
struct TransportContext;
}  // namespace transport

// Creates one transport for an engine (the interface: transport/transport.h). Returns null,
// with OK, when the transport cannot run here (e.g. no RDMA device; the factory logs why); an
// error fails Engine::Create.
using TransportFactory = std::function<absl::StatusOr<std::unique_ptr<transport::Transport>>(
    const transport::TransportContext&)>;

// One one-sided operation. READ copies remote -> local, WRITE copies local -> remote.
struct Op {
  RegionId local_region = 0;
  uint64_t local_offset = 0;
  RegionId remote_region = 0;  // an id the peer exported to this engine
  uint64_t remote_offset = 0;
  uint64_t length = 0;
};

struct EngineOptions {
  // Name shown to peers and in logs. Default: "kvwire-<pid>-<random>".
  std::string name;

  // Control-channel listen address, "host:port". Port 0 picks a free port (see address()).
  // Empty: do not listen (the engine can still dial out).
  std::string listen_address = "127.0.0.1:0";

  // Transport used for peers, by name: "auto" picks, per peer and per transfer, the
  // best-ranked transport (Capabilities::rank: shm on the same host when the regions allow it,
  // else rdma when both sides have a device that reaches the other, else tcp) and reports why.
  // Any other name forces that transport: a built-in ("tcp", "shm", "rdma") or an outside one
  // (extra_transports) whose options are in `transports` (Engine::Create refuses a name
  // without options, naming the known ones). A forced transport that cannot reach a peer
  // fails Connect with the reason. A forced transport whose target cannot check read grants
  // (shm, rdma) gets tcp too, used only for regions the peer guards with grants
  // (RegionOptions::reads_need_grant).
  std::string transport = "auto";

  // Each transport's own options, by the transport's name (kvwire/transport_options.h): the
  // built-ins' (tcp(), shm(), rdma() below) are there from the start; an outside transport
  // puts its own (transports.Put, or transports.Get<ItsOptions>()). Engine::Create calls every
  // one's Validate(); by name: transports.Set("tcp", "io_poll", "50us").
  TransportOptionsMap transports;
  TcpOptions& tcp() { return transports.Get<TcpOptions>(); }
  const TcpOptions& tcp() const { return transports.Get<TcpOptions>(); }
  ShmOptions& shm() { return transports.Get<ShmOptions>(); }
  const ShmOptions& shm() const { return transports.Get<ShmOptions>(); }
  RdmaOptions& rdma() { return transports.Get<RdmaOptions>(); }
  const RdmaOptions& rdma() const { return transports.Get<RdmaOptions>(); }

  // Transports added to the built-in ones (transport/builtin_transports.cc): Create calls each
  // factory once, and a transport it returns is routed like the others, from its
  // Capabilities (e.g. tests/transport/pipe/pipe_transport.h, which lives in tests/ only).
  std::vector<TransportFactory> extra_transports;

  // Ops longer than this are split into pieces (striped across connections); at most 64 MiB.
  uint64_t max_op_bytes = 1 << 20;

  // Transfers below this size use one connection (striping costs more than it gains).
  uint64_t stripe_min_bytes = 256 << 10;

  // Largest control-channel frame accepted (bytes).
  uint32_t max_frame_bytes = 16 << 20;

  // Heartbeats are sent every `heartbeat_interval`; a peer silent for `peer_lease` is dead,
  // and every transfer bound to it fails.
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  absl::Duration peer_lease = absl::Seconds(5);

  // Deadline for Connect (dial, handshake, data connections).
  absl::Duration connect_timeout = absl::Seconds(10);

  // Default deadline of a transfer when TransferOptions::timeout is not set.
  absl::Duration transfer_timeout = absl::Seconds(30);

  // Engine::Wait watches for the transfer's end this long before it sleeps: a transfer that
  // ends meanwhile costs no futex wake (the thread that ends it) and no sleep and reschedule
  // (the waiter); one 4 KiB tcp op on an idle 2-core VM: ~12 us instead of ~85. Only while
  // the core is the waiter's: a waiter that was preempted while it watched (the thread's CPU
  // time fell behind the wall clock) sleeps at once, and the engine's waiters then sleep at
  // once for a backoff that doubles while the cores stay busy; at most cores-1 waiters watch
  // at once (src/util/spin_gate.h). Zero: sleep at once. 0..10ms.
  absl::Duration wait_poll = absl::Microseconds(50);

  // Shared secret of a deployment. When set, peers prove knowledge of it with
  // HMAC-SHA256 challenge-response; peers without it are rejected. Empty: no check.
  std::string shared_secret;

  // Mixed into the compatibility hash checked at handshake, e.g. a hash of the model and
  // layout: engines with different values refuse each other.
  uint64_t compat_salt = 0;

  // Threads running the control channel.
  int io_threads = 1;

  // End-to-end checksums (docs/CHECKSUMS.md): each op's bytes are checked with CRC32C between
  // the memory they were read from and the memory they landed in, so that a corruption the
  // path's own checks miss (tcp's 16-bit checksum passes about one corrupted segment in
  // 65,536) fails the transfer with DataLoss, naming the transfer, op and peer, instead of
  // landing as a success. Used with a peer when either side sets it (the handshake says so).
  // Covers host memory over tcp, shm (memfd mappings) and rdma (one control round trip per
  // lane after its completion); not device memory, nor shm's cross-memory attach
  // (docs/CHECKSUMS.md says why). Costs a CRC pass over the bytes on each side (hardware
  // CRC32C where the CPU has it); figures in perf/RESULTS.md.
  bool verify_checksums = false;

  // Largest payload of an engine message (SendMessage), both ways: a peer that sends a larger
  // one is closed with an error naming the size. Must stay below max_frame_bytes.
  uint32_t max_message_bytes = 1 << 20;

  // --- bounds on what peers (authenticated or not) can make this engine hold ---
  // Every inbound control handshake, all stages together, must finish within connect_timeout
  // of its accept (an absolute deadline: trickling bytes does not extend it).
  // Inbound control handshakes not yet finished (unauthenticated) at once; a dialer beyond it
  // is refused with ResourceExhausted ("too many control handshakes in flight (limit N)").
  int max_pending_handshakes = 64;
  // Of those, from one source address: one host cannot keep the control port refusing every
  // other dialer ("too many control handshakes in flight from ADDR (limit N)").
  int max_pending_handshakes_per_source = 16;
  // Inbound control connections open at once (handshaking plus established); beyond it a
  // dialer is refused with ResourceExhausted ("too many control connections (limit N)").
  int max_control_connections = 1024;
  // Bytes queued on one control connection for a peer that does not read; a peer that lets
  // more pile up is closed (ResourceExhausted, in its Goodbye). At least max_frame_bytes + 4.
  uint64_t max_control_send_queue_bytes = 64 << 20;
  // Notifications delivered but not yet taken (TakeNotifications / WaitNotification). Past
  // it, a newly complete notification is dropped, counted in
  // EngineStats::control.notifications_dropped and logged. Notifications still waiting for
  // their data are bounded by the same number: a peer that exceeds it is closed.
  uint64_t max_undrained_notifications = 1 << 16;
  // Closed peers kept for Peers()/Stats() (with their close reason); older ones are forgotten.
  int closed_peers_kept = 16;

  // Returns `base` with the engine's KVWIRE_* environment variables applied: with
  // ConnectorOptions::FromEnvironment (kvwire/connector.h), which calls it for the engine part
  // and adds the connector's KVWIRE_ETCD_*, the one place the library reads the environment,
  // and only a caller's call reads it (Engine::Create, Connector::Create, the C API's
  // kvw_*_options_create and Python's Engine()/Connector() never do; C's
  // kvw_*_options_from_environment and Python's *Options.from_environment call these, and
  // the tools call them for their users). A variable that is set and non-empty REPLACES base's
  // value (callers that want their own value to win set it after this call); unset or empty
  // variables leave base's value. The variables:
  //   KVWIRE_LISTEN             listen_address, taken as is
  //   KVWIRE_TRANSPORT          transport, a name (checked by Engine::Create)
  //   KVWIRE_SECRET             shared_secret, taken as is
  //   KVWIRE_<T>_<KEY>          option <key> of transport <t> (upper case), for every option of
  //                             every transport in base.transports, as TransportOptions::Set
  //                             takes it: KVWIRE_TCP_CONNECTIONS=8, KVWIRE_TCP_IO_POLL=50us,
  //                             KVWIRE_SHM_CMA=1, KVWIRE_RDMA_DEVICES=mlx5_0,mlx5_1,
  //                             KVWIRE_RDMA_GID_INDEX=3
  //   KVWIRE_RDMA_QPS           rdma qps_per_peer (its older name)
  //   KVWIRE_VERIFY_CHECKSUMS   verify_checksums: 1/0/true/false
  //   KVWIRE_WAIT_POLL_US       wait_poll in microseconds, 0..10000
  //   KVWIRE_LOG_LEVEL          not an option: sets the process-wide log level at once
  // A bad value fails the call with InvalidArgument naming the variable and, where it parsed
  // but is out of range, the option and its range ("KVWIRE_TCP_CONNECTIONS=0:
  // tcp.connections: 0 is out of range (1..64)").
  static absl::StatusOr<EngineOptions> FromEnvironment(EngineOptions base);
};

// Defaults: a region may be read AND written by every peer it is exported to (access
// kRemoteReadWrite), but it is exported to none: only to the peers named in
// ConnectOptions::exports or Export, unless export_to_all_peers is set. Pass kRemoteRead to
// make a region read-only for peers.
struct RegionOptions {
  // What a peer the region is exported to may do (kvwire::Access); local access is always
  // allowed.
  uint32_t access = kRemoteReadWrite;
  MemoryKind kind = MemoryKind::kHost;
  // kGpu: the device the memory belongs to; -1 = ask the GPU runtime (either way the runtime
  // must confirm it: a host pointer registered as kGpu, or the wrong device, is refused).
  int gpu_device = -1;
  // Exported to every peer (present and future) without a per-peer Export call.
  bool export_to_all_peers = false;
  // Peers may READ the region only where this engine granted them (Engine::Grant): a READ
  // is served only for ranges of a live grant to the peer presenting it
  // (TransferOptions::grant), checked by the target for every op. Transports whose target
  // cannot check a grant never serve READs of such a region: shm does not map it (a mapping
  // reads everything; its owner copies each checked op instead, served copies) and rdma
  // exports it to peers without remote-read access, so rdma READs of it go over tcp (see
  // docs/SECURITY.md, "Read grants"). WRITEs are unaffected.
  bool reads_need_grant = false;
};

// A range of a local region that Engine::Grant lets one peer READ.
struct GrantRange {
  RegionId region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct ConnectOptions {
  // Regions exported to this peer during the handshake.
  std::vector<RegionId> exports;
  // Overrides EngineOptions::transport for this peer (a transport's name, or "auto").
  std::optional<std::string> transport;
};

struct TransferOptions {
  // Delivered to the peer after all data of the transfer is visible there.
  std::optional<std::string> notification;
  // Deadline relative to submission; default EngineOptions::transfer_timeout.
  std::optional<absl::Duration> timeout;
  // Called exactly once when the transfer ends (succeeded, failed, deadline exceeded, peer
  // closed, engine shutting down) with its final status, so that a caller need not poll.
  // It runs on the engine's completion thread: one callback at a time, in the order the
  // transfers ended, never under an engine lock and never inside Transfer() (a shm copy that
  // ends inline is still reported from that thread). The status goes to the callback alone:
  // Poll and Wait of such a transfer answer NotFound once it has ended. The callback may call
  // the engine (Transfer, SendMessage, ...) but must not block for long (it delays the other
  // callbacks), throw, or destroy the engine. Every callback has run when ~Engine returns.
  std::function<void(TransferId, const absl::Status&)> on_complete;
  // READ: the grant the target engine gave this engine (Engine::Grant on its side; the
  // protocol layered on the engine carries its id), presented with every op. Needed for
  // regions the target registered with RegionOptions::reads_need_grant; ignored elsewhere.
  GrantId grant = 0;
};

enum class TransferState { kPending, kSucceeded, kFailed };

struct Notification {
  PeerId peer = 0;
  std::string peer_name;
  TransferId transfer_id = 0;  // the sender's transfer id
  std::string payload;
};

// What an Inbox delivers: a message a peer sent with Engine::SendMessage, the end of a
// peer (Goodbye, lease expiry, I/O or protocol error, local Disconnect or shutdown), or (only
// to an inbox opened with region_events) that regions the peer exported became usable.
struct InboxEvent {
  enum class Kind : uint32_t { kMessage = 0, kPeerClosed = 1, kRegionsReady = 2 };
  Kind kind = Kind::kMessage;
  PeerId peer = 0;
  std::string peer_name;
  // kMessage: the message; kPeerClosed: why the peer closed; kRegionsReady: empty.
  std::string payload;
};

struct InboxOptions {
  // Bytes of undelivered payload this inbox may hold. A peer whose message would exceed it is
  // closed (ResourceExhausted, named in its Goodbye): a consumer that stops taking never makes
  // the engine grow without bound.
  uint64_t max_queued_bytes = 64 << 20;
  // Also deliver kPeerClosed events.
  bool peer_events = true;
  // Also deliver kRegionsReady events: one each time regions a peer exported become usable
  // (WaitForRemoteRegion would return for them), so that a consumer waiting for a peer's
  // regions sleeps until they arrive instead of polling. Off by default: consumers written
  // before this kind existed never see it.
  bool region_events = false;
  // Called after each event is queued, on the engine thread that queued it, so that a
  // consumer waiting on several sources (transfer ends, messages) can sleep on one condition
  // of its own instead of polling Wait. It runs while the engine holds its message lock: it
  // must only record or signal (e.g. a condition variable), never call the engine or block.
  std::function<void()> on_event;
};

// The receiving end of one message topic (Engine::OpenInbox). Events come in arrival order;
// the messages of one peer keep their send order and come before that peer's kPeerClosed,
// after which nothing more of that peer arrives. Thread-safe. Closing the inbox (destroying
// it) makes the engine drop later messages of its topic; it may outlive the engine.
class Inbox {
 public:
  class Impl;
  explicit Inbox(std::shared_ptr<Impl> impl);
  ~Inbox();
  Inbox(const Inbox&) = delete;
  Inbox& operator=(const Inbox&) = delete;

  const std::string& topic() const;
  // Everything queued so far (each event once); empty when nothing is.
  std::vector<InboxEvent> Take();
  // Waits up to `timeout` for at least one event, then takes everything queued (empty on
  // timeout).
  std::vector<InboxEvent> Wait(absl::Duration timeout);

 private:
  std::shared_ptr<Impl> impl_;
};

struct RemoteRegion {
  RegionId id = 0;
  uint64_t length = 0;
  uint32_t access = kAccessNone;
  MemoryKind kind = MemoryKind::kHost;
};

struct PeerInfo {
  PeerId id = 0;
  std::string name;
  std::string address;    // control-channel address of the peer
  std::string transport;  // chosen transport, e.g. "tcp x4", "shm"
  bool alive = false;
  std::string close_reason;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const std::string& name() const;
  // Control-channel address peers dial, "host:port" (empty when not listening).
  std::string address() const;
  // The compatibility hash a peer's handshake must match: of the control channel's schema and
  // version, and EngineOptions::compat_salt (e.g. for a discovery record).
  uint64_t compatibility_hash() const;

  // Registers [ptr, ptr+length) with every enabled transport. Memory from ShareableBuffer is
  // recognised and mapped by shm peers; other host memory goes through cross-memory attach
  // or tcp.
  absl::StatusOr<RegionId> RegisterMemory(void* ptr, size_t length,
                                          RegionOptions options = RegionOptions());
  // Fails transfers still using the region, revokes it from peers, then forgets it.
  absl::Status DeregisterMemory(RegionId region);

  // Dials a peer's control channel, handshakes, and opens the data path.
  absl::StatusOr<PeerId> Connect(const std::string& address,
                                 const ConnectOptions& options = ConnectOptions());
  // Makes more regions accessible to a connected peer.
  absl::Status Export(PeerId peer, absl::Span<const RegionId> regions);
  // Withdraws regions Export gave a peer: the peer is told (RevokeRegions), and every key it
  // was given for them stops working before this returns. FailedPrecondition for a region
  // exported to all peers; NotFound for one not exported to this peer.
  absl::Status Unexport(PeerId peer, absl::Span<const RegionId> regions);
  // Fails the peer's transfers and closes it.
  absl::Status Disconnect(PeerId peer);
  // The same for a reason of the caller's, e.g. a protocol layered on the engine that caught
  // the peer misbehaving: the peer gets `reason` in its Goodbye.
  absl::Status Disconnect(PeerId peer, const absl::Status& reason);

  std::vector<PeerInfo> Peers() const;
  absl::StatusOr<PeerId> FindPeer(const std::string& name) const;
  // Waits until a peer named `name` is connected (e.g. dialed in), or the timeout passes.
  absl::StatusOr<PeerId> WaitForPeer(const std::string& name, absl::Duration timeout);
  // Regions the peer has exported to this engine.
  absl::StatusOr<std::vector<RemoteRegion>> RemoteRegions(PeerId peer) const;
  // Waits until the peer has exported `region` to this engine, or the timeout passes.
  absl::Status WaitForRemoteRegion(PeerId peer, RegionId region, absl::Duration timeout);

  // Submits a batch of ops (all `kind`) to one peer. The ops are validated before anything
  // moves; the transfer then always ends: succeeded, failed (first error wins), or deadline
  // exceeded.
  absl::StatusOr<TransferId> Transfer(PeerId peer, OpKind kind, absl::Span<const Op> ops,
                                      const TransferOptions& options = TransferOptions());
  // Non-blocking. A final state is reported once; the transfer is then forgotten.
  TransferState Poll(TransferId id, absl::Status* status = nullptr);
  // Waits up to `timeout` for the transfer to end and returns its status
  // (DeadlineExceeded if the wait itself timed out; the transfer stays pending then).
  absl::Status Wait(TransferId id, absl::Duration timeout);

  // Notifications received so far (each once).
  std::vector<Notification> TakeNotifications();
  absl::StatusOr<Notification> WaitNotification(absl::Duration timeout);

  // Data-less messages over the control channel, for protocols layered on the engine (the
  // KV connector's handshake, releases, aborts). A message goes to the peer's inbox of
  // `topic` (1 to 64 bytes); one inbox per topic, so consumers never take each other's
  // messages. Sending fails at once for an unknown or closed peer, a bad topic or a payload
  // over max_message_bytes; otherwise the message is queued on the control connection and
  // arrives after everything sent to that peer before it. A peer without an inbox of that
  // topic drops it (logged there). Delivery is not acknowledged: a peer that dies shows up as
  // kPeerClosed in the sender's inboxes.
  absl::Status SendMessage(PeerId peer, const std::string& topic, std::string payload);
  // Opens the inbox of `topic`; AlreadyExists while another inbox of it is open. Messages that
  // arrived before it was opened were dropped.
  absl::StatusOr<std::unique_ptr<Inbox>> OpenInbox(const std::string& topic,
                                                   InboxOptions options = InboxOptions());

  EngineStats Stats() const;

  // Target side (memory peers read or write through this engine; src/core/served_ops.h).
  // Waits until every op of `peer` that this engine began serving before the call has ended
  // (its last access to the memory is over), at most `timeout`; DeadlineExceeded otherwise.
  // Call before reusing memory on a peer's word (e.g. its release of blocks it read): the
  // word travels apart from the data and can overtake the serving thread's last access.
  absl::Status WaitForServedOps(PeerId peer, absl::Duration timeout);
  // Target side, read grants (RegionOptions::reads_need_grant): lets `peer` READ `ranges`
  // (each inside a registered region exported to it) when it presents the returned id
  // (TransferOptions::grant). Nothing else of a grant-guarded region is readable by anyone.
  // Refused ops fail that peer's transfer with PermissionDenied naming the grant, and are
  // counted in EngineStats::grant_refused. Errors: NotFound for an unknown or closed peer or
  // an unexported region, OutOfRange for a range outside its region, InvalidArgument for no
  // ranges. A peer's grants end with the peer.
  absl::StatusOr<GrantId> Grant(PeerId peer, absl::Span<const GrantRange> ranges);
  // Ends a grant: no op under it begins being served after this returns (call
  // WaitForServedOps, as for any reuse, before reusing the memory). NotFound for a grant that
  // is not live for `peer`.
  absl::Status Revoke(PeerId peer, GrantId grant);
  // Target side, events instead of waits. `done` runs once, on the thread that ends the last
  // op it waits for (it must not block nor call into the engine), or is dropped with the
  // engine; each call returns true, without calling or keeping `done`, when what it waits for
  // holds already. `done` may be empty (nothing to tell: a revocation nobody waits for).
  // WhenServedOps: every op of `peer` that began before the call has ended.
  bool WhenServedOps(PeerId peer, std::function<void()> done);
  // RevokeWhenServed: revokes `grant` of `peer` once at least `bytes` were served under it
  // (what the peer says it read) and no op under it is being served, at once when `bytes` is
  // 0; `done` once it is revoked and no op under it is being served. A grant revoked
  // meanwhile (Revoke, the peer's close, a call with 0) stops waiting for its bytes. Ops under
  // a grant are counted only on a target that serves them (tcp): a peer's count of bytes it
  // moved otherwise (shm mappings, rdma) is never reached; pass 0 then.
  bool RevokeWhenServed(PeerId peer, GrantId grant, uint64_t bytes, std::function<void()> done);

  // Target side: orders the caller's earlier writes to registered memory before every op
  // this engine begins serving after the call. Call after filling memory, before telling a
  // peer it may read it.
  void PublishMemory();

  class Impl;
  // Only Create can make the key; the constructor is public for std::make_unique.
  class ConstructionKey {
    friend class Engine;
    ConstructionKey() = default;
  };
  Engine(ConstructionKey key, std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvwire

#endif  // KVWIRE_ENGINE_H_

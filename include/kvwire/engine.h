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
#include "kvwire/stats.h"

namespace kvwire {

using RegionId = uint64_t;    // unique within one engine, never reused
using PeerId = uint64_t;      // unique within one engine, never reused
using TransferId = uint64_t;  // unique within one engine, never reused (64-bit: no wrap)
// A read grant (Engine::Grant): unique within the granting engine, never reused; 0 is none.
using GrantId = uint64_t;

enum class OpKind : uint32_t { kRead = 0, kWrite = 1 };

// The built-in transports, where an option names one (forced for every peer or one peer);
// kAuto routes by what each transport declares. Strings ("auto", "tcp", "shm", "rdma", as in
// KVWIRE_TRANSPORT) convert with ParseTransportKind, which names the accepted values when it
// refuses one.
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

  // Transport used for peers: kAuto picks, per peer and per transfer, the best-ranked
  // transport (Capabilities::rank: shm on the same host when the regions allow it, else rdma
  // when both sides have a device that reaches the other, else tcp) and reports why. A forced
  // transport that cannot reach a peer fails Connect with the reason. A forced transport whose
  // target cannot check read grants (shm, rdma) gets tcp too, used only for regions the peer
  // guards with grants (RegionOptions::reads_need_grant).
  TransportKind transport = TransportKind::kAuto;

  // Transports added to the built-in ones (transport/builtin_transports.cc): Create calls each
  // factory once, and a transport it returns is routed like the others, from its
  // Capabilities (e.g. tests/transport/pipe/pipe_transport.h, which lives in tests/ only).
  std::vector<TransportFactory> extra_transports;

  // Parallel tcp data connections per peer; a transfer is striped over them.
  int tcp_connections = 4;

  // I/O threads that run every tcp data connection of the engine, whatever the number of
  // peers (epoll; see docs/ARCHITECTURE.md). 0: one per 8 cores, 1..4.
  int tcp_io_threads = 0;
  // After its last event, a tcp I/O thread polls this long before it sleeps: a busy
  // connection's next bytes come within microseconds, and waking a sleeping thread costs more
  // than polling (loopback, 2-core VM, 1 MiB ops: 4.4 -> 7.2 GB/s). Spends CPU only while
  // data moves; zero: always sleep at once. 0..10ms.
  absl::Duration tcp_io_poll = absl::Microseconds(20);

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

  // Shared secret of a deployment. When set, peers prove knowledge of it with
  // HMAC-SHA256 challenge-response; peers without it are rejected. Empty: no check.
  std::string shared_secret;

  // Mixed into the compatibility hash checked at handshake, e.g. a hash of the model and
  // layout: engines with different values refuse each other.
  uint64_t compat_salt = 0;

  // Threads running the control channel.
  int io_threads = 1;

  // Largest payload of an engine message (SendMessage), both ways: a peer that sends a larger
  // one is closed with an error naming the size. Must stay below max_frame_bytes.
  uint32_t max_message_bytes = 1 << 20;

  // --- rdma transport (used when a usable RDMA device exists; kAuto picks it for peers on
  // other hosts that offer it too) ---
  // Device allow-list, "mlx5_0" or "mlx5_0:1" entries (like perftest -d). Empty: every
  // device with an ACTIVE port.
  std::vector<std::string> rdma_devices;
  // RoCE GID index; -1 picks the first IPv4-mapped RoCE v2 GID.
  int rdma_gid_index = -1;
  // RC queue pairs per peer and device; a transfer is striped over them.
  int rdma_qps_per_peer = 4;
  // Send-queue depth (work requests) of each QP; more is queued, never posted.
  int rdma_send_queue_depth = 256;
  // RC local ACK timeout exponent (4.096 us * 2^n; 14 = 67 ms), retry count (0..7) and RNR
  // retry count (7 = retry forever).
  int rdma_qp_timeout = 14;
  int rdma_retry_count = 7;
  int rdma_rnr_retry = 7;
  // QP budget of each device: the QPs (initiator and target ends, every peer together) this
  // engine may hold on one device; 0 = the device's own limit (ibv_device_attr::max_qp). A peer
  // whose QPs would pass it is refused: its rdma channel is not made, with an error naming
  // the device, the budget and this option (a forced rdma fails Connect with it; kAuto routes
  // the peer to another transport and says why in PeerInfo); the peers already connected keep
  // their QPs and work on.
  int rdma_max_qps_per_device = 0;

  // --- shm transport (peers on this host); see docs/SECURITY-shm.md ---
  // Cross-memory attach for host memory that is not a whole ShareableBuffer, offered to and
  // used on peers that opt in too (ShmTransportOptions::allow_cma). Off: such regions move
  // over tcp, validated by the target, and the engine says so in its log and peer stats.
  // On: any peer that opted in too can read and write ALL of this process's memory.
  bool shm_cma = false;
  // Makes the process non-dumpable so that other processes of the same uid cannot reach its
  // memory through ptrace access (process_vm_*, /proc/<pid>/mem, /proc/<pid>/fd); see
  // ShmTransportOptions::deny_ptrace for the side effects. Cannot be combined with shm_cma.
  bool shm_deny_ptrace = false;

  // --- tcp data listener limits: what a dialer that has not (yet) shown a valid session
  // token, or a peer that stops mid-op, can hold (details: transport/tcp/tcp_transport.h) ---
  // Data connections open at once in every stage; per peer once authenticated.
  int tcp_max_data_connections = 1024;
  int tcp_max_data_connections_per_peer = 64;
  // Data connections still in the hello stage, in total and per remote address.
  int tcp_max_pending_hellos = 128;
  int tcp_max_pending_hellos_per_address = 32;
  // Absolute deadline for a data connection's hello (header and token).
  absl::Duration tcp_hello_timeout = absl::Seconds(10);
  // A data connection stuck this long inside one op (payload not arriving, responses not
  // taken) is cut, its pins released, and its peer dropped. Keep it below 10 s, the time
  // DeregisterMemory waits for ops in flight.
  absl::Duration tcp_io_timeout = absl::Seconds(5);

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

  // Returns `base` with the KVWIRE_* environment variables applied. A variable that is set
  // and non-empty REPLACES base's value, whatever base held (the environment wins over base;
  // callers that want their own value to win set it after this call). Unset or empty
  // variables leave base's value. The variables:
  //   KVWIRE_LISTEN           listen_address, taken as is
  //   KVWIRE_TRANSPORT        transport: auto, tcp, shm or rdma
  //   KVWIRE_TCP_CONNECTIONS  tcp_connections, 1..64
  //   KVWIRE_TCP_IO_THREADS   tcp_io_threads, 0..64
  //   KVWIRE_SECRET           shared_secret, taken as is
  //   KVWIRE_SHM_CMA          shm_cma: "1" turns it on, ANY other value turns it off
  //   KVWIRE_SHM_DENY_PTRACE  shm_deny_ptrace: likewise, "1" on, anything else off
  //   KVWIRE_RDMA_DEVICES     rdma_devices, a comma list (empty entries dropped)
  //   KVWIRE_RDMA_GID_INDEX   rdma_gid_index, -1..1023
  //   KVWIRE_RDMA_QPS         rdma_qps_per_peer, 1..64
  //   KVWIRE_LOG_LEVEL        not an option: sets the process-wide log level at once
  // A bad value (unknown transport, a number that does not parse or is out of range, an
  // unknown log level) is ignored with a warning in the log, and base's value stays; nothing
  // fails. Every other field is base's. It is the only place the library reads the
  // environment, and only a caller's call reads it: Engine::Create, the C API's
  // kvw_options_create and Python's Engine()/Connector() never do; C's *_from_environment
  // and Python's EngineOptions.from_environment call it (the tools call it for their users).
  static EngineOptions FromEnvironment(EngineOptions base);
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
  // reads everything) and rdma exports it to peers without remote-read access, so READs of it
  // go over tcp (see docs/SECURITY.md, "Read grants"). WRITEs are unaffected.
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
  // Overrides EngineOptions::transport for this peer.
  std::optional<TransportKind> transport;
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

// What an Inbox delivers: a message a peer sent with Engine::SendMessage, or the end of a
// peer (Goodbye, lease expiry, I/O or protocol error, local Disconnect or shutdown).
struct InboxEvent {
  enum class Kind : uint32_t { kMessage = 0, kPeerClosed = 1 };
  Kind kind = Kind::kMessage;
  PeerId peer = 0;
  std::string peer_name;
  std::string payload;  // kMessage: the message; kPeerClosed: why the peer closed
};

struct InboxOptions {
  // Bytes of undelivered payload this inbox may hold. A peer whose message would exceed it is
  // closed (ResourceExhausted, named in its Goodbye): a consumer that stops taking never makes
  // the engine grow without bound.
  uint64_t max_queued_bytes = 64 << 20;
  // Also deliver kPeerClosed events.
  bool peer_events = true;
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

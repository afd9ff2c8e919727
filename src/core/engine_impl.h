// Engine::Impl: owns the control channel, the transports, the region registry, peers and
// transfers. One file per job: engine.cc (lifecycle, memory registration), engine_handshake.cc
// (handshake both ways, session tokens), engine_peers.cc (a live peer's messages, closing,
// finding peers), engine_exports.cc (exports both ways), engine_channels.cc (a peer's data
// path), engine_transfers.cc (the transfer path, target hooks, grants), engine_messages.cc
// (engine messages and inboxes), stats.cc (Stats), options.cc (EngineOptions).
#ifndef KVWIRE_CORE_ENGINE_IMPL_H_
#define KVWIRE_CORE_ENGINE_IMPL_H_

#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include "absl/container/flat_hash_map.h"

#include "kvwire/engine.h"
#include "proto/kvwire.pb.h"
#include "src/control/control.h"
#include "src/core/arrival_counter.h"
#include "src/core/grant_table.h"
#include "src/core/inline_ends.h"
#include "src/core/message_hub.h"
#include "src/core/region_registry.h"
#include "src/core/route.h"
#include "src/core/served_ops.h"
#include "src/core/transfer_table.h"
#include "src/gpu/runtime.h"
#include "src/util/mutex.h"
#include "src/util/task_runner.h"
#include "transport/transport.h"

namespace kvwire {

// A peer's region as this engine knows it, and which of the peer's channels reach it.
struct RemoteRegionState {
  transport::RemoteRegionDesc desc;
  bool resolved = false;  // the data path for it has been decided
  // Bit i: the channel of transports_[i] accepted the region (Channel::AddRemoteRegions).
  core::TransportMask reached_by = 0;
  // Those of reached_by whose channel also moves local device memory to and from it
  // (Channel::MovesDeviceMemory): the mask a transfer with local GPU memory routes by.
  core::TransportMask reached_by_device = 0;
  std::map<std::string, std::string> transport_keys;  // RegionDescriptor.transport_keys
};

struct Peer {
  PeerId id = 0;
  std::string name;
  std::string address;
  pb::Hello hello;
  std::string preference = "auto";  // effective for this pair: a transport name or "auto"
  std::shared_ptr<control::Connection> conn;

  Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = true;
  std::string close_reason ABSL_GUARDED_BY(mu);
  bool setup_done ABSL_GUARDED_BY(mu) = false;
  absl::Status setup_status ABSL_GUARDED_BY(mu);
  // Indexed like Engine::Impl::transports_; null where no channel was opened (routing
  // opens the best one and, if needed, a fallback: src/core/route.h).
  std::vector<std::shared_ptr<transport::Channel>> channels ABSL_GUARDED_BY(mu);
  std::vector<uint32_t> lanes ABSL_GUARDED_BY(mu);  // lanes each channel was opened with
  // Channels routed only for grant-guarded regions (core::ChannelChoice::GrantFallback).
  core::TransportMask guarded_only ABSL_GUARDED_BY(mu) = 0;
  std::string transport_desc ABSL_GUARDED_BY(mu);
  std::string transport_reason ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<RegionId, RemoteRegionState> remote ABSL_GUARDED_BY(mu);
  core::RouteMemo route_memo ABSL_GUARDED_BY(mu);  // Transfer's last route choice
  // Counted at each transfer's end without `mu` (a lock pair less per transfer).
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> transfers{0};
};

class Engine::Impl final : public transport::TargetHooks {
 public:
  explicit Impl(EngineOptions options);
  ~Impl() override;
  absl::Status Init();

  const std::string& name() const { return name_; }
  std::string address() const { return address_; }
  uint64_t compatibility_hash() const { return handshake_.compat_hash; }

  absl::StatusOr<RegionId> RegisterMemory(void* ptr, size_t length, RegionOptions options);
  absl::Status DeregisterMemory(RegionId region);

  absl::StatusOr<PeerId> Connect(const std::string& address, const ConnectOptions& options);
  absl::Status Export(PeerId peer, absl::Span<const RegionId> regions);
  absl::Status Unexport(PeerId peer, absl::Span<const RegionId> regions);
  absl::Status Disconnect(PeerId peer);
  absl::Status Disconnect(PeerId peer, const absl::Status& reason);
  std::vector<PeerInfo> Peers() const;
  absl::StatusOr<PeerId> FindPeer(const std::string& name) const;
  absl::StatusOr<PeerId> WaitForPeer(const std::string& name, absl::Duration timeout);
  absl::StatusOr<std::vector<RemoteRegion>> RemoteRegions(PeerId peer) const;
  absl::Status WaitForRemoteRegion(PeerId peer, RegionId region, absl::Duration timeout);

  absl::StatusOr<TransferId> Transfer(PeerId peer, OpKind kind, absl::Span<const Op> ops,
                                      const TransferOptions& options);
  // One try; returns IsRegionMoving's status, unwrapped, when a local region is being moved.
  absl::StatusOr<TransferId> TransferOnce(PeerId peer, OpKind kind, absl::Span<const Op> ops,
                                          const TransferOptions& options);
  // A transfer that ended inside Transfer is in inline_ends_, any other in transfers_.
  TransferState Poll(TransferId id, absl::Status* status) {
    if (absl::Status ended; inline_ends_.Take(id, &ended)) {
      const TransferState state = ended.ok() ? TransferState::kSucceeded : TransferState::kFailed;
      if (status != nullptr) *status = std::move(ended);
      return state;
    }
    return transfers_.Poll(id, status);
  }
  absl::Status Wait(TransferId id, absl::Duration timeout) {
    if (absl::Status ended; inline_ends_.Take(id, &ended)) return ended;
    return transfers_.Wait(id, timeout, options_.wait_poll);
  }
  std::vector<Notification> TakeNotifications() { return arrivals_.TakeAll(); }
  absl::StatusOr<Notification> WaitNotification(absl::Duration timeout);
  // engine_messages.cc
  absl::Status SendMessage(PeerId peer, const std::string& topic, std::string payload);
  absl::StatusOr<std::unique_ptr<Inbox>> OpenInbox(const std::string& topic, InboxOptions options);
  EngineStats Stats() const;

  // transport::TargetHooks
  absl::StatusOr<PeerId> PeerForToken(const std::string& token) override;
  absl::StatusOr<transport::IncomingAccess> ResolveIncoming(PeerId peer, RegionId region,
                                                            uint64_t offset, uint64_t length,
                                                            OpKind kind) override;
  absl::StatusOr<transport::IncomingAccess> ResolveIncoming(PeerId peer, RegionId region,
                                                            uint64_t offset, uint64_t length,
                                                            OpKind kind, GrantId grant) override;
  transport::IncomingRun ResolveIncomingRun(PeerId peer,
                                            absl::Span<const transport::IncomingOp> ops,
                                            OpKind kind, GrantId grant,
                                            absl::Span<transport::IncomingMemory> memory) override;
  uint64_t AccessEpoch() override { return regions_.access_epoch() + grants_.access_epoch(); }
  absl::StatusOr<transport::LocalRegion> ExportedRegion(PeerId peer, RegionId region) override;
  void OnWriteArrived(PeerId peer, TransferId transfer_id) override;
  void OnPeerError(PeerId peer, const absl::Status& error) override;
  uint32_t PeerProcessId(PeerId peer) override;
  // engine_exports.cc
  std::unique_ptr<RangeHold> QuiesceRange(const std::byte* base, uint64_t length,
                                          absl::Time deadline) override;

  core::ServedOps& served_ops() { return *served_ops_; }
  core::GrantTable& grants() { return grants_; }

  // engine_transfers.cc: read grants (Engine::Grant / Revoke).
  absl::StatusOr<GrantId> Grant(PeerId peer, absl::Span<const GrantRange> ranges);
  absl::Status Revoke(PeerId peer, GrantId grant);

 private:
  // engine_handshake.cc. The handshake adds the session token (HandshakeConfig::issue_token).
  pb::Hello LocalHello(const std::string& preference) const;
  absl::StatusOr<pb::Hello> RespondToHello(const pb::Hello& remote);
  void OnAccepted(control::Accepted accepted);
  std::shared_ptr<Peer> AddPeer(PeerId id, const std::string& address, control::Accepted accepted,
                                std::string preference);
  // HandshakeConfig::issue_token/revoke_token: a token becomes live (PeerForToken finds it)
  // for a new peer id only once the handshake has authenticated the peer it goes to.
  absl::StatusOr<std::string> IssueToken();
  void RevokeToken(const std::string& token);
  // The peer id a live token was issued for; 0 if it is not live (revoked: engine stopping).
  PeerId TokenPeer(const std::string& token) const;

  // engine_peers.cc
  void OnMessage(const std::shared_ptr<Peer>& peer, const pb::Envelope& message);
  void ClosePeer(const std::shared_ptr<Peer>& peer, const absl::Status& reason);
  // Drops a peer from a malformed or unexpected control message: Goodbye says why.
  void ClosePeerForProtocol(const std::shared_ptr<Peer>& peer, const absl::Status& reason);
  std::shared_ptr<Peer> GetPeer(PeerId id) const;

  // engine_exports.cc
  absl::Status SendExports(Peer& peer, const std::vector<transport::LocalRegion>& regions);
  // What a peer exported to this engine, or withdrew.
  void OnExportRegions(const std::shared_ptr<Peer>& peer, const pb::ExportRegions& message);
  void OnRevokeRegions(const std::shared_ptr<Peer>& peer, const pb::RevokeRegions& message);

  // engine_channels.cc
  // The endpoint of transport `kind` the peer offered in `hello`; null if none.
  static const pb::TransportEndpoint* FindEndpoint(const pb::Hello& hello, const std::string& kind);
  // The transport name a settled preference forces; empty for "auto".
  static std::string ForcedName(const std::string& preference);
  // Opens transports_[index]'s channel to `peer`; the reason when it is not usable.
  absl::StatusOr<std::unique_ptr<transport::Channel>> ConnectChannel(
      const std::shared_ptr<Peer>& peer, size_t index, transport::PeerLink link);
  // Sends transports_[index]'s own control payload to `conn`'s peer (TransportControl).
  transport::ControlSender ControlSenderFor(size_t index,
                                            std::shared_ptr<control::Connection> conn) const;
  void OnTransportControl(const std::shared_ptr<Peer>& peer, const pb::TransportControl& message);
  absl::Status SetupChannels(const std::shared_ptr<Peer>& peer);
  void ResolveRemoteRegions(const std::shared_ptr<Peer>& peer);
  // region_events.cc: a peer was added, changed state or learned a region; wakes the waiters
  // on peers_cv_.
  void PeersChangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peers_mu_);
  // `peer`'s exported regions became usable (resolved with its channels set up): wakes the
  // waiters and raises the inbox event.
  void RegionsReady(const std::shared_ptr<Peer>& peer) ABSL_LOCKS_EXCLUDED(peers_mu_);

  // engine_messages.cc
  void OnEngineMessage(const std::shared_ptr<Peer>& peer, const pb::EngineMessage& message);

  // engine.cc: 16 bytes from the CSPRNG, hex; an error (never predictable bytes) if it fails.
  absl::StatusOr<std::string> NewToken();

  // engine_transfers.cc
  void OnLaneDone(TransferId id, absl::Status status);
  // The end of a transfer that never entered transfers_ (TransferOnce's `untabled`): `done`
  // says whether its lane ended inline with `status`.
  void EndUntabled(const core::TransferInfo& info, bool done, absl::Status status, Peer* peer);
  void RecordEnd(const core::TransferInfo& info, const absl::Status& status);
  // The same for a caller that holds the peer (null: gone) and read the clock at the end
  // (UnixNanos, src/util/clock.h).
  void RecordEnd(const core::TransferInfo& info, const absl::Status& status, Peer* peer,
                 int64_t end_ns);
  // Fails transfers at their deadlines, sleeping until the earliest one (not on a period).
  void ReaperLoop();

  // Fills the GPU fields of a kGpu region from the runtime (device, allocation).
  absl::Status DescribeGpuMemory(const RegionOptions& options, transport::LocalRegion* region);

  const EngineOptions options_;
  std::string name_;
  std::string address_;
  control::HandshakeConfig handshake_;

  boost::asio::io_context io_;
  std::unique_ptr<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_;
  std::vector<std::thread> io_threads_;
  std::unique_ptr<control::Server> server_;
  // The GPU runtime of kGpu regions, fixed at creation (gpu::DefaultRuntime() then).
  gpu::Runtime* const gpu_ = &gpu::DefaultRuntime();
  // Every transport this engine runs, in registration order (the built-ins of
  // transport/builtin_transports.cc, then EngineOptions::extra_transports); the core never
  // names one: routing decides from their Capabilities (src/core/route.h). Fixed after Init.
  std::vector<std::unique_ptr<transport::Transport>> transports_;
  std::vector<const transport::Capabilities*> caps_;  // transports_[i]->caps()
  std::vector<size_t> rank_order_;                    // core::RankOrder(caps_), fixed after Init
  // Every transport that serves incoming ops itself (reaches_every_region) moves GPU memory.
  bool incoming_gpu_ok_ = true;

  core::RegionRegistry regions_;
  core::GrantTable grants_;
  // Incoming ops being served (ResolveIncoming's pins); shared with those pins.
  const std::shared_ptr<core::ServedOps> served_ops_ = std::make_shared<core::ServedOps>();
  core::TransferTable transfers_;
  core::InlineEnds inline_ends_;  // the ends of transfers that never entered transfers_
  core::ArrivalCounter arrivals_{options_.max_undrained_notifications};
  // Engine messages per topic; shared with the Inbox handles, which may outlive the engine.
  std::shared_ptr<core::MessageHub> messages_ =
      std::make_shared<core::MessageHub>(options_.max_message_bytes);
  std::atomic<TransferId> next_transfer_id_{1};
  std::atomic<PeerId> next_peer_id_{1};

  mutable Mutex peers_mu_;
  CondVar peers_cv_;  // a peer was added, changed state, or learned a region
  // Bumped with each peers_cv_ signal (PeersChangedLocked), so that a waiter that checked a
  // peer's state under the peer's own lock sees a change made before it started waiting.
  uint64_t peers_epoch_ ABSL_GUARDED_BY(peers_mu_) = 0;
  absl::flat_hash_map<PeerId, std::shared_ptr<Peer>> peers_ ABSL_GUARDED_BY(peers_mu_);
  // Live session tokens: issued only to authenticated peers (see IssueToken).
  absl::flat_hash_map<std::string, PeerId> tokens_ ABSL_GUARDED_BY(peers_mu_);
  // Closed peers still in peers_ (for Peers()/Stats()), oldest first; bounded by
  // options_.closed_peers_kept.
  std::deque<PeerId> closed_peers_ ABSL_GUARDED_BY(peers_mu_);
  std::atomic<uint64_t> peers_closed_for_protocol_{0};

  mutable Mutex stats_mu_;
  EngineStats stats_ ABSL_GUARDED_BY(stats_mu_);
  // Counted as each transfer starts (before its first Post: a Stats() reader sees a transfer
  // in flight) without stats_mu_; Stats() adds them to its copy of stats_.
  std::atomic<uint64_t> transfers_started_{0};
  std::atomic<uint64_t> ops_submitted_{0};
  std::atomic<uint64_t> ops_posted_{0};
  // Bytes of completed transfers by the transport that moved them ({READ, WRITE} per
  // transport name): a peer's ops may take another transport than its first choice (a
  // grant-guarded region goes over one that checks grants). Stats(): "bytes_by_transport".
  // Indexed like caps_ (a name lookup per transfer cost ~100 instructions).
  struct MovedBytes {
    uint64_t read = 0;
    uint64_t written = 0;
    bool used = false;  // a transfer completed over it: listed even at 0 bytes
  };
  std::array<MovedBytes, core::kMaxTransports> bytes_by_transport_ ABSL_GUARDED_BY(stats_mu_);

  std::atomic<bool> stopping_{false};
  std::thread reaper_;
  std::thread completer_;               // runs TransferOptions::on_complete callbacks (transfers_)
  std::unique_ptr<TaskRunner> worker_;  // peer setup and teardown
};

}  // namespace kvwire

#endif  // KVWIRE_CORE_ENGINE_IMPL_H_

// Connector::Impl, shared by the files that implement it, one job each:
//   connector.cc          the public facade, start-up, KV cache registration, address mapping
//   scheduler_side.cc     scheduler half (match, alloc, metadata, request finished)
//   worker_side.cc        worker half (bind metadata, start loads, layer waits and saves, abort)
//   decode_load.cc        decode: mode choice and the start of a load (READ, or write request)
//   write_mode.cc         prefill, write mode: layer-wise WRITEs, "layer" and "done"
//   event_saves.cc        prefill, write mode: layer saves gated on a GPU event, waited for on
//                         a waiter thread of their own
//   peer_messages.cc      connector handshake and messages, peer deaths, the progress thread
//   request_lifecycle.cc  the request state machine's endings: complete, fail, abort,
//                         transfer polling, deadlines and leases
//   connector_stats.cc    per-request and per-group accounting, JSON and Prometheus
//
// Connector-to-connector messages (hello, read start, write requests, releases, aborts,
// done) are engine messages of topic kTopic over the control channel, in order per peer.
// "done" is sent only after every layer WRITE succeeded, i.e. after the target acknowledged
// the data, so it tells decode that every byte is in place; "layer" says the same of one layer
// (decode's WaitForLayerLoad returns on it). Read mode moves each layer in a transfer of its
// own for the same reason. Peer closes (lease expiry,
// Goodbye, I/O error) arrive through the same inbox and fail every request bound to the peer
// at once.
//
// Peers are not trusted with each other's requests: every message is parsed into a
// PeerMessage (typed, bounded) before use; a transfer is bound to the engine peer that first
// claims it (read_start or release in read mode, write_req in write mode; decode binds its
// loads to the prefill it dialed), and a message about it from any other peer, a malformed or
// unknown message, or a message before the connector handshake closes that peer alone, with
// the reason in its Goodbye. Read-mode transfer ids are 128 random bits.
#ifndef KVWIRE_CONNECTOR_CONNECTOR_IMPL_H_
#define KVWIRE_CONNECTOR_CONNECTOR_IMPL_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <time.h>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "kvwire/connector.h"
#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "src/connector/metrics_http.h"
#include "src/discovery/etcd_client.h"
#include "src/discovery/registration.h"
#include "src/gpu/runtime.h"
#include "src/util/json_fields.h"
#include "src/util/mutex.h"
#include "src/util/recent_set.h"

namespace kvwire {
namespace connector_internal {

// Inbox topic of connector messages.
inline constexpr char kTopic[] = "kvwire.connector";
inline constexpr char kLog[] = "connector";

nlohmann::json LayoutToJsonValue(const Layout& layout);
absl::StatusOr<Layout> LayoutFromJsonValue(const nlohmann::json& j);

// A registered memory range (local, or a peer's from its hello).
struct RegionSpan {
  uint64_t base = 0;
  uint64_t length = 0;
  RegionId id = 0;
};

// The region holding [addr, addr+length) and the offset in it.
absl::StatusOr<std::pair<RegionId, uint64_t>> FindRegion(const std::vector<RegionSpan>& regions,
                                                         uint64_t addr, uint64_t length,
                                                         const char* side);
nlohmann::json BlocksToJson(const BlockTable& t);
// The block table in object field `field` of `f` ({group: [block id, ...]}), typed and bounded.
BlockTable BlocksFromJson(JsonFields& f, absl::string_view field, bool required);

// Bounds on what a peer's connector message may hold.
inline constexpr size_t kMaxTransferIdBytes = 256;
inline constexpr size_t kMaxReasonBytes = 4096;
inline constexpr size_t kMaxRegions = 4096;
// Write requests a prefill keeps for requests its scheduler has not seen yet: per peer, and
// in all. Beyond them a write request is answered with "fail" at once.
inline constexpr size_t kMaxEarlyWritesPerPeer = 1024;
inline constexpr size_t kMaxEarlyWrites = 8192;
// Releases of read-mode transfers not held yet that a prefill remembers.
inline constexpr size_t kMaxEarlyReleases = 8192;

// One connector message from a peer, with every field checked (type, range, size) before any
// of it is used.
struct PeerMessage {
  enum class Type {
    kHello,
    kHelloAck,
    kHelloErr,
    kReadStart,
    kRelease,
    kWriteReq,
    kLayer,
    kDone,
    kFail
  };
  Type type = Type::kHello;
  std::string name;  // the type as sent ("hello", "release", ...)
  std::string transfer_id;
  // hello, hello_ack
  std::string engine_id;
  KvMode mode = KvMode::kAuto;
  Layout layout;
  std::vector<RegionSpan> regions;
  // release
  bool ok = true;
  // release, fail; hello_err's error
  std::string reason;
  // write_req
  BlockTable blocks;
  uint64_t num_cached = 0;
  // layer
  int layer = 0;
};
// Errors name the message type and the field ("connector message 'release': 'transfer_id'
// must be a string, got 5").
absl::StatusOr<PeerMessage> ParsePeerMessage(const std::string& payload);
double ThreadCpuUs();
// Microseconds from a to b; -1 when either is unset.
double Us(absl::Time a, absl::Time b);

// Accumulates the calling thread's CPU time into `*sink` while alive; Pause() excludes a
// span (e.g. an engine call, whose cost is the transport's, not the connector's).
class CpuTimer {
 public:
  explicit CpuTimer(double* sink) : sink_(sink), start_(ThreadCpuUs()) {}
  ~CpuTimer() {
    if (running_) *sink_ += ThreadCpuUs() - start_;
  }
  CpuTimer(const CpuTimer&) = delete;
  CpuTimer& operator=(const CpuTimer&) = delete;
  void Pause() {
    *sink_ += ThreadCpuUs() - start_;
    running_ = false;
  }
  void Resume() {
    start_ = ThreadCpuUs();
    running_ = true;
  }

 private:
  double* sink_;
  double start_;
  bool running_ = true;
};

}  // namespace connector_internal

class Connector::Impl {
 public:
  using json = nlohmann::json;
  using RegionSpan = connector_internal::RegionSpan;

  enum class State {
    kMatched,   // scheduler knows it; blocks not yet allocated
    kPending,   // blocks allocated, waiting for the worker (decode load / prefill save)
    kLoading,   // decode: READ in flight, or waiting for prefill's WRITEs
    kSaving,    // prefill write mode: layers going out
    kHeld,      // prefill read mode: blocks held for the reader (lease)
    kDraining,  // aborted or failed: waiting for transfers touching the blocks to end
  };
  static const char* StateName(State s) {
    static const char* names[] = {"matched", "pending", "loading", "saving", "held", "draining"};
    return names[static_cast<int>(s)];
  }

  struct GroupCounters {
    uint64_t bytes = 0;
    uint64_t ops_before_merge = 0;
    uint64_t ops = 0;
  };

  struct Request {
    std::string id;
    bool decode = false;  // role of this side for the request
    State state = State::kMatched;
    KvTransferParams params;
    KvMode mode = KvMode::kAuto;
    BlockTable blocks;
    uint64_t num_tokens = 0;
    uint64_t num_cached = 0;  // decode: tokens already present locally
    absl::Time deadline = absl::InfiniteFuture();
    absl::Time t_queued = absl::InfinitePast(), t_first = absl::InfinitePast(),
               t_last = absl::InfinitePast();
    std::optional<PeerId> peer;
    // Decode read mode: further prefill ranks read from (peer, their transfer id).
    std::vector<std::pair<PeerId, std::string>> tp_sources;
    std::set<TransferId> transfers;  // in flight, touching the blocks
    // The layer each transfer moves (layer-wise progress), and transfers left per layer.
    std::map<TransferId, int> transfer_layer;
    std::map<int, int> layer_transfers_left;
    // Decode: layers not yet in place (WaitForLayerLoad waits on them).
    std::set<int> layers_pending;
    std::optional<TransferPlan> plan;
    // Prefill, write mode.
    bool have_remote = false;
    BlockTable remote_blocks;
    uint64_t remote_cached = 0;
    std::set<int> layers_final, layers_sent;
    bool finished_by_scheduler = false;  // RequestFinished was called
    // Decode write mode: abort sent, waiting for prefill to stop.
    bool abort_sent = false;
    std::string fail_reason;  // set once a request fails
    std::map<std::string, GroupCounters> groups;
    double cpu_us = 0;  // connector CPU on the request path (planning, ops), not transport
  };

  struct Peer {
    PeerId id = 0;
    std::string engine_id;
    std::string address;
    Layout layout;
    std::vector<RegionSpan> regions;
    KvMode prefill_mode = KvMode::kAuto, decode_mode = KvMode::kAuto;
    bool ready = false;
    std::string error;
  };

  explicit Impl(ConnectorOptions options) : options_(std::move(options)) {}
  ~Impl() {
    {
      // First: the key goes from etcd at once, before the engine stops answering.
      MutexLock lock(&discovery_mu_);
      registration_.reset();
    }
    metrics_.reset();
    {
      MutexLock lock(&mu_);
      stop_ = true;
      waiter_cv_.SignalAll();
    }
    if (progress_.joinable()) progress_.join();
    if (event_waiter_.joinable()) event_waiter_.join();
  }
  absl::Status Init();
  std::string metrics_address() const { return metrics_ ? metrics_->address() : ""; }
  Engine& engine() { return *engine_; }
  const std::string& engine_id() const { return engine_->name(); }

  // --- discovery (discovery_side.cc) -----------------------------------------------------
  absl::Status InitDiscovery();
  absl::Status Announce(const std::string& http_address);
  bool Announced() const;
  // The control address of engine `engine_id`: a connected peer's, else etcd's record.
  absl::StatusOr<std::string> ResolveEngine(const std::string& engine_id);

  // --- registration -----------------------------------------------------------------------
  absl::Status RegisterKvCaches(const Layout& layout, const std::vector<KvMemory>& memory);

  // --- scheduler side ---------------------------------------------------------------------
  absl::StatusOr<MatchResult> GetNumNewMatchedTokens(const std::string& req_id, uint64_t num_tokens,
                                                     uint64_t num_computed,
                                                     const std::string& params_json);
  absl::Status UpdateStateAfterAlloc(const std::string& req_id, const BlockTable& blocks,
                                     uint64_t num_external_tokens);
  std::string BuildConnectorMeta();
  absl::StatusOr<RequestFinishedResult> RequestFinished(
      const std::string& req_id, const BlockTable& blocks, uint64_t num_tokens,
      const std::string& params_json, bool aborted, const std::string& transfer_id);

  // --- worker side ------------------------------------------------------------------------
  absl::Status BindConnectorMeta(const std::string& meta_json);
  absl::Status StartLoadKv();
  absl::Status WaitForLayerLoad(int layer);
  absl::Status SaveKvLayer(int layer);
  absl::Status SaveKvLayer(int layer, GpuEvent ready);
  absl::Status WaitForSave();
  FinishedRequests GetFinished() {
    MutexLock lock(&mu_);
    FinishedRequests out = std::move(finished_);
    finished_ = FinishedRequests();
    return out;
  }
  absl::Status Abort(const std::string& req_id);
  size_t LiveRequests() const {
    MutexLock lock(&mu_);
    return requests_.size();
  }
  std::string StatsJson() const;
  std::string StatsPrometheus() const;

 private:
  // --- messages ---------------------------------------------------------------------------

  // Messages to one peer keep their order; a dead peer is an error.
  absl::Status SendMessage(PeerId peer, const json& msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return engine_->SendMessage(peer, connector_internal::kTopic, DumpJson(msg));
  }
  json HelloBody() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decode: connects to the prefill engine at `address` and runs the connector handshake.
  absl::StatusOr<PeerId> EnsurePeer(const std::string& address);
  void OnMessage(const InboxEvent& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnHello(PeerId peer, connector_internal::PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The peer broke the protocol (a malformed, unknown or unexpected message, or one about a
  // transfer bound to another peer): it is closed, with `reason` in its Goodbye, once the
  // lock is released; requests bound to it fail now. Nothing else is touched.
  void ClosePeerLocked(PeerId peer, const std::string& name, absl::Status reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the peers ClosePeerLocked queued (outside mu_: closing joins transport threads).
  void CloseQueuedPeers() ABSL_LOCKS_EXCLUDED(mu_);
  // False (and the sender is closed) when `r` is bound to a peer other than `peer`; binds an
  // unbound `r` to `peer` when `bind`.
  bool CheckBinding(Request& r, PeerId peer, const std::string& name,
                    const connector_internal::PeerMessage& m, bool bind)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Request* FindByTransfer(const std::string& tid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decode: the live request loading `tid` (any mode), or nullptr.
  Request* FindDecodeByTransfer(const std::string& tid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnWriteRequest(PeerId peer, const std::string& name, connector_internal::PeerMessage& m)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill write mode: plans once both block tables are known, then sends every final
  // layer not yet sent; "done" follows when all layers are sent and their transfers ended.
  void MaybeSendLayersLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeFinishSaveLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<Op>> ToOps(const std::vector<ByteRange>& ranges, const Peer& p,
                                        bool local_is_src) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds a plan's bytes and ops to the request's per-group counters.
  void Account(Request& r, const TransferPlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decode: starts one request's load.
  void StartLoad(const std::string& id);
  // Decode, read mode: plans and submits the READs from every source; false when it failed
  // (the request is failing then).
  bool StartReads(Request& r, const std::vector<absl::StatusOr<PeerId>>& tp_peers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Marks `layer` final for every request in `ids` still saving, and sends what it can.
  void SaveLayerLocked(int layer, const std::vector<std::string>& ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A transfer of `r` that moved one layer ended well: decode marks the layer in place,
  // prefill (write mode) tells decode.
  void LayerTransferDone(Request& r, TransferId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill, write mode: tells decode that `layer` of `r` is in place.
  void TellLayerDone(Request& r, int layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- event-gated saves (event_saves.cc) -------------------------------------------------
  struct EventSave {
    uint64_t seq = 0;
    int layer = 0;
    GpuEvent event;  // handle null: no event (a plain save queued behind gated ones)
    std::vector<std::string> requests;
  };
  // The waiter thread: takes the queue's head when its event completed (or its requests
  // ended), in order.
  void EventWaitLoop();

  // --- endings ----------------------------------------------------------------------------
  void TellPeer(Request& r, bool ok, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a request once nothing touches its blocks any more (else drains first).
  void FailLocked(Request& r, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(Request& r, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Retire(Request& r, const char* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool PeerAlive(PeerId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !dead_peers_.Contains(id); }

  // --- progress ---------------------------------------------------------------------------
  void ProgressLoop();
  // Before the events' peers are heard: their ops served so far have ended (peer_messages.cc).
  void WaitForServedOps(const std::vector<InboxEvent>& events) ABSL_LOCKS_EXCLUDED(mu_);
  // Answers the hellos whose regions arrived (or whose deadline passed).
  void ServePendingHellos() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The engine closed `peer` (lease expiry, Goodbye, I/O error): every request bound to it
  // fails now, not at its deadline.
  void OnPeerDeath(PeerId peer, const std::string& name, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PollTransfers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckDeadlines() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct PendingHello {
    PeerId peer = 0;
    std::string name;
    connector_internal::PeerMessage msg;
    absl::Time deadline;
  };

  struct EarlyWrite {
    PeerId peer = 0;
    BlockTable blocks;
    uint64_t num_cached = 0;
    absl::Time expires;
  };

  const ConnectorOptions options_;
  // The engine's GPU runtime (both take gpu::DefaultRuntime() at creation): events handed to
  // SaveKvLayer belong to it.
  gpu::Runtime* gpu_runtime_ = nullptr;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Inbox> inbox_;
  std::thread progress_;
  std::unique_ptr<connector_internal::MetricsServer> metrics_;
  std::thread event_waiter_;                     // started by the first event-gated save
  std::shared_ptr<discovery::EtcdClient> etcd_;  // set by Init when configured
  mutable Mutex discovery_mu_;
  std::unique_ptr<discovery::Registration> registration_ ABSL_GUARDED_BY(discovery_mu_);

  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  CondVar waiter_cv_;  // wakes the event waiter (new save, stop)
  std::deque<EventSave> event_saves_ ABSL_GUARDED_BY(mu_);
  uint64_t event_saves_queued_ ABSL_GUARDED_BY(mu_) = 0;  // sequence of the last one queued
  uint64_t event_saves_taken_ ABSL_GUARDED_BY(mu_) = 0;   // all up to this one are taken
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  Layout layout_ ABSL_GUARDED_BY(mu_);
  std::vector<RegionSpan> local_regions_ ABSL_GUARDED_BY(mu_);
  std::map<PeerId, Peer> peers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, PeerId> peer_by_address_ ABSL_GUARDED_BY(mu_);
  // Bounded: engine peer ids are never reused, and a dead peer's control connection is closed
  // (its token revoked) by the engine right after it is marked here, so nothing arriving
  // after a few thousand later deaths can name it.
  RecentSet<PeerId> dead_peers_ ABSL_GUARDED_BY(mu_){kClosedPeersRemembered};
  std::vector<std::pair<PeerId, absl::Status>> peers_to_close_ ABSL_GUARDED_BY(mu_);
  std::vector<PendingHello> pending_hellos_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Request> requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> by_transfer_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, EarlyWrite> early_writes_ ABSL_GUARDED_BY(mu_);
  // Read mode, releases of transfer ids not held (yet): a scheduler in another process hands
  // a transfer id out before its worker holds the blocks under it (RequestFinished with a
  // given id), so a fast reader's release can come first. Bounded, oldest dropped.
  struct EarlyRelease {
    PeerId peer = 0;
    bool ok = true;
    std::string reason;
  };
  std::map<std::string, EarlyRelease> early_releases_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> early_release_order_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> retired_early_ ABSL_GUARDED_BY(mu_);
  // Prefill transfers that failed, with the reason, for decodes that ask late.
  std::map<std::string, std::string> retired_transfers_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> retired_order_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pending_loads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pending_saves_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> bound_loads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> bound_saves_ ABSL_GUARDED_BY(mu_);
  FinishedRequests finished_ ABSL_GUARDED_BY(mu_);
  // Accounting that balances: started = completed + failed + withdrawn + live requests.
  uint64_t started_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t withdrawn_ ABSL_GUARDED_BY(mu_) = 0;  // dropped by the scheduler before any transfer
  uint64_t lease_expired_ ABSL_GUARDED_BY(mu_) =
      0;  // read-mode holds no reader released (of failed_)
  double transfer_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, GroupCounters> group_totals_ ABSL_GUARDED_BY(mu_);
  json recent_ ABSL_GUARDED_BY(mu_) = json::array();
};

}  // namespace kvwire

#endif  // KVWIRE_CONNECTOR_CONNECTOR_IMPL_H_

// Connector::Impl, shared by the files that implement it, one job each:
//   connector.cc          the public facade, start-up, KV cache registration, address mapping
//   discovery_side.cc     etcd registration and announce, resolving a prefill by engine id
//   scheduler_side.cc     scheduler half (match, alloc, metadata, request finished)
//   worker_side.cc        worker half (bind metadata, start loads, layer waits and saves, abort)
//   decode_load.cc        decode: mode choice and the start of a load (READ, or write
//                         request); releasing the blocks of a load it will not read
//   write_mode.cc         prefill, write mode: layer-wise WRITEs, "layer" and "done"
//   event_saves.cc        prefill, write mode: layer saves gated on a GPU event, waited for on
//                         a waiter thread of their own; WaitForSave
//   read_scrub.cc         prefill: zeroing the rows of a request's blocks it did not fill
//   peer_sessions.cc      connector handshake (hello, pending hellos), protocol closes, peer
//                         deaths
//   read_grants.cc        prefill, read mode: readers of a held hand-off, their grants and
//                         read_ok; decode's side of read_ok
//   peer_messages.cc      the other message handlers (one per type, through a table), transfer
//                         binding checks, the progress thread and its wake-ups
//   request_lifecycle.cc  the request state machine's endings: complete, fail, abort,
//                         transfer submission and ends, deadlines and leases
//   connector_stats.cc    per-request and per-group accounting, JSON and Prometheus
//   progress_signal.cc    ProgressSignal (below)
// with the records it keeps in connector_request.h (Request, Peer) and the typed peer messages
// in peer_message.h (parsed in peer_message_parse.cc);
// and its components, each with a job of its own: the request table, peer sessions, write-mode
// pushes and event-save queue (state under mu_, see the lock order at the fields),
// ConnectorMetrics (connector_metrics.h, own lock) and ProgressSignal (progress_signal.h, own
// lock: what wakes the progress thread; transfer ends are pushed by the engine, not polled).
// The folder's other files are not Connector::Impl: layout.cc and layout_json.cc
// (kvwire/layout.h), kv_params.cc (kv_transfer_params), metrics_http.cc (the /metrics
// endpoint, metrics_http.h); the C ABI over the public API is src/capi/ (its own layer).
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
// claims it (write_req in write mode; decode binds its loads to the prefill it dialed) or, in
// read mode, to the engines that claim it by read_start or release, one per rank of the
// decode's tensor parallelism (its layout's; Request::Reader), each with its own grant and
// able to end only its own read. A message about it from any other peer, a malformed or
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

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

#include "kvwire/connector.h"
#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "src/connector/connector_metrics.h"
#include "src/connector/connector_request.h"
#include "src/connector/metrics_http.h"
#include "src/connector/peer_message.h"
#include "src/connector/progress_signal.h"
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

// The region holding [addr, addr+length) and the offset in it.
absl::StatusOr<std::pair<RegionId, uint64_t>> FindRegion(const std::vector<RegionSpan>& regions,
                                                         uint64_t addr, uint64_t length,
                                                         const char* side);
// FindRegion for a stream of ranges that mostly lie in the region of the range before: that
// region is tried first.
class RegionFinder {
 public:
  explicit RegionFinder(const std::vector<RegionSpan>& regions) : regions_(regions) {}
  // The region holding [addr, addr+length), or null (FindRegion names the error).
  const RegionSpan* Find(uint64_t addr, uint64_t length) {
    if (Holds(last_, addr, length)) return last_;
    for (const RegionSpan& r : regions_) {
      if (Holds(&r, addr, length)) return last_ = &r;
    }
    return nullptr;
  }

 private:
  static bool Holds(const RegionSpan* r, uint64_t addr, uint64_t length) {
    return r != nullptr && addr >= r->base && addr + length <= r->base + r->length;
  }
  const std::vector<RegionSpan>& regions_;
  const RegionSpan* last_ = nullptr;
};
nlohmann::json BlocksToJson(const BlockTable& t);
// KvTransferParams::ToJson and FromJson without the text: the connector metadata carries the
// params as a JSON value, so building and binding it neither prints nor parses them again.
nlohmann::json ParamsToJsonValue(const KvTransferParams& p);
absl::StatusOr<KvTransferParams> ParamsFromJsonValue(const nlohmann::json& object);
// The block table in object field `field` of `f` ({group: [block id, ...]}), typed and bounded.
BlockTable BlocksFromJson(JsonFields& f, absl::string_view field, bool required);

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
  // The connector_internal names the implementation files use (no per-file using blocks).
  using json = nlohmann::json;
  using RegionSpan = connector_internal::RegionSpan;
  using PeerMessage = connector_internal::PeerMessage;
  using CpuTimer = connector_internal::CpuTimer;
  static constexpr const char* kLog = connector_internal::kLog;

  // The request and peer records (connector_request.h).
  using State = connector_internal::RequestState;
  using Event = connector_internal::RequestEvent;
  using Machine = connector_internal::RequestMachine;
  using Role = connector_internal::Role;
  static const char* StateName(State s) { return connector_internal::RequestStateName(s); }
  using GroupCounters = connector_internal::GroupCounters;
  using Request = connector_internal::Request;
  using Peer = connector_internal::Peer;

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
    signal_->Notify();
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
    FinishedRequests out = std::move(table_.finished);
    table_.finished = FinishedRequests();
    return out;
  }
  absl::Status Abort(const std::string& req_id);
  absl::Status ReleaseUnread(const std::string& req_id, const std::string& params_json,
                             const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  size_t LiveRequests() const {
    MutexLock lock(&mu_);
    return table_.requests.size();
  }
  std::string StatsJson() const;
  std::string StatsPrometheus() const;
  // A public call changed requests (state, deadline): the progress thread recomputes when it
  // must wake next.
  void WakeProgress() { signal_->Notify(); }
  // What woke the progress thread so far (tests: completion is pushed, not polled).
  connector_internal::ProgressSignal::Counters progress_counters() const {
    return signal_->counters();
  }

 private:
  // --- messages ---------------------------------------------------------------------------

  // Queues a message to `peer`; it is sent once mu_ is released (FlushOutbox), in the order
  // queued, so no engine call is made under the lock for it. A peer known dead is an error
  // now; a send that fails later fails `request` (if named and still loading) there, and the
  // engine reports the peer's close through the inbox anyway.
  absl::Status SendMessage(PeerId peer, const json& msg, const std::string& request = "")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same, for a message already serialized (the per-layer ones, built without a json).
  absl::Status SendPayload(PeerId peer, std::string payload, const std::string& request = "")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends what SendMessage queued, outside mu_. One thread drains at a time (the others
  // leave theirs to it), which keeps every peer's messages in order without a lock held
  // across the engine calls.
  void FlushOutbox() ABSL_LOCKS_EXCLUDED(mu_);
  // mu_ for one step of the connector's public calls: released first, then the messages
  // the step queued are sent (FlushOutbox).
  class ABSL_SCOPED_LOCKABLE StepLock {
   public:
    explicit StepLock(Impl* impl) ABSL_EXCLUSIVE_LOCK_FUNCTION(impl->mu_) : impl_(impl) {
      impl_->mu_.Lock();
    }
    ~StepLock() ABSL_UNLOCK_FUNCTION() {
      impl_->mu_.Unlock();
      impl_->FlushOutbox();
    }
    StepLock(const StepLock&) = delete;
    StepLock& operator=(const StepLock&) = delete;

   private:
    Impl* const impl_;
  };
  json HelloBody() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decode: connects to the prefill engine at `address` and runs the connector handshake.
  absl::StatusOr<PeerId> EnsurePeer(const std::string& address);
  // Parses a connector message and hands it to its type's handler (peer_messages.cc).
  void OnMessage(const InboxEvent& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The handlers, one per message type (write_req's is OnWriteRequest, in write_mode.cc).
  void OnHelloMessage(const InboxEvent& n, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnHelloAnswer(const InboxEvent& n, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnReadStart(const InboxEvent& n, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnRelease(const InboxEvent& n, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnLayer(const InboxEvent& n, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnDone(const InboxEvent& n, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnFail(const InboxEvent& n, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // read_ok on the decode side: a prefill source granted the blocks; the READs start once
  // every source of the request did.
  void OnReadOk(const InboxEvent& n, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill, read mode: every page of `r`'s blocks (all groups, layers, components) as
  // ranges of the local regions, for Engine::Grant.
  absl::StatusOr<std::vector<GrantRange>> GrantRangesLocked(const Request& r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill, read mode: queues the revocation of grants still held (none after kReleasing).
  void RevokeGrantLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill, read mode: true when `r` must first wait (kReleasing) for the engine to serve
  // what each reader read and revoke its grant (Engine::RevokeWhenServed, queued for outside
  // mu_); the word comes back to OnServedLocked, which ends `r` as `end`. False: end now.
  bool AwaitServedLocked(Request& r, Request::End end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The engine's answer to a queued grant of `request`'s blocks to reader `peer`.
  void OnGrantedLocked(const std::string& request, PeerId peer, absl::StatusOr<GrantId> grant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The engine's word for watch `ticket`; false when `ticket` is no such watch.
  bool OnServedLocked(TransferId ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A releasing `r`'s deadline passed: its grants are revoked now, without waiting for the
  // readers' counts; the watches AwaitServedLocked kept free the blocks once no op under a
  // grant is served, and `r` gets a handshake_timeout more for that.
  void ForceRevokeLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ... and that second deadline passed too: nothing waits any more.
  void StopServedWatchesLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The second deadline of a releasing request: closes every reader whose ops under a revoked
  // grant are still served, so those ops end with its data connections; the blocks go when
  // their watches fire, or at a third deadline.
  void CloseServedReadersLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill (read grants on): zeroes the rows of `r`'s blocks that the request did not fill
  // (UnfilledPageSpans), once, before its pages first go out whole: read mode before the first
  // grant, write mode before the first WRITE (read_scrub.cc).
  absl::Status ScrubUnfilledLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill, read mode: grants held `r`'s blocks to its reader `peer` (once) and answers
  // read_ok.
  void GrantReadLocked(Request& r, PeerId peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill, read mode: the reader `peer` of held `r`, bound now if a decode rank's place is
  // free (see Request::Reader); nullptr, with the sender closed, when `r` is bound to other
  // readers (every place taken, or this peer's rank is) or the peer's layout disagrees.
  // `place`: the peer's (ReaderPlaceLocked), `message` the one that claims ("read_start",
  // "release").
  Request::Reader* ClaimReaderLocked(Request& r, PeerId peer, const std::string& name,
                                     const char* message, std::pair<int, int> place)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A decode engine's place among the readers of a hand-off, {tensor-parallel size, rank},
  // from the layout of its connector handshake ({1, 0} without one).
  std::pair<int, int> ReaderPlaceLocked(PeerId peer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill, read mode: `reader` of `r` is done (read, will not read, or failed with
  // `reason`); ends the hold when no reader is left to wait for (`r` may die here).
  enum class ReadEnd { kRead, kUnread, kFailed };
  void ReaderDoneLocked(Request& r, PeerId reader, ReadEnd how, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill, read mode: tells `peer` that `tid` is not readable here, and counts it.
  void RefuseReadLocked(PeerId peer, const std::string& tid, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decode, read mode: submits the READs of every source, layer by layer.
  void SubmitReadsLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // layer/done/fail about a decode load: handled here, or the load is bound to another peer,
  // or no load of this side has that transfer id.
  enum class LoadResult { kHandled, kBoundElsewhere, kNotALoad };
  LoadResult OnLoadResult(const InboxEvent& n, const PeerMessage& m)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefuseBoundElsewhere(const InboxEvent& n, const PeerMessage& m)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers a hello whose regions arrived (ServePendingHellos).
  void OnHello(PeerId peer, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The peer broke the protocol (a malformed, unknown or unexpected message, or one about a
  // transfer bound to another peer): it is closed, with `reason` in its Goodbye, once the
  // lock is released; requests bound to it fail now. Nothing else is touched.
  void ClosePeerLocked(PeerId peer, const std::string& name, absl::Status reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the peers ClosePeerLocked queued (outside mu_: closing joins transport threads).
  void CloseQueuedPeers() ABSL_LOCKS_EXCLUDED(mu_);
  // False (and the sender is closed) when `r` is bound to a peer other than `peer`; binds an
  // unbound `r` to `peer` when `bind`.
  bool CheckBinding(Request& r, PeerId peer, const std::string& name, const PeerMessage& m,
                    bool bind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Request* FindByTransfer(const std::string& tid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decode: the live request loading `tid` (any mode), or nullptr.
  Request* FindDecodeByTransfer(const std::string& tid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnWriteRequest(const InboxEvent& n, PeerMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  void LayerTransferDone(Request& r, int layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // Feeds `event` to r's request machine with the facts read off `r` (FactsLocked) and
  // returns the row taken. An event no row takes is counted (machine_refused in the stats)
  // and logged, and nullptr is returned; the handler goes on as it would (its own checks
  // decide what the event does), so a table that disagrees with the handlers shows in the
  // counts rather than in a changed request.
  const connector_internal::Transition* StepLocked(Request& r, Event e,
                                                   bool nothing_to_move = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  connector_internal::RequestFacts FactsLocked(const Request& r, Event e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `r` leaves the table as `end`: counted (machine_diverged) and logged when its machine
  // ended elsewhere.
  void CheckMachineEndLocked(const Request& r, State end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TellPeer(Request& r, bool ok, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a request once nothing touches its blocks any more (else drains first).
  void FailLocked(Request& r, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `event`: what aborts it (kAbort, kSchedulerFinished, kPeerFail), fed to its machine.
  void AbortLocked(Request& r, const std::string& reason, Event event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill: the reader said it will not read (PeerMessage::unread); the blocks go now.
  void ReleaseUnreadLocked(Request& r, PeerId reader, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TellUnreadLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Retire(Request& r, const char* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefill: remembers an ended transfer id with why it ended (retired_transfers), bounded.
  void RememberRetiredLocked(const Request& r, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool PeerAlive(PeerId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !sessions_.dead.Contains(id);
  }

  // --- progress ---------------------------------------------------------------------------
  void ProgressLoop();
  // The events to handle now, each peer's after the ops it had this engine serve; a peer with
  // ops in flight is parked, not waited for (peer_messages.cc). Progress thread only.
  std::vector<InboxEvent> OrderAfterServedOps(
      std::vector<InboxEvent> events,
      absl::Span<const connector_internal::ProgressSignal::EndedTransfer> ended)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Answers the hellos whose regions arrived (or whose deadline passed).
  void ServePendingHellos() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The engine closed `peer` (lease expiry, Goodbye, I/O error): every request bound to it
  // fails now, not at its deadline.
  void OnPeerDeath(PeerId peer, const std::string& name, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Submits one transfer of `r` moving `layer`: recorded in `r` under a ticket of the
  // connector's now, handed to the engine once mu_ is released (queued in the outbox, in order
  // with the messages; FlushOutbox), its end pushed to OnTransferEnded under that ticket. An
  // engine that refuses the transfer ends it there, as a failed transfer. A peer known dead is
  // an error now. `grant`: the source's read grant (read mode), presented with every op.
  absl::Status SubmitLocked(Request& r, PeerId peer, OpKind kind, std::vector<Op> ops, int layer,
                            GrantId grant = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The end of the transfer under ticket `id` (progress thread; FlushOutbox for a transfer the
  // engine refused).
  void OnTransferEnded(TransferId id, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckDeadlines() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // When the progress thread must look again with nothing reported: the earliest request
  // deadline or lease, early write expiry, or pending hello deadline.
  absl::Time NextWakeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Pending hellos and what came before its request (connector_request.h).
  using PendingHello = connector_internal::PendingHello;
  using EarlyWrite = connector_internal::EarlyWrite;
  using EarlyRead = connector_internal::EarlyRead;
  using EarlyRelease = connector_internal::EarlyRelease;

  const ConnectorOptions options_;
  // Declared before engine_ so that it outlives the engine, whose completion thread reports
  // into it until ~Engine returns (the callbacks hold it too).
  const std::shared_ptr<connector_internal::ProgressSignal> signal_ =
      std::make_shared<connector_internal::ProgressSignal>();
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

  // Lock order (a path that holds two takes them in this order; the later ones are leaves
  // that call nothing while held):
  //   discovery_mu_ (alone)  |  mu_ -> accounting_'s lock -> signal_'s lock
  // mu_ guards the request state machine: the request table, the peer sessions, the
  // write-mode pushes and the event-gated saves move together in every transition (a message
  // about a transfer looks up its request, checks the peer it is bound to, and may end both),
  // so they are separate components under one lock rather than locks that every path would
  // take together. Connector messages and transfers are queued under mu_ and sent (submitted)
  // after it is released (outbox_, FlushOutbox), and so are grant revocations (each an
  // Engine::RevokeWhenServed whose word comes back as an event) and grants (OutGrant). The
  // engine never
  // calls back into the connector under its locks (completions and inbox events only signal
  // signal_), so no engine lock is ever waited for in the other order. Disconnect, which joins
  // transport threads, runs outside mu_ (CloseQueuedPeers).
  mutable Mutex mu_;
  CondVar cv_;  // a request, peer or save changed (WaitForLayerLoad, WaitForSave, EnsurePeer)
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  CondVar waiter_cv_;  // wakes the event waiter (new save, stop)
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  Layout layout_ ABSL_GUARDED_BY(mu_);
  std::vector<RegionSpan> local_regions_ ABSL_GUARDED_BY(mu_);
  std::vector<KvMemory> local_memory_ ABSL_GUARDED_BY(mu_);  // as registered (kinds, devices)

  // Live requests and what is remembered of ended ones.
  struct RequestTable {
    std::map<std::string, Request> requests;         // by request id
    std::map<std::string, std::string> by_transfer;  // connector transfer id -> request id
    // Transfers in flight, by ticket (SubmitLocked) -> the request they belong to.
    absl::flat_hash_map<TransferId, std::string> transfer_owner;
    // Prefill read mode: served-ops watches (AwaitServedLocked), by ticket -> request id.
    absl::flat_hash_map<TransferId, std::string> served_watch;
    // Read mode, releases of transfer ids not held (yet): a scheduler in another process
    // hands a transfer id out before its worker holds the blocks under it (RequestFinished
    // with a given id), so a fast reader's release can come first. One per reader of a
    // transfer id (a decode with tensor parallelism has several); bounded, oldest id dropped.
    std::multimap<std::string, EarlyRelease> early_releases;
    // Read mode, read_starts of transfer ids not held (yet), one per reader: granted when the
    // hold comes, refused (fail, counted in reads_refused) after handshake_timeout. Bounded
    // like early_releases (the oldest id's are refused at once).
    std::multimap<std::string, EarlyRead> early_reads;
    std::deque<std::string> early_read_order;
    std::deque<std::string> early_release_order;
    std::set<std::string> retired_early;
    // Prefill transfers that failed, with the reason, for decodes that ask late.
    std::map<std::string, std::string> retired_transfers;
    std::deque<std::string> retired_order;
    std::vector<std::string> pending_loads;
    std::vector<std::string> pending_saves;
    std::vector<std::string> bound_loads;
    std::vector<std::string> bound_saves;
    FinishedRequests finished;
  };
  RequestTable table_ ABSL_GUARDED_BY(mu_);

  // Connector peers: handshakes, their layouts and regions, deaths, protocol closes.
  struct PeerSessions {
    std::map<PeerId, Peer> peers;
    std::map<std::string, PeerId> by_address;
    // Bounded: engine peer ids are never reused, and a dead peer's control connection is
    // closed (its token revoked) by the engine right after it is marked here, so nothing
    // arriving after a few thousand later deaths can name it.
    RecentSet<PeerId> dead{kClosedPeersRemembered};
    std::vector<std::pair<PeerId, absl::Status>> to_close;
    std::vector<PendingHello> pending_hellos;
  };
  PeerSessions sessions_ ABSL_GUARDED_BY(mu_);

  // Connector messages and engine transfers queued under mu_, sent outside it (SendMessage,
  // SubmitLocked, FlushOutbox): no Transfer (with its shm copy) is made under mu_.
  struct OutTransfer {
    TransferId ticket = 0;  // the connector's name of the transfer (Request::transfers)
    OpKind kind = OpKind::kWrite;
    std::vector<Op> ops;
    TransferOptions options;
  };
  using OutRevoke = connector_internal::OutRevoke;
  using OutGrant = connector_internal::OutGrant;
  struct OutMessage {
    PeerId peer = 0;
    std::string payload;
    std::string request;                  // fails this request if the send fails ("" for none)
    std::optional<OutTransfer> transfer;  // a transfer to submit instead of a message
    std::optional<OutRevoke> revoke;      // a grant to revoke instead of a message
    std::optional<OutGrant> grant;        // a grant to make instead of a message
  };
  struct Outbox {
    // Vectors, swapped with the drainer's batch (outbox_batch_) so that both keep their
    // capacity: queueing and draining allocate nothing at steady state.
    std::vector<OutMessage> queue;
    bool draining = false;   // a thread is sending; it takes what others queue meanwhile
    TransferId tickets = 0;  // the last transfer ticket handed out
  };
  Outbox outbox_ ABSL_GUARDED_BY(mu_);
  // The batch being sent; only the drainer (outbox_.draining, set under mu_) touches it.
  std::vector<OutMessage> outbox_batch_;

  // Peers whose events wait for the ops they had served (OrderAfterServedOps; the progress
  // thread's alone, no lock). Tickets kParkTicket | n, apart from the outbox's.
  static constexpr TransferId kParkTicket = TransferId{1} << 63;
  absl::flat_hash_map<PeerId, connector_internal::ParkedPeer> parked_;
  TransferId park_seq_ = 0;

  // Prefill, write mode: write requests that came before the scheduler saw their request.
  struct WritePushes {
    std::map<std::string, EarlyWrite> early_writes;
  };
  WritePushes pushes_ ABSL_GUARDED_BY(mu_);

  // Prefill, write mode: saves gated on GPU events, in order (event_saves.cc).
  struct EventSaveQueue {
    std::deque<EventSave> queue;
    uint64_t queued = 0;  // sequence of the last one queued
    uint64_t taken = 0;   // all up to this one are taken
  };
  EventSaveQueue saves_ ABSL_GUARDED_BY(mu_);

  // The request machines' steps (StepLocked, CheckMachineEndLocked; in the stats).
  struct MachineCounters {
    uint64_t steps = 0;
    uint64_t refused = 0;
    uint64_t diverged = 0;
  };
  MachineCounters machine_ ABSL_GUARDED_BY(mu_);

  // Prefill read: ops under revoked grants still served at a releasing request's deadlines
  // (CheckDeadlines; in the stats). Both stay 0 unless a reader stops draining its data path.
  struct ServedPastDeadline {
    uint64_t readers_closed = 0;      // readers closed at the second deadline
    uint64_t freed_while_served = 0;  // blocks freed at the third, their ops still served
  };
  ServedPastDeadline served_late_ ABSL_GUARDED_BY(mu_);

  // Outcome counters and recent requests: a lock of its own (see the lock order above).
  connector_internal::ConnectorMetrics accounting_;
};

}  // namespace kvwire

#endif  // KVWIRE_CONNECTOR_CONNECTOR_IMPL_H_

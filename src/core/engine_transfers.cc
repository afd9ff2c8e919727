// The transfer path (validate, route, plan, post, complete) and the target-side hooks the
// transports call for incoming data.
#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/core/engine_impl.h"
#include "src/core/op_planner.h"
#include "src/core/route.h"
#include "src/util/clock.h"
#include "src/util/log.h"

namespace kvwire {
namespace {

absl::Status OpError(size_t index, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("op ", index, ": ", s.message()));
}

// The one-lane transfer whose Post runs in this thread, for its lane callback to tell whether
// it was called inline (by Post, in this thread, before Post returned) or later (another
// thread, a device copy's end). Keyed by engine and id: two engines in one process number
// their transfers alike.
struct InlineEnd {
  const void* engine = nullptr;
  TransferId id = 0;
  bool done = false;
  absl::Status status;
};
thread_local InlineEnd* tls_inline_end = nullptr;

// A lane's error, named and not only numbered: it reaches users (a connector's load outcome)
// who know their peers by name.
absl::Status NamedFailure(TransferId id, PeerId peer_id, const Peer* peer,
                          const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("transfer ", id, " to peer ", peer_id,
                                                  peer ? absl::StrCat(" (", peer->name, ")") : "",
                                                  ": ", status.message()));
}

// An incoming op on device memory where a transport serving incoming ops cannot move it.
absl::Status GpuNotServed(RegionId region) {
  return absl::FailedPreconditionError(
      absl::StrCat("region ", region,
                   " is GPU memory and a transport of this engine serving it cannot move GPU "
                   "memory"));
}

}  // namespace

absl::StatusOr<TransferId> Engine::Impl::Transfer(PeerId peer_id, OpKind kind,
                                                  absl::Span<const Op> ops,
                                                  const TransferOptions& options) {
  absl::StatusOr<TransferId> id = TransferOnce(peer_id, kind, ops, options);
  if (id.ok() || !core::IsRegionMoving(id.status())) [[likely]]
    return id;
  // A local region lies in a buffer being moved onto a fresh memfd (shm revocation): the
  // transfer holds no pin now; it waits for the move to end, within its own deadline, then
  // starts again against the same addresses (the owner's bytes stay where they were).
  const absl::Time deadline = absl::Now() + options.timeout.value_or(options_.transfer_timeout);
  while (!id.ok() && core::IsRegionMoving(id.status())) {
    if (!regions_.WaitForMoves(deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("transfer: ", id.status().message(), "; the move did not end in time"));
    }
    id = TransferOnce(peer_id, kind, ops, options);
  }
  return id;
}

absl::StatusOr<TransferId> Engine::Impl::TransferOnce(PeerId peer_id, OpKind kind,
                                                      absl::Span<const Op> ops,
                                                      const TransferOptions& options) {
  std::shared_ptr<Peer> peer = GetPeer(peer_id);
  if (!peer) return absl::NotFoundError(absl::StrCat("transfer: unknown peer ", peer_id));
  if (ops.empty()) return absl::InvalidArgumentError("transfer: no ops");
  const char* verb = kind == OpKind::kRead ? "READ" : "WRITE";

  // Local side: every op inside a registered region, each region pinned for the transfer.
  // Inline storage: a transfer of a few ops over a few regions allocates nothing here.
  absl::InlinedVector<RegionId, 2> local_regions;
  // The last lane's request, whose pins are collected in place (not moved into it later).
  transport::PostRequest last_request;
  transport::Pins& pins = last_request.pins;
  absl::InlinedVector<transport::WireOp, 4> wire;
  core::TransferNeeds needs;
  needs.kind = kind;
  wire.reserve(ops.size());
  // Ops mostly come in runs of one region: an op in the region of the op before it is checked
  // against that region's entry, which a pin of this transfer holds (ids are never reused), so
  // a run costs one trip through the registry's lock, not one per op.
  const core::RegionEntry* last_entry = nullptr;
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    if (last_entry == nullptr || op.local_region != local_regions.back()) {
      auto local = regions_.ResolveLocal(op.local_region, op.local_offset, op.length);
      if (!local.ok()) {
        // Unwrapped: Transfer waits for the move and starts again.
        if (core::IsRegionMoving(local.status())) [[unlikely]]
          return local.status();
        return OpError(i, local.status());
      }
      auto known = std::find(local_regions.begin(), local_regions.end(), op.local_region);
      if (known == local_regions.end()) {
        local_regions.push_back(op.local_region);
        pins.push_back(std::move(local->pin));
      } else {
        // Pinned already, further back: moved to the back (with its pin), so that it is the
        // one the next ops are compared with. The order of the pins does not matter.
        const size_t k = static_cast<size_t>(known - local_regions.begin());
        std::swap(local_regions[k], local_regions.back());
        std::swap(pins[k], pins.back());
      }
      last_entry = static_cast<const core::RegionEntry*>(pins.back().get());
    } else if (absl::Status s = core::CheckBounds("local", op.local_region, op.local_offset,
                                                  op.length, last_entry->region.length);
               !s.ok()) {
      return OpError(i, s);
    }
    const int gpu_device = last_entry->region.gpu_device;
    wire.push_back(transport::WireOp{last_entry->region.base + op.local_offset, op.remote_region,
                                     op.remote_offset, op.length, gpu_device, op.local_region});
    (gpu_device >= 0 ? needs.local_gpu : needs.local_host) = true;
  }

  // Remote side: exported to us, permission, bounds; and the route (src/core/route.h).
  std::shared_ptr<transport::Channel> channel;
  const transport::Capabilities* caps = nullptr;
  size_t route_index = 0;
  uint32_t lanes = 1;
  bool remote_gpu = false;
  {
    MutexLock lock(&peer->mu);
    if (!peer->alive) {
      return absl::UnavailableError(
          absl::StrCat("transfer: peer ", peer->name, " closed: ", peer->close_reason));
    }
    if (!peer->setup_done) {
      return absl::UnavailableError(
          absl::StrCat("transfer: data path to peer ", peer->name, " is not ready yet"));
    }
    const uint32_t needed = kind == OpKind::kRead ? kRemoteRead : kRemoteWrite;
    needs.reaches = ~core::TransportMask{0};
    // As on the local side: an op in the remote region of the op before it needs only its
    // bounds checked (the rest depends on the region alone, and peer->mu is held throughout).
    const RemoteRegionState* last = nullptr;
    for (size_t i = 0; i < ops.size(); ++i) {
      const Op& op = ops[i];
      if (last == nullptr || op.remote_region != ops[i - 1].remote_region) {
        auto it = peer->remote.find(op.remote_region);
        if (it == peer->remote.end()) {
          return OpError(
              i, absl::NotFoundError(absl::StrCat("remote region ", op.remote_region,
                                                  " is not exported by peer ", peer->name)));
        }
        last = &it->second;
        const transport::RemoteRegionDesc& desc = last->desc;
        if ((desc.access & needed) == 0) {
          return OpError(i, absl::PermissionDeniedError(
                                absl::StrCat("peer ", peer->name, " region ", op.remote_region,
                                             " does not allow remote ", verb)));
        }
        remote_gpu = remote_gpu || desc.kind == MemoryKind::kGpu;
        needs.grant_reads = needs.grant_reads || (kind == OpKind::kRead && desc.reads_need_grant);
        needs.guarded = needs.guarded || desc.reads_need_grant;
        needs.reaches &= !last->resolved   ? 0
                         : needs.local_gpu ? last->reached_by_device
                                           : last->reached_by;
      }
      if (absl::Status s = core::CheckBounds("remote", op.remote_region, op.remote_offset,
                                             op.length, last->desc.length);
          !s.ok()) {
        return OpError(i, s);
      }
    }
    needs.guarded_only = peer->guarded_only;
    core::TransportMask connected = 0;
    for (size_t i = 0; i < peer->channels.size(); ++i) {
      if (peer->channels[i]) connected |= core::TransportMask{1} << i;
    }
    // The choice depends on the needs and the connected channels alone (caps_ and
    // rank_order_ are fixed after Init): a peer's transfers mostly need the same, and reuse
    // the last choice instead of ranking the transports again.
    core::RouteMemo& memo = peer->route_memo;
    if (!memo.valid || memo.connected != connected || !core::SameNeeds(memo.needs, needs)) {
      absl::StatusOr<size_t> route =
          core::PickTransport(caps_, rank_order_, connected, needs, peer->name);
      if (!route.ok()) return route.status();
      memo = core::RouteMemo{true, needs, connected, *route};
    }
    const size_t route = memo.route;
    channel = peer->channels[route];
    route_index = route;
    caps = caps_[route];
    lanes = peer->lanes[route];
  }

  core::PlanLimits limits;
  limits.max_op_bytes = std::min<uint64_t>(options_.max_op_bytes, caps->max_op_bytes);
  if ((needs.local_gpu || remote_gpu) && caps->same_host_only) {
    // On one host a GPU op is one device copy, whose launch cost splitting would multiply;
    // EngineOptions::max_op_bytes exists for pipelining host copies and network streams.
    limits.max_op_bytes = caps->max_op_bytes;
  }
  limits.lanes = std::min<uint32_t>(lanes, caps->max_lanes);
  limits.stripe_min_bytes = options_.stripe_min_bytes;
  // One op that is one piece (IsOnePiece, what PlanOps would make of it) goes into its lane's
  // request as it is, without a plan built and moved (~100 instructions per small transfer).
  const bool one_piece = wire.size() == 1 && core::IsOnePiece(wire[0], limits);
  core::Plan plan;
  if (one_piece) {
    plan.total_bytes = wire[0].length;
    plan.merged_ops = 1;
    plan.pieces = 1;
  } else {
    plan = core::PlanOps(absl::MakeSpan(wire), limits);
  }
  const size_t lanes_planned = one_piece ? 1 : plan.lanes.size();

  core::TransferInfo info;
  info.id = next_transfer_id_++;
  info.peer = peer_id;
  info.kind = kind;
  info.bytes = plan.total_bytes;
  info.pieces = plan.pieces;
  // Assigned only when set: copy-assigning an empty optional<string> is not free.
  if (options.notification) info.notification = options.notification;
  info.count_arrivals = kind == OpKind::kWrite && options.notification && caps->counts_arrivals;
  // Nanoseconds read once and kept as they are: absl::Now and Time/Duration arithmetic are
  // library calls (~100 instructions per transfer between the start and the end).
  info.start_ns = UnixNanos();
  info.start = absl::FromUnixNanos(info.start_ns);
  info.deadline = info.start + options.timeout.value_or(options_.transfer_timeout);
  info.transport = static_cast<int>(route_index);
  info.local_regions = std::move(local_regions);
  KVW_LOG(kDebug, "engine") << "transfer start" << Kv("engine", name_) << Kv("transfer", info.id)
                            << Kv("peer", peer->name) << Kv("kind", verb) << Kv("bytes", info.bytes)
                            << Kv("ops", ops.size()) << Kv("pieces", plan.pieces)
                            << Kv("lanes", lanes_planned) << Kv("via", caps->name);

  const TransferId id = info.id;
  const bool count_arrivals = info.count_arrivals;
  // A one-lane transfer with nothing to do at its end but accounting (no notification, no end
  // callback) is ended in this thread when its channel finishes it inline (shm host copies):
  // one step through the table and one through the stats instead of the lane callback's
  // LaneDone, GetPeer, ClaimEnd and CompleteEnd.
  const bool inline_end = lanes_planned == 1 && !options.notification && !options.on_complete;
  // One host op over a channel that ends such ops inline never enters the table at all: its
  // end goes to inline_ends_ (src/core/inline_ends.h), where Wait and Poll find it. Nothing
  // can ask for it while it runs (its id is not out), and one copy has nothing to cancel
  // midway, so it needs no record and no cancellation flag.
  const bool untabled =
      inline_end && one_piece && !needs.local_gpu && !remote_gpu && caps->ends_host_ops_inline;
  core::TransferInfo end_info;  // what RecordEnd reads (inline_end)
  if (inline_end && !untabled) {
    end_info.id = id;
    end_info.peer = peer_id;
    end_info.kind = kind;
    end_info.bytes = info.bytes;
    end_info.pieces = info.pieces;
    end_info.start = info.start;
    end_info.start_ns = info.start_ns;
    end_info.transport = info.transport;
  }
  transfers_started_.fetch_add(1, std::memory_order_relaxed);
  ops_submitted_.fetch_add(ops.size(), std::memory_order_relaxed);
  ops_posted_.fetch_add(plan.pieces, std::memory_order_relaxed);
  // A transfer that may end inline is started without its deadline watched: one that does end
  // inline has EndInline check the deadline (no deadline set entry made and erased per
  // transfer); one that does not is watched from when Post returns.
  const absl::Time deadline = info.deadline;  // for the requests: `info` may be moved below
  std::shared_ptr<std::atomic<bool>> cancelled;
  if (!untabled) {
    cancelled = transfers_.Start(std::move(info), static_cast<uint32_t>(lanes_planned),
                                 options.on_complete, /*arm_deadline=*/!inline_end);
  }
  InlineEnd slot;
  slot.engine = this;
  slot.id = id;
  InlineEnd*& current = tls_inline_end;  // one thread-local lookup for the lanes below
  for (size_t lane = 0; lane < lanes_planned; ++lane) {
    // The last lane posts last_request, which holds the pins; the others copy them.
    const bool last_lane = lane + 1 == lanes_planned;
    std::optional<transport::PostRequest> other_lane;  // built only for the lanes before
    transport::PostRequest& request = last_lane ? last_request : other_lane.emplace();
    request.transfer_id = id;
    request.kind = kind;
    request.lane = static_cast<uint32_t>(lane);
    request.count_arrivals = count_arrivals;
    request.grant = options.grant;
    request.deadline = deadline;
    if (one_piece) {
      request.ops.push_back(wire[0]);
    } else {
      request.ops = std::move(plan.lanes[lane]);
    }
    // The last lane takes the flag, the others copy it.
    if (last_lane) {
      request.cancelled = std::move(cancelled);
    } else {
      request.cancelled = cancelled;
      request.pins = pins;
    }
    InlineEnd* const outer = current;
    if (inline_end) current = &slot;
    channel->Post(std::move(request), [this, id](absl::Status s) {
      if (InlineEnd* e = tls_inline_end; e != nullptr && e->engine == this && e->id == id) {
        e->done = true;
        e->status = std::move(s);
        return;
      }
      OnLaneDone(id, std::move(s));
    });
    current = outer;
  }
  if (untabled) {
    EndUntabled(info, slot.done, std::move(slot.status), peer.get());
    return id;
  }
  // Not done inline: the lane's callback ends it later (OnLaneDone). Done: ended here unless
  // a deadline or the peer's close ended it first (which counted its end).
  if (inline_end && slot.done) {
    if (!slot.status.ok()) slot.status = NamedFailure(id, peer_id, peer.get(), slot.status);
    const int64_t now_ns = UnixNanos();
    if (transfers_.EndInline(id, &slot.status, absl::FromUnixNanos(now_ns))) {
      RecordEnd(end_info, slot.status, peer.get(), now_ns);
    }
  } else if (inline_end) {
    transfers_.ArmDeadline(id);
  }
  return id;
}

void Engine::Impl::EndUntabled(const core::TransferInfo& info, bool done, absl::Status status,
                               Peer* peer) {
  const TransferId id = info.id;
  if (!done) [[unlikely]] {
    // The channel broke Capabilities::ends_host_ops_inline: the end comes later, through
    // OnLaneDone, which needs the record (an end that came before it is lost, and the
    // transfer fails at its deadline).
    KVW_LOG(kError, "engine") << "a channel that ends host ops inline did not"
                              << Kv("engine", name_) << Kv("transfer", id);
    (void)transfers_.Start(info, 1, nullptr, /*arm_deadline=*/true);
    return;
  }
  if (!status.ok()) status = NamedFailure(id, info.peer, peer, status);
  const int64_t now_ns = UnixNanos();
  // Its deadline was not watched while it ran: ended as the deadline thread would have.
  if (status.ok() && info.deadline <= absl::FromUnixNanos(now_ns)) [[unlikely]] {
    status = core::TransferTable::DeadlineError(info);
  }
  // Counted before the id is out: a caller whose Wait returned sees it in Stats().
  RecordEnd(info, status, peer, now_ns);
  if (!inline_ends_.Put(id, status)) [[unlikely]] {
    // Its slot holds an end nobody collected yet: kept in the table instead.
    transfers_.AddEnded(info, std::move(status));
  }
}

void Engine::Impl::OnLaneDone(TransferId id, absl::Status status) {
  std::optional<core::LanesDone> done =
      transfers_.LaneDone(id, std::move(status), /*claim_unless_notifying=*/true);
  if (!done) return;
  const core::TransferInfo& info = done->info;
  absl::Status result = done->status;
  if (result.ok() && info.notification) {
    std::shared_ptr<Peer> peer = GetPeer(info.peer);
    pb::Envelope message;
    pb::Notify* notify = message.mutable_notify();
    notify->set_transfer_id(id);
    notify->set_expected_arrivals(info.count_arrivals ? info.pieces : 0);
    notify->set_payload(*info.notification);
    absl::Status sent = peer ? peer->conn->Send(message) : absl::UnavailableError("peer is gone");
    if (!sent.ok()) {
      result = absl::UnavailableError(absl::StrCat(
          "transfer ", id, ": data moved but the notification was not sent: ", sent.message()));
    } else {
      MutexLock lock(&stats_mu_);
      ++stats_.notifications_sent;
    }
  } else if (!result.ok()) {
    std::shared_ptr<Peer> peer = GetPeer(info.peer);
    result = NamedFailure(id, info.peer, peer.get(), result);
  }
  // Counted before the waiter wakes: a caller whose Wait returned sees this transfer in Stats().
  if (done->claimed || transfers_.ClaimEnd(id)) {
    RecordEnd(info, result);
    transfers_.CompleteEnd(id, std::move(result));
  }
}

void Engine::Impl::RecordEnd(const core::TransferInfo& info, const absl::Status& status) {
  std::shared_ptr<Peer> peer = GetPeer(info.peer);
  RecordEnd(info, status, peer.get(), UnixNanos());
}

void Engine::Impl::RecordEnd(const core::TransferInfo& info, const absl::Status& status, Peer* peer,
                             int64_t end_ns) {
  // Integer nanoseconds (inline) rather than Time arithmetic and ToDoubleMicroseconds.
  const double us = static_cast<double>(end_ns - info.start_ns) * 1e-3;
  {
    MutexLock lock(&stats_mu_);
    if (status.ok()) {
      ++stats_.transfers_succeeded;
      (info.kind == OpKind::kRead ? stats_.bytes_read : stats_.bytes_written) += info.bytes;
      if (info.transport >= 0 && static_cast<size_t>(info.transport) < caps_.size()) {
        MovedBytes& moved = bytes_by_transport_[info.transport];
        moved.used = true;
        (info.kind == OpKind::kRead ? moved.read : moved.written) += info.bytes;
      }
      stats_.transfer_latency.Add(us);
    } else {
      ++stats_.transfers_failed;
      ++stats_.errors_by_kind[absl::StatusCodeToString(status.code())];
    }
  }
  if (peer != nullptr) {
    peer->transfers.fetch_add(1, std::memory_order_relaxed);
    if (status.ok()) {
      (info.kind == OpKind::kRead ? peer->bytes_read : peer->bytes_written)
          .fetch_add(info.bytes, std::memory_order_relaxed);
    }
  }
  if (!status.ok()) {
    KVW_LOG(kWarning, "engine") << "transfer failed" << Kv("engine", name_)
                                << Kv("transfer", info.id) << Kv("peer", info.peer)
                                << Kv("status", status.ToString());
  }
}

void Engine::Impl::ReaperLoop() {
  // Stale arrival counters are swept now and then; deadlines are met when they fall due.
  constexpr absl::Duration kPrunePeriod = absl::Seconds(1);
  absl::Time next_prune = absl::Now() + kPrunePeriod;
  while (transfers_.WaitForDeadline(next_prune)) {
    const absl::Time now = absl::Now();
    for (const core::TransferInfo& info : transfers_.ExpireDeadlines(now)) {
      RecordEnd(info, absl::DeadlineExceededError("deadline exceeded"));
    }
    if (now >= next_prune) {
      arrivals_.Prune(now, absl::Minutes(10));
      next_prune = now + kPrunePeriod;
    }
  }
}

// --- target side ---------------------------------------------------------------------------

absl::StatusOr<PeerId> Engine::Impl::PeerForToken(const std::string& token) {
  if (token.empty()) return absl::UnauthenticatedError("no session token presented");
  MutexLock lock(&peers_mu_);
  auto it = tokens_.find(token);
  if (it == tokens_.end()) {
    return absl::UnauthenticatedError("unknown session token (no completed handshake issued it)");
  }
  return it->second;
}

absl::StatusOr<transport::IncomingAccess> Engine::Impl::ResolveIncoming(
    PeerId peer, RegionId region, uint64_t offset, uint64_t length, OpKind kind) {
  // A transport that carries no grant: grant-guarded regions are not readable through it.
  return ResolveIncoming(peer, region, offset, length, kind, /*grant=*/0);
}

absl::StatusOr<transport::IncomingAccess> Engine::Impl::ResolveIncoming(
    PeerId peer, RegionId region, uint64_t offset, uint64_t length, OpKind kind, GrantId grant) {
  bool grant_refused = false;
  absl::StatusOr<core::ResolvedRange> resolved = core::CheckIncoming(
      regions_, grants_, peer, region, offset, length, kind, grant, &grant_refused);
  // A region whose buffer is being moved (shm revocation) answers IsRegionMoving's status:
  // not a refusal, the transport tries the op again after the move (tcp parks it; a serving
  // thread never waits here, since other connections it serves may hold the pins the move
  // waits for).
  if (!resolved.ok() && core::IsRegionMoving(resolved.status())) [[unlikely]] {
    return resolved.status();
  }
  MutexLock lock(&stats_mu_);
  if (!resolved.ok()) {
    ++stats_.incoming_rejected;
    if (grant_refused) {
      ++stats_.grant_refused;
      KVW_LOG(kWarning, "engine") << "READ refused: no grant covers it" << Kv("engine", name_)
                                  << Kv("peer", peer) << Kv("region", region)
                                  << Kv("offset", offset) << Kv("length", length)
                                  << Kv("reason", resolved.status().message());
    }
    return resolved.status();
  }
  if (resolved->gpu_device >= 0 && !incoming_gpu_ok_) {
    // Only transports that reach every region serve incoming ops themselves; one of them
    // cannot move device memory (and the engine cannot tell which one asks).
    ++stats_.incoming_rejected;
    return GpuNotServed(region);
  }
  ++stats_.incoming_ops;
  if (grant != 0 && kind == OpKind::kRead) {
    // Counted under its grant (what the peer read under it: Engine::RevokeWhenServed); a
    // grant revoked since CheckIncoming refuses a guarded READ here after all.
    std::shared_ptr<const void> pin = served_ops_->BeginGranted(
        peer, grant, length, resolved->reads_need_grant, grants_, std::move(resolved->pin));
    if (pin == nullptr) {
      ++stats_.incoming_rejected;
      ++stats_.grant_refused;
      return absl::PermissionDeniedError(
          absl::StrCat("grant ", grant, " is not live for this peer (unknown or revoked)"));
    }
    return transport::IncomingAccess{resolved->data, resolved->gpu_device, std::move(pin)};
  }
  return transport::IncomingAccess{resolved->data, resolved->gpu_device,
                                   served_ops_->Begin(peer, std::move(resolved->pin))};
}

transport::IncomingRun Engine::Impl::ResolveIncomingRun(
    PeerId peer, absl::Span<const transport::IncomingOp> ops, OpKind kind, GrantId grant,
    absl::Span<transport::IncomingMemory> memory) {
  core::CheckedRun checked =
      core::CheckIncomingRun(regions_, grants_, peer, ops, kind, grant, memory);
  transport::IncomingRun run;
  run.resolved = checked.passed;
  run.status = std::move(checked.refused);
  if (!incoming_gpu_ok_) {
    // As ResolveIncoming: device memory only where every serving transport moves it.
    for (size_t i = 0; i < run.resolved; ++i) {
      if (memory[i].gpu_device >= 0) {
        run.resolved = i;
        run.status = GpuNotServed(ops[i].region);
        checked.grant_refused = false;
        break;
      }
    }
  }
  uint64_t bytes = 0;
  for (size_t i = 0; i < run.resolved; ++i) bytes += ops[i].length;
  // The regions' pins, held together by the run's one served-ops pin.
  std::shared_ptr<const void> inner;
  if (checked.pins.size() == 1) {
    inner = std::move(checked.pins.front());
  } else if (!checked.pins.empty()) {
    inner = std::make_shared<absl::InlinedVector<std::shared_ptr<const void>, 2>>(
        std::move(checked.pins));
  }
  if (run.resolved > 0) {
    if (grant != 0 && kind == OpKind::kRead) {
      // Counted under its grant, as ResolveIncoming's ops. A grant revoked since the check
      // refuses the run's first op on a grant-guarded region here (as it would refuse that op
      // alone); the ops before it, on open regions, are served without the grant.
      const size_t first_guarded = checked.first_guarded;
      const bool required = first_guarded < run.resolved;
      std::shared_ptr<const void> kept = required ? inner : nullptr;
      run.pin = served_ops_->BeginGranted(peer, grant, bytes, required, grants_, std::move(inner));
      if (run.pin == nullptr) {
        run.resolved = first_guarded;
        run.status = absl::PermissionDeniedError(
            absl::StrCat("grant ", grant, " is not live for this peer (unknown or revoked)"));
        checked.grant_refused = true;
        if (first_guarded > 0) run.pin = served_ops_->Begin(peer, std::move(kept));
      }
    } else {
      run.pin = served_ops_->Begin(peer, std::move(inner));
    }
  }
  MutexLock lock(&stats_mu_);
  stats_.incoming_ops += run.resolved;
  // A region being moved is not a refusal: the transport asks again after the move.
  if (!run.status.ok() && !core::IsRegionMoving(run.status)) {
    ++stats_.incoming_rejected;
    if (checked.grant_refused) {
      ++stats_.grant_refused;
      const transport::IncomingOp& op = ops[run.resolved];
      KVW_LOG(kWarning, "engine") << "READ refused: no grant covers it" << Kv("engine", name_)
                                  << Kv("peer", peer) << Kv("region", op.region)
                                  << Kv("offset", op.offset) << Kv("length", op.length)
                                  << Kv("reason", run.status.message());
    }
  }
  return run;
}

absl::StatusOr<transport::LocalRegion> Engine::Impl::ExportedRegion(PeerId peer, RegionId region) {
  absl::StatusOr<transport::LocalRegion> r = regions_.ExportedRegion(peer, region);
  if (r.ok() && r->reads_need_grant) {
    // A mapping reads the whole region, which no grant check can stop: such a region is
    // never mapped (its ops go over a transport whose target checks them).
    return absl::PermissionDeniedError(absl::StrCat(
        "region ", region, " is readable only under a grant and is never mapped by a peer"));
  }
  return r;
}

absl::StatusOr<GrantId> Engine::Impl::Grant(PeerId peer_id, absl::Span<const GrantRange> ranges) {
  if (ranges.empty()) return absl::InvalidArgumentError("Grant: no ranges");
  std::shared_ptr<Peer> peer = GetPeer(peer_id);
  if (!peer) return absl::NotFoundError(absl::StrCat("Grant: unknown peer ", peer_id));
  {
    MutexLock lock(&peer->mu);
    if (!peer->alive) {
      return absl::NotFoundError(absl::StrCat("Grant: peer ", peer->name, " closed"));
    }
  }
  // Exported to the peer, readable by it, inside the region (no overflow). A range of the
  // region of the range before it needs its bounds checked only: the rest depends on the
  // region alone, whose entry the pin holds (a request's ranges come in runs of a region, so
  // its thousands of ranges take a few trips through the registry's lock, not one each). A
  // region unexported meanwhile is no loss: every READ under the grant is checked again.
  std::shared_ptr<const void> pinned;
  RegionId pinned_region = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const GrantRange& r = ranges[i];
    absl::Status checked;
    if (pinned != nullptr && r.region == pinned_region) {
      checked =
          core::CheckBounds("remote", r.region, r.offset, r.length,
                            static_cast<const core::RegionEntry*>(pinned.get())->region.length);
    } else {
      auto resolved = regions_.ResolveForPeer(peer_id, r.region, r.offset, r.length, OpKind::kRead,
                                              /*for_op=*/false);
      if (resolved.ok()) {
        pinned = std::move(resolved->pin);
        pinned_region = r.region;
      } else {
        checked = resolved.status();
      }
    }
    if (!checked.ok()) {
      return absl::Status(checked.code(),
                          absl::StrCat("Grant: range ", i, ": ", checked.message()));
    }
  }
  const GrantId id = grants_.Add(peer_id, ranges);
  // A peer that closed meanwhile never comes back (ids are not reused): its grant is dropped.
  bool alive;
  {
    MutexLock lock(&peer->mu);
    alive = peer->alive;
  }
  if (!alive) {
    (void)grants_.Remove(peer_id, id);
    return absl::NotFoundError(absl::StrCat("Grant: peer ", peer->name, " closed"));
  }
  KVW_LOG(kDebug, "engine") << "grant" << Kv("engine", name_) << Kv("peer", peer->name)
                            << Kv("grant", id) << Kv("ranges", ranges.size());
  return id;
}

absl::Status Engine::Impl::Revoke(PeerId peer, GrantId grant) {
  // Through the served ops: their grant watches stop waiting for bytes (served_ops.h).
  return served_ops_->Revoke(peer, grant, grants_);
}

void Engine::Impl::OnWriteArrived(PeerId peer, TransferId transfer_id) {
  if (absl::Status s = arrivals_.OnArrival(peer, transfer_id); !s.ok()) OnPeerError(peer, s);
}

void Engine::Impl::OnPeerError(PeerId peer_id, const absl::Status& error) {
  KVW_LOG(kError, "engine") << "dropping peer after protocol error" << Kv("engine", name_)
                            << Kv("peer", peer_id) << Kv("error", error.ToString());
  std::shared_ptr<Peer> peer = GetPeer(peer_id);
  if (!peer || stopping_) return;
  worker_->Post([this, peer, error] { ClosePeer(peer, error); });
}

// The shm transport's check that its socket peer is the process that handshook.
uint32_t Engine::Impl::PeerProcessId(PeerId peer) {
  MutexLock lock(&peers_mu_);
  auto it = peers_.find(peer);
  // `hello` is set before the peer is published and never changes.
  return it == peers_.end() ? 0 : it->second->hello.pid();
}

}  // namespace kvwire

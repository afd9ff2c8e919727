// Connector peers: the messages of running requests (one handler per type: release, layer,
// done, fail; write_req's is write_mode.cc's, the handshake's peer_sessions.cc's, read_start's
// and read_ok's read_grants.cc's), the checks that bind a transfer to its peer, and the progress
// thread that drives them.
#include <algorithm>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

namespace connector_internal {

namespace {

// Keeps an early release of `tid` by its peer (each reader's first one; at most kMaxReaders
// of one transfer id), dropping the oldest transfer id's beyond kMaxEarlyReleases. A template
// so that it names no private type of Connector::Impl.
template <typename Release>
void RememberEarlyRelease(std::multimap<std::string, Release>& releases,
                          std::deque<std::string>& order, const std::string& tid, Release release) {
  auto [it, end] = releases.equal_range(tid);
  const bool known = it != end;
  size_t readers = 0;
  for (; it != end; ++it, ++readers) {
    if (it->second.peer == release.peer) return;
  }
  if (readers >= static_cast<size_t>(kMaxReaders)) return;
  releases.emplace(tid, std::move(release));
  if (known) return;  // its id is in `order` already
  order.push_back(tid);
  if (order.size() > connector_internal::kMaxEarlyReleases) {
    releases.erase(order.front());
    order.pop_front();
  }
}

}  // namespace

}  // namespace connector_internal

// Each message type has one handler, which gets the parsed, typed message; a message that
// does not parse (unknown type included) closes its sender alone.
void Connector::Impl::OnMessage(const InboxEvent& n) {
  using Type = PeerMessage::Type;
  struct Route {
    Type type;
    bool after_handshake;  // refused from a peer whose connector handshake is not done
    void (Impl::*handle)(const InboxEvent& from, PeerMessage& m);
  };
  static constexpr Route kRoutes[] = {
      {Type::kHello, false, &Impl::OnHelloMessage},
      {Type::kHelloAck, false, &Impl::OnHelloAnswer},
      {Type::kHelloErr, false, &Impl::OnHelloAnswer},
      {Type::kReadStart, true, &Impl::OnReadStart},
      {Type::kRelease, true, &Impl::OnRelease},
      {Type::kWriteReq, true, &Impl::OnWriteRequest},
      {Type::kLayer, true, &Impl::OnLayer},
      {Type::kDone, true, &Impl::OnDone},
      {Type::kFail, true, &Impl::OnFail},
      {Type::kReadOk, true, &Impl::OnReadOk},
  };
  if (!PeerAlive(n.peer)) return;  // closed here earlier in this batch
  absl::StatusOr<PeerMessage> parsed = connector_internal::ParsePeerMessage(n.payload);
  if (!parsed.ok()) {
    ClosePeerLocked(n.peer, n.peer_name, parsed.status());
    return;
  }
  const Route* route = std::find_if(std::begin(kRoutes), std::end(kRoutes),
                                    [&](const Route& r) { return r.type == parsed->type; });
  if (route == std::end(kRoutes)) {  // a type the parser knows and nothing handles
    ClosePeerLocked(n.peer, n.peer_name,
                    absl::InternalError(absl::StrCat("connector message '", parsed->name,
                                                     "' has no handler here")));
    return;
  }
  if (route->after_handshake) {
    auto pit = sessions_.peers.find(n.peer);
    if (pit == sessions_.peers.end() || !pit->second.ready) {
      ClosePeerLocked(
          n.peer, n.peer_name,
          absl::FailedPreconditionError(absl::StrCat("connector message '", parsed->name,
                                                     "' before the connector handshake")));
      return;
    }
  }
  (this->*route->handle)(n, *parsed);
}

// release: the reader is done with a read-mode hand-off (or failed).
void Connector::Impl::OnRelease(const InboxEvent& n, PeerMessage& m) {
  const std::string& tid = m.transfer_id;
  Request* r = FindByTransfer(tid);
  if (r == nullptr) {
    // Ended here already, or not held yet (see table_.early_releases): kept for a while.
    // The reason is cut short: thousands of these may wait.
    connector_internal::RememberEarlyRelease(
        table_.early_releases, table_.early_release_order, tid,
        EarlyRelease{n.peer, ReaderPlaceLocked(n.peer), m.ok, m.unread, m.reason.substr(0, 256)});
    return;
  }
  if (r->mode != KvMode::kRead) {
    ClosePeerLocked(
        n.peer, n.peer_name,
        absl::FailedPreconditionError(absl::StrCat("connector message 'release' for transfer ", tid,
                                                   ", which is not a read-mode hand-off")));
    return;
  }
  Request::Reader* reader =
      ClaimReaderLocked(*r, n.peer, n.peer_name, "release", ReaderPlaceLocked(n.peer));
  if (reader == nullptr) return;
  if (m.ok && !m.unread && !reader->done) reader->read_bytes = m.read_bytes;
  if (m.unread) {
    ReaderDoneLocked(*r, n.peer, ReadEnd::kUnread, m.reason);
  } else if (m.ok) {
    ReaderDoneLocked(*r, n.peer, ReadEnd::kRead, "");
  } else {
    ReaderDoneLocked(*r, n.peer, ReadEnd::kFailed, absl::StrCat("reader failed: ", m.reason));
  }
}

// layer, done, fail on the decode side: results of a write-mode load (or prefill stopping),
// accepted only from the prefill the load is bound to.
Connector::Impl::LoadResult Connector::Impl::OnLoadResult(const InboxEvent& n,
                                                          const PeerMessage& m) {
  using Type = PeerMessage::Type;
  Request* d = nullptr;
  std::optional<PeerId> d_peer;
  for (auto& [id, r] : table_.requests) {
    if (!r.decode) continue;
    if (r.params.transfer_id == m.transfer_id) {
      d = &r;
      d_peer = r.peer;
      break;
    }
    for (const auto& [source, source_tid] : r.tp_sources) {
      if (source_tid == m.transfer_id) {
        d = &r;
        d_peer = source;
      }
    }
    if (d != nullptr) break;
  }
  if (d == nullptr) return LoadResult::kNotALoad;
  if (d_peer != n.peer) return LoadResult::kBoundElsewhere;
  Request& r = *d;
  if (r.mode != KvMode::kWrite) {
    // Read mode: a "fail" before the READs started (the prefill refused the read_start: it
    // holds no such transfer, or could not grant it) ends the load; once they started, the
    // READs themselves fail.
    if (m.type == Type::kFail && r.mode == KvMode::kRead &&
        (r.state == State::kLoading || r.state == State::kDraining)) {
      StepLocked(r, Event::kPeerFail);  // in flight or draining: the READs end on their own
    }
    if (m.type == Type::kFail && r.state == State::kLoading && r.transfers.empty()) {
      FailLocked(r, r.fail_reason.empty() ? absl::StrCat("prefill: ", m.reason) : r.fail_reason);
    }
    return LoadResult::kHandled;
  }
  if (r.state != State::kLoading && r.state != State::kDraining) return LoadResult::kHandled;
  StepLocked(r, m.type == Type::kLayer  ? Event::kPeerLayer
                : m.type == Type::kDone ? Event::kPeerDone
                                        : Event::kPeerFail);
  if (m.type == Type::kLayer) {
    r.layers_pending.erase(m.layer);
    cv_.SignalAll();  // WaitForLayerLoad
  } else if (m.type == Type::kDone && r.state == State::kLoading && r.fail_reason.empty()) {
    CompleteLocked(r);
  } else {
    r.abort_sent = true;  // prefill writes nothing more
    FailLocked(r, r.fail_reason.empty() ? absl::StrCat("prefill: ", m.reason) : r.fail_reason);
  }
  return LoadResult::kHandled;
}

void Connector::Impl::RefuseBoundElsewhere(const InboxEvent& n, const PeerMessage& m) {
  ClosePeerLocked(
      n.peer, n.peer_name,
      absl::PermissionDeniedError(absl::StrCat("connector message '", m.name, "' for transfer ",
                                               m.transfer_id, ", which is bound to another peer")));
}

void Connector::Impl::OnLayer(const InboxEvent& n, PeerMessage& m) {
  // Else: a transfer that ended here already (or never was): nothing to do.
  if (OnLoadResult(n, m) == LoadResult::kBoundElsewhere) RefuseBoundElsewhere(n, m);
}

void Connector::Impl::OnDone(const InboxEvent& n, PeerMessage& m) {
  if (OnLoadResult(n, m) == LoadResult::kBoundElsewhere) RefuseBoundElsewhere(n, m);
}

// fail: on decode, prefill stopped a load; on prefill, decode aborted a write-mode transfer
// (stop sending; answer when nothing is in flight).
void Connector::Impl::OnFail(const InboxEvent& n, PeerMessage& m) {
  const LoadResult load = OnLoadResult(n, m);
  if (load == LoadResult::kHandled) return;
  bool bound_elsewhere = load == LoadResult::kBoundElsewhere;
  const std::string& tid = m.transfer_id;
  if (Request* r = FindByTransfer(tid); r != nullptr) {
    if (!r->decode && r->mode == KvMode::kRead) {
      // A read-mode hold: its readers release (a "fail" of theirs changes nothing); anyone
      // else is refused once it has readers.
      if (r->FindReader(n.peer) == nullptr && !r->readers.empty()) {
        RefuseBoundElsewhere(n, m);
      } else {
        StepLocked(*r, Event::kPeerFail);  // its readers release: nothing changes
      }
      return;
    }
    std::optional<PeerId> bound = r->peer;
    if (!bound) {
      auto e = pushes_.early_writes.find(tid);
      if (e != pushes_.early_writes.end()) bound = e->second.peer;
    }
    if (bound == n.peer) {
      if (r->mode == KvMode::kWrite) AbortLocked(*r, "aborted by decode", Event::kPeerFail);
      return;
    }
    if (!bound && m.unread && r->mode == KvMode::kWrite) {
      // Write mode, before decode sent its blocks: decode will not load (the transfer id,
      // 128 random bits, is the capability to say so).
      StepLocked(*r, Event::kPeerUnread);
      ReleaseUnreadLocked(*r, n.peer, m.reason);
      return;
    }
    bound_elsewhere = bound_elsewhere || bound.has_value();
  } else if (auto e = pushes_.early_writes.find(tid); e != pushes_.early_writes.end()) {
    if (e->second.peer == n.peer) {
      pushes_.early_writes.erase(e);  // decode gave up before this prefill saw the request
      return;
    }
    bound_elsewhere = true;
  } else if (m.unread) {
    // Write mode: decode will not load (its prefix cache holds the prompt, or it has one token)
    // and says so before this prefill has seen the request. Kept with the early releases
    // (bounded, the oldest dropped), so that the request ends as soon as it is saved here
    // (MaybeSendLayersLocked) instead of holding its blocks until request_timeout.
    connector_internal::RememberEarlyRelease(
        table_.early_releases, table_.early_release_order, tid,
        EarlyRelease{n.peer, {1, 0}, false, true, m.reason.substr(0, 256)});
    return;
  }
  if (bound_elsewhere) RefuseBoundElsewhere(n, m);
  // Else: a transfer that ended here already (or never was): nothing to do.
}

bool Connector::Impl::CheckBinding(Request& r, PeerId peer, const std::string& name,
                                   const PeerMessage& m, bool bind) {
  std::optional<PeerId> bound = r.peer;
  if (!bound) {
    // A write request kept before the scheduler saw the request binds it already.
    auto e = pushes_.early_writes.find(r.params.transfer_id);
    if (e != pushes_.early_writes.end()) bound = e->second.peer;
  }
  if (bound && *bound != peer) {
    ClosePeerLocked(peer, name,
                    absl::PermissionDeniedError(absl::StrCat("connector message '", m.name,
                                                             "' for transfer ", m.transfer_id,
                                                             ", which is bound to another peer")));
    return false;
  }
  if (!bound && bind) r.peer = peer;
  return true;
}

// --- outbox -----------------------------------------------------------------------------
absl::Status Connector::Impl::SendMessage(PeerId peer, const json& msg,
                                          const std::string& request) {
  return SendPayload(peer, DumpJson(msg), request);
}

absl::Status Connector::Impl::SendPayload(PeerId peer, std::string payload,
                                          const std::string& request) {
  if (!PeerAlive(peer)) {
    return absl::UnavailableError(absl::StrCat("connector peer ", peer, " closed"));
  }
  if (outbox_.queue.empty() && !outbox_.draining) {
    // Every step that queues flushes once it lets go of mu_ (StepLock, the progress loop);
    // the progress thread is woken as well, for any step that does not.
    signal_->Notify();
  }
  outbox_.queue.push_back({peer, std::move(payload), request});
  return absl::OkStatus();
}

void Connector::Impl::FlushOutbox() {
  std::vector<OutMessage>& batch = outbox_batch_;  // ours while outbox_.draining
  {
    MutexLock lock(&mu_);
    if (outbox_.draining || outbox_.queue.empty()) return;  // the drainer sends ours too
    outbox_.draining = true;
    batch.swap(outbox_.queue);
  }
  while (true) {
    std::vector<std::pair<std::string, std::string>> failed;   // request, reason
    std::vector<std::pair<TransferId, absl::Status>> refused;  // ticket, why
    std::vector<TransferId> served;                            // watches that hold now
    struct Granted {
      std::string request;
      PeerId peer;
      absl::StatusOr<GrantId> grant;
    };
    std::vector<Granted> granted;
    for (OutMessage& m : batch) {
      if (m.grant) {
        granted.push_back(
            {std::move(m.grant->request), m.peer, engine_->Grant(m.peer, m.grant->ranges)});
        continue;
      }
      if (m.revoke) {
        // Revoked once what the reader read was served; the engine's word is an event.
        const TransferId ticket = m.revoke->ticket;
        std::function<void()> done;
        if (ticket != 0) done = [signal = signal_, ticket] { signal->Served(ticket); };
        if (engine_->RevokeWhenServed(m.peer, m.revoke->grant, m.revoke->bytes, std::move(done)) &&
            ticket != 0) {
          served.push_back(ticket);
        }
        continue;
      }
      if (m.transfer) {
        absl::StatusOr<TransferId> id =
            engine_->Transfer(m.peer, m.transfer->kind, m.transfer->ops, m.transfer->options);
        if (!id.ok()) refused.emplace_back(m.transfer->ticket, id.status());
        continue;
      }
      absl::Status s =
          engine_->SendMessage(m.peer, connector_internal::kTopic, std::move(m.payload));
      if (s.ok()) continue;
      KVW_LOG(kDebug, kLog) << "connector message not sent" << Kv("peer", m.peer)
                            << Kv("request", m.request) << Kv("error", s.message());
      if (!m.request.empty()) failed.emplace_back(std::move(m.request), std::string(s.message()));
    }
    batch.clear();
    MutexLock lock(&mu_);
    for (const auto& [ticket, status] : refused) OnTransferEnded(ticket, status);
    for (Granted& g : granted) OnGrantedLocked(g.request, g.peer, std::move(g.grant));
    for (TransferId ticket : served) OnServedLocked(ticket);
    for (const auto& [id, reason] : failed) {
      auto it = table_.requests.find(id);
      if (it == table_.requests.end() || it->second.state != State::kLoading) continue;
      StepLocked(it->second, Event::kPeerGone);  // the peer cannot be told any more
      FailLocked(it->second, it->second.fail_reason.empty() ? reason : it->second.fail_reason);
    }
    if (outbox_.queue.empty()) {
      outbox_.draining = false;
      return;
    }
    batch.swap(outbox_.queue);
  }
}

// --- progress ---------------------------------------------------------------------------
// Nothing is polled: the thread sleeps on the progress signal until the engine pushes a
// transfer's end or an inbox event, an API call changes requests, or the next deadline falls
// due (NextWakeLocked).
void Connector::Impl::ProgressLoop() {
  absl::Time wake = absl::Now();
  connector_internal::ProgressSignal::Wakeup woke;
  while (true) {
    woke = signal_->Wait(wake, std::move(woke.ended));
    std::vector<InboxEvent> events = OrderAfterServedOps(inbox_->Take(), woke.ended);
    {
      MutexLock lock(&mu_);
      if (stop_) return;
      for (const InboxEvent& e : events) {
        if (e.kind == InboxEvent::Kind::kMessage) {
          OnMessage(e);
        } else if (e.kind == InboxEvent::Kind::kRegionsReady) {
          continue;  // ServePendingHellos below answers the hellos it unblocked
        } else if (sessions_.dead.Insert(e.peer)) {
          OnPeerDeath(e.peer, e.peer_name, e.payload);
        }
      }
      ServePendingHellos();
      for (const connector_internal::ProgressSignal::EndedTransfer& t : woke.ended) {
        if ((t.id & kParkTicket) != 0) continue;  // OrderAfterServedOps took it
        if (!OnServedLocked(t.id)) OnTransferEnded(t.id, t.status);
      }
      CheckDeadlines();
      wake = NextWakeLocked();
    }
    for (const auto& [peer, p] : parked_) wake = std::min(wake, p.deadline + absl::Microseconds(1));
    FlushOutbox();  // before the closes: a Goodbye follows what was said to the peer
    CloseQueuedPeers();
  }
}

absl::Time Connector::Impl::NextWakeLocked() const {
  // Idle: nothing is due; the wait is still bounded.
  constexpr absl::Duration kIdleWake = absl::Minutes(1);
  // A pending hello is woken by its regions' arrival (the engine's kRegionsReady event, also
  // raised when a peer's data path comes up) or by its deadline: never polled.
  const absl::Time now = absl::Now();
  absl::Time wake = now + kIdleWake;
  for (const PendingHello& h : sessions_.pending_hellos) wake = std::min(wake, h.deadline);
  for (const auto& [tid, e] : pushes_.early_writes) wake = std::min(wake, e.expires);
  for (const auto& [tid, e] : table_.early_reads) wake = std::min(wake, e.expires);
  for (const auto& [id, r] : table_.requests) {
    // A request with transfers in flight waits for their ends (each has a deadline of its
    // own in the engine); CheckDeadlines acts on the others, except matched and pending ones
    // (the scheduler has not started them): their deadline would stay in the past and spin
    // this loop.
    if (r.transfers.empty() && r.state != State::kMatched && r.state != State::kPending) {
      wake = std::min(wake, r.deadline);
    }
  }
  // CheckDeadlines acts on deadlines strictly in the past.
  return wake + absl::Microseconds(1);
}

// A peer's messages (and its death) are handled only once the ops it sent this engine before
// them have been served: its word about memory (a release of blocks it read, a "done" of
// blocks it wrote) can overtake the serving thread's last access to them (the ops and the
// messages travel on different connections). A peer with ops in flight has its events parked,
// in order, until the engine says those ops ended (WhenServedOps: no wait, no poll) or
// kServedOpsWait passed (a peer that keeps an op stalled: handled anyway, loudly); other
// peers' events are handled meanwhile. A read-mode release additionally waits, in its request
// alone, for the bytes the reader says it read (AwaitServedLocked).
std::vector<InboxEvent> Connector::Impl::OrderAfterServedOps(
    std::vector<InboxEvent> events,
    absl::Span<const connector_internal::ProgressSignal::EndedTransfer> ended) {
  constexpr absl::Duration kServedOpsWait = absl::Milliseconds(250);
  if (parked_.empty() && events.empty()) return events;
  for (const connector_internal::ProgressSignal::EndedTransfer& t : ended) {
    if ((t.id & kParkTicket) == 0) continue;
    for (auto& [peer, p] : parked_) {
      if (p.ticket == t.id) p.served = true;
    }
  }
  const absl::Time now = absl::Now();
  std::vector<InboxEvent> ready;
  // Peers whose watch was set in this call: its mark follows every event of this batch too.
  std::vector<PeerId> armed_now;
  for (auto it = parked_.begin(); it != parked_.end();) {
    connector_internal::ParkedPeer& p = it->second;
    if (!p.served && p.deadline > now) {
      ++it;
      continue;
    }
    if (!p.served) {
      KVW_LOG(kWarning, kLog) << "handling a peer's messages while its ops are still served"
                              << Kv("peer", it->first) << Kv("events", p.events.size())
                              << Kv("waited", absl::FormatDuration(kServedOpsWait));
      p.covered = p.events.size();
    }
    for (size_t i = 0; i < p.covered; ++i) ready.push_back(std::move(p.events[i]));
    p.events.erase(p.events.begin(), p.events.begin() + static_cast<std::ptrdiff_t>(p.covered));
    if (!p.events.empty()) {
      // Events that came while parked: ordered after the ops in flight now.
      const TransferId ticket = kParkTicket | ++park_seq_;
      if (!engine_->WhenServedOps(it->first,
                                  [signal = signal_, ticket] { signal->Served(ticket); })) {
        p.ticket = ticket;
        p.served = false;
        p.covered = p.events.size();
        p.deadline = now + kServedOpsWait;
        armed_now.push_back(it->first);
        ++it;
        continue;
      }
      for (InboxEvent& e : p.events) ready.push_back(std::move(e));
    }
    parked_.erase(it++);
  }
  std::vector<PeerId> served_now;  // peers of this batch with no op in flight
  for (InboxEvent& e : events) {
    if (e.kind == InboxEvent::Kind::kRegionsReady) {  // orders nothing
      ready.push_back(std::move(e));
      continue;
    }
    if (auto p = parked_.find(e.peer); p != parked_.end()) {
      p->second.events.push_back(std::move(e));
      if (std::find(armed_now.begin(), armed_now.end(), e.peer) != armed_now.end()) {
        ++p->second.covered;
      }
      continue;
    }
    if (std::find(served_now.begin(), served_now.end(), e.peer) != served_now.end()) {
      ready.push_back(std::move(e));
      continue;
    }
    const TransferId ticket = kParkTicket | ++park_seq_;
    if (engine_->WhenServedOps(e.peer, [signal = signal_, ticket] { signal->Served(ticket); })) {
      served_now.push_back(e.peer);
      ready.push_back(std::move(e));
      continue;
    }
    connector_internal::ParkedPeer& p = parked_[e.peer];
    p.ticket = ticket;
    p.deadline = now + kServedOpsWait;
    p.events.push_back(std::move(e));
    p.covered = 1;
    armed_now.push_back(e.peer);
  }
  return ready;
}

}  // namespace kvwire

// The request state machine's endings: completion, failure (after draining the transfers that
// touch the blocks), aborts from either side, transfer polling, deadlines and leases.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

Connector::Impl::Request* Connector::Impl::FindByTransfer(const std::string& tid) {
  auto t = table_.by_transfer.find(tid);
  if (t == table_.by_transfer.end()) return nullptr;
  auto it = table_.requests.find(t->second);
  return it == table_.requests.end() ? nullptr : &it->second;
}

Connector::Impl::Request* Connector::Impl::FindDecodeByTransfer(const std::string& tid) {
  if (tid.empty()) return nullptr;
  for (auto& [id, r] : table_.requests) {
    if (r.decode && r.params.transfer_id == tid) return &r;
  }
  return nullptr;
}

// --- the request machine -----------------------------------------------------------------
// Only the facts the rows for `e` read are gathered (the rest keep their defaults, which no
// row for `e` looks at), and none allocates: this runs at every event of every request (each
// transfer end among them, ~60 per request).
connector_internal::RequestFacts Connector::Impl::FactsLocked(const Request& r, Event e) {
  connector_internal::RequestFacts f;
  f.in_flight = !r.transfers.empty();
  f.failing = !r.fail_reason.empty();
  f.release_only = r.release_only;
  if (e == Event::kReadOk) {
    f.all_granted = !r.read_sources.empty() &&
                    std::all_of(r.read_sources.begin(), r.read_sources.end(),
                                [](const Request::ReadSource& s) { return s.grant.has_value(); });
  }
  if (!r.decode && e == Event::kTransferOk) f.all_sent = AllLayersSent(r);
  if (!r.decode && (e == Event::kRelease || e == Event::kDeadline || e == Event::kGrantFailed)) {
    f.granted = std::any_of(r.readers.begin(), r.readers.end(),
                            [](const Request::Reader& x) { return x.grant != 0 || x.granting; });
  }
  // Releasing, the grants are the watches' (AwaitServedLocked took them from the readers):
  // live until a deadline revoked them all.
  if (r.state == State::kReleasing && e == Event::kDeadline) {
    f.granted = !r.revoke_forced;
    f.readers_closed = r.readers_closed;
  }
  if (!r.decode && (e == Event::kRelease || e == Event::kServed)) {
    // As ReaderDoneLocked decides: every bound reader done and, unless one said unread, every
    // expected one bound.
    f.readers_left = std::any_of(r.readers.begin(), r.readers.end(),
                                 [](const Request::Reader& x) { return !x.done; }) ||
                     (!r.unread && static_cast<int>(r.readers.size()) < r.readers_expected);
    f.reader_failed = !r.reader_failure.empty();
    f.reader_read = r.read;
  }
  f.peer_alive = r.peer.has_value() && PeerAlive(*r.peer);
  return f;
}

const connector_internal::Transition* Connector::Impl::StepLocked(Request& r, Event e,
                                                                  bool nothing_to_move) {
  connector_internal::RequestFacts f = FactsLocked(r, e);
  f.nothing_to_move = nothing_to_move;
  ++machine_.steps;
  absl::StatusOr<const connector_internal::Transition*> row = r.machine.Step(e, f);
  if (!row.ok()) {
    ++machine_.refused;
    KVW_LOG(kWarning, kLog) << "request event refused by the transition table"
                            << Kv("request", r.id) << Kv("transfer", r.params.transfer_id)
                            << Kv("error", row.status().message());
    return nullptr;
  }
  return *row;
}

void Connector::Impl::CheckMachineEndLocked(const Request& r, State end) {
  if (r.machine.state() == end) return;
  ++machine_.diverged;
  KVW_LOG(kWarning, kLog) << "request ended other than its transition table says"
                          << Kv("request", r.id) << Kv("transfer", r.params.transfer_id)
                          << Kv("ended", connector_internal::RequestStateName(end))
                          << Kv("machine", connector_internal::RequestStateName(r.machine.state()));
}

// --- endings ----------------------------------------------------------------------------
void Connector::Impl::TellPeer(Request& r, bool ok, const std::string& reason) {
  if (!r.peer) return;
  if (!PeerAlive(*r.peer)) return;
  json m;
  if (r.decode && r.mode == KvMode::kRead) {
    m = {{"t", "release"}, {"transfer_id", r.params.transfer_id}, {"ok", ok}, {"reason", reason}};
    // Read: each source learns how many bytes this engine READ under its grant, and frees the
    // blocks once its engine served them (no wait there for ops still in its socket).
    auto count = [&](PeerId peer, json& msg) {
      if (!ok) return;
      for (const auto& [p, bytes] : r.bytes_read) {
        if (p == peer) msg["read_bytes"] = bytes;
      }
    };
    for (const auto& [peer, tid] : r.tp_sources) {
      if (!PeerAlive(peer)) continue;
      json more = m;
      more["transfer_id"] = tid;
      count(peer, more);
      (void)SendMessage(peer, more);
    }
    count(*r.peer, m);
  } else {
    m = {{"t", "fail"}, {"transfer_id", r.params.transfer_id}, {"reason", reason}};
  }
  (void)SendMessage(*r.peer, m);
}

void Connector::Impl::CompleteLocked(Request& r) {
  if (AwaitServedLocked(r, {Request::End::kComplete, 0, ""})) return;
  // Nothing should be in flight for a complete request; should anything be, its end finds no
  // owner and is ignored.
  for (const auto& [t, layer] : r.transfers) table_.transfer_owner.erase(t);
  r.t_last = absl::Now();
  if (r.decode && r.mode == KvMode::kRead) TellPeer(r, true, "");

  if (r.decode) {
    table_.finished.finished_recving.push_back(r.id);
  } else if (r.finished_by_scheduler) {
    table_.finished.finished_sending.push_back(r.id);
  } else {
    table_.retired_early.insert(r.id);  // its RequestFinished frees the blocks at once
  }
  if (!r.decode && r.mode == KvMode::kRead) RememberRetiredLocked(r, "released by its reader");
  Retire(r, "completed");
}

// Ends a request once nothing touches its blocks any more (else drains first).
void Connector::Impl::FailLocked(Request& r, const std::string& reason) {
  if (r.fail_reason.empty()) r.fail_reason = reason;
  if (AwaitServedLocked(r, {Request::End::kFail, 0, ""})) return;
  if (!r.transfers.empty()) {
    r.state = State::kDraining;
    return;
  }
  if (r.decode && r.mode == KvMode::kWrite && r.state == State::kLoading && !r.abort_sent &&
      r.peer && PeerAlive(*r.peer)) {
    // Prefill may still be writing: ask it to stop and wait for its answer (or deadline).
    TellPeer(r, false, r.fail_reason);
    r.abort_sent = true;
    r.state = State::kDraining;
    r.deadline = absl::Now() + options_.handshake_timeout;
    return;
  }
  if (!r.abort_sent && (r.decode ? r.mode != KvMode::kWrite : r.mode == KvMode::kWrite)) {
    // Decode read: release prefill's blocks. Prefill write: nothing more will be written.
    TellPeer(r, false, r.fail_reason);
    r.abort_sent = true;
  }
  r.t_last = absl::Now();

  KVW_LOG(kInfo, kLog) << "request failed" << Kv("request", r.id)
                       << Kv("transfer", r.params.transfer_id) << Kv("reason", r.fail_reason);
  if (r.decode) {
    table_.finished.failed_loads.push_back({r.id, r.fail_reason});
  } else if (r.finished_by_scheduler) {
    table_.finished.finished_sending.push_back(r.id);
  } else {
    // Failed before the scheduler finished it: its RequestFinished frees the blocks.
    table_.retired_early.insert(r.id);
  }
  if (!r.decode) RememberRetiredLocked(r, r.fail_reason);
  Retire(r, "failed");
}

void Connector::Impl::RememberRetiredLocked(const Request& r, const std::string& reason) {
  if (r.params.transfer_id.empty()) return;
  if (table_.retired_transfers.insert_or_assign(r.params.transfer_id, reason).second) {
    table_.retired_order.push_back(r.params.transfer_id);
  }
  if (table_.retired_order.size() > 4096) {
    table_.retired_transfers.erase(table_.retired_order.front());
    table_.retired_order.pop_front();
  }
}

void Connector::Impl::ReleaseUnreadLocked(Request& r, PeerId reader, const std::string& reason) {
  if (r.state != State::kLoading && r.state != State::kDraining && r.transfers.empty() &&
      AwaitServedLocked(r, {Request::End::kUnread, reader, reason})) {
    return;
  }
  if (!r.transfers.empty() || r.state == State::kLoading || r.state == State::kDraining) {
    // Data moved or is moving for it after all: the ordinary failure path drains first.
    FailLocked(r, absl::StrCat("reader released it: ", reason));
    return;
  }
  r.peer = reader;
  r.fail_reason = absl::StrCat("released unread: ", reason);
  r.t_last = absl::Now();
  KVW_LOG(kDebug, kLog) << "released unread" << Kv("request", r.id)
                        << Kv("transfer", r.params.transfer_id) << Kv("reason", reason);
  if (r.finished_by_scheduler) {
    table_.finished.finished_sending.push_back(r.id);
  } else {
    table_.retired_early.insert(r.id);  // its RequestFinished frees the blocks at once
  }
  Retire(r, "released");
}

void Connector::Impl::AbortLocked(Request& r, const std::string& reason, Event event) {
  StepLocked(r, event);
  if (!r.fail_reason.empty()) return;
  if (!r.decode && (r.state == State::kHeld || r.state == State::kReleasing)) {
    // A reader may be reading these blocks: they stay until it releases or the lease ends
    // (releasing: until the engine served what the readers read).
    return;
  }
  r.fail_reason = reason;
  if (r.decode && r.state == State::kLoading && r.transfers.empty() && r.mode == KvMode::kAuto) {
    return;  // connecting: StartLoad sees fail_reason
  }
  FailLocked(r, reason);
}

absl::Status Connector::Impl::SubmitLocked(Request& r, PeerId peer, OpKind kind,
                                           std::vector<Op> ops, int layer, GrantId grant) {
  if (!PeerAlive(peer)) {
    return absl::UnavailableError(absl::StrCat("connector peer ", peer, " closed"));
  }
  OutTransfer t;
  t.ticket = ++outbox_.tickets;
  t.kind = kind;
  t.ops = std::move(ops);
  t.options.grant = grant;
  t.options.timeout = std::max(absl::Milliseconds(1), r.deadline - absl::Now());
  // The end is pushed to the progress thread (OnTransferEnded), which needs mu_ to act on it,
  // under the ticket the request knows the transfer by (recorded below, before the engine
  // has it, so that no end can come first).
  t.options.on_complete = [signal = signal_, ticket = t.ticket](TransferId,
                                                                const absl::Status& status) {
    signal->TransferEnded(ticket, status);
  };
  r.transfers.emplace(t.ticket, layer);
  ++r.layer_transfers_left[layer];
  table_.transfer_owner[t.ticket] = r.id;
  if (outbox_.queue.empty() && !outbox_.draining) signal_->Notify();  // as SendMessage
  outbox_.queue.push_back({peer, "", "", std::move(t)});
  return absl::OkStatus();
}

void Connector::Impl::OnTransferEnded(TransferId id, const absl::Status& status) {
  auto owner = table_.transfer_owner.find(id);
  if (owner == table_.transfer_owner.end()) return;
  auto it = table_.requests.find(owner->second);
  table_.transfer_owner.erase(owner);
  if (it == table_.requests.end()) return;
  Request& r = it->second;
  auto in_flight = r.transfers.find(id);
  if (in_flight == r.transfers.end()) return;
  const int layer = in_flight->second;
  r.transfers.erase(in_flight);
  StepLocked(r, status.ok() ? Event::kTransferOk : Event::kTransferFailed);
  if (!status.ok()) {
    // The first failure names the request's reason; later ones find it set.
    FailLocked(r, absl::StrCat("transfer ", r.params.transfer_id, ": ", status.message()));
    return;
  }
  LayerTransferDone(r, layer);
  if (!r.transfers.empty()) return;
  if (r.state == State::kDraining) {
    FailLocked(r, r.fail_reason);
  } else if (r.decode && r.state == State::kLoading && r.mode == KvMode::kRead) {
    CompleteLocked(r);
  } else if (!r.decode && r.state == State::kSaving) {
    MaybeFinishSaveLocked(r);
  }
}

// --- prefill read mode: freeing after the readers' ops were served --------------------------
bool Connector::Impl::AwaitServedLocked(Request& r, Request::End end) {
  if (r.decode || r.mode != KvMode::kRead) return false;
  if (r.state == State::kReleasing) return !r.serving.empty();
  for (Request::Reader& reader : r.readers) {
    const GrantId grant = std::exchange(reader.grant, 0);
    if (grant == 0 && reader.granting) {
      // Its grant is being made: OnGrantedLocked queues the revocation under this ticket.
      const TransferId ticket = ++outbox_.tickets;
      table_.served_watch[ticket] = r.id;
      r.serving.push_back({ticket, reader.peer, 0});
      continue;
    }
    if (grant == 0) continue;
    // The reader's count of bytes it read under the grant is served by this engine's tcp
    // target only when the grants guard the blocks (else its READs may go over shm or rdma,
    // which no target counts): then the grant is revoked only once they were served. Without
    // a count (an older peer, a failed read) it is revoked now; the ops under it in flight
    // are waited for either way.
    const uint64_t bytes = options_.read_grants ? reader.read_bytes.value_or(0) : 0;
    const TransferId ticket = ++outbox_.tickets;
    table_.served_watch[ticket] = r.id;
    r.serving.push_back({ticket, reader.peer, grant});
    if (outbox_.queue.empty() && !outbox_.draining) signal_->Notify();  // as SendMessage
    OutMessage m;
    m.peer = reader.peer;
    m.revoke = OutRevoke{ticket, grant, bytes};
    outbox_.queue.push_back(std::move(m));
  }
  if (r.serving.empty()) return false;
  r.pending_end = std::move(end);
  r.state = State::kReleasing;
  // Bounded by the request's own deadline (the lease); past it already (the lease expired):
  // the ops get one handshake_timeout more.
  const absl::Time now = absl::Now();
  if (r.deadline <= now) r.deadline = now + options_.handshake_timeout;
  return true;
}

bool Connector::Impl::OnServedLocked(TransferId ticket) {
  auto w = table_.served_watch.find(ticket);
  if (w == table_.served_watch.end()) return false;
  const std::string id = std::move(w->second);
  table_.served_watch.erase(w);
  auto it = table_.requests.find(id);
  if (it == table_.requests.end()) return true;
  Request& r = it->second;
  auto s = std::find_if(r.serving.begin(), r.serving.end(),
                        [&](const Request::Serving& x) { return x.ticket == ticket; });
  if (s == r.serving.end()) return true;
  r.serving.erase(s);
  if (!r.serving.empty() || r.state != State::kReleasing) return true;
  StepLocked(r, Event::kServed);
  Request::End end = std::move(*r.pending_end);
  r.pending_end.reset();
  switch (end.kind) {
    case Request::End::kComplete:
      CompleteLocked(r);
      break;
    case Request::End::kFail:
      FailLocked(r, r.fail_reason);
      break;
    case Request::End::kUnread:
      ReleaseUnreadLocked(r, end.reader, end.reason);
      break;
  }
  return true;
}

void Connector::Impl::StopServedWatchesLocked(Request& r) {
  for (const Request::Serving& s : r.serving) {
    table_.served_watch.erase(s.ticket);
    if (s.grant == 0) continue;  // being made: OnGrantedLocked finds no request, revokes it
    // Revoked now, without waiting for the bytes (its watch's end finds no owner).
    OutMessage m;
    m.peer = s.peer;
    m.revoke = OutRevoke{0, s.grant, 0};
    outbox_.queue.push_back(std::move(m));
  }
  if (!r.serving.empty() && !outbox_.draining) signal_->Notify();
  r.serving.clear();
}

void Connector::Impl::ForceRevokeLocked(Request& r) {
  r.revoke_forced = true;
  if (r.fail_reason.empty()) r.fail_reason = "the readers' ops were not served before the deadline";
  r.pending_end = Request::End{Request::End::kFail};
  r.deadline = absl::Now() + options_.handshake_timeout;
  for (const Request::Serving& s : r.serving) {
    // A grant being made is revoked by OnGrantedLocked, at once now (revoke_forced).
    if (s.grant == 0) continue;
    // Revoked at once; the watch already kept for it fires once no op under it is served.
    OutMessage m;
    m.peer = s.peer;
    m.revoke = OutRevoke{0, s.grant, 0};
    if (outbox_.queue.empty() && !outbox_.draining) signal_->Notify();  // as SendMessage
    outbox_.queue.push_back(std::move(m));
  }
}

void Connector::Impl::CloseServedReadersLocked(Request& r) {
  r.readers_closed = true;
  r.deadline = absl::Now() + options_.handshake_timeout;
  std::vector<PeerId> readers;  // alive ones (a dead reader's ops end with it anyway)
  for (const Request::Serving& s : r.serving) {
    if (PeerAlive(s.peer) && std::find(readers.begin(), readers.end(), s.peer) == readers.end()) {
      readers.push_back(s.peer);
    }
  }
  KVW_LOG(kWarning, kLog) << "ops under revoked grants still served a deadline later: closing "
                             "their readers"
                          << Kv("request", r.id) << Kv("transfer", r.params.transfer_id)
                          << Kv("readers", readers.size());
  served_late_.readers_closed += readers.size();
  const std::string why =
      absl::StrCat("ops under a revoked read grant (transfer ", r.params.transfer_id,
                   ") still served ", absl::FormatDuration(options_.handshake_timeout),
                   " after the revocation: the reader stopped draining its data connection");
  // Its requests end now (OnPeerDeath): this one is releasing and its readers are done, so it
  // stays, and frees its blocks when the engine ends the closed readers' ops.
  for (PeerId peer : readers) {
    std::string name;
    if (auto p = sessions_.peers.find(peer); p != sessions_.peers.end()) name = p->second.engine_id;
    ClosePeerLocked(peer, name, absl::DeadlineExceededError(why));
  }
}

void Connector::Impl::LayerTransferDone(Request& r, int layer) {
  if (--r.layer_transfers_left[layer] > 0) return;
  r.layer_transfers_left.erase(layer);
  if (r.decode) {
    r.layers_pending.erase(layer);
    cv_.SignalAll();  // WaitForLayerLoad
  } else if (r.state == State::kSaving && r.fail_reason.empty()) {
    TellLayerDone(r, layer);
  }
}

void Connector::Impl::CheckDeadlines() {
  const absl::Time now = absl::Now();
  for (auto e = pushes_.early_writes.begin(); e != pushes_.early_writes.end();) {
    if (e->second.expires >= now) {
      ++e;
      continue;
    }
    // No request ever claimed it: tell decode now rather than let it wait for its deadline.
    if (PeerAlive(e->second.peer)) {
      (void)SendMessage(
          e->second.peer,
          json{{"t", "fail"},
               {"transfer_id", e->first},
               {"reason", absl::StrCat("prefill engine ", engine_->name(),
                                       " has no request for this transfer after ",
                                       absl::FormatDuration(options_.request_timeout))}});
    }
    e = pushes_.early_writes.erase(e);
  }
  for (auto e = table_.early_reads.begin(); e != table_.early_reads.end();) {
    if (e->second.expires >= now) {
      ++e;
      continue;
    }
    RefuseReadLocked(
        e->second.peer, e->first,
        absl::StrCat("none was held under it within ",
                     absl::FormatDuration(options_.handshake_timeout), " (unknown or released)"));
    e = table_.early_reads.erase(e);
  }
  std::vector<std::string> late;
  for (auto& [id, r] : table_.requests) {
    if (r.deadline < now && r.transfers.empty()) late.push_back(id);
  }
  for (const std::string& id : late) {
    auto it = table_.requests.find(id);
    if (it == table_.requests.end()) continue;
    Request& r = it->second;
    // An earlier one's handling may have moved this one on (a reader closed for it failed
    // this one's hand-off, with a deadline of its own): only what is still late goes on.
    if (r.deadline >= now || !r.transfers.empty()) continue;
    if (r.state != State::kMatched && r.state != State::kPending) StepLocked(r, Event::kDeadline);
    if (r.state == State::kReleasing && !r.revoke_forced) {
      // A reader's ops still served, or its count of bytes read not reached (a lying or
      // short count, bytes it moved elsewhere): bounded by the request's own deadline. The
      // grants are revoked now; the blocks go when the engine says no op under them is
      // served (their watches fire, OnServedLocked), not before: a reader that still holds
      // its grant must not READ blocks handed to another request.
      KVW_LOG(kWarning, kLog) << "readers' ops not all served by the deadline: grants revoked"
                              << Kv("request", r.id) << Kv("transfer", r.params.transfer_id)
                              << Kv("grants_left", r.serving.size());
      ForceRevokeLocked(r);
    } else if (r.state == State::kReleasing && !r.readers_closed) {
      // Revoked, and an op under a grant is still being served a handshake_timeout later: its
      // reader stopped draining the data connection (tcp's io_timeout cuts such a connection
      // only when it is shorter than this). Freeing now would let that op stream the blocks
      // of whichever request gets them next: its reader is closed instead, which ends the op.
      CloseServedReadersLocked(r);  // last: may close peers (no use of `r` after it)
    } else if (r.state == State::kReleasing) {
      // Closed, and an op under a grant is still being served a handshake_timeout later (the
      // engine ends a closed peer's ops; this is the bound if that never happens).
      KVW_LOG(kError, kLog) << "blocks freed while ops under revoked grants were served"
                            << Kv("request", r.id) << Kv("transfer", r.params.transfer_id)
                            << Kv("grants_left", r.serving.size());
      ++served_late_.freed_while_served;
      StopServedWatchesLocked(r);
      FailLocked(r, r.fail_reason);
    } else if (r.state == State::kHeld) {
      KVW_LOG(kWarning, kLog) << "lease expired: no release from the reader" << Kv("request", r.id)
                              << Kv("transfer", r.params.transfer_id);
      accounting_.LeaseExpired();
      FailLocked(r, "lease expired before the reader released the blocks");
    } else if (r.state == State::kDraining) {
      r.abort_sent = true;  // prefill did not answer: give up waiting
      FailLocked(r, r.fail_reason);
    } else if (r.state != State::kMatched && r.state != State::kPending) {
      FailLocked(r, absl::StrCat("deadline of ", absl::FormatDuration(options_.request_timeout),
                                 " exceeded in state ", StateName(r.state)));
    }
  }
}

}  // namespace kvwire

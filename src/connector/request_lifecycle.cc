// The request state machine's endings: completion, failure (after draining the transfers that
// touch the blocks), aborts from either side, transfer polling, deadlines and leases.
#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

using connector_internal::BlocksFromJson;
using connector_internal::BlocksToJson;
using connector_internal::CpuTimer;
using connector_internal::FindRegion;
using connector_internal::kLog;
using connector_internal::Us;
using nlohmann::json;

Connector::Impl::Request* Connector::Impl::FindByTransfer(const std::string& tid) {
  auto t = by_transfer_.find(tid);
  if (t == by_transfer_.end()) return nullptr;
  auto it = requests_.find(t->second);
  return it == requests_.end() ? nullptr : &it->second;
}

Connector::Impl::Request* Connector::Impl::FindDecodeByTransfer(const std::string& tid) {
  if (tid.empty()) return nullptr;
  for (auto& [id, r] : requests_) {
    if (r.decode && r.params.transfer_id == tid) return &r;
  }
  return nullptr;
}

// --- endings ----------------------------------------------------------------------------
void Connector::Impl::TellPeer(Request& r, bool ok, const std::string& reason) {
  if (!r.peer) return;
  if (!PeerAlive(*r.peer)) return;
  json m;
  if (r.decode && r.mode == KvMode::kRead) {
    m = {{"t", "release"}, {"transfer_id", r.params.transfer_id}, {"ok", ok}, {"reason", reason}};
    for (const auto& [peer, tid] : r.tp_sources) {
      if (!PeerAlive(peer)) continue;
      json more = m;
      more["transfer_id"] = tid;
      (void)SendMessage(peer, more);
    }
  } else {
    m = {{"t", "fail"}, {"transfer_id", r.params.transfer_id}, {"reason", reason}};
  }
  (void)SendMessage(*r.peer, m);
}

void Connector::Impl::CompleteLocked(Request& r) {
  r.t_last = absl::Now();
  if (r.decode && r.mode == KvMode::kRead) TellPeer(r, true, "");
  ++completed_;
  if (r.decode) {
    finished_.finished_recving.push_back(r.id);
  } else if (r.finished_by_scheduler) {
    finished_.finished_sending.push_back(r.id);
  } else {
    retired_early_.insert(r.id);  // its RequestFinished frees the blocks at once
  }
  Retire(r, "completed");
}

// Ends a request once nothing touches its blocks any more (else drains first).
void Connector::Impl::FailLocked(Request& r, const std::string& reason) {
  if (r.fail_reason.empty()) r.fail_reason = reason;
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
  ++failed_;
  KVW_LOG(kInfo, kLog) << "request failed" << Kv("request", r.id)
                       << Kv("transfer", r.params.transfer_id) << Kv("reason", r.fail_reason);
  if (r.decode) {
    finished_.failed_loads.push_back({r.id, r.fail_reason});
  } else if (r.finished_by_scheduler) {
    finished_.finished_sending.push_back(r.id);
  } else {
    // Failed before the scheduler finished it: its RequestFinished frees the blocks.
    retired_early_.insert(r.id);
  }
  if (!r.decode && !r.params.transfer_id.empty()) {
    retired_transfers_[r.params.transfer_id] = r.fail_reason;
    retired_order_.push_back(r.params.transfer_id);
    if (retired_order_.size() > 4096) {
      retired_transfers_.erase(retired_order_.front());
      retired_order_.pop_front();
    }
  }
  Retire(r, "failed");
}

void Connector::Impl::AbortLocked(Request& r, const std::string& reason) {
  if (!r.fail_reason.empty()) return;
  if (!r.decode && r.state == State::kHeld) {
    // A reader may be reading these blocks: they stay until it releases or the lease ends.
    return;
  }
  r.fail_reason = reason;
  if (r.decode && r.state == State::kLoading && r.transfers.empty() && r.mode == KvMode::kAuto) {
    return;  // connecting: StartLoad sees fail_reason
  }
  FailLocked(r, reason);
}

void Connector::Impl::PollTransfers() {
  std::vector<std::string> ids;
  for (auto& [id, r] : requests_) {
    if (!r.transfers.empty()) ids.push_back(id);
  }
  for (const std::string& id : ids) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    Request& r = it->second;
    absl::Status first_error;
    for (auto t = r.transfers.begin(); t != r.transfers.end();) {
      absl::Status s;
      TransferState st = engine_->Poll(*t, &s);
      if (st == TransferState::kPending) {
        ++t;
        continue;
      }
      if (!s.ok() && first_error.ok()) first_error = s;
      if (s.ok()) LayerTransferDone(r, *t);
      t = r.transfers.erase(t);
    }
    if (!first_error.ok()) {
      FailLocked(r, absl::StrCat("transfer ", r.params.transfer_id, ": ", first_error.message()));
      continue;
    }
    if (!r.transfers.empty()) continue;
    if (r.state == State::kDraining) {
      FailLocked(r, r.fail_reason);
    } else if (r.decode && r.state == State::kLoading && r.mode == KvMode::kRead) {
      CompleteLocked(r);
    } else if (!r.decode && r.state == State::kSaving) {
      MaybeFinishSaveLocked(r);
    }
  }
}

void Connector::Impl::LayerTransferDone(Request& r, TransferId id) {
  auto it = r.transfer_layer.find(id);
  if (it == r.transfer_layer.end()) return;
  const int layer = it->second;
  r.transfer_layer.erase(it);
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
  for (auto e = early_writes_.begin(); e != early_writes_.end();) {
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
    e = early_writes_.erase(e);
  }
  std::vector<std::string> late;
  for (auto& [id, r] : requests_) {
    if (r.deadline < now && r.transfers.empty()) late.push_back(id);
  }
  for (const std::string& id : late) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    Request& r = it->second;
    if (r.state == State::kHeld) {
      KVW_LOG(kWarning, kLog) << "lease expired: no release from the reader" << Kv("request", r.id)
                              << Kv("transfer", r.params.transfer_id);
      ++lease_expired_;
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

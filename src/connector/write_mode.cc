// Prefill, write mode: once decode's block ids are known, each layer saved by the worker goes
// out as one WRITE transfer; "done" follows when every layer is sent and acknowledged.
#include <algorithm>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

void Connector::Impl::OnWriteRequest(const InboxEvent& n, PeerMessage& m) {
  const PeerId peer = n.peer;
  const std::string& name = n.peer_name;
  const std::string& tid = m.transfer_id;
  Request* r = FindByTransfer(tid);
  if (r == nullptr) {
    auto gone = table_.retired_transfers.find(tid);
    if (gone != table_.retired_transfers.end()) {
      // Failed or aborted here before decode asked: tell it at once.
      (void)SendMessage(peer, json{{"t", "fail"}, {"transfer_id", tid}, {"reason", gone->second}});
      return;
    }
    if (auto e = pushes_.early_writes.find(tid); e != pushes_.early_writes.end()) {
      ClosePeerLocked(peer, name,
                      absl::PermissionDeniedError(absl::StrCat(
                          "connector message 'write_req' for transfer ", tid,
                          e->second.peer == peer ? ", which this peer asked for already"
                                                 : ", which another peer asked for already")));
      return;
    }
    // Decode may ask before prefill's scheduler has seen the request: keep it a while, within
    // bounds (a peer cannot grow this without limit).
    size_t of_peer = 0;
    for (const auto& [t, e] : pushes_.early_writes) of_peer += e.peer == peer ? 1 : 0;
    if (of_peer >= connector_internal::kMaxEarlyWritesPerPeer ||
        pushes_.early_writes.size() >= connector_internal::kMaxEarlyWrites) {
      (void)SendMessage(
          peer, json{{"t", "fail"},
                     {"transfer_id", tid},
                     {"reason",
                      absl::StrCat("prefill engine ", engine_->name(), " holds ", of_peer,
                                   " write requests of this peer and ", pushes_.early_writes.size(),
                                   " in all for requests it has not seen (limits ",
                                   connector_internal::kMaxEarlyWritesPerPeer, " and ",
                                   connector_internal::kMaxEarlyWrites, ")")}});
      return;
    }
    pushes_.early_writes[tid] = {peer, std::move(m.blocks), m.num_cached,
                                 absl::Now() + options_.request_timeout};
    return;
  }
  if (r->mode != KvMode::kWrite) {
    ClosePeerLocked(
        peer, name,
        absl::FailedPreconditionError(absl::StrCat("connector message 'write_req' for transfer ",
                                                   tid, ", which is a read-mode hand-off")));
    return;
  }
  // One write request per transfer: a second one (from its decode or anyone else) would
  // redirect the KV.
  auto early = pushes_.early_writes.find(tid);
  if (r->have_remote || early != pushes_.early_writes.end()) {
    const std::optional<PeerId> asked = r->have_remote ? r->peer : early->second.peer;
    ClosePeerLocked(peer, name,
                    absl::PermissionDeniedError(
                        absl::StrCat("connector message 'write_req' for transfer ", tid,
                                     asked == peer ? ", which this peer asked for already"
                                                   : ", which is bound to another peer")));
    return;
  }
  if (!CheckBinding(*r, peer, name, m, /*bind=*/true)) return;
  r->have_remote = true;
  r->remote_blocks = std::move(m.blocks);
  r->remote_cached = m.num_cached;
  StepLocked(*r, Event::kWriteReq);
  MaybeSendLayersLocked(*r);
}

// Prefill write mode: plans once both block tables are known, then sends every final
// layer not yet sent; "done" follows when all layers are sent and their transfers ended.
void Connector::Impl::MaybeSendLayersLocked(Request& r) {
  double cpu_us = 0;  // outlives `cpu`; added to the request only while it is alive
  CpuTimer cpu(&cpu_us);
  if (!r.have_remote) {
    auto e = pushes_.early_writes.find(r.params.transfer_id);
    if (e == pushes_.early_writes.end()) {
      // Decode said it will not load before this request was seen here (OnFail, unread).
      auto u = table_.early_releases.find(r.params.transfer_id);
      if (!r.decode && u != table_.early_releases.end() && u->second.unread) {
        const PeerId reader = u->second.peer;
        const std::string reason = u->second.reason;
        table_.early_releases.erase(u);
        StepLocked(r, Event::kPeerUnread);
        ReleaseUnreadLocked(r, reader, reason);  // `r` dies here
      }
      return;
    }
    EarlyWrite ew = std::move(e->second);
    pushes_.early_writes.erase(e);
    r.peer = ew.peer;
    r.have_remote = true;
    r.remote_blocks = std::move(ew.blocks);
    r.remote_cached = ew.num_cached;
  }
  if (r.state != State::kSaving) return;
  auto pit = sessions_.peers.find(*r.peer);
  if (pit == sessions_.peers.end() || !pit->second.ready) {
    StepLocked(r, Event::kTransferFailed);
    FailLocked(r, "write request from a peer without a connector handshake");
    return;
  }
  Peer& p = pit->second;
  if (!r.plan) {
    absl::StatusOr<TransferPlan> plan =
        PlanTransfer(layout_, r.blocks, p.layout, r.remote_blocks, r.num_tokens, r.remote_cached);
    if (!plan.ok()) {
      StepLocked(r, Event::kTransferFailed);
      FailLocked(r, std::string(plan.status().message()));
      return;
    }
    r.plan = std::move(*plan);
    Account(r, *r.plan);
  }
  for (int layer : r.layers_final) {
    if (r.layers_sent.count(layer) != 0) continue;
    r.layers_sent.insert(layer);
    std::vector<ByteRange> ranges = r.plan->LayerRanges(layer);
    if (ranges.empty()) {
      TellLayerDone(r, layer);
      continue;
    }
    absl::StatusOr<std::vector<Op>> ops = ToOps(ranges, p, /*local_is_src=*/true);
    if (!ops.ok()) {
      StepLocked(r, Event::kTransferFailed);
      FailLocked(r, std::string(ops.status().message()));
      return;
    }
    // The plan WRITEs whole pages (a group's last page too): before the first of them, the
    // rows of the request's blocks that it does not fill are zeroed, every layer's at once, or
    // the decode would get whatever an earlier request left there (read_scrub.cc; once per
    // request). Here, at the first WRITE rather than when the plan is made, the first final
    // layer is done (with event-gated saves its event completed, so the engine's stream is past
    // whatever it still had to write into these blocks before). Later layers may still be
    // being computed: the clear touches only rows past the request's num_tokens
    // (GetNumNewMatchedTokens), which the compute never writes when that is the count it
    // computes (the vLLM plugin passes the prompt), so the two are disjoint, whichever comes
    // first. (An engine that hands off fewer tokens than it computes gets its extra tokens'
    // rows cleared too: its own KV, which the decode recomputes; see read_scrub.cc.)
    if (absl::Status scrubbed = ScrubUnfilledLocked(r); !scrubbed.ok()) {
      StepLocked(r, Event::kTransferFailed);
      FailLocked(r, std::string(scrubbed.message()));
      return;
    }
    cpu.Pause();
    absl::Status submitted = SubmitLocked(r, *r.peer, OpKind::kWrite, std::move(*ops), layer);
    cpu.Resume();
    if (!submitted.ok()) {
      StepLocked(r, Event::kTransferFailed);
      FailLocked(r, absl::StrCat("layer ", layer, ": ", submitted.message()));
      return;
    }
    if (r.t_first == absl::InfinitePast()) r.t_first = absl::Now();
  }
  cpu.Pause();
  r.cpu_us += cpu_us;
  MaybeFinishSaveLocked(r);
}

void Connector::Impl::TellLayerDone(Request& r, int layer) {
  if (!r.peer || !PeerAlive(*r.peer)) return;
  // A lost message only costs decode the overlap: "done" still completes the load. Built as
  // DumpJson would write {"t": "layer", "transfer_id": ..., "layer": ...} (keys sorted), one
  // string per layer instead of a json object's nodes; the id is escaped once per request.
  if (r.transfer_id_json.empty()) r.transfer_id_json = DumpJson(json(r.params.transfer_id));
  (void)SendPayload(*r.peer, connector_internal::LayerMessagePayload(r.transfer_id_json, layer));
}

void Connector::Impl::MaybeFinishSaveLocked(Request& r) {
  if (r.state != State::kSaving || !r.transfers.empty() || !AllLayersSent(r)) return;
  json done = {{"t", "done"}, {"transfer_id", r.params.transfer_id}, {"bytes", r.plan->bytes}};
  absl::Status s = SendMessage(*r.peer, done);
  if (!s.ok()) {
    FailLocked(r, absl::StrCat("done notification not sent: ", s.message()));
    return;
  }
  CompleteLocked(r);
}

}  // namespace kvwire

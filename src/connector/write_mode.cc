// Prefill, write mode: once decode's block ids are known, each layer saved by the worker goes
// out as one WRITE transfer; "done" follows when every layer is sent and acknowledged.
#include <algorithm>

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

void Connector::Impl::OnWriteRequest(PeerId peer, const json& m) {
  const std::string tid = m.value("transfer_id", "");
  Request* r = FindByTransfer(tid);
  if (r == nullptr) {
    auto gone = retired_transfers_.find(tid);
    if (gone != retired_transfers_.end()) {
      // Failed or aborted here before decode asked: tell it at once.
      (void)SendMessage(peer, json{{"t", "fail"}, {"transfer_id", tid}, {"reason", gone->second}});
      return;
    }
    // Decode may ask before prefill's scheduler has seen the request: keep it a while.
    early_writes_[tid] = {peer, m, absl::Now() + options_.request_timeout};
    return;
  }
  r->peer = peer;
  r->have_remote = true;
  try {
    r->remote_blocks = BlocksFromJson(m.at("blocks"));
    r->remote_cached = m.value("num_cached", uint64_t{0});
  } catch (const json::exception& e) {
    FailLocked(*r, absl::StrCat("bad write request: ", e.what()));
    return;
  }
  MaybeSendLayersLocked(*r);
}

// Prefill write mode: plans once both block tables are known, then sends every final
// layer not yet sent; "done" follows when all layers are sent and their transfers ended.
void Connector::Impl::MaybeSendLayersLocked(Request& r) {
  double cpu_us = 0;  // outlives `cpu`; added to the request only while it is alive
  CpuTimer cpu(&cpu_us);
  if (!r.have_remote) {
    auto e = early_writes_.find(r.params.transfer_id);
    if (e == early_writes_.end()) return;
    EarlyWrite ew = std::move(e->second);
    early_writes_.erase(e);
    r.peer = ew.peer;
    r.have_remote = true;
    try {
      r.remote_blocks = BlocksFromJson(ew.msg.at("blocks"));
      r.remote_cached = ew.msg.value("num_cached", uint64_t{0});
    } catch (const json::exception& ex) {
      FailLocked(r, absl::StrCat("bad write request: ", ex.what()));
      return;
    }
  }
  if (r.state != State::kSaving) return;
  auto pit = peers_.find(*r.peer);
  if (pit == peers_.end() || !pit->second.ready) {
    FailLocked(r, "write request from a peer without a connector handshake");
    return;
  }
  Peer& p = pit->second;
  if (!r.plan) {
    absl::StatusOr<TransferPlan> plan =
        PlanTransfer(layout_, r.blocks, p.layout, r.remote_blocks, r.num_tokens, r.remote_cached);
    if (!plan.ok()) {
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
      FailLocked(r, std::string(ops.status().message()));
      return;
    }
    TransferOptions to;
    to.timeout = std::max(absl::Milliseconds(1), r.deadline - absl::Now());
    cpu.Pause();
    absl::StatusOr<TransferId> id = engine_->Transfer(*r.peer, OpKind::kWrite, *ops, to);
    cpu.Resume();
    if (!id.ok()) {
      FailLocked(r, absl::StrCat("layer ", layer, ": ", id.status().message()));
      return;
    }
    if (r.t_first == absl::InfinitePast()) r.t_first = absl::Now();
    r.transfers.insert(*id);
    r.transfer_layer[*id] = layer;
    ++r.layer_transfers_left[layer];
  }
  cpu.Pause();
  r.cpu_us += cpu_us;
  MaybeFinishSaveLocked(r);
}

void Connector::Impl::TellLayerDone(Request& r, int layer) {
  if (!r.peer || !PeerAlive(*r.peer)) return;
  // A lost message only costs decode the overlap: "done" still completes the load.
  (void)SendMessage(*r.peer,
                    json{{"t", "layer"}, {"transfer_id", r.params.transfer_id}, {"layer", layer}});
}

void Connector::Impl::MaybeFinishSaveLocked(Request& r) {
  if (r.state != State::kSaving || !r.plan || !r.transfers.empty()) return;
  for (int layer : r.plan->Layers()) {
    if (r.layers_sent.count(layer) == 0) return;
  }
  json done = {{"t", "done"}, {"transfer_id", r.params.transfer_id}, {"bytes", r.plan->bytes}};
  absl::Status s = SendMessage(*r.peer, done);
  if (!s.ok()) {
    FailLocked(r, absl::StrCat("done notification not sent: ", s.message()));
    return;
  }
  CompleteLocked(r);
}

}  // namespace kvwire

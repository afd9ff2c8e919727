// Decode: the start of one load. Chooses the mode (request override, else the peer pair),
// then either READs every block in one transfer (read mode; prefill is told first, so that
// its blocks are bound to this reader) or sends its block ids to prefill (write mode).
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

// Decode: starts one request's load.
void Connector::Impl::StartLoad(const std::string& id) {
  std::string address;
  {
    MutexLock lock(&mu_);
    auto it = requests_.find(id);
    if (it == requests_.end() || it->second.state != State::kPending) return;
    it->second.state = State::kLoading;
    address = absl::StrCat(it->second.params.host, ":", it->second.params.port);
  }
  absl::StatusOr<PeerId> peer = EnsurePeer(address);
  MutexLock lock(&mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  Request& r = it->second;
  if (!r.fail_reason.empty()) {  // aborted while connecting
    FailLocked(r, r.fail_reason);
    return;
  }
  if (!peer.ok()) {
    FailLocked(r, std::string(peer.status().message()));
    return;
  }
  r.peer = *peer;
  Peer& p = peers_[*peer];
  // Mode: the request's override, else block ids decide (present: read), then the pair.
  KvMode want = r.params.mode;
  if (want == KvMode::kAuto) {
    absl::StatusOr<KvMode> pair = NegotiateKvMode(p.prefill_mode, p.decode_mode);
    want = pair.ok() ? *pair : KvMode::kRead;
    if (p.prefill_mode == KvMode::kAuto && p.decode_mode == KvMode::kAuto) {
      want = r.params.block_ids.empty() ? KvMode::kWrite : KvMode::kRead;
    }
  }
  for (KvMode side : {p.prefill_mode, p.decode_mode}) {
    if (side != KvMode::kAuto && side != want) {
      FailLocked(r, absl::StrCat("kv transfer mode conflict: request wants '", KvModeName(want),
                                 "', prefill is '", KvModeName(p.prefill_mode), "', decode is '",
                                 KvModeName(p.decode_mode), "'"));
      return;
    }
  }
  r.mode = want;
  if (want == KvMode::kWrite) {
    json req = {{"t", "write_req"},
                {"transfer_id", r.params.transfer_id},
                {"request_id", r.id},
                {"blocks", BlocksToJson(r.blocks)},
                {"num_cached", r.num_cached}};
    if (absl::Status s = SendMessage(*peer, req); !s.ok()) {
      FailLocked(r, std::string(s.message()));
      return;
    }
    r.t_first = absl::Now();
    return;
  }
  if (r.params.block_ids.empty()) {
    FailLocked(r, "read mode but kv_transfer_params carry no block_ids");
    return;
  }
  double cpu_us = 0;  // outlives `cpu`; added to the request only while it is alive
  CpuTimer cpu(&cpu_us);
  absl::StatusOr<TransferPlan> plan =
      PlanTransfer(p.layout, r.params.block_ids, layout_, r.blocks, r.num_tokens, r.num_cached);
  if (!plan.ok()) {
    FailLocked(r, std::string(plan.status().message()));
    return;
  }
  r.plan = std::move(*plan);
  Account(r);
  std::vector<ByteRange> all;
  for (const GroupPlan& g : r.plan->groups) all.insert(all.end(), g.ranges.begin(), g.ranges.end());
  if (all.empty()) {
    CompleteLocked(r);
    return;
  }
  absl::StatusOr<std::vector<Op>> ops = ToOps(all, p, /*local_is_src=*/false);
  if (!ops.ok()) {
    FailLocked(r, std::string(ops.status().message()));
    return;
  }
  cpu.Pause();
  absl::Status started =
      SendMessage(*peer, json{{"t", "read_start"}, {"transfer_id", r.params.transfer_id}});
  cpu.Resume();
  if (!started.ok()) {
    FailLocked(r, std::string(started.message()));
    return;
  }
  TransferOptions to;
  to.timeout = std::max(absl::Milliseconds(1), r.deadline - absl::Now());
  cpu.Pause();
  absl::StatusOr<TransferId> tid = engine_->Transfer(*peer, OpKind::kRead, *ops, to);
  cpu.Resume();
  if (!tid.ok()) {
    FailLocked(r, std::string(tid.status().message()));
    return;
  }
  r.t_first = absl::Now();
  r.transfers.insert(*tid);
  cpu.Pause();
  r.cpu_us += cpu_us;
  KVW_LOG(kDebug, kLog) << "load started" << Kv("request", r.id)
                        << Kv("transfer", r.params.transfer_id) << Kv("bytes", r.plan->bytes)
                        << Kv("ops", ops->size());
}

}  // namespace kvwire

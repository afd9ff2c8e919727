// Decode: the start of one load. Chooses the mode (request override, else the peer pair),
// then either READs every block in one transfer (read mode; prefill is told first, so that
// its blocks are bound to this reader) or sends its block ids to prefill (write mode).
#include <algorithm>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

// Decode: starts one request's load.
void Connector::Impl::StartLoad(const std::string& id) {
  std::string address, engine_id;
  std::vector<std::string> tp_addresses;
  {
    MutexLock lock(&mu_);
    auto it = table_.requests.find(id);
    if (it == table_.requests.end() || it->second.state != State::kPending) return;
    StepLocked(it->second, Event::kStartLoad);
    it->second.state = State::kLoading;
    // Every layer is pending until its data is known to be in place (read: its transfers
    // ended; write: prefill's "layer" or "done").
    for (const CacheGroup& g : layout_.groups) {
      it->second.layers_pending.insert(g.layers.begin(), g.layers.end());
    }
    if (!it->second.params.host.empty() && it->second.params.port != 0) {
      address = absl::StrCat(it->second.params.host, ":", it->second.params.port);
    }
    engine_id = it->second.params.engine_id;
    for (const KvSource& src : it->second.params.tp_sources) {
      tp_addresses.push_back(absl::StrCat(src.host, ":", src.port));
    }
  }
  if (address.empty()) {
    // Named by engine id alone: resolved through discovery (or refused with the reason).
    absl::StatusOr<std::string> resolved = ResolveEngine(engine_id);
    if (!resolved.ok()) {
      StepLock lock(this);
      auto it = table_.requests.find(id);
      if (it != table_.requests.end()) StepLocked(it->second, Event::kConnectFailed);
      if (it != table_.requests.end() && it->second.release_only) {
        KVW_LOG(kWarning, kLog) << "cannot tell the prefill to free its blocks (its lease will)"
                                << Kv("request", id) << Kv("reason", resolved.status().message());
        CheckMachineEndLocked(it->second, State::kWithdrawn);
        table_.requests.erase(it);
      } else if (it != table_.requests.end()) {
        Request& r = it->second;
        FailLocked(
            r, r.fail_reason.empty() ? std::string(resolved.status().message()) : r.fail_reason);
      }
      return;
    }
    address = *resolved;
  }
  absl::StatusOr<PeerId> peer = EnsurePeer(address);
  std::vector<absl::StatusOr<PeerId>> tp_peers;
  for (const std::string& a : tp_addresses) tp_peers.push_back(EnsurePeer(a));
  // The blocks' last reads here come before a prefill's writes (write mode), served on other
  // threads; outside the lock, before any message that lets the prefill write.
  engine_->PublishMemory();
  StepLock lock(this);
  auto it = table_.requests.find(id);
  if (it == table_.requests.end()) return;
  Request& r = it->second;
  // Bound before any failure, so that the sources that hold blocks for it get their release.
  for (size_t i = 0; i < tp_peers.size(); ++i) {
    if (tp_peers[i].ok())
      r.tp_sources.emplace_back(*tp_peers[i], r.params.tp_sources[i].transfer_id);
  }
  if (r.release_only) {
    if (peer.ok()) r.peer = *peer;
    KvMode told = r.params.mode;
    if (told == KvMode::kAuto) told = r.params.block_ids.empty() ? KvMode::kWrite : KvMode::kRead;
    StepLocked(r, !peer.ok()               ? Event::kConnectFailed
                  : told == KvMode::kWrite ? Event::kConnectedWrite
                                           : Event::kConnectedRead);
    TellUnreadLocked(r);
    CheckMachineEndLocked(r, State::kWithdrawn);
    table_.requests.erase(it);  // never counted as started: nothing moved
    return;
  }
  if (!r.fail_reason.empty()) {  // aborted while connecting
    StepLocked(r, Event::kConnectFailed);
    FailLocked(r, r.fail_reason);
    return;
  }
  if (!peer.ok()) {
    StepLocked(r, Event::kConnectFailed);
    FailLocked(r, std::string(peer.status().message()));
    return;
  }
  r.peer = *peer;
  auto pit = sessions_.peers.find(*peer);
  if (pit == sessions_.peers.end() || !pit->second.ready) {
    StepLocked(r, Event::kConnectFailed);
    FailLocked(r, absl::StrCat("prefill engine at ", address, " closed"));
    return;
  }
  Peer& p = pit->second;
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
      StepLocked(r, Event::kConnectFailed);
      FailLocked(r, absl::StrCat("kv transfer mode conflict: request wants '", KvModeName(want),
                                 "', prefill is '", KvModeName(p.prefill_mode), "', decode is '",
                                 KvModeName(p.decode_mode), "'"));
      return;
    }
  }
  r.mode = want;
  if (want == KvMode::kWrite) {
    if (!r.params.tp_sources.empty()) {
      r.mode = KvMode::kRead;  // the extra ranks hold read-mode hand-offs: release them
      StepLocked(r, Event::kConnectFailed);
      FailLocked(r,
                 "kv_transfer_params name several prefill ranks (tp_sources), which only "
                 "read mode supports");
      return;
    }
    json req = {{"t", "write_req"},
                {"transfer_id", r.params.transfer_id},
                {"request_id", r.id},
                {"blocks", connector_internal::BlocksToJson(r.blocks)},
                {"num_cached", r.num_cached}};
    StepLocked(r, Event::kConnectedWrite);
    if (absl::Status s = SendMessage(*peer, req, r.id); !s.ok()) {
      StepLocked(r, Event::kPeerGone);
      FailLocked(r, std::string(s.message()));
      return;
    }
    r.t_first = absl::Now();
    return;
  }
  if (r.params.block_ids.empty()) {
    StepLocked(r, Event::kConnectFailed);
    FailLocked(r, "read mode but kv_transfer_params carry no block_ids");
    return;
  }
  if (!StartReads(r, tp_peers)) return;
  KVW_LOG(kDebug, kLog) << "load started" << Kv("request", r.id)
                        << Kv("transfer", r.params.transfer_id) << Kv("bytes", r.plan->bytes)
                        << Kv("sources", 1 + r.tp_sources.size());
}

// Decode: tells every prefill rank of a release-only request that it will not read (read
// mode: "release" unread; write mode, before any block ids went out: "fail" unread).
void Connector::Impl::TellUnreadLocked(Request& r) {
  KvMode mode = r.params.mode;
  if (mode == KvMode::kAuto) mode = r.params.block_ids.empty() ? KvMode::kWrite : KvMode::kRead;
  json m = {{"t", mode == KvMode::kWrite ? "fail" : "release"},
            {"transfer_id", r.params.transfer_id},
            {"ok", false},
            {"unread", true},
            {"reason", r.fail_reason}};
  if (r.peer && PeerAlive(*r.peer)) (void)SendMessage(*r.peer, m);
  for (const auto& [peer, tid] : r.tp_sources) {
    if (!PeerAlive(peer)) continue;
    json more = m;
    more["transfer_id"] = tid;
    (void)SendMessage(peer, more);
  }
  KVW_LOG(kDebug, kLog) << "told prefill its blocks are not needed" << Kv("request", r.id)
                        << Kv("transfer", r.params.transfer_id) << Kv("reason", r.fail_reason);
}

absl::Status Connector::Impl::ReleaseUnread(const std::string& req_id,
                                            const std::string& params_json,
                                            const std::string& reason) {
  absl::StatusOr<KvTransferParams> params = KvTransferParams::FromJson(params_json);
  if (!params.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", req_id, ": ", params.status().message()));
  }
  if (!params->do_remote_prefill || params->transfer_id.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", req_id,
                     ": release needs a prefill's hand-off (do_remote_prefill, transfer_id)"));
  }
  {
    MutexLock lock(&mu_);
    if (table_.requests.count(req_id) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("request ", req_id, " is already known"));
    }
    Request r;
    r.id = req_id;
    r.decode = true;
    r.release_only = true;
    r.params = *std::move(params);
    r.state = State::kPending;
    r.fail_reason = reason.substr(0, 256);
    r.t_queued = absl::Now();
    r.deadline = r.t_queued + options_.request_timeout;
    table_.requests[req_id] = std::move(r);
  }
  StartLoad(req_id);
  return absl::OkStatus();
}

bool Connector::Impl::StartReads(Request& r, const std::vector<absl::StatusOr<PeerId>>& tp_peers) {
  for (const absl::StatusOr<PeerId>& tp : tp_peers) {
    if (!tp.ok()) {
      StepLocked(r, Event::kConnectFailed);
      FailLocked(r, absl::StrCat("prefill tensor-parallel rank: ", tp.status().message()));
      return false;
    }
  }
  double cpu_us = 0;  // outlives `cpu`; added to the request only while it is alive
  CpuTimer cpu(&cpu_us);
  struct Source {
    PeerId peer;
    const std::string* transfer_id;
    TransferPlan plan;
    std::map<int, std::vector<Op>> layer_ops;  // layers with something to move
  };
  std::vector<Source> sources;
  std::vector<std::pair<PeerId, const BlockTable*>> tables = {{*r.peer, &r.params.block_ids}};
  for (size_t i = 0; i < r.tp_sources.size(); ++i) {
    tables.emplace_back(r.tp_sources[i].first, &r.params.tp_sources[i].block_ids);
  }
  std::map<std::string, uint64_t> head_bytes;  // head-split groups: bytes over all sources
  for (size_t i = 0; i < tables.size(); ++i) {
    auto pit = sessions_.peers.find(tables[i].first);
    if (pit == sessions_.peers.end() || !pit->second.ready) {
      StepLocked(r, Event::kConnectFailed);
      FailLocked(r, "a prefill engine of the request closed");
      return false;
    }
    const Peer& p = pit->second;
    absl::StatusOr<TransferPlan> plan =
        PlanTransfer(p.layout, *tables[i].second, layout_, r.blocks, r.num_tokens, r.num_cached);
    if (!plan.ok()) {
      StepLocked(r, Event::kConnectFailed);
      FailLocked(r, std::string(plan.status().message()));
      return false;
    }
    std::vector<GroupPlan> kept;
    for (GroupPlan& g : plan->groups) {
      const bool split = layout_.FindGroup(g.group)->heads.total_heads != 0;
      // Replicated groups are identical on every rank: read them from the first one only.
      if (i > 0 && !split) continue;
      if (split) head_bytes[g.group] += g.bytes;
      kept.push_back(std::move(g));
    }
    plan->groups = std::move(kept);
    std::map<int, std::vector<Op>> layer_ops;
    for (int layer : plan->Layers()) {
      std::vector<ByteRange> ranges = plan->LayerRanges(layer);
      if (ranges.empty()) continue;
      absl::StatusOr<std::vector<Op>> ops = ToOps(ranges, p, /*local_is_src=*/false);
      if (!ops.ok()) {
        StepLocked(r, Event::kConnectFailed);
        FailLocked(r, std::string(ops.status().message()));
        return false;
      }
      layer_ops[layer] = std::move(*ops);
    }
    sources.push_back({tables[i].first,
                       i == 0 ? &r.params.transfer_id : &r.params.tp_sources[i - 1].transfer_id,
                       std::move(*plan), std::move(layer_ops)});
  }
  {
    // Every head of this rank must come from some prefill rank (a decode rank with more
    // heads than one prefill rank needs the others in tp_sources).
    for (const CacheGroup& g : layout_.groups) {
      if (g.heads.total_heads == 0) continue;
      const uint64_t want = SelectBlocks(g, r.num_tokens, r.num_cached).logical_blocks.size() *
                            g.layers.size() * g.components * g.page_bytes;
      if (head_bytes[g.name] != want) {
        StepLocked(r, Event::kConnectFailed);
        FailLocked(r, absl::StrCat("cache group '", g.name, "': the ", tables.size(),
                                   " prefill rank(s) give ", head_bytes[g.name], " of the ", want,
                                   " bytes of this decode rank's heads"));
        return false;
      }
    }
  }
  r.plan = sources[0].plan;
  std::set<int> layers;
  for (Source& s : sources) {
    Account(r, s.plan);
    for (const auto& [layer, ops] : s.layer_ops) layers.insert(layer);
  }
  if (layers.empty()) {
    StepLocked(r, Event::kConnectedRead, /*nothing_to_move=*/true);
    CompleteLocked(r);
    return false;
  }
  // Each source is told first (read_start), so that the blocks it holds are bound to this
  // reader (freed if it dies) and granted to it; the READs start once every source answered
  // with its grant (read_ok, OnReadOk): before that the prefill serves none of them.
  r.read_sources.clear();
  for (Source& s : sources) {
    r.read_sources.push_back({s.peer, *s.transfer_id, std::move(s.layer_ops), std::nullopt});
  }
  r.layers_pending = layers;
  StepLocked(r, Event::kConnectedRead);
  for (const Request::ReadSource& s : r.read_sources) {
    cpu.Pause();
    absl::Status started =
        SendMessage(s.peer, json{{"t", "read_start"}, {"transfer_id", s.transfer_id}}, r.id);
    cpu.Resume();
    if (!started.ok()) {
      StepLocked(r, Event::kPeerGone);
      FailLocked(r, std::string(started.message()));
      return false;
    }
  }
  cpu.Pause();
  r.cpu_us += cpu_us;
  return true;
}

void Connector::Impl::SubmitReadsLocked(Request& r) {
  // One transfer per layer and source, in layer order: WaitForLayerLoad(i) returns once
  // layer i is in place while later layers still move.
  // Before the first Transfer: shm copies run inside it, so a later stamp misses them.
  r.t_first = absl::Now();
  for (int layer : std::set<int>(r.layers_pending)) {
    for (const Request::ReadSource& s : r.read_sources) {
      auto ops = s.layer_ops.find(layer);
      if (ops == s.layer_ops.end()) continue;
      // The ops are not needed here any more (read_sources is cleared below).
      uint64_t bytes = 0;
      for (const Op& op : ops->second) bytes += op.length;
      auto counted =
          std::find_if(r.bytes_read.begin(), r.bytes_read.end(),
                       [&](const std::pair<PeerId, uint64_t>& x) { return x.first == s.peer; });
      if (counted == r.bytes_read.end()) {
        r.bytes_read.emplace_back(s.peer, bytes);
      } else {
        counted->second += bytes;
      }
      absl::Status submitted =
          SubmitLocked(r, s.peer, OpKind::kRead, std::move(ops->second), layer, *s.grant);
      if (!submitted.ok()) {
        StepLocked(r, Event::kTransferFailed);
        FailLocked(r, absl::StrCat("layer ", layer, ": ", submitted.message()));
        return;
      }
    }
  }
  r.read_sources.clear();  // the ops are no longer needed
}

}  // namespace kvwire

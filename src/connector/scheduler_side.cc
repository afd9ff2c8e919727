// Connector scheduler half: GetNumNewMatchedTokens, UpdateStateAfterAlloc,
// BuildConnectorMeta and RequestFinished (which, in read mode, holds prefill's blocks).
#include <algorithm>

#include <openssl/rand.h>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/connector/transfer_id.h"
#include "src/util/log.h"

namespace kvwire {
namespace connector_internal {

absl::StatusOr<std::string> RandomTransferId() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    return absl::UnavailableError("RAND_bytes failed: no transfer id can be made");
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

}  // namespace connector_internal

// --- scheduler side ---------------------------------------------------------------------
absl::StatusOr<MatchResult> Connector::Impl::GetNumNewMatchedTokens(
    const std::string& req_id, uint64_t num_tokens, uint64_t num_computed,
    const std::string& params_json) {
  MatchResult result;
  if (params_json.empty()) return result;
  absl::StatusOr<KvTransferParams> params = KvTransferParams::FromJson(params_json);
  if (!params.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", req_id, ": ", params.status().message()));
  }
  MutexLock lock(&mu_);
  if (table_.requests.count(req_id) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("request ", req_id, " is already known"));
  }
  if (params->do_remote_prefill) {
    // No num_tokens (vLLM's proxies pass on what its connectors send): the whole prompt.
    const uint64_t remote_tokens =
        params->num_tokens == 0 ? num_tokens : std::min(params->num_tokens, num_tokens);
    if (remote_tokens <= num_computed) return result;  // full local prefix hit
    // Prefill's messages about a transfer name it by id: two loads of one id cannot be told
    // apart.
    if (const Request* other = FindDecodeByTransfer(params->transfer_id); other != nullptr) {
      return absl::AlreadyExistsError(absl::StrCat("request ", req_id, ": transfer id '",
                                                   params->transfer_id, "' is in use by request ",
                                                   other->id));
    }
    Request r;
    r.id = req_id;
    r.decode = true;
    r.params = *params;
    r.num_tokens = remote_tokens;
    r.num_cached = num_computed;
    r.t_queued = absl::Now();
    r.deadline = r.t_queued + options_.request_timeout;
    r.machine = Machine(Role::kDecode, KvMode::kAuto);
    StepLocked(r, Event::kMatch);
    table_.requests[req_id] = std::move(r);
    accounting_.Started();
    result.num_external_tokens = remote_tokens - num_computed;
    result.load_async = true;
    return result;
  }
  if (params->do_remote_decode && params->mode == KvMode::kWrite) {
    if (params->transfer_id.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", req_id, ": write mode needs a transfer_id"));
    }
    if (options_.mode == KvMode::kRead) {
      return absl::FailedPreconditionError(absl::StrCat(
          "request ", req_id, ": asks for write mode but this prefill engine is 'read'"));
    }
    if (auto other = table_.by_transfer.find(params->transfer_id);
        other != table_.by_transfer.end()) {
      return absl::AlreadyExistsError(absl::StrCat("request ", req_id, ": transfer id '",
                                                   params->transfer_id, "' is in use by request ",
                                                   other->second));
    }
    Request r;
    r.id = req_id;
    r.params = *params;
    r.mode = KvMode::kWrite;
    r.num_tokens = num_tokens;
    r.t_queued = absl::Now();
    r.deadline = r.t_queued + options_.request_timeout;
    r.machine = Machine(Role::kPrefill, KvMode::kWrite);
    StepLocked(r, Event::kMatch);
    table_.by_transfer[params->transfer_id] = req_id;
    table_.requests[req_id] = std::move(r);
    accounting_.Started();
  }
  return result;
}

absl::Status Connector::Impl::UpdateStateAfterAlloc(const std::string& req_id,
                                                    const BlockTable& blocks,
                                                    uint64_t num_external_tokens) {
  StepLock lock(this);  // a write-mode save may send at once
  auto it = table_.requests.find(req_id);
  if (it == table_.requests.end()) return absl::OkStatus();  // not a connector request
  Request& r = it->second;
  if (!registered_) {
    return absl::FailedPreconditionError("RegisterKvCaches must come before requests");
  }
  if (r.state != State::kMatched) {
    StepLocked(r, Event::kAlloc);  // refused: counted and logged
    return absl::FailedPreconditionError(absl::StrCat(
        "request ", req_id, ": blocks allocated twice (state ", StateName(r.state), ")"));
  }
  r.blocks = blocks;
  if (r.decode) {
    if (num_external_tokens == 0) {
      // The scheduler chose not to load: nothing touches the blocks.
      StepLocked(r, Event::kAllocNone);
      CheckMachineEndLocked(r, State::kWithdrawn);
      table_.requests.erase(it);
      accounting_.Withdrawn();
      return absl::OkStatus();
    }
    StepLocked(r, Event::kAlloc);
    r.state = State::kPending;
    table_.pending_loads.push_back(req_id);
  } else {
    StepLocked(r, Event::kAlloc);
    r.state = State::kSaving;
    table_.pending_saves.push_back(req_id);
    MaybeSendLayersLocked(r);
  }
  return absl::OkStatus();
}

std::string Connector::Impl::BuildConnectorMeta() {
  MutexLock lock(&mu_);
  json loads = json::array(), saves = json::array();
  for (const std::string& id : table_.pending_loads) {
    auto it = table_.requests.find(id);
    if (it == table_.requests.end()) continue;
    loads.push_back({{"request_id", id},
                     {"params", connector_internal::ParamsToJsonValue(it->second.params)},
                     {"blocks", connector_internal::BlocksToJson(it->second.blocks)},
                     {"num_cached", it->second.num_cached}});
  }
  for (const std::string& id : table_.pending_saves) {
    if (table_.requests.count(id) != 0) saves.push_back({{"request_id", id}});
  }
  table_.pending_loads.clear();
  table_.pending_saves.clear();
  return DumpJson(json{{"loads", loads}, {"saves", saves}});
}

absl::StatusOr<RequestFinishedResult> Connector::Impl::RequestFinished(
    const std::string& req_id, const BlockTable& blocks, uint64_t num_tokens,
    const std::string& params_json, bool aborted, const std::string& given_transfer_id) {
  RequestFinishedResult out;
  // A read-mode hand-off's blocks were filled before this call; the readers' ops are served
  // on other threads. Outside the lock (one uncontended engine lock when nothing is handed off).
  engine_->PublishMemory();
  StepLock lock(this);  // readers that asked early get their read_ok, sent after the lock
  if (table_.retired_early.erase(req_id) != 0) return out;  // failed before it finished
  auto it = table_.requests.find(req_id);
  if (it != table_.requests.end()) {
    Request& r = it->second;
    if (r.decode) {
      // Decode finished (or aborted) the request: an unfinished load is aborted.
      if (!r.fail_reason.empty() || r.state == State::kDraining) {
        StepLocked(r, Event::kSchedulerFinished);
        out.delay_free = true;
        return out;
      }
      if (r.state == State::kMatched || r.state == State::kPending) {
        StepLocked(r, Event::kSchedulerFinished);
        CheckMachineEndLocked(r, State::kWithdrawn);
        table_.requests.erase(it);
        accounting_.Withdrawn();
        return out;
      }
      AbortLocked(r, "request finished by the scheduler while loading", Event::kSchedulerFinished);
      out.delay_free = true;
      return out;
    }
    // Prefill write mode.
    r.finished_by_scheduler = true;
    StepLocked(r, Event::kSchedulerFinished);
    if (aborted) AbortLocked(r, "aborted on prefill", Event::kAbort);
    out.delay_free = true;
    return out;
  }
  if (aborted || params_json.empty()) return out;
  absl::StatusOr<KvTransferParams> in = KvTransferParams::FromJson(params_json);
  if (!in.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", req_id, ": ", in.status().message()));
  }
  if (!in->do_remote_decode) return out;
  if (options_.mode == KvMode::kWrite) {
    return absl::FailedPreconditionError(absl::StrCat(
        "request ", req_id, ": read mode hand-off but this prefill engine is 'write'"));
  }
  if (!registered_) {
    return absl::FailedPreconditionError("RegisterKvCaches must come before requests");
  }
  // Prefill read mode: hold the blocks for the reader.
  Request r;
  r.id = req_id;
  r.mode = KvMode::kRead;
  r.state = State::kHeld;
  r.blocks = blocks;
  r.t_queued = absl::Now();
  r.deadline = r.t_queued + options_.request_timeout;
  r.finished_by_scheduler = true;
  KvTransferParams p;
  p.engine_id = engine_->name();
  const std::string addr = engine_->address();
  const size_t colon = addr.rfind(':');
  p.host = addr.substr(0, colon);
  int port = 0;
  if (colon != std::string::npos) {
    if (!absl::SimpleAtoi(addr.substr(colon + 1), &port)) port = 0;
  }
  p.port = port;
  // Unguessable: the id is what a reader presents (read_start, release), so a peer that was
  // not handed it cannot claim or release the blocks.
  if (given_transfer_id.empty()) {
    absl::StatusOr<std::string> tid = connector_internal::RandomTransferId();
    if (!tid.ok()) return tid.status();
    p.transfer_id = std::move(*tid);
  } else {
    if (given_transfer_id.size() > connector_internal::kMaxTransferIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat("request ", req_id, ": transfer id of ",
                                                     given_transfer_id.size(), " bytes"));
    }
    if (auto other = table_.by_transfer.find(given_transfer_id);
        other != table_.by_transfer.end()) {
      return absl::AlreadyExistsError(absl::StrCat("request ", req_id, ": transfer id '",
                                                   given_transfer_id, "' is in use by request ",
                                                   other->second));
    }
    p.transfer_id = given_transfer_id;
  }
  p.remote_request_id = req_id;
  p.mode = KvMode::kRead;
  p.block_ids = blocks;
  p.do_remote_prefill = true;
  p.num_tokens = num_tokens;
  r.params = p;
  r.machine = Machine(Role::kPrefill, KvMode::kRead);
  StepLocked(r, Event::kHandOff);
  table_.by_transfer[p.transfer_id] = req_id;
  table_.requests[req_id] = std::move(r);
  accounting_.Started();
  out.delay_free = true;
  out.kv_transfer_params = p.ToJson();
  // Readers that asked before this hold (a decode with tensor parallelism: several): bound
  // to it and granted now, in turn. A failed grant ends the hold (the rest find it gone).
  std::vector<EarlyRead> asked;
  for (auto [e, end] = table_.early_reads.equal_range(p.transfer_id); e != end; ++e) {
    asked.push_back(std::move(e->second));
  }
  table_.early_reads.erase(p.transfer_id);
  for (const EarlyRead& e : asked) {
    auto held = table_.requests.find(req_id);
    if (held == table_.requests.end()) break;
    if (!PeerAlive(e.peer)) continue;
    if (ClaimReaderLocked(held->second, e.peer, e.name, "read_start", e.place) != nullptr) {
      GrantReadLocked(held->second, e.peer);
    }
  }
  // Readers that were done before this hold: bound to it and done now; the hold ends when
  // that leaves no reader to wait for (GetFinished reports it as sent).
  std::vector<EarlyRelease> released;
  for (auto [e, end] = table_.early_releases.equal_range(p.transfer_id); e != end; ++e) {
    released.push_back(std::move(e->second));
  }
  table_.early_releases.erase(p.transfer_id);
  for (const EarlyRelease& e : released) {
    auto held = table_.requests.find(req_id);
    if (held == table_.requests.end()) break;
    Request& h = held->second;
    if (ClaimReaderLocked(h, e.peer, "", "release", e.place) == nullptr) continue;
    if (e.unread) {
      ReaderDoneLocked(h, e.peer, ReadEnd::kUnread, e.reason);
    } else if (e.ok) {
      ReaderDoneLocked(h, e.peer, ReadEnd::kRead, "");
    } else {
      ReaderDoneLocked(h, e.peer, ReadEnd::kFailed, absl::StrCat("reader failed: ", e.reason));
    }
  }
  KVW_LOG(kDebug, kLog) << "holding blocks for reader" << Kv("request", req_id)
                        << Kv("transfer", p.transfer_id);
  return out;
}

}  // namespace kvwire

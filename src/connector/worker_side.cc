// Connector worker half: binding the scheduler's metadata, starting loads, waiting for
// layers, saving layers, and aborts.
#include <optional>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

// --- worker side ------------------------------------------------------------------------
absl::Status Connector::Impl::BindConnectorMeta(const std::string& meta_json) {
  absl::StatusOr<json> j = ParseJsonObject(meta_json, "connector metadata");
  if (!j.ok()) return j.status();
  // Everything is read and checked before any of it is bound.
  struct Load {
    std::string id;
    std::optional<KvTransferParams> params;  // only for requests this worker does not know
    BlockTable blocks;
    uint64_t num_cached = 0;
  };
  std::vector<Load> loads;
  std::vector<std::string> saves;
  JsonFields f(*j, "connector metadata");
  const json* jl = f.Array("loads", /*required=*/false);
  for (size_t i = 0; jl != nullptr && i < jl->size() && f.ok(); ++i) {
    JsonFields l = f.Item((*jl)[i], absl::StrCat("loads[", i, "]"));
    Load load;
    load.id = l.String("request_id");
    const json* params = l.Object("params", /*required=*/false);
    load.num_cached = l.OptUint("num_cached", uint64_t{1} << 40, 0);
    load.blocks = connector_internal::BlocksFromJson(l, "blocks", /*required=*/params != nullptr);
    if (!f.ok()) break;
    if (params != nullptr) {
      absl::StatusOr<KvTransferParams> p = connector_internal::ParamsFromJsonValue(*params);
      if (!p.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("connector metadata: loads[", i, "].params: ", p.status().message()));
      }
      load.params = std::move(*p);
    }
    loads.push_back(std::move(load));
  }
  const json* js = f.Array("saves", /*required=*/false);
  for (size_t i = 0; js != nullptr && i < js->size() && f.ok(); ++i) {
    saves.push_back(f.Item((*js)[i], absl::StrCat("saves[", i, "]")).String("request_id"));
  }
  if (!f.ok()) return f.status();
  MutexLock lock(&mu_);
  table_.bound_loads.clear();
  table_.bound_saves.clear();
  for (Load& l : loads) {
    if (table_.requests.count(l.id) == 0) {
      // Scheduler in another process: rebuild the worker's view.
      if (!l.params) {
        return absl::InvalidArgumentError(
            absl::StrCat("connector metadata: load of request ", l.id, " has no params"));
      }
      if (const Request* other = FindDecodeByTransfer(l.params->transfer_id); other != nullptr) {
        return absl::AlreadyExistsError(absl::StrCat("connector metadata: request ", l.id,
                                                     ": transfer id '", l.params->transfer_id,
                                                     "' is in use by request ", other->id));
      }
      Request r;
      r.id = l.id;
      r.decode = true;
      r.params = std::move(*l.params);
      r.num_tokens = r.params.num_tokens;
      r.num_cached = l.num_cached;
      r.blocks = std::move(l.blocks);
      r.state = State::kPending;
      r.machine = Machine(Role::kDecode, KvMode::kAuto);
      StepLocked(r, Event::kBindMeta);
      r.t_queued = absl::Now();
      r.deadline = r.t_queued + options_.request_timeout;
      table_.requests[l.id] = std::move(r);
      accounting_.Started();
    }
    table_.bound_loads.push_back(l.id);
  }
  table_.bound_saves = std::move(saves);
  return absl::OkStatus();
}

absl::Status Connector::Impl::StartLoadKv() {
  std::vector<std::string> loads;
  {
    MutexLock lock(&mu_);
    loads = table_.bound_loads;
  }
  for (const std::string& id : loads) StartLoad(id);
  return absl::OkStatus();
}

absl::Status Connector::Impl::WaitForLayerLoad(int layer) {
  // A layer is in place when its transfers ended (read) or prefill said so (write); a request
  // that left kLoading is complete or failed, which GetFinished reports.
  MutexLock lock(&mu_);
  for (const std::string& id : table_.bound_loads) {
    while (true) {
      auto it = table_.requests.find(id);
      if (it == table_.requests.end() || it->second.state != State::kLoading) break;
      if (it->second.layers_pending.count(layer) == 0) break;
      if (absl::Now() > it->second.deadline) break;
      cv_.WaitUntil(&mu_, std::min(it->second.deadline, absl::Now() + absl::Milliseconds(50)));
    }
  }
  return absl::OkStatus();
}

absl::Status Connector::Impl::SaveKvLayer(int layer) {
  StepLock lock(this);
  if (!saves_.queue.empty()) {
    // Event-gated saves are still waiting: this layer goes out after them, in order.
    saves_.queue.push_back({++saves_.queued, layer, GpuEvent(), table_.bound_saves});
    waiter_cv_.SignalAll();
    return absl::OkStatus();
  }
  SaveLayerLocked(layer, table_.bound_saves);
  return absl::OkStatus();
}

void Connector::Impl::SaveLayerLocked(int layer, const std::vector<std::string>& ids) {
  for (const std::string& id : ids) {
    auto it = table_.requests.find(id);
    if (it == table_.requests.end()) continue;
    if (it->second.state == State::kDraining) {
      StepLocked(it->second, Event::kLayerSaved);  // nothing more is sent
      continue;
    }
    if (it->second.state != State::kSaving) continue;
    it->second.layers_final.insert(layer);
    StepLocked(it->second, Event::kLayerSaved);
    MaybeSendLayersLocked(it->second);
  }
}

absl::Status Connector::Impl::Abort(const std::string& req_id) {
  StepLock lock(this);
  auto it = table_.requests.find(req_id);
  if (it == table_.requests.end()) {
    return absl::NotFoundError(absl::StrCat("request ", req_id, " is not known"));
  }
  AbortLocked(it->second, absl::StrCat("aborted on ", it->second.decode ? "decode" : "prefill"),
              Event::kAbort);
  return absl::OkStatus();
}

}  // namespace kvwire

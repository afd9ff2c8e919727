// Connector worker half: binding the scheduler's metadata, starting loads, waiting for
// layers, saving layers, and aborts.
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

// --- worker side ------------------------------------------------------------------------
absl::Status Connector::Impl::BindConnectorMeta(const std::string& meta_json) {
  json j = json::parse(meta_json, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("connector metadata: not a JSON object");
  }
  MutexLock lock(&mu_);
  bound_loads_.clear();
  bound_saves_.clear();
  try {
    for (const json& l : j.value("loads", json::array())) {
      const std::string id = l.at("request_id").get<std::string>();
      if (requests_.count(id) == 0) {
        // Scheduler in another process: rebuild the worker's view.
        absl::StatusOr<KvTransferParams> p = KvTransferParams::FromJson(l.at("params").dump());
        if (!p.ok()) return p.status();
        Request r;
        r.id = id;
        r.decode = true;
        r.params = *p;
        r.num_tokens = p->num_tokens;
        r.num_cached = l.value("num_cached", uint64_t{0});
        r.blocks = BlocksFromJson(l.at("blocks"));
        r.state = State::kPending;
        r.t_queued = absl::Now();
        r.deadline = r.t_queued + options_.request_timeout;
        requests_[id] = std::move(r);
      }
      bound_loads_.push_back(id);
    }
    for (const json& s : j.value("saves", json::array())) {
      bound_saves_.push_back(s.at("request_id").get<std::string>());
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("connector metadata: ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status Connector::Impl::StartLoadKv() {
  std::vector<std::string> loads;
  {
    MutexLock lock(&mu_);
    loads = bound_loads_;
  }
  for (const std::string& id : loads) StartLoad(id);
  return absl::OkStatus();
}

absl::Status Connector::Impl::WaitForLayerLoad(int layer) {
  // A layer is in place when its transfers ended (read) or prefill said so (write); a request
  // that left kLoading is complete or failed, which GetFinished reports.
  MutexLock lock(&mu_);
  for (const std::string& id : bound_loads_) {
    while (true) {
      auto it = requests_.find(id);
      if (it == requests_.end() || it->second.state != State::kLoading) break;
      if (it->second.layers_pending.count(layer) == 0) break;
      if (absl::Now() > it->second.deadline) break;
      cv_.WaitUntil(&mu_, std::min(it->second.deadline, absl::Now() + absl::Milliseconds(50)));
    }
  }
  return absl::OkStatus();
}

absl::Status Connector::Impl::SaveKvLayer(int layer) {
  MutexLock lock(&mu_);
  if (!event_saves_.empty()) {
    // Event-gated saves are still waiting: this layer goes out after them, in order.
    event_saves_.push_back({++event_saves_queued_, layer, GpuEvent(), bound_saves_});
    waiter_cv_.SignalAll();
    return absl::OkStatus();
  }
  SaveLayerLocked(layer, bound_saves_);
  return absl::OkStatus();
}

void Connector::Impl::SaveLayerLocked(int layer, const std::vector<std::string>& ids) {
  for (const std::string& id : ids) {
    auto it = requests_.find(id);
    if (it == requests_.end() || it->second.state != State::kSaving) continue;
    it->second.layers_final.insert(layer);
    MaybeSendLayersLocked(it->second);
  }
}

absl::Status Connector::Impl::Abort(const std::string& req_id) {
  MutexLock lock(&mu_);
  auto it = requests_.find(req_id);
  if (it == requests_.end()) {
    return absl::NotFoundError(absl::StrCat("request ", req_id, " is not known"));
  }
  AbortLocked(it->second, absl::StrCat("aborted on ", it->second.decode ? "decode" : "prefill"));
  return absl::OkStatus();
}

}  // namespace kvwire

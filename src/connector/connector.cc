// The KV connector: request state machines for prefill and decode on top of the public
// Engine API.
//
// Connector-to-connector messages (hello, write requests, releases, aborts, done) travel as
// notifications of a 1-byte WRITE into the peer's mailbox region: a small region every
// connector registers and exports to all peers, found by its length (kMailboxBytes). The
// engine delivers a notification only after its transfer's data, so "done" sent after all
// layer WRITEs succeeded tells decode that every byte is in place.
#include "kvwire/connector.h"

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <time.h>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "kvwire/memory.h"
#include "src/connector/metrics_http.h"
#include "src/util/log.h"
#include "src/util/mutex.h"

namespace kvwire {

namespace connector_internal {
nlohmann::json LayoutToJsonValue(const Layout& layout);
absl::StatusOr<Layout> LayoutFromJsonValue(const nlohmann::json& j);
}  // namespace connector_internal

namespace {

using connector_internal::LayoutFromJsonValue;
using connector_internal::LayoutToJsonValue;
using nlohmann::json;

// Length of the mailbox region; odd so that it is not mistaken for a KV region.
constexpr uint64_t kMailboxBytes = 4093;
constexpr char kLog[] = "connector";

struct RegionSpan {
  uint64_t base = 0;
  uint64_t length = 0;
  RegionId id = 0;
};

absl::StatusOr<std::pair<RegionId, uint64_t>> FindRegion(const std::vector<RegionSpan>& regions,
                                                         uint64_t addr, uint64_t length,
                                                         const char* side) {
  for (const RegionSpan& r : regions) {
    if (addr >= r.base && addr + length <= r.base + r.length) return {{r.id, addr - r.base}};
  }
  return absl::OutOfRangeError(
      absl::StrFormat("%s range [0x%x, +%u) is in no registered region", side, addr, length));
}

json BlocksToJson(const BlockTable& t) {
  json j = json::object();
  for (const auto& [g, ids] : t) j[g] = ids;
  return j;
}

BlockTable BlocksFromJson(const json& j) {
  BlockTable t;
  for (const auto& [g, ids] : j.items()) t[g] = ids.get<std::vector<int64_t>>();
  return t;
}

double ThreadCpuUs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

// Accumulates the calling thread's CPU time into `*sink` while alive; Pause() excludes a
// span (e.g. an engine call, whose cost is the transport's, not the connector's).
class CpuTimer {
 public:
  explicit CpuTimer(double* sink) : sink_(sink), start_(ThreadCpuUs()) {}
  ~CpuTimer() {
    if (running_) *sink_ += ThreadCpuUs() - start_;
  }
  CpuTimer(const CpuTimer&) = delete;
  CpuTimer& operator=(const CpuTimer&) = delete;
  void Pause() {
    *sink_ += ThreadCpuUs() - start_;
    running_ = false;
  }
  void Resume() {
    start_ = ThreadCpuUs();
    running_ = true;
  }

 private:
  double* sink_;
  double start_;
  bool running_ = true;
};

double Us(absl::Time a, absl::Time b) {
  if (a == absl::InfinitePast() || b == absl::InfinitePast()) return -1;
  return absl::ToDoubleMicroseconds(b - a);
}

}  // namespace

class Connector::Impl {
 public:
  enum class State {
    kMatched,   // scheduler knows it; blocks not yet allocated
    kPending,   // blocks allocated, waiting for the worker (decode load / prefill save)
    kLoading,   // decode: READ in flight, or waiting for prefill's WRITEs
    kSaving,    // prefill write mode: layers going out
    kHeld,      // prefill read mode: blocks held for the reader (lease)
    kDraining,  // aborted or failed: waiting for transfers touching the blocks to end
  };
  static const char* StateName(State s) {
    static const char* names[] = {"matched", "pending", "loading", "saving", "held", "draining"};
    return names[static_cast<int>(s)];
  }

  struct GroupCounters {
    uint64_t bytes = 0;
    uint64_t ops_before_merge = 0;
    uint64_t ops = 0;
  };

  struct Request {
    std::string id;
    bool decode = false;  // role of this side for the request
    State state = State::kMatched;
    KvTransferParams params;
    KvMode mode = KvMode::kAuto;
    BlockTable blocks;
    uint64_t num_tokens = 0;
    uint64_t num_cached = 0;  // decode: tokens already present locally
    absl::Time deadline = absl::InfiniteFuture();
    absl::Time t_queued = absl::InfinitePast(), t_first = absl::InfinitePast(),
               t_last = absl::InfinitePast();
    std::optional<PeerId> peer;
    std::set<TransferId> transfers;  // in flight, touching the blocks
    std::optional<TransferPlan> plan;
    // Prefill, write mode.
    bool have_remote = false;
    BlockTable remote_blocks;
    uint64_t remote_cached = 0;
    std::set<int> layers_final, layers_sent;
    bool finished_by_scheduler = false;  // RequestFinished was called
    // Decode write mode: abort sent, waiting for prefill to stop.
    bool abort_sent = false;
    std::string fail_reason;  // set once a request fails
    std::map<std::string, GroupCounters> groups;
    double cpu_us = 0;  // connector CPU on the request path (planning, ops), not transport
  };

  struct Peer {
    PeerId id = 0;
    std::string engine_id;
    std::string address;
    Layout layout;
    std::vector<RegionSpan> regions;
    RegionId mailbox = 0;
    KvMode prefill_mode = KvMode::kAuto, decode_mode = KvMode::kAuto;
    bool ready = false;
    std::string error;
  };

  explicit Impl(ConnectorOptions options) : options_(std::move(options)) {}
  ~Impl() {
    metrics_.reset();
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    if (progress_.joinable()) progress_.join();
  }

  absl::Status Init() {
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(options_.engine);
    if (!engine.ok()) return engine.status();
    engine_ = std::move(*engine);
    absl::StatusOr<ShareableBuffer> box = ShareableBuffer::Create(kMailboxBytes, "kvwire-mailbox");
    if (!box.ok()) return box.status();
    mailbox_buf_ = std::move(*box);
    RegionOptions ro;
    ro.export_to_all_peers = true;
    absl::StatusOr<RegionId> id = engine_->RegisterMemory(mailbox_buf_.data(), kMailboxBytes, ro);
    if (!id.ok()) return id.status();
    mailbox_ = *id;
    progress_ = std::thread([this] { ProgressLoop(); });
    if (!options_.metrics_address.empty()) {
      absl::StatusOr<std::unique_ptr<connector_internal::MetricsServer>> server =
          connector_internal::MetricsServer::Start(options_.metrics_address, [this](bool json) {
            return json ? StatsJson() : StatsPrometheus();
          });
      if (!server.ok()) return server.status();
      metrics_ = std::move(*server);
    }
    return absl::OkStatus();
  }

  std::string metrics_address() const { return metrics_ ? metrics_->address() : ""; }

  Engine& engine() { return *engine_; }
  const std::string& engine_id() const { return engine_->name(); }

  // --- registration -----------------------------------------------------------------------

  absl::Status RegisterKvCaches(const Layout& layout, const std::vector<KvMemory>& memory) {
    if (absl::Status s = layout.Validate(); !s.ok()) return s;
    std::vector<RegionSpan> spans;
    for (const KvMemory& m : memory) {
      RegionOptions ro;
      ro.export_to_all_peers = true;
      absl::StatusOr<RegionId> id = engine_->RegisterMemory(m.ptr, m.length, ro);
      if (!id.ok()) return id.status();
      spans.push_back({reinterpret_cast<uint64_t>(m.ptr), m.length, *id});
    }
    for (const CacheGroup& g : layout.groups) {
      if (g.layer_base.size() != g.layers.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("cache group '", g.name, "' has no backing memory"));
      }
      const uint64_t span = (g.num_blocks - 1) * g.block_stride +
                            (g.components - 1) * g.component_stride + g.page_bytes;
      for (size_t l = 0; l < g.layers.size(); ++l) {
        absl::StatusOr<std::pair<RegionId, uint64_t>> r =
            FindRegion(spans, g.layer_base[l], span, "local");
        if (!r.ok()) {
          return absl::InvalidArgumentError(absl::StrCat("cache group '", g.name, "' layer ",
                                                         g.layers[l], ": ", r.status().message()));
        }
      }
    }
    MutexLock lock(&mu_);
    layout_ = layout;
    local_regions_ = std::move(spans);
    registered_ = true;
    return absl::OkStatus();
  }

  // --- scheduler side ---------------------------------------------------------------------

  absl::StatusOr<MatchResult> GetNumNewMatchedTokens(const std::string& req_id, uint64_t num_tokens,
                                                     uint64_t num_computed,
                                                     const std::string& params_json) {
    MatchResult result;
    if (params_json.empty()) return result;
    absl::StatusOr<KvTransferParams> params = KvTransferParams::FromJson(params_json);
    if (!params.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", req_id, ": ", params.status().message()));
    }
    MutexLock lock(&mu_);
    if (requests_.count(req_id) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("request ", req_id, " is already known"));
    }
    if (params->do_remote_prefill) {
      const uint64_t remote_tokens = std::min(params->num_tokens, num_tokens);
      if (remote_tokens <= num_computed) return result;  // full local prefix hit
      Request r;
      r.id = req_id;
      r.decode = true;
      r.params = *params;
      r.num_tokens = remote_tokens;
      r.num_cached = num_computed;
      r.t_queued = absl::Now();
      r.deadline = r.t_queued + options_.request_timeout;
      requests_[req_id] = std::move(r);
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
      Request r;
      r.id = req_id;
      r.params = *params;
      r.mode = KvMode::kWrite;
      r.num_tokens = num_tokens;
      r.t_queued = absl::Now();
      r.deadline = r.t_queued + options_.request_timeout;
      by_transfer_[params->transfer_id] = req_id;
      requests_[req_id] = std::move(r);
    }
    return result;
  }

  absl::Status UpdateStateAfterAlloc(const std::string& req_id, const BlockTable& blocks,
                                     uint64_t num_external_tokens) {
    MutexLock lock(&mu_);
    auto it = requests_.find(req_id);
    if (it == requests_.end()) return absl::OkStatus();  // not a connector request
    Request& r = it->second;
    if (!registered_) {
      return absl::FailedPreconditionError("RegisterKvCaches must come before requests");
    }
    if (r.state != State::kMatched) {
      return absl::FailedPreconditionError(absl::StrCat(
          "request ", req_id, ": blocks allocated twice (state ", StateName(r.state), ")"));
    }
    r.blocks = blocks;
    if (r.decode) {
      if (num_external_tokens == 0) {
        // The scheduler chose not to load: nothing touches the blocks.
        requests_.erase(it);
        return absl::OkStatus();
      }
      r.state = State::kPending;
      pending_loads_.push_back(req_id);
    } else {
      r.state = State::kSaving;
      pending_saves_.push_back(req_id);
      MaybeSendLayersLocked(r);
    }
    return absl::OkStatus();
  }

  std::string BuildConnectorMeta() {
    MutexLock lock(&mu_);
    json loads = json::array(), saves = json::array();
    for (const std::string& id : pending_loads_) {
      auto it = requests_.find(id);
      if (it == requests_.end()) continue;
      loads.push_back({{"request_id", id},
                       {"params", json::parse(it->second.params.ToJson())},
                       {"blocks", BlocksToJson(it->second.blocks)},
                       {"num_cached", it->second.num_cached}});
    }
    for (const std::string& id : pending_saves_) {
      if (requests_.count(id) != 0) saves.push_back({{"request_id", id}});
    }
    pending_loads_.clear();
    pending_saves_.clear();
    return json{{"loads", loads}, {"saves", saves}}.dump();
  }

  absl::StatusOr<RequestFinishedResult> RequestFinished(const std::string& req_id,
                                                        const BlockTable& blocks,
                                                        uint64_t num_tokens,
                                                        const std::string& params_json,
                                                        bool aborted) {
    RequestFinishedResult out;
    MutexLock lock(&mu_);
    if (retired_early_.erase(req_id) != 0) return out;  // failed before it finished
    auto it = requests_.find(req_id);
    if (it != requests_.end()) {
      Request& r = it->second;
      if (r.decode) {
        // Decode finished (or aborted) the request: an unfinished load is aborted.
        if (!r.fail_reason.empty() || r.state == State::kDraining) {
          out.delay_free = true;
          return out;
        }
        if (r.state == State::kMatched || r.state == State::kPending) {
          requests_.erase(it);
          return out;
        }
        AbortLocked(r, "request finished by the scheduler while loading");
        out.delay_free = true;
        return out;
      }
      // Prefill write mode.
      r.finished_by_scheduler = true;
      if (aborted) AbortLocked(r, "aborted on prefill");
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
    p.transfer_id = absl::StrCat(engine_->name(), "/", req_id, "/", ++transfer_seq_);
    p.mode = KvMode::kRead;
    p.block_ids = blocks;
    p.do_remote_prefill = true;
    p.num_tokens = num_tokens;
    r.params = p;
    by_transfer_[p.transfer_id] = req_id;
    requests_[req_id] = std::move(r);
    out.delay_free = true;
    out.kv_transfer_params = p.ToJson();
    KVW_LOG(kDebug, kLog) << "holding blocks for reader" << Kv("request", req_id)
                          << Kv("transfer", p.transfer_id);
    return out;
  }

  // --- worker side ------------------------------------------------------------------------

  absl::Status BindConnectorMeta(const std::string& meta_json) {
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

  absl::Status StartLoadKv() {
    std::vector<std::string> loads;
    {
      MutexLock lock(&mu_);
      loads = bound_loads_;
    }
    for (const std::string& id : loads) StartLoad(id);
    return absl::OkStatus();
  }

  absl::Status WaitForLayerLoad(int layer) {
    // Loads move all layers in one transfer (read) or are reported whole (write): waiting
    // for a layer waits for the bound requests to leave kLoading.
    MutexLock lock(&mu_);
    for (const std::string& id : bound_loads_) {
      while (true) {
        auto it = requests_.find(id);
        if (it == requests_.end() || it->second.state != State::kLoading) break;
        if (absl::Now() > it->second.deadline) break;
        cv_.WaitUntil(&mu_, std::min(it->second.deadline, absl::Now() + absl::Milliseconds(50)));
      }
    }
    return absl::OkStatus();
  }

  absl::Status SaveKvLayer(int layer) {
    MutexLock lock(&mu_);
    for (const std::string& id : bound_saves_) {
      auto it = requests_.find(id);
      if (it == requests_.end() || it->second.state != State::kSaving) continue;
      it->second.layers_final.insert(layer);
      MaybeSendLayersLocked(it->second);
    }
    return absl::OkStatus();
  }

  absl::Status WaitForSave() { return absl::OkStatus(); }

  FinishedRequests GetFinished() {
    MutexLock lock(&mu_);
    FinishedRequests out = std::move(finished_);
    finished_ = FinishedRequests();
    return out;
  }

  absl::Status Abort(const std::string& req_id) {
    MutexLock lock(&mu_);
    auto it = requests_.find(req_id);
    if (it == requests_.end()) {
      return absl::NotFoundError(absl::StrCat("request ", req_id, " is not known"));
    }
    AbortLocked(it->second, absl::StrCat("aborted on ", it->second.decode ? "decode" : "prefill"));
    return absl::OkStatus();
  }

  size_t LiveRequests() const {
    MutexLock lock(&mu_);
    return requests_.size();
  }

  std::string StatsJson() const {
    MutexLock lock(&mu_);
    json groups = json::object();
    for (const auto& [name, c] : group_totals_) {
      groups[name] = {{"bytes", c.bytes}, {"ops_before_merge", c.ops_before_merge}, {"ops", c.ops}};
    }
    json j = {{"engine_id", engine_->name()},
              {"live_requests", requests_.size()},
              {"completed", completed_},
              {"failed", failed_},
              {"groups", groups},
              {"requests", recent_}};
    return j.dump();
  }

  std::string StatsPrometheus() const {
    MutexLock lock(&mu_);
    const std::string e = engine_->name();
    std::string out;
    absl::StrAppend(&out, "# TYPE kvwire_connector_requests_total counter\n");
    absl::StrAppend(&out, "kvwire_connector_requests_total{engine=\"", e,
                    "\",outcome=\"completed\"} ", completed_, "\n");
    absl::StrAppend(&out, "kvwire_connector_requests_total{engine=\"", e, "\",outcome=\"failed\"} ",
                    failed_, "\n");
    absl::StrAppend(&out, "# TYPE kvwire_connector_live_requests gauge\n");
    absl::StrAppend(&out, "kvwire_connector_live_requests{engine=\"", e, "\"} ", requests_.size(),
                    "\n");
    absl::StrAppend(&out, "# TYPE kvwire_connector_group_bytes_total counter\n");
    for (const auto& [g, c] : group_totals_) {
      absl::StrAppend(&out, "kvwire_connector_group_bytes_total{engine=\"", e, "\",group=\"", g,
                      "\"} ", c.bytes, "\n");
    }
    absl::StrAppend(&out, "# TYPE kvwire_connector_group_ops_total counter\n");
    for (const auto& [g, c] : group_totals_) {
      absl::StrAppend(&out, "kvwire_connector_group_ops_total{engine=\"", e, "\",group=\"", g,
                      "\",merged=\"false\"} ", c.ops_before_merge, "\n");
      absl::StrAppend(&out, "kvwire_connector_group_ops_total{engine=\"", e, "\",group=\"", g,
                      "\",merged=\"true\"} ", c.ops, "\n");
    }
    absl::StrAppend(&out, "# TYPE kvwire_connector_transfer_seconds_sum counter\n");
    absl::StrAppend(&out, "kvwire_connector_transfer_seconds_sum{engine=\"", e, "\"} ",
                    transfer_seconds_, "\n");
    return out;
  }

 private:
  // --- messages ---------------------------------------------------------------------------

  // Sends `msg` to the peer as the notification of a 1-byte mailbox WRITE. A peer whose data
  // path is still being set up (it just dialed in) gets it from the outbox a little later;
  // messages to one peer keep their order.
  absl::Status SendMessage(PeerId peer, RegionId remote_mailbox, const json& msg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    OutMessage m{peer, remote_mailbox, msg.dump(), absl::Now() + options_.handshake_timeout};
    for (const OutMessage& queued : outbox_) {
      if (queued.peer == peer) {
        outbox_.push_back(std::move(m));
        return absl::OkStatus();
      }
    }
    if (!PeerAlive(peer)) return absl::UnavailableError(absl::StrCat("peer ", peer, " is dead"));
    if (!TrySend(m).ok()) outbox_.push_back(std::move(m));  // retried until its deadline
    return absl::OkStatus();
  }

  struct OutMessage {
    PeerId peer = 0;
    RegionId mailbox = 0;
    std::string payload;
    absl::Time deadline;
  };

  absl::Status TrySend(const OutMessage& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Op op{mailbox_, 0, m.mailbox, 0, 1};
    TransferOptions to;
    to.notification = m.payload;
    to.timeout = options_.handshake_timeout;
    absl::StatusOr<TransferId> id = engine_->Transfer(m.peer, OpKind::kWrite, {&op, 1}, to);
    if (!id.ok()) return id.status();
    message_transfers_.push_back(*id);
    return absl::OkStatus();
  }

  void FlushOutbox() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::set<PeerId> blocked;
    std::vector<OutMessage> keep;
    for (OutMessage& m : outbox_) {
      if (blocked.count(m.peer) == 0) {
        absl::Status s = TrySend(m);
        if (s.ok()) continue;
        if (!PeerAlive(m.peer) || absl::Now() > m.deadline) {
          KVW_LOG(kWarning, kLog) << "message not sent" << Kv("peer", m.peer) << Kv("error", s);
          continue;
        }
        blocked.insert(m.peer);
      }
      keep.push_back(std::move(m));
    }
    outbox_ = std::move(keep);
  }

  json HelloBody() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    json regions = json::array();
    for (const RegionSpan& r : local_regions_) regions.push_back({r.base, r.length, r.id});
    return {{"engine_id", engine_->name()},
            {"mode", KvModeName(options_.mode)},
            {"layout", LayoutToJsonValue(layout_)},
            {"regions", regions},
            {"mailbox", mailbox_}};
  }

  static absl::Status ReadHello(const json& m, Peer* p) {
    try {
      p->engine_id = m.at("engine_id").get<std::string>();
      absl::StatusOr<Layout> layout = LayoutFromJsonValue(m.at("layout"));
      if (!layout.ok()) return layout.status();
      p->layout = std::move(*layout);
      p->regions.clear();
      for (const json& r : m.at("regions")) {
        p->regions.push_back(
            {r.at(0).get<uint64_t>(), r.at(1).get<uint64_t>(), r.at(2).get<uint64_t>()});
      }
      p->mailbox = m.at("mailbox").get<uint64_t>();
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("bad hello: ", e.what()));
    }
    return absl::OkStatus();
  }

  // Decode: connects to the prefill engine at `address` and runs the connector handshake.
  absl::StatusOr<PeerId> EnsurePeer(const std::string& address) {
    {
      MutexLock lock(&mu_);
      auto it = peer_by_address_.find(address);
      if (it != peer_by_address_.end()) {
        Peer& p = peers_[it->second];
        if (p.ready) return p.id;
        if (!p.error.empty()) return absl::FailedPreconditionError(p.error);
      }
    }
    absl::StatusOr<PeerId> peer = engine_->Connect(address);
    if (!peer.ok()) return peer.status();
    const absl::Time deadline = absl::Now() + options_.handshake_timeout;
    RegionId box = 0;
    while (box == 0) {
      absl::StatusOr<std::vector<RemoteRegion>> remote = engine_->RemoteRegions(*peer);
      if (!remote.ok()) return remote.status();
      for (const RemoteRegion& r : *remote) {
        if (r.length == kMailboxBytes) box = r.id;
      }
      if (box != 0) break;
      if (absl::Now() > deadline) {
        return absl::FailedPreconditionError(
            absl::StrCat("peer at ", address, " exports no connector mailbox (not a connector?)"));
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
    if (absl::Status s = engine_->WaitForRemoteRegion(*peer, box, deadline - absl::Now());
        !s.ok()) {
      return s;
    }
    const PeerId id = *peer;
    std::vector<RegionId> regions;
    {
      MutexLock lock(&mu_);
      Peer& p = peers_[id];
      p.id = id;
      p.address = address;
      p.mailbox = box;
      peer_by_address_[address] = id;
      json hello = HelloBody();
      hello["t"] = "hello";
      if (absl::Status s = SendMessage(id, box, hello); !s.ok()) return s;
      while (!p.ready && p.error.empty()) {
        if (!cv_.WaitUntil(&mu_, deadline) && absl::Now() >= deadline) {
          p.error = absl::StrCat("connector handshake with ", address, " timed out");
          break;
        }
      }
      if (!p.ready) {
        peer_by_address_.erase(address);
        return absl::FailedPreconditionError(p.error);
      }
      for (const RegionSpan& r : p.regions) regions.push_back(r.id);
    }
    // Prefill's KV regions become usable here asynchronously.
    for (RegionId r : regions) {
      absl::Status s = engine_->WaitForRemoteRegion(
          id, r, std::max(absl::ZeroDuration(), deadline - absl::Now()));
      if (!s.ok()) return s;
    }
    return id;
  }

  void OnMessage(const Notification& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    json m = json::parse(n.payload, nullptr, false);
    if (m.is_discarded() || !m.is_object()) {
      KVW_LOG(kWarning, kLog) << "ignoring malformed message" << Kv("peer", n.peer);
      return;
    }
    const std::string type = m.value("t", "");
    if (type == "hello") {
      Peer& p = peers_[n.peer];
      p.id = n.peer;
      json reply;
      absl::Status s = ReadHello(m, &p);
      absl::StatusOr<KvMode> mode = KvMode::kAuto;
      if (s.ok()) {
        absl::StatusOr<KvMode> dm = ParseKvMode(m.value("mode", "auto"));
        mode = dm.ok() ? NegotiateKvMode(options_.mode, *dm) : dm;
        if (!mode.ok()) s = mode.status();
      }
      if (s.ok()) s = CheckCompatible(layout_, p.layout);
      if (s.ok()) {
        reply = HelloBody();
        reply["t"] = "hello_ack";
        p.ready = true;
        p.decode_mode = *ParseKvMode(m.value("mode", "auto"));
        p.prefill_mode = options_.mode;
      } else {
        reply = {{"t", "hello_err"}, {"error", std::string(s.message())}};
        KVW_LOG(kWarning, kLog) << "refusing connector peer" << Kv("peer", n.peer)
                                << Kv("error", s);
      }
      if (p.mailbox != 0) (void)SendMessage(n.peer, p.mailbox, reply);
      return;
    }
    if (type == "hello_ack" || type == "hello_err") {
      auto it = peers_.find(n.peer);
      if (it == peers_.end()) return;
      Peer& p = it->second;
      if (type == "hello_err") {
        p.error =
            absl::StrCat("prefill engine refused the connector handshake: ", m.value("error", "?"));
      } else {
        const RegionId box = p.mailbox;
        absl::Status s = ReadHello(m, &p);
        p.mailbox = box;
        if (s.ok()) s = CheckCompatible(p.layout, layout_);
        if (s.ok()) {
          p.ready = true;
          p.decode_mode = options_.mode;
          p.prefill_mode = *ParseKvMode(m.value("mode", "auto"));
        } else {
          p.error = std::string(s.message());
        }
      }
      cv_.SignalAll();
      return;
    }
    const std::string tid = m.value("transfer_id", "");
    if (type == "write_req") {
      OnWriteRequest(n.peer, m);
      return;
    }
    if (type == "release") {
      auto r = FindByTransfer(tid);
      if (r != nullptr && !r->decode && r->mode == KvMode::kRead) {
        if (m.value("ok", true)) {
          CompleteLocked(*r);
        } else {
          FailLocked(*r, absl::StrCat("reader failed: ", m.value("reason", "?")));
        }
      }
      return;
    }
    // Decode side: results of a write-mode load, or prefill stopping.
    for (auto& [id, r] : requests_) {
      if (!r.decode || r.params.transfer_id != tid || r.mode != KvMode::kWrite) continue;
      if (r.state != State::kLoading && r.state != State::kDraining) break;
      if (type == "done" && r.state == State::kLoading && r.fail_reason.empty()) {
        CompleteLocked(r);
      } else if (type == "done" || type == "fail") {
        r.abort_sent = true;  // prefill writes nothing more
        FailLocked(r, r.fail_reason.empty() ? absl::StrCat("prefill: ", m.value("reason", "?"))
                                            : r.fail_reason);
      }
      return;
    }
    if (type == "fail") {
      // Decode aborted a write-mode transfer: stop sending; answer when nothing is in flight.
      Request* r = FindByTransfer(tid);
      if (r != nullptr && !r->decode) AbortLocked(*r, "aborted by decode");
    }
  }

  Request* FindByTransfer(const std::string& tid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto t = by_transfer_.find(tid);
    if (t == by_transfer_.end()) return nullptr;
    auto it = requests_.find(t->second);
    return it == requests_.end() ? nullptr : &it->second;
  }

  void OnWriteRequest(PeerId peer, const json& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::string tid = m.value("transfer_id", "");
    Request* r = FindByTransfer(tid);
    if (r == nullptr) {
      auto gone = retired_transfers_.find(tid);
      if (gone != retired_transfers_.end()) {
        // Failed or aborted here before decode asked: tell it at once.
        RegionId box = 0;
        try {
          box = m.at("mailbox").get<uint64_t>();
        } catch (const json::exception&) {
        }
        auto p = peers_.find(peer);
        if (p != peers_.end()) box = p->second.mailbox;
        if (box != 0) {
          (void)SendMessage(peer, box,
                            json{{"t", "fail"}, {"transfer_id", tid}, {"reason", gone->second}});
        }
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
  void MaybeSendLayersLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
      Account(r);
    }
    for (int layer : r.layers_final) {
      if (r.layers_sent.count(layer) != 0) continue;
      r.layers_sent.insert(layer);
      std::vector<ByteRange> ranges = r.plan->LayerRanges(layer);
      if (ranges.empty()) continue;
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
    }
    cpu.Pause();
    r.cpu_us += cpu_us;
    MaybeFinishSaveLocked(r);
  }

  void MaybeFinishSaveLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (r.state != State::kSaving || !r.plan || !r.transfers.empty()) return;
    for (int layer : r.plan->Layers()) {
      if (r.layers_sent.count(layer) == 0) return;
    }
    json done = {{"t", "done"}, {"transfer_id", r.params.transfer_id}, {"bytes", r.plan->bytes}};
    absl::Status s = SendMessage(*r.peer, peers_[*r.peer].mailbox, done);
    if (!s.ok()) {
      FailLocked(r, absl::StrCat("done notification not sent: ", s.message()));
      return;
    }
    CompleteLocked(r);
  }

  absl::StatusOr<std::vector<Op>> ToOps(const std::vector<ByteRange>& ranges, const Peer& p,
                                        bool local_is_src) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Op> ops;
    ops.reserve(ranges.size());
    for (const ByteRange& br : ranges) {
      const uint64_t local = local_is_src ? br.src : br.dst;
      const uint64_t remote = local_is_src ? br.dst : br.src;
      absl::StatusOr<std::pair<RegionId, uint64_t>> l =
          FindRegion(local_regions_, local, br.length, "local");
      if (!l.ok()) return l.status();
      absl::StatusOr<std::pair<RegionId, uint64_t>> rr =
          FindRegion(p.regions, remote, br.length, "remote");
      if (!rr.ok()) return rr.status();
      ops.push_back({l->first, l->second, rr->first, rr->second, br.length});
    }
    return ops;
  }

  void Account(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const GroupPlan& g : r.plan->groups) {
      GroupCounters& c = r.groups[g.group];
      c.bytes = g.bytes;
      c.ops_before_merge = g.ops_before_merge;
      c.ops = g.ranges.size();
    }
  }

  // Decode: starts one request's load.
  void StartLoad(const std::string& id) {
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
      if (absl::Status s = SendMessage(*peer, p.mailbox, req); !s.ok()) {
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
    for (const GroupPlan& g : r.plan->groups)
      all.insert(all.end(), g.ranges.begin(), g.ranges.end());
    if (all.empty()) {
      CompleteLocked(r);
      return;
    }
    absl::StatusOr<std::vector<Op>> ops = ToOps(all, p, /*local_is_src=*/false);
    if (!ops.ok()) {
      FailLocked(r, std::string(ops.status().message()));
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

  // --- endings ----------------------------------------------------------------------------

  void TellPeer(Request& r, bool ok, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!r.peer) return;
    auto p = peers_.find(*r.peer);
    if (p == peers_.end() || p->second.mailbox == 0 || !PeerAlive(*r.peer)) return;
    json m;
    if (r.decode && r.mode == KvMode::kRead) {
      m = {{"t", "release"}, {"transfer_id", r.params.transfer_id}, {"ok", ok}, {"reason", reason}};
    } else {
      m = {{"t", "fail"}, {"transfer_id", r.params.transfer_id}, {"reason", reason}};
    }
    (void)SendMessage(*r.peer, p->second.mailbox, m);
  }

  void CompleteLocked(Request& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
  void FailLocked(Request& r, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  void AbortLocked(Request& r, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  void Retire(Request& r, const char* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    json groups = json::object();
    for (const auto& [g, c] : r.groups) {
      groups[g] = {{"bytes", c.bytes}, {"ops_before_merge", c.ops_before_merge}, {"ops", c.ops}};
      if (std::string(outcome) == "completed") {
        GroupCounters& t = group_totals_[g];
        t.bytes += c.bytes;
        t.ops_before_merge += c.ops_before_merge;
        t.ops += c.ops;
      }
    }
    if (r.t_first != absl::InfinitePast() && r.t_last != absl::InfinitePast()) {
      transfer_seconds_ += absl::ToDoubleSeconds(r.t_last - r.t_first);
    }
    recent_.push_back({{"request_id", r.id},
                       {"transfer_id", r.params.transfer_id},
                       {"role", r.decode ? "decode" : "prefill"},
                       {"mode", KvModeName(r.mode)},
                       {"outcome", outcome},
                       {"reason", r.fail_reason},
                       {"queue_us", Us(r.t_queued, r.t_first)},
                       {"first_byte_us", Us(r.t_queued, r.t_first)},
                       {"last_byte_us", Us(r.t_queued, r.t_last)},
                       {"connector_cpu_us", r.cpu_us},
                       {"groups", groups}});
    if (recent_.size() > 256) recent_.erase(recent_.begin());
    by_transfer_.erase(r.params.transfer_id);
    cv_.SignalAll();
    const std::string id = r.id;
    requests_.erase(id);  // `r` dies here
  }

  bool PeerAlive(PeerId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return dead_peers_.count(id) == 0;
  }

  // --- progress ---------------------------------------------------------------------------

  void ProgressLoop() {
    absl::Time next_peer_check = absl::Now();
    while (true) {
      absl::StatusOr<Notification> first = engine_->WaitNotification(absl::Milliseconds(2));
      std::vector<Notification> notes;
      if (first.ok()) notes.push_back(std::move(*first));
      for (Notification& n : engine_->TakeNotifications()) notes.push_back(std::move(n));
      for (const Notification& n : notes) WaitForHelloRegions(n);
      std::vector<PeerInfo> peers;
      if (absl::Now() >= next_peer_check) {
        peers = engine_->Peers();
        next_peer_check = absl::Now() + absl::Milliseconds(100);
      }
      MutexLock lock(&mu_);
      if (stop_) return;
      for (const Notification& n : notes) OnMessage(n);
      for (const PeerInfo& p : peers) {
        if (!p.alive && dead_peers_.insert(p.id).second) OnPeerDeath(p);
      }
      FlushOutbox();
      PollTransfers();
      CheckDeadlines();
    }
  }

  // A hello names the regions the sender exported; they become usable here asynchronously,
  // so wait (bounded) before answering.
  void WaitForHelloRegions(const Notification& n) {
    if (n.payload.find("\"hello\"") == std::string::npos) return;
    json m = json::parse(n.payload, nullptr, false);
    if (m.is_discarded() || !m.is_object() || m.value("t", "") != "hello") return;
    const absl::Time deadline = absl::Now() + options_.handshake_timeout;
    std::vector<RegionId> ids;
    try {
      ids.push_back(m.at("mailbox").get<uint64_t>());
      for (const json& r : m.at("regions")) ids.push_back(r.at(2).get<uint64_t>());
    } catch (const json::exception&) {
      return;  // OnMessage reports it
    }
    for (RegionId id : ids) {
      absl::Status s = engine_->WaitForRemoteRegion(
          n.peer, id, std::max(absl::ZeroDuration(), deadline - absl::Now()));
      if (!s.ok()) {
        KVW_LOG(kWarning, kLog) << "hello names a region that never arrived" << Kv("peer", n.peer)
                                << Kv("region", id) << Kv("error", s);
        return;
      }
    }
  }

  void OnPeerDeath(const PeerInfo& info) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    KVW_LOG(kWarning, kLog) << "peer died" << Kv("peer", info.id) << Kv("name", info.name)
                            << Kv("reason", info.close_reason);
    for (auto& [address, id] : peer_by_address_) {
      if (id == info.id) {
        peer_by_address_.erase(address);
        break;
      }
    }
    std::vector<std::string> ids;
    for (auto& [id, r] : requests_) {
      if (r.peer == info.id) ids.push_back(id);
    }
    for (const std::string& id : ids) {
      auto it = requests_.find(id);
      if (it == requests_.end()) continue;
      Request& r = it->second;
      r.abort_sent = true;  // nobody to tell
      FailLocked(r, absl::StrCat("peer ", info.name, " died: ", info.close_reason));
    }
  }

  void PollTransfers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<TransferId> still;
    for (TransferId id : message_transfers_) {
      absl::Status s;
      if (engine_->Poll(id, &s) == TransferState::kPending) still.push_back(id);
    }
    message_transfers_ = std::move(still);
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

  void CheckDeadlines() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    for (auto e = early_writes_.begin(); e != early_writes_.end();) {
      e = e->second.expires < now ? early_writes_.erase(e) : std::next(e);
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
        KVW_LOG(kWarning, kLog) << "lease expired: no release from the reader"
                                << Kv("request", r.id) << Kv("transfer", r.params.transfer_id);
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

  struct EarlyWrite {
    PeerId peer = 0;
    json msg;
    absl::Time expires;
  };

  const ConnectorOptions options_;
  std::unique_ptr<Engine> engine_;
  ShareableBuffer mailbox_buf_;
  RegionId mailbox_ = 0;
  std::thread progress_;
  std::unique_ptr<connector_internal::MetricsServer> metrics_;

  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  Layout layout_ ABSL_GUARDED_BY(mu_);
  std::vector<RegionSpan> local_regions_ ABSL_GUARDED_BY(mu_);
  std::map<PeerId, Peer> peers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, PeerId> peer_by_address_ ABSL_GUARDED_BY(mu_);
  std::set<PeerId> dead_peers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Request> requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> by_transfer_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, EarlyWrite> early_writes_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> retired_early_ ABSL_GUARDED_BY(mu_);
  // Prefill transfers that failed, with the reason, for decodes that ask late.
  std::map<std::string, std::string> retired_transfers_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> retired_order_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pending_loads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pending_saves_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> bound_loads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> bound_saves_ ABSL_GUARDED_BY(mu_);
  std::vector<TransferId> message_transfers_ ABSL_GUARDED_BY(mu_);
  std::vector<OutMessage> outbox_ ABSL_GUARDED_BY(mu_);
  FinishedRequests finished_ ABSL_GUARDED_BY(mu_);
  uint64_t transfer_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
  double transfer_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, GroupCounters> group_totals_ ABSL_GUARDED_BY(mu_);
  json recent_ ABSL_GUARDED_BY(mu_) = json::array();
};

// --- Connector ----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Connector>> Connector::Create(ConnectorOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<Connector>(new Connector(std::move(impl)));
}
Connector::Connector(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Connector::~Connector() = default;
Engine& Connector::engine() { return impl_->engine(); }
const std::string& Connector::engine_id() const { return impl_->engine_id(); }
std::string Connector::metrics_address() const { return impl_->metrics_address(); }
absl::Status Connector::RegisterKvCaches(const Layout& layout,
                                         const std::vector<KvMemory>& memory) {
  return impl_->RegisterKvCaches(layout, memory);
}
absl::StatusOr<MatchResult> Connector::GetNumNewMatchedTokens(const std::string& request_id,
                                                              uint64_t num_tokens,
                                                              uint64_t num_computed_tokens,
                                                              const std::string& params) {
  return impl_->GetNumNewMatchedTokens(request_id, num_tokens, num_computed_tokens, params);
}
absl::Status Connector::UpdateStateAfterAlloc(const std::string& request_id,
                                              const BlockTable& blocks,
                                              uint64_t num_external_tokens) {
  return impl_->UpdateStateAfterAlloc(request_id, blocks, num_external_tokens);
}
std::string Connector::BuildConnectorMeta() { return impl_->BuildConnectorMeta(); }
absl::StatusOr<RequestFinishedResult> Connector::RequestFinished(const std::string& request_id,
                                                                 const BlockTable& blocks,
                                                                 uint64_t num_tokens,
                                                                 const std::string& params,
                                                                 bool aborted) {
  return impl_->RequestFinished(request_id, blocks, num_tokens, params, aborted);
}
absl::Status Connector::BindConnectorMeta(const std::string& meta) {
  return impl_->BindConnectorMeta(meta);
}
absl::Status Connector::StartLoadKv() { return impl_->StartLoadKv(); }
absl::Status Connector::WaitForLayerLoad(int layer) { return impl_->WaitForLayerLoad(layer); }
absl::Status Connector::SaveKvLayer(int layer) { return impl_->SaveKvLayer(layer); }
absl::Status Connector::WaitForSave() { return impl_->WaitForSave(); }
FinishedRequests Connector::GetFinished() { return impl_->GetFinished(); }
absl::Status Connector::Abort(const std::string& request_id) { return impl_->Abort(request_id); }
size_t Connector::LiveRequests() const { return impl_->LiveRequests(); }
std::string Connector::StatsJson() const { return impl_->StatsJson(); }
std::string Connector::StatsPrometheus() const { return impl_->StatsPrometheus(); }

}  // namespace kvwire

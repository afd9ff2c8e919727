// SchedulerHalf (include/kvwire/scheduler_half.h): the connector's scheduler decisions for a
// scheduler process without an engine (vLLM's engine core). What the workers must do goes out
// as JSON each step; each worker replays it on its kvwire::Connector.
#include "kvwire/scheduler_half.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

#include "src/connector/transfer_id.h"
#include "src/util/json_fields.h"

namespace kvwire {

using nlohmann::json;

namespace {

// Python's truth value of a JSON value: kv_transfer_params come from clients, and vLLM's
// connectors test their flags the same way.
bool Truthy(const json* j) {
  if (j == nullptr || j->is_null()) return false;
  if (j->is_boolean()) return j->get<bool>();
  if (j->is_number_float()) return j->get<double>() != 0.0;
  if (j->is_number()) return j->get<int64_t>() != 0;
  if (j->is_string() || j->is_array() || j->is_object()) return !j->empty();
  return false;
}

const json* Field(const json& object, const char* name) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(name);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

std::string StringField(const json& object, const char* name) {
  const json* j = Field(object, name);
  return j != nullptr && j->is_string() ? j->get<std::string>() : "";
}

json Parse(const std::string& text) {
  if (text.empty()) return json::object();
  return json::parse(text, nullptr, /*allow_exceptions=*/false);
}

// num_tokens as an integer (a client may send 5, 5.0, "5" or true), at most `limit`.
absl::StatusOr<int64_t> TokensAtMost(const json& n, int64_t limit) {
  if (n.is_boolean()) return std::min<int64_t>(n.get<bool>() ? 1 : 0, limit);
  if (n.is_number_unsigned()) {
    return n.get<uint64_t>() > static_cast<uint64_t>(limit) ? limit : n.get<int64_t>();
  }
  if (n.is_number_integer()) return std::min(n.get<int64_t>(), limit);
  if (n.is_number_float() && std::isfinite(n.get<double>())) {
    const double d = std::trunc(n.get<double>());
    if (d >= static_cast<double>(limit)) return limit;
    if (d <= static_cast<double>(std::numeric_limits<int64_t>::min())) {
      return std::numeric_limits<int64_t>::min();
    }
    return static_cast<int64_t>(d);
  }
  int64_t v = 0;
  if (n.is_string() && absl::SimpleAtoi(absl::StripAsciiWhitespace(n.get<std::string>()), &v)) {
    return std::min(v, limit);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("num_tokens must be an integer, got ",
                   n.dump(-1, ' ', false, json::error_handler_t::replace)));
}

json TableJson(const BlockTable& t) {
  json j = json::object();
  for (const auto& [group, ids] : t) j[group] = ids;
  return j;
}

}  // namespace

class SchedulerHalf::Impl {
 public:
  explicit Impl(SchedulerHalfOptions o) : o_(std::move(o)) {}

  // Per group, the blocks of `lists` by group name; an error when the counts differ.
  absl::StatusOr<BlockTable> Table(const BlockLists& lists) const {
    if (lists.size() != o_.groups.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(lists.size(), " block lists for ", o_.groups.size(), " KV cache groups"));
    }
    BlockTable t;
    for (size_t i = 0; i < lists.size(); ++i) t[o_.groups[i]] = lists[i];
    return t;
  }

  // remote_block_ids as this engine's block table: the framework's per-group lists (or one
  // flat list for one group) map onto the groups by index; an object by name.
  absl::StatusOr<json> RemoteTable(const json& remote) const {
    if (remote.is_object()) return remote;
    if (!remote.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat("remote_block_ids must be a list or an object, got ", remote.type_name()));
    }
    const bool per_group =
        !remote.empty() &&
        std::all_of(remote.begin(), remote.end(), [](const json& x) { return x.is_array(); });
    json t = json::object();
    if (per_group) {
      if (remote.size() != o_.groups.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(remote.size(), " block lists for ", o_.groups.size(), " KV cache groups"));
      }
      for (size_t i = 0; i < remote.size(); ++i) t[o_.groups[i]] = remote[i];
      return t;
    }
    if (o_.groups.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("remote_block_ids is one flat list but this engine has ", o_.groups.size(),
                       " KV cache groups"));
    }
    t[o_.groups[0]] = remote;
    return t;
  }

  // A decode request's kv_transfer_params as the kvwire JSON its workers load with (what the
  // connector's typed parser accepts), or the reason they cannot be used.
  absl::StatusOr<std::string> LoadParams(const json& params, uint64_t prompt_tokens) const {
    if (!params.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_transfer_params must be an object, got ", params.type_name()));
    }
    json out = json::object();
    for (const auto& [k, v] : params.items()) {
      if (!v.is_null()) out[k] = v;
    }
    out.erase("block_ids");
    const json* remote = Field(params, "remote_block_ids");
    if (remote == nullptr) remote = Field(params, "block_ids");
    if (remote != nullptr) {
      absl::StatusOr<json> t = RemoteTable(*remote);
      if (!t.ok()) return t.status();
      out["remote_block_ids"] = *std::move(t);
    }
    if (const json* given = Field(params, "tp_sources"); Truthy(given)) {
      if (!given->is_array()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tp_sources must be a list, got ", given->type_name()));
      }
      json sources = json::array();
      for (size_t i = 0; i < given->size(); ++i) {
        const json& s = (*given)[i];
        if (!s.is_object()) {
          return absl::InvalidArgumentError(absl::StrCat("tp_sources[", i, "] must be an object"));
        }
        json e = json::object();
        for (const auto& [k, v] : s.items()) {
          if (!v.is_null() && k != "block_ids" && k != "remote_block_ids") e[k] = v;
        }
        const json* rb = Field(s, "block_ids");
        if (rb == nullptr) rb = Field(s, "remote_block_ids");
        if (rb != nullptr) {
          absl::StatusOr<json> t = RemoteTable(*rb);
          if (!t.ok()) return t.status();
          e["remote_block_ids"] = *std::move(t);
        }
        sources.push_back(std::move(e));
      }
      if (!sources.empty()) out["tp_sources"] = std::move(sources);
    }
    const int64_t prompt = static_cast<int64_t>(prompt_tokens);
    if (const json* n = Field(params, "num_tokens"); n != nullptr) {
      absl::StatusOr<int64_t> tokens = TokensAtMost(*n, prompt);
      if (!tokens.ok()) return tokens.status();
      out["num_tokens"] = *tokens;
    } else {
      out["num_tokens"] = prompt;
    }
    out["do_remote_prefill"] = true;
    out["do_remote_decode"] = false;
    std::string text = DumpJson(out);
    // The workers' typed parser: what it refuses fails the load here, before any worker.
    if (absl::StatusOr<KvTransferParams> p = KvTransferParams::FromJson(text); !p.ok()) {
      return p.status();
    }
    return text;
  }

  // Per group, the blocks a load fills: those past the locally computed prefix (whole blocks,
  // which other requests may share), as one sorted list without repeats.
  std::vector<int64_t> OwnBlocks(const BlockLists& lists, uint64_t computed) const {
    const uint64_t skip = computed / std::max<uint64_t>(o_.block_size, 1);
    std::set<int64_t> own;
    for (const std::vector<int64_t>& ids : lists) {
      for (size_t i = skip; i < ids.size(); ++i) own.insert(ids[i]);
    }
    return {own.begin(), own.end()};
  }

  void Log(int level, std::string message) { log_.emplace_back(level, std::move(message)); }

  void Fail(const std::string& id, const std::string& reason, std::vector<int64_t> blocks) {
    failed_.push_back({{"request_id", id}, {"reason", reason}, {"block_ids", std::move(blocks)}});
    loading_[id] = std::nullopt;
  }

  // Decode will not load this hand-off: the workers tell the prefill ranks.
  void Release(const std::string& id, const json& params, uint64_t prompt_tokens,
               const std::string& reason) {
    absl::StatusOr<std::string> text = LoadParams(params, prompt_tokens);
    if (!text.ok()) {
      Log(kWarning, absl::StrCat("kvwire connector: request ", id,
                                 ": cannot tell the prefill to free its blocks (bad "
                                 "kv_transfer_params: ",
                                 text.status().message(), "); its lease will"));
      return;
    }
    releases_.push_back({{"request_id", id}, {"params", *text}, {"reason", reason}});
  }

  void AfterAllocDecode(const std::string& id, uint64_t prompt_tokens, const json& params,
                        const BlockLists& lists, uint64_t num_external) {
    if (!load_started_.insert(id).second) return;  // the second call, after the load
    if (num_external == 0) {
      // A full local prefix hit: nothing to load, and the prefill frees its blocks now rather
      // than at the end of its lease.
      Release(id, params, prompt_tokens, "decode found the prompt in its prefix cache");
      return;
    }
    const uint64_t computed = prompt_tokens > num_external ? prompt_tokens - num_external : 0;
    // Only the blocks this load fills: a local prefix block may be shared.
    std::vector<int64_t> own = OwnBlocks(lists, computed);
    absl::StatusOr<std::string> text = LoadParams(params, prompt_tokens);
    absl::StatusOr<BlockTable> table = text.ok() ? Table(lists) : text.status();
    if (!table.ok()) {
      // Never into the scheduler: the load fails (its blocks reported as failed), and the
      // framework recomputes or fails the request; the blocks are freed.
      const std::string reason = absl::StrCat("bad kv_transfer_params: ", table.status().message());
      Log(kError, absl::StrCat("kvwire connector: request ", id, ": ", reason));
      Fail(id, reason, std::move(own));
      return;
    }
    loads_.push_back({{"request_id", id},
                      {"params", *text},
                      {"blocks", TableJson(*table)},
                      {"num_tokens", prompt_tokens},
                      {"num_computed", computed}});
    loading_[id] = LoadEntry{*std::move(table), prompt_tokens, *std::move(text)};
  }

  void AfterAllocSave(const std::string& id, uint64_t prompt_tokens, uint64_t computed,
                      const json& params, const BlockLists& lists) {
    if (pending_saves_.count(id) != 0 || saving_.count(id) != 0) return;
    if (o_.mode == KvMode::kRead) {
      Log(kError, absl::StrCat("kvwire connector: request ", id,
                               " asks for write mode but this engine is 'read'; no hand-off"));
      return;
    }
    std::string tid = StringField(params, "transfer_id");
    if (tid.empty()) tid = StringField(params, "remote_request_id");
    if (tid.empty()) {
      Log(kError, absl::StrCat("kvwire connector: request ", id,
                               ": write mode without a transfer_id; no hand-off"));
      return;
    }
    absl::StatusOr<BlockTable> table = Table(lists);
    if (!table.ok()) {
      Log(kError, absl::StrCat("kvwire connector: update_state_after_alloc(", id,
                               "): ", table.status().message(), "; no transfer"));
      return;
    }
    const json p = {{"do_remote_decode", true}, {"mode", "write"}, {"transfer_id", tid}};
    pending_saves_[id] = SaveEntry{*std::move(table), prompt_tokens, DumpJson(p), computed};
  }

  struct LoadEntry {
    BlockTable blocks;
    uint64_t num_tokens = 0;
    std::string params;
  };
  struct SaveEntry {
    BlockTable blocks;
    uint64_t num_tokens = 0;
    std::string params;
    uint64_t computed = 0;  // tokens computed before the next step (when the output omits it)
  };

  const SchedulerHalfOptions o_;
  std::map<int, SchedulerWorker> workers_;
  std::set<std::string> load_started_;  // decode requests whose load went to the workers
  // decode request -> its load (nullopt: it failed before it started)
  std::map<std::string, std::optional<LoadEntry>> loading_;
  std::map<std::string, SaveEntry> pending_saves_;  // write mode, not sent yet
  std::map<std::string, SaveEntry> saving_;         // write mode, sent to the workers
  std::map<std::string, std::string> holding_;      // prefill -> transfer id ("": write mode)
  json loads_ = json::array(), saves_ = json::array(), holds_ = json::array(),
       finishes_ = json::array(), failed_ = json::array(), releases_ = json::array();
  std::vector<std::pair<int, std::string>> log_;
};

absl::StatusOr<std::unique_ptr<SchedulerHalf>> SchedulerHalf::Create(SchedulerHalfOptions o) {
  if (o.groups.empty()) return absl::InvalidArgumentError("SchedulerHalf: no KV cache groups");
  if (std::set<std::string>(o.groups.begin(), o.groups.end()).size() != o.groups.size()) {
    return absl::InvalidArgumentError("SchedulerHalf: group names repeat");
  }
  if (o.tp_size < 1) return absl::InvalidArgumentError("SchedulerHalf: tp_size < 1");
  return std::unique_ptr<SchedulerHalf>(new SchedulerHalf(std::make_unique<Impl>(std::move(o))));
}

SchedulerHalf::SchedulerHalf(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SchedulerHalf::~SchedulerHalf() = default;

void SchedulerHalf::SetWorkers(std::map<int, SchedulerWorker> workers) {
  impl_->workers_ = std::move(workers);
}

std::optional<SchedulerWorker> SchedulerHalf::Worker(int rank) const {
  auto it = impl_->workers_.find(rank);
  if (it == impl_->workers_.end()) return std::nullopt;
  return it->second;
}

MatchResult SchedulerHalf::GetNumNewMatchedTokens(const std::string& id, uint64_t prompt_tokens,
                                                  uint64_t computed, const std::string& params) {
  MatchResult r;
  const json p = Parse(params);
  if (!Truthy(Field(p, "do_remote_prefill"))) return r;
  if (impl_->load_started_.count(id) != 0) return r;
  // Everything but the last prompt token in the local prefix cache (vLLM never counts the
  // last one as a hit): vLLM computes that token itself even after a load (it replays it to
  // sample the next), so nothing is loaded and the prefill is told to free its blocks
  // (UpdateStateAfterAlloc with 0 tokens).
  if (prompt_tokens > computed + 1) {
    r.num_external_tokens = prompt_tokens - computed;
    r.load_async = true;
  }
  return r;
}

void SchedulerHalf::UpdateStateAfterAlloc(const std::string& id, uint64_t prompt_tokens,
                                          uint64_t computed, const std::string& params,
                                          const BlockLists& blocks, uint64_t num_external) {
  const json p = Parse(params);
  if (!p.is_object()) return;
  if (Truthy(Field(p, "do_remote_prefill"))) {
    impl_->AfterAllocDecode(id, prompt_tokens, p, blocks, num_external);
  } else if (Truthy(Field(p, "do_remote_decode")) && StringField(p, "mode") == "write") {
    impl_->AfterAllocSave(id, prompt_tokens, computed, p, blocks);
  }
}

std::string SchedulerHalf::BuildConnectorMeta(const SchedulerStep& step) {
  Impl& m = *impl_;
  // Write mode: a save goes to the workers with the step that computes the last prompt chunk
  // (its layers are final at that step's save_kv_layer), with every block the request got
  // since (chunked prefill allocates as it goes).
  for (auto it = m.pending_saves_.begin(); it != m.pending_saves_.end();) {
    const std::string& id = it->first;
    Impl::SaveEntry& e = it->second;
    if (auto nb = step.new_blocks.find(id); nb != step.new_blocks.end()) {
      for (size_t g = 0; g < nb->second.size() && g < m.o_.groups.size(); ++g) {
        std::vector<int64_t>& ids = e.blocks[m.o_.groups[g]];
        ids.insert(ids.end(), nb->second[g].begin(), nb->second[g].end());
      }
    }
    auto n = step.scheduled_tokens.find(id);
    if (n == step.scheduled_tokens.end()) {
      ++it;  // not scheduled this step
      continue;
    }
    auto c = step.computed_tokens.find(id);
    const uint64_t computed = c != step.computed_tokens.end() ? c->second : e.computed;
    if (computed + n->second < e.num_tokens) {
      e.computed = computed + n->second;  // a partial prefill: not final yet
      ++it;
      continue;
    }
    m.saves_.push_back({{"request_id", id},
                        {"blocks", TableJson(e.blocks)},
                        {"num_tokens", e.num_tokens},
                        {"params", e.params}});
    m.saving_[id] = std::move(e);
    it = m.pending_saves_.erase(it);
  }
  json meta = {{"loads", std::move(m.loads_)},   {"saves", std::move(m.saves_)},
               {"holds", std::move(m.holds_)},   {"finishes", std::move(m.finishes_)},
               {"failed", std::move(m.failed_)}, {"releases", std::move(m.releases_)}};
  m.loads_ = m.saves_ = m.holds_ = m.finishes_ = m.failed_ = m.releases_ = json::array();
  return DumpJson(meta);
}

RequestFinishedResult SchedulerHalf::RequestFinished(const std::string& id, uint64_t prompt_tokens,
                                                     const std::string& params_text,
                                                     const BlockLists& lists, bool hands_off,
                                                     bool flat) {
  Impl& m = *impl_;
  RequestFinishedResult out;
  json params = Parse(params_text);
  if (!params.is_object()) params = json::object();
  const bool started = m.load_started_.erase(id) != 0;
  auto loading = m.loading_.find(id);
  if (Truthy(Field(params, "do_remote_prefill")) && !started && loading == m.loading_.end()) {
    // Decode, ended (aborted) before its blocks were allocated: the load never started.
    m.Release(id, params, prompt_tokens, "decode request ended before its load started");
    return out;
  }
  if (loading != m.loading_.end()) {
    // Decode, finished (aborted) before its KV arrived: the workers stop the load and report
    // it received; the scheduler keeps the blocks until then.
    if (loading->second.has_value()) {
      const Impl::LoadEntry& e = *loading->second;
      m.finishes_.push_back({{"request_id", id},
                             {"aborted", true},
                             {"blocks", TableJson(e.blocks)},
                             {"num_tokens", e.num_tokens},
                             {"params", e.params}});
    }
    m.loading_.erase(loading);
    return out;
  }
  if (m.pending_saves_.erase(id) != 0) return out;  // never reached the workers
  if (auto s = m.saving_.find(id); s != m.saving_.end()) {
    m.finishes_.push_back({{"request_id", id},
                           {"aborted", !hands_off},
                           {"blocks", TableJson(s->second.blocks)},
                           {"num_tokens", s->second.num_tokens},
                           {"params", s->second.params}});
    m.saving_.erase(s);
    m.holding_[id] = "";
    out.delay_free = true;
    return out;
  }
  if (!Truthy(Field(params, "do_remote_decode")) || StringField(params, "mode") == "write") {
    return out;
  }
  if (absl::StatusOr<KvTransferParams> in = KvTransferParams::FromJson(DumpJson(params));
      !in.ok()) {
    m.Log(kError, absl::StrCat("kvwire connector: request ", id, ": bad kv_transfer_params: ",
                               in.status().message(), "; no hand-off, blocks freed"));
    return out;
  }
  if (!hands_off) return out;  // aborted or failed: nothing to hand off
  if (m.o_.mode == KvMode::kWrite) {
    m.Log(kError, absl::StrCat("kvwire connector: request ", id,
                               ": read-mode hand-off but this engine is 'write'; blocks freed"));
    return out;
  }
  auto rank0 = m.workers_.find(0);
  if (rank0 == m.workers_.end()) {
    m.Log(kError, absl::StrCat("kvwire connector: request ", id,
                               ": no worker address yet (vLLM has not called "
                               "set_xfer_handshake_metadata); blocks freed"));
    return out;
  }
  absl::StatusOr<BlockTable> table = m.Table(lists);
  if (!table.ok()) {
    m.Log(kError, absl::StrCat("kvwire connector: request_finished(", id,
                               "): ", table.status().message(), "; blocks freed now"));
    return out;
  }
  // Where a worker listens: the configured host, else its handshake's, else its address's.
  auto where = [&](const SchedulerWorker& w) -> absl::StatusOr<std::pair<std::string, int>> {
    const size_t colon = w.address.rfind(':');
    const std::string addr_host = colon == std::string::npos ? "" : w.address.substr(0, colon);
    int port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(w.address.substr(colon + 1), &port)) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker address '", w.address, "' has no port"));
    }
    std::string host = !m.o_.host_ip.empty() ? m.o_.host_ip : !w.host.empty() ? w.host : addr_host;
    return std::make_pair(std::move(host), port);
  };
  absl::StatusOr<std::pair<std::string, int>> at = where(rank0->second);
  if (!at.ok()) {
    m.Log(kError, absl::StrCat("kvwire connector: request_finished(", id,
                               "): ", at.status().message(), "; blocks freed now"));
    return out;
  }
  absl::StatusOr<std::string> tid = connector_internal::RandomTransferId();
  if (!tid.ok()) {
    m.Log(kError, absl::StrCat("kvwire connector: request ", id, ": ", tid.status().message(),
                               "; blocks freed"));
    return out;
  }
  KvTransferParams p;
  p.engine_id = m.o_.engine_id;
  p.host = at->first;
  p.port = at->second;
  p.block_ids = *table;
  p.remote_request_id = id;
  p.transfer_id = *tid;
  p.tp_size = m.o_.tp_size;
  p.mode = KvMode::kRead;
  p.num_tokens = prompt_tokens;
  p.do_remote_prefill = true;
  for (const auto& [rank, w] : m.workers_) {
    if (rank == 0) continue;
    absl::StatusOr<std::pair<std::string, int>> other = where(w);
    if (!other.ok()) {
      m.Log(kError, absl::StrCat("kvwire connector: request_finished(", id, "): rank ", rank, ": ",
                                 other.status().message(), "; blocks freed now"));
      return out;
    }
    p.tp_sources.push_back({w.engine_id, other->first, other->second, *tid, *table});
  }
  json hand_off = json::parse(p.ToJson());
  // Without the hybrid allocator (one group named "0") the framework passed one flat list,
  // and the hand-off carries one, as NIXL's do.
  const bool by_index = m.o_.groups.size() == 1 && m.o_.groups[0] == "0";
  if (flat && by_index && lists.size() == 1) {
    hand_off["remote_block_ids"] = lists[0];
    if (hand_off.contains("tp_sources")) {
      for (json& s : hand_off["tp_sources"]) s["remote_block_ids"] = lists[0];
    }
  }
  out.delay_free = std::any_of(lists.begin(), lists.end(),
                               [](const std::vector<int64_t>& ids) { return !ids.empty(); });
  if (out.delay_free) {
    m.holds_.push_back({{"request_id", id},
                        {"transfer_id", *tid},
                        {"blocks", TableJson(*table)},
                        {"num_tokens", prompt_tokens}});
    m.holding_[id] = *tid;
  }
  out.kv_transfer_params = DumpJson(hand_off);
  return out;
}

void SchedulerHalf::UpdateConnectorOutput(const std::vector<std::string>& finished_recving,
                                          const std::vector<std::string>& finished_sending) {
  for (const std::string& id : finished_recving) impl_->loading_.erase(id);
  for (const std::string& id : finished_sending) impl_->holding_.erase(id);
}

bool SchedulerHalf::PendingPushWork() const {
  return !impl_->pending_saves_.empty() || !impl_->saving_.empty();
}

std::vector<std::pair<int, std::string>> SchedulerHalf::TakeLog() {
  std::vector<std::pair<int, std::string>> out;
  out.swap(impl_->log_);
  return out;
}

std::string SchedulerHalf::StateJson() const {
  const Impl& m = *impl_;
  json loading = json::object();
  for (const auto& [id, e] : m.loading_) loading[id] = e.has_value() ? "loading" : "failed";
  json pending = json::array(), saving = json::array();
  for (const auto& [id, e] : m.pending_saves_) pending.push_back(id);
  for (const auto& [id, e] : m.saving_) saving.push_back(id);
  return DumpJson({{"load_started", m.load_started_},
                   {"loading", std::move(loading)},
                   {"pending_saves", std::move(pending)},
                   {"saving", std::move(saving)},
                   {"holding", m.holding_}});
}

}  // namespace kvwire

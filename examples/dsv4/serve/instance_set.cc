#include "examples/dsv4/serve/instance_set.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/attest.h"
#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/http_client.h"
#include "src/control/hmac.h"
#include "src/discovery/instance.h"
#include "src/util/json_fields.h"
#include "src/util/log.h"
#include "src/util/prometheus_text.h"

namespace dsv4::serve {

using kvwire::Kv;
using nlohmann::json;
namespace discovery = kvwire::discovery;

namespace {
constexpr char kLog[] = "router";
}  // namespace

const char* InstanceKindName(InstanceKind kind) {
  return kind == InstanceKind::kPrefill ? "prefill" : "decode";
}

InstanceSet::Ticket& InstanceSet::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    Release();
    set_ = other.set_;
    server_ = std::move(other.server_);
    other.set_ = nullptr;
  }
  return *this;
}

void InstanceSet::Ticket::Release() {
  if (set_ == nullptr) return;
  kvwire::MutexLock lock(&set_->mu_);
  auto it = set_->instances_.find(server_);
  if (it != set_->instances_.end() && it->second.outstanding > 0) --it->second.outstanding;
  set_ = nullptr;
}

InstanceSet::InstanceSet(InstanceSetOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<InstanceSet>> InstanceSet::Start(InstanceSetOptions options) {
  std::string policy = options.policy;
  if (policy.empty()) policy = options.etcd.empty() ? "round_robin" : "least_loaded";
  if (policy != "round_robin" && policy != "least_loaded") {
    return absl::InvalidArgumentError(
        absl::StrCat("router --policy must be round_robin or least_loaded, not '", policy, "'"));
  }
  std::unique_ptr<InstanceSet> set(new InstanceSet(std::move(options)));
  set->policy_ = policy;
  const InstanceSetOptions& o = set->options_;
  if (o.etcd.empty()) {
    if (!o.cluster.empty()) return absl::InvalidArgumentError("--cluster needs --etcd");
    if (o.prefill.empty() || o.decode.empty()) {
      return absl::InvalidArgumentError(
          "router needs at least one --prefill and one --decode (or --etcd and --cluster)");
    }
    kvwire::MutexLock lock(&set->mu_);
    for (InstanceKind kind : {InstanceKind::kPrefill, InstanceKind::kDecode}) {
      for (const std::string& a : kind == InstanceKind::kPrefill ? o.prefill : o.decode) {
        std::string host;
        int port = 0;
        if (!SplitHostPort(a, &host, &port)) {
          return absl::InvalidArgumentError(absl::StrCat("'", a, "' is not host:port"));
        }
        if (set->instances_.count(a) != 0) {
          // One role per address: a server listed twice would silently lose a role.
          return absl::InvalidArgumentError(
              absl::StrCat("'", a,
                           "' is listed more than once (--prefill and --decode "
                           "servers must be distinct)"));
        }
        Instance& in = set->instances_[a];
        in.kind = kind;
        in.name = a;
        in.order = set->joined_++;
      }
    }
  } else {
    if (!o.prefill.empty() || !o.decode.empty()) {
      return absl::InvalidArgumentError(
          "--etcd discovers the instances: give it without --prefill/--decode");
    }
    if (absl::Status s = discovery::CheckName("--cluster", o.cluster); !s.ok()) return s;
    discovery::EtcdOptions eo = o.etcd_access;
    eo.endpoints = o.etcd;
    eo.call_timeout = discovery::EtcdOptions().call_timeout;
    absl::StatusOr<std::unique_ptr<discovery::EtcdClient>> etcd = discovery::EtcdClient::Create(eo);
    if (!etcd.ok()) return etcd.status();
    // etcd that answers and refuses the credentials is a configuration error, reported at
    // start; etcd unreachable is not (the router follows it once it comes).
    if (absl::Status a = (*etcd)->Authenticate();
        !a.ok() && !absl::IsUnavailable(a) && !absl::IsDeadlineExceeded(a) && !absl::IsAborted(a)) {
      return a;
    }
    absl::StatusOr<std::unique_ptr<discovery::PrefixWatcher>> w = discovery::PrefixWatcher::Start(
        std::move(*etcd), discovery::ClusterPrefix(o.cluster),
        [p = set.get()](const discovery::PrefixWatcher::Snapshot& keys) { p->OnChange(keys); });
    if (!w.ok()) return w.status();
    set->watcher_ = std::move(*w);
    if (o.secret.empty()) {
      KVW_LOG(kWarning, kLog)
          << "no shared secret: instances registered in etcd are routed to as their records "
             "say (whoever can write to etcd can take requests); give the router the "
             "deployment's secret (--secret-file) to require proof of membership";
    }
  }
  set->poller_ = std::thread([p = set.get()] { p->PollLoop(); });
  return set;
}

InstanceSet::~InstanceSet() {
  watcher_.reset();  // no more changes
  {
    kvwire::MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  if (poller_.joinable()) poller_.join();
}

void InstanceSet::OnChange(const discovery::PrefixWatcher::Snapshot& keys) {
  std::map<std::string, Instance> seen;
  for (const auto& [key, value] : keys) {
    absl::StatusOr<discovery::InstanceRecord> r = discovery::InstanceRecord::FromJson(value);
    if (!r.ok()) {
      KVW_LOG(kWarning, kLog) << "ignoring a malformed instance record" << Kv("key", key)
                              << Kv("error", r.status().message());
      continue;
    }
    std::string host;
    int port = 0;
    if (r->role == "both" || !SplitHostPort(r->http_address, &host, &port)) continue;
    Instance in;
    in.kind = r->role == "prefill" ? InstanceKind::kPrefill : InstanceKind::kDecode;
    in.name = r->name;
    in.engine_id = r->name;
    in.role = r->role;
    in.kv_address = r->kv_address;
    in.verified = options_.secret.empty();
    seen[r->http_address] = std::move(in);
  }
  kvwire::MutexLock lock(&mu_);
  for (auto it = instances_.begin(); it != instances_.end();) {
    auto s = seen.find(it->first);
    if (s == seen.end() || s->second.name != it->second.name ||
        s->second.kv_address != it->second.kv_address || s->second.kind != it->second.kind) {
      KVW_LOG(kWarning, kLog) << "instance gone" << Kv("kind", InstanceKindName(it->second.kind))
                              << Kv("name", it->second.name) << Kv("address", it->first);
      ++removed_;
      // Its routing counter goes after forget_after unless it comes back: a series per
      // instance that ever was would grow without bound as instances come and go.
      gone_[{static_cast<int>(it->second.kind), it->second.name}] = absl::Now();
      it = instances_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& [address, in] : seen) {
    if (instances_.count(address) != 0) continue;
    KVW_LOG(kWarning, kLog) << "instance added" << Kv("kind", InstanceKindName(in.kind))
                            << Kv("name", in.name) << Kv("address", address);
    ++added_;
    gone_.erase({static_cast<int>(in.kind), in.name});
    in.order = joined_++;
    instances_[address] = std::move(in);
  }
}

void InstanceSet::PollLoop() {
  while (true) {
    std::vector<std::string> addresses;
    {
      kvwire::MutexLock lock(&mu_);
      const absl::Time until = absl::Now() + options_.poll;
      while (!stop_ && absl::Now() < until) cv_.WaitUntil(&mu_, until);
      if (stop_) return;
      for (const auto& [a, in] : instances_) addresses.push_back(a);
      const absl::Time now = absl::Now();
      for (auto it = gone_.begin(); it != gone_.end();) {
        if (now - it->second < options_.forget_after) {
          ++it;
          continue;
        }
        routed_.erase(it->first);
        it = gone_.erase(it);
      }
    }
    for (const std::string& a : addresses) {
      Instance claim;
      {
        kvwire::MutexLock lock(&mu_);
        auto it = instances_.find(a);
        if (it == instances_.end()) continue;
        claim = it->second;
      }
      if (!claim.verified) {
        absl::Status proof = Verify(a, claim);
        kvwire::MutexLock lock(&mu_);
        auto it = instances_.find(a);
        // Gone, or replaced by another record at the same address meanwhile.
        if (it == instances_.end() || it->second.name != claim.name) continue;
        if (proof.ok()) {
          it->second.verified = true;
          ++verified_;
          KVW_LOG(kInfo, kLog) << "instance proved membership" << Kv("name", claim.name)
                               << Kv("address", a);
        } else if (!it->second.refusal_logged) {
          it->second.refusal_logged = true;
          ++refused_;
          KVW_LOG(kWarning, kLog) << "ignoring an instance that does not prove membership"
                                  << Kv("kind", InstanceKindName(claim.kind))
                                  << Kv("name", claim.name) << Kv("address", a)
                                  << Kv("error", proof.message());
        }
        if (!proof.ok()) continue;
      }
      // A loaded machine may answer slowly: only a failed call (refused, reset, or no answer
      // within a second) marks an instance unreachable.
      absl::StatusOr<json> h = GetJson(a, "/health", absl::Seconds(1));
      int active = -1;
      int64_t free_blocks = -1;
      if (h.ok()) {
        kvwire::JsonFields f(*h, "instance /health");
        active = static_cast<int>(f.OptInt("active_requests", 0, 1 << 20, 0) +
                                  f.OptInt("prefilling", 0, 1 << 20, 0));
        const int64_t total = f.OptInt("total_blocks", 0, INT64_MAX / 2, -1);
        const int64_t used = f.OptInt("used_blocks", 0, INT64_MAX / 2, 0);
        if (total >= 0) free_blocks = std::max<int64_t>(0, total - used);
        if (!f.ok()) active = -1;
      }
      kvwire::MutexLock lock(&mu_);
      auto it = instances_.find(a);
      if (it == instances_.end()) continue;
      it->second.reachable = h.ok();
      it->second.reported_active = active;
      it->second.free_blocks = free_blocks;
    }
  }
}

absl::Status InstanceSet::Verify(const std::string& address, const Instance& claim) const {
  absl::StatusOr<std::string> nonce = kvwire::control::RandomNonce(16);
  if (!nonce.ok()) return nonce.status();
  const std::string nonce_hex = absl::BytesToHexString(*nonce);
  HttpCallOptions o;
  o.deadline = absl::Now() + absl::Seconds(1);
  o.body_limit = 64 << 10;
  absl::StatusOr<HttpResponse> r =
      HttpCall(address, "GET", absl::StrCat(kAttestPath, "?nonce=", nonce_hex), "", o);
  if (!r.ok()) return r.status();
  if (r->status != 200) {
    return absl::PermissionDeniedError(absl::StrCat("its ", kAttestPath, " answered ", r->status));
  }
  absl::StatusOr<json> j = kvwire::ParseJsonObject(r->body, "attestation", {});
  if (!j.ok()) return j.status();
  kvwire::JsonFields f(*j, "attestation");
  const std::string proof = f.String("proof", 256);
  if (!f.ok()) return f.status();
  AttestClaim c;
  c.engine_id = claim.name;
  c.role = claim.role;
  c.http_address = address;
  c.kv_address = claim.kv_address;
  if (!kvwire::control::ConstantTimeEquals(proof, AttestProof(options_.secret, nonce_hex, c))) {
    return absl::PermissionDeniedError(
        "its proof does not match the shared secret and its record (engine id, role, "
        "addresses)");
  }
  return absl::OkStatus();
}

std::vector<std::string> InstanceSet::Order(InstanceKind kind) {
  kvwire::MutexLock lock(&mu_);
  // The map is sorted by address; the rotation starts from the order the instances joined
  // (for a static list: the order on the command line).
  std::vector<std::pair<uint64_t, std::string>> joined;
  for (const auto& [a, in] : instances_) {
    if (in.kind == kind && in.verified) joined.push_back({in.order, a});
  }
  std::sort(joined.begin(), joined.end());
  std::vector<std::string> all;
  all.reserve(joined.size());
  for (auto& [order, a] : joined) all.push_back(std::move(a));
  if (all.empty()) return all;
  const uint64_t start = next_[static_cast<int>(kind)]++;
  std::rotate(all.begin(), all.begin() + static_cast<ptrdiff_t>(start % all.size()), all.end());
  if (policy_ == "least_loaded") {
    // Unreachable ones last; then by load, then by free blocks; ties keep the rotation. The
    // keys are read here, under the lock, so the comparator touches no guarded state.
    std::vector<std::pair<std::tuple<bool, int, int64_t>, std::string>> keyed;
    keyed.reserve(all.size());
    for (std::string& a : all) {
      const Instance& in = instances_.at(a);
      keyed.push_back(
          {{!in.reachable, std::max(in.outstanding, in.reported_active), -in.free_blocks},
           std::move(a)});
    }
    std::stable_sort(keyed.begin(), keyed.end(),
                     [](const auto& x, const auto& y) { return x.first < y.first; });
    for (size_t i = 0; i < keyed.size(); ++i) all[i] = std::move(keyed[i].second);
  }
  return all;
}

InstanceSet::Ticket InstanceSet::Acquire(InstanceKind kind, const std::string& server,
                                         bool count_route) {
  Ticket t;
  kvwire::MutexLock lock(&mu_);
  auto it = instances_.find(server);
  if (it == instances_.end()) return t;
  ++it->second.outstanding;
  if (count_route) ++routed_[{static_cast<int>(kind), it->second.name}];
  t.set_ = this;
  t.server_ = server;
  return t;
}

std::string InstanceSet::EngineId(const std::string& server) {
  kvwire::MutexLock lock(&mu_);
  auto it = instances_.find(server);
  return it == instances_.end() ? "" : it->second.engine_id;
}

std::string InstanceSet::NoneReason(InstanceKind kind) const {
  if (watcher_ == nullptr) return absl::StrCat("no ", InstanceKindName(kind), " server");
  return absl::StrCat("no ", InstanceKindName(kind), " instance registered in etcd cluster '",
                      options_.cluster, "'",
                      watcher_->connected() ? "" : " (etcd unreachable: last known list)");
}

json InstanceSet::Health() {
  kvwire::MutexLock lock(&mu_);
  json out = {{"policy", policy_},
              {"discovery", watcher_ ? "etcd" : "static"},
              {"prefill", json::array()},
              {"decode", json::array()}};
  if (watcher_) {
    out["etcd_connected"] = watcher_->connected();
    out["cluster"] = options_.cluster;
  }
  out["unverified"] = json::array();
  for (const auto& [a, in] : instances_) {
    out[in.verified ? InstanceKindName(in.kind) : "unverified"].push_back(a);
  }
  return out;
}

std::string InstanceSet::Metrics() {
  kvwire::MutexLock lock(&mu_);
  std::string m =
      "# HELP kvwire_dsv4_router_routed_total Requests routed to an instance, by kind, instance "
      "and policy.\n"
      "# TYPE kvwire_dsv4_router_routed_total counter\n";
  for (const auto& [key, n] : routed_) {
    absl::StrAppend(&m, "kvwire_dsv4_router_routed_total{kind=\"",
                    InstanceKindName(static_cast<InstanceKind>(std::get<0>(key))), "\",instance=\"",
                    kvwire::PrometheusLabelValue(std::get<1>(key)), "\",policy=\"", policy_, "\"} ",
                    n, "\n");
  }
  absl::StrAppend(&m,
                  "# HELP kvwire_dsv4_router_instance_outstanding Requests the router has "
                  "outstanding on an instance now.\n",
                  "# TYPE kvwire_dsv4_router_instance_outstanding gauge\n");
  std::string reported =
      "# HELP kvwire_dsv4_router_instance_reported_active Active requests an instance last "
      "reported (its /health; -1: not yet polled).\n"
      "# TYPE kvwire_dsv4_router_instance_reported_active gauge\n";
  std::string free_blocks =
      "# HELP kvwire_dsv4_router_instance_free_blocks Free KV blocks an instance last reported "
      "(its /health; -1: unknown).\n"
      "# TYPE kvwire_dsv4_router_instance_free_blocks gauge\n";
  int count[2] = {0, 0};
  for (const auto& [a, in] : instances_) {
    if (!in.verified) continue;  // not routed to: no series (a forged record makes none)
    ++count[static_cast<int>(in.kind)];
    const std::string labels = absl::StrCat("{kind=\"", InstanceKindName(in.kind), "\",instance=\"",
                                            kvwire::PrometheusLabelValue(in.name), "\"} ");
    absl::StrAppend(&m, "kvwire_dsv4_router_instance_outstanding", labels, in.outstanding, "\n");
    absl::StrAppend(&reported, "kvwire_dsv4_router_instance_reported_active", labels,
                    in.reported_active, "\n");
    absl::StrAppend(&free_blocks, "kvwire_dsv4_router_instance_free_blocks", labels, in.free_blocks,
                    "\n");
  }
  absl::StrAppend(
      &m, reported, free_blocks,
      "# HELP kvwire_dsv4_router_instances Verified instances the router routes to, by kind.\n",
      "# TYPE kvwire_dsv4_router_instances gauge\n",
      "kvwire_dsv4_router_instances{kind=\"prefill\"} ", count[0], "\n",
      "kvwire_dsv4_router_instances{kind=\"decode\"} ", count[1], "\n",
      "# HELP kvwire_dsv4_router_instance_changes_total Instances added to or removed from "
      "the router's set.\n",
      "# TYPE kvwire_dsv4_router_instance_changes_total counter\n",
      "kvwire_dsv4_router_instance_changes_total{change=\"added\"} ", added_, "\n",
      "kvwire_dsv4_router_instance_changes_total{change=\"removed\"} ", removed_, "\n",
      "# HELP kvwire_dsv4_router_instance_proofs_total Instance membership proofs checked, by "
      "outcome.\n",
      "# TYPE kvwire_dsv4_router_instance_proofs_total counter\n",
      "kvwire_dsv4_router_instance_proofs_total{outcome=\"verified\"} ", verified_, "\n",
      "kvwire_dsv4_router_instance_proofs_total{outcome=\"refused\"} ", refused_, "\n");
  if (watcher_) {
    absl::StrAppend(&m,
                    "# HELP kvwire_dsv4_router_etcd_connected 1 while the router's etcd watch is "
                    "connected, else 0.\n",
                    "# TYPE kvwire_dsv4_router_etcd_connected gauge\n",
                    "kvwire_dsv4_router_etcd_connected ", watcher_->connected() ? 1 : 0, "\n");
  }
  return m;
}

}  // namespace dsv4::serve

// Connector and discovery (ConnectorOptions::etcd_endpoints): the engine's registration in
// etcd, and resolving a prefill named by engine id alone.
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "src/connector/connector_impl.h"
#include "src/discovery/instance.h"
#include "src/util/log.h"

namespace kvwire {

absl::Status Connector::Impl::InitDiscovery() {
  // ValidateConnectorOptions (Connector::Create) has checked that the endpoints, the cluster
  // and the credentials go together.
  if (options_.etcd_endpoints.empty()) return absl::OkStatus();
  if (absl::Status s = discovery::CheckName("engine name (for discovery)", engine_->name());
      !s.ok()) {
    return s;
  }
  discovery::EtcdOptions o;
  o.endpoints = options_.etcd_endpoints;
  o.call_timeout = options_.etcd_call_timeout;
  o.user = options_.etcd_user;
  o.password = options_.etcd_password;
  o.ca_file = options_.etcd_ca_file;
  o.cert_file = options_.etcd_cert_file;
  o.key_file = options_.etcd_key_file;
  absl::StatusOr<std::unique_ptr<discovery::EtcdClient>> c = discovery::EtcdClient::Create(o);
  if (!c.ok()) return c.status();
  // etcd's credentials (ConnectorOptions; FromEnvironment's KVWIRE_ETCD_*): etcd that answers
  // and refuses them is a configuration error, reported now; etcd unreachable is not
  // (registration retries until it returns).
  if (absl::Status a = (*c)->Authenticate();
      !a.ok() && !absl::IsUnavailable(a) && !absl::IsDeadlineExceeded(a) && !absl::IsAborted(a)) {
    return a;
  }
  etcd_ = std::move(*c);
  return absl::OkStatus();
}

absl::Status Connector::Impl::Announce(const std::string& http_address) {
  if (etcd_ == nullptr) {
    return absl::FailedPreconditionError(
        "Announce needs ConnectorOptions::etcd_endpoints and cluster");
  }
  discovery::InstanceRecord r;
  r.name = engine_->name();
  r.role = options_.role;
  r.kv_address = engine_->address();
  r.http_address = http_address;
  r.mode = KvModeName(options_.mode);
  r.compat_hash = absl::StrFormat("%016x", engine_->compatibility_hash());
  r.pid = getpid();
  if (options_.engine.transport == "auto") {
    r.transports = {"shm", "tcp"};
  } else {
    r.transports = {options_.engine.transport};
  }
  {
    MutexLock lock(&mu_);
    if (registered_) {
      json groups = json::array();
      uint64_t layers = 0;
      for (const CacheGroup& g : layout_.groups) {
        groups.push_back({{"name", g.name},
                          {"layers", g.layers.size()},
                          {"tokens_per_block", g.tokens_per_block},
                          {"page_bytes", g.page_bytes},
                          {"num_blocks", g.num_blocks}});
        layers = std::max<uint64_t>(layers, g.layers.size());
      }
      r.layout = {{"model", layout_.model}, {"groups", std::move(groups)}};
    }
  }
  discovery::RegistrationOptions ro;
  ro.ttl_seconds = options_.etcd_lease_seconds;
  absl::StatusOr<std::unique_ptr<discovery::Registration>> reg = discovery::Registration::Start(
      etcd_, discovery::InstanceKey(options_.cluster, r.name), r.ToJson(), ro);
  if (!reg.ok()) return reg.status();
  MutexLock lock(&discovery_mu_);
  registration_ = std::move(*reg);  // a second Announce replaces (and first removes) the key
  return absl::OkStatus();
}

bool Connector::Impl::Announced() const {
  MutexLock lock(&discovery_mu_);
  return registration_ != nullptr && registration_->registered();
}

absl::StatusOr<std::string> Connector::Impl::ResolveEngine(const std::string& engine_id) {
  {
    // A peer already connected needs no lookup: transfers with it go on while etcd is away.
    MutexLock lock(&mu_);
    for (const auto& [id, p] : sessions_.peers) {
      if (p.ready && p.engine_id == engine_id) return p.address;
    }
  }
  if (etcd_ == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_transfer_params name prefill engine '", engine_id,
        "' without remote_host/remote_port, and this connector has no discovery (etcd) to "
        "resolve it"));
  }
  if (absl::Status s = discovery::CheckName("engine_id", engine_id); !s.ok()) return s;
  absl::StatusOr<discovery::EtcdRange> r =
      etcd_->Get(discovery::InstanceKey(options_.cluster, engine_id));
  if (!r.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot resolve engine '", engine_id,
                                               "' through etcd: ", r.status().message()));
  }
  if (r->kvs.empty()) {
    return absl::NotFoundError(absl::StrCat("engine '", engine_id,
                                            "' is not registered in cluster '", options_.cluster,
                                            "' (stopped, or its lease expired)"));
  }
  absl::StatusOr<discovery::InstanceRecord> rec =
      discovery::InstanceRecord::FromJson(r->kvs[0].value);
  if (!rec.ok()) return rec.status();
  if (rec->kv_address.empty()) {
    return absl::NotFoundError(absl::StrCat("engine '", engine_id, "' has no control address"));
  }
  KVW_LOG(kDebug, kLog) << "resolved through etcd" << Kv("engine", engine_id)
                        << Kv("address", rec->kv_address);
  return rec->kv_address;
}

absl::Status Connector::Announce(const std::string& http_address) {
  return impl_->Announce(http_address);
}
bool Connector::Announced() const { return impl_->Announced(); }

}  // namespace kvwire

#include "src/discovery/registration.h"

#include "absl/strings/str_cat.h"

#include "src/util/log.h"

namespace kvwire::discovery {

namespace {
constexpr char kLog[] = "discovery";
}  // namespace

absl::StatusOr<std::unique_ptr<Registration>> Registration::Start(std::shared_ptr<EtcdClient> etcd,
                                                                  std::string key,
                                                                  std::string value,
                                                                  RegistrationOptions options) {
  if (etcd == nullptr) return absl::InvalidArgumentError("registration needs an etcd client");
  if (options.ttl_seconds < 2 || options.ttl_seconds > 3600) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease ttl must be 2 to 3600 s, not ", options.ttl_seconds));
  }
  std::unique_ptr<Registration> r(
      new Registration(std::move(etcd), std::move(key), std::move(value), options));
  r->first_attempt_ = r->Register();
  if (!r->first_attempt_.ok()) {
    KVW_LOG(kWarning, kLog) << "cannot register yet; retrying in the background"
                            << Kv("key", r->key_) << Kv("error", r->first_attempt_.message());
  }
  r->thread_ = std::thread([p = r.get()] { p->Loop(); });
  return r;
}

Registration::Registration(std::shared_ptr<EtcdClient> etcd, std::string key, std::string value,
                           RegistrationOptions options)
    : etcd_(std::move(etcd)), key_(std::move(key)), value_(std::move(value)), options_(options) {}

Registration::~Registration() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
  if (lease_ == 0) return;
  // Revoking deletes the key with the lease; should that fail, the key goes by itself.
  absl::Status s = etcd_->Revoke(lease_);
  if (!s.ok()) {
    absl::StatusOr<int64_t> d = etcd_->Delete(key_);
    KVW_LOG(kWarning, kLog) << "could not remove the registration; it expires with its lease"
                            << Kv("key", key_) << Kv("error", s.message())
                            << Kv("ttl_s", options_.ttl_seconds);
    (void)d;
  } else {
    KVW_LOG(kInfo, kLog) << "unregistered" << Kv("key", key_);
  }
}

absl::Status Registration::Register() {
  absl::StatusOr<EtcdLease> lease = etcd_->GrantLease(options_.ttl_seconds);
  if (!lease.ok()) return lease.status();
  absl::StatusOr<int64_t> put = etcd_->Put(key_, value_, lease->id);
  if (!put.ok()) {
    (void)etcd_->Revoke(lease->id);  // best effort; it expires anyway
    return put.status();
  }
  lease_ = lease->id;
  registered_.store(true);
  ++writes_;
  KVW_LOG(kInfo, kLog) << "registered" << Kv("key", key_) << Kv("lease", lease_)
                       << Kv("ttl_s", lease->ttl);
  return absl::OkStatus();
}

void Registration::Loop() {
  // Keep-alives at a third of the TTL: two can fail (a slow member, a leader change) before
  // the lease runs out.
  const absl::Duration period = absl::Seconds(options_.ttl_seconds) / 3;
  bool outage = !first_attempt_.ok();
  while (true) {
    const absl::Duration wait = lease_ == 0 || outage ? options_.retry : period;
    {
      MutexLock lock(&mu_);
      const absl::Time until = absl::Now() + wait;
      while (!stop_ && absl::Now() < until) cv_.WaitUntil(&mu_, until);
      if (stop_) return;
    }
    absl::Status s;
    if (lease_ == 0) {
      s = Register();
    } else {
      absl::StatusOr<EtcdLease> k = etcd_->KeepAlive(lease_);
      s = k.status();
      if (absl::IsNotFound(s)) {
        // Expired while etcd was away (or etcd lost its data): a new lease, the key again.
        KVW_LOG(kWarning, kLog) << "lease lost; registering again" << Kv("key", key_)
                                << Kv("lease", lease_);
        lease_ = 0;
        registered_.store(false);
        s = Register();
      }
    }
    if (s.ok()) {
      if (outage) {
        KVW_LOG(kWarning, kLog) << "etcd reachable again" << Kv("key", key_);
      }
      outage = false;
      registered_.store(true);
    } else {
      registered_.store(false);
      if (!outage) {
        KVW_LOG(kWarning, kLog) << "etcd unavailable; the registration is kept when it returns"
                                << Kv("key", key_) << Kv("error", s.message());
      }
      outage = true;
    }
  }
}

}  // namespace kvwire::discovery

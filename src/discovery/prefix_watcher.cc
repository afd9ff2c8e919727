#include "src/discovery/prefix_watcher.h"

#include "absl/strings/str_cat.h"

#include "src/util/log.h"

namespace kvwire::discovery {

namespace {
constexpr char kLog[] = "discovery";
}  // namespace

absl::StatusOr<std::unique_ptr<PrefixWatcher>> PrefixWatcher::Start(
    std::shared_ptr<EtcdClient> etcd, std::string prefix,
    std::function<void(const Snapshot&)> on_change, PrefixWatcherOptions options) {
  if (etcd == nullptr) return absl::InvalidArgumentError("watcher needs an etcd client");
  if (prefix.empty()) return absl::InvalidArgumentError("watcher needs a prefix");
  std::unique_ptr<PrefixWatcher> w(
      new PrefixWatcher(std::move(etcd), std::move(prefix), std::move(on_change), options));
  w->thread_ = std::thread([p = w.get()] { p->Loop(); });
  return w;
}

PrefixWatcher::PrefixWatcher(std::shared_ptr<EtcdClient> etcd, std::string prefix,
                             std::function<void(const Snapshot&)> on_change,
                             PrefixWatcherOptions options)
    : etcd_(std::move(etcd)),
      prefix_(std::move(prefix)),
      on_change_(std::move(on_change)),
      options_(options) {}

PrefixWatcher::~PrefixWatcher() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  cancel_.Cancel();
  if (thread_.joinable()) thread_.join();
}

PrefixWatcher::Snapshot PrefixWatcher::snapshot() const {
  MutexLock lock(&mu_);
  return keys_;
}

bool PrefixWatcher::Stopping() {
  MutexLock lock(&mu_);
  return stop_;
}

void PrefixWatcher::Publish() {
  if (!on_change_) return;
  Snapshot copy = snapshot();
  try {
    on_change_(copy);
  } catch (const std::exception& e) {  // no exception leaves the thread
    KVW_LOG(kError, kLog) << "watch callback threw" << Kv("error", e.what());
  }
}

void PrefixWatcher::Loop() {
  bool outage = false;
  while (!Stopping()) {
    absl::StatusOr<EtcdRange> range = etcd_->GetPrefix(prefix_);
    absl::Status s = range.status();
    if (s.ok()) {
      ++lists_;
      Snapshot fresh;
      for (EtcdKv& kv : range->kvs) fresh[kv.key] = std::move(kv.value);
      {
        MutexLock lock(&mu_);
        keys_ = std::move(fresh);
      }
      connected_.store(true);
      if (outage) {
        KVW_LOG(kWarning, kLog) << "etcd reachable again" << Kv("prefix", prefix_);
      }
      outage = false;
      Publish();
      int64_t revision = range->revision;
      // Watch sessions until one fails; each resumes after the last revision seen.
      while (!Stopping()) {
        bool relist = false;
        s = etcd_->Watch(
            prefix_, revision + 1, absl::Now() + options_.session,
            [&](const EtcdWatchMessage& m) {
              if (m.compact_revision > 0 || m.canceled) {
                relist = true;
                return false;
              }
              if (m.events.empty()) return true;
              {
                MutexLock lock(&mu_);
                for (const EtcdWatchEvent& e : m.events) {
                  if (e.deleted) {
                    keys_.erase(e.kv.key);
                  } else {
                    keys_[e.kv.key] = e.kv.value;
                  }
                  revision = std::max(revision, e.kv.mod_revision);
                }
              }
              Publish();
              return true;
            },
            &cancel_);
        if (relist) break;
        if (!s.ok()) break;
      }
      if (s.ok()) continue;  // relist (compaction) or stopping
    }
    if (Stopping()) break;
    connected_.store(false);
    if (!outage) {
      KVW_LOG(kWarning, kLog) << "etcd unavailable; keeping the last known instances"
                              << Kv("prefix", prefix_) << Kv("error", s.message());
    }
    outage = true;
    MutexLock lock(&mu_);
    const absl::Time until = absl::Now() + options_.retry;
    while (!stop_ && absl::Now() < until) cv_.WaitUntil(&mu_, until);
  }
}

}  // namespace kvwire::discovery

// A live copy of every key under an etcd prefix: lists it, then follows a watch from the
// listed revision, so a key that appears, changes or goes away (its lease expired, or it was
// deleted) is seen at once. The watch runs in sessions of bounded length (resumed from the
// last revision seen), and after an error or a compaction the prefix is listed again.
//
// While etcd is away the last copy is kept (what was reachable stays usable) and
// `connected()` is false; the callback runs on the watcher's thread after every change.
#ifndef KVWIRE_SRC_DISCOVERY_PREFIX_WATCHER_H_
#define KVWIRE_SRC_DISCOVERY_PREFIX_WATCHER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/discovery/etcd_client.h"
#include "src/util/mutex.h"

namespace kvwire::discovery {

struct PrefixWatcherOptions {
  absl::Duration session = absl::Seconds(20);      // one watch stream, then resumed
  absl::Duration retry = absl::Milliseconds(500);  // after an error
};

class PrefixWatcher {
 public:
  using Snapshot = std::map<std::string, std::string>;  // key -> value
  static absl::StatusOr<std::unique_ptr<PrefixWatcher>> Start(
      std::shared_ptr<EtcdClient> etcd, std::string prefix,
      std::function<void(const Snapshot&)> on_change, PrefixWatcherOptions options = {});
  ~PrefixWatcher();
  PrefixWatcher(const PrefixWatcher&) = delete;
  PrefixWatcher& operator=(const PrefixWatcher&) = delete;

  Snapshot snapshot() const;
  bool connected() const { return connected_.load(); }
  // Times the prefix was listed (1 + one per recovery from an error).
  int64_t lists() const { return lists_.load(); }

 private:
  PrefixWatcher(std::shared_ptr<EtcdClient> etcd, std::string prefix,
                std::function<void(const Snapshot&)> on_change, PrefixWatcherOptions options);
  void Loop();
  bool Stopping();
  void Publish();

  const std::shared_ptr<EtcdClient> etcd_;
  const std::string prefix_;
  const std::function<void(const Snapshot&)> on_change_;
  const PrefixWatcherOptions options_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  Snapshot keys_ ABSL_GUARDED_BY(mu_);
  WatchCancel cancel_;
  std::atomic<bool> connected_{false};
  std::atomic<int64_t> lists_{0};
  std::thread thread_;
};

}  // namespace kvwire::discovery

#endif  // KVWIRE_SRC_DISCOVERY_PREFIX_WATCHER_H_

// The router's prefill and decode instances: fixed (--prefill/--decode host:port) or
// discovered (--etcd URL --cluster NAME: every instance registered under
// /kvwire/<cluster>/instances/ with role prefill or decode and an HTTP address, added and
// removed as their keys come and go, without a restart), and the choice among them:
//   round_robin:  in turn;
//   least_loaded: fewest requests outstanding, where an instance's load is the larger of
//                 what this router has in flight on it and what it reports itself (GET
//                 /health: active_requests + prefilling, polled every poll interval), then
//                 the most free KV blocks (total_blocks - used_blocks), then in turn.
// Every choice is counted per instance and policy in Metrics().
//
// etcd is a directory, not an authority: with the deployment's shared secret (`secret`), a
// discovered instance is routed to only once it has proved it holds the secret (attest.h:
// an HMAC over a fresh nonce and what its record claims, asked on its HTTP port); one that
// cannot is ignored, logged once and counted, and asked again every poll (a real server that
// was still starting is taken once it answers). Without a secret, records are trusted as
// given (logged at start).
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_INSTANCE_SET_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_INSTANCE_SET_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/discovery/etcd_client.h"
#include "src/discovery/prefix_watcher.h"
#include "src/util/mutex.h"

namespace dsv4::serve {

enum class InstanceKind { kPrefill = 0, kDecode = 1 };
const char* InstanceKindName(InstanceKind kind);

struct InstanceSetOptions {
  std::vector<std::string> prefill, decode;  // host:port (without etcd)
  std::string etcd;                          // etcd endpoints; empty: the fixed lists
  std::string cluster;
  // etcd's own authentication and TLS (user, password, CA, client certificate); its
  // endpoints and call timeout are not used.
  kvwire::discovery::EtcdOptions etcd_access;
  std::string
      policy;  // round_robin | least_loaded; empty: least_loaded with etcd, else round_robin
  absl::Duration poll = absl::Milliseconds(250);  // reported load
  // The deployment's shared secret: discovered instances must prove they hold it. Empty:
  // records are trusted.
  std::string secret;
  // How long the routing counter of an instance that left is kept: one that comes back
  // within it (a lease that lapsed on a loaded machine) keeps its count; after it, the series
  // is pruned, so instances that come and go (or forged records) do not grow the metrics.
  absl::Duration forget_after = absl::Seconds(30);
};

class InstanceSet {
 public:
  static absl::StatusOr<std::unique_ptr<InstanceSet>> Start(InstanceSetOptions options);
  ~InstanceSet();
  InstanceSet(const InstanceSet&) = delete;
  InstanceSet& operator=(const InstanceSet&) = delete;

  // Counts one request in flight on an instance while it lives.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept : set_(other.set_), server_(std::move(other.server_)) {
      other.set_ = nullptr;
    }
    Ticket& operator=(Ticket&& other) noexcept;
    ~Ticket() { Release(); }
    void Release();

   private:
    friend class InstanceSet;
    InstanceSet* set_ = nullptr;
    std::string server_;
  };

  // The instances of `kind` (HTTP host:port) in the order to try them; the first is the
  // policy's choice. Empty when none is known.
  std::vector<std::string> Order(InstanceKind kind);
  // Records that a request went to `server` (unless `count_route` is false: a later step of
  // a request already counted) and counts it outstanding until the ticket goes.
  Ticket Acquire(InstanceKind kind, const std::string& server, bool count_route = true);
  // The engine id an instance registered (empty without etcd).
  std::string EngineId(const std::string& server);

  const std::string& policy() const { return policy_; }
  bool discovered() const { return watcher_ != nullptr; }
  // Discovered, and etcd answering now (false with etcd unreachable: the last known list).
  bool directory_reachable() const { return watcher_ != nullptr && watcher_->connected(); }
  // Why there is no instance of `kind` (for the client's error).
  std::string NoneReason(InstanceKind kind) const;
  nlohmann::json Health();
  std::string Metrics();

 private:
  struct Instance {
    InstanceKind kind = InstanceKind::kPrefill;
    std::string name;  // engine id (etcd) or the address
    std::string engine_id;
    int outstanding = 0;
    int reported_active = -1;  // -1: not yet polled
    int64_t free_blocks = -1;
    bool reachable = true;
    // What the record claims (attest.h) and whether the instance proved it: always true
    // for the fixed lists and without a secret.
    std::string role, kv_address;
    bool verified = true;
    bool refusal_logged = false;
    uint64_t order = 0;  // when it joined: round robin follows the order instances were given
  };
  explicit InstanceSet(InstanceSetOptions options);
  void OnChange(const kvwire::discovery::PrefixWatcher::Snapshot& keys);
  void PollLoop();
  // Asks an unverified instance for its proof (no lock held); OK when it holds the secret.
  absl::Status Verify(const std::string& address, const Instance& claim) const;

  const InstanceSetOptions options_;
  std::string policy_;
  std::unique_ptr<kvwire::discovery::PrefixWatcher> watcher_;
  mutable kvwire::Mutex mu_;
  kvwire::CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, Instance> instances_ ABSL_GUARDED_BY(mu_);  // by HTTP address
  // Routing choices: (kind, name, policy) -> count; kept after an instance goes.
  std::map<std::tuple<int, std::string>, uint64_t> routed_ ABSL_GUARDED_BY(mu_);
  // Instances that left, and when: their routed_ series goes after forget_after.
  std::map<std::tuple<int, std::string>, absl::Time> gone_ ABSL_GUARDED_BY(mu_);
  uint64_t added_ ABSL_GUARDED_BY(mu_) = 0, removed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t verified_ ABSL_GUARDED_BY(mu_) = 0, refused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_[2] ABSL_GUARDED_BY(mu_) = {0, 0};
  uint64_t joined_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread poller_;
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_INSTANCE_SET_H_

// Keeps one key in etcd for as long as this object lives: the key is attached to a lease that
// a thread keeps alive, so a process that dies disappears when its lease expires (ttl), and a
// graceful stop (the destructor) revokes the lease, deleting the key at once.
//
// etcd down, slow or restarted: every call has the client's deadline, failures are logged
// (once per outage, with the error), and the thread keeps trying; when etcd answers again the
// lease is kept alive if it survived, else a new one is granted and the key written again.
#ifndef KVWIRE_SRC_DISCOVERY_REGISTRATION_H_
#define KVWIRE_SRC_DISCOVERY_REGISTRATION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/discovery/etcd_client.h"
#include "src/util/mutex.h"

namespace kvwire::discovery {

struct RegistrationOptions {
  int64_t ttl_seconds = 10;                        // the lease; etcd's minimum is about 2 s
  absl::Duration retry = absl::Milliseconds(500);  // between attempts while etcd is away
};

class Registration {
 public:
  // Makes the first attempt before returning (its outcome: first_attempt()), then keeps the
  // key in the background whatever that outcome was.
  static absl::StatusOr<std::unique_ptr<Registration>> Start(std::shared_ptr<EtcdClient> etcd,
                                                             std::string key, std::string value,
                                                             RegistrationOptions options = {});
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  const std::string& key() const { return key_; }
  const absl::Status& first_attempt() const { return first_attempt_; }
  // Whether the key is believed to be in etcd now (the last call succeeded).
  bool registered() const { return registered_.load(); }
  // How many times the key was written (1 + re-registrations after a lost lease).
  int64_t writes() const { return writes_.load(); }

 private:
  Registration(std::shared_ptr<EtcdClient> etcd, std::string key, std::string value,
               RegistrationOptions options);
  absl::Status Register();
  void Loop();

  const std::shared_ptr<EtcdClient> etcd_;
  const std::string key_, value_;
  const RegistrationOptions options_;
  absl::Status first_attempt_;
  int64_t lease_ = 0;  // the loop's thread only (and Start, before it runs)
  std::atomic<bool> registered_{false};
  std::atomic<int64_t> writes_{0};
  Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvwire::discovery

#endif  // KVWIRE_SRC_DISCOVERY_REGISTRATION_H_

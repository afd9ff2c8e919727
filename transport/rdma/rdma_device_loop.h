// One event thread per rdma device: it drains the device's CQ (initiator and target QPs
// share it) into the QPs by QPN, and handles the device's async events.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_DEVICE_LOOP_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_DEVICE_LOOP_H_

#include <cstdint>
#include <memory>
#include <thread>

#include "absl/container/flat_hash_map.h"

#include "src/util/mutex.h"
#include "transport/rdma/rdma_device.h"
#include "transport/rdma/rdma_post_counters.h"
#include "transport/rdma/verbs.h"
#include "transport/transport.h"

namespace kvwire::transport::rdma {

class ClientQp;
class ServerQp;

// Per-device event thread: completions (initiator and target QPs share the device's CQ) and
// async events.
class DeviceLoop {
 public:
  // Starts the event thread.
  DeviceLoop(std::shared_ptr<DevicePort> dev, TargetHooks* hooks, PostCounters* counters);
  ~DeviceLoop() { Stop(); }

  // Stops and joins the event thread (idempotent).
  void Stop();

  void AddClient(uint32_t qpn, std::weak_ptr<ClientQp> qp) {
    MutexLock lock(&mu_);
    clients_[qpn] = std::move(qp);
  }
  void AddServer(uint32_t qpn, std::shared_ptr<ServerQp> qp) {
    MutexLock lock(&mu_);
    servers_[qpn] = std::move(qp);
  }
  void Remove(uint32_t qpn) {
    MutexLock lock(&mu_);
    clients_.erase(qpn);
    servers_.erase(qpn);
  }
  const std::shared_ptr<DevicePort>& device() const { return dev_; }

 private:
  void Run();
  void Drain();
  void Dispatch(const ibv_wc& wc);
  void OnAsyncEvent(const ibv_async_event& event);

  std::shared_ptr<DevicePort> dev_;
  TargetHooks* hooks_;
  PostCounters* counters_;
  int wake_fd_;
  std::thread thread_;
  Mutex mu_;
  absl::flat_hash_map<uint32_t, std::weak_ptr<ClientQp>> clients_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint32_t, std::shared_ptr<ServerQp>> servers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_DEVICE_LOOP_H_

#include "transport/rdma/rdma_device_loop.h"

#include <sys/eventfd.h>

#include <cerrno>
#include <cstring>
#include <poll.h>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "transport/rdma/rdma_client_qp.h"
#include "transport/rdma/rdma_server_qp.h"

namespace kvwire::transport::rdma {

DeviceLoop::DeviceLoop(std::shared_ptr<DevicePort> dev, TargetHooks* hooks, PostCounters* counters)
    : dev_(std::move(dev)),
      hooks_(hooks),
      counters_(counters),
      wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  thread_ = std::thread([this] { Run(); });
}

void DeviceLoop::Stop() {
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  if (wake_fd_ >= 0) close(wake_fd_);
  wake_fd_ = -1;
}

void DeviceLoop::Run() {
  while (true) {
    pollfd p[3] = {
        {dev_->channel->fd, POLLIN, 0}, {dev_->ctx->async_fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const int n = poll(p, 3, 100);
    if (n < 0 && errno != EINTR) {
      KVW_LOG(kError, "rdma") << "event thread poll failed" << Kv("device", dev_->Describe())
                              << Kv("error", std::strerror(errno));
      return;
    }
    if (p[2].revents != 0) return;
    if (p[0].revents != 0) {
      ibv_cq* cq = nullptr;
      void* context = nullptr;
      unsigned events = 0;
      while (verbs().get_cq_event(dev_->channel.get(), &cq, &context) == 0) ++events;
      if (events != 0) verbs().ack_cq_events(dev_->cq.get(), events);
      verbs().req_notify_cq(dev_->cq.get(), 0);
    }
    if (p[1].revents != 0) {
      ibv_async_event event;
      while (verbs().get_async_event(dev_->ctx.get(), &event) == 0) {
        OnAsyncEvent(event);
        verbs().ack_async_event(&event);
      }
    }
    Drain();  // also on timeouts: a missed notification never strands completions
  }
}

void DeviceLoop::Drain() {
  ibv_wc wcs[64];
  while (true) {
    const int n = verbs().poll_cq(dev_->cq.get(), 64, wcs);
    if (n <= 0) {
      if (n < 0) {
        KVW_LOG(kError, "rdma") << "ibv_poll_cq failed" << Kv("device", dev_->Describe());
      }
      return;
    }
    for (int i = 0; i < n; ++i) Dispatch(wcs[i]);
  }
}

void DeviceLoop::Dispatch(const ibv_wc& wc) {
  std::shared_ptr<ClientQp> client;
  std::shared_ptr<ServerQp> server;
  {
    MutexLock lock(&mu_);
    if (auto it = clients_.find(wc.qp_num); it != clients_.end()) client = it->second.lock();
    if (auto it = servers_.find(wc.qp_num); it != servers_.end()) server = it->second;
  }
  if (client) client->OnCompletion(wc);
  if (server) server->OnCompletion(wc, hooks_);
}

void DeviceLoop::OnAsyncEvent(const ibv_async_event& event) {
  const char* what = ibv_event_type_str(event.event_type);
  switch (event.event_type) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_PATH_MIG_ERR: {
      counters_->async_events.fetch_add(1, std::memory_order_relaxed);
      const uint32_t qpn = event.element.qp->qp_num;
      KVW_LOG(kWarning, "rdma") << "async event" << Kv("device", dev_->Describe())
                                << Kv("event", what) << Kv("qpn", qpn);
      std::shared_ptr<ClientQp> client;
      {
        MutexLock lock(&mu_);
        if (auto it = clients_.find(qpn); it != clients_.end()) client = it->second.lock();
      }
      if (client) {
        client->Break(absl::UnavailableError(
            absl::StrCat("async event ", what, " on ", dev_->Describe(), " QP ", qpn)));
      }
      break;
    }
    case IBV_EVENT_CQ_ERR:
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_DEVICE_FATAL: {
      counters_->async_events.fetch_add(1, std::memory_order_relaxed);
      // A port comes back (PORT_ACTIVE); a dead device or a broken CQ does not.
      const bool for_good = event.event_type != IBV_EVENT_PORT_ERR;
      const std::string why = absl::StrCat("async event ", what, " on ", dev_->Describe());
      dev_->MarkDown(why, for_good);
      KVW_LOG(kError, "rdma") << "async event: failing every QP of the device"
                              << Kv("device", dev_->Describe()) << Kv("event", what)
                              << Kv("until", for_good ? "the engine restarts" : "port ACTIVE");
      std::vector<std::shared_ptr<ClientQp>> all;
      {
        MutexLock lock(&mu_);
        for (auto& [qpn, weak] : clients_) {
          if (auto qp = weak.lock()) all.push_back(std::move(qp));
        }
      }
      for (auto& qp : all) qp->Break(absl::UnavailableError(why));
      break;
    }
    case IBV_EVENT_PORT_ACTIVE:
      dev_->MarkUp();
      KVW_LOG(kWarning, "rdma") << "port active again; QPs are re-created on next use"
                                << Kv("device", dev_->Describe());
      break;
    default:
      KVW_LOG(kInfo, "rdma") << "async event" << Kv("device", dev_->Describe())
                             << Kv("event", what);
      break;
  }
}

}  // namespace kvwire::transport::rdma

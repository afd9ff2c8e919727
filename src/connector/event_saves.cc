// Prefill, write mode: SaveKvLayer(layer, event). The engine recorded `event` on its compute
// stream after the layer's KV was written; the connector must not read the blocks before it
// completes, and must block neither the caller nor the compute stream.
//
// One waiter thread (started by the first gated save) takes a FIFO of saves in order: it polls
// the head's event with Runtime::EventDone, backing off from 20 us to 1 ms, and sends the layer
// once the event completed. Polling rather than SynchronizeEvent on the waiter thread:
//  - every wait stays bounded: a blocking synchronize cannot be interrupted, so a request that
//    fails meanwhile (deadline, abort, peer death) or the connector's destruction would wait
//    for the GPU (forever, if the engine never runs that stream again);
//  - the waiter re-checks the head's requests between polls, drops a save whose requests all
//    ended without touching the event again (the engine may destroy it once they ended), and
//    fails the requests when the runtime reports an error for the event;
//  - one thread serves every layer in order, where blocking waits would need a thread per
//    pending event to stay responsive.
// A query costs about a microsecond on CUDA/HIP; the backoff keeps an idle wait to ~1000
// queries a second, and the latency it adds to a layer to under 1 ms.
#include <algorithm>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

absl::Status Connector::Impl::SaveKvLayer(int layer, GpuEvent ready) {
  if (ready.handle == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("SaveKvLayer(", layer, "): the GPU event handle is null"));
  }
  MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const std::string& id : table_.bound_saves) {
    auto it = table_.requests.find(id);
    if (it != table_.requests.end() && it->second.state == State::kSaving) ids.push_back(id);
  }
  if (ids.empty()) return absl::OkStatus();  // nothing reads the layer: no wait
  saves_.queue.push_back({++saves_.queued, layer, ready, std::move(ids)});
  if (!event_waiter_.joinable()) event_waiter_ = std::thread([this] { EventWaitLoop(); });
  waiter_cv_.SignalAll();
  return absl::OkStatus();
}

absl::Status Connector::Impl::WaitForSave() {
  MutexLock lock(&mu_);
  const uint64_t want = saves_.queued;
  // The waiter takes every save by its requests' deadline at the latest (they fail then);
  // the margin covers the progress thread noticing.
  const absl::Time deadline = absl::Now() + options_.request_timeout + options_.handshake_timeout;
  while (saves_.taken < want) {
    if (stop_) return absl::CancelledError("connector shutting down");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          saves_.queued - saves_.taken, " layer saves still wait for their GPU events after ",
          absl::FormatDuration(options_.request_timeout + options_.handshake_timeout)));
    }
    cv_.WaitUntil(&mu_, std::min(deadline, absl::Now() + absl::Milliseconds(50)));
  }
  return absl::OkStatus();
}

void Connector::Impl::EventWaitLoop() {
  absl::Duration backoff = absl::Microseconds(20);
  MutexLock lock(&mu_);
  while (!stop_) {
    if (saves_.queue.empty()) {
      waiter_cv_.WaitUntil(&mu_, absl::Now() + absl::Milliseconds(100));
      continue;
    }
    EventSave& head = saves_.queue.front();
    // Requests that ended (failed, aborted, their peer died) no longer wait for the layer.
    std::vector<std::string> saving;
    for (const std::string& id : head.requests) {
      auto it = table_.requests.find(id);
      if (it != table_.requests.end() && it->second.state == State::kSaving) saving.push_back(id);
    }
    head.requests = std::move(saving);
    bool take = head.requests.empty() || head.event.handle == nullptr;
    if (!take) {
      const GpuEvent event = head.event;
      mu_.Unlock();  // a runtime call: the other threads go on meanwhile
      absl::StatusOr<bool> done = gpu_runtime_->EventDone(event.device, event.handle);
      mu_.Lock();
      if (stop_) return;
      // Only this thread pops: `head` is still the front (push_back keeps references).
      if (!done.ok()) {
        const std::string reason =
            absl::StrCat("layer ", head.layer, ": GPU event: ", done.status().message());
        KVW_LOG(kWarning, kLog) << "layer save failed" << Kv("layer", head.layer)
                                << Kv("error", done.status());
        for (const std::string& id : head.requests) {
          auto it = table_.requests.find(id);
          if (it == table_.requests.end()) continue;
          StepLocked(it->second, Event::kTransferFailed);  // its layer cannot be sent
          FailLocked(it->second, reason);
        }
        head.requests.clear();
        take = true;
      } else {
        take = *done;
      }
    }
    if (!take) {
      waiter_cv_.WaitUntil(&mu_, absl::Now() + backoff);
      backoff = std::min(backoff * 2, absl::Milliseconds(1));
      continue;
    }
    backoff = absl::Microseconds(20);
    EventSave save = std::move(saves_.queue.front());
    saves_.queue.pop_front();
    SaveLayerLocked(save.layer, save.requests);
    saves_.taken = save.seq;
    cv_.SignalAll();    // WaitForSave
    signal_->Notify();  // requests may have changed (failed, sent): their deadlines too
  }
}

}  // namespace kvwire

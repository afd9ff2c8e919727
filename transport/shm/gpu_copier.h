// The device copies of one shm channel. Ops that touch GPU memory (local or the peer's, any
// direction) are runtime copies (CopyAsync) on a stream of the channel: one per local device,
// created on first use, so that a channel's copies never queue behind another channel's. A
// request's copies are followed by an event on each stream it used; a completion thread (one
// per channel, started on first use) waits for those events in posting order and only then
// reports the request, releasing what it held (pins of local regions, mapped peer regions).
//
// Waiting polls the events, so that a request whose transfer ended meanwhile (deadline,
// deregistration, peer death: PostRequest::cancelled) is reported at once. Its memory stays
// held until the device has really finished: a queued copy cannot be taken back. Every wait
// is bounded (kDeviceCopyTimeout): a device that stops making progress fails the request and
// leaves what its copies may still touch allocated (never freed under the device), instead of
// hanging the channel's threads.
#ifndef KVWIRE_TRANSPORT_SHM_GPU_COPIER_H_
#define KVWIRE_TRANSPORT_SHM_GPU_COPIER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/gpu/runtime.h"
#include "src/util/mutex.h"
#include "transport/shm/gpu_imports.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

// How long one request's device copies may run before the device is considered stuck.
inline constexpr absl::Duration kDeviceCopyTimeout = absl::Seconds(60);

class GpuCopier {
 public:
  GpuCopier(gpu::Runtime* runtime, std::shared_ptr<ShmGpuCounters> counters)
      : runtime_(runtime), counters_(std::move(counters)) {}
  // Waits until every queued copy has run and its request was reported.
  ~GpuCopier();
  GpuCopier(const GpuCopier&) = delete;
  GpuCopier& operator=(const GpuCopier&) = delete;

  // The device copies of one request.
  class Batch {
   public:
    bool empty() const { return devices_.empty(); }

   private:
    friend class GpuCopier;
    std::vector<int> devices_;  // streams used, each once
  };

  // Queues one copy on `device`'s stream (any direction: the runtime tells host from device).
  absl::Status Copy(Batch* batch, int device, void* dst, const void* src, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Copy, then waits until `device`'s stream has run it (and everything queued before it).
  absl::Status CopyAndWait(Batch* batch, int device, void* dst, const void* src, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Hands a request whose copies are queued in `batch` to the completion thread: `done` runs
  // there exactly once, with `status` (or the reason given to Fail) after the copies ended, or
  // with Cancelled as soon as `cancelled` is seen set. `keep` is released after the copies
  // ended and before `done` runs (unless done ran early on cancellation).
  void Complete(Batch batch, absl::Status status, std::shared_ptr<std::atomic<bool>> cancelled,
                std::shared_ptr<void> keep, DoneCallback done) ABSL_LOCKS_EXCLUDED(mu_);

  // Requests completed from now on report `reason` (the channel closed).
  void Fail(const absl::Status& reason) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits (up to `timeout`) until every request handed to Complete so far was reported and
  // released what it held. Channel::Close calls it, so that no `done` runs after Close
  // returned (the engine may be tearing down then). A no-op on the completion thread.
  void Drain(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pending {
    std::vector<std::pair<int, void*>> events;  // (device, event)
    absl::Status status;
    std::shared_ptr<std::atomic<bool>> cancelled;
    std::shared_ptr<void> keep;
    DoneCallback done;
    absl::Time deadline = absl::InfiniteFuture();  // for the copies (kDeviceCopyTimeout)
  };

  absl::StatusOr<void*> StreamFor(int device) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<void*> TakeEvent(int device) ABSL_LOCKS_EXCLUDED(mu_);
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for `p`'s events; runs done early (and clears it) if the request is cancelled.
  absl::Status WaitEvents(Pending& p);
  // Waits (bounded) for everything queued on `device`'s `stream`, through a pooled event.
  absl::Status WaitForStream(int device, void* stream) ABSL_LOCKS_EXCLUDED(mu_);

  gpu::Runtime* const runtime_;
  const std::shared_ptr<ShmGpuCounters> counters_;
  Mutex mu_;
  CondVar cv_;
  absl::flat_hash_map<int, void*> streams_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, std::vector<void*>> free_events_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<Pending>> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // the completion thread holds a request
  CondVar drained_;                         // signalled when a request was reported
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // What requests held when their copies did not end in time: kept for the copier's life
  // (and a stream that did not drain is not destroyed), never freed under the device.
  std::vector<std::shared_ptr<void>> stuck_ ABSL_GUARDED_BY(mu_);
  std::thread thread_ ABSL_GUARDED_BY(mu_);  // started by the first Complete
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_GPU_COPIER_H_

#include "transport/shm/gpu_copier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/util/log.h"

namespace kvwire::transport::shm {
namespace {

// Memory that copies which missed their deadline may still touch: held until the process
// exits, never freed under the device.
void KeepUntilExit(std::vector<std::shared_ptr<void>> held) {
  if (held.empty()) return;
  static Mutex mu;
  static std::vector<std::shared_ptr<void>> kept;
  MutexLock lock(&mu);
  for (std::shared_ptr<void>& h : held) kept.push_back(std::move(h));
}

}  // namespace

GpuCopier::~GpuCopier() {
  std::thread thread;
  {
    MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
  absl::flat_hash_map<int, void*> streams;
  {
    MutexLock lock(&mu_);
    streams.swap(streams_);
  }
  for (auto& [device, stream] : streams) {
    if (absl::Status s = WaitForStream(device, stream); !s.ok()) {
      KVW_LOG(kError, "shm") << "device stream did not drain: left allocated"
                             << Kv("device", device) << Kv("status", s);
      continue;
    }
    runtime_->DestroyStream(device, stream);
  }
  MutexLock lock(&mu_);
  KeepUntilExit(std::move(stuck_));
  for (auto& [device, events] : free_events_) {
    for (void* event : events) runtime_->DestroyEvent(device, event);
  }
}

absl::StatusOr<void*> GpuCopier::StreamFor(int device) {
  MutexLock lock(&mu_);
  auto it = streams_.find(device);
  if (it != streams_.end()) return it->second;
  absl::StatusOr<void*> stream = runtime_->CreateStream(device);
  if (!stream.ok()) return stream.status();
  streams_.emplace(device, *stream);
  return *stream;
}

absl::StatusOr<void*> GpuCopier::TakeEvent(int device) {
  {
    MutexLock lock(&mu_);
    std::vector<void*>& events = free_events_[device];
    if (!events.empty()) {
      void* event = events.back();
      events.pop_back();
      return event;
    }
  }
  return runtime_->CreateEvent(device);
}

absl::Status GpuCopier::Copy(Batch* batch, int device, void* dst, const void* src, uint64_t bytes) {
  absl::StatusOr<void*> stream = StreamFor(device);
  if (!stream.ok()) {
    return absl::Status(stream.status().code(),
                        absl::StrCat("creating the device stream: ", stream.status().message()));
  }
  if (std::find(batch->devices_.begin(), batch->devices_.end(), device) == batch->devices_.end()) {
    batch->devices_.push_back(device);
  }
  counters_->device_copies.fetch_add(1, std::memory_order_relaxed);
  return runtime_->CopyAsync(device, dst, src, bytes, *stream);
}

absl::Status GpuCopier::CopyAndWait(Batch* batch, int device, void* dst, const void* src,
                                    uint64_t bytes) {
  if (absl::Status copied = Copy(batch, device, dst, src, bytes); !copied.ok()) return copied;
  absl::StatusOr<void*> stream = StreamFor(device);
  if (!stream.ok()) return stream.status();
  return WaitForStream(device, *stream);
}

absl::Status GpuCopier::WaitForStream(int device, void* stream) {
  absl::StatusOr<void*> event = TakeEvent(device);
  if (!event.ok()) return event.status();
  absl::Status s = gpu::WaitForStream(*runtime_, device, stream, *event,
                                      absl::Now() + kDeviceCopyTimeout, "shm device copies");
  if (s.code() == absl::StatusCode::kDeadlineExceeded) return s;  // the event may still fire
  MutexLock lock(&mu_);
  free_events_[device].push_back(*event);
  return s;
}

void GpuCopier::Complete(Batch batch, absl::Status status,
                         std::shared_ptr<std::atomic<bool>> cancelled, std::shared_ptr<void> keep,
                         DoneCallback done) {
  auto pending = std::make_unique<Pending>();
  pending->status = std::move(status);
  pending->cancelled = std::move(cancelled);
  pending->keep = std::move(keep);
  pending->done = std::move(done);
  pending->deadline = absl::Now() + kDeviceCopyTimeout;
  for (int device : batch.devices_) {
    absl::StatusOr<void*> stream = StreamFor(device);
    absl::StatusOr<void*> event = stream.ok() ? TakeEvent(device) : stream.status();
    absl::Status recorded =
        event.ok() ? runtime_->RecordEvent(device, *event, *stream) : event.status();
    if (recorded.ok()) {
      pending->events.emplace_back(device, *event);
      continue;
    }
    if (event.ok()) runtime_->DestroyEvent(device, *event);
    // Without an event the only way to know the copies ended is to wait for the stream.
    absl::Status drained =
        stream.ok() ? runtime_->SynchronizeStream(device, *stream) : stream.status();
    if (pending->status.ok()) {
      pending->status = absl::Status(
          recorded.code(), absl::StrCat("shm: recording a device event: ", recorded.message()));
    }
    if (!drained.ok()) {
      KVW_LOG(kError, "shm") << "device stream failed" << Kv("device", device)
                             << Kv("status", drained);
    }
  }
  MutexLock lock(&mu_);
  queue_.push_back(std::move(pending));
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
  cv_.Signal();
}

void GpuCopier::Fail(const absl::Status& reason) {
  MutexLock lock(&mu_);
  if (failed_.ok()) failed_ = reason.ok() ? absl::CancelledError("closed") : reason;
}

void GpuCopier::Drain(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  MutexLock lock(&mu_);
  if (thread_.joinable() && thread_.get_id() == std::this_thread::get_id()) return;
  while (!queue_.empty() || busy_) {
    if (absl::Now() >= deadline) {
      KVW_LOG(kError, "shm") << "device copies still running after close"
                             << Kv("requests", queue_.size() + (busy_ ? 1 : 0))
                             << Kv("waited", timeout);
      return;
    }
    drained_.WaitUntil(&mu_, deadline);
  }
}

absl::Status GpuCopier::WaitEvents(Pending& p) {
  int polls = 0;
  absl::Duration nap = absl::Microseconds(10);
  for (const auto& [device, event] : p.events) {
    while (true) {
      absl::StatusOr<bool> finished = runtime_->EventDone(device, event);
      if (!finished.ok()) {
        // Device error: nothing will run on this stream any more.
        return absl::Status(finished.status().code(),
                            absl::StrCat("shm: device copy failed: ", finished.status().message()));
      }
      if (*finished) break;
      if (absl::Now() >= p.deadline) {
        return absl::DeadlineExceededError(absl::StrCat("shm: device copies did not end within ",
                                                        absl::FormatDuration(kDeviceCopyTimeout),
                                                        " on device ", device));
      }
      if (p.done && p.cancelled != nullptr && p.cancelled->load(std::memory_order_acquire)) {
        // The transfer is over for the engine; what the copies hold stays held until they end.
        std::exchange(p.done, nullptr)(
            absl::CancelledError("shm: transfer cancelled while its device copies ran"));
      }
      // Short copies end within microseconds: spin briefly, then back off up to 200 us (a
      // late look delays the report, never the device: later copies are queued already).
      if (++polls < 256) {
        std::this_thread::yield();
      } else {
        absl::SleepFor(nap);
        nap = std::min(nap * 2, absl::Microseconds(200));
      }
    }
  }
  return absl::OkStatus();
}

void GpuCopier::Run() {
  while (true) {
    std::unique_ptr<Pending> p;
    {
      MutexLock lock(&mu_);
      while (queue_.empty() && !stop_) cv_.Wait(&mu_);
      if (queue_.empty()) return;
      p = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    absl::Status waited = WaitEvents(*p);
    const bool stuck = waited.code() == absl::StatusCode::kDeadlineExceeded;
    absl::Status status = p->status.ok() ? std::move(waited) : p->status;
    {
      MutexLock lock(&mu_);
      if (stuck) {
        // The copies may still run: their memory and events are not given back.
        stuck_.push_back(std::move(p->keep));
      } else {
        for (const auto& [device, event] : p->events) free_events_[device].push_back(event);
      }
      if (status.ok() && !failed_.ok()) status = failed_;
    }
    // Unpin before reporting, so that whoever waits for the transfer to end finds its regions
    // released.
    p->keep.reset();
    if (p->done) p->done(std::move(status));
    p.reset();
    MutexLock lock(&mu_);
    busy_ = false;
    drained_.SignalAll();
  }
}

}  // namespace kvwire::transport::shm

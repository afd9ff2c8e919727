#include "transport/tcp/tcp_staging.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_socket.h"

namespace kvwire::transport {
namespace {

absl::Status Staging(const absl::Status& s, const char* what) {
  return absl::Status(s.code(), absl::StrCat("tcp GPU staging: ", what, ": ", s.message()));
}

}  // namespace

// --- StagingBuffers ----------------------------------------------------------------------------

StagingBuffers::~StagingBuffers() {
  gpu::Runtime* rt = staging_.runtime;
  if (rt == nullptr) return;
  // Nothing may still copy into or out of the buffers when they are freed.
  if (absl::Status s = WaitAll(); !s.ok()) {
    KVW_LOG(kError, "tcp") << "staging copies did not end: their pinned buffers and streams are "
                              "left allocated"
                           << Kv("error", s.message());
    return;
  }
  for (const std::unique_ptr<DeviceQueue>& q : queues_) {
    for (void* event : q->events) {
      if (event != nullptr) rt->DestroyEvent(q->device, event);
    }
    if (q->stream != nullptr) rt->DestroyStream(q->device, q->stream);
  }
  for (std::byte* buffer : buffers_) {
    if (buffer != nullptr) rt->FreePinnedHost(buffer);
  }
}

absl::Status StagingBuffers::Init(int device) {
  if (buffers_[1] != nullptr) return absl::OkStatus();
  if (staging_.runtime == nullptr) {
    return absl::FailedPreconditionError(
        "tcp: device memory in an op, but this transport has no GPU runtime");
  }
  for (std::byte*& buffer : buffers_) {
    if (buffer != nullptr) continue;
    absl::StatusOr<void*> p = staging_.runtime->AllocatePinnedHost(device, kStagingChunkBytes);
    if (!p.ok()) {
      return Staging(
          p.status(),
          absl::StrCat("allocating 2 pinned buffers of ", kStagingChunkBytes, " bytes").c_str());
    }
    buffer = static_cast<std::byte*>(*p);
  }
  return absl::OkStatus();
}

absl::StatusOr<StagingBuffers::DeviceQueue*> StagingBuffers::Queue(int device) {
  for (const std::unique_ptr<DeviceQueue>& q : queues_) {
    if (q->device == device) return q.get();
  }
  gpu::Runtime* rt = staging_.runtime;
  auto q = std::make_unique<DeviceQueue>();
  q->device = device;
  absl::StatusOr<void*> stream = rt->CreateStream(device);
  if (!stream.ok()) return Staging(stream.status(), "creating a stream");
  q->stream = *stream;
  for (void*& event : q->events) {
    absl::StatusOr<void*> e = rt->CreateEvent(device);
    if (!e.ok()) {
      for (void* made : q->events) {
        if (made != nullptr) rt->DestroyEvent(device, made);
      }
      rt->DestroyStream(device, q->stream);
      return Staging(e.status(), "creating an event");
    }
    event = *e;
  }
  queues_.push_back(std::move(q));
  return queues_.back().get();
}

absl::Status StagingBuffers::Copy(int device, void* dst, const void* src, size_t bytes) {
  absl::StatusOr<DeviceQueue*> q = Queue(device);
  if (!q.ok()) return q.status();
  if (absl::Status s = staging_.runtime->CopyAsync(device, dst, src, bytes, (*q)->stream);
      !s.ok()) {
    return Staging(s, "queueing a copy");
  }
  (*q)->queued = true;
  if (staging_.staged_bytes != nullptr) {
    staging_.staged_bytes->fetch_add(bytes, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

absl::Status StagingBuffers::Mark(int slot) {
  for (const std::unique_ptr<DeviceQueue>& q : queues_) {
    if (!q->queued) continue;
    if (absl::Status s = staging_.runtime->RecordEvent(q->device, q->events[slot], q->stream);
        !s.ok()) {
      return Staging(s, "recording an event");
    }
    q->queued = false;
    q->marked[slot] = true;
  }
  return absl::OkStatus();
}

absl::Status StagingBuffers::Wait(int slot) {
  for (const std::unique_ptr<DeviceQueue>& q : queues_) {
    if (!q->marked[slot]) continue;
    q->marked[slot] = false;
    if (absl::Status s = gpu::WaitForEvent(*staging_.runtime, q->device, q->events[slot],
                                           absl::Now() + kStagingCopyTimeout, "a staging copy");
        !s.ok()) {
      return Staging(s, "waiting for a copy");
    }
  }
  return absl::OkStatus();
}

absl::Status StagingBuffers::WaitAll() {
  absl::Status first;
  for (const std::unique_ptr<DeviceQueue>& q : queues_) {
    q->marked = {false, false};
    q->queued = false;
    absl::Status s = gpu::WaitForStream(*staging_.runtime, q->device, q->stream, q->events[0],
                                        absl::Now() + kStagingCopyTimeout, "the staging stream");
    if (!s.ok() && first.ok()) first = Staging(s, "waiting for the staging stream");
  }
  return first;
}

// --- StagedSender ------------------------------------------------------------------------------

void StagedSender::Plan(const std::vector<Piece>& pieces) {
  used_ = 0;
  size_t fill = 0;
  auto open = [&] {
    if (used_ == groups_.size()) groups_.emplace_back();
    groups_[used_++].entries.clear();
    fill = 0;
  };
  open();
  for (const Piece& piece : pieces) {
    if (piece.length == 0) continue;
    if (piece.device < 0) {
      groups_[used_ - 1].entries.push_back({piece.data, static_cast<size_t>(piece.length), -1, 0});
      continue;
    }
    uint64_t done = 0;
    while (done < piece.length) {
      if (fill == kStagingChunkBytes) open();
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(piece.length - done, kStagingChunkBytes - fill));
      groups_[used_ - 1].entries.push_back({piece.data + done, n, piece.device, fill});
      fill += n;
      done += n;
    }
  }
}

absl::Status StagedSender::Issue(size_t k) {
  const int slot = static_cast<int>(k % 2);
  std::byte* base = buffers_.buffer(slot);
  Group& g = groups_[k];
  g.iov.clear();
  for (const Entry& e : g.entries) {
    if (e.device < 0) {
      g.iov.push_back({const_cast<std::byte*>(e.data), e.length});
      continue;
    }
    if (absl::Status s = buffers_.Copy(e.device, base + e.offset, e.data, e.length); !s.ok()) {
      return s;
    }
    g.iov.push_back({base + e.offset, e.length});
  }
  return buffers_.Mark(slot);
}

absl::Status StagedSender::Send(int fd, const std::vector<Piece>& pieces) {
  int device = 0;
  for (const Piece& p : pieces) {
    if (p.device >= 0) {
      device = p.device;
      break;
    }
  }
  if (absl::Status s = buffers_.Init(device); !s.ok()) return s;
  Plan(pieces);
  absl::Status s = Issue(0);
  for (size_t k = 0; s.ok() && k < used_; ++k) {
    // Chunk k+1 is copied while chunk k is sent: its buffer held chunk k-1, already sent.
    if (k + 1 < used_) s = Issue(k + 1);
    if (s.ok()) s = buffers_.Wait(static_cast<int>(k % 2));
    if (s.ok() && !groups_[k].iov.empty()) {
      s = SendAll(fd, groups_[k].iov.data(), groups_[k].iov.size());
    }
  }
  if (!s.ok()) {
    // A copy queued for a later chunk may still read the pieces: wait for it.
    if (absl::Status w = buffers_.WaitAll(); !w.ok()) {
      KVW_LOG(kError, "tcp") << "waiting for staging copies failed" << Kv("error", w.message());
    }
  }
  return s;
}

// --- StagedReceiver ----------------------------------------------------------------------------

absl::Status StagedReceiver::WaitSlot(int slot) {
  if (!in_flight_[slot]) return absl::OkStatus();
  in_flight_[slot] = false;
  return buffers_.Wait(slot);
}

absl::Status StagedReceiver::Seal() {
  if (pending_.empty()) return absl::OkStatus();
  // One buffer's copies at a time: the other buffer's ran while this one was received. This
  // also bounds what a cancellation can no longer stop to one buffer's copies.
  if (absl::Status s = WaitSlot(1 - current_); !s.ok()) return s;
  // Checked after that wait (which may be long): nothing is queued once the transfer ended.
  if (cancelled_ != nullptr && cancelled_->load(std::memory_order_acquire)) {
    pending_.clear();
    return absl::CancelledError("receive into device memory cancelled");
  }
  for (const Copy& c : pending_) {
    if (absl::Status s = buffers_.Copy(c.device, c.dst, c.src, c.bytes); !s.ok()) return s;
  }
  pending_.clear();
  if (absl::Status s = buffers_.Mark(current_); !s.ok()) return s;
  in_flight_[current_] = true;
  return absl::OkStatus();
}

absl::Status StagedReceiver::Receive(HeaderReader& reader, int device, std::byte* dst,
                                     uint64_t length, const std::atomic<bool>* cancelled) {
  if (absl::Status s = buffers_.Init(device); !s.ok()) return s;
  cancelled_ = cancelled;
  receiving_ = true;
  absl::Status s;
  while (length > 0) {
    if (fill_ == kStagingChunkBytes) {
      s = Seal();
      if (s.ok()) {
        current_ = 1 - current_;
        fill_ = 0;
        s = WaitSlot(current_);
      }
      if (!s.ok()) break;
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(length, kStagingChunkBytes - fill_));
    std::byte* into = buffers_.buffer(current_) + fill_;
    // Headers after the payload are read ahead only with its last piece.
    s = n == length ? reader.ReadTrailing(into, n, cancelled)
                    : reader.ReadTrailingPart(into, n, cancelled);
    if (absl::IsCancelled(s)) {
      length -= n;  // the reader dropped the rest of this piece
      break;
    }
    if (!s.ok()) break;
    pending_.push_back({device, dst, into, n});
    fill_ += n;
    dst += n;
    length -= n;
  }
  receiving_ = false;
  if (absl::IsCancelled(s)) {
    pending_.clear();
    if (length > 0) {
      if (absl::Status d = reader.DiscardTrailing(length); !d.ok()) return d;
    }
  }
  return s;
}

absl::Status StagedReceiver::Drain() {
  const absl::Status sealed = Seal();
  const absl::Status w0 = WaitSlot(0);
  const absl::Status w1 = WaitSlot(1);
  // Inside Receive (a target's flush before it blocks), bytes are arriving in the buffer.
  if (!receiving_) fill_ = 0;
  if (!sealed.ok()) return sealed;
  return w0.ok() ? w1 : w0;
}

absl::Status StagedReceiver::Abandon() {
  pending_.clear();
  in_flight_ = {false, false};
  if (!receiving_) fill_ = 0;
  return buffers_.WaitAll();
}

}  // namespace kvwire::transport

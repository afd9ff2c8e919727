// GPU memory over tcp: sockets cannot read or write device memory, so its bytes pass through
// page-locked host buffers, copied by the GPU runtime on streams owned by the connection.
//
// Each direction of a connection that meets device memory owns two pinned buffers of
// kStagingChunkBytes (allocated on first use, reused for every op after): while the socket
// sends (or receives) one chunk through one buffer, the runtime copies the next (or the
// previous) chunk through the other. Host memory never comes here: it stays zero-copy.
//
// The runtime is used through its raw calls (gpu::Runtime), not the RAII types of
// src/gpu/runtime.cc, so that kvwire_tcp keeps linking without a GPU backend.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_STAGING_H_
#define KVWIRE_TRANSPORT_TCP_TCP_STAGING_H_

#include <sys/uio.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"

#include "src/gpu/runtime.h"

namespace kvwire::transport {

class HeaderReader;

// One staging buffer. 1 MiB: a writer batch and a staged response flush are 4 MiB, so one
// gather send is 4 chunks and the copy of each but the first overlaps the send of the one
// before; per-chunk costs (a copy launch, an event wait, a sendmsg: ~10-20 us) stay small
// next to the ~100-300 us a MiB takes on the wire; and page-locked memory, which the host
// can neither swap nor move, stays bounded at 2 x 1 MiB per direction and connection (at
// most 4 MiB per lane, 64 MiB for a peer at the maximum of 16 lanes), allocated only by
// connections that meet device memory. It is also the engine's default op size.
inline constexpr size_t kStagingChunkBytes = 1 << 20;
// Staged bytes a writer batch or a target's response flush may hold (4 chunks, see above).
inline constexpr uint64_t kStagedBatchBytes = 4 * kStagingChunkBytes;
// How long a staging copy (at most a few chunks) may take before the device is considered
// stuck: the op fails and the connection closes instead of its thread hanging.
inline constexpr absl::Duration kStagingCopyTimeout = absl::Seconds(30);

// What a connection needs to move device memory: the runtime (null: it refuses) and the
// transport's counter of staged bytes (transport statistic gpu/tcp_staged_bytes).
struct GpuStaging {
  gpu::Runtime* runtime = nullptr;
  std::shared_ptr<std::atomic<uint64_t>> staged_bytes;
};

// The two pinned buffers of one direction, and per device a stream and one event per
// buffer. Used by one thread at a time. Destruction waits (bounded) for queued copies; buffers
// a stuck device may still use are left allocated, never freed under it.
class StagingBuffers {
 public:
  explicit StagingBuffers(GpuStaging staging) : staging_(std::move(staging)) {}
  ~StagingBuffers();
  StagingBuffers(const StagingBuffers&) = delete;
  StagingBuffers& operator=(const StagingBuffers&) = delete;

  // Allocates the buffers on first use, with `device` current (pinned memory belongs to a
  // device's context; a rank using GPU 3 must not create one on GPU 0).
  absl::Status Init(int device);
  std::byte* buffer(int slot) const { return buffers_[slot]; }

  // Queues a copy on `device`'s stream (created on first use) and counts the bytes staged.
  absl::Status Copy(int device, void* dst, const void* src, size_t bytes);
  // Records, for buffer `slot`, every copy queued since the last Mark.
  absl::Status Mark(int slot);
  // Waits until the copies marked for `slot` are done.
  absl::Status Wait(int slot);
  // Waits until every queued copy is done (marked or not).
  absl::Status WaitAll();

 private:
  struct DeviceQueue {
    int device = -1;
    void* stream = nullptr;
    std::array<void*, 2> events = {nullptr, nullptr};
    std::array<bool, 2> marked = {false, false};
    bool queued = false;  // copies queued since the last Mark
  };
  absl::StatusOr<DeviceQueue*> Queue(int device);

  const GpuStaging staging_;
  std::array<std::byte*, 2> buffers_ = {nullptr, nullptr};
  std::vector<std::unique_ptr<DeviceQueue>> queues_;
};

// Sends a gather list whose pieces may lie in device memory: device bytes are copied into the
// pinned buffers chunk by chunk, the copy of chunk i+1 running while chunk i is sent.
class StagedSender {
 public:
  explicit StagedSender(GpuStaging staging) : buffers_(std::move(staging)) {}

  struct Piece {
    const std::byte* data = nullptr;
    uint64_t length = 0;
    int device = -1;  // >= 0: device memory of that device
  };
  // Sends every byte of `pieces` in order, like SendAll. When it returns, no copy reads the
  // pieces any more (also on error).
  absl::Status Send(int fd, const std::vector<Piece>& pieces);

 private:
  // One piece of a group: host bytes sent in place, or device bytes staged at `offset` of
  // the group's buffer.
  struct Entry {
    const std::byte* data;
    size_t length;
    int device;
    size_t offset;
  };
  struct Group {
    std::vector<Entry> entries;
    std::vector<iovec> iov;
  };
  // Cuts `pieces` into groups of at most kStagingChunkBytes device bytes each.
  void Plan(const std::vector<Piece>& pieces);
  // Queues the copies of group `k` into buffer k % 2 and builds its iovecs.
  absl::Status Issue(size_t k);

  StagingBuffers buffers_;
  std::vector<Group> groups_;  // reused across sends
  size_t used_ = 0;            // groups_ in use by the current send
};

// Receives trailing bytes (READ responses, WRITE payloads) destined for device memory: each
// chunk lands in a pinned buffer, and its host->device copy runs while the next chunk is
// received into the other buffer. Copies of a filled buffer are queued when the buffer is
// sealed (full, or Drain), at most one sealed buffer's copies run at a time, and the last
// bytes reach the device only in Drain: call it before the memory is reported written.
class StagedReceiver {
 public:
  explicit StagedReceiver(GpuStaging staging) : buffers_(std::move(staging)) {}

  // Receives `length` trailing bytes from `reader` for `dst` on `device`. With `cancelled`,
  // the flag is checked before every receive (as HeaderReader::ReadTrailing does) and before
  // copies are queued: once set, nothing more is copied to the device, the rest of the bytes
  // are dropped, and the result is Cancelled.
  absl::Status Receive(HeaderReader& reader, int device, std::byte* dst, uint64_t length,
                       const std::atomic<bool>* cancelled);
  // Queues the copies still pending and waits for every copy. Cancelled (and nothing queued)
  // when the flag of the last Receive was set meanwhile.
  absl::Status Drain();
  // Drops the pending copies and waits for those already queued (a failed connection).
  absl::Status Abandon();
  bool has_work() const { return !pending_.empty() || in_flight_[0] || in_flight_[1]; }

 private:
  struct Copy {
    int device;
    std::byte* dst;
    const std::byte* src;
    size_t bytes;
  };
  // Queues the pending copies of the current buffer (after those of the other buffer ended).
  absl::Status Seal();
  absl::Status WaitSlot(int slot);

  StagingBuffers buffers_;
  int current_ = 0;
  size_t fill_ = 0;            // bytes of the current buffer received (committed)
  bool receiving_ = false;     // inside Receive (a Drain from a flush must keep fill_)
  std::vector<Copy> pending_;  // received into the current buffer, not queued yet
  std::array<bool, 2> in_flight_ = {false, false};
  const std::atomic<bool>* cancelled_ = nullptr;
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_STAGING_H_

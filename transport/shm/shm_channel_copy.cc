// ShmChannel's copies through a mapping of the peer's memory: the end-to-end check
// (docs/CHECKSUMS.md) and following the owner when it moves the buffer onto a fresh memfd
// (shareable_registry.h, docs/SECURITY-shm.md).
#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

#include "src/util/crc32c.h"
#include "src/util/fault_injection.h"
#include "src/util/log.h"
#include "transport/shm/shm_channel.h"
#include "transport/shm/shm_channel_internal.h"

namespace kvwire::transport::shm {

absl::Status ShmChannel::CopyChecked(const PostRequest& request, size_t index, std::byte* dst,
                                     const std::byte* src) {
  const uint64_t length = request.ops[index].length;
  const bool verify = link_.verify_checksums;
  const uint32_t source_crc = verify ? Crc32c(src, length) : 0;
  std::memcpy(dst, src, length);
  fault_injection::MaybeFlipPayloadByte(fault_injection::Site::kShm, dst, length);
  if (!verify) return absl::OkStatus();
  const uint32_t landed_crc = Crc32c(dst, length);
  if (landed_crc == source_crc) return absl::OkStatus();
  KVW_LOG(kWarning, "shm") << "checksum mismatch" << Kv("transfer", request.transfer_id)
                           << Kv("op", index) << Kv("peer", link_.peer_name);
  return OpError(request, index, absl::StatusCode::kDataLoss,
                 absl::StrFormat("with peer %s: end-to-end checksum mismatch (CRC32C of the "
                                 "source 0x%08x, of the destination after the copy 0x%08x)",
                                 link_.peer_name, source_crc, landed_crc));
}

absl::Status ShmChannel::CopyMapped(const PostRequest& request, size_t index,
                                    std::shared_ptr<const RemoteRegion>* region) {
  const WireOp& op = request.ops[index];
  // Moves are followed within one request timeout, set at the first (not paid per op).
  absl::Time deadline = absl::InfiniteFuture();
  for (int remaps = 0;; ++remaps) {
    const RemoteRegion& mapped = **region;
    const uint64_t before = LoadEpoch(mapped.epoch_word);
    if (before == mapped.epoch) {
      std::byte* remote = mapped.mapping.data() + op.remote_offset;
      const bool write = request.kind == OpKind::kWrite;
      const absl::Status copied =
          CopyChecked(request, index, write ? remote : op.local, write ? op.local : remote);
      // Pairs with the fence after the owner's first store (shareable_registry.cc): either
      // its copy saw these bytes, or this load sees the word change.
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (__atomic_load_n(mapped.epoch_word, __ATOMIC_RELAXED) == before) return copied;
    }
    if (remaps == 0) deadline = absl::Now() + options_.request_timeout;
    if (absl::Now() > deadline) {
      return OpError(
          request, index, absl::StatusCode::kDeadlineExceeded,
          absl::StrCat("the peer moved the region's buffer ", remaps, " times in ",
                       absl::FormatDuration(options_.request_timeout), " during one copy"));
    }
    absl::StatusOr<std::shared_ptr<const RemoteRegion>> moved = Remap(*region);
    if (!moved.ok()) {
      return OpError(request, index, moved.status().code(), moved.status().message());
    }
    *region = *std::move(moved);
  }
}

absl::StatusOr<std::shared_ptr<const ShmChannel::RemoteRegion>> ShmChannel::Remap(
    const std::shared_ptr<const RemoteRegion>& stale) {
  {
    // Another thread may have mapped the new memfd already.
    std::shared_ptr<const RemoteRegion> current = Find(stale->id);
    if (current != nullptr && current != stale && current->mapped &&
        LoadEpoch(current->epoch_word) == current->epoch) {
      return current;
    }
  }
  absl::StatusOr<std::shared_ptr<const RemoteRegion>> fresh = MapShareable(stale->desc);
  if (!fresh.ok()) return fresh.status();
  // Pinned by a device since it was mapped: served copies from now on (ops still queued
  // against the mapping fail below, named; later requests find the served region).
  const bool now_served = (*fresh)->served;
  std::shared_ptr<const RemoteRegion> replaced;  // unmapped outside the lock
  MutexLock lock(&mu_);
  if (closed_.load(std::memory_order_relaxed)) return ClosedError();
  auto it = regions_.find(stale->id);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("shm: region ", stale->id, " was removed while it was being remapped"));
  }
  // Replace only what this call found stale: a removal and re-add meanwhile stays as it is.
  if (it->second == stale) replaced = std::exchange(it->second, *fresh);
  if (now_served) {
    return absl::UnavailableError(absl::StrCat(
        "shm: region ", stale->id,
        " moved and is now reached through served copies (its pages were pinned meanwhile); "
        "this op was not done"));
  }
  return fresh;
}

}  // namespace kvwire::transport::shm

// Process-wide registry of live ShareableBuffers, so that the engine can tell whether memory
// handed to RegisterMemory is memfd-backed (and which memfd, at which offset) without the
// caller saying so; and revocation of a buffer from the peers that mapped it.
//
// Revocation (RebackShareable): Linux cannot take a mapping back from another process, so the
// owner moves instead. The buffer's current bytes are copied into a fresh memfd, which is
// mapped MAP_FIXED over the owner's range: the owner keeps its bytes at the same addresses,
// and the memfd a peer mapped is no longer the owner's memory (the peer's later writes and
// the owner's later writes no longer meet). The fresh memfd takes the old one's descriptor
// number (dup3), so ShareableBuffer::fd() and every lookup here name it from then on.
//
// Peers that still hold a legitimate export notice the move through the epoch table: one
// 64-bit word per buffer that has been shared (a slot), in a memfd every peer maps read-only
// (fd_protocol.h: the Hello reply carries it). A fetch reply names the buffer's slot and the
// word's value for the memfd it carries. The owner stores a new value before it copies and
// another after the move; a peer compares the word with its mapping's value before each copy
// and again after it (with a full fence on both sides, so either the owner's copy saw the
// peer's bytes or the peer sees the new value), and on a change fetches the new memfd and
// redoes the copy. Values are never reused (one process-wide counter), so a slot that was
// freed and given to another buffer never matches a stale mapping either.
#ifndef KVWIRE_TRANSPORT_SHM_SHAREABLE_REGISTRY_H_
#define KVWIRE_TRANSPORT_SHM_SHAREABLE_REGISTRY_H_

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "transport/shm/unique_fd.h"

namespace kvwire::transport {

// Where a range of host memory lives inside a ShareableBuffer's memfd.
struct ShareableBacking {
  int fd = -1;          // owned by the ShareableBuffer: valid while it lives
  uint64_t offset = 0;  // offset of the range's first byte within the memfd
  uint64_t buffer =
      0;  // which buffer (never reused): tells a buffer from a later one at its address
};

// Returns the backing of [ptr, ptr + length) if the whole range lies inside one live
// ShareableBuffer (length 0: ptr inside one), else nullopt. Thread-safe.
std::optional<ShareableBacking> FindShareable(const void* ptr, size_t length);

namespace shm {

// Slots in the epoch table (8 bytes each): buffers shared with peers at once.
inline constexpr uint32_t kEpochSlots = 1u << 16;
inline constexpr uint32_t kNoEpochSlot = UINT32_MAX;
inline constexpr uint64_t kEpochTableBytes = uint64_t{kEpochSlots} * sizeof(uint64_t);

// A duplicate of the memfd behind [ptr, ptr + length), taken under the registry's lock (so
// the descriptor is the buffer's current memfd, never one being closed or moved).
struct ShareableDup {
  UniqueFd fd;
  uint64_t offset = 0;  // of the range within the memfd
  uint64_t size = 0;    // of the whole memfd
  uint32_t epoch_slot = kNoEpochSlot;
  uint64_t epoch = 0;  // the slot's value for this memfd
};

// nullopt when the range is not inside one live buffer, or (`buffer` not 0) that buffer is not
// ShareableBacking::buffer. With `with_epoch` the buffer gets an epoch slot if it has none
// (ResourceExhausted when all are taken).
absl::StatusOr<std::optional<ShareableDup>> DupShareable(const void* ptr, size_t length,
                                                         uint64_t buffer, bool with_epoch);

// Whether a move must hold the owner's own writes off (write_guard.h).
enum class MoveGuard {
  // Guarded where the guard works, else moved anyway (Unexport, DeregisterMemory: the
  // application chose the moment).
  kIfAvailable,
  // Not moved without the guard (a peer's close: a moment the application does not choose).
  kRequired,
};

// Moves the live buffer that contains `ptr` onto a fresh memfd (see the top of this file);
// its bytes stay the owner's, at the same addresses. The owner's threads that write into the
// buffer while this runs wait in the kernel until the move is over, then write into the new
// memfd (WriteGuard); without the guard (kIfAvailable where it does not work) such writes may
// land in the old memfd and be lost. Writes the kernel makes without a fault (a device's DMA,
// pages pinned by io_uring) are not held: the caller quiesces what it can. NotFound when no
// live buffer contains `ptr`; FailedPrecondition (not moved) when a device pinned part of it
// (src/util/pinned_ranges.h), or kRequired and the guard could not be armed. Thread-safe; a
// ShareableBuffer being destroyed meanwhile waits for it. Never call it from a thread that
// writes into the buffer in between: nothing here does.
absl::Status RebackShareable(const void* ptr, MoveGuard guard = MoveGuard::kIfAvailable);

// The whole live buffer that contains `ptr` (its base and size); nullopt if none.
struct ShareableRange {
  std::byte* base = nullptr;
  size_t size = 0;
};
std::optional<ShareableRange> FindShareableRange(const void* ptr);

// How many RebackShareable calls completed, and how many of them with the owner's writes held
// off by the write guard (tests and logs).
uint64_t RebackCount();
uint64_t GuardedRebackCount();

// The epoch table's descriptor (sealed: no holder can write it, the owner's mapping can), to
// hand to peers; created on first use. Valid for the process's life.
absl::StatusOr<int> EpochTableFd();

// Called by ShareableBuffer only: [base, base + size) is backed by `fd` from offset 0.
void RegisterShareable(const void* base, size_t size, int fd);
void UnregisterShareable(const void* base);
}  // namespace shm

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_SHM_SHAREABLE_REGISTRY_H_

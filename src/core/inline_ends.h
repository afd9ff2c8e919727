// The ends of transfers that finished inside Engine::Transfer, before their id was handed out
// (a one-op shm host copy: Capabilities::ends_host_ops_inline), kept for Wait and Poll outside
// the TransferTable (issue 24: the table's insert, lookup and erase, each under its lock, were
// ~750 of a one-op Transfer's ~2,900 instructions).
//
// A fixed ring of slots indexed by the id, each claimed and released with one atomic: Put
// fills a free slot (false when it is taken: the caller keeps the end in the table instead),
// Take empties the slot of its id once. Ids are never reused (Engine::Impl numbers them from
// one counter), so a slot's tag names one transfer only; a Take for an id that is not in its
// slot (not inline, taken already, or never issued) answers false and the caller asks the table.
#ifndef KVWIRE_CORE_INLINE_ENDS_H_
#define KVWIRE_CORE_INLINE_ENDS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"

#include "kvwire/engine.h"

namespace kvwire::core {

class InlineEnds {
 public:
  // Records the end of transfer `id` (never 0, not handed out yet). False when its slot holds
  // another transfer's end nobody took yet, or a Take is reading it: the caller records the
  // end elsewhere.
  bool Put(TransferId id, absl::Status status) {
    Slot& slot = slots_[id % kSlots];
    uint64_t expected = kFree;
    if (!slot.tag.compare_exchange_strong(expected, kBusy, std::memory_order_acquire,
                                          std::memory_order_relaxed)) {
      return false;
    }
    slot.status = std::move(status);
    slot.tag.store(id, std::memory_order_release);
    return true;
  }

  // The end of `id` if this ring holds it: true once, with *status set (when not null); the
  // slot is free again afterwards.
  bool Take(TransferId id, absl::Status* status) {
    Slot& slot = slots_[id % kSlots];
    uint64_t expected = id;
    // The load first: most Takes of ids not here (transfers that did not end inline) cost a
    // read, not a locked instruction.
    if (slot.tag.load(std::memory_order_relaxed) != id ||
        !slot.tag.compare_exchange_strong(expected, kBusy, std::memory_order_acquire,
                                          std::memory_order_relaxed)) {
      return false;
    }
    if (status != nullptr) *status = std::move(slot.status);
    slot.status = absl::OkStatus();
    slot.tag.store(kFree, std::memory_order_release);
    return true;
  }

  static constexpr size_t kSlots = 64;

 private:
  static constexpr uint64_t kFree = 0;  // ids start at 1
  static constexpr uint64_t kBusy = ~uint64_t{0};
  struct alignas(64) Slot {
    std::atomic<uint64_t> tag{kFree};  // kFree, kBusy (being filled or taken), or the id
    absl::Status status;
  };
  std::array<Slot, kSlots> slots_;
};

}  // namespace kvwire::core

#endif  // KVWIRE_CORE_INLINE_ENDS_H_

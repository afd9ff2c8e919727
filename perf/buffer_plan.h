// Where each op of a raw test reads and writes: one buffer per thread reused by every op
// (hot), or blocks in random order over a pool on each side (pool); and the byte pattern that
// --check fills sources with and expects at destinations. Both processes compute the same
// plan from the agreed options, so the destination side can check without being told more.
#ifndef KVWIRE_PERF_BUFFER_PLAN_H_
#define KVWIRE_PERF_BUFFER_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"

#include "perf/perf_options.h"

namespace kvwire::perf {

// Bytes each side registers for a raw test with these options (largest size, all threads).
uint64_t RawRegionBytes(const PerfOptions& options);

// Writes the --check pattern of region bytes [offset, offset + length) to dst: every byte
// depends on its position, so an op that lands in the wrong place is caught.
void FillPattern(std::byte* dst, uint64_t offset, uint64_t length);

class BufferPlan;

// Ops per thread to run before measuring: the options' warm-up, and in the pool pattern (when
// -w/--warmup was not given) at least one op per slot, so that every block of the pool has been
// touched through the transport's mappings before the clock starts. A peer's memfd mapped with
// MAP_POPULATE still costs about ten times a plain copy on the first touch of each page on
// some virtual machines (no page fault is counted; see perf/cpu/README.md), which is a cost of
// the first use of a mapping, not of each transfer, and memcpy of pre-touched buffers (the
// floor) never pays it.
uint64_t WarmupOps(const PerfOptions& options, const BufferPlan& plan, uint64_t iterations);

class BufferPlan {
 public:
  BufferPlan(Pattern pattern, int threads, uint64_t size, uint64_t region_bytes);

  uint64_t size() const { return size_; }
  uint64_t slots_per_thread() const { return slots_; }
  // Offsets of op `i` (0-based, warm-up included) of `thread` on the initiator (local) and
  // target (remote) side.
  uint64_t LocalOffset(int thread, uint64_t i) const { return Offset(local_, thread, i); }
  uint64_t RemoteOffset(int thread, uint64_t i) const { return Offset(remote_, thread, i); }

  // Clears every destination block `thread` touches in its first `ops` ops.
  void ClearDestinations(std::byte* dst_base, bool dst_is_remote, int thread, uint64_t ops) const;
  // Compares every destination block of the first `ops` ops of `thread` with the pattern of
  // its source block; the error names the thread, op, offsets and first differing byte.
  absl::Status Verify(const std::byte* dst_base, bool dst_is_remote, int thread,
                      uint64_t ops) const;

 private:
  uint64_t Offset(const std::vector<uint32_t>& perm, int thread, uint64_t i) const {
    const uint64_t slot = perm.empty() ? 0 : perm[i % slots_];
    return (static_cast<uint64_t>(thread) * slots_ + slot) * size_;
  }

  uint64_t size_;
  uint64_t slots_;
  std::vector<uint32_t> local_;  // empty: hot (slot 0 of the thread)
  std::vector<uint32_t> remote_;
};

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_BUFFER_PLAN_H_

#include "perf/buffer_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"

namespace kvwire::perf {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::vector<uint32_t> Permutation(uint64_t n, uint64_t seed) {
  std::vector<uint32_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0u);
  std::mt19937_64 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  return perm;
}

}  // namespace

uint64_t RawRegionBytes(const PerfOptions& options) {
  uint64_t largest = 0;
  for (uint64_t s : options.Sizes()) largest = std::max(largest, s);
  if (options.pattern == Pattern::kPool) {
    return std::max<uint64_t>(options.pool_mib << 20, largest * options.threads);
  }
  return largest * static_cast<uint64_t>(options.threads);
}

uint64_t WarmupOps(const PerfOptions& options, const BufferPlan& plan, uint64_t iterations) {
  const uint64_t warmup = options.WarmupFor(iterations);
  if (options.pattern != Pattern::kPool || options.warmup >= 0) return warmup;
  return std::max<uint64_t>(warmup, plan.slots_per_thread());
}

void FillPattern(std::byte* dst, uint64_t offset, uint64_t length) {
  uint64_t pos = offset;
  const uint64_t end = offset + length;
  while (pos < end && (pos & 7) != 0) {
    *dst++ = static_cast<std::byte>(Mix(pos >> 3) >> ((pos & 7) * 8));
    ++pos;
  }
  for (; pos + 8 <= end; pos += 8, dst += 8) {
    const uint64_t word = Mix(pos >> 3);
    std::memcpy(dst, &word, 8);
  }
  for (; pos < end; ++pos) *dst++ = static_cast<std::byte>(Mix(pos >> 3) >> ((pos & 7) * 8));
}

BufferPlan::BufferPlan(Pattern pattern, int threads, uint64_t size, uint64_t region_bytes)
    : size_(size), slots_(1) {
  if (pattern == Pattern::kPool) {
    slots_ = std::max<uint64_t>(1, region_bytes / size / std::max(1, threads));
    slots_ = std::min<uint64_t>(slots_, UINT32_MAX);
    // Different orders on the two sides, like block ids of two independent allocators.
    local_ = Permutation(slots_, 0x6b76776972650001ull ^ size);
    remote_ = Permutation(slots_, 0x6b76776972650002ull ^ size);
  }
}

void BufferPlan::ClearDestinations(std::byte* dst_base, bool dst_is_remote, int thread,
                                   uint64_t ops) const {
  for (uint64_t i = 0; i < std::min(ops, slots_); ++i) {
    const uint64_t dst = dst_is_remote ? RemoteOffset(thread, i) : LocalOffset(thread, i);
    std::memset(dst_base + dst, 0, size_);
  }
}

absl::Status BufferPlan::Verify(const std::byte* dst_base, bool dst_is_remote, int thread,
                                uint64_t ops) const {
  std::vector<std::byte> expected(size_);
  // Only the last op to each destination block decides its content; with the same source
  // block paired every time, the first slots_ ops cover every block touched.
  for (uint64_t i = 0; i < std::min(ops, slots_); ++i) {
    const uint64_t src = dst_is_remote ? LocalOffset(thread, i) : RemoteOffset(thread, i);
    const uint64_t dst = dst_is_remote ? RemoteOffset(thread, i) : LocalOffset(thread, i);
    FillPattern(expected.data(), src, size_);
    if (std::memcmp(dst_base + dst, expected.data(), size_) != 0) {
      uint64_t at = 0;
      while (at < size_ && dst_base[dst + at] == expected[at]) ++at;
      return absl::DataLossError(
          absl::StrCat("check failed: thread ", thread, " op ", i, " (source offset ", src,
                       ", destination offset ", dst, ", ", size_, " bytes): byte ", at, " is 0x",
                       absl::Hex(static_cast<int>(dst_base[dst + at])), ", expected 0x",
                       absl::Hex(static_cast<int>(expected[at]))));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvwire::perf

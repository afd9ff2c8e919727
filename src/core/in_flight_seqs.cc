#include "src/core/in_flight_seqs.h"

#include <algorithm>
#include <utility>

namespace kvwire::core {

void InFlightSeqs::Add(uint64_t seq) {
  if (count_ == ring_.size() && count_ > 0 && live_ <= count_ / 2) {
    // Mostly ended entries behind a live one: drop them in place, in order (j <= i always).
    size_t j = 0;
    for (size_t i = 0; i < count_; ++i) {
      if (!At(i).ended) At(j++) = At(i);
    }
    count_ = j;
  }
  if (count_ == ring_.size()) {
    // Full: twice the room, the entries laid out from 0 in their order.
    std::vector<Entry> grown(std::max<size_t>(16, ring_.size() * 2));
    for (size_t i = 0; i < count_; ++i) grown[i] = At(i);
    ring_ = std::move(grown);
    head_ = 0;
  }
  At(count_) = Entry{seq, false};
  ++count_;
  ++live_;
}

void InFlightSeqs::End(uint64_t seq) {
  // The entries are in increasing order of seq: binary search over the ring's order.
  size_t lo = 0, hi = count_;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (At(mid).seq < seq) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == count_ || At(lo).seq != seq || At(lo).ended) return;
  At(lo).ended = true;
  --live_;
  // The front leaves once ended, so that the first entry is always the smallest live number.
  while (count_ > 0 && At(0).ended) {
    head_ = (head_ + 1) & (ring_.size() - 1);
    --count_;
  }
}

size_t InFlightSeqs::CountBelow(uint64_t mark) const {
  size_t n = 0;
  for (size_t i = 0; i < count_ && At(i).seq < mark; ++i) n += At(i).ended ? 0 : 1;
  return n;
}

}  // namespace kvwire::core

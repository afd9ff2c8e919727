// The sequence numbers of one peer's ops being served (ServedOps): added in increasing order,
// ended in any order, and asked "is any below this mark still live?". A ring of entries in
// the order they were added, whose ended ones leave from the front. Ended entries behind a
// live one stay until the ring is full; then, if at most half are live, they are compacted
// away instead of the ring growing, so the ring holds at most about twice the most ops that
// were live at once (one stalled op does not make it grow with every op after it), and
// adding, ending and asking allocate nothing once it has that size (a std::set allocated a
// node per op, ~3,000 per DeepSeek-V4 request on the serving side).
#ifndef KVWIRE_SRC_CORE_IN_FLIGHT_SEQS_H_
#define KVWIRE_SRC_CORE_IN_FLIGHT_SEQS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvwire::core {

class InFlightSeqs {
 public:
  // `seq` must be larger than every number added before.
  void Add(uint64_t seq);
  // Ends `seq` (a number added and not ended yet; anything else is ignored).
  void End(uint64_t seq);
  // No live number below `mark`.
  bool NoneBelow(uint64_t mark) const { return live_ == 0 || At(0).seq >= mark; }
  // Live numbers below `mark`.
  size_t CountBelow(uint64_t mark) const;
  size_t live() const { return live_; }
  bool empty() const { return live_ == 0; }
  size_t capacity() const { return ring_.size(); }  // entries the ring holds before it grows

 private:
  struct Entry {
    uint64_t seq = 0;
    bool ended = false;
  };
  const Entry& At(size_t i) const { return ring_[(head_ + i) & (ring_.size() - 1)]; }
  Entry& At(size_t i) { return ring_[(head_ + i) & (ring_.size() - 1)]; }

  std::vector<Entry> ring_;  // capacity a power of two (or empty)
  size_t head_ = 0;          // where entry 0 is
  size_t count_ = 0;         // entries in the ring, ended ones behind the first live included
  size_t live_ = 0;          // entries not ended
};

}  // namespace kvwire::core

#endif  // KVWIRE_SRC_CORE_IN_FLIGHT_SEQS_H_

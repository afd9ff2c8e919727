// A set that remembers only its most recent insertions: for per-peer "this one is gone" marks
// that would otherwise grow by one entry per closed peer for the life of the process.
#ifndef KVWIRE_UTIL_RECENT_SET_H_
#define KVWIRE_UTIL_RECENT_SET_H_

#include <algorithm>
#include <cstddef>
#include <deque>

#include "absl/container/flat_hash_set.h"

namespace kvwire {

// How many closed/dropped peers each per-peer mark remembers. A peer is marked when it closes;
// its token is revoked first, so only messages or connections already in flight at that moment
// can still name it, and those are long settled by the time this many later peers have closed.
inline constexpr size_t kClosedPeersRemembered = 4096;

// Not thread-safe. Forgetting is only safe for marks whose subject cannot come back once it
// is old: the users' peer ids are never reused, and by the time a peer is marked its session
// token is revoked, so nothing of an old peer can reach the code that checks the mark.
template <typename T>
class RecentSet {
 public:
  // Keeps at most `capacity` (at least 1) values, forgetting the oldest insertion first.
  explicit RecentSet(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {}

  // True if `value` was not in the set (it is now).
  bool Insert(const T& value) {
    if (!members_.insert(value).second) return false;
    order_.push_back(value);
    if (order_.size() > capacity_) {
      members_.erase(order_.front());
      order_.pop_front();
    }
    return true;
  }
  bool Contains(const T& value) const { return members_.contains(value); }
  size_t size() const { return order_.size(); }
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  absl::flat_hash_set<T> members_;
  std::deque<T> order_;  // insertion order, oldest first
};

}  // namespace kvwire

#endif  // KVWIRE_UTIL_RECENT_SET_H_

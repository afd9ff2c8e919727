// Reused memory for objects made and dropped at a high rate from std::allocate_shared (a pin
// per served op): a free list of equal-size blocks, so that steady traffic reuses its blocks
// instead of a malloc and a free each.
//
// The allocator holds its pool by shared_ptr, and a shared_ptr's control block keeps a copy of
// its allocator until it has freed itself: a block released after everything else that held
// the pool went (the object's owner destroyed by the object's own destructor) still goes back
// to a live pool.
#ifndef KVWIRE_SRC_UTIL_BLOCK_POOL_H_
#define KVWIRE_SRC_UTIL_BLOCK_POOL_H_

#include <cstddef>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"

#include "src/util/mutex.h"

namespace kvwire {

class BlockPool {
 public:
  // Keeps at most `keep` free blocks; more are handed back to operator delete.
  explicit BlockPool(size_t keep) : keep_(keep) {}
  ~BlockPool() {
    for (void* block : free_) ::operator delete(block);
  }
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block of `bytes` (operator new's alignment). The pool's blocks are the size of the
  // first one asked for; other sizes come from operator new each time.
  void* Allocate(size_t bytes) {
    {
      MutexLock lock(&mu_);
      if (block_bytes_ == 0) block_bytes_ = bytes;
      if (bytes == block_bytes_ && !free_.empty()) {
        void* block = free_.back();
        free_.pop_back();
        return block;
      }
    }
    return ::operator new(bytes);
  }
  void Deallocate(void* block, size_t bytes) {
    {
      MutexLock lock(&mu_);
      if (bytes == block_bytes_ && free_.size() < keep_) {
        // Kept for the next op (up to `keep_`): steady traffic frees as many as it takes.
        free_.push_back(block);
        return;
      }
    }
    ::operator delete(block);
  }

  size_t free_blocks() const {
    MutexLock lock(&mu_);
    return free_.size();
  }

 private:
  const size_t keep_;
  mutable Mutex mu_;
  size_t block_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<void*> free_ ABSL_GUARDED_BY(mu_);
};

// A standard allocator over a BlockPool, for std::allocate_shared.
template <typename T>
class PoolAllocator {
 public:
  using value_type = T;

  explicit PoolAllocator(std::shared_ptr<BlockPool> pool) : pool_(std::move(pool)) {}
  template <typename U>
  PoolAllocator(const PoolAllocator<U>& other) : pool_(other.pool()) {}  // NOLINT: rebinding

  T* allocate(size_t n) { return static_cast<T*>(pool_->Allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { pool_->Deallocate(p, n * sizeof(T)); }

  const std::shared_ptr<BlockPool>& pool() const { return pool_; }
  template <typename U>
  bool operator==(const PoolAllocator<U>& other) const {
    return pool_ == other.pool();
  }

 private:
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__,
                "BlockPool hands out operator new's alignment");
  std::shared_ptr<BlockPool> pool_;
};

}  // namespace kvwire

#endif  // KVWIRE_SRC_UTIL_BLOCK_POOL_H_

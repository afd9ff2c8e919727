// A mutex and condition variable with Abseil's thread-safety annotations, built on the
// standard library so that ThreadSanitizer sees every acquire and release (Debian's libabsl
// is not built with TSan, and absl::Mutex's futex path would be invisible to it).
#ifndef KVWIRE_UTIL_MUTEX_H_
#define KVWIRE_UTIL_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvwire {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

class CondVar {
 public:
  // Waits until notified or `deadline`; returns false on timeout. Spurious wake-ups happen:
  // callers loop on their predicate.
  bool WaitUntil(Mutex* mu, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    bool notified = true;
    if (deadline == absl::InfiniteFuture()) {
      cv_.wait(lock);
    } else {
      notified = cv_.wait_until(lock, absl::ToChronoTime(deadline)) == std::cv_status::no_timeout;
    }
    lock.release();
    return notified;
  }
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { WaitUntil(mu, absl::InfiniteFuture()); }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kvwire

#endif  // KVWIRE_UTIL_MUTEX_H_

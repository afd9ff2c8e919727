// A small fixed pool for data-parallel loops. ParallelFor splits [0, n) into chunks that
// any thread may run; callers give it independent outputs only, so results never depend on
// the thread count or the schedule.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_THREAD_POOL_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "src/util/mutex.h"

namespace dsv4 {

class ThreadPool {
 public:
  // threads <= 0: hardware concurrency. The caller's thread is one of them.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(begin, end) over disjoint ranges covering [0, n); returns when all are done.
  // Concurrent callers are serialised.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunChunks();

  kvwire::Mutex submit_mu_;  // one ParallelFor at a time
  kvwire::Mutex mu_;
  kvwire::CondVar cv_;
  kvwire::CondVar done_cv_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // The current job; written under mu_ before generation_ advances.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 1;
  std::atomic<int64_t> next_{0};
  std::vector<std::thread> workers_;
};

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_THREAD_POOL_H_

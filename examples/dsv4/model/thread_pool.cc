// Fixed thread pool with a chunked ParallelFor.
#include "examples/dsv4/model/thread_pool.h"

#include <algorithm>

namespace dsv4 {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    kvwire::MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunChunks() {
  for (;;) {
    const int64_t begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= n_) return;
    (*fn_)(begin, std::min(n_, begin + chunk_));
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      kvwire::MutexLock lock(&mu_);
      while (!stop_ && generation_ == seen) cv_.Wait(&mu_);
      if (stop_) return;
      seen = generation_;
    }
    RunChunks();
    bool last;
    {
      kvwire::MutexLock lock(&mu_);
      last = --busy_ == 0;
    }
    if (last) done_cv_.SignalAll();
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  kvwire::MutexLock submit(&submit_mu_);
  {
    kvwire::MutexLock lock(&mu_);
    fn_ = &fn;
    n_ = n;
    chunk_ = std::max<int64_t>(1, n / (4 * threads()));
    next_.store(0, std::memory_order_relaxed);
    busy_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  cv_.SignalAll();
  RunChunks();
  kvwire::MutexLock lock(&mu_);
  while (busy_ != 0) done_cv_.Wait(&mu_);
}

}  // namespace dsv4

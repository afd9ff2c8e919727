// One background thread running posted tasks in order. Used where work must leave the thread
// that noticed it (an I/O thread must not block on setup or teardown of its own peer).
#ifndef KVWIRE_UTIL_TASK_RUNNER_H_
#define KVWIRE_UTIL_TASK_RUNNER_H_

#include <deque>
#include <functional>
#include <thread>

#include "src/util/mutex.h"

namespace kvwire {

class TaskRunner {
 public:
  TaskRunner() : thread_([this] { Run(); }) {}
  ~TaskRunner() { Stop(); }
  TaskRunner(const TaskRunner&) = delete;
  TaskRunner& operator=(const TaskRunner&) = delete;

  // Returns false (and drops the task) once stopped.
  bool Post(std::function<void()> task) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    if (stopped_) return false;
    tasks_.push_back(std::move(task));
    cv_.Signal();
    return true;
  }

  // Runs the tasks already queued, then joins. Idempotent; not callable from a task.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      MutexLock lock(&mu_);
      stopped_ = true;
      cv_.Signal();
    }
    if (thread_.joinable()) thread_.join();
  }

  bool OnRunnerThread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_) {
    while (true) {
      std::function<void()> task;
      {
        MutexLock lock(&mu_);
        while (tasks_.empty() && !stopped_) cv_.Wait(&mu_);
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvwire

#endif  // KVWIRE_UTIL_TASK_RUNNER_H_

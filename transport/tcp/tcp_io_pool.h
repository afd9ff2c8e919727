// The fixed set of I/O threads that runs every data connection of one tcp transport, whatever
// the number of peers. Each thread owns an epoll instance; a connection is registered with one
// thread for its whole life (edge-triggered, input and output), and all of its I/O, parsing
// and completions run there, so a connection's state needs no lock against itself. Other
// threads hand work to a connection's thread with IoLoop::Run (a task queue woken through an
// eventfd). Nothing on these threads blocks on a peer in the host-memory paths: sockets are
// non-blocking and a connection that cannot make progress returns to epoll_wait, so a slow
// peer never holds up another one. The loop has no timers: an idle transport does not wake.
// After it handled events or tasks, a loop polls epoll without sleeping for a short while
// (`poll`, TcpTransportOptions::io_poll) before it sleeps: a busy connection's next bytes
// usually arrive within microseconds, and a sleeping receiver costs its sender a wake-up
// (an inter-processor interrupt, a VM exit under a hypervisor) for every segment that arrives;
// the poll ends as soon as the connections go quiet, so idle still means no CPU. A poll runs
// only while the core is its thread's (SpinGate, src/util/spin_gate.h, one per pool): a
// thread that was preempted while polling stops and sleeps, and the pool's threads then do
// not poll for a while (a backoff that doubles while the cores stay contended); at most
// cores-1 threads of a pool poll at once. It never yields: sched_yield hands the core to a
// CPU-bound neighbour for a whole slice (milliseconds).
// Readiness comes from epoll or, with IoBackend::kIoUring, from io_uring poll requests
// (multishot where the kernel has it, re-armed otherwise): the same loop, tasks and handlers,
// only the wait differs (tcp_io_pool.cc).
#ifndef KVWIRE_TRANSPORT_TCP_TCP_IO_POOL_H_
#define KVWIRE_TRANSPORT_TCP_TCP_IO_POOL_H_

#include <sys/epoll.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/util/mutex.h"
#include "src/util/spin_gate.h"

namespace kvwire::transport {

// A connection's side of the loop: OnIo runs on the loop thread with the epoll events.
class IoHandler {
 public:
  virtual ~IoHandler() = default;
  virtual void OnIo(uint32_t events) = 0;
};

// How a loop waits for readiness (TcpOptions::io_backend).
enum class IoBackend { kEpoll, kIoUring };

// OK when an io_uring instance can be created here (liburing built in, the kernel has it and
// no seccomp filter refuses it); otherwise why not.
absl::Status IoUringAvailable();

struct UringState;  // tcp_io_pool.cc

class IoLoop {
 public:
  IoLoop() = default;
  ~IoLoop();  // Stop()
  IoLoop(const IoLoop&) = delete;
  IoLoop& operator=(const IoLoop&) = delete;

  // Creates the epoll instance and the eventfd and starts the thread named `name`, which
  // polls for `poll` after its last event before it sleeps (zero: sleeps at once), when
  // `gate` (shared by a pool's loops; null: one of its own) admits it.
  absl::Status Start(const std::string& name, absl::Duration poll = absl::ZeroDuration(),
                     IoBackend backend = IoBackend::kEpoll,
                     std::shared_ptr<SpinGate> gate = nullptr);
  // Runs the queued tasks, drops every registered handler and joins the thread. Idempotent;
  // not on the loop thread (then it only asks the thread to stop).
  void Stop();

  // Queues `task` for the loop thread; false (task not run, dropped) once the loop stopped.
  bool Run(std::function<void()> task);
  // Registers `fd` for input, output and hang-up, edge-triggered; the loop keeps `handler`
  // alive until Remove. Call on the loop thread.
  absl::Status Add(int fd, std::shared_ptr<IoHandler> handler);
  // Unregisters `fd` and lets go of its handler (events already fetched for it are
  // dropped). Call on the loop thread, before the descriptor is closed.
  void Remove(int fd);
  bool OnLoopThread() const { return std::this_thread::get_id() == thread_id_.load(); }

 private:
  void Loop();
  void RunTasks();
  // True (and the loop marked sleeping) when the loop may sleep: no task is queued.
  bool PrepareToSleep();
  // Waits up to `timeout_ms` (0: not at all, -1: for ever) for readiness; fills `events` as
  // epoll_wait does (data.u64: the descriptor or the wake tag); -1 and errno on failure.
  int Wait(epoll_event* events, int capacity, int timeout_ms);
  void Wake();

  int epfd_ = -1;
  std::unique_ptr<UringState> uring_;  // io_uring backend: the ring and the registrations
  int eventfd_ = -1;
  int64_t poll_ns_ = 0;
  std::shared_ptr<SpinGate> gate_;  // who may poll, and when polling stopped paying
  // The loop sleeps (or is about to) in epoll_wait: Run must wake it through the eventfd.
  // While it polls, a queued task is seen without the write (a system call per Post saved).
  std::atomic<bool> sleeping_{false};
  Mutex join_mu_;  // std::thread::join must not run twice at once
  std::thread thread_;
  std::atomic<std::thread::id> thread_id_{};
  // Loop thread only: the registered handlers by descriptor.
  absl::flat_hash_map<int, std::shared_ptr<IoHandler>> handlers_;
  Mutex mu_;
  std::vector<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Written under mu_: tasks_ is not empty or the loop is stopping. The polling loop reads it
  // without the lock.
  std::atomic<bool> queued_{false};
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

class IoPool {
 public:
  // `threads` loops (at least 1) named kvw-tcp-io<i>, each polling for `poll` after its
  // last event before it sleeps (IoLoop::Start).
  static absl::StatusOr<std::shared_ptr<IoPool>> Create(uint32_t threads,
                                                        absl::Duration poll = absl::ZeroDuration(),
                                                        IoBackend backend = IoBackend::kEpoll);
  // The default size: a small number tied to the cores (1 per 8 cores, 1..4).
  static uint32_t DefaultThreads();
  ~IoPool() { Stop(); }

  // The loop for a new connection (round robin).
  IoLoop* Pick();
  // Stops every loop (see IoLoop::Stop).
  void Stop();
  // True on any thread of this pool.
  bool OnPoolThread() const;
  size_t threads() const { return loops_.size(); }

 private:
  std::vector<std::unique_ptr<IoLoop>> loops_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_IO_POOL_H_

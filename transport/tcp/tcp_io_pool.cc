#include "transport/tcp/tcp_io_pool.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <exception>
#include <pthread.h>
#include <system_error>
#include <unistd.h>
#include <utility>

#include "absl/strings/str_cat.h"

#ifdef KVWIRE_HAVE_LIBURING
#include <liburing.h>
#include <poll.h>
#endif

#include "src/util/log.h"
#include "transport/tcp/tcp_socket.h"

namespace kvwire::transport {
namespace {

// epoll_data of the eventfd; descriptors are >= 0.
constexpr uint64_t kWakeTag = ~uint64_t{0};
// user_data of an io_uring poll-remove request (its completion is dropped).
[[maybe_unused]] constexpr uint64_t kIgnoreTag = ~uint64_t{0} - 1;

}  // namespace

#ifdef KVWIRE_HAVE_LIBURING
// The io_uring backend. Each descriptor has one poll request (user_data: its registration's
// generation << 32 | fd, so that a completion of a removed registration is never taken for
// the next socket that gets the same descriptor number), multishot (IORING_POLL_ADD_MULTI:
// one completion per wake-up of the socket, as epoll's edge-triggered mode reports) until the
// kernel refuses it (then one-shot), re-armed whenever a completion says it ended. The
// eventfd that wakes the loop is one more such poll.
struct UringState {
  io_uring ring{};
  bool ready = false;  // ring initialized
  bool multishot = true;
  uint32_t next_gen = 1;
  absl::flat_hash_map<int, uint32_t> gens;  // registered descriptor -> its generation

  ~UringState() {
    if (ready) io_uring_queue_exit(&ring);
  }
  io_uring_sqe* Sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    while (sqe == nullptr) {  // the submission queue is full: hand it to the kernel
      (void)io_uring_submit(&ring);
      sqe = io_uring_get_sqe(&ring);
    }
    return sqe;
  }
  void Arm(int fd, uint64_t tag, unsigned mask) {
    io_uring_sqe* sqe = Sqe();
    if (multishot) {
      io_uring_prep_poll_multishot(sqe, fd, mask);
    } else {
      io_uring_prep_poll_add(sqe, fd, mask);
    }
    io_uring_sqe_set_data64(sqe, tag);
  }
};

namespace {
constexpr unsigned kSocketMask = POLLIN | POLLOUT | POLLRDHUP | POLLERR | POLLHUP;
uint64_t Tag(int fd, uint32_t gen) { return (uint64_t{gen} << 32) | static_cast<uint32_t>(fd); }
}  // namespace

absl::Status IoUringAvailable() {
  io_uring ring{};
  const int rc = io_uring_queue_init(8, &ring, 0);
  if (rc < 0) return absl::UnavailableError(absl::StrCat("io_uring_queue_init: ", ErrnoText(-rc)));
  io_uring_queue_exit(&ring);
  return absl::OkStatus();
}
#else
struct UringState {};
absl::Status IoUringAvailable() {
  return absl::UnavailableError("kvwire was built without liburing (liburing-dev)");
}
#endif

IoLoop::~IoLoop() {
  Stop();
  if (thread_.joinable()) {
    // Destroyed by its own thread (a transport destroyed inside one of its callbacks).
    KVW_LOG(kError, "tcp") << "I/O loop destroyed on its own thread; detaching it";
    thread_.detach();
  }
  if (epfd_ >= 0) ::close(epfd_);
  if (eventfd_ >= 0) ::close(eventfd_);
}

absl::Status IoLoop::Start(const std::string& name, absl::Duration poll, IoBackend backend,
                           std::shared_ptr<SpinGate> gate) {
  poll_ns_ = std::max<int64_t>(0, absl::ToInt64Nanoseconds(poll));
  gate_ = gate != nullptr ? std::move(gate) : std::make_shared<SpinGate>();
  eventfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (eventfd_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", ErrnoText(errno)));
  if (backend == IoBackend::kIoUring) {
#ifdef KVWIRE_HAVE_LIBURING
    auto state = std::make_unique<UringState>();
    io_uring_params params{};
    // Room for a completion per registered socket and then some: a full completion queue
    // ends multishot polls (re-armed, but a wasted round trip).
    params.flags = IORING_SETUP_CQSIZE;
    params.cq_entries = 4096;
    const int rc = io_uring_queue_init_params(256, &state->ring, &params);
    if (rc < 0)
      return absl::UnavailableError(absl::StrCat("io_uring_queue_init: ", ErrnoText(-rc)));
    state->ready = true;
    uring_ = std::move(state);
    uring_->Arm(eventfd_, kWakeTag, POLLIN);
    (void)io_uring_submit(&uring_->ring);
#else
    return IoUringAvailable();
#endif
  } else {
    epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (epfd_ < 0) return absl::InternalError(absl::StrCat("epoll_create1: ", ErrnoText(errno)));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kWakeTag;
    if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, eventfd_, &ev) != 0) {
      return absl::InternalError(absl::StrCat("epoll_ctl(eventfd): ", ErrnoText(errno)));
    }
  }
  try {
    thread_ = std::thread([this, name] {
      pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
      Loop();
    });
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot start tcp I/O thread: ", e.what()));
  }
  thread_id_.store(thread_.get_id());
  return absl::OkStatus();
}

void IoLoop::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    queued_.store(true, std::memory_order_release);
    if (!thread_.joinable()) stopped_ = true;  // never started: refuse tasks from now on
  }
  const uint64_t one = 1;
  if (eventfd_ >= 0) (void)!::write(eventfd_, &one, sizeof(one));
  if (OnLoopThread()) return;  // the thread returns after the current dispatch
  MutexLock lock(&join_mu_);
  if (thread_.joinable()) thread_.join();
  handlers_.clear();  // the thread is gone: nobody else touches it
}

bool IoLoop::Run(std::function<void()> task) {
  bool first = false;
  {
    MutexLock lock(&mu_);
    if (stopped_) return false;
    first = tasks_.empty();
    tasks_.push_back(std::move(task));
    queued_.store(true, std::memory_order_release);
  }
  // Pairs with PrepareToSleep: either the loop sees this task before it sleeps, or it set
  // sleeping_ before this load (both are sequentially consistent) and the write wakes it.
  // Later tasks of the same batch find the queue non-empty: the first one's write will do.
  if (first && sleeping_.load()) {
    const uint64_t one = 1;
    // EAGAIN only when the counter is about to overflow: the loop is awake anyway.
    (void)!::write(eventfd_, &one, sizeof(one));
  }
  return true;
}

absl::Status IoLoop::Add(int fd, std::shared_ptr<IoHandler> handler) {
#ifdef KVWIRE_HAVE_LIBURING
  if (uring_) {
    const uint32_t gen = uring_->next_gen++;
    uring_->gens[fd] = gen;
    uring_->Arm(fd, Tag(fd, gen), kSocketMask);  // submitted by the loop's next wait
    handlers_[fd] = std::move(handler);
    return absl::OkStatus();
  }
#endif
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  ev.data.u64 = static_cast<uint64_t>(fd);
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl(ADD): ", ErrnoText(errno)));
  }
  handlers_[fd] = std::move(handler);
  return absl::OkStatus();
}

void IoLoop::Remove(int fd) {
#ifdef KVWIRE_HAVE_LIBURING
  if (uring_) {
    if (auto g = uring_->gens.find(fd); g != uring_->gens.end()) {
      io_uring_sqe* sqe = uring_->Sqe();
      io_uring_prep_poll_remove(sqe, Tag(fd, g->second));
      io_uring_sqe_set_data64(sqe, kIgnoreTag);
      uring_->gens.erase(g);
      // Now, not at the next wait: the poll request holds a reference to the socket, which
      // the caller is about to close.
      (void)io_uring_submit(&uring_->ring);
    }
  }
#endif
  if (epfd_ >= 0) (void)::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
  // Released after the current dispatch: the handler may be the one running now.
  auto it = handlers_.find(fd);
  if (it == handlers_.end()) return;
  std::shared_ptr<IoHandler> handler = std::move(it->second);
  handlers_.erase(it);
  MutexLock lock(&mu_);
  tasks_.push_back([h = std::move(handler)] {});
  queued_.store(true, std::memory_order_release);
  const uint64_t one = 1;
  (void)!::write(eventfd_, &one, sizeof(one));
}

void IoLoop::RunTasks() {
  std::vector<std::function<void()>> tasks;
  {
    MutexLock lock(&mu_);
    tasks.swap(tasks_);
    queued_.store(stopping_, std::memory_order_release);
  }
  for (std::function<void()>& task : tasks) {
    try {
      task();
    } catch (const std::exception& e) {
      KVW_LOG(kError, "tcp") << "I/O task failed" << Kv("error", e.what());
    }
    task = nullptr;  // what it captured goes here, on this thread
  }
}

bool IoLoop::PrepareToSleep() {
  sleeping_.store(true);
  MutexLock lock(&mu_);
  if (tasks_.empty() && !stopping_) return true;
  sleeping_.store(false);
  return false;
}

int IoLoop::Wait(epoll_event* events, int capacity, int timeout_ms) {
  if (!uring_) return ::epoll_wait(epfd_, events, capacity, timeout_ms);
#ifdef KVWIRE_HAVE_LIBURING
  io_uring* ring = &uring_->ring;
  // Submits what Add queued; waits only when asked to. Completions of polls come from
  // task work, which the kernel runs on this thread as soon as it is queued (TWA_SIGNAL: no
  // IORING_SETUP_COOP_TASKRUN here), also while the thread polls in user space.
  const int rc = timeout_ms == 0 ? io_uring_submit(ring) : io_uring_submit_and_wait(ring, 1);
  if (rc < 0 && rc != -EBUSY) {
    errno = -rc;
    return -1;
  }
  int n = 0;
  unsigned head = 0;
  unsigned seen = 0;
  io_uring_cqe* cqe = nullptr;
  io_uring_for_each_cqe(ring, head, cqe) {
    if (n == capacity) break;
    ++seen;
    const uint64_t tag = io_uring_cqe_get_data64(cqe);
    if (tag == kIgnoreTag) continue;
    const bool more = (cqe->flags & IORING_CQE_F_MORE) != 0;
    if (cqe->res == -EINVAL && uring_->multishot) {
      // A kernel without multishot polls (before 5.13): one-shot polls, re-armed below.
      KVW_LOG(kInfo, "tcp") << "io_uring: no multishot poll here; re-arming one-shot polls";
      uring_->multishot = false;
    }
    if (tag == kWakeTag) {
      if (!more) uring_->Arm(eventfd_, kWakeTag, POLLIN);
      events[n].events = EPOLLIN;
      events[n++].data.u64 = kWakeTag;
      continue;
    }
    const int fd = static_cast<int>(tag & 0xffffffffu);
    auto g = uring_->gens.find(fd);
    if (g == uring_->gens.end() || Tag(fd, g->second) != tag) continue;  // removed since
    if (!more) uring_->Arm(fd, tag, kSocketMask);
    if (cqe->res == -EINVAL) continue;  // re-armed one-shot
    // Poll bits are epoll's; a failed poll request is reported as an error on the socket,
    // whose handler then finds out what happened from the socket itself.
    events[n].events = cqe->res >= 0 ? static_cast<uint32_t>(cqe->res) : EPOLLERR;
    events[n++].data.u64 = static_cast<uint64_t>(fd);
  }
  io_uring_cq_advance(ring, seen);
  return n;
#else
  return 0;
#endif
}

void IoLoop::Loop() {
  std::array<epoll_event, 64> events;
  const int capacity = static_cast<int>(events.size());
  // The poll in progress (admitted by the gate) and until when it lasts, on the gate's clock
  // (CLOCK_MONOTONIC: a vDSO call, no syscall).
  SpinGate::Spin spin;
  int64_t poll_until = 0;
  uint32_t turns = 0;
  while (true) {
    int n = 0;
    if (spin) {
      // The thread's CPU time (a system call) is compared with the wall time every 16
      // empty turns, a few microseconds.
      const int64_t now = gate_->Now();
      if (now >= poll_until || (++turns % 16 == 0 && !spin.StillOurs(now))) spin.End();
    }
    if (spin) {
      n = Wait(events.data(), capacity, 0);
      if (n == 0) {
        // Tasks are seen without a wake-up while polling (Run skips the eventfd).
        // Read without the lock: a poll that locked mu_ on every turn would make each Run
        // from another thread contend for it (a futex call per op on both sides).
        const bool queued = queued_.load(std::memory_order_acquire);
        // No sched_yield here: with a CPU-bound neighbour runnable it hands the core away
        // for a whole slice (p99 ~4 ms). A poll whose thread loses its core stops instead
        // (StillOurs), and the gate keeps the pool from polling for a while.
        if (!queued) {
          CpuRelax();
          continue;
        }
      }
      spin.Paid();
    } else if (PrepareToSleep()) {
      n = Wait(events.data(), capacity, -1);
      sleeping_.store(false);
    } else {
      // Tasks are queued: the sockets are still looked at first, without waiting, so that a
      // task that queues itself again (a connection coming back for its next turn, or one
      // whose op waits for a moving region) never starves the others on this thread.
      n = Wait(events.data(), capacity, 0);
    }
    if (poll_ns_ > 0) {
      if (!spin) spin = gate_->Begin();
      poll_until = gate_->Now() + poll_ns_;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      KVW_LOG(kError, "tcp") << "waiting for readiness failed; I/O thread ends"
                             << Kv("error", ErrnoText(errno));
      break;
    }
    bool wake = false;
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kWakeTag) {
        wake = true;
        continue;
      }
      // Looked up per event: an earlier handler of this batch may have removed it.
      auto it = handlers_.find(static_cast<int>(events[i].data.u64));
      if (it == handlers_.end()) continue;
      const std::shared_ptr<IoHandler> handler = it->second;
      try {
        handler->OnIo(events[i].events);
      } catch (const std::exception& e) {
        KVW_LOG(kError, "tcp") << "I/O handler failed" << Kv("error", e.what());
      }
    }
    if (wake) {
      uint64_t count = 0;
      (void)!::read(eventfd_, &count, sizeof(count));
    }
    RunTasks();
    MutexLock lock(&mu_);
    if (stopping_ && tasks_.empty()) {
      stopped_ = true;
      break;
    }
  }
  // Tasks queued between the last run and stopped_: run them so that nothing is lost.
  RunTasks();
  MutexLock lock(&mu_);
  stopped_ = true;
}

absl::StatusOr<std::shared_ptr<IoPool>> IoPool::Create(uint32_t threads, absl::Duration poll,
                                                       IoBackend backend) {
  auto pool = std::make_shared<IoPool>();
  threads = std::max<uint32_t>(1, threads);
  // One gate for the pool: at most DefaultMaxSpinners of its threads poll at once, and a
  // preempted poll stops the others polling too (the cores are busy for all of them).
  auto gate = std::make_shared<SpinGate>();
  for (uint32_t i = 0; i < threads; ++i) {
    auto loop = std::make_unique<IoLoop>();
    if (absl::Status s = loop->Start(absl::StrCat("kvw-tcp-io", i), poll, backend, gate); !s.ok()) {
      pool->Stop();
      return s;
    }
    pool->loops_.push_back(std::move(loop));
  }
  return pool;
}

uint32_t IoPool::DefaultThreads() {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return std::clamp<uint32_t>(cores / 8, 1, 4);
}

IoLoop* IoPool::Pick() {
  return loops_[next_.fetch_add(1, std::memory_order_relaxed) % loops_.size()].get();
}

void IoPool::Stop() {
  for (const std::unique_ptr<IoLoop>& loop : loops_) loop->Stop();
}

bool IoPool::OnPoolThread() const {
  for (const std::unique_ptr<IoLoop>& loop : loops_) {
    if (loop->OnLoopThread()) return true;
  }
  return false;
}

}  // namespace kvwire::transport

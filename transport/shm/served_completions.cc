#include "transport/shm/served_completions.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <unistd.h>
#include <utility>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "transport/shm/errno_text.h"

namespace kvwire::transport::shm {

absl::StatusOr<std::shared_ptr<ServedCompletions>> ServedCompletions::Start() {
  UniqueFd epoll(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll.valid())
    return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "epoll_create1");
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "eventfd");
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.ptr = nullptr;  // the wake descriptor
  if (::epoll_ctl(epoll.get(), EPOLL_CTL_ADD, wake.get(), &event) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, errno, "epoll_ctl");
  }
  auto completions =
      std::make_shared<ServedCompletions>(PassKey(), std::move(epoll), std::move(wake));
  MutexLock lock(&completions->join_mu_);
  completions->thread_ = std::thread([self = completions] { self->Run(); });
  MutexLock ids(&completions->mu_);
  completions->thread_id_ = completions->thread_.get_id();
  return completions;
}

ServedCompletions::ServedCompletions(PassKey, UniqueFd epoll, UniqueFd wake)
    : epoll_(std::move(epoll)), wake_(std::move(wake)) {}

ServedCompletions::~ServedCompletions() { Shutdown(); }

void ServedCompletions::Wake() {
  const uint64_t one = 1;
  // EAGAIN means the counter is already non-zero: the thread will wake anyway.
  ssize_t ignored = ::write(wake_.get(), &one, sizeof(one));
  (void)ignored;
}

absl::Status ServedCompletions::Add(const std::shared_ptr<ServedLink>& link) {
  {
    MutexLock lock(&mu_);
    if (stopping_) return absl::FailedPreconditionError("shm served copies: shutting down");
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.ptr = link.get();
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, link->socket(), &event) != 0) {
      return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "epoll_ctl");
    }
    links_.push_back(link);
  }
  link->SetWake([weak = weak_from_this()] {
    if (std::shared_ptr<ServedCompletions> self = weak.lock()) self->Wake();
  });
  Wake();
  return absl::OkStatus();
}

void ServedCompletions::Remove(const ServedLink* link) {
  std::shared_ptr<ServedLink> removed;  // released outside the lock
  MutexLock lock(&mu_);
  auto it = std::find_if(links_.begin(), links_.end(),
                         [link](const std::shared_ptr<ServedLink>& l) { return l.get() == link; });
  if (it == links_.end()) return;
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, link->socket(), nullptr);
  removed = std::move(*it);
  links_.erase(it);
  if (std::this_thread::get_id() != thread_id_) {
    while (running_ == link) idle_cv_.Wait(&mu_);
  }
  Wake();
}

void ServedCompletions::Shutdown() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  Wake();
  MutexLock lock(&join_mu_);
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();  // it returns at its next check of stopping_
  } else {
    thread_.join();
  }
}

void ServedCompletions::Run() {
  epoll_event events[64];
  // Kept across wake-ups (its capacity): a snapshot per wake-up, emptied at its end.
  std::vector<std::shared_ptr<ServedLink>> links;
  while (true) {
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
      links.assign(links_.begin(), links_.end());
    }
    absl::Time wake_at = absl::InfiniteFuture();
    for (const std::shared_ptr<ServedLink>& link : links) {
      wake_at = std::min(wake_at, link->NextWake());
    }
    int timeout_ms = -1;
    if (wake_at != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(std::clamp<int64_t>(
          absl::ToInt64Milliseconds(absl::Ceil(wake_at - absl::Now(), absl::Milliseconds(1))), 0,
          std::numeric_limits<int>::max()));
    }
    const int n = ::epoll_wait(epoll_.get(), events, 64, timeout_ms);
    if (n < 0 && errno != EINTR) {
      KVW_LOG(kError, "shm") << "served copies: epoll_wait failed, stopping"
                             << Kv("error", ErrnoText(errno));
      return;
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.ptr != nullptr) continue;
      uint64_t count;
      ssize_t ignored = ::read(wake_.get(), &count, sizeof(count));
      (void)ignored;
    }
    // Every link, not only the readable ones: Progress never waits, and it also fails the
    // requests whose answer is overdue. A link removed since the snapshot is skipped.
    for (const std::shared_ptr<ServedLink>& link : links) {
      {
        MutexLock lock(&mu_);
        if (stopping_) return;
        if (std::none_of(links_.begin(), links_.end(),
                         [&](const std::shared_ptr<ServedLink>& l) { return l == link; })) {
          continue;
        }
        running_ = link.get();
      }
      link->Progress();
      // A broken link's socket (shut down, or closed by the peer) would report readable on
      // every wait: it is no longer watched (Remove finds it still listed).
      if (link->broken()) (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, link->socket(), nullptr);
      MutexLock lock(&mu_);
      running_ = nullptr;
      idle_cv_.SignalAll();
    }
    links.clear();
  }
}

}  // namespace kvwire::transport::shm

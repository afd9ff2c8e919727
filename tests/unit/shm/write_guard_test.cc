// The write guard (transport/shm/write_guard.h) against the kernel: a thread that writes into a
// guarded range sleeps in the kernel until the guard goes; mapped over meanwhile, its write lands
// in the new mapping, never in the memfd given up; lifted instead, in the same one. Real threads;
// every wait has a deadline.
#include "transport/shm/write_guard.h"

#include <sys/mman.h>
#include <sys/syscall.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "transport/shm/unique_fd.h"

namespace kvwire::transport::shm {
namespace {

size_t Page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// A memfd of `pages` pages and its shared mapping.
struct Mapped {
  UniqueFd fd;
  std::byte* base = nullptr;
  size_t size = 0;
};

Mapped MapMemfd(size_t pages) {
  Mapped m;
  m.size = pages * Page();
  m.fd.Reset(memfd_create("write-guard-test", MFD_CLOEXEC));
  EXPECT_TRUE(m.fd.valid());
  EXPECT_EQ(ftruncate(m.fd.get(), static_cast<off_t>(m.size)), 0);
  void* map = mmap(nullptr, m.size, PROT_READ | PROT_WRITE, MAP_SHARED, m.fd.get(), 0);
  EXPECT_NE(map, MAP_FAILED);
  m.base = static_cast<std::byte*>(map);
  return m;
}

uint64_t WordOf(int fd, size_t offset) {
  uint64_t word = 0;
  EXPECT_EQ(pread(fd, &word, sizeof(word), static_cast<off_t>(offset)),
            static_cast<ssize_t>(sizeof(word)));
  return word;
}

// A thread that stores one word (a user-mode write fault when guarded) and says when it is done.
// Not instrumented by ThreadSanitizer: the store races with the test's pwrite copy of the range
// by design; the guard orders them, invisibly to the sanitizer.
struct StoreThread {
  // Only after a failed check, with the thread still held: the process ends without it.
  ~StoreThread() {
    if (thread.joinable()) thread.detach();
  }
  std::atomic<pid_t> tid{0};
  std::atomic<bool> done{false};
  std::thread thread;
};

__attribute__((no_sanitize("thread"))) void StoreWord(std::byte* at, uint64_t value,
                                                      StoreThread* self) {
  self->tid.store(static_cast<pid_t>(syscall(SYS_gettid)));
  *reinterpret_cast<volatile uint64_t*>(at) = value;
  self->done.store(true);
}

void StartStore(StoreThread* t, std::byte* at, uint64_t value) {
  t->thread = std::thread(StoreWord, at, value, t);
}

// The thread's scheduler state ('S': asleep) and where it sleeps (wchan), from /proc.
std::string TaskState(pid_t tid) {
  std::ifstream stat("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() ? "" : line.substr(paren + 2, 1);
}

std::string TaskWchan(pid_t tid) {
  std::ifstream wchan("/proc/self/task/" + std::to_string(tid) + "/wchan");
  std::string text;
  std::getline(wchan, text);
  return text;
}

// Waits (up to 20 s) until the thread sleeps and has not finished its store: held by the guard.
::testing::AssertionResult Held(StoreThread& t) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (t.tid.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Microseconds(100));
  const pid_t tid = t.tid.load();
  if (tid == 0) return ::testing::AssertionFailure() << "the thread never started";
  while (absl::Now() < deadline && !t.done.load()) {
    if (TaskState(tid) == "S") {
      // Asleep and not done: the store is what it sleeps in (it does nothing else). Where the
      // kernel names the function it sleeps in, that must be the userfaultfd's.
      const std::string wchan = TaskWchan(tid);
      std::printf("held thread %d asleep in %s\n", static_cast<int>(tid), wchan.c_str());
      if (wchan.empty() || wchan == "0" || wchan.find("userfault") != std::string::npos) {
        return ::testing::AssertionSuccess();
      }
    }
    absl::SleepFor(absl::Microseconds(100));
  }
  return ::testing::AssertionFailure()
         << (t.done.load() ? "the store went through the guard" : "never asleep in 20 s");
}

::testing::AssertionResult Finishes(StoreThread& t) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!t.done.load() && absl::Now() < deadline) absl::SleepFor(absl::Microseconds(100));
  if (!t.done.load()) {
    // Unblock it so that the test process can end: the guard is gone, nothing else holds it.
    t.thread.detach();
    return ::testing::AssertionFailure() << "the held store did not finish within 20 s";
  }
  t.thread.join();
  return ::testing::AssertionSuccess();
}

#define SKIP_WITHOUT_GUARD()                                                          \
  if (absl::Status available = WriteGuardAvailable(); !available.ok()) {              \
    GTEST_SKIP() << "the write guard is not available here: " << available.message(); \
  }

TEST(WriteGuardTest, ReportsHowItWorksHere) {
  const absl::Status available = WriteGuardAvailable();
  std::printf("write guard: %s\n",
              available.ok() ? WriteGuardMode().c_str() : available.ToString().c_str());
  EXPECT_EQ(available.ok(), !WriteGuardMode().empty());
}

// The move's sequence: guard, copy, map a fresh memfd over the range, drop the guard. Writers
// that came during it (one into a page that was mapped, one into a page never touched: the
// kernel's pte marker) wait, then write into the fresh memfd; the old one keeps what was copied.
TEST(WriteGuardTest, HeldWritersLandInTheMemfdMappedOverTheRange) {
  SKIP_WITHOUT_GUARD();
  Mapped old = MapMemfd(4);
  const size_t page = Page();
  std::memset(old.base, 0, page);  // page 0 mapped; page 2 never touched
  absl::StatusOr<WriteGuard> armed = WriteGuard::Arm(old.base, old.size);
  ASSERT_TRUE(armed.ok()) << armed.status();
  std::optional<WriteGuard> guard;
  guard.emplace(*std::move(armed));

  StoreThread mapped_page, untouched_page;
  StartStore(&mapped_page, old.base, 7);
  StartStore(&untouched_page, old.base + 2 * page, 8);
  ASSERT_TRUE(Held(mapped_page));
  ASSERT_TRUE(Held(untouched_page));
  EXPECT_EQ(WordOf(old.fd.get(), 0), 0u);
  EXPECT_EQ(WordOf(old.fd.get(), 2 * page), 0u);

  UniqueFd fresh(memfd_create("write-guard-fresh", MFD_CLOEXEC));
  ASSERT_TRUE(fresh.valid());
  ASSERT_EQ(ftruncate(fresh.get(), static_cast<off_t>(old.size)), 0);
  ASSERT_EQ(pwrite(fresh.get(), old.base, old.size, 0), static_cast<ssize_t>(old.size));
  ASSERT_NE(
      mmap(old.base, old.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fresh.get(), 0),
      MAP_FAILED);
  EXPECT_FALSE(mapped_page.done.load()) << "the store ran before the guard went";
  guard.reset();  // the writers retry their faults

  ASSERT_TRUE(Finishes(mapped_page));
  ASSERT_TRUE(Finishes(untouched_page));
  EXPECT_EQ(WordOf(fresh.get(), 0), 7u);
  EXPECT_EQ(WordOf(fresh.get(), 2 * page), 8u);
  EXPECT_EQ(WordOf(old.fd.get(), 0), 0u) << "a held write landed in the memfd given up";
  EXPECT_EQ(WordOf(old.fd.get(), 2 * page), 0u) << "a held write landed in the memfd given up";
  munmap(old.base, old.size);
}

// A move that fails before mapping over: Lift makes the same mapping writable again.
TEST(WriteGuardTest, LiftLetsHeldWritersWriteTheSameMapping) {
  SKIP_WITHOUT_GUARD();
  Mapped m = MapMemfd(2);
  absl::StatusOr<WriteGuard> guard = WriteGuard::Arm(m.base, m.size);
  ASSERT_TRUE(guard.ok()) << guard.status();
  StoreThread writer;
  StartStore(&writer, m.base + Page(), 9);
  ASSERT_TRUE(Held(writer));
  guard->Lift();
  ASSERT_TRUE(Finishes(writer));
  EXPECT_EQ(WordOf(m.fd.get(), Page()), 9u);
  // The range is no longer guarded: a write goes straight through.
  *reinterpret_cast<volatile uint64_t*>(m.base) = 10;
  EXPECT_EQ(WordOf(m.fd.get(), 0), 10u);
  munmap(m.base, m.size);
}

// A write the kernel makes into the range for this process (read(2) into it): with a full
// userfaultfd (root, CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1) it waits like a user
// write; with a user-mode-only one it fails with EFAULT, nothing written.
TEST(WriteGuardTest, AKernelWriteIntoTheRangeWaitsOrFailsByMode) {
  SKIP_WITHOUT_GUARD();
  const bool user_mode_only = WriteGuardMode().find("user-mode") != std::string::npos;
  Mapped m = MapMemfd(2);
  std::memset(m.base, 0, m.size);
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  UniqueFd read_end(pipe_fds[0]), write_end(pipe_fds[1]);
  const uint64_t value = 11;
  ASSERT_EQ(write(write_end.get(), &value, sizeof(value)), static_cast<ssize_t>(sizeof(value)));
  absl::StatusOr<WriteGuard> guard = WriteGuard::Arm(m.base, m.size);
  ASSERT_TRUE(guard.ok()) << guard.status();

  StoreThread reader;  // its "store" is the kernel's copy out of the pipe
  std::atomic<ssize_t> got{0};
  std::atomic<int> error{0};
  reader.thread = std::thread([&] {
    reader.tid.store(static_cast<pid_t>(syscall(SYS_gettid)));
    const ssize_t n = read(read_end.get(), m.base + Page(), sizeof(uint64_t));
    error.store(n < 0 ? errno : 0);
    got.store(n);
    reader.done.store(true);
  });
  if (user_mode_only) {
    ASSERT_TRUE(Finishes(reader));
    EXPECT_EQ(got.load(), -1);
    EXPECT_EQ(error.load(), EFAULT);
  } else {
    ASSERT_TRUE(Held(reader));
    guard->Lift();
    ASSERT_TRUE(Finishes(reader));
    EXPECT_EQ(got.load(), static_cast<ssize_t>(sizeof(uint64_t)));
    EXPECT_EQ(WordOf(m.fd.get(), Page()), value);
  }
  munmap(m.base, m.size);
}

TEST(WriteGuardTest, TheTestHookMakesItUnavailable) {
  SetWriteGuardDisabledForTesting(true);
  EXPECT_FALSE(WriteGuardAvailable().ok());
  EXPECT_TRUE(WriteGuardMode().empty());
  Mapped m = MapMemfd(1);
  EXPECT_FALSE(WriteGuard::Arm(m.base, m.size).ok());
  SetWriteGuardDisabledForTesting(false);
  // Writable as ever: nothing was armed.
  *reinterpret_cast<volatile uint64_t*>(m.base) = 12;
  EXPECT_EQ(WordOf(m.fd.get(), 0), 12u);
  munmap(m.base, m.size);
}

}  // namespace
}  // namespace kvwire::transport::shm

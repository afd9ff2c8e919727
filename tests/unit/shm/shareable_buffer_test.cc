// ShareableBuffer and the registry the engine uses to recognise memfd-backed memory.
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kvwire/memory.h"
#include "src/util/pinned_ranges.h"
#include "transport/shm/shareable_registry.h"
#include "transport/shm/write_guard.h"

namespace kvwire {
namespace {

using transport::FindShareable;

size_t Page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

TEST(ShareableBufferTest, RoundsUpToPagesAndZeroFills) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(Page() + 1, "test");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), 2 * Page());
  ASSERT_NE(buffer->data(), nullptr);
  EXPECT_GE(buffer->fd(), 0);
  EXPECT_TRUE(std::all_of(buffer->data(), buffer->data() + buffer->size(),
                          [](std::byte b) { return b == std::byte{0}; }));
  std::memset(buffer->data(), 0x5a, buffer->size());  // writable end to end

  struct stat info;
  ASSERT_EQ(fstat(buffer->fd(), &info), 0);
  EXPECT_EQ(static_cast<size_t>(info.st_size), buffer->size());
  EXPECT_NE(fcntl(buffer->fd(), F_GETFD) & FD_CLOEXEC, 0);
  const int seals = fcntl(buffer->fd(), F_GET_SEALS);
  EXPECT_NE(seals & F_SEAL_SHRINK, 0);
  EXPECT_NE(seals & F_SEAL_GROW, 0);
  EXPECT_NE(ftruncate(buffer->fd(), 0), 0) << "the size must be sealed";
}

TEST(ShareableBufferTest, ExactPageSizeIsKept) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4 * Page());
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), 4 * Page());
}

TEST(ShareableBufferTest, RejectsZeroAndHugeLengths) {
  EXPECT_EQ(ShareableBuffer::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ShareableBuffer::Create(SIZE_MAX).ok());
}

TEST(ShareableBufferTest, SecondMappingSeesTheSameBytes) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(Page());
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  void* other = mmap(nullptr, Page(), PROT_READ | PROT_WRITE, MAP_SHARED, buffer->fd(), 0);
  ASSERT_NE(other, MAP_FAILED);
  std::memcpy(buffer->data() + 10, "hello", 5);
  EXPECT_EQ(std::memcmp(static_cast<char*>(other) + 10, "hello", 5), 0);
  static_cast<char*>(other)[100] = 'x';
  EXPECT_EQ(static_cast<char>(buffer->data()[100]), 'x');
  munmap(other, Page());
}

TEST(ShareableBufferTest, MoveTransfersOwnership) {
  absl::StatusOr<ShareableBuffer> created = ShareableBuffer::Create(Page());
  ASSERT_TRUE(created.ok()) << created.status();
  std::byte* const data = created->data();
  const int fd = created->fd();
  data[0] = std::byte{7};

  ShareableBuffer moved(std::move(*created));
  EXPECT_EQ(created->data(), nullptr);
  EXPECT_EQ(created->size(), 0u);
  EXPECT_EQ(created->fd(), -1);
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(moved.fd(), fd);
  EXPECT_EQ(moved.data()[0], std::byte{7});

  ShareableBuffer assigned;
  assigned = std::move(moved);
  EXPECT_EQ(moved.data(), nullptr);
  EXPECT_EQ(assigned.data(), data);
  EXPECT_EQ(assigned.size(), Page());

  // The registry follows the memory, not the object.
  std::optional<transport::ShareableBacking> backing = FindShareable(data, Page());
  ASSERT_TRUE(backing.has_value());
  EXPECT_EQ(backing->fd, fd);

  // Move-assigning over a live buffer releases it.
  absl::StatusOr<ShareableBuffer> second = ShareableBuffer::Create(Page());
  ASSERT_TRUE(second.ok());
  std::byte* const second_data = second->data();
  assigned = std::move(*second);
  EXPECT_EQ(assigned.data(), second_data);
  EXPECT_FALSE(FindShareable(data, 1).has_value());
  EXPECT_EQ(fcntl(fd, F_GETFD), -1) << "the first buffer's memfd must be closed";
}

TEST(ShareableRegistryTest, FindsSubRanges) {
  absl::StatusOr<ShareableBuffer> a = ShareableBuffer::Create(4 * Page());
  absl::StatusOr<ShareableBuffer> b = ShareableBuffer::Create(2 * Page());
  ASSERT_TRUE(a.ok() && b.ok());

  std::optional<transport::ShareableBacking> whole = FindShareable(a->data(), a->size());
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->fd, a->fd());
  EXPECT_EQ(whole->offset, 0u);

  std::optional<transport::ShareableBacking> inner = FindShareable(a->data() + 123, 1000);
  ASSERT_TRUE(inner.has_value());
  EXPECT_EQ(inner->fd, a->fd());
  EXPECT_EQ(inner->offset, 123u);

  std::optional<transport::ShareableBacking> tail = FindShareable(a->data() + a->size() - 1, 1);
  ASSERT_TRUE(tail.has_value());
  EXPECT_EQ(tail->offset, a->size() - 1);

  std::optional<transport::ShareableBacking> in_b = FindShareable(b->data() + Page(), Page());
  ASSERT_TRUE(in_b.has_value());
  EXPECT_EQ(in_b->fd, b->fd());
  EXPECT_EQ(in_b->offset, Page());

  EXPECT_FALSE(FindShareable(a->data() + 1, a->size()).has_value()) << "runs past the end";
  EXPECT_FALSE(FindShareable(a->data() + a->size(), 1).has_value()) << "one past the end";
  EXPECT_FALSE(FindShareable(a->data() - 1, 2).has_value()) << "starts before";
  std::vector<std::byte> heap(64);
  EXPECT_FALSE(FindShareable(heap.data(), heap.size()).has_value()) << "plain heap memory";
  EXPECT_FALSE(FindShareable(nullptr, 0).has_value());
}

TEST(ShareableRegistryTest, ForgetsDestroyedBuffers) {
  std::byte* data = nullptr;
  {
    absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(Page());
    ASSERT_TRUE(buffer.ok());
    data = buffer->data();
    ASSERT_TRUE(FindShareable(data, 8).has_value());
  }
  EXPECT_FALSE(FindShareable(data, 8).has_value());
}

TEST(ShareableRegistryTest, ConcurrentCreateFindDestroy) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&failures] {
      for (int i = 0; i < kRounds; ++i) {
        absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(Page());
        if (!buffer.ok()) {
          ++failures;
          continue;
        }
        std::optional<transport::ShareableBacking> backing = FindShareable(buffer->data() + 8, 16);
        if (!backing.has_value() || backing->fd != buffer->fd() || backing->offset != 8) {
          ++failures;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

// Revocation moves the buffer onto a fresh memfd (shareable_registry.h): the owner keeps its
// bytes at the same addresses, fd() names the new memfd, and whoever holds the old one (a
// peer's mapping) shares nothing with the owner from then on, either way.
TEST(ShareableBufferTest, MovingTheBufferKeepsItsBytesAndLeavesTheOldMemfdBehind) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4 * Page(), "moved");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  // Pages 0 and 2 written, 1 and 3 never touched (holes stay holes, and read as zero).
  std::memset(buffer->data(), 0x11, Page());
  std::memset(buffer->data() + 2 * Page(), 0x22, Page());
  // A read-only export sealed the memfd against writes; the new one must be sealed the same.
  ASSERT_EQ(fcntl(buffer->fd(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SEAL), 0);
  const int old_seals = fcntl(buffer->fd(), F_GET_SEALS);
  const int old_fd = dup(buffer->fd());  // what a peer holds
  ASSERT_GE(old_fd, 0);
  auto* peer =
      static_cast<std::byte*>(mmap(nullptr, buffer->size(), PROT_READ, MAP_SHARED, old_fd, 0));
  ASSERT_NE(peer, MAP_FAILED);
  std::byte* const data = buffer->data();
  const int fd = buffer->fd();
  struct stat before;
  ASSERT_EQ(fstat(fd, &before), 0);

  ASSERT_TRUE(transport::shm::RebackShareable(data + Page()).ok());
  EXPECT_EQ(buffer->data(), data);
  EXPECT_EQ(buffer->fd(), fd);
  struct stat after;
  ASSERT_EQ(fstat(fd, &after), 0);
  EXPECT_NE(after.st_ino, before.st_ino) << "fd() still names the old memfd";
  EXPECT_EQ(after.st_size, before.st_size);
  // The holes stayed holes: the copy allocated no page the old memfd did not have.
  EXPECT_LE(after.st_blocks, before.st_blocks);
  EXPECT_GT(after.st_blocks, 0);
  EXPECT_EQ(fcntl(fd, F_GET_SEALS), old_seals);
  EXPECT_NE(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
  for (size_t i = 0; i < buffer->size(); ++i) {
    const std::byte want = i < Page()                            ? std::byte{0x11}
                           : (i >= 2 * Page() && i < 3 * Page()) ? std::byte{0x22}
                                                                 : std::byte{0};
    ASSERT_EQ(data[i], want) << "byte " << i;
  }
  // The owner's writes no longer reach the old memfd (and the owner stays writable).
  std::memset(data, 0x33, buffer->size());
  EXPECT_EQ(peer[0], std::byte{0x11});
  EXPECT_EQ(peer[2 * Page()], std::byte{0x22});
  // The registry serves the new memfd.
  absl::StatusOr<std::optional<transport::shm::ShareableDup>> served =
      transport::shm::DupShareable(data, buffer->size(), 0, /*with_epoch=*/false);
  ASSERT_TRUE(served.ok() && served->has_value());
  struct stat dup_info;
  ASSERT_EQ(fstat((*served)->fd.get(), &dup_info), 0);
  EXPECT_EQ(dup_info.st_ino, after.st_ino);
  munmap(peer, buffer->size());
  close(old_fd);

  std::vector<std::byte> heap(Page());
  EXPECT_EQ(transport::shm::RebackShareable(heap.data()).code(), absl::StatusCode::kNotFound);
}

TEST(ShareableBufferTest, ABufferAPinnedRangeTouchesIsNotMoved) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(2 * Page(), "pinned");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  struct stat before;
  ASSERT_EQ(fstat(buffer->fd(), &before), 0);
  {
    PinnedRange pinned(buffer->data() + Page() + 8, 16);  // as an rdma MR holds it
    EXPECT_TRUE(AnyPinned(buffer->data(), buffer->size()));
    const absl::Status moved = transport::shm::RebackShareable(buffer->data());
    EXPECT_EQ(moved.code(), absl::StatusCode::kFailedPrecondition) << moved;
    struct stat still;
    ASSERT_EQ(fstat(buffer->fd(), &still), 0);
    EXPECT_EQ(still.st_ino, before.st_ino);
  }
  EXPECT_FALSE(AnyPinned(buffer->data(), buffer->size()));
  EXPECT_TRUE(transport::shm::RebackShareable(buffer->data()).ok());
}

// The cost of one move (revocation), for docs/SECURITY.md: not run by default (it allocates
// twice the buffer); KVWIRE_MOVE_MIB sets the size (default 1024); KVWIRE_MOVE_UNGUARDED=1
// moves without the write guard (its cost is the difference).
TEST(ShareableBufferTest, DISABLED_MoveCost) {
  const char* unguarded = std::getenv("KVWIRE_MOVE_UNGUARDED");
  transport::shm::SetWriteGuardDisabledForTesting(unguarded != nullptr &&
                                                  std::string(unguarded) == "1");
  std::printf("write guard: %s\n", transport::shm::WriteGuardAvailable().ok() ? "on" : "off");
  const char* mib_text = std::getenv("KVWIRE_MOVE_MIB");
  const size_t mib = mib_text != nullptr ? std::strtoull(mib_text, nullptr, 10) : 1024;
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(mib << 20, "move-cost");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memset(buffer->data(), 0x5a, buffer->size());  // every page written
  for (int i = 0; i < 3; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(transport::shm::RebackShareable(buffer->data()).ok());
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("move of %zu MiB (all pages written): %.1f ms, %.1f ms/GiB, %.2f GiB/s\n", mib, ms,
                ms * 1024.0 / static_cast<double>(mib),
                static_cast<double>(mib) / 1024.0 / (ms / 1000.0));
    // The floor under the same load: one memcpy into memory touched for the first time.
    const auto copy_start = std::chrono::steady_clock::now();
    std::vector<std::byte> copy(buffer->data(), buffer->data() + buffer->size());
    const double copy_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - copy_start)
            .count();
    std::printf("  a plain copy into fresh heap memory: %.1f ms, %.2f GiB/s (byte %d)\n", copy_ms,
                static_cast<double>(mib) / 1024.0 / (copy_ms / 1000.0),
                static_cast<int>(copy[copy.size() / 2]));
  }
  transport::shm::SetWriteGuardDisabledForTesting(false);
}

}  // namespace
}  // namespace kvwire

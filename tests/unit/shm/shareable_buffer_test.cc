// ShareableBuffer and the registry the engine uses to recognise memfd-backed memory.
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fcntl.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kvwire/memory.h"
#include "transport/shm/shareable_registry.h"

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

}  // namespace
}  // namespace kvwire

// Mapping of a peer's memfd: the pre-fault at map time (Prefault) touches every page without
// changing a byte, also while the owner writes, and maps read-only ranges too. (What the
// pre-fault is for, the first requests through a new mapping costing what later ones do, is a
// timing: `kvwire-transfer-driver --first-touch 10` measures it; tests assert no speed.)
#include "transport/shm/mapping.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include "transport/shm/unique_fd.h"

namespace kvwire::transport::shm {
namespace {

// A memfd of `pages` pages, each byte set to its index modulo 251, and the owner's mapping.
struct Memfd {
  explicit Memfd(size_t pages) : bytes(pages * PageSize()) {
    fd = UniqueFd(::memfd_create("kvwire-mapping-test", MFD_CLOEXEC));
    EXPECT_TRUE(fd.valid());
    EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(bytes)), 0);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    EXPECT_NE(p, MAP_FAILED);
    owner = static_cast<std::byte*>(p);
    for (size_t i = 0; i < bytes; ++i) owner[i] = static_cast<std::byte>(i % 251);
  }
  ~Memfd() { ::munmap(owner, bytes); }
  size_t bytes;
  UniqueFd fd;
  std::byte* owner = nullptr;
};

TEST(MappingTest, PopulatedMappingKeepsEveryByte) {
  Memfd memfd(5);
  const size_t page = PageSize();
  // Unaligned start: the pre-fault also touches the page below it, inside the file.
  absl::StatusOr<Mapping> writable = Mapping::Create(memfd.fd.get(), page + 100, 3 * page,
                                                     PROT_READ | PROT_WRITE, /*populate=*/true);
  ASSERT_TRUE(writable.ok()) << writable.status();
  absl::StatusOr<Mapping> read_only =
      Mapping::Create(memfd.fd.get(), 0, memfd.bytes, PROT_READ, /*populate=*/true);
  ASSERT_TRUE(read_only.ok()) << read_only.status();
  for (size_t i = 0; i < memfd.bytes; ++i) {
    ASSERT_EQ(memfd.owner[i], static_cast<std::byte>(i % 251)) << "byte " << i;
  }
  EXPECT_EQ(std::memcmp(writable->data(), memfd.owner + page + 100, 3 * page), 0);
  EXPECT_EQ(std::memcmp(read_only->data(), memfd.owner, memfd.bytes), 0);
}

TEST(MappingTest, PrefaultLosesNoConcurrentWrite) {
  constexpr size_t kPages = 16;
  Memfd memfd(kPages);
  const size_t page = PageSize();
  void* second =
      ::mmap(nullptr, memfd.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.fd.get(), 0);
  ASSERT_NE(second, MAP_FAILED);
  // The owner counts up the first word of every page while the peer's mapping is pre-faulted
  // again and again: each pre-fault writes back what it read, atomically, so the owner's last
  // values survive.
  std::atomic<bool> stop{false};
  std::vector<uint64_t> last(kPages, 0);
  std::thread owner([&] {
    for (uint64_t value = 1; !stop.load(std::memory_order_relaxed) || value < 1000; ++value) {
      for (size_t p = 0; p < kPages; ++p) {
        auto* word = reinterpret_cast<uint64_t*>(memfd.owner + p * page);
        std::atomic_ref<uint64_t>(*word).store(value, std::memory_order_relaxed);
        last[p] = value;
      }
    }
  });
  for (int round = 0; round < 200; ++round) {
    Prefault(static_cast<std::byte*>(second), memfd.bytes, /*writable=*/true);
  }
  stop.store(true);
  owner.join();
  for (size_t p = 0; p < kPages; ++p) {
    auto* word = reinterpret_cast<uint64_t*>(memfd.owner + p * page);
    EXPECT_EQ(std::atomic_ref<uint64_t>(*word).load(), last[p]) << "page " << p;
    // The rest of the page is untouched.
    EXPECT_EQ(memfd.owner[p * page + 8], static_cast<std::byte>((p * page + 8) % 251));
  }
  ::munmap(second, memfd.bytes);
}

}  // namespace
}  // namespace kvwire::transport::shm

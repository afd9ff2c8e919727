// The shared harnesses themselves: a defect in one would let every test built on it pass for
// the wrong reason (a fake target that serves out of bounds, a driver that runs with a default
// instead of refusing a wrong flag, a read that waits past its deadline).
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

#include "tests/support/fake_target_hooks.h"
#include "tests/support/flags.h"
#include "tests/support/socket_io.h"

namespace kvwire::testing {
namespace {

// --- FakeTargetHooks ---------------------------------------------------------------------

TEST(FakeTargetHooks, ServesOnlyInsideAnExportedRegionWithItsPermission) {
  FakeTargetHooks hooks(OnePeer("t", 5));
  const RegionId rw = hooks.AllocateRegion(4096, kRemoteReadWrite);
  const RegionId ro = hooks.AllocateRegion(4096, kRemoteRead);
  const RegionId hidden = hooks.AllocateRegion(4096, kRemoteReadWrite, /*exported=*/false);

  {
    auto access = hooks.ResolveIncoming(5, rw, 4000, 96, OpKind::kWrite);
    ASSERT_TRUE(access.ok()) << access.status();
    EXPECT_EQ(access->data, hooks.data(rw) + 4000);
    EXPECT_EQ(hooks.pins_alive(), 1);
  }
  EXPECT_TRUE(hooks.WaitPinsReleased(absl::Seconds(5)));

  EXPECT_EQ(hooks.ResolveIncoming(5, rw, 4000, 97, OpKind::kRead).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(hooks.ResolveIncoming(5, rw, 4097, 0, OpKind::kRead).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(hooks.ResolveIncoming(5, rw, 1, UINT64_MAX, OpKind::kRead).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(hooks.ResolveIncoming(5, ro, 0, 8, OpKind::kWrite).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(hooks.ResolveIncoming(5, ro, 0, 8, OpKind::kRead).ok());
  EXPECT_EQ(hooks.ResolveIncoming(5, hidden, 0, 8, OpKind::kRead).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(hooks.ResolveIncoming(5, 99, 0, 8, OpKind::kRead).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(hooks.ExportedRegion(5, hidden).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(hooks.ExportedRegion(5, 99).status().code(), absl::StatusCode::kNotFound);
  hooks.SetExported(hidden, true);
  EXPECT_TRUE(hooks.ExportedRegion(5, hidden).ok());
}

TEST(FakeTargetHooks, LetsInOnlyItsTokensAndCountsWhatItIsTold) {
  FakeTargetHooks hooks(OnePeer("t", 5, /*pid=*/42));
  EXPECT_EQ(hooks.PeerForToken("t").value_or(0), 5u);
  EXPECT_EQ(hooks.PeerForToken("u").status().code(), absl::StatusCode::kUnauthenticated);
  hooks.AddToken("u", 6);
  EXPECT_EQ(hooks.PeerForToken("u").value_or(0), 6u);
  EXPECT_EQ(hooks.PeerProcessId(5), 42u);

  FakeTargetHooks open(AnyToken(9));
  EXPECT_EQ(open.PeerForToken("anything").value_or(0), 9u);
  EXPECT_EQ(open.PeerProcessId(9), 0u);

  hooks.OnWriteArrived(5, 100);
  hooks.OnWriteArrived(5, 100);
  hooks.OnWriteArrived(6, 100);
  EXPECT_EQ(hooks.arrivals(5, 100), 2);
  EXPECT_EQ(hooks.arrivals(100), 3);
  EXPECT_EQ(hooks.arrivals(101), 0);
  EXPECT_FALSE(hooks.WaitPeerErrors(1, absl::Milliseconds(10)));
  hooks.OnPeerError(6, absl::DataLossError("x"));
  EXPECT_TRUE(hooks.WaitPeerErrors(1, absl::Seconds(5)));
  ASSERT_EQ(hooks.peer_errors().size(), 1u);
  EXPECT_EQ(hooks.peer_errors()[0].first, 6u);
}

// --- FlagParser --------------------------------------------------------------------------

TEST(FlagParser, SetsDeclaredFlagsAndRefusesAnythingElse) {
  std::string name = "default";
  int count = 0;
  uint64_t address = 0;
  bool on = false;
  auto parse = [&](std::vector<std::string> args) {
    std::vector<char*> argv = {const_cast<char*>("prog")};
    for (std::string& a : args) argv.push_back(a.data());
    return FlagParser()
        .String("name", &name)
        .Int("count", &count)
        .HexInt("address", &address)
        .Bool("on", &on)
        .Parse(static_cast<int>(argv.size()), argv.data());
  };
  ASSERT_TRUE(parse({"--name=a=b", "--count=-3", "--address=0x1f", "--on=1"}).ok());
  EXPECT_EQ(name, "a=b");
  EXPECT_EQ(count, -3);
  EXPECT_EQ(address, 0x1fu);
  EXPECT_TRUE(on);
  EXPECT_TRUE(parse({"--name="}).ok());
  EXPECT_EQ(name, "");

  for (std::vector<std::string> bad : std::vector<std::vector<std::string>>{{"--count=x"},
                                                                            {"--count=12x"},
                                                                            {"--count=99999999999"},
                                                                            {"--address=zz"},
                                                                            {"--on=maybe"},
                                                                            {"--other=1"},
                                                                            {"--count"},
                                                                            {"count=1"},
                                                                            {"-count=1"}}) {
    absl::Status s = parse(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad[0] << ": " << s;
  }
}

// --- socket_io ---------------------------------------------------------------------------

class SocketIo : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds_), 0); }
  void TearDown() override {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  int fds_[2] = {-1, -1};
};

TEST_F(SocketIo, StringsCrossAndEveryReadEndsByItsDeadline) {
  const absl::Time soon = absl::Now() + absl::Seconds(10);
  ASSERT_TRUE(WriteString(fds_[0], std::string(10000, 'x'), soon));
  std::string got;
  ASSERT_TRUE(ReadString(fds_[1], &got, soon));
  EXPECT_EQ(got, std::string(10000, 'x'));

  // Nothing written: the read gives up at its deadline, not later.
  const absl::Time start = absl::Now();
  char byte;
  EXPECT_FALSE(ReadAll(fds_[1], &byte, 1, start + absl::Milliseconds(100)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(ClosedBy(fds_[1], absl::Now() + absl::Milliseconds(50)));

  // A length beyond the limit is refused without reading on.
  ASSERT_TRUE(WriteString(fds_[0], "12345", soon));
  EXPECT_FALSE(ReadString(fds_[1], &got, soon, /*max_bytes=*/4));

  close(fds_[0]);
  fds_[0] = -1;
  EXPECT_TRUE(ClosedBy(fds_[1], absl::Now() + absl::Seconds(5)));
  EXPECT_FALSE(ReadAll(fds_[1], &byte, 1, absl::Now() + absl::Seconds(5)));
}

}  // namespace
}  // namespace kvwire::testing

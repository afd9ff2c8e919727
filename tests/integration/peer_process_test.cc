// The harness judges the second process: a peer that fails must fail the test that ran it.
// Each case plants a peer that ends badly and checks that PeerProcess::Stop reports it as a
// (non-fatal) gtest failure; the clean and deliberate-kill cases check it stays quiet.
#include "tests/integration/peer_process.h"

#include <signal.h>

#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"

#include "tests/support/sanitizer_build.h"

namespace kvwire::testing {
namespace {

std::unique_ptr<PeerProcess> StartPeer(std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--transport=tcp", "--regions=1", "--region_bytes=4096"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto peer = PeerProcess::Start(args);
  EXPECT_TRUE(peer.ok()) << peer.status();
  return peer.ok() ? std::move(*peer) : nullptr;
}

TEST(PeerProcessTest, CleanExitIsNotAFailure) {
  auto peer = StartPeer();
  ASSERT_NE(peer, nullptr);
  peer->Stop();
  EXPECT_EQ(peer->end_problem(), "");
}

TEST(PeerProcessTest, NonZeroExitFailsTheTest) {
  auto peer = StartPeer({"--exit_code=23"});  // LeakSanitizer's exit code
  ASSERT_NE(peer, nullptr);
  EXPECT_NONFATAL_FAILURE(peer->Stop(), "exited with status 23");
}

TEST(PeerProcessTest, SignalTheTestDidNotSendFailsTheTest) {
  auto peer = StartPeer();
  ASSERT_NE(peer, nullptr);
  // SIGKILL, not SIGSEGV: a sanitizer runtime catches SIGSEGV and exits with its own status.
  ASSERT_EQ(kill(peer->pid(), SIGKILL), 0);  // as if the OOM killer took the peer
  EXPECT_NONFATAL_FAILURE(peer->Stop(), "died of signal 9");
}

TEST(PeerProcessTest, HangOnExitFailsTheTest) {
  auto peer = StartPeer({"--linger_s=30"});
  ASSERT_NE(peer, nullptr);
  EXPECT_NONFATAL_FAILURE(peer->Stop(absl::Milliseconds(500)), "was killed");
}

TEST(PeerProcessTest, DeliberateKillIsNotAFailure) {
  auto peer = StartPeer();
  ASSERT_NE(peer, nullptr);
  peer->Signal(SIGKILL);
  peer->Stop();
  EXPECT_EQ(peer->end_problem(), "");
}

#if KVWIRE_TEST_ASAN || KVWIRE_TEST_TSAN
// A real report of this build's sanitizer in the peer (a data race under TSan, a heap
// overflow under ASan) makes it exit non-zero, and that fails the test. Only in sanitizer
// builds: elsewhere there is no report to plant.
TEST(PeerProcessTest, SanitizerReportInThePeerFailsTheTest) {
  auto peer = StartPeer({"--sanitizer_report=1"});
  ASSERT_NE(peer, nullptr);
  EXPECT_NONFATAL_FAILURE(peer->Stop(absl::Seconds(60)), "exited with status");
}
#endif

}  // namespace
}  // namespace kvwire::testing

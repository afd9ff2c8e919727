// The shm fd socket lives in the abstract namespace, so any local process of any uid can
// connect to it. These tests connect as such a process would, over real sockets (and, for the
// per-uid cap, from a second process under another uid): connections that never present a
// token must not keep legitimate peers out, and a valid token must never be served before the
// pid its peer handshook from is known.
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <grp.h>
#include <memory>
#include <optional>
#include <poll.h>
#include <signal.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/memory.h"
#include "tests/support/fake_target_hooks.h"
#include "tests/support/socket_io.h"
#include "transport/shm/fd_client.h"
#include "transport/shm/fd_protocol.h"
#include "transport/shm/seqpacket.h"
#include "transport/shm/shareable_registry.h"
#include "transport/shm/shm_endpoint.h"
#include "transport/shm/shm_transport.h"

namespace kvwire::transport {
namespace {

using ::kvwire::testing::ClosedBy;
using ::kvwire::testing::FakeTargetHooks;
using ::kvwire::testing::OnePeer;
using ::testing::HasSubstr;

constexpr PeerId kPeer = 7;
constexpr char kToken[] = "session-token-of-peer-7";
constexpr RegionId kRegion = 1;
constexpr uid_t kOtherUid = 65533;  // the squatter's uid when the test runs as root

std::string SocketName(const std::string& endpoint_text) {
  absl::StatusOr<shm::ShmEndpoint> endpoint = shm::ParseEndpoint(endpoint_text);
  EXPECT_TRUE(endpoint.ok()) << endpoint.status();
  return endpoint.ok() ? endpoint->socket_name : std::string();
}

class FdServerAuthTest : public ::testing::Test {
 protected:
  void StartTransport(size_t max_connections, size_t max_unauthenticated_per_uid,
                      absl::Duration auth_timeout) {
    absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4096, "fd-auth");
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffer_ = *std::move(buffer);
    for (size_t i = 0; i < buffer_.size(); ++i) {
      buffer_.data()[i] = static_cast<std::byte>(i * 7 + 3);
    }
    LocalRegion region;
    region.id = kRegion;
    region.base = buffer_.data();
    region.length = buffer_.size();
    region.access = kRemoteReadWrite;
    ASSERT_TRUE(FindShareable(buffer_.data(), buffer_.size()).has_value());
    hooks_.AddRegion(region);

    ShmTransportOptions options;
    options.engine_name = "fd-auth";
    options.max_connections = max_connections;
    options.max_unauthenticated_per_uid = max_unauthenticated_per_uid;
    options.auth_timeout = auth_timeout;
    absl::StatusOr<std::unique_ptr<Transport>> transport = CreateShmTransport(options, &hooks_);
    ASSERT_TRUE(transport.ok()) << transport.status();
    transport_ = *std::move(transport);
    ASSERT_TRUE(transport_->RegisterRegion(region).ok());
    socket_name_ = SocketName(transport_->Endpoint());
  }

  void TearDown() override {
    if (transport_) transport_->Shutdown();
  }

  shm::UniqueFd Connect() {
    absl::StatusOr<shm::UniqueFd> socket =
        shm::ConnectSeqpacket(socket_name_, absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(socket.ok()) << socket.status();
    return socket.ok() ? *std::move(socket) : shm::UniqueFd();
  }

  absl::StatusOr<shm::FdResponse> Call(int socket, shm::FdRequestKind kind) {
    shm::FdRequest request;
    request.kind = kind;
    request.region = kRegion;
    request.token = kToken;
    return shm::CallFdServer(socket, request, absl::Now() + absl::Seconds(10));
  }

  // A legitimate peer: fetches the region's memfd and reads it back byte-exact.
  void ExpectServed() {
    shm::UniqueFd socket = Connect();
    ASSERT_TRUE(socket.valid());
    absl::StatusOr<shm::FdResponse> response = Call(socket.get(), shm::FdRequestKind::kFetch);
    ASSERT_TRUE(response.ok()) << response.status();
    ASSERT_EQ(response->reply.code, absl::StatusCode::kOk) << response->reply.message;
    ASSERT_TRUE(response->fd.valid());
    ASSERT_EQ(response->reply.length, buffer_.size());
    void* map = mmap(nullptr, response->reply.memfd_offset + response->reply.length, PROT_READ,
                     MAP_SHARED, response->fd.get(), 0);
    ASSERT_NE(map, MAP_FAILED) << strerror(errno);
    EXPECT_EQ(std::memcmp(static_cast<const char*>(map) + response->reply.memfd_offset,
                          buffer_.data(), buffer_.size()),
              0);
    munmap(map, response->reply.memfd_offset + response->reply.length);
  }

  // The peer "handshook" from this process (set_peer_pid(0): not published yet).
  FakeTargetHooks hooks_{OnePeer(kToken, kPeer)};
  ShareableBuffer buffer_;
  std::unique_ptr<Transport> transport_;
  std::string socket_name_;
};

// Connections that never send a byte take every slot; the server closes them at the
// authentication deadline, and a legitimate peer is then served.
TEST_F(FdServerAuthTest, IdleSquattersAreCutAtTheDeadline) {
  constexpr size_t kSlots = 4;
  StartTransport(kSlots, kSlots, absl::Seconds(1));
  std::vector<shm::UniqueFd> squatters;
  for (size_t i = 0; i < kSlots; ++i) squatters.push_back(Connect());
  // While they hold every slot, one more connection is refused.
  {
    shm::UniqueFd refused = Connect();
    EXPECT_TRUE(ClosedBy(refused.get(), absl::Now() + absl::Seconds(5)))
        << "a connection beyond max_connections was kept";
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (size_t i = 0; i < kSlots; ++i) {
    EXPECT_TRUE(ClosedBy(squatters[i].get(), deadline))
        << "idle connection " << i << " still open 10 s after a 1 s auth_timeout";
  }
  ExpectServed();
}

// Another uid fills its own quota of unauthenticated connections; the rest of its connections
// are refused, so slots remain for this uid's legitimate peer.
TEST_F(FdServerAuthTest, OneUidCannotTakeEverySlot) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the squatter under another uid";
  constexpr size_t kSlots = 8;
  constexpr size_t kPerUid = 2;
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  // Forked before the transport starts its thread.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(fds[0]);
    char name[256] = {};
    ssize_t n = read(fds[1], name, sizeof(name) - 1);
    if (n <= 0) _exit(2);
    if (setgroups(0, nullptr) != 0 || setresgid(kOtherUid, kOtherUid, kOtherUid) != 0 ||
        setresuid(kOtherUid, kOtherUid, kOtherUid) != 0) {
      _exit(3);
    }
    // Open every slot the server has, and report how many it kept.
    std::vector<shm::UniqueFd> held;
    for (size_t i = 0; i < kSlots; ++i) {
      absl::StatusOr<shm::UniqueFd> socket =
          shm::ConnectSeqpacket(std::string(name, n), absl::Now() + absl::Seconds(10));
      if (!socket.ok()) _exit(4);
      held.push_back(*std::move(socket));
    }
    uint32_t kept = 0;
    for (const shm::UniqueFd& socket : held) {
      if (!ClosedBy(socket.get(), absl::Now() + absl::Milliseconds(300))) ++kept;
    }
    if (write(fds[1], &kept, sizeof(kept)) != sizeof(kept)) _exit(5);
    char done;
    (void)read(fds[1], &done, 1);  // holds its connections until told to exit
    _exit(0);
  }
  close(fds[1]);
  shm::UniqueFd control(fds[0]);
  StartTransport(kSlots, kPerUid, absl::Seconds(30));
  ASSERT_EQ(write(control.get(), socket_name_.data(), socket_name_.size()),
            static_cast<ssize_t>(socket_name_.size()));
  pollfd entry{control.get(), POLLIN, 0};
  ASSERT_EQ(poll(&entry, 1, 20000), 1) << "the squatter did not report";
  uint32_t kept = 0;
  ASSERT_EQ(read(control.get(), &kept, sizeof(kept)), static_cast<ssize_t>(sizeof(kept)));
  EXPECT_EQ(kept, kPerUid) << "connections of uid " << kOtherUid << " kept without a token";
  // The squatter still holds its connections (well within auth_timeout): this uid is served.
  ExpectServed();
  control.Reset();
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "squatter status " << status;
}

// A valid token whose peer's handshake pid is not known (the engine reports 0) is refused at
// the deadline with an error that says so, never served unchecked.
TEST_F(FdServerAuthTest, TokenIsNotServedWhileThePeerPidIsUnknown) {
  StartTransport(16, 16, absl::Seconds(1));
  hooks_.set_peer_pid(0);
  shm::UniqueFd socket = Connect();
  ASSERT_TRUE(socket.valid());
  absl::StatusOr<shm::FdResponse> response = Call(socket.get(), shm::FdRequestKind::kFetch);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->reply.code, absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(response->reply.message, HasSubstr("handshake pid was not known"));
  EXPECT_FALSE(response->fd.valid()) << "a memfd was served without the pid check";
  EXPECT_TRUE(ClosedBy(socket.get(), absl::Now() + absl::Seconds(5)));
}

// The legitimate race: the peer asks before this side has published it. Its request waits
// and is served once the pid is known.
TEST_F(FdServerAuthTest, RequestWaitsForThePeerToBePublished) {
  StartTransport(16, 16, absl::Seconds(10));
  hooks_.set_peer_pid(0);
  shm::UniqueFd socket = Connect();
  ASSERT_TRUE(socket.valid());
  std::thread publish([this] {
    absl::SleepFor(absl::Milliseconds(200));
    hooks_.set_peer_pid(static_cast<uint32_t>(getpid()));
  });
  absl::StatusOr<shm::FdResponse> response = Call(socket.get(), shm::FdRequestKind::kHello);
  publish.join();
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->reply.code, absl::StatusCode::kOk) << response->reply.message;
  ExpectServed();
}

}  // namespace
}  // namespace kvwire::transport

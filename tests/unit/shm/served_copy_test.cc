// Served copies at the fd server (transport/shm/served_copy.h), driven over a real socket as a
// peer would drive them, hostile ones included: the staging memfd, a READ copied into a slot
// and a WRITE copied out of one, byte-exact; and every request the server must refuse (no
// staging asked, a slot that does not exist, ops that overrun their slot, an op the engine
// refuses) answers an error, reports the peer to the engine and closes the connection, with
// no pin left behind.
#include "transport/shm/served_copy.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cstring>
#include <fcntl.h>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "tests/support/fake_target_hooks.h"
#include "transport/shm/fd_client.h"
#include "transport/shm/fd_protocol.h"
#include "transport/shm/seqpacket.h"
#include "transport/shm/shm_endpoint.h"
#include "transport/shm/shm_transport.h"

namespace kvwire::transport {
namespace {

using ::kvwire::testing::FakeTargetHooks;
using ::kvwire::testing::OnePeer;
using ::testing::HasSubstr;

constexpr PeerId kPeer = 7;
constexpr char kToken[] = "session-token-of-peer-7";
constexpr uint64_t kRegionBytes = 64 * 1024;
constexpr absl::Duration kWait = absl::Seconds(10);

class ServedCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    region_ = hooks_.AllocateRegion(kRegionBytes, kRemoteReadWrite);
    std::byte* data = hooks_.data(region_);
    for (uint64_t i = 0; i < kRegionBytes; ++i) data[i] = static_cast<std::byte>(i * 13 + 5);
    ShmTransportOptions options;
    options.engine_name = "served-copy";
    absl::StatusOr<std::unique_ptr<Transport>> transport = CreateShmTransport(options, &hooks_);
    ASSERT_TRUE(transport.ok()) << transport.status();
    transport_ = *std::move(transport);
    absl::StatusOr<shm::ShmEndpoint> endpoint = shm::ParseEndpoint(transport_->Endpoint());
    ASSERT_TRUE(endpoint.ok()) << endpoint.status();
    socket_name_ = endpoint->socket_name;
  }
  void TearDown() override {
    if (transport_) transport_->Shutdown();
  }

  shm::UniqueFd Connect() {
    absl::StatusOr<shm::UniqueFd> socket = shm::ConnectSeqpacket(socket_name_, absl::Now() + kWait);
    EXPECT_TRUE(socket.ok()) << socket.status();
    return socket.ok() ? *std::move(socket) : shm::UniqueFd();
  }
  absl::StatusOr<shm::FdResponse> Call(int socket, const shm::FdRequest& request) {
    return shm::CallFdServer(socket, request, absl::Now() + kWait);
  }
  // Asks for the staging memfd and maps it.
  std::byte* Stage(int socket) {
    shm::FdRequest ask;
    ask.kind = shm::FdRequestKind::kStaging;
    ask.token = kToken;
    absl::StatusOr<shm::FdResponse> response = Call(socket, ask);
    EXPECT_TRUE(response.ok()) << response.status();
    if (!response.ok() || response->reply.code != absl::StatusCode::kOk) return nullptr;
    const size_t bytes = shm::kCopySlots * shm::kCopySlotBytes;
    void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, response->fd.get(), 0);
    EXPECT_NE(map, MAP_FAILED) << strerror(errno);
    if (map == MAP_FAILED) return nullptr;
    maps_.push_back(map);
    return static_cast<std::byte*>(map);
  }
  static shm::FdRequest Copy(OpKind kind, uint32_t slot, std::vector<shm::CopyOp> ops) {
    shm::FdRequest request;
    request.kind = shm::FdRequestKind::kCopy;
    request.region = 41;
    request.token = kToken;
    request.copy_kind = kind;
    request.slot = slot;
    request.ops = std::move(ops);
    return request;
  }
  // A copy request the server must refuse: an error reply that says `says`, the peer
  // reported, the connection closed, no pin kept.
  void ExpectRefused(bool stage, const shm::FdRequest& request, const std::string& says) {
    shm::UniqueFd socket = Connect();
    ASSERT_TRUE(socket.valid());
    if (stage) ASSERT_NE(Stage(socket.get()), nullptr);
    const size_t errors = hooks_.peer_errors().size();
    absl::StatusOr<shm::FdResponse> response = Call(socket.get(), request);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_NE(response->reply.code, absl::StatusCode::kOk);
    EXPECT_THAT(response->reply.message, HasSubstr(says));
    EXPECT_TRUE(hooks_.WaitPeerErrors(errors + 1, kWait)) << "the peer was not reported";
    absl::StatusOr<shm::ReceivedMessage> after =
        shm::ReceiveMessage(socket.get(), shm::kMaxFdMessageBytes, absl::Now() + kWait);
    EXPECT_TRUE(!after.ok() || after->eof) << "the connection was kept open";
    EXPECT_TRUE(hooks_.WaitPinsReleased(kWait));
  }

  ~ServedCopyTest() override {
    for (void* map : maps_) munmap(map, shm::kCopySlots * shm::kCopySlotBytes);
  }

  FakeTargetHooks hooks_{OnePeer(kToken, kPeer)};
  RegionId region_ = 0;
  std::unique_ptr<Transport> transport_;
  std::string socket_name_;
  std::vector<void*> maps_;
};

TEST_F(ServedCopyTest, StagingIsASealedMemfdOfItsSlots) {
  shm::UniqueFd socket = Connect();
  shm::FdRequest ask;
  ask.kind = shm::FdRequestKind::kStaging;
  ask.token = kToken;
  absl::StatusOr<shm::FdResponse> response = Call(socket.get(), ask);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->reply.code, absl::StatusCode::kOk) << response->reply.message;
  EXPECT_EQ(response->reply.length, shm::kCopySlotBytes);
  EXPECT_EQ(response->reply.flags, shm::kCopySlots);
  ASSERT_TRUE(response->fd.valid());
  const int seals = fcntl(response->fd.get(), F_GET_SEALS);
  EXPECT_NE(seals & F_SEAL_SHRINK, 0) << "a peer could shrink it under the server's mapping";
  struct stat info;
  ASSERT_EQ(fstat(response->fd.get(), &info), 0);
  EXPECT_EQ(static_cast<uint64_t>(info.st_size), shm::kCopySlots * shm::kCopySlotBytes);
}

// A peer with a valid token may open many connections (up to max_connections): one staging
// memfd per peer, not per connection, or it could claim 4 MiB of the owner's memory on each.
// The second is refused (and the peer reported); once the holder's connection is gone the
// peer may ask again.
TEST_F(ServedCopyTest, OneStagingPerPeerWhateverItsConnections) {
  shm::UniqueFd first = Connect();
  ASSERT_NE(Stage(first.get()), nullptr);
  {
    shm::UniqueFd second = Connect();
    shm::FdRequest ask;
    ask.kind = shm::FdRequestKind::kStaging;
    ask.token = kToken;
    const size_t errors = hooks_.peer_errors().size();
    absl::StatusOr<shm::FdResponse> response = Call(second.get(), ask);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->reply.code, absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(response->reply.message, HasSubstr("one per peer"));
    EXPECT_FALSE(response->fd.valid());
    EXPECT_TRUE(hooks_.WaitPeerErrors(errors + 1, kWait)) << "the peer was not reported";
    absl::StatusOr<shm::ReceivedMessage> after =
        shm::ReceiveMessage(second.get(), shm::kMaxFdMessageBytes, absl::Now() + kWait);
    EXPECT_TRUE(!after.ok() || after->eof) << "the connection was kept open";
  }
  // The first connection still has its staging (asking again on it answers the same memfd).
  ASSERT_NE(Stage(first.get()), nullptr);
  first.Reset();
  // The server notices the close when it next polls: ask until it has (bounded).
  const absl::Time deadline = absl::Now() + kWait;
  bool staged = false;
  while (!staged && absl::Now() < deadline) {
    shm::UniqueFd again = Connect();
    shm::FdRequest ask;
    ask.kind = shm::FdRequestKind::kStaging;
    ask.token = kToken;
    absl::StatusOr<shm::FdResponse> response = Call(again.get(), ask);
    staged = response.ok() && response->reply.code == absl::StatusCode::kOk;
    if (!staged) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(staged) << "the peer could not stage again after its holder closed";
}

// One staging per peer does not bound a process that handshakes as many peers as it likes
// (each with its own token): the connections of one process hold at most
// max_stagings_per_process of them. Beyond, the ask is refused, but the peer is not reported
// (its process may hold many honest engines) and its connection stays: once one staging goes,
// it may ask again and stage.
TEST(ServedCopyLimitsTest, AProcessOfManyPeersHoldsAtMostItsStagings) {
  FakeTargetHooks hooks(OnePeer("token-0", 100));
  for (PeerId p = 1; p < 4; ++p) hooks.AddToken(absl::StrCat("token-", p), 100 + p);
  ShmTransportOptions options;
  options.engine_name = "served-limits";
  options.max_stagings_per_process = 2;
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateShmTransport(options, &hooks);
  ASSERT_TRUE(transport.ok()) << transport.status();
  absl::StatusOr<shm::ShmEndpoint> endpoint = shm::ParseEndpoint((*transport)->Endpoint());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  auto stage = [&](int peer, shm::UniqueFd* socket) -> absl::StatusOr<shm::FdResponse> {
    absl::StatusOr<shm::UniqueFd> connected =
        shm::ConnectSeqpacket(endpoint->socket_name, absl::Now() + kWait);
    if (!connected.ok()) return connected.status();
    *socket = *std::move(connected);
    shm::FdRequest ask;
    ask.kind = shm::FdRequestKind::kStaging;
    ask.token = absl::StrCat("token-", peer);
    return shm::CallFdServer(socket->get(), ask, absl::Now() + kWait);
  };
  shm::UniqueFd held[2];
  for (int p = 0; p < 2; ++p) {
    absl::StatusOr<shm::FdResponse> response = stage(p, &held[p]);
    ASSERT_TRUE(response.ok()) << response.status();
    ASSERT_EQ(response->reply.code, absl::StatusCode::kOk) << response->reply.message;
  }
  shm::UniqueFd third;
  absl::StatusOr<shm::FdResponse> response = stage(2, &third);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->reply.code, absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(response->reply.message, HasSubstr("the most one process may hold"));
  EXPECT_FALSE(response->fd.valid());
  held[0].Reset();
  // The server notices the close when it next polls: the same connection asks until it has
  // (bounded).
  shm::FdRequest ask;
  ask.kind = shm::FdRequestKind::kStaging;
  ask.token = "token-2";
  const absl::Time deadline = absl::Now() + kWait;
  bool staged = false;
  while (!staged && absl::Now() < deadline) {
    response = shm::CallFdServer(third.get(), ask, absl::Now() + kWait);
    ASSERT_TRUE(response.ok()) << "the refused connection was closed: " << response.status();
    staged = response->reply.code == absl::StatusCode::kOk;
    if (!staged) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(staged) << "the refused peer could not stage after one staging went";
  EXPECT_TRUE(hooks.peer_errors().empty()) << "a refusal for the process's bound reported a peer";
  (*transport)->Shutdown();
}

TEST_F(ServedCopyTest, ReadFillsTheSlotAndWriteEmptiesIt) {
  shm::UniqueFd socket = Connect();
  std::byte* staging = Stage(socket.get());
  ASSERT_NE(staging, nullptr);
  const std::byte* region = hooks_.data(region_);
  // READ: two ops, one after the other in slot 1.
  absl::StatusOr<shm::FdResponse> read =
      Call(socket.get(), Copy(OpKind::kRead, 1, {{region_, 4096, 8192}, {region_, 100, 300}}));
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->reply.code, absl::StatusCode::kOk) << read->reply.message;
  EXPECT_EQ(read->reply.region, 41u) << "the reply echoes the sequence number";
  EXPECT_EQ(read->reply.length, 2u);
  const std::byte* slot = staging + shm::kCopySlotBytes;
  EXPECT_EQ(std::memcmp(slot, region + 4096, 8192), 0);
  EXPECT_EQ(std::memcmp(slot + 8192, region + 100, 300), 0);
  // WRITE: slot 0's bytes into the region.
  for (int i = 0; i < 5000; ++i) staging[i] = static_cast<std::byte>(i * 3 + 1);
  absl::StatusOr<shm::FdResponse> write =
      Call(socket.get(), Copy(OpKind::kWrite, 0, {{region_, 60000, 5000}}));
  ASSERT_TRUE(write.ok()) << write.status();
  ASSERT_EQ(write->reply.code, absl::StatusCode::kOk) << write->reply.message;
  EXPECT_EQ(std::memcmp(region + 60000, staging, 5000), 0);
  EXPECT_TRUE(hooks_.WaitPinsReleased(kWait));
  EXPECT_TRUE(hooks_.peer_errors().empty());
}

TEST_F(ServedCopyTest, RefusesWhatItMustNotServe) {
  ExpectRefused(/*stage=*/false, Copy(OpKind::kRead, 0, {{region_, 0, 64}}),
                "before the staging memfd");
  ExpectRefused(true, Copy(OpKind::kRead, shm::kCopySlots, {{region_, 0, 64}}), "staging slot");
  // Ops that each fit the region but together overrun the slot.
  std::vector<shm::CopyOp> overrun(shm::kCopySlotBytes / 60000 + 1, {region_, 0, 60000});
  ExpectRefused(true, Copy(OpKind::kRead, 0, overrun), "overrun the staging slot");
  ExpectRefused(true, Copy(OpKind::kRead, 0, {{region_, kRegionBytes - 8, 64}}),
                "exceeds region length");
  ExpectRefused(true, Copy(OpKind::kWrite, 0, {{region_ + 1, 0, 64}}), "not exported");
  // The second op refused: the reply names it.
  ExpectRefused(true, Copy(OpKind::kRead, 0, {{region_, 0, 64}, {region_, kRegionBytes, 1}}),
                "copy op 1");
  // A region withdrawn from the peer.
  hooks_.SetExported(region_, false);
  ExpectRefused(true, Copy(OpKind::kRead, 0, {{region_, 0, 64}}), "not exported");
}

}  // namespace
}  // namespace kvwire::transport

// The shm transport end to end: two Transport instances, in one process and (for the data
// path) in two processes, so that memfd mappings and cross-memory attach are real.
#include "transport/shm/shm_transport.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <poll.h>
#include <random>
#include <signal.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/memory.h"
#include "src/util/mutex.h"
#include "tests/support/cma.h"
#include "tests/support/fake_target_hooks.h"
#include "tests/support/shm_regions.h"
#include "tests/support/socket_io.h"
#include "transport/shm/host_region_key.h"
#include "transport/shm/local_regions.h"
#include "transport/shm/shareable_registry.h"

namespace kvwire::transport {
namespace {

using ::kvwire::testing::Describe;
using ::kvwire::testing::FakeTargetHooks;
using ::kvwire::testing::MakeRegion;
using ::kvwire::testing::OnePeer;
using ::kvwire::testing::ReadAll;
using ::kvwire::testing::ReadString;
using ::kvwire::testing::WriteAll;
using ::kvwire::testing::WriteString;
using ::testing::HasSubstr;

constexpr PeerId kPeer = 7;
constexpr char kToken[] = "session-token-of-peer-7";
constexpr uint64_t kRegionBytes = 1 << 20;

std::unique_ptr<Transport> MakeTransport(const std::string& name, TargetHooks* hooks,
                                         bool allow_cma = true) {
  ShmTransportOptions options;
  options.engine_name = name;
  options.allow_cma = allow_cma;
  options.request_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<Transport>> transport = CreateShmTransport(options, hooks);
  EXPECT_TRUE(transport.ok()) << transport.status();
  return transport.ok() ? *std::move(transport) : nullptr;
}

PeerLink MakeLink(const std::string& endpoint, uint32_t pid, const std::string& token = kToken) {
  PeerLink link;
  link.peer = 1;
  link.peer_name = "target";
  link.remote_endpoint = endpoint;
  link.token = token;
  link.remote_pid = pid;
  link.deadline = absl::Now() + absl::Seconds(20);
  return link;
}

// Posts and checks the shm contract: `done` runs exactly once, before Post returns.
absl::Status PostAndWait(Channel& channel, PostRequest request) {
  int calls = 0;
  absl::Status result = absl::InternalError("done not called");
  channel.Post(std::move(request), [&](absl::Status status) {
    ++calls;
    result = std::move(status);
  });
  EXPECT_EQ(calls, 1) << "done must run exactly once, inline";
  return result;
}

// --- random op lists ---------------------------------------------------------------------

struct Piece {
  uint64_t remote_offset = 0;
  uint64_t local_offset = 0;
  uint64_t length = 0;
};

// Disjoint pieces of [0, size) on both sides (local order shuffled), about half of them
// chosen, many small (so that CMA batches overflow) and some large, crossing pages.
std::vector<Piece> RandomPieces(uint64_t size, std::mt19937_64& rng) {
  std::vector<Piece> all;
  for (uint64_t at = 0; at < size;) {
    const uint64_t want = rng() % 8 == 0 ? 1 + rng() % (96 << 10) : 1 + rng() % 700;
    const uint64_t length = std::min(want, size - at);
    all.push_back(Piece{at, 0, length});
    at += length;
  }
  std::vector<Piece> chosen;
  for (const Piece& piece : all) {
    if (rng() % 2 == 0) chosen.push_back(piece);
  }
  std::shuffle(chosen.begin(), chosen.end(), rng);
  uint64_t local = 0;
  for (Piece& piece : chosen) {
    piece.local_offset = local;
    local += piece.length;
  }
  std::shuffle(chosen.begin(), chosen.end(), rng);
  return chosen;
}

PostRequest MakeRequest(TransferId id, OpKind kind, RegionId region, std::byte* local,
                        const std::vector<Piece>& pieces) {
  PostRequest request;
  request.transfer_id = id;
  request.kind = kind;
  for (const Piece& piece : pieces) {
    request.ops.push_back(
        WireOp{local + piece.local_offset, region, piece.remote_offset, piece.length});
  }
  return request;
}

void FillRandom(std::byte* data, size_t size, std::mt19937_64& rng) {
  for (size_t i = 0; i < size; ++i) data[i] = static_cast<std::byte>(rng());
}

// Remote bytes after a WRITE of `pieces` from `local` over `poison`.
std::vector<std::byte> ExpectedAfterWrite(const std::vector<Piece>& pieces, const std::byte* local,
                                          size_t size, std::byte poison) {
  std::vector<std::byte> expected(size, poison);
  for (const Piece& piece : pieces) {
    std::memcpy(expected.data() + piece.remote_offset, local + piece.local_offset, piece.length);
  }
  return expected;
}

// Local bytes after a READ of `pieces` from `remote` over `poison`.
std::vector<std::byte> ExpectedAfterRead(const std::vector<Piece>& pieces, const std::byte* remote,
                                         size_t size, std::byte poison) {
  std::vector<std::byte> expected(size, poison);
  for (const Piece& piece : pieces) {
    std::memcpy(expected.data() + piece.local_offset, remote + piece.remote_offset, piece.length);
  }
  return expected;
}

// First differing byte, for a readable failure.
::testing::AssertionResult SameBytes(const std::byte* actual, const std::byte* expected,
                                     size_t size) {
  for (size_t i = 0; i < size; ++i) {
    if (actual[i] != expected[i]) {
      return ::testing::AssertionFailure() << "byte " << i << " is " << static_cast<int>(actual[i])
                                           << ", expected " << static_cast<int>(expected[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

// --- one process -------------------------------------------------------------------------

class ShmPairTest : public ::testing::Test {
 protected:
  void SetUp() override {
    target_ = MakeTransport("target", &target_hooks_);
    initiator_ = MakeTransport("initiator", &initiator_hooks_);
    ASSERT_NE(target_, nullptr);
    ASSERT_NE(initiator_, nullptr);
  }

  LocalRegion Register(RegionId id, std::byte* base, uint64_t length, uint32_t access,
                       bool exported = true) {
    LocalRegion region = MakeRegion(id, base, length, access);
    EXPECT_TRUE(target_->RegisterRegion(region).ok());
    target_hooks_.AddRegion(region, exported);
    return region;
  }

  std::unique_ptr<Channel> Connect(const std::string& token = kToken) {
    absl::StatusOr<std::unique_ptr<Channel>> channel =
        initiator_->Connect(MakeLink(target_->Endpoint(), getpid(), token));
    EXPECT_TRUE(channel.ok()) << channel.status();
    return channel.ok() ? *std::move(channel) : nullptr;
  }

  FakeTargetHooks target_hooks_{OnePeer(kToken, kPeer)};
  FakeTargetHooks initiator_hooks_{OnePeer(kToken, kPeer)};
  std::unique_ptr<Transport> target_;
  std::unique_ptr<Transport> initiator_;
};

TEST_F(ShmPairTest, Capabilities) {
  const Capabilities& caps = target_->caps();
  EXPECT_EQ(caps.name, "shm");
  EXPECT_TRUE(caps.same_host_only);
  EXPECT_FALSE(caps.counts_arrivals);
  EXPECT_TRUE(caps.one_sided_read);
  EXPECT_TRUE(caps.one_sided_write);
  EXPECT_GE(caps.max_op_bytes, uint64_t{1} << 30);
  EXPECT_EQ(caps.max_lanes, 1u);
  EXPECT_THAT(target_->Endpoint(), HasSubstr("kvwire-shm/1"));
  EXPECT_NE(target_->Endpoint(), initiator_->Endpoint());
}

TEST_F(ShmPairTest, CanReachOnlyTheSameHostId) {
  EXPECT_TRUE(initiator_->CanReach(target_->Endpoint()).ok());

  ShmTransportOptions options;
  options.engine_name = "elsewhere";
  options.host_id = "another-host";
  absl::StatusOr<std::unique_ptr<Transport>> other = CreateShmTransport(options, &target_hooks_);
  ASSERT_TRUE(other.ok()) << other.status();
  const absl::Status refused = initiator_->CanReach((*other)->Endpoint());
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("another-host"));
  EXPECT_THAT(refused.message(), HasSubstr(LocalHostId()));
  EXPECT_EQ((*other)->CanReach(target_->Endpoint()).code(), absl::StatusCode::kFailedPrecondition);
  // Connect refuses the same way.
  absl::StatusOr<std::unique_ptr<Channel>> channel =
      initiator_->Connect(MakeLink((*other)->Endpoint(), getpid()));
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kFailedPrecondition);

  EXPECT_EQ(initiator_->CanReach("tcp 127.0.0.1:1").code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ShmPairTest, WrongTokenIsRefusedAtConnect) {
  absl::StatusOr<std::unique_ptr<Channel>> channel =
      initiator_->Connect(MakeLink(target_->Endpoint(), getpid(), "forged"));
  ASSERT_FALSE(channel.ok());
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(channel.status().message(), HasSubstr("refused the session"));
}

TEST_F(ShmPairTest, RegionNotExportedOrUnknownIsRefused) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kRegionBytes);
  ASSERT_TRUE(buffer.ok());
  const LocalRegion hidden =
      Register(11, buffer->data(), buffer->size(), kRemoteReadWrite, /*exported=*/false);
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);

  absl::Status added = channel->AddRemoteRegions({Describe(hidden)});
  EXPECT_EQ(added.code(), absl::StatusCode::kPermissionDenied) << added;
  EXPECT_THAT(added.message(), HasSubstr("region 11"));
  EXPECT_THAT(added.message(), HasSubstr("not exported"));

  RemoteRegionDesc unknown = Describe(hidden);
  unknown.id = 99;
  added = channel->AddRemoteRegions({unknown});
  EXPECT_EQ(added.code(), absl::StatusCode::kNotFound) << added;
  EXPECT_THAT(added.message(), HasSubstr("99"));

  // Ops on a region never added fail with a message naming it.
  std::vector<std::byte> local(64);
  PostRequest request;
  request.transfer_id = 5;
  request.kind = OpKind::kWrite;
  request.ops.push_back(WireOp{local.data(), 11, 0, 64});
  const absl::Status posted = PostAndWait(*channel, std::move(request));
  EXPECT_EQ(posted.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(posted.message(), HasSubstr("transfer 5 op 0"));
  EXPECT_THAT(posted.message(), HasSubstr("region 11"));

  // Exported later: the same channel can add it.
  target_hooks_.SetExported(11, true);
  EXPECT_TRUE(channel->AddRemoteRegions({Describe(hidden)}).ok());
}

TEST_F(ShmPairTest, RegionRegisteredButNotWithTheTransportIsRefused) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kRegionBytes);
  ASSERT_TRUE(buffer.ok());
  const LocalRegion region = MakeRegion(12, buffer->data(), buffer->size(), kRemoteReadWrite);
  target_hooks_.AddRegion(region, true);  // the engine knows it, the transport does not
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  const absl::Status added = channel->AddRemoteRegions({Describe(region)});
  EXPECT_EQ(added.code(), absl::StatusCode::kNotFound) << added;
  EXPECT_THAT(added.message(), HasSubstr("not registered with the shm transport"));
}

TEST_F(ShmPairTest, MissingPermissionIsEnforced) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kRegionBytes);
  ASSERT_TRUE(buffer.ok());
  std::memset(buffer->data(), 0x11, buffer->size());
  const LocalRegion read_only = Register(21, buffer->data(), buffer->size(), kRemoteRead);
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  // The initiator claims more than the target allows: the target's answer wins.
  RemoteRegionDesc claimed = Describe(read_only);
  claimed.access = kRemoteReadWrite;
  ASSERT_TRUE(channel->AddRemoteRegions({claimed}).ok());

  std::vector<std::byte> local(4096, std::byte{0x22});
  PostRequest write;
  write.transfer_id = 8;
  write.kind = OpKind::kWrite;
  write.ops.push_back(WireOp{local.data(), 21, 100, 4096});
  const absl::Status denied = PostAndWait(*channel, std::move(write));
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied) << denied;
  EXPECT_THAT(denied.message(), HasSubstr("transfer 8 op 0 (WRITE region 21 offset 100"));
  EXPECT_EQ(buffer->data()[100], std::byte{0x11}) << "nothing written";

  PostRequest read;
  read.transfer_id = 9;
  read.kind = OpKind::kRead;
  read.ops.push_back(WireOp{local.data(), 21, 100, 4096});
  EXPECT_TRUE(PostAndWait(*channel, std::move(read)).ok());
  EXPECT_EQ(local[0], std::byte{0x11});

  // A write-only region refuses READ.
  absl::StatusOr<ShareableBuffer> sink = ShareableBuffer::Create(4096);
  ASSERT_TRUE(sink.ok());
  const LocalRegion write_only = Register(22, sink->data(), sink->size(), kRemoteWrite);
  ASSERT_TRUE(channel->AddRemoteRegions({Describe(write_only)}).ok());
  PostRequest read_sink;
  read_sink.transfer_id = 10;
  read_sink.kind = OpKind::kRead;
  read_sink.ops.push_back(WireOp{local.data(), 22, 0, 16});
  EXPECT_EQ(PostAndWait(*channel, std::move(read_sink)).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(ShmPairTest, OutOfBoundsOpsAreRejected) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kRegionBytes);
  ASSERT_TRUE(buffer.ok());
  std::vector<std::byte> heap(8192);
  const LocalRegion mapped = Register(31, buffer->data(), buffer->size(), kRemoteReadWrite);
  const LocalRegion cma = Register(32, heap.data(), heap.size(), kRemoteReadWrite);
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  ASSERT_TRUE(channel->AddRemoteRegions({Describe(mapped), Describe(cma)}).ok());

  std::vector<std::byte> local(kRegionBytes + 1);
  struct Case {
    RegionId region;
    uint64_t offset;
    uint64_t length;
  };
  for (const Case& c :
       {Case{31, 0, kRegionBytes + 1}, Case{31, kRegionBytes, 1}, Case{31, kRegionBytes - 10, 11},
        Case{31, UINT64_MAX - 5, 10}, Case{32, 8000, 193}, Case{32, 8193, 0}}) {
    for (OpKind kind : {OpKind::kWrite, OpKind::kRead}) {
      PostRequest request;
      request.transfer_id = 40;
      request.kind = kind;
      request.ops.push_back(WireOp{local.data(), c.region, 0, 16});  // valid
      request.ops.push_back(WireOp{local.data(), c.region, c.offset, c.length});
      const absl::Status status = PostAndWait(*channel, std::move(request));
      EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
      EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("transfer 40 op 1")));
      EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("region ", c.region, " offset ",
                                                           c.offset, " length ", c.length)));
    }
  }
  // Exactly at the end is fine.
  PostRequest edge;
  edge.kind = OpKind::kWrite;
  edge.ops.push_back(WireOp{local.data(), 31, kRegionBytes - 10, 10});
  edge.ops.push_back(WireOp{local.data(), 32, 8192 - 10, 10});
  edge.ops.push_back(WireOp{local.data(), 32, 8192, 0});
  EXPECT_TRUE(PostAndWait(*channel, std::move(edge)).ok());
}

TEST_F(ShmPairTest, RandomOpsInProcess) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kRegionBytes);
  ASSERT_TRUE(buffer.ok());
  std::vector<std::byte> heap(kRegionBytes);
  // Only a whole memfd is shared (a part of one goes over tcp: hostile_shm_test).
  const LocalRegion mapped = Register(41, buffer->data(), kRegionBytes, kRemoteReadWrite);
  ASSERT_EQ(FindShareable(mapped.base, mapped.length)->offset, 0u);
  const LocalRegion cma = Register(42, heap.data(), heap.size(), kRemoteReadWrite);
  ASSERT_FALSE(FindShareable(cma.base, cma.length).has_value());
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  ASSERT_THAT(channel->Describe(), HasSubstr("shm memfd"));
  // Where the kernel allows cross-memory attach the CMA path is required (a CMA path that
  // fails is a failure here); where it refuses, the refusal is checked.
  const bool cma_ok = kvwire::testing::CmaHere().allowed;
  if (cma_ok) {
    ASSERT_EQ(channel->Describe().rfind("shm memfd+cma", 0), 0u) << channel->Describe();
  } else {
    ASSERT_THAT(channel->Describe(), HasSubstr("cma refused"));
  }
  const absl::Status added = channel->AddRemoteRegions({Describe(mapped), Describe(cma)});
  if (!cma_ok) {
    EXPECT_EQ(added.code(), absl::StatusCode::kFailedPrecondition) << added;
    EXPECT_THAT(added.message(), HasSubstr("region 42"));
  } else {
    ASSERT_TRUE(added.ok()) << added;
  }

  std::mt19937_64 rng(1234);
  std::vector<std::byte> local(kRegionBytes);
  TransferId next_id = 1;
  for (const LocalRegion& region : {mapped, cma}) {
    if (region.id == 42 && !cma_ok) continue;
    for (int round = 0; round < 4; ++round) {
      SCOPED_TRACE(absl::StrCat("region ", region.id, " round ", round));
      std::vector<Piece> pieces = RandomPieces(region.length, rng);
      FillRandom(local.data(), local.size(), rng);
      std::memset(region.base, 0xAB, region.length);
      std::vector<std::byte> expected =
          ExpectedAfterWrite(pieces, local.data(), region.length, std::byte{0xAB});
      ASSERT_TRUE(PostAndWait(*channel, MakeRequest(next_id++, OpKind::kWrite, region.id,
                                                    local.data(), pieces))
                      .ok());
      ASSERT_TRUE(SameBytes(region.base, expected.data(), region.length));

      pieces = RandomPieces(region.length, rng);
      FillRandom(region.base, region.length, rng);
      std::memset(local.data(), 0xCD, local.size());
      expected = ExpectedAfterRead(pieces, region.base, local.size(), std::byte{0xCD});
      ASSERT_TRUE(PostAndWait(*channel, MakeRequest(next_id++, OpKind::kRead, region.id,
                                                    local.data(), pieces))
                      .ok());
      ASSERT_TRUE(SameBytes(local.data(), expected.data(), local.size()));
    }
  }
}

// The refusal path on purpose: in a process of its own (a death-test child, re-executed so
// that no thread of this one is copied) a seccomp filter makes process_vm_readv/writev fail
// with EPERM, as a hardened sandbox does. The channel must say that CMA was refused and why,
// refuse heap regions by name, and still move memfd regions.
TEST_F(ShmPairTest, CmaRefusedBySeccompIsReportedAndHeapRegionsAreRefused) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto refused_run = [this] {
    auto fail = [](const std::string& why) {
      std::fprintf(stderr, "FAILED: %s\n", why.c_str());
      std::fflush(stderr);
      _exit(1);
    };
    if (absl::Status denied = kvwire::testing::DenyCmaBySeccomp(); !denied.ok()) {
      fail(denied.ToString());
    }
    absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kRegionBytes);
    if (!buffer.ok()) fail(buffer.status().ToString());
    std::vector<std::byte> heap(kRegionBytes, std::byte{7});
    const LocalRegion mapped = Register(51, buffer->data(), kRegionBytes, kRemoteReadWrite);
    const LocalRegion cma = Register(52, heap.data(), heap.size(), kRemoteReadWrite);
    absl::StatusOr<std::unique_ptr<Channel>> channel =
        initiator_->Connect(MakeLink(target_->Endpoint(), getpid()));
    if (!channel.ok()) fail(channel.status().ToString());
    const std::string path = (*channel)->Describe();
    if (path.find("cma refused") == std::string::npos ||
        path.find("Operation not permitted") == std::string::npos) {
      fail("data path does not report the refusal: " + path);
    }
    const absl::Status added = (*channel)->AddRemoteRegions({Describe(mapped), Describe(cma)});
    if (added.code() != absl::StatusCode::kFailedPrecondition ||
        std::string(added.message()).find("region 52") == std::string::npos) {
      fail("heap region not refused by name: " + added.ToString());
    }
    (void)(*channel)->AddRemoteRegions({Describe(mapped)});
    std::vector<std::byte> local(4096, std::byte{0x5a});
    PostRequest write;
    write.kind = OpKind::kWrite;
    write.ops.push_back(WireOp{local.data(), 51, 100, local.size()});
    if (absl::Status moved = PostAndWait(**channel, std::move(write)); !moved.ok()) {
      fail("memfd write: " + moved.ToString());
    }
    if (buffer->data()[100] != std::byte{0x5a} || buffer->data()[100 + 4095] != std::byte{0x5a}) {
      fail("memfd write did not land");
    }
    std::fprintf(stderr, "refused as it should: %s\n", path.c_str());
    std::fflush(stderr);
    _exit(0);
  };
  EXPECT_EXIT(refused_run(), ::testing::ExitedWithCode(0), "refused as it should: shm memfd");
}

TEST_F(ShmPairTest, CmaDisabledGivesAClearErrorNotAFallback) {
  FakeTargetHooks hooks{OnePeer(kToken, kPeer)};
  std::unique_ptr<Transport> no_cma = MakeTransport("no-cma", &hooks, /*allow_cma=*/false);
  ASSERT_NE(no_cma, nullptr);
  std::vector<std::byte> heap(4096);
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4096);
  ASSERT_TRUE(buffer.ok());
  const LocalRegion plain = Register(51, heap.data(), heap.size(), kRemoteReadWrite);
  const LocalRegion shared = Register(52, buffer->data(), buffer->size(), kRemoteReadWrite);
  absl::StatusOr<std::unique_ptr<Channel>> channel =
      no_cma->Connect(MakeLink(target_->Endpoint(), getpid()));
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ((*channel)->Describe(),
            "shm memfd (cma refused: disabled by ShmTransportOptions::allow_cma)");
  const absl::Status added = (*channel)->AddRemoteRegions({Describe(plain), Describe(shared)});
  EXPECT_EQ(added.code(), absl::StatusCode::kFailedPrecondition) << added;
  EXPECT_THAT(added.message(), HasSubstr("region 51"));
  EXPECT_THAT(added.message(), HasSubstr("cross-memory attach is refused"));
  // The memfd region was added all the same.
  std::vector<std::byte> local(4096, std::byte{9});
  PostRequest request;
  request.kind = OpKind::kWrite;
  request.ops.push_back(WireOp{local.data(), 52, 0, 4096});
  EXPECT_TRUE(PostAndWait(**channel, std::move(request)).ok());
  EXPECT_EQ(buffer->data()[4095], std::byte{9});
}

TEST_F(ShmPairTest, CloseThenPostFailsWithTheReason) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4096);
  ASSERT_TRUE(buffer.ok());
  const LocalRegion region = Register(61, buffer->data(), buffer->size(), kRemoteReadWrite);
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  ASSERT_TRUE(channel->AddRemoteRegions({Describe(region)}).ok());
  channel->Close(absl::AbortedError("peer lease expired"));
  channel->Close(absl::InternalError("second close is ignored"));

  std::vector<std::byte> local(16);
  PostRequest request;
  request.transfer_id = 62;
  request.kind = OpKind::kWrite;
  request.ops.push_back(WireOp{local.data(), 61, 0, 16});
  const absl::Status status = PostAndWait(*channel, std::move(request));
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(status.message(), HasSubstr("peer lease expired"));
  EXPECT_THAT(status.message(), HasSubstr("transfer 62"));
  EXPECT_EQ(channel->AddRemoteRegions({Describe(region)}).code(), absl::StatusCode::kAborted);
}

TEST_F(ShmPairTest, RemovedRegionIsUnmapped) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4096);
  ASSERT_TRUE(buffer.ok());
  const LocalRegion region = Register(63, buffer->data(), buffer->size(), kRemoteReadWrite);
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  ASSERT_TRUE(channel->AddRemoteRegions({Describe(region)}).ok());
  ASSERT_TRUE(channel->AddRemoteRegions({Describe(region)}).ok()) << "adding twice is fine";
  channel->RemoveRemoteRegions({63, 999});
  std::vector<std::byte> local(16);
  PostRequest request;
  request.kind = OpKind::kRead;
  request.ops.push_back(WireOp{local.data(), 63, 0, 16});
  EXPECT_EQ(PostAndWait(*channel, std::move(request)).code(), absl::StatusCode::kNotFound);
}

TEST_F(ShmPairTest, CancelledTransferLeavesLocalMemoryAlone) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4096);
  std::vector<std::byte> heap(4096, std::byte{0x77});
  ASSERT_TRUE(buffer.ok());
  std::memset(buffer->data(), 0x77, 4096);
  const LocalRegion mapped = Register(64, buffer->data(), buffer->size(), kRemoteReadWrite);
  const LocalRegion cma = Register(65, heap.data(), heap.size(), kRemoteReadWrite);
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  (void)channel->AddRemoteRegions({Describe(mapped), Describe(cma)});
  std::vector<std::byte> local(4096, std::byte{0});
  for (RegionId id : {RegionId{64}, RegionId{65}}) {
    PostRequest request;
    request.kind = OpKind::kRead;
    request.cancelled = std::make_shared<std::atomic<bool>>(true);
    request.ops.push_back(WireOp{local.data(), id, 0, 4096});
    EXPECT_EQ(PostAndWait(*channel, std::move(request)).code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(local[0], std::byte{0});
  }
}

TEST_F(ShmPairTest, PinsAreReleasedBeforeDone) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4096);
  ASSERT_TRUE(buffer.ok());
  const LocalRegion region = Register(66, buffer->data(), buffer->size(), kRemoteReadWrite);
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  ASSERT_TRUE(channel->AddRemoteRegions({Describe(region)}).ok());
  auto pin = std::make_shared<int>(1);
  std::vector<std::byte> local(16);
  PostRequest request;
  request.kind = OpKind::kWrite;
  request.ops.push_back(WireOp{local.data(), 66, 0, 16});
  request.pins.push_back(pin);
  long uses_in_done = -1;
  channel->Post(std::move(request), [&](absl::Status status) {
    EXPECT_TRUE(status.ok()) << status;
    uses_in_done = pin.use_count();
  });
  EXPECT_EQ(uses_in_done, 1);
}

TEST_F(ShmPairTest, DropPeerStopsServingIt) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4096);
  absl::StatusOr<ShareableBuffer> other = ShareableBuffer::Create(4096);
  ASSERT_TRUE(buffer.ok() && other.ok());
  const LocalRegion first = Register(71, buffer->data(), 4096, kRemoteReadWrite);
  const LocalRegion second = Register(72, other->data(), 4096, kRemoteReadWrite);
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  ASSERT_TRUE(channel->AddRemoteRegions({Describe(first)}).ok());
  target_->DropPeer(kPeer);
  const absl::Status added = channel->AddRemoteRegions({Describe(second)});
  EXPECT_FALSE(added.ok());
  EXPECT_THAT(added.message(), HasSubstr("region 72"));
  // A new connection with the dropped peer's token is refused too.
  absl::StatusOr<std::unique_ptr<Channel>> again =
      initiator_->Connect(MakeLink(target_->Endpoint(), getpid()));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
}

TEST_F(ShmPairTest, ShutdownWithAConnectedPeerDoesNotHang) {
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  std::future<void> shutdown = std::async(std::launch::async, [this] { target_->Shutdown(); });
  ASSERT_EQ(shutdown.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "Shutdown hung with a connected peer";
  target_->Shutdown();  // idempotent
  EXPECT_EQ(target_->CanReach(initiator_->Endpoint()).code(), absl::StatusCode::kOk);
  EXPECT_FALSE(target_->Connect(MakeLink(initiator_->Endpoint(), getpid())).ok());
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4096);
  ASSERT_TRUE(buffer.ok());
  RemoteRegionDesc desc;
  desc.id = 1;
  desc.length = 4096;
  desc.access = kRemoteReadWrite;
  desc.SetKey(shm::EncodeHostRegionKey(true));
  EXPECT_FALSE(channel->AddRemoteRegions({desc}).ok());
}

// The shm transport's table of its regions, given the memfd a region lies in (RegisterRegion
// finds it with FindShareable, which only ever returns sealed ShareableBuffers).
TEST(ShmLocalRegionTableTest, RejectsUnsealedOrShortMemfds) {
  shm::LocalRegionTable table;
  const int raw = memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(raw, 0);
  ASSERT_EQ(ftruncate(raw, 8192), 0);
  LocalRegion region;
  region.id = 81;
  region.length = 4096;
  absl::Status status = table.Add(region, ShareableBacking{raw, 0});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("sealed"));
  close(raw);

  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4096);
  ASSERT_TRUE(buffer.ok());
  const ShareableBacking tail{buffer->fd(), 4000};
  region.length = 97;
  status = table.Add(region, tail);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("past the end"));
  region.length = 96;
  EXPECT_TRUE(table.Add(region, tail).ok());
  EXPECT_EQ(table.Add(region, tail).code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(ShmPairTest, ConcurrentPostsRemoveAndClose) {
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(kRegionBytes);
  ASSERT_TRUE(buffer.ok());
  const LocalRegion region = Register(91, buffer->data(), buffer->size(), kRemoteReadWrite);
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  ASSERT_TRUE(channel->AddRemoteRegions({Describe(region)}).ok());

  constexpr int kThreads = 3;
  std::atomic<int> posts{0};
  std::atomic<int> dones{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Each thread owns a slice of the remote region: no two copies overlap.
      std::vector<std::byte> local(4096, static_cast<std::byte>(t));
      while (!stop.load()) {
        PostRequest request;
        request.kind = t % 2 == 0 ? OpKind::kWrite : OpKind::kRead;
        request.ops.push_back(WireOp{local.data(), 91, uint64_t(t) * 4096, 4096});
        ++posts;
        channel->Post(std::move(request), [&](absl::Status) { ++dones; });
      }
    });
  }
  for (int i = 0; i < 50; ++i) {
    channel->RemoveRemoteRegions({91});
    (void)channel->AddRemoteRegions({Describe(region)});
  }
  channel->Close(absl::CancelledError("test over"));
  stop = true;
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(posts.load(), dones.load());
}

// --- two processes -----------------------------------------------------------------------

// Commands from the parent to the forked target, over a socketpair. Every wait is bounded.
enum Command : uint32_t { kFill = 1, kPoison = 2, kDump = 3, kShutdown = 4, kExit = 5 };
struct CommandMessage {
  uint32_t command = 0;
  uint32_t region = 0;  // index into the child's region list
  uint64_t argument = 0;
};

absl::Time Soon() { return absl::Now() + absl::Seconds(30); }

// The target process. Regions: 0 memfd whole buffer, 1 another whole memfd buffer,
// 2 heap (CMA), 3 heap not exported, 4 memfd read-only.
[[noreturn]] void RunChild(int control) {
  FakeTargetHooks hooks(OnePeer(kToken, kPeer, static_cast<uint32_t>(getppid())));
  std::unique_ptr<Transport> transport = MakeTransport("forked-target", &hooks);
  if (transport == nullptr) _exit(10);
  absl::StatusOr<ShareableBuffer> whole = ShareableBuffer::Create(kRegionBytes);
  absl::StatusOr<ShareableBuffer> big = ShareableBuffer::Create(kRegionBytes);
  absl::StatusOr<ShareableBuffer> read_only = ShareableBuffer::Create(kRegionBytes);
  if (!whole.ok() || !big.ok() || !read_only.ok()) _exit(11);
  std::vector<std::byte> heap(kRegionBytes);
  std::vector<std::byte> hidden(kRegionBytes);
  std::vector<LocalRegion> regions = {
      MakeRegion(101, whole->data(), kRegionBytes, kRemoteReadWrite),
      MakeRegion(102, big->data(), kRegionBytes, kRemoteReadWrite),
      MakeRegion(103, heap.data(), kRegionBytes, kRemoteReadWrite),
      MakeRegion(104, hidden.data(), kRegionBytes, kRemoteReadWrite),
      MakeRegion(105, read_only->data(), kRegionBytes, kRemoteRead)};
  std::string descs;
  for (size_t i = 0; i < regions.size(); ++i) {
    if (!transport->RegisterRegion(regions[i]).ok()) _exit(12);
    hooks.AddRegion(regions[i], /*exported=*/i != 3);
    const RemoteRegionDesc desc = Describe(regions[i]);
    descs.append(reinterpret_cast<const char*>(&desc), sizeof(desc));
  }
  if (!WriteString(control, transport->Endpoint(), Soon()) ||
      !WriteString(control, descs, Soon())) {
    _exit(13);
  }
  while (true) {
    CommandMessage message;
    if (!ReadAll(control, &message, sizeof(message), absl::Now() + absl::Seconds(120))) _exit(14);
    if (message.command == kExit) break;
    if (message.command == kShutdown) {
      const absl::Time start = absl::Now();
      transport->Shutdown();
      const std::string took = absl::StrCat(absl::ToInt64Milliseconds(absl::Now() - start));
      if (!WriteString(control, took, Soon())) _exit(15);
      continue;
    }
    if (message.region >= regions.size()) _exit(16);
    const LocalRegion& region = regions[message.region];
    if (message.command == kFill) {
      std::mt19937_64 rng(message.argument);
      FillRandom(region.base, region.length, rng);
    } else if (message.command == kPoison) {
      std::memset(region.base, static_cast<int>(message.argument), region.length);
    } else if (message.command == kDump) {
      if (!WriteString(control,
                       std::string(reinterpret_cast<const char*>(region.base), region.length),
                       Soon())) {
        _exit(17);
      }
      continue;
    }
    const std::string ack = "ok";
    if (!WriteString(control, ack, Soon())) _exit(18);
  }
  transport->Shutdown();
  _exit(0);
}

class ShmTwoProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    // Fork before this process starts any thread of its own (the transports come after).
    child_ = fork();
    ASSERT_GE(child_, 0);
    if (child_ == 0) {
      close(fds[0]);
      RunChild(fds[1]);
    }
    close(fds[1]);
    control_ = fds[0];
    std::string descs;
    ASSERT_TRUE(ReadString(control_, &endpoint_, Soon())) << "child did not start";
    ASSERT_TRUE(ReadString(control_, &descs, Soon()));
    ASSERT_EQ(descs.size() % sizeof(RemoteRegionDesc), 0u);
    descs_.resize(descs.size() / sizeof(RemoteRegionDesc));
    std::memcpy(descs_.data(), descs.data(), descs.size());
    initiator_ = MakeTransport("forked-initiator", &hooks_);
    ASSERT_NE(initiator_, nullptr);
  }

  void TearDown() override {
    if (child_ <= 0) return;
    CommandMessage exit_message{kExit, 0, 0};
    (void)WriteAll(control_, &exit_message, sizeof(exit_message), Soon());
    close(control_);
    int status = 0;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (waitpid(child_, &status, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(child_, SIGKILL);
        waitpid(child_, &status, 0);
        ADD_FAILURE() << "the target process did not exit";
        return;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }

  void Send(Command command, uint32_t region, uint64_t argument) {
    CommandMessage message{command, region, argument};
    ASSERT_TRUE(WriteAll(control_, &message, sizeof(message), Soon()));
    if (command == kFill || command == kPoison) {
      std::string ack;
      ASSERT_TRUE(ReadString(control_, &ack, Soon()));
      ASSERT_EQ(ack, "ok");
    }
  }

  std::vector<std::byte> Dump(uint32_t region) {
    CommandMessage message{kDump, region, 0};
    std::string bytes;
    EXPECT_TRUE(WriteAll(control_, &message, sizeof(message), Soon()));
    EXPECT_TRUE(ReadString(control_, &bytes, Soon()));
    std::vector<std::byte> out(bytes.size());
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }

  std::unique_ptr<Channel> Connect() {
    absl::StatusOr<std::unique_ptr<Channel>> channel =
        initiator_->Connect(MakeLink(endpoint_, static_cast<uint32_t>(child_)));
    EXPECT_TRUE(channel.ok()) << channel.status();
    return channel.ok() ? *std::move(channel) : nullptr;
  }

  pid_t child_ = -1;
  int control_ = -1;
  std::string endpoint_;
  std::vector<RemoteRegionDesc> descs_;
  FakeTargetHooks hooks_{OnePeer(kToken, kPeer)};
  std::unique_ptr<Transport> initiator_;
};

TEST_F(ShmTwoProcessTest, RandomOpsAcrossProcesses) {
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  const std::string path = channel->Describe();
  std::printf("data path to the forked target: %s\n", path.c_str());
  // Required where the kernel allows it (see RandomOpsInProcess).
  const bool cma_ok = kvwire::testing::CmaHere().allowed;
  if (cma_ok) {
    ASSERT_EQ(path.rfind("shm memfd+cma", 0), 0u) << path;
  } else {
    ASSERT_THAT(path, HasSubstr("cma refused"));
  }
  ASSERT_TRUE(channel->AddRemoteRegions({descs_[0], descs_[1]}).ok());
  const absl::Status cma_added = channel->AddRemoteRegions({descs_[2]});
  if (cma_ok) {
    ASSERT_TRUE(cma_added.ok()) << cma_added;
  } else {
    std::printf("cross-memory attach refused, checking the error path: %s\n",
                std::string(cma_added.message()).c_str());
    EXPECT_EQ(cma_added.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(cma_added.message(), HasSubstr("region 103"));
  }

  std::mt19937_64 rng(99);
  std::vector<std::byte> local(kRegionBytes);
  TransferId next_id = 1;
  for (uint32_t index : {0u, 1u, 2u}) {
    if (index == 2 && !cma_ok) continue;
    const RegionId id = descs_[index].id;
    for (int round = 0; round < 3; ++round) {
      SCOPED_TRACE(absl::StrCat("region ", id, " round ", round));
      std::vector<Piece> pieces = RandomPieces(kRegionBytes, rng);
      FillRandom(local.data(), local.size(), rng);
      Send(kPoison, index, 0xAB);
      ASSERT_TRUE(
          PostAndWait(*channel, MakeRequest(next_id++, OpKind::kWrite, id, local.data(), pieces))
              .ok());
      const std::vector<std::byte> expected_remote =
          ExpectedAfterWrite(pieces, local.data(), kRegionBytes, std::byte{0xAB});
      const std::vector<std::byte> remote = Dump(index);
      ASSERT_EQ(remote.size(), kRegionBytes);
      ASSERT_TRUE(SameBytes(remote.data(), expected_remote.data(), kRegionBytes));

      pieces = RandomPieces(kRegionBytes, rng);
      const uint64_t seed = rng();
      Send(kFill, index, seed);
      std::vector<std::byte> filled(kRegionBytes);
      std::mt19937_64 same(seed);
      FillRandom(filled.data(), filled.size(), same);
      std::memset(local.data(), 0xCD, local.size());
      ASSERT_TRUE(
          PostAndWait(*channel, MakeRequest(next_id++, OpKind::kRead, id, local.data(), pieces))
              .ok());
      const std::vector<std::byte> expected_local =
          ExpectedAfterRead(pieces, filled.data(), kRegionBytes, std::byte{0xCD});
      ASSERT_TRUE(SameBytes(local.data(), expected_local.data(), kRegionBytes));
    }
  }
}

TEST_F(ShmTwoProcessTest, RefusalsAcrossProcesses) {
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  // Not exported: the memfd is never handed out; as a CMA region it is the engine's check
  // (the region is not in the Hello), so here ask for it as if it were shareable.
  RemoteRegionDesc hidden = descs_[3];
  hidden.SetKey(shm::EncodeHostRegionKey(true));
  absl::Status added = channel->AddRemoteRegions({hidden});
  EXPECT_EQ(added.code(), absl::StatusCode::kPermissionDenied) << added;
  EXPECT_THAT(added.message(), HasSubstr("region 104"));
  // A heap region asked for as shareable: refused by the target.
  RemoteRegionDesc heap = descs_[2];
  heap.SetKey(shm::EncodeHostRegionKey(true));
  added = channel->AddRemoteRegions({heap});
  EXPECT_EQ(added.code(), absl::StatusCode::kFailedPrecondition) << added;
  EXPECT_THAT(added.message(), HasSubstr("not memfd-backed"));

  // Read-only: the target hands out a read-only fd, and WRITE is refused before any copy.
  RemoteRegionDesc read_only = descs_[4];
  read_only.access = kRemoteReadWrite;
  ASSERT_TRUE(channel->AddRemoteRegions({read_only}).ok());
  Send(kPoison, 4, 0x5A);
  std::vector<std::byte> local(64, std::byte{1});
  PostRequest write;
  write.transfer_id = 3;
  write.kind = OpKind::kWrite;
  write.ops.push_back(WireOp{local.data(), 105, 0, 64});
  EXPECT_EQ(PostAndWait(*channel, std::move(write)).code(), absl::StatusCode::kPermissionDenied);
  PostRequest read;
  read.kind = OpKind::kRead;
  read.ops.push_back(WireOp{local.data(), 105, 0, 64});
  EXPECT_TRUE(PostAndWait(*channel, std::move(read)).ok());
  EXPECT_EQ(local[63], std::byte{0x5A});

  // Wrong token.
  absl::StatusOr<std::unique_ptr<Channel>> forged =
      initiator_->Connect(MakeLink(endpoint_, static_cast<uint32_t>(child_), "forged"));
  EXPECT_EQ(forged.status().code(), absl::StatusCode::kUnauthenticated) << forged.status();
}

TEST_F(ShmTwoProcessTest, TargetShutdownWithAConnectedPeer) {
  std::unique_ptr<Channel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  ASSERT_TRUE(channel->AddRemoteRegions({descs_[0]}).ok());
  CommandMessage message{kShutdown, 0, 0};
  ASSERT_TRUE(WriteAll(control_, &message, sizeof(message), Soon()));
  std::string took_ms;
  ASSERT_TRUE(ReadString(control_, &took_ms, Soon())) << "Shutdown hung in the target";
  std::printf("target Shutdown with a connected peer took %s ms\n", took_ms.c_str());
  // The mapping outlives the target's server; new fetches fail clearly.
  std::vector<std::byte> local(64, std::byte{3});
  PostRequest write;
  write.kind = OpKind::kWrite;
  write.ops.push_back(WireOp{local.data(), 101, 0, 64});
  EXPECT_TRUE(PostAndWait(*channel, std::move(write)).ok());
  const absl::Status added = channel->AddRemoteRegions({descs_[1]});
  EXPECT_FALSE(added.ok());
  EXPECT_THAT(added.message(), HasSubstr("region 102"));
}

}  // namespace
}  // namespace kvwire::transport

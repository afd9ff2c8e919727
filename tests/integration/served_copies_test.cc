// Served copies between real engines on one host (transport/shm/served_copy.h): a peer's
// grant-guarded region is never mapped, so the shm transport asks the peer to copy each op
// through a staging memfd instead of sending the bytes over loopback tcp. Many-op READs and
// WRITEs larger than the staging slots (pieces, several requests in flight), many transfers at
// once, byte-exact and counted as shm's; the grant still decides what is read (an op outside
// it fails its transfer and closes the reader, and its bytes never arrive); a reader that
// disconnects with transfers queued sees each of them end.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"
#include "src/util/pinned_ranges.h"
#include "tests/support/memfd_mappings.h"
#include "transport/shm/write_guard.h"

namespace kvwire::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kPage = 4096;
constexpr uint64_t kRegionBytes = 8 << 20;  // 8 staging slots' worth
constexpr absl::Duration kWait = absl::Seconds(30);

class ServedCopiesTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    target_ = MakeEngine("served-target");
    ASSERT_TRUE(target_);
    auto buffer = ShareableBuffer::Create(kRegionBytes, "served");
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffer_ = std::move(*buffer);
    for (uint64_t i = 0; i < kRegionBytes; ++i) {
      buffer_.data()[i] = static_cast<std::byte>(i * 31 + i / 4093);
    }
    RegionOptions ro;
    ro.export_to_all_peers = true;
    ro.reads_need_grant = true;
    auto id = target_->RegisterMemory(buffer_.data(), kRegionBytes, ro);
    ASSERT_TRUE(id.ok()) << id.status();
    region_ = *id;

    reader_ = MakeEngine("served-reader");
    ASSERT_TRUE(reader_);
    auto local = reader_->RegisterMemory(local_.data(), local_.size());
    ASSERT_TRUE(local.ok()) << local.status();
    local_id_ = *local;
    auto peer = reader_->Connect(target_->address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    ASSERT_TRUE(reader_->WaitForRemoteRegion(peer_, region_, kWait).ok());
    auto back = target_->WaitForPeer("served-reader", kWait);
    ASSERT_TRUE(back.ok()) << back.status();
    as_target_ = *back;
  }

  std::unique_ptr<Engine> MakeEngine(const std::string& name) {
    EngineOptions o;
    o.name = name;
    o.transport = GetParam();
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  absl::StatusOr<TransferId> Start(OpKind kind, const std::vector<Op>& ops, GrantId grant) {
    TransferOptions to;
    to.grant = grant;
    to.timeout = kWait;
    return reader_->Transfer(peer_, kind, ops, to);
  }
  absl::Status Run(OpKind kind, const std::vector<Op>& ops, GrantId grant) {
    absl::StatusOr<TransferId> id = Start(kind, ops, grant);
    if (!id.ok()) return id.status();
    return reader_->Wait(*id, kWait + absl::Seconds(5));
  }

  std::unique_ptr<Engine> target_;
  std::unique_ptr<Engine> reader_;
  ShareableBuffer buffer_;
  std::vector<std::byte> local_ = std::vector<std::byte>(kRegionBytes, std::byte{0});
  RegionId region_ = 0;
  RegionId local_id_ = 0;
  PeerId peer_ = 0;
  PeerId as_target_ = 0;
};

TEST_P(ServedCopiesTest, ManyOpsAndLargeOnesMoveByteExactOverShm) {
  const std::string route = reader_->Stats().peers.at(0).transport;
  std::printf("route (%s): %s\n", GetParam().c_str(), route.c_str());
  auto grant = target_->Grant(as_target_, {GrantRange{region_, 0, kRegionBytes}});
  ASSERT_TRUE(grant.ok()) << grant.status();
  // READ: 1,024 scattered 4 KiB pages (every other one, reversed here, so no two merge) into
  // the first 4 MiB here, and one 3 MiB op that spans several slots.
  std::vector<Op> reads;
  for (uint64_t p = 0; p < 1024; ++p) {
    reads.push_back(Op{local_id_, (1023 - p) * kPage, region_, p * 2 * kPage, kPage});
  }
  const uint64_t big_at = 5 << 20;
  reads.push_back(Op{local_id_, big_at, region_, big_at - 12345, 3 << 20});
  ASSERT_TRUE(Run(OpKind::kRead, reads, *grant).ok());
  for (uint64_t p = 0; p < 1024; ++p) {
    ASSERT_EQ(
        std::memcmp(local_.data() + (1023 - p) * kPage, buffer_.data() + p * 2 * kPage, kPage), 0)
        << "page " << p;
  }
  EXPECT_EQ(std::memcmp(local_.data() + big_at, buffer_.data() + big_at - 12345, 3 << 20), 0);
  // WRITE into the guarded region: served too (it is never mapped).
  for (uint64_t i = 0; i < 4 << 20; ++i) local_[i] = static_cast<std::byte>(i * 7 + 1);
  std::vector<Op> writes;
  for (uint64_t p = 0; p < 512; ++p)
    writes.push_back(Op{local_id_, p * kPage, region_, (1023 - p) * kPage, kPage});
  writes.push_back(Op{local_id_, 2 << 20, region_, 6 << 20, 2 << 20});
  ASSERT_TRUE(Run(OpKind::kWrite, writes, 0).ok());
  for (uint64_t p = 0; p < 512; ++p) {
    ASSERT_EQ(std::memcmp(buffer_.data() + (1023 - p) * kPage, local_.data() + p * kPage, kPage), 0)
        << "page " << p;
  }
  EXPECT_EQ(std::memcmp(buffer_.data() + (6 << 20), local_.data() + (2 << 20), 2 << 20), 0);
  const EngineStats stats = reader_->Stats();
  EXPECT_EQ(stats.TransportStatValue("bytes_by_transport", "shm_read"), 1024 * kPage + (3 << 20));
  EXPECT_EQ(stats.TransportStatValue("bytes_by_transport", "shm_written"), 512 * kPage + (2 << 20));
  EXPECT_EQ(stats.TransportStatValue("bytes_by_transport", "tcp_read"), 0u);
  // Counted as served copies on both sides: every byte asked for, and answered.
  const uint64_t moved = 1024 * kPage + (3 << 20) + 512 * kPage + (2 << 20);
  EXPECT_EQ(stats.TransportStatValue("shm", "served_copy_bytes"), moved);
  EXPECT_GE(stats.TransportStatValue("shm", "served_copy_requests"),
            5u);  // more than the slots hold
  const EngineStats served = target_->Stats();
  EXPECT_EQ(served.TransportStatValue("shm", "served_copy_bytes_answered"), moved);
  EXPECT_EQ(served.TransportStatValue("shm", "served_copy_requests_answered"),
            stats.TransportStatValue("shm", "served_copy_requests"));
  EXPECT_EQ(served.TransportStatValue("shm", "served_copy_requests_refused"), 0u);
}

TEST_P(ServedCopiesTest, ManyTransfersAtOnceAllArrive) {
  auto grant = target_->Grant(as_target_, {GrantRange{region_, 0, kRegionBytes}});
  ASSERT_TRUE(grant.ok()) << grant.status();
  // 32 transfers of 64 pages each, all in flight together (more than the slots).
  std::vector<TransferId> ids;
  for (uint64_t t = 0; t < 32; ++t) {
    std::vector<Op> ops;
    for (uint64_t p = 0; p < 64; ++p) {
      const uint64_t page = t * 64 + p;
      ops.push_back(Op{local_id_, page * kPage, region_, (2047 - page) * kPage, kPage});
    }
    absl::StatusOr<TransferId> id = Start(OpKind::kRead, ops, *grant);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  for (TransferId id : ids) ASSERT_TRUE(reader_->Wait(id, kWait + absl::Seconds(5)).ok());
  for (uint64_t page = 0; page < 2048; ++page) {
    ASSERT_EQ(
        std::memcmp(local_.data() + page * kPage, buffer_.data() + (2047 - page) * kPage, kPage), 0)
        << "page " << page;
  }
}

TEST_P(ServedCopiesTest, AnOpOutsideTheGrantFailsItsTransferAndClosesTheReader) {
  auto grant = target_->Grant(as_target_, {GrantRange{region_, 0, 64 * kPage}});
  ASSERT_TRUE(grant.ok()) << grant.status();
  // Pages 0..63 granted, then page 100 (another request's), then more granted ones.
  std::vector<Op> ops;
  for (uint64_t p = 0; p < 40; ++p)
    ops.push_back(Op{local_id_, p * 2 * kPage, region_, p * kPage, kPage});
  ops.push_back(Op{local_id_, 100 * 2 * kPage, region_, 100 * kPage, kPage});
  for (uint64_t p = 40; p < 64; ++p)
    ops.push_back(Op{local_id_, p * 2 * kPage, region_, p * kPage, kPage});
  const uint64_t refused = target_->Stats().grant_refused;
  const absl::Status s = Run(OpKind::kRead, ops, *grant);
  EXPECT_FALSE(s.ok());
  for (uint64_t i = 0; i < kPage; ++i) {
    ASSERT_EQ(local_[100 * 2 * kPage + i], std::byte{0}) << "a byte of an ungranted page arrived";
  }
  EXPECT_GT(target_->Stats().grant_refused, refused);
  EXPECT_EQ(target_->Stats().TransportStatValue("shm", "served_copy_requests_refused"), 1u);
  // The refusal closed the reader (its grants end with it), as over tcp.
  const absl::Time deadline = absl::Now() + kWait;
  while (target_->Stats().grants_live != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(target_->Stats().grants_live, 0u);
}

TEST_P(ServedCopiesTest, ADisconnectEndsEveryQueuedTransfer) {
  auto grant = target_->Grant(as_target_, {GrantRange{region_, 0, kRegionBytes}});
  ASSERT_TRUE(grant.ok()) << grant.status();
  std::vector<TransferId> ids;
  for (uint64_t t = 0; t < 16; ++t) {
    std::vector<Op> ops;
    for (uint64_t p = 0; p < 128; ++p) {
      ops.push_back(Op{local_id_, (t * 128 + p) * kPage, region_, (t * 128 + p) * kPage, kPage});
    }
    absl::StatusOr<TransferId> id = Start(OpKind::kRead, ops, *grant);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  ASSERT_TRUE(reader_->Disconnect(peer_).ok());
  int failed = 0;
  for (TransferId id : ids) {
    const absl::Status s = reader_->Wait(id, kWait + absl::Seconds(5));
    EXPECT_NE(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    failed += s.ok() ? 0 : 1;
  }
  std::printf("%d of %zu transfers failed after the disconnect\n", failed, ids.size());
}

// A buffer whose pages a device pinned (an rdma MR, as every host region is registered on a
// host with an RDMA device; a PinnedRange here, as rdma_regions.cc makes one) could not be
// moved to revoke a peer's mapping: its owner never maps it out. Same-host peers reach it
// through served copies, READ and WRITE, without a grant (it is not grant-guarded), byte-exact
// and over shm; the peer never holds a mapping of it, so a peer's close leaves nothing to
// revoke.
TEST_P(ServedCopiesTest, APinnedBufferIsServedNeverMapped) {
  const std::string name = absl::StrCat("pinned-", GetParam(), "-", getpid());
  auto buffer = ShareableBuffer::Create(2 << 20, name);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  for (size_t i = 0; i < buffer->size(); ++i) buffer->data()[i] = static_cast<std::byte>(i * 11);
  PinnedRange pinned(buffer->data(), buffer->size());
  ASSERT_EQ(MemfdMappings(name + " "), 1) << "the owner's own mapping";
  RegionOptions ro;
  ro.export_to_all_peers = true;
  auto region = target_->RegisterMemory(buffer->data(), buffer->size(), ro);
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_TRUE(reader_->WaitForRemoteRegion(peer_, *region, kWait).ok());

  std::vector<Op> reads;
  for (uint64_t p = 0; p < 256; ++p) {
    reads.push_back(Op{local_id_, p * kPage, *region, (511 - p) * kPage, kPage});
  }
  ASSERT_TRUE(Run(OpKind::kRead, reads, 0).ok());
  for (uint64_t p = 0; p < 256; ++p) {
    ASSERT_EQ(std::memcmp(local_.data() + p * kPage, buffer->data() + (511 - p) * kPage, kPage), 0)
        << "page " << p;
  }
  for (uint64_t i = 0; i < (1 << 20); ++i) local_[i] = static_cast<std::byte>(i * 5 + 3);
  ASSERT_TRUE(Run(OpKind::kWrite, {Op{local_id_, 0, *region, 1 << 20, 1 << 20}}, 0).ok());
  EXPECT_EQ(std::memcmp(buffer->data() + (1 << 20), local_.data(), 1 << 20), 0);

  EXPECT_EQ(MemfdMappings(name + " "), 1) << "the peer mapped the pinned buffer";
  const EngineStats stats = reader_->Stats();
  EXPECT_EQ(stats.TransportStatValue("bytes_by_transport", "shm_read"), 256 * kPage);
  EXPECT_EQ(stats.TransportStatValue("bytes_by_transport", "shm_written"), uint64_t{1} << 20);
  EXPECT_EQ(stats.TransportStatValue("bytes_by_transport", "tcp_read"), 0u);
  EXPECT_EQ(stats.TransportStatValue("bytes_by_transport", "tcp_written"), 0u);
  ASSERT_TRUE(target_->DeregisterMemory(*region).ok());
}

// A peer that does not answer a one-op transfer's copy holds the caller up to the transfer's
// own deadline, not to the link's request_timeout (10 s): a one-op request ends in the caller's
// thread (ends_host_ops_inline), where the engine watches no deadline. The owner's copier is
// held in the kernel by a userfaultfd write-protection of the region a WRITE copies into; a
// READ queued behind it ends at its deadline too. Once the guard goes, the late answers are
// dropped: the READ's bytes never reach local memory after it ended, and the link serves the
// next transfer.
TEST_P(ServedCopiesTest, AnUnansweredOneOpTransferEndsAtItsOwnDeadline) {
  if (absl::Status guard = transport::shm::WriteGuardAvailable(); !guard.ok()) {
    GTEST_SKIP() << "no userfaultfd write-protection here, so no way to stall the peer's "
                    "copier: "
                 << guard;
  }
  constexpr uint64_t kBytes = 64 << 10;
  constexpr uint64_t kReadAt = 4 << 20;  // the stalled READ's local bytes
  for (uint64_t i = 0; i < kBytes; ++i) local_[i] = static_cast<std::byte>(i * 7 + 1);
  std::fill(local_.begin() + kReadAt, local_.begin() + kReadAt + kBytes, std::byte{0xAB});
  auto grant = target_->Grant(as_target_, {GrantRange{region_, 0, kRegionBytes}});
  ASSERT_TRUE(grant.ok()) << grant.status();
  TransferOptions to;
  to.timeout = absl::Milliseconds(300);
  to.grant = *grant;
  {
    absl::StatusOr<transport::shm::WriteGuard> stall =
        transport::shm::WriteGuard::Arm(buffer_.data(), kRegionBytes);
    ASSERT_TRUE(stall.ok()) << stall.status();
    for (OpKind kind : {OpKind::kWrite, OpKind::kRead}) {
      const uint64_t local = kind == OpKind::kWrite ? 0 : kReadAt;
      const absl::Time start = absl::Now();
      absl::StatusOr<TransferId> id =
          reader_->Transfer(peer_, kind, {Op{local_id_, local, region_, 0, kBytes}}, to);
      const absl::Status status = id.ok() ? reader_->Wait(*id, kWait) : id.status();
      const absl::Duration took = absl::Now() - start;
      std::printf("one-op %s with a 300 ms deadline against a stalled copier: %s after %s\n",
                  kind == OpKind::kWrite ? "WRITE" : "READ",
                  std::string(absl::StatusCodeToString(status.code())).c_str(),
                  absl::FormatDuration(took).c_str());
      EXPECT_TRUE(absl::IsDeadlineExceeded(status)) << status;
      EXPECT_LT(took, absl::Seconds(3)) << "held up past the transfer's deadline";
    }
  }  // the copier goes on: its answers come late
  std::vector<Op> reads;
  for (uint64_t p = 0; p < 64; ++p)
    reads.push_back(Op{local_id_, p * kPage, region_, p * kPage, kPage});
  // Answered after the late ones (one connection, answered in order): they were handled.
  ASSERT_TRUE(Run(OpKind::kRead, reads, *grant).ok());
  EXPECT_EQ(std::memcmp(local_.data(), buffer_.data(), 64 * kPage), 0);
  for (uint64_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(local_[kReadAt + i], std::byte{0xAB})
        << "the ended READ's late answer landed at " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, ServedCopiesTest, ::testing::Values("shm", "auto"));

}  // namespace
}  // namespace kvwire::testing

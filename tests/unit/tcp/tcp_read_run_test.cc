// ReadRun, without sockets: READ headers buffered behind the one accepted are resolved as one
// run, each op then gets what resolving it alone gives, and whatever the run does not cover
// (a refused op, a header that is not what the run resolved, a WRITE) is resolved alone.
#include "transport/tcp/tcp_read_run.h"

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;

constexpr PeerId kPeer = 3;
constexpr RegionId kRegion = 7;
constexpr GrantId kGrant = 11;
constexpr uint64_t kMaxOpBytes = 1 << 20;

// One region of 64 KiB; an op at offset kRefusedOffset is refused. Counts its calls, and
// holds one pin per op it resolves (live while anything holds it).
class CountingHooks : public TargetHooks {
 public:
  static constexpr uint64_t kRefusedOffset = 40960;
  absl::StatusOr<PeerId> PeerForToken(const std::string&) override { return kPeer; }
  absl::StatusOr<IncomingAccess> ResolveIncoming(PeerId peer, RegionId region, uint64_t offset,
                                                 uint64_t length, OpKind kind) override {
    return ResolveIncoming(peer, region, offset, length, kind, 0);
  }
  absl::StatusOr<IncomingAccess> ResolveIncoming(PeerId peer, RegionId region, uint64_t offset,
                                                 uint64_t length, OpKind kind,
                                                 GrantId grant) override {
    ++single_calls;
    if (peer != kPeer || region != kRegion || kind != OpKind::kRead || grant != kGrant ||
        offset == kRefusedOffset || offset + length > memory.size()) {
      return absl::PermissionDeniedError(absl::StrCat("op at ", offset, " refused"));
    }
    return IncomingAccess{memory.data() + offset, -1, pin};
  }
  IncomingRun ResolveIncomingRun(PeerId peer, absl::Span<const IncomingOp> ops, OpKind kind,
                                 GrantId grant, absl::Span<IncomingMemory> out) override {
    ++run_calls;
    const size_t before = single_calls;
    IncomingRun run = TargetHooks::ResolveIncomingRun(peer, ops, kind, grant, out);
    single_calls = before;  // the default asks ResolveIncoming per op: not counted as such
    return run;
  }
  uint64_t AccessEpoch() override { return epoch; }
  absl::StatusOr<LocalRegion> ExportedRegion(PeerId, RegionId) override {
    return absl::NotFoundError("none");
  }
  void OnWriteArrived(PeerId, TransferId) override {}
  void OnPeerError(PeerId, const absl::Status&) override {}

  std::vector<std::byte> memory = std::vector<std::byte>(64 << 10);
  std::shared_ptr<const void> pin = std::make_shared<int>(0);
  size_t single_calls = 0;
  size_t run_calls = 0;
  uint64_t epoch = 0;
};

wire::RequestHeader Read(uint64_t sequence, uint64_t offset, uint64_t length = 4096) {
  wire::RequestHeader h;
  h.kind = wire::kKindRead;
  h.sequence = sequence;
  h.region = kRegion;
  h.offset = offset;
  h.length = length;
  h.grant = kGrant;
  return h;
}

// `count` READs of one page each, in sequence from `first_sequence`, op i at page i.
std::vector<wire::RequestHeader> PageReads(uint64_t count, uint64_t first_sequence = 0) {
  std::vector<wire::RequestHeader> headers;
  for (uint64_t i = 0; i < count; ++i) headers.push_back(Read(first_sequence + i, i * 4096));
  return headers;
}

// The bytes the reader holds after header `i` of `raw` (the encoded headers).
absl::Span<const std::byte> AheadOf(const std::vector<std::byte>& raw, size_t i) {
  return absl::MakeConstSpan(raw).subspan((i + 1) * wire::kRequestBytes);
}

// The encoded headers, as the reader buffers them.
std::vector<std::byte> Encode(const std::vector<wire::RequestHeader>& headers) {
  std::vector<std::byte> out(headers.size() * wire::kRequestBytes);
  for (size_t i = 0; i < headers.size(); ++i) {
    wire::EncodeRequest(headers[i], out.data() + i * wire::kRequestBytes);
  }
  return out;
}

// Accepts headers[0..] in order as the server does: each one's access, with the headers after
// it (those the reader would have buffered) as what lies ahead.
std::vector<absl::StatusOr<IncomingAccess>> AcceptAll(
    ReadRun& run, CountingHooks& hooks, const std::vector<wire::RequestHeader>& headers) {
  const std::vector<std::byte> raw = Encode(headers);
  std::vector<absl::StatusOr<IncomingAccess>> out;
  for (size_t i = 0; i < headers.size(); ++i) {
    out.push_back(run.Resolve(hooks, kPeer, headers[i], AheadOf(raw, i), kMaxOpBytes));
  }
  return out;
}

TEST(ReadRunTest, BufferedReadsAreResolvedOnceAndEachGetsItsOwnMemory) {
  CountingHooks hooks;
  const long idle = hooks.pin.use_count();
  ReadRun run;
  const std::vector<wire::RequestHeader> headers = PageReads(10, 100);
  {
    const auto accesses = AcceptAll(run, hooks, headers);
    EXPECT_EQ(hooks.run_calls, 1u);
    EXPECT_EQ(hooks.single_calls, 0u);
    for (size_t i = 0; i < accesses.size(); ++i) {
      ASSERT_TRUE(accesses[i].ok()) << i << ": " << accesses[i].status();
      EXPECT_EQ(accesses[i]->data, hooks.memory.data() + i * 4096) << i;
      EXPECT_NE(accesses[i]->pin, nullptr) << i;
    }
  }
  // Every op accepted and its access gone: the run holds nothing (its last op took its pin).
  EXPECT_EQ(hooks.pin.use_count(), idle);
}

TEST(ReadRunTest, ARunStopsAtTheFirstOpRefusedWhichGetsTheRefusalFoundOnce) {
  CountingHooks hooks;
  ReadRun run;
  const std::vector<wire::RequestHeader> headers = PageReads(14);  // 10 * 4096 is refused
  const auto accesses = AcceptAll(run, hooks, headers);
  for (size_t i = 0; i < 10; ++i) ASSERT_TRUE(accesses[i].ok()) << i;
  EXPECT_EQ(accesses[10].status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(accesses[10].status().message().find("op at 40960 refused"), std::string::npos);
  // Two runs: ops 0-9 and the refusal of op 10 (given to op 10 as found, not asked again: the
  // engine counts each refusal once), then ops 11-13.
  EXPECT_EQ(hooks.run_calls, 2u);
  EXPECT_EQ(hooks.single_calls, 0u);
  for (size_t i = 11; i < 14; ++i) {
    ASSERT_TRUE(accesses[i].ok()) << i;
    EXPECT_EQ(accesses[i]->data, hooks.memory.data() + i * 4096) << i;
  }
}

TEST(ReadRunTest, WhatTheRunDidNotResolveIsResolvedAlone) {
  CountingHooks hooks;
  ReadRun run;
  // Header 1 buffered says offset 4096; the header accepted as sequence 1 says 8192 (not
  // what the run resolved): it is resolved alone and gets its own memory.
  const std::vector<wire::RequestHeader> buffered = {Read(0, 0), Read(1, 4096)};
  const std::vector<std::byte> raw = Encode(buffered);
  auto first = run.Resolve(hooks, kPeer, buffered[0], AheadOf(raw, 0), kMaxOpBytes);
  ASSERT_TRUE(first.ok());
  auto other = run.Resolve(hooks, kPeer, Read(1, 8192), {}, kMaxOpBytes);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->data, hooks.memory.data() + 8192);
  EXPECT_EQ(hooks.single_calls, 1u);

  // A header that differs from what the run resolved in its region, its length or its grant
  // is not taken from the run (it is resolved alone, and refused here).
  for (int field = 0; field < 3; ++field) {
    const std::vector<wire::RequestHeader> two = {Read(10, 0), Read(11, 4096)};
    const std::vector<std::byte> bytes = Encode(two);
    ASSERT_TRUE(run.Resolve(hooks, kPeer, two[0], AheadOf(bytes, 0), kMaxOpBytes).ok());
    wire::RequestHeader changed = two[1];
    if (field == 0) changed.region = kRegion + 1;
    if (field == 1) changed.length = 8192;
    if (field == 2) changed.grant = kGrant + 1;
    const size_t before = hooks.single_calls;
    auto got = run.Resolve(hooks, kPeer, changed, {}, kMaxOpBytes);
    EXPECT_EQ(hooks.single_calls, before + 1) << "field " << field;
    if (field != 1) EXPECT_FALSE(got.ok()) << "field " << field;
  }
  hooks.single_calls = 1;
  hooks.run_calls = 1;
  run.Clear();

  // Headers that cannot join a run: a WRITE, another grant, a gap in the sequence, bytes that
  // are no header. The op resolves alone each time.
  wire::RequestHeader write = Read(3, 0);
  write.kind = wire::kKindWrite;
  wire::RequestHeader other_grant = Read(3, 0);
  other_grant.grant = kGrant + 1;
  for (const wire::RequestHeader& next : {write, other_grant, Read(4, 0)}) {
    const std::vector<std::byte> ahead = Encode({next});
    ASSERT_TRUE(run.Resolve(hooks, kPeer, Read(2, 0), ahead, kMaxOpBytes).ok());
  }
  std::vector<std::byte> junk(wire::kRequestBytes, std::byte{0x5a});
  ASSERT_TRUE(run.Resolve(hooks, kPeer, Read(2, 0), junk, kMaxOpBytes).ok());
  EXPECT_EQ(hooks.single_calls, 5u);
  EXPECT_EQ(hooks.run_calls, 1u);
}

// Access taken back after a run was checked (a grant revoked, a region unexported or about to
// move: the epoch changes): the ops not accepted yet are checked again, one new run.
TEST(ReadRunTest, ARunDoesNotOutliveAChangeOfAccess) {
  CountingHooks hooks;
  ReadRun run;
  const std::vector<wire::RequestHeader> headers = PageReads(6);
  const std::vector<std::byte> raw = Encode(headers);
  auto ahead = [&](size_t i) { return AheadOf(raw, i); };
  ASSERT_TRUE(run.Resolve(hooks, kPeer, headers[0], ahead(0), kMaxOpBytes).ok());
  ASSERT_TRUE(run.Resolve(hooks, kPeer, headers[1], ahead(1), kMaxOpBytes).ok());
  EXPECT_EQ(hooks.run_calls, 1u);
  ++hooks.epoch;
  ASSERT_TRUE(run.Resolve(hooks, kPeer, headers[2], ahead(2), kMaxOpBytes).ok());
  EXPECT_EQ(hooks.run_calls, 2u) << "op 2 was taken from a run checked before the change";
  for (size_t i = 3; i < 6; ++i)
    ASSERT_TRUE(run.Resolve(hooks, kPeer, headers[i], ahead(i), kMaxOpBytes).ok());
  EXPECT_EQ(hooks.run_calls, 2u);
}

TEST(ReadRunTest, ClearLetsGoOfTheOpsNotAcceptedYet) {
  CountingHooks hooks;
  ReadRun run;
  const std::vector<wire::RequestHeader> headers = PageReads(5);
  const std::vector<std::byte> raw = Encode(headers);
  const long idle = hooks.pin.use_count();
  {
    auto first = run.Resolve(hooks, kPeer, headers[0], AheadOf(raw, 0), kMaxOpBytes);
    ASSERT_TRUE(first.ok());
  }
  EXPECT_GT(hooks.pin.use_count(), idle) << "the run holds its ops";
  run.Clear();
  EXPECT_EQ(hooks.pin.use_count(), idle);
  // Cleared: the next header is resolved again (a new run), not taken from the old one.
  ASSERT_TRUE(run.Resolve(hooks, kPeer, headers[1], {}, kMaxOpBytes).ok());
  EXPECT_EQ(hooks.single_calls, 1u);
}

}  // namespace
}  // namespace kvwire::transport

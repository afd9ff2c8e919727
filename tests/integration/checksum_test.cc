// EngineOptions::verify_checksums (docs/CHECKSUMS.md): with it, an op whose bytes were
// corrupted on the way fails its transfer with DataLoss naming the transfer, the op and the
// peer; without it, the same corruption lands as a success: the reason the option exists.
// The corruption is the transports' test hook (src/util/fault_injection.h), which flips one
// byte where an op's bytes arrive (tcp: after the socket, shm: after the copy). Two engines in
// this process, over tcp and over shm (memfd regions).
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"
#include "src/util/fault_injection.h"
#include "tests/integration/test_pattern.h"

namespace kvwire::testing {
namespace {

namespace fi = fault_injection;

constexpr size_t kBytes = 1 << 20;
constexpr uint64_t kOp = 256 << 10;

struct Case {
  TransportKind transport;
  bool verify_initiator;  // which side sets the option (the pair uses it if either does)
  bool verify_target;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat(TransportKindName(info.param.transport),
                      info.param.verify_initiator ? "_VerifyInitiator" : "",
                      info.param.verify_target ? "_VerifyTarget" : "",
                      !info.param.verify_initiator && !info.param.verify_target ? "_NoVerify" : "");
}

fi::Site SiteOf(TransportKind t) {
  return t == TransportKind::kShm ? fi::Site::kShm : fi::Site::kTcp;
}

class ChecksumTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    fi::ArmPayloadFlips(SiteOf(GetParam().transport), 0);
    // The target's regions are memfd-backed so that shm maps them (tcp ignores that).
    auto source = ShareableBuffer::Create(kBytes, "crc-source");
    auto sink = ShareableBuffer::Create(kBytes, "crc-sink");
    ASSERT_TRUE(source.ok() && sink.ok());
    source_ = std::move(*source);
    sink_ = std::move(*sink);
    FillPattern(source_.data(), kBytes, 26, 0);
    local_.assign(kBytes, std::byte{0});
    FillPattern(local_.data(), kBytes, 26, 1);

    target_ = MakeEngine("crc-target", GetParam().verify_target);
    initiator_ = MakeEngine("crc-initiator", GetParam().verify_initiator);
    ASSERT_TRUE(target_ && initiator_);
    RegionOptions exported;
    exported.export_to_all_peers = true;
    auto s = target_->RegisterMemory(source_.data(), kBytes, exported);
    auto k = target_->RegisterMemory(sink_.data(), kBytes, exported);
    auto l = initiator_->RegisterMemory(local_.data(), kBytes);
    ASSERT_TRUE(s.ok() && k.ok() && l.ok());
    source_id_ = *s;
    sink_id_ = *k;
    local_id_ = *l;
    auto peer = initiator_->Connect(target_->address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    ASSERT_TRUE(initiator_->WaitForRemoteRegion(peer_, source_id_, absl::Seconds(10)).ok());
    ASSERT_TRUE(initiator_->WaitForRemoteRegion(peer_, sink_id_, absl::Seconds(10)).ok());
  }
  void TearDown() override { fi::ArmPayloadFlips(SiteOf(GetParam().transport), 0); }

  std::unique_ptr<Engine> MakeEngine(const std::string& name, bool verify) {
    EngineOptions options;
    options.name = name;
    options.transport = TransportKindName(GetParam().transport);
    options.verify_checksums = verify;
    auto engine = Engine::Create(options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }

  bool Verifying() const { return GetParam().verify_initiator || GetParam().verify_target; }

  // The whole buffer in kOp ops (READ from source_, or WRITE to sink_).
  absl::Status Move(OpKind kind) {
    std::vector<Op> ops;
    const RegionId remote = kind == OpKind::kRead ? source_id_ : sink_id_;
    for (uint64_t off = 0; off < kBytes; off += kOp)
      ops.push_back(Op{local_id_, off, remote, off, kOp});
    auto id = initiator_->Transfer(peer_, kind, ops);
    if (!id.ok()) return id.status();
    return initiator_->Wait(*id, absl::Seconds(30));
  }

  // Source and sink are declared first: they outlive the engines that map them.
  ShareableBuffer source_, sink_;
  std::vector<std::byte> local_;
  std::unique_ptr<Engine> target_, initiator_;
  RegionId source_id_ = 0, sink_id_ = 0, local_id_ = 0;
  PeerId peer_ = 0;
};

TEST_P(ChecksumTest, CleanTransfersSucceedAndThePathSaysItVerifies) {
  ASSERT_TRUE(Move(OpKind::kRead).ok());
  EXPECT_EQ(FirstDifference(local_.data(), source_.data(), kBytes), -1);
  FillPattern(local_.data(), kBytes, 26, 2);
  ASSERT_TRUE(Move(OpKind::kWrite).ok());
  EXPECT_EQ(FirstDifference(local_.data(), sink_.data(), kBytes), -1);
  const EngineStats stats = initiator_->Stats();
  ASSERT_EQ(stats.peers.size(), 1u);
  EXPECT_EQ(stats.peers[0].transport.find("+crc32c") != std::string::npos, Verifying())
      << stats.peers[0].transport;
}

TEST_P(ChecksumTest, AFlippedByteFailsTheTransferOnlyWhenVerifying) {
  for (OpKind kind : {OpKind::kRead, OpKind::kWrite}) {
    SCOPED_TRACE(kind == OpKind::kRead ? "READ" : "WRITE");
    const std::byte* from = kind == OpKind::kRead ? source_.data() : local_.data();
    const std::byte* to = kind == OpKind::kRead ? local_.data() : sink_.data();
    fi::ArmPayloadFlips(SiteOf(GetParam().transport), 1);
    const absl::Status s = Move(kind);
    EXPECT_EQ(fi::PayloadFlipsLeft(SiteOf(GetParam().transport)), 0) << "the hook never ran";
    if (Verifying()) {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_NE(s.message().find("checksum mismatch"), std::string::npos) << s;
      EXPECT_NE(s.message().find("crc-target"), std::string::npos) << "names the peer: " << s;
      EXPECT_NE(s.message().find(" op "), std::string::npos) << "names the op: " << s;
      EXPECT_NE(s.message().find("transfer "), std::string::npos) << s;
    } else {
      // Nothing checks: the corrupted byte lands and the transfer reports success.
      EXPECT_TRUE(s.ok()) << s;
      EXPECT_GE(FirstDifference(to, from, kBytes), 0) << "the flipped byte did not land";
    }
    // The path stays usable: the same transfer again, unharmed, is exact.
    ASSERT_TRUE(Move(kind).ok());
    EXPECT_EQ(FirstDifference(to, from, kBytes), -1);
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, ChecksumTest,
                         ::testing::Values(Case{TransportKind::kTcp, true, false},
                                           Case{TransportKind::kTcp, false, true},
                                           Case{TransportKind::kTcp, false, false},
                                           Case{TransportKind::kShm, true, false},
                                           Case{TransportKind::kShm, false, true},
                                           Case{TransportKind::kShm, false, false}),
                         CaseName);

}  // namespace
}  // namespace kvwire::testing

// PeerGrants: which regions each peer holds over rdma, and that each revocation path (export
// withdrawn, region deregistered, peer dropped) hands back exactly what it must, grants before
// the domain they live in.
#include "transport/rdma/rdma_grants.h"

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kvwire::transport::rdma {
namespace {

// Records its destruction in a shared log, like an MR (grant) or a PD (domain) would be torn
// down.
class Tracked {
 public:
  Tracked(std::string name, std::shared_ptr<std::vector<std::string>> log)
      : name_(std::move(name)), log_(std::move(log)) {}
  Tracked(Tracked&& other) noexcept : name_(std::move(other.name_)), log_(std::move(other.log_)) {}
  Tracked& operator=(Tracked&&) = delete;
  ~Tracked() {
    if (log_) log_->push_back(name_);
  }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::shared_ptr<std::vector<std::string>> log_;
};

using Grants = PeerGrants<Tracked, Tracked>;

class PeerGrantsTest : public ::testing::Test {
 protected:
  Tracked Make(const std::string& name) { return Tracked(name, log_); }
  void Grant(PeerId peer, RegionId region) {
    ASSERT_TRUE(grants_
                    .DomainOf(peer,
                              [&]() -> absl::StatusOr<Tracked> {
                                return Make("pd" + std::to_string(peer));
                              })
                    .ok());
    EXPECT_FALSE(
        grants_.Add(peer, region, Make("mr" + std::to_string(peer) + "." + std::to_string(region)))
            .has_value());
  }

  std::shared_ptr<std::vector<std::string>> log_ = std::make_shared<std::vector<std::string>>();
  Grants grants_;
};

TEST_F(PeerGrantsTest, DomainIsMadeOnceAndAFailureLeavesNothing) {
  int made = 0;
  auto make = [&]() -> absl::StatusOr<Tracked> {
    ++made;
    return Make("pd1");
  };
  auto a = grants_.DomainOf(1, make);
  auto b = grants_.DomainOf(1, make);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(made, 1);
  auto failed = grants_.DomainOf(
      2, []() -> absl::StatusOr<Tracked> { return absl::ResourceExhaustedError("no PD"); });
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(grants_.HasDomain(2));
  EXPECT_EQ(grants_.peers(), 1u);
}

TEST_F(PeerGrantsTest, AGrantNeedsTheDomainAndIsNotReplaced) {
  // No domain (the peer was dropped while its MR was registered): the grant comes back.
  std::optional<Tracked> back = grants_.Add(7, 1, Make("orphan"));
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->name(), "orphan");
  Grant(7, 1);
  // A concurrent export of the same region lost.
  std::optional<Tracked> second = grants_.Add(7, 1, Make("second"));
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->name(), "second");
  ASSERT_NE(grants_.Find(7, 1), nullptr);
  EXPECT_EQ(grants_.Find(7, 1)->name(), "mr7.1");
  EXPECT_EQ(grants_.grants(), 1u);
}

TEST_F(PeerGrantsTest, WithdrawingAnExportTakesOnlyThatGrant) {
  Grant(1, 10);
  Grant(1, 11);
  Grant(2, 10);
  std::optional<Tracked> revoked = grants_.Revoke(1, 10);
  ASSERT_TRUE(revoked.has_value());
  EXPECT_EQ(revoked->name(), "mr1.10");
  EXPECT_EQ(grants_.Find(1, 10), nullptr);
  EXPECT_NE(grants_.Find(1, 11), nullptr);
  EXPECT_NE(grants_.Find(2, 10), nullptr);
  EXPECT_FALSE(grants_.Revoke(1, 10).has_value());  // twice: nothing
  EXPECT_FALSE(grants_.Revoke(3, 10).has_value());  // unknown peer
  EXPECT_TRUE(grants_.HasDomain(1));                // the peer keeps its domain
}

TEST_F(PeerGrantsTest, DeregisteringARegionTakesItFromEveryPeer) {
  Grant(1, 10);
  Grant(2, 10);
  Grant(2, 11);
  std::vector<Tracked> revoked = grants_.RevokeRegion(10);
  ASSERT_EQ(revoked.size(), 2u);
  EXPECT_EQ(grants_.Find(1, 10), nullptr);
  EXPECT_EQ(grants_.Find(2, 10), nullptr);
  EXPECT_NE(grants_.Find(2, 11), nullptr);
  EXPECT_EQ(grants_.grants(), 1u);
  EXPECT_TRUE(grants_.RevokeRegion(10).empty());
}

TEST_F(PeerGrantsTest, DroppingAPeerTakesItsGrantsThenItsDomain) {
  Grant(1, 10);
  Grant(1, 11);
  Grant(2, 10);
  log_->clear();
  {
    Grants::Dropped dropped = grants_.DropPeer(1);
    ASSERT_TRUE(dropped.domain.has_value());
    EXPECT_EQ(dropped.grants.size(), 2u);
    EXPECT_TRUE(log_->empty());  // handed back, destroyed by the caller outside its lock
  }
  // MRs are deregistered before their PD is deallocated.
  ASSERT_EQ(log_->size(), 3u);
  EXPECT_EQ(log_->back(), "pd1");
  EXPECT_FALSE(grants_.HasDomain(1));
  EXPECT_EQ(grants_.Find(1, 11), nullptr);
  EXPECT_NE(grants_.Find(2, 10), nullptr);
  EXPECT_FALSE(grants_.DropPeer(1).domain.has_value());  // twice: nothing
}

TEST_F(PeerGrantsTest, ClearTakesEverything) {
  Grant(1, 10);
  Grant(2, 11);
  std::vector<Grants::Dropped> all = grants_.Clear();
  EXPECT_EQ(all.size(), 2u);
  EXPECT_EQ(grants_.peers(), 0u);
  EXPECT_EQ(grants_.grants(), 0u);
}

}  // namespace
}  // namespace kvwire::transport::rdma

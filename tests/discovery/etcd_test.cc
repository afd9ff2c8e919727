// The etcd client, registration and prefix watch against real etcd members that the test
// starts on loopback (tests/support/etcd_cluster.h): one member, one killed and restarted
// (with and without its data), one paused (a member that accepts and never answers), and a
// three-member cluster that loses a member.
#include <sys/wait.h>

#include <csignal>
#include <functional>
#include <unistd.h>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/discovery/etcd_client.h"
#include "src/discovery/prefix_watcher.h"
#include "src/discovery/registration.h"
#include "tests/support/etcd_cluster.h"

namespace kvwire::discovery {
namespace {

using kvwire::testing::EtcdCluster;

bool WaitFor(const std::function<bool()>& pred, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return pred();
}

std::shared_ptr<EtcdClient> Client(const std::string& endpoints,
                                   absl::Duration timeout = absl::Seconds(2)) {
  EtcdOptions o;
  o.endpoints = endpoints;
  o.call_timeout = timeout;
  absl::StatusOr<std::unique_ptr<EtcdClient>> c = EtcdClient::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::shared_ptr<EtcdClient>(std::move(*c)) : nullptr;
}

bool HasKey(EtcdClient& c, const std::string& key) {
  absl::StatusOr<EtcdRange> r = c.Get(key);
  return r.ok() && r->kvs.size() == 1;
}

// A child process holding a registration (register_child.cc).
class Child {
 public:
  Child(const std::string& endpoints, const std::string& key, int ttl) {
    // Everything the child needs is made before fork (other threads run here).
    const std::string ttl_text = std::to_string(ttl);
    pid_ = fork();
    if (pid_ == 0) {
      execl(KVWIRE_REGISTER_CHILD, KVWIRE_REGISTER_CHILD, endpoints.c_str(), key.c_str(),
            "{\"role\":\"decode\"}", ttl_text.c_str(), nullptr);
      _exit(127);
    }
  }
  ~Child() { Signal(SIGKILL); }
  int Signal(int sig) {
    if (pid_ <= 0) return -1;
    kill(pid_, sig);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
};

class EtcdOneMember : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<EtcdCluster>> c = EtcdCluster::Start(1);
    ASSERT_TRUE(c.ok()) << c.status();
    etcd_ = std::move(*c);
    client_ = Client(etcd_->endpoints());
    ASSERT_NE(client_, nullptr);
  }
  void TearDown() override {
    if (HasFailure() && etcd_ != nullptr) std::fprintf(stderr, "%s\n", etcd_->Logs().c_str());
  }
  std::unique_ptr<EtcdCluster> etcd_;
  std::shared_ptr<EtcdClient> client_;
};

TEST_F(EtcdOneMember, PutGetPrefixDelete) {
  ASSERT_TRUE(client_->Put("/kvwire/t/instances/a", "va").ok());
  ASSERT_TRUE(client_->Put("/kvwire/t/instances/b", "vb").ok());
  ASSERT_TRUE(client_->Put("/kvwire/t/other", "x").ok());
  ASSERT_TRUE(client_->Put("/kvwire/t/instancesX", "y").ok());
  absl::StatusOr<EtcdRange> r = client_->GetPrefix("/kvwire/t/instances/");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->kvs.size(), 2u);
  EXPECT_EQ(r->kvs[0].key, "/kvwire/t/instances/a");
  EXPECT_EQ(r->kvs[1].value, "vb");
  absl::StatusOr<int64_t> d = client_->Delete("/kvwire/t/instances/a");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, 1);
  EXPECT_FALSE(HasKey(*client_, "/kvwire/t/instances/a"));
  // Binary-safe keys and values (base64 on the wire).
  const std::string odd("k\0\xff\n", 4), val("\x00\x01{\"", 4);
  ASSERT_TRUE(client_->Put(odd, val).ok());
  r = client_->Get(odd);
  ASSERT_TRUE(r.ok() && r->kvs.size() == 1);
  EXPECT_EQ(r->kvs[0].value, val);
}

TEST_F(EtcdOneMember, LeaseExpiresAndRevokeDeletes) {
  absl::StatusOr<EtcdLease> lease = client_->GrantLease(2);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(client_->Put("/l/a", "1", lease->id).ok());
  absl::StatusOr<EtcdLease> k = client_->KeepAlive(lease->id);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_GT(k->ttl, 0);
  // Nobody keeps it alive: the key goes with the lease.
  EXPECT_TRUE(WaitFor([&] { return !HasKey(*client_, "/l/a"); }, absl::Seconds(10)));
  EXPECT_TRUE(absl::IsNotFound(client_->KeepAlive(lease->id).status()));
  // A revoke removes the key at once.
  lease = client_->GrantLease(30);
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(client_->Put("/l/b", "1", lease->id).ok());
  ASSERT_TRUE(client_->Revoke(lease->id).ok());
  EXPECT_FALSE(HasKey(*client_, "/l/b"));
  // A put on a lease that does not exist is refused with etcd's reason.
  absl::Status s = client_->Put("/l/c", "1", 12345).status();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_NE(s.message().find("lease not found"), std::string::npos) << s;
}

TEST_F(EtcdOneMember, UnreachableAndSilentEtcdGiveBoundedErrors) {
  // Nothing listens: refused (retried until the call's deadline, as a leader election would
  // be), and the error names the endpoint.
  etcd_->Kill(0);
  std::shared_ptr<EtcdClient> c = Client(etcd_->endpoint(0), absl::Seconds(2));
  absl::Time start = absl::Now();
  absl::Status s = c->Get("/x").status();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find(etcd_->endpoint(0).substr(7)), std::string::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  // A member that accepts and never answers: the call ends at its deadline.
  ASSERT_TRUE(etcd_->Restart(0, /*wipe=*/false).ok());
  etcd_->Pause(0);
  start = absl::Now();
  s = c->Put("/x", "1").status();
  const absl::Duration took = absl::Now() - start;
  etcd_->Resume(0);
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_GE(took, absl::Milliseconds(1900));
  EXPECT_LT(took, absl::Seconds(5));
  // Bad endpoints are refused when the client is made.
  EXPECT_FALSE(EtcdClient::Create({.endpoints = "https://127.0.0.1:2379"}).ok());
  EXPECT_FALSE(EtcdClient::Create({.endpoints = "127.0.0.1"}).ok());
  EXPECT_FALSE(EtcdClient::Create({.endpoints = ""}).ok());
}

TEST_F(EtcdOneMember, GracefulStopDeletesAtOnceAndDeadInstanceExpires) {
  std::unique_ptr<PrefixWatcher> w;
  {
    absl::StatusOr<std::unique_ptr<PrefixWatcher>> s =
        PrefixWatcher::Start(client_, "/kvwire/c/instances/", nullptr);
    ASSERT_TRUE(s.ok()) << s.status();
    w = std::move(*s);
  }
  auto present = [&](const std::string& k) { return w->snapshot().count(k) == 1; };
  // Graceful: a long lease (30 s), yet the key goes at once on SIGTERM.
  Child graceful(etcd_->endpoints(), "/kvwire/c/instances/g", 30);
  ASSERT_TRUE(WaitFor([&] { return present("/kvwire/c/instances/g"); }, absl::Seconds(10)));
  absl::Time stop = absl::Now();
  EXPECT_EQ(graceful.Signal(SIGTERM), 0);
  EXPECT_TRUE(WaitFor([&] { return !present("/kvwire/c/instances/g"); }, absl::Seconds(3)));
  EXPECT_LT(absl::Now() - stop, absl::Seconds(10));
  // Dead (SIGKILL): the key stays until its 2 s lease runs out, then the watch sees it go.
  Child dead(etcd_->endpoints(), "/kvwire/c/instances/d", 2);
  ASSERT_TRUE(WaitFor([&] { return present("/kvwire/c/instances/d"); }, absl::Seconds(10)));
  absl::SleepFor(absl::Seconds(3));  // several keep-alives: the lease is renewed
  EXPECT_TRUE(present("/kvwire/c/instances/d"));
  dead.Signal(SIGKILL);
  EXPECT_TRUE(present("/kvwire/c/instances/d"));
  EXPECT_TRUE(WaitFor([&] { return !present("/kvwire/c/instances/d"); }, absl::Seconds(15)));
  EXPECT_TRUE(w->connected());
}

TEST_F(EtcdOneMember, RegistrationAndWatchResumeWhenEtcdReturns) {
  std::shared_ptr<EtcdClient> fast = Client(etcd_->endpoints(), absl::Milliseconds(800));
  RegistrationOptions ro;
  ro.ttl_seconds = 2;
  ro.retry = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<Registration>> reg =
      Registration::Start(fast, "/kvwire/c/instances/r", "v1", ro);
  ASSERT_TRUE(reg.ok()) << reg.status();
  ASSERT_TRUE((*reg)->first_attempt().ok()) << (*reg)->first_attempt();
  int changes = 0;
  Mutex mu;
  PrefixWatcherOptions wo;
  wo.retry = absl::Milliseconds(200);
  wo.session = absl::Seconds(2);  // several sessions in this test: resumes are exercised
  absl::StatusOr<std::unique_ptr<PrefixWatcher>> w = PrefixWatcher::Start(
      fast, "/kvwire/c/instances/",
      [&](const PrefixWatcher::Snapshot&) {
        MutexLock lock(&mu);
        ++changes;
      },
      wo);
  ASSERT_TRUE(w.ok()) << w.status();
  auto present = [&] { return (*w)->snapshot().count("/kvwire/c/instances/r") == 1; };
  ASSERT_TRUE(WaitFor(present, absl::Seconds(5)));

  // Restarted with its data: the lease survived; nothing is written again.
  ASSERT_TRUE(etcd_->Restart(0, /*wipe=*/false).ok());
  ASSERT_TRUE(
      WaitFor([&] { return (*reg)->registered() && HasKey(*client_, "/kvwire/c/instances/r"); },
              absl::Seconds(10)));
  EXPECT_EQ((*reg)->writes(), 1);

  // Down for longer than the lease, then back empty: the watcher keeps the last copy while
  // etcd is away, the registration writes the key again, the watcher lists it again.
  etcd_->Kill(0);
  ASSERT_TRUE(WaitFor([&] { return !(*w)->connected(); }, absl::Seconds(10)));
  EXPECT_TRUE(present());
  absl::SleepFor(absl::Seconds(3));
  EXPECT_FALSE((*reg)->registered());
  const int64_t lists = (*w)->lists();
  ASSERT_TRUE(etcd_->Restart(0, /*wipe=*/true).ok());
  EXPECT_TRUE(
      WaitFor([&] { return HasKey(*client_, "/kvwire/c/instances/r"); }, absl::Seconds(10)));
  EXPECT_TRUE(WaitFor([&] { return (*w)->connected() && (*w)->lists() > lists && present(); },
                      absl::Seconds(10)));
  EXPECT_GE((*reg)->writes(), 2);
  // Still followed after the recovery: a new key shows up through the watch.
  ASSERT_TRUE(client_->Put("/kvwire/c/instances/late", "x").ok());
  EXPECT_TRUE(WaitFor([&] { return (*w)->snapshot().count("/kvwire/c/instances/late") == 1; },
                      absl::Seconds(5)));
  reg->reset();
  EXPECT_FALSE(HasKey(*client_, "/kvwire/c/instances/r"));
  MutexLock lock(&mu);
  EXPECT_GE(changes, 3);
}

TEST(EtcdThreeMembers, OneMemberKilled) {
  absl::StatusOr<std::unique_ptr<EtcdCluster>> c = EtcdCluster::Start(3);
  ASSERT_TRUE(c.ok()) << c.status();
  EtcdCluster& etcd = **c;
  std::shared_ptr<EtcdClient> client = Client(etcd.endpoints(), absl::Seconds(2));
  RegistrationOptions ro;
  ro.ttl_seconds = 2;
  ro.retry = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<Registration>> reg =
      Registration::Start(client, "/kvwire/c/instances/r", "v", ro);
  ASSERT_TRUE(reg.ok() && (*reg)->first_attempt().ok());
  absl::StatusOr<std::unique_ptr<PrefixWatcher>> w =
      PrefixWatcher::Start(client, "/kvwire/c/instances/", nullptr);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(WaitFor([&] { return (*w)->snapshot().size() == 1; }, absl::Seconds(5)));
  // The member the client talks to first goes; the other two keep a quorum.
  etcd.Kill(0);
  ASSERT_TRUE(client->Put("/kvwire/c/instances/after", "x").ok());
  EXPECT_TRUE(WaitFor([&] { return (*w)->snapshot().size() == 2; }, absl::Seconds(10)))
      << etcd.Logs();
  // Well past the 2 s lease: kept alive through the survivors.
  absl::SleepFor(absl::Seconds(4));
  EXPECT_TRUE(HasKey(*client, "/kvwire/c/instances/r"));
  EXPECT_EQ((*reg)->writes(), 1);
  EXPECT_TRUE((*reg)->registered());
  // A client that knows only the dead member says so.
  std::shared_ptr<EtcdClient> lone = Client(etcd.endpoint(0), absl::Seconds(1));
  EXPECT_TRUE(absl::IsUnavailable(lone->Get("/x").status()));
  reg->reset();
  EXPECT_FALSE(HasKey(*client, "/kvwire/c/instances/r"));
}

}  // namespace
}  // namespace kvwire::discovery

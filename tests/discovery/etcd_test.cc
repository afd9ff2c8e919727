// The etcd client, registration and prefix watch against real etcd members that the test
// starts on loopback (tests/support/etcd_cluster.h): one member, one killed and restarted
// (with and without its data), one paused (a member that accepts and never answers), and a
// three-member cluster that loses a member; etcd's own authentication (user and password,
// tokens that expire) and TLS (a client certificate, a CA that does not match).
#include <sys/wait.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/connector.h"
#include "src/discovery/etcd_client.h"
#include "src/discovery/prefix_watcher.h"
#include "src/discovery/registration.h"
#include "tests/support/etcd_cluster.h"

namespace kvwire::discovery {
namespace {

using kvwire::testing::EtcdCluster;
using kvwire::testing::EtcdClusterOptions;

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
  EXPECT_FALSE(EtcdClient::Create({.endpoints = "ftp://127.0.0.1:2379"}).ok());
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
  // The key reaches etcd before the registration counts its write (Register counts after
  // Put returns), so the count is waited for, not read once.
  EXPECT_TRUE(WaitFor([&] { return (*reg)->writes() >= 2; }, absl::Seconds(10)))
      << "writes: " << (*reg)->writes();
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

// --- etcd's own authentication and TLS ------------------------------------------------------

std::unique_ptr<EtcdClient> MustClient(EtcdOptions o) {
  absl::StatusOr<std::unique_ptr<EtcdClient>> c = EtcdClient::Create(std::move(o));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// A watch on `prefix` sees a key put under it while it runs.
bool WatchSeesAPut(EtcdClient& c, const std::string& prefix) {
  absl::StatusOr<EtcdRange> before = c.Get(prefix + "none");
  if (!before.ok()) return false;
  std::atomic<bool> seen{false};
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(300));
    (void)c.Put(prefix + "w", "x");
  });
  WatchCancel cancel;
  const absl::Status s = c.Watch(
      prefix, before->revision + 1, absl::Now() + absl::Seconds(10),
      [&](const EtcdWatchMessage& m) {
        for (const EtcdWatchEvent& e : m.events) {
          if (e.kv.key == prefix + "w") seen = true;
        }
        return !seen;
      },
      &cancel);
  writer.join();
  EXPECT_TRUE(s.ok()) << s;
  return seen;
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/kvwire-etcd-test-XXXXXX";
    if (mkdtemp(tmpl) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A cluster with authentication enabled (`etcdctl user add root`, `auth enable`) and tokens
// that live 2 s (--auth-token-ttl): a client with the user's password works (calls, leases,
// watch), also after its token expired; a client without credentials and one with a wrong
// password get errors that say why; the password can come from a file and from the
// environment (as a server's connector takes it).
TEST(EtcdAuth, UserAndPassword) {
  EtcdClusterOptions co;
  co.extra_args = {"--auth-token-ttl", "2"};
  absl::StatusOr<std::unique_ptr<EtcdCluster>> etcd = EtcdCluster::Start(1, absl::Seconds(30), co);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string endpoints = (*etcd)->endpoints();
  const absl::Status enabled = (*etcd)->EnableAuth("s3cret-pw");
  ASSERT_TRUE(enabled.ok()) << enabled;

  // No credentials: etcd refuses, and the error says a user is missing.
  std::unique_ptr<EtcdClient> anonymous = MustClient({.endpoints = endpoints});
  ASSERT_NE(anonymous, nullptr);
  absl::StatusOr<int64_t> put = anonymous->Put("/auth/k", "v");
  ASSERT_FALSE(put.ok());
  EXPECT_TRUE(absl::StrContains(put.status().message(), "user name is empty")) << put.status();

  // A wrong password: a clear error, at Authenticate() and at every call.
  std::unique_ptr<EtcdClient> wrong =
      MustClient({.endpoints = endpoints, .user = "root", .password = "not-it"});
  ASSERT_NE(wrong, nullptr);
  const absl::Status auth = wrong->Authenticate();
  EXPECT_TRUE(absl::IsInvalidArgument(auth)) << auth;
  EXPECT_TRUE(absl::StrContains(auth.message(), "etcd authentication as 'root' failed")) << auth;
  EXPECT_TRUE(absl::StrContains(auth.message(), "invalid user ID or password")) << auth;
  put = wrong->Put("/auth/k", "v");
  EXPECT_TRUE(absl::IsInvalidArgument(put.status())) << put.status();

  // The right one: calls, a lease, a watch.
  std::unique_ptr<EtcdClient> good =
      MustClient({.endpoints = endpoints, .user = "root", .password = "s3cret-pw"});
  ASSERT_NE(good, nullptr);
  EXPECT_TRUE(good->Authenticate().ok());
  ASSERT_TRUE(good->Put("/auth/k", "v").ok());
  absl::StatusOr<EtcdRange> got = good->GetPrefix("/auth/");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->kvs.size(), 1u);
  EXPECT_EQ(got->kvs[0].value, "v");
  absl::StatusOr<EtcdLease> lease = good->GrantLease(5);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(good->KeepAlive(lease->id).ok());
  EXPECT_TRUE(WatchSeesAPut(*good, "/auth/watch/"));

  // Past the token's 2 s: etcd refuses it ("invalid auth token"); the client takes a new one.
  absl::SleepFor(absl::Seconds(4));
  got = good->Get("/auth/k");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->kvs.size(), 1u);
  absl::SleepFor(absl::Seconds(4));
  EXPECT_TRUE(WatchSeesAPut(*good, "/auth/watch2/"));

  // From the environment, the password in a file (as a server's connector takes them), through
  // ConnectorOptions::FromEnvironment: kvwire's one reader of KVWIRE_ETCD_*.
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string file = dir.path() + "/password";
  std::ofstream(file) << "s3cret-pw\n";
  setenv("KVWIRE_ETCD_USER", "root", 1);
  setenv("KVWIRE_ETCD_PASSWORD_FILE", file.c_str(), 1);
  absl::StatusOr<ConnectorOptions> env = ConnectorOptions::FromEnvironment(ConnectorOptions());
  ASSERT_TRUE(env.ok()) << env.status();
  std::unique_ptr<EtcdClient> from_env =
      MustClient({.endpoints = endpoints, .user = env->etcd_user, .password = env->etcd_password});
  ASSERT_NE(from_env, nullptr);
  EXPECT_TRUE(from_env->Put("/auth/env", "e").ok());
  // The client itself reads no environment: given no user, it is not authenticated, and etcd
  // refuses its write though the variables are set.
  std::unique_ptr<EtcdClient> bare = MustClient({.endpoints = endpoints});
  ASSERT_NE(bare, nullptr);
  absl::StatusOr<int64_t> bare_put = bare->Put("/auth/bare", "b");
  ASSERT_FALSE(bare_put.ok());
  EXPECT_TRUE(absl::StrContains(bare_put.status().message(), "user name is empty"))
      << bare_put.status();
  setenv("KVWIRE_ETCD_PASSWORD_FILE", (dir.path() + "/missing").c_str(), 1);
  absl::StatusOr<ConnectorOptions> missing = ConnectorOptions::FromEnvironment(ConnectorOptions());
  EXPECT_FALSE(missing.ok());
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "cannot read password file"))
      << missing.status();
  unsetenv("KVWIRE_ETCD_USER");
  unsetenv("KVWIRE_ETCD_PASSWORD_FILE");
  EXPECT_FALSE(EtcdClient::Create({.endpoints = endpoints, .password = "alone"}).ok());
}

// A connector given etcd's credentials in its options (no KVWIRE_ETCD_* in the environment)
// registers under authentication; a wrong password is an error at Create that says why, and
// credentials without endpoints are refused rather than ignored.
TEST(EtcdAuth, ConnectorTakesCredentialsFromItsOptions) {
  ASSERT_EQ(std::getenv("KVWIRE_ETCD_USER"), nullptr);
  ASSERT_EQ(std::getenv("KVWIRE_ETCD_PASSWORD"), nullptr);
  absl::StatusOr<std::unique_ptr<EtcdCluster>> etcd = EtcdCluster::Start(1, absl::Seconds(30));
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string endpoints = (*etcd)->endpoints();
  const absl::Status enabled = (*etcd)->EnableAuth("opt-pw");
  ASSERT_TRUE(enabled.ok()) << enabled;
  auto options = [&](const std::string& password) {
    ConnectorOptions o;
    o.engine.name = "auth-by-options";
    o.engine.transport = "tcp";
    o.engine.listen_address = "127.0.0.1:0";
    o.role = "prefill";
    o.etcd_endpoints = endpoints;
    o.cluster = "authopts";
    o.etcd_user = "root";
    o.etcd_password = password;
    return o;
  };

  absl::StatusOr<std::unique_ptr<Connector>> wrong = Connector::Create(options("a guess"));
  ASSERT_FALSE(wrong.ok());
  EXPECT_TRUE(absl::StrContains(wrong.status().message(), "etcd authentication as 'root' failed"))
      << wrong.status();

  ConnectorOptions alone = options("opt-pw");
  alone.etcd_endpoints.clear();
  alone.cluster.clear();
  absl::StatusOr<std::unique_ptr<Connector>> no_endpoints = Connector::Create(alone);
  ASSERT_FALSE(no_endpoints.ok());
  EXPECT_EQ(no_endpoints.status().message(), "etcd_user: set without etcd_endpoints")
      << no_endpoints.status();

  absl::StatusOr<std::unique_ptr<Connector>> c = Connector::Create(options("opt-pw"));
  ASSERT_TRUE(c.ok()) << c.status();
  const absl::Status announced = (*c)->Announce("127.0.0.1:1");
  ASSERT_TRUE(announced.ok()) << announced;
  EXPECT_TRUE(WaitFor([&] { return (*c)->Announced(); }, absl::Seconds(10)));
  std::unique_ptr<EtcdClient> reader =
      MustClient({.endpoints = endpoints, .user = "root", .password = "opt-pw"});
  ASSERT_NE(reader, nullptr);
  absl::StatusOr<EtcdRange> got = reader->GetPrefix("/kvwire/authopts/instances/");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->kvs.size(), 1u);
  EXPECT_TRUE(absl::StrContains(got->kvs[0].key, "auth-by-options")) << got->kvs[0].key;
}

// A member that serves https:// and requires a client certificate (--client-cert-auth):
// a client with the CA and its certificate works; without a certificate, or trusting
// another CA, it is refused with the TLS error; certificates for an http:// cluster are a
// configuration error. Authentication on top of TLS works too.
TEST(EtcdTls, ClientCertificateAndCa) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  absl::StatusOr<kvwire::testing::TestPki> pki = kvwire::testing::MakeTestPki(dir.path());
  ASSERT_TRUE(pki.ok()) << pki.status();
  EtcdClusterOptions co;
  co.server_cert = pki->server_cert;
  co.server_key = pki->server_key;
  co.client_ca = pki->ca;
  co.access.ca_file = pki->ca;
  co.access.cert_file = pki->client_cert;
  co.access.key_file = pki->client_key;
  absl::StatusOr<std::unique_ptr<EtcdCluster>> etcd = EtcdCluster::Start(1, absl::Seconds(30), co);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string endpoints = (*etcd)->endpoints();
  ASSERT_TRUE(absl::StartsWith(endpoints, "https://")) << endpoints;

  std::unique_ptr<EtcdClient> good = MustClient({.endpoints = endpoints,
                                                 .ca_file = pki->ca,
                                                 .cert_file = pki->client_cert,
                                                 .key_file = pki->client_key});
  ASSERT_NE(good, nullptr);
  ASSERT_TRUE(good->Put("/tls/k", "v").ok());
  EXPECT_TRUE(WatchSeesAPut(*good, "/tls/watch/"));

  // No client certificate: the member ends the handshake.
  std::unique_ptr<EtcdClient> no_cert =
      MustClient({.endpoints = endpoints, .call_timeout = absl::Seconds(1), .ca_file = pki->ca});
  ASSERT_NE(no_cert, nullptr);
  absl::StatusOr<EtcdRange> r = no_cert->Get("/tls/k");
  EXPECT_FALSE(r.ok());
  // Trusting another CA: the client refuses the member's certificate.
  std::unique_ptr<EtcdClient> other_ca = MustClient({.endpoints = endpoints,
                                                     .call_timeout = absl::Seconds(1),
                                                     .ca_file = pki->other_ca,
                                                     .cert_file = pki->client_cert,
                                                     .key_file = pki->client_key});
  ASSERT_NE(other_ca, nullptr);
  r = other_ca->Get("/tls/k");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::StrContains(r.status().message(), "TLS handshake")) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "certificate verify failed")) << r.status();
  // Certificates for a plain-http cluster, a key without its certificate, a CA file that
  // does not exist: refused at once.
  absl::StatusOr<std::unique_ptr<EtcdClient>> bad =
      EtcdClient::Create({.endpoints = "http://127.0.0.1:2379", .ca_file = pki->ca});
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  bad = EtcdClient::Create({.endpoints = endpoints, .key_file = pki->client_key});
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  bad = EtcdClient::Create({.endpoints = endpoints, .ca_file = dir.path() + "/none.pem"});
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "none.pem")) << bad.status();

  // Authentication over TLS.
  const absl::Status enabled = (*etcd)->EnableAuth("tls-pw");
  ASSERT_TRUE(enabled.ok()) << enabled;
  EXPECT_FALSE(good->Put("/tls/k2", "v").ok());  // no user
  std::unique_ptr<EtcdClient> both = MustClient({.endpoints = endpoints,
                                                 .user = "root",
                                                 .password = "tls-pw",
                                                 .ca_file = pki->ca,
                                                 .cert_file = pki->client_cert,
                                                 .key_file = pki->client_key});
  ASSERT_NE(both, nullptr);
  absl::StatusOr<int64_t> put = both->Put("/tls/k2", "v");
  EXPECT_TRUE(put.ok()) << put.status();
}

}  // namespace
}  // namespace kvwire::discovery

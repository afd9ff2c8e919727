#include "tests/support/etcd_cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

#include "src/discovery/etcd_client.h"

namespace kvwire::testing {

namespace {

constexpr char kEtcd[] = "/usr/bin/etcd";

// A port the kernel reports free on loopback now (bound to port 0, then released).
absl::StatusOr<int> FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return absl::InternalError("bind to a free port failed");
  }
  close(fd);
  return ntohs(a.sin_port);
}

std::string Tail(const std::string& path, size_t bytes = 3000) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > bytes ? s.substr(s.size() - bytes) : s;
}

void Reap(pid_t& pid, int sig) {
  if (pid <= 0) return;
  kill(pid, sig);
  if (sig == SIGSTOP) return;
  int status = 0;
  waitpid(pid, &status, 0);
  pid = -1;
}

}  // namespace

absl::StatusOr<TestPki> MakeTestPki(const std::string& dir) {
  if (access("/usr/bin/openssl", X_OK) != 0) {
    return absl::FailedPreconditionError(
        "no /usr/bin/openssl: install Debian's openssl (scripts/install-deps.sh does)");
  }
  TestPki p;
  p.ca = dir + "/ca.pem";
  p.server_cert = dir + "/server.pem";
  p.server_key = dir + "/server.key";
  p.client_cert = dir + "/client.pem";
  p.client_key = dir + "/client.key";
  p.other_ca = dir + "/other-ca.pem";
  {
    std::ofstream ext(dir + "/server.ext");
    // clientAuth too: with --client-cert-auth, etcd's HTTP gateway presents the server's
    // certificate to its own gRPC port.
    ext << "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n";
    std::ofstream cext(dir + "/client.ext");
    cext << "extendedKeyUsage=clientAuth\n";
  }
  // The client certificate has no CommonName: with authentication enabled etcd's HTTP
  // gateway refuses a client certificate that names a user ("CommonName of client sending a
  // request against gateway will be ignored"); the user comes from the password.
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::vector<std::string> steps = {
      absl::StrCat("openssl req -x509 ", key, " -keyout ", dir, "/ca.key -out ", p.ca,
                   " -days 2 -subj /CN=kvwire-test-ca"),
      absl::StrCat("openssl req -x509 ", key, " -keyout ", dir, "/other-ca.key -out ", p.other_ca,
                   " -days 2 -subj /CN=kvwire-other-ca"),
      absl::StrCat("openssl req ", key, " -keyout ", p.server_key, " -out ", dir,
                   "/server.csr -subj /CN=127.0.0.1"),
      absl::StrCat("openssl x509 -req -in ", dir, "/server.csr -CA ", p.ca, " -CAkey ", dir,
                   "/ca.key -CAcreateserial -days 2 -out ", p.server_cert, " -extfile ", dir,
                   "/server.ext"),
      absl::StrCat("openssl req ", key, " -keyout ", p.client_key, " -out ", dir,
                   "/client.csr -subj /O=kvwire-client"),
      absl::StrCat("openssl x509 -req -in ", dir, "/client.csr -CA ", p.ca, " -CAkey ", dir,
                   "/ca.key -CAcreateserial -days 2 -out ", p.client_cert, " -extfile ", dir,
                   "/client.ext"),
  };
  for (const std::string& step : steps) {
    const std::string cmd = absl::StrCat(step, " > ", dir, "/openssl.log 2>&1");
    if (std::system(cmd.c_str()) != 0) {
      return absl::InternalError(
          absl::StrCat("'", step, "' failed:\n", Tail(dir + "/openssl.log")));
    }
  }
  return p;
}

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(int members, absl::Duration timeout,
                                                                EtcdClusterOptions options) {
  if (access(kEtcd, X_OK) != 0) {
    return absl::FailedPreconditionError(
        "no /usr/bin/etcd: install Debian's etcd-server (scripts/install-deps.sh does)");
  }
  // Ports are free when chosen, but another process may take one before etcd binds it: a
  // cluster that does not come up is started again on new ports.
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::unique_ptr<EtcdCluster> c(new EtcdCluster());
    c->options_ = options;
    char tmpl[] = "/tmp/kvwire-etcd-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
    c->dir_ = tmpl;
    for (int i = 0; i < members; ++i) {
      Member m;
      m.name = absl::StrCat("m", i);
      m.data_dir = absl::StrCat(c->dir_, "/", m.name, ".etcd");
      m.log = absl::StrCat(c->dir_, "/", m.name, ".log");
      absl::StatusOr<int> cp = FreePort(), pp = FreePort();
      if (!cp.ok()) return cp.status();
      if (!pp.ok()) return pp.status();
      m.client_port = *cp;
      m.peer_port = *pp;
      c->members_.push_back(m);
    }
    last = absl::OkStatus();
    for (Member& m : c->members_) {
      if (last.ok()) last = c->Launch(m, /*existing=*/false);
    }
    const absl::Time deadline = absl::Now() + timeout;
    for (int i = 0; i < members && last.ok(); ++i) last = c->WaitReady(i, deadline);
    if (last.ok()) return c;
    last = absl::Status(last.code(), absl::StrCat(last.message(), "\n", c->Logs()));
  }
  return last;
}

EtcdCluster::~EtcdCluster() {
  for (Member& m : members_) {
    if (m.pid > 0) kill(m.pid, SIGCONT);
    Reap(m.pid, SIGKILL);
  }
  std::error_code ignored;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
}

std::string EtcdCluster::endpoint(int i) const {
  return absl::StrCat(options_.server_cert.empty() ? "http" : "https",
                      "://127.0.0.1:", members_.at(i).client_port);
}

std::string EtcdCluster::endpoints() const {
  std::vector<std::string> all;
  for (int i = 0; i < size(); ++i) all.push_back(endpoint(i));
  return absl::StrJoin(all, ",");
}

std::string EtcdCluster::InitialCluster() const {
  std::vector<std::string> all;
  for (const Member& m : members_) {
    all.push_back(absl::StrCat(m.name, "=http://127.0.0.1:", m.peer_port));
  }
  return absl::StrJoin(all, ",");
}

absl::Status EtcdCluster::Launch(Member& m, bool existing) {
  const std::string client =
      absl::StrCat(options_.server_cert.empty() ? "http" : "https", "://127.0.0.1:", m.client_port);
  const std::string peer = absl::StrCat("http://127.0.0.1:", m.peer_port);
  std::vector<std::string> args = {kEtcd,
                                   "--name",
                                   m.name,
                                   "--data-dir",
                                   m.data_dir,
                                   "--listen-client-urls",
                                   client,
                                   "--advertise-client-urls",
                                   client,
                                   "--listen-peer-urls",
                                   peer,
                                   "--initial-advertise-peer-urls",
                                   peer,
                                   "--initial-cluster",
                                   InitialCluster(),
                                   "--initial-cluster-state",
                                   existing ? "existing" : "new",
                                   "--initial-cluster-token",
                                   absl::StrCat("kvwire-test-", getpid()),
                                   "--heartbeat-interval",
                                   "50",
                                   "--election-timeout",
                                   "500",
                                   "--logger",
                                   "zap",
                                   "--log-outputs",
                                   "stderr",
                                   "--log-level",
                                   "warn"};
  if (!options_.server_cert.empty()) {
    args.insert(args.end(),
                {"--cert-file", options_.server_cert, "--key-file", options_.server_key});
    if (!options_.client_ca.empty()) {
      args.insert(args.end(), {"--trusted-ca-file", options_.client_ca, "--client-cert-auth"});
    }
  }
  args.insert(args.end(), options_.extra_args.begin(), options_.extra_args.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int log = open(m.log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) return absl::InternalError(absl::StrCat("cannot open ", m.log));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(log);
    return absl::InternalError("fork failed");
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the test
    if (getppid() != parent) _exit(126);
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    dup2(log, STDOUT_FILENO);
    dup2(log, STDERR_FILENO);
    execv(kEtcd, argv.data());
    _exit(127);
  }
  close(log);
  m.pid = pid;
  return absl::OkStatus();
}

absl::Status EtcdCluster::WaitReady(int i, absl::Time deadline) {
  discovery::EtcdOptions o = options_.access;
  o.endpoints = endpoint(i);
  o.call_timeout = absl::Seconds(1);
  absl::StatusOr<std::unique_ptr<discovery::EtcdClient>> c = discovery::EtcdClient::Create(o);
  if (!c.ok()) return c.status();
  absl::Status last;
  while (absl::Now() < deadline) {
    if (!Running(i)) {
      return absl::InternalError(absl::StrCat("etcd member ", i, " exited"));
    }
    absl::StatusOr<discovery::EtcdRange> r = (*c)->Get("/kvwire-test-ready");
    if (r.ok()) return absl::OkStatus();
    last = r.status();
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("etcd member ", i, " not ready: ", last.message()));
}

void EtcdCluster::Kill(int i) {
  Member& m = members_.at(i);
  if (m.pid > 0) kill(m.pid, SIGCONT);
  Reap(m.pid, SIGKILL);
}

void EtcdCluster::Pause(int i) {
  if (members_.at(i).pid > 0) kill(members_[i].pid, SIGSTOP);
}

void EtcdCluster::Resume(int i) {
  if (members_.at(i).pid > 0) kill(members_[i].pid, SIGCONT);
}

bool EtcdCluster::Running(int i) {
  Member& m = members_.at(i);
  if (m.pid <= 0) return false;
  int status = 0;
  if (waitpid(m.pid, &status, WNOHANG) == m.pid) {
    m.pid = -1;
    return false;
  }
  return true;
}

absl::Status EtcdCluster::Restart(int i, bool wipe, absl::Duration timeout) {
  Kill(i);
  Member& m = members_.at(i);
  if (wipe) {
    if (size() != 1) return absl::InvalidArgumentError("wipe restarts only a single member");
    std::error_code ignored;
    std::filesystem::remove_all(m.data_dir, ignored);
  }
  // A member with data rejoins from it; a wiped single member starts a new cluster.
  if (absl::Status s = Launch(m, /*existing=*/false); !s.ok()) return s;
  return WaitReady(i, absl::Now() + timeout);
}

absl::Status EtcdCluster::EnableAuth(const std::string& root_password) {
  // It goes through a shell command line.
  if (root_password.empty() ||
      root_password.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                      "0123456789._-") != std::string::npos) {
    return absl::InvalidArgumentError("EnableAuth: use a password of letters, digits, . _ -");
  }
  std::string flags;
  if (!options_.access.ca_file.empty())
    absl::StrAppend(&flags, " --cacert ", options_.access.ca_file);
  if (!options_.access.cert_file.empty()) {
    absl::StrAppend(&flags, " --cert ", options_.access.cert_file, " --key ",
                    options_.access.key_file);
  }
  for (const std::string& command :
       {absl::StrCat("user add root:", root_password), std::string("user grant-role root root"),
        std::string("auth enable")}) {
    const std::string cmd = absl::StrCat("ETCDCTL_API=3 /usr/bin/etcdctl --endpoints ", endpoints(),
                                         flags, " ", command, " 2>&1");
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) return absl::InternalError("popen failed");
    std::string out;
    char buf[512];
    while (fgets(buf, sizeof(buf), p) != nullptr) out += buf;
    if (pclose(p) != 0) return absl::InternalError(absl::StrCat("'", cmd, "' failed: ", out));
  }
  return absl::OkStatus();
}

std::string EtcdCluster::Logs() const {
  std::string all;
  for (const Member& m : members_) absl::StrAppend(&all, "--- etcd ", m.name, "\n", Tail(m.log));
  return all;
}

}  // namespace kvwire::testing

// Real etcd members (Debian's etcd-server) for tests: started on loopback with free ports and
// a temporary data folder, killed with the test process whatever ends it (PR_SET_PDEATHSIG),
// stopped and their folder removed when the handle goes away. Elections are fast (50 ms
// heartbeat, 500 ms election timeout), so a lease TTL of 2 s is legal.
#ifndef KVWIRE_TESTS_SUPPORT_ETCD_CLUSTER_H_
#define KVWIRE_TESTS_SUPPORT_ETCD_CLUSTER_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/discovery/etcd_client.h"

namespace kvwire::testing {

// Certificates for a TLS etcd on loopback, made with the openssl command: a CA, a server
// certificate for IP 127.0.0.1 and a client certificate, all signed by it, and a second CA
// that signed nothing here (a client that trusts only it must refuse the members).
struct TestPki {
  std::string ca, server_cert, server_key, client_cert, client_key, other_ca;
};
absl::StatusOr<TestPki> MakeTestPki(const std::string& dir);

struct EtcdClusterOptions {
  // More etcd flags for every member (e.g. "--auth-token-ttl", "2").
  std::vector<std::string> extra_args;
  // TLS on the client port when set: members serve https:// with this certificate and key,
  // and require client certificates signed by client_ca when that is set.
  std::string server_cert, server_key, client_ca;
  // How the cluster's own readiness check reaches the members (CA, client certificate).
  discovery::EtcdOptions access;
};

class EtcdCluster {
 public:
  // `members` members of one cluster; returns once every member answers a linearizable read.
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(
      int members, absl::Duration timeout = absl::Seconds(30),
      EtcdClusterOptions options = EtcdClusterOptions());
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "http://127.0.0.1:P,..." (https:// with TLS) of every member / of member i.
  std::string endpoints() const;
  std::string endpoint(int i) const;
  // SIGKILLs member i and reaps it.
  void Kill(int i);
  // SIGSTOPs / SIGCONTs member i (a member that accepts connections and never answers).
  void Pause(int i);
  void Resume(int i);
  // Starts member i again on its ports; `wipe` first deletes its data (single-member
  // clusters: a new cluster that knows no lease or key of the old one). Waits until it
  // answers.
  absl::Status Restart(int i, bool wipe, absl::Duration timeout = absl::Seconds(30));
  bool Running(int i);
  std::string Logs() const;
  // Turns on etcd's authentication as an operator does (etcdctl `user add root`, `user
  // grant-role root root`, `auth enable`), through the members' TLS when they serve it.
  absl::Status EnableAuth(const std::string& root_password);

 private:
  struct Member {
    std::string name, data_dir, log;
    int client_port = 0, peer_port = 0;
    pid_t pid = -1;
  };
  EtcdCluster() = default;
  absl::Status Launch(Member& m, bool existing);
  absl::Status WaitReady(int i, absl::Time deadline);
  std::string InitialCluster() const;

  std::string dir_;
  EtcdClusterOptions options_;
  std::vector<Member> members_;
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_ETCD_CLUSTER_H_

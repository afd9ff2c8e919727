// A process that registers one key and holds it until SIGTERM (graceful: the key goes at
// once) or SIGKILL (the key goes when its lease expires). Used by discovery_etcd_test.
//   discovery_register_child ENDPOINTS KEY VALUE TTL_S
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "src/discovery/registration.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s ENDPOINTS KEY VALUE TTL_S\n", argv[0]);
    return 2;
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  kvwire::discovery::EtcdOptions o;
  o.endpoints = argv[1];
  o.call_timeout = absl::Seconds(1);
  auto etcd = kvwire::discovery::EtcdClient::Create(o);
  if (!etcd.ok()) return 1;
  kvwire::discovery::RegistrationOptions ro;
  ro.ttl_seconds = std::atoi(argv[4]);
  auto r = kvwire::discovery::Registration::Start(std::move(*etcd), argv[2], argv[3], ro);
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n", std::string(r.status().message()).c_str());
    return 1;
  }
  std::printf("registered=%d\n", (*r)->first_attempt().ok() ? 1 : 0);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  r->reset();
  return 0;
}

// The target of hostile_tcp_test: a kvwire engine in its own process with short tcp listener
// limits, regions filled with the test pattern and exported to every peer. It prints one READY
// line (like kvwire_test_peer), then answers commands on stdin, one line each:
//
//   DEREGISTER <region>  ->  "DEREGISTER ok <ms>" | "DEREGISTER error <ms> <message>"
//   STATS                ->  "STATS <EngineStats::ToJson()>"
//   TRANSPORT <peer name>  ->  "TRANSPORT <chosen transport>" ("" while channels are set up)
//   LIMIT_THREADS        ->  "LIMIT_THREADS ok" | "LIMIT_THREADS error <message>": from now on
//                            the process cannot start a thread (real uid nobody, saved uid
//                            kept, RLIMIT_NPROC 0); running threads go on
//   UNLIMIT_THREADS      ->  "UNLIMIT_THREADS ok" | "... error <message>": undoes it
//
// and exits when stdin closes.
//
//   hostile_tcp_target --regions=3 --region_bytes=1048576 --seed=5 --secret=s
//                      --max_connections=16 --max_per_peer=4 --max_pending=64
//                      --max_pending_per_address=8 --hello_ms=4000 --io_ms=1000
#include <sys/resource.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "tests/integration/test_pattern.h"
#include "tests/support/flags.h"

namespace {

struct Args {
  int regions = 3;
  uint64_t region_bytes = 1 << 20;
  uint64_t seed = 5;
  std::string secret;
  int max_connections = 1024;
  int max_per_peer = 64;
  int max_pending = 128;
  int max_pending_per_address = 32;
  int hello_ms = 10000;
  int io_ms = 5000;
};

absl::Status ParseArgs(int argc, char** argv, Args* args) {
  return kvwire::testing::FlagParser()
      .Int("regions", &args->regions)
      .Int("region_bytes", &args->region_bytes)
      .Int("seed", &args->seed)
      .String("secret", &args->secret)
      .Int("max_connections", &args->max_connections)
      .Int("max_per_peer", &args->max_per_peer)
      .Int("max_pending", &args->max_pending)
      .Int("max_pending_per_address", &args->max_pending_per_address)
      .Int("hello_ms", &args->hello_ms)
      .Int("io_ms", &args->io_ms)
      .Parse(argc, argv);
}

// Thread creation fails with EAGAIN once the real uid's task count is at RLIMIT_NPROC. Root
// is exempt from that limit, hence (as root) the uid change; the saved uid lets the process
// return.
std::string LimitThreads(bool limit) {
  static const bool root = getuid() == 0;
  static rlim_t saved_soft = RLIM_INFINITY;
  rlimit nproc{};
  if (getrlimit(RLIMIT_NPROC, &nproc) != 0) return std::strerror(errno);
  if (limit) {
    saved_soft = nproc.rlim_cur;
    nproc.rlim_cur = 0;
    if (setrlimit(RLIMIT_NPROC, &nproc) != 0) return std::strerror(errno);
    if (root && setresuid(65534, 65534, 0) != 0) return std::strerror(errno);
  } else {
    if (root && setresuid(0, 0, 0) != 0) return std::strerror(errno);
    nproc.rlim_cur = saved_soft;
    if (setrlimit(RLIMIT_NPROC, &nproc) != 0) return std::strerror(errno);
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (absl::Status parsed = ParseArgs(argc, argv, &args); !parsed.ok()) {
    std::fprintf(stderr, "hostile_tcp_target: bad arguments: %s\n", parsed.ToString().c_str());
    return 2;
  }
  kvwire::EngineOptions options;
  options.name = "hostile-tcp-target";
  options.shared_secret = args.secret;
  options.transport = "tcp";
  // The test's readiness backend (hostile_tcp_test runs over epoll and over io_uring).
  if (const char* backend = std::getenv("KVWIRE_TCP_IO_BACKEND"); backend != nullptr) {
    options.tcp().io_backend = backend;
  }
  options.tcp().max_data_connections = args.max_connections;
  options.tcp().max_data_connections_per_peer = args.max_per_peer;
  options.tcp().max_pending_hellos = args.max_pending;
  options.tcp().max_pending_hellos_per_address = args.max_pending_per_address;
  options.tcp().hello_timeout = absl::Milliseconds(args.hello_ms);
  options.tcp().io_timeout = absl::Milliseconds(args.io_ms);
  // Declared before the engine so that it outlives it: the engine's destruction joins the
  // threads that served it (what ThreadSanitizer needs to see before the memory goes).
  std::vector<std::vector<std::byte>> memory(args.regions);
  auto engine = kvwire::Engine::Create(options);
  if (!engine.ok()) {
    std::fprintf(stderr, "hostile_tcp_target: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  std::vector<kvwire::RegionId> ids;
  for (int r = 0; r < args.regions; ++r) {
    memory[r].resize(args.region_bytes);
    kvwire::testing::FillPattern(memory[r].data(), args.region_bytes, args.seed, r);
    kvwire::RegionOptions ropts;
    ropts.export_to_all_peers = true;
    auto id = (*engine)->RegisterMemory(memory[r].data(), args.region_bytes, ropts);
    if (!id.ok()) {
      std::fprintf(stderr, "hostile_tcp_target: %s\n", id.status().ToString().c_str());
      return 1;
    }
    ids.push_back(*id);
  }
  std::printf("READY address=%s name=%s regions=%s pid=%d\n", (*engine)->address().c_str(),
              (*engine)->name().c_str(), absl::StrJoin(ids, ",").c_str(), getpid());
  std::fflush(stdout);

  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (parts.empty()) continue;
    kvwire::RegionId region = 0;
    if (parts[0] == "DEREGISTER" && parts.size() == 2 && absl::SimpleAtoi(parts[1], &region)) {
      const absl::Time start = absl::Now();
      const absl::Status s = (*engine)->DeregisterMemory(region);
      const int64_t ms = absl::ToInt64Milliseconds(absl::Now() - start);
      if (s.ok()) {
        std::printf("DEREGISTER ok %lld\n", static_cast<long long>(ms));
      } else {
        std::printf("DEREGISTER error %lld %s\n", static_cast<long long>(ms),
                    std::string(s.message()).c_str());
      }
    } else if (parts[0] == "LIMIT_THREADS" || parts[0] == "UNLIMIT_THREADS") {
      const std::string error = LimitThreads(parts[0] == "LIMIT_THREADS");
      std::printf("%s %s%s\n", parts[0].c_str(), error.empty() ? "ok" : "error ", error.c_str());
    } else if (parts[0] == "TRANSPORT" && parts.size() == 2) {
      std::string transport;
      for (const kvwire::PeerInfo& p : (*engine)->Peers()) {
        if (p.name == parts[1] && p.alive) transport = p.transport;
      }
      std::printf("TRANSPORT %s\n", transport.c_str());
    } else if (parts[0] == "STATS") {
      std::printf("STATS %s\n", (*engine)->Stats().ToJson().c_str());
    } else {
      std::printf("ERROR unknown command \"%s\"\n", line.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}

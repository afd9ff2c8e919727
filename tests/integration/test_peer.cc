// A kvwire engine in its own process for the integration tests. It registers regions filled
// with a known pattern, exports them to every peer, prints one READY line on stdout, then
// serves until stdin closes. For each notification "check:<region>:<offset>:<length>:<fnv>"
// it verifies its own memory at that moment and prints "NOTIFY <transfer> ok|bad".
//
//   kvwire_test_peer --transport=tcp --regions=2 --region_bytes=1048576 --shareable=1
//                    --seed=7 --secret=s --salt=0 --name=peer-a --shm_cma=1
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <poll.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <variant>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "tests/integration/test_pattern.h"
#include "tests/support/flags.h"
#include "tests/support/sanitizer_build.h"
#include "tests/transport/pipe/pipe_transport.h"

namespace {

// The defect the build's sanitizer reports, committed on purpose (see Args::sanitizer_report).
// `opaque` is 0 at run time but unknown to the compiler, so the defect is not folded away.
void CommitSanitizedDefect(int opaque) {
#if KVWIRE_TEST_TSAN
  int racy = 0;
  std::thread writer([&] { racy = 1; });  // unsynchronised with the write below
  racy = 2 + opaque;
  writer.join();
  std::printf("racy=%d\n", racy);
#elif KVWIRE_TEST_ASAN
  auto block = std::make_unique<char[]>(8);
  volatile char past_the_end = block[8 + opaque];
  std::printf("read %d\n", past_the_end);
#else
  (void)opaque;
#endif
  std::fflush(stdout);
}

struct Args {
  std::string transport = "auto";
  int regions = 2;
  uint64_t region_bytes = 1 << 20;
  bool shareable = true;
  uint64_t seed = 1;
  std::string secret;
  uint64_t salt = 0;
  std::string name = "test-peer";
  int lease_ms = 5000;
  bool shm_cma = false;  // ShmOptions::cma
  // Status to exit with once stdin closes: tests of the harness plant a failing peer with it.
  int exit_code = 0;
  // Seconds to keep running after stdin closes: plants a peer that hangs on exit.
  int linger_s = 0;
  // 1: commits, once stdin closes, the defect the build's sanitizer reports (a data race
  // under TSan, a heap overflow under ASan): plants a peer whose report must fail the test.
  bool sanitizer_report = false;
};

absl::Status ParseArgs(int argc, char** argv, Args* args) {
  return kvwire::testing::FlagParser()
      .String("transport", &args->transport)
      .Int("regions", &args->regions)
      .Int("region_bytes", &args->region_bytes)
      .Bool("shareable", &args->shareable)
      .Int("seed", &args->seed)
      .String("secret", &args->secret)
      .Int("salt", &args->salt)
      .String("name", &args->name)
      .Int("lease_ms", &args->lease_ms)
      .Bool("shm_cma", &args->shm_cma)
      .Int("exit_code", &args->exit_code)
      .Int("linger_s", &args->linger_s)
      .Bool("sanitizer_report", &args->sanitizer_report)
      .Parse(argc, argv);
}

bool StdinClosed() {
  pollfd p{STDIN_FILENO, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  char c;
  return read(STDIN_FILENO, &c, 1) <= 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (absl::Status parsed = ParseArgs(argc, argv, &args); !parsed.ok()) {
    std::fprintf(stderr, "test_peer: bad arguments: %s\n", parsed.ToString().c_str());
    return 2;
  }
  kvwire::EngineOptions options;
  options.name = args.name;
  options.shared_secret = args.secret;
  options.compat_salt = args.salt;
  options.peer_lease = absl::Milliseconds(args.lease_ms);
  options.heartbeat_interval = absl::Milliseconds(std::max(50, args.lease_ms / 10));
  if (args.transport == kvwire::testing::kPipeTransportName) {
    // A transport of tests/ only: registered, then chosen by rank ("auto").
    kvwire::testing::AddPipeTransport(&options);
  } else {
    options.transport = args.transport;  // Engine::Create checks the name
  }
  options.shm().cma = args.shm_cma;
  auto from_env = kvwire::EngineOptions::FromEnvironment(options);
  if (!from_env.ok()) {
    std::fprintf(stderr, "test_peer: %s\n", from_env.status().ToString().c_str());
    return 2;
  }
  options = *std::move(from_env);
  auto engine = kvwire::Engine::Create(options);
  if (!engine.ok()) {
    std::fprintf(stderr, "test_peer: %s\n", engine.status().ToString().c_str());
    return 1;
  }

  // Shareable regions for shm's memfd path; plain heap memory otherwise (cma or tcp).
  std::vector<kvwire::ShareableBuffer> shareable;
  std::vector<std::vector<std::byte>> heap;
  std::vector<std::byte*> bases;
  std::vector<kvwire::RegionId> ids;
  std::map<kvwire::RegionId, int> index_of;
  for (int r = 0; r < args.regions; ++r) {
    std::byte* base;
    if (args.shareable) {
      auto buf = kvwire::ShareableBuffer::Create(args.region_bytes, "test-peer");
      if (!buf.ok()) {
        std::fprintf(stderr, "test_peer: %s\n", buf.status().ToString().c_str());
        return 1;
      }
      base = buf->data();
      shareable.push_back(std::move(*buf));
    } else {
      heap.emplace_back(args.region_bytes);
      base = heap.back().data();
    }
    kvwire::testing::FillPattern(base, args.region_bytes, args.seed, r);
    kvwire::RegionOptions ropts;
    ropts.export_to_all_peers = true;
    // The last region is read-only, so tests can check permission errors.
    ropts.access =
        r == args.regions - 1 && args.regions > 1 ? kvwire::kRemoteRead : kvwire::kRemoteReadWrite;
    auto id = (*engine)->RegisterMemory(base, args.region_bytes, ropts);
    if (!id.ok()) {
      std::fprintf(stderr, "test_peer: %s\n", id.status().ToString().c_str());
      return 1;
    }
    bases.push_back(base);
    ids.push_back(*id);
    index_of[*id] = r;
  }
  std::printf("READY address=%s name=%s regions=%s pid=%d\n", (*engine)->address().c_str(),
              (*engine)->name().c_str(), absl::StrJoin(ids, ",").c_str(), getpid());
  std::fflush(stdout);

  while (!StdinClosed()) {
    auto note = (*engine)->WaitNotification(absl::Milliseconds(50));
    if (!note.ok()) continue;
    std::vector<std::string> parts = absl::StrSplit(note->payload, ':');
    std::string verdict = "bad";
    uint64_t region = 0, offset = 0, length = 0, fnv = 0;
    if (parts.size() == 5 && parts[0] == "check" && absl::SimpleAtoi(parts[1], &region) &&
        absl::SimpleAtoi(parts[2], &offset) && absl::SimpleAtoi(parts[3], &length) &&
        absl::SimpleAtoi(parts[4], &fnv) && index_of.count(region) &&
        offset + length <= args.region_bytes) {
      const std::byte* base = bases[index_of[region]];
      verdict = kvwire::testing::Fnv1a(base + offset, length) == fnv ? "ok" : "bad";
    }
    std::printf("NOTIFY %llu %s\n", static_cast<unsigned long long>(note->transfer_id),
                verdict.c_str());
    std::fflush(stdout);
  }
  if (args.linger_s > 0) absl::SleepFor(absl::Seconds(args.linger_s));
  // The engine (and the transports' serving threads it joins) ends before the memory it
  // serves, which was allocated after it.
  engine->reset();
  if (args.sanitizer_report) CommitSanitizedDefect(args.exit_code);
  return args.exit_code;
}

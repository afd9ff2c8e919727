// A hostile rdma peer for the VM tests (rdma_vm_isolation_test.cc): a real kvwire engine in its
// own process that connects to a target, then tries to READ and WRITE a region the target
// never exported to it, with an rkey it learned out of band. It dials the target through a
// ControlProxy of its own and slips a forged ExportRegions (the region's real address, length
// and rdma key) into what its engine hears from the target: exactly what a peer that rewrote
// its own copy of kvwire could do. Its QPs reach the target directly.
//
//   kvwire_rdma_hostile_peer --target=127.0.0.1:PORT --region=ID --address=ADDR --length=N
//       --rdma_key=KEY [--legit_region=ID --legit_length=N]
//
// Prints one line per step and exits 0 when every step ran (the test judges the outcomes):
//   LEGIT_BEFORE|LEGIT_AFTER code=<absl code> fnv=<fnv1a of the bytes read> [msg=...]
//   READ code=<...> fnv=<fnv1a of the local buffer after the READ> msg=...
//   WRITE code=<...> msg=...
//   DONE
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "kvwire/engine.h"
#include "proto/kvwire.pb.h"
#include "tests/integration/test_pattern.h"
#include "tests/rdma/control_proxy.h"
#include "tests/support/flags.h"

namespace kvwire::testing {
namespace {

struct Args {
  std::string target;
  uint64_t region = 0;
  uint64_t address = 0;
  uint64_t length = 0;
  std::string rdma_key;
  uint64_t legit_region = 0;
  uint64_t legit_length = 0;
};

absl::Status ParseArgs(int argc, char** argv, Args* args) {
  absl::Status parsed = FlagParser()
                            .String("target", &args->target)
                            .Int("region", &args->region)
                            .HexInt("address", &args->address)
                            .Int("length", &args->length)
                            .String("rdma_key", &args->rdma_key)
                            .Int("legit_region", &args->legit_region)
                            .Int("legit_length", &args->legit_length)
                            .Parse(argc, argv);
  if (parsed.ok() && (args->target.empty() || args->length == 0)) {
    return absl::InvalidArgumentError("--target and --length are required");
  }
  return parsed;
}

void Report(const char* step, const absl::Status& s, const std::string& extra) {
  std::string msg(s.message());
  for (char& c : msg) c = c == '\n' ? ' ' : c;
  std::printf("%s code=%d %s msg=%s\n", step, static_cast<int>(s.code()), extra.c_str(),
              msg.c_str());
  std::fflush(stdout);
}

int Run(const Args& args) {
  EngineOptions options;
  options.name = "rdma-hostile";
  options.transport = "rdma";
  options.connect_timeout = absl::Seconds(60);
  options.peer_lease = absl::Seconds(30);
  absl::StatusOr<EngineOptions> from_env = EngineOptions::FromEnvironment(options);
  if (!from_env.ok()) {
    std::fprintf(stderr, "rdma_hostile_peer: %s\n", from_env.status().ToString().c_str());
    return 2;
  }
  options = *std::move(from_env);
  auto engine = Engine::Create(options);
  if (!engine.ok()) {
    std::fprintf(stderr, "hostile_peer: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  std::vector<std::byte> local(args.length + args.legit_length);
  auto local_id = (*engine)->RegisterMemory(local.data(), local.size());
  if (!local_id.ok()) {
    std::fprintf(stderr, "hostile_peer: %s\n", local_id.status().ToString().c_str());
    return 1;
  }
  auto proxy = ControlProxy::Start(args.target, nullptr);
  if (!proxy.ok()) {
    std::fprintf(stderr, "hostile_peer: %s\n", proxy.status().ToString().c_str());
    return 1;
  }
  auto peer = (*engine)->Connect((*proxy)->address());
  if (!peer.ok()) {
    std::fprintf(stderr, "hostile_peer: connect: %s\n", peer.status().ToString().c_str());
    return 1;
  }
  TransferOptions topts;
  topts.timeout = absl::Seconds(60);
  auto run = [&](OpKind kind, const Op& op) -> absl::Status {
    auto id = (*engine)->Transfer(*peer, kind, {op}, topts);
    if (!id.ok()) return id.status();
    return (*engine)->Wait(*id, absl::Seconds(90));
  };
  // A region the target did export to us, read before and after the attack: the attack is
  // the only thing that fails, and our connection recovers from it.
  auto legit = [&](const char* step) {
    if (args.legit_region == 0) return;
    absl::Status s = (*engine)->WaitForRemoteRegion(*peer, args.legit_region, absl::Seconds(60));
    std::byte* dst = local.data() + args.length;
    std::fill(dst, dst + args.legit_length, std::byte{0});
    if (s.ok())
      s = run(OpKind::kRead, Op{*local_id, args.length, args.legit_region, 0, args.legit_length});
    Report(step, s, absl::StrCat("fnv=", Fnv1a(dst, args.legit_length)));
  };
  legit("LEGIT_BEFORE");

  pb::Envelope forged;
  pb::RegionDescriptor* d = forged.mutable_export_regions()->add_regions();
  d->set_id(args.region);
  d->set_length(args.length);
  d->set_access(kRemoteReadWrite);
  d->set_memory_kind(static_cast<uint32_t>(MemoryKind::kHost));
  d->set_address(args.address);
  (*d->mutable_transport_keys())["rdma"] = args.rdma_key;
  absl::Status s = (*proxy)->Inject(forged);
  if (s.ok()) s = (*engine)->WaitForRemoteRegion(*peer, args.region, absl::Seconds(60));
  if (!s.ok()) {
    std::fprintf(stderr, "hostile_peer: forged export not taken: %s\n", s.ToString().c_str());
    return 1;
  }
  std::fill(local.begin(), local.begin() + args.length, std::byte{0xEE});
  s = run(OpKind::kRead, Op{*local_id, 0, args.region, 0, args.length});
  Report("READ", s, absl::StrCat("fnv=", Fnv1a(local.data(), args.length)));
  std::fill(local.begin(), local.begin() + args.length, std::byte{0x5A});
  s = run(OpKind::kWrite, Op{*local_id, 0, args.region, 0, args.length});
  Report("WRITE", s, "");
  legit("LEGIT_AFTER");
  std::printf("DONE\n");
  std::fflush(stdout);
  engine->reset();  // says Goodbye through the proxy, which closes after it
  return 0;
}

}  // namespace
}  // namespace kvwire::testing

int main(int argc, char** argv) {
  kvwire::testing::Args args;
  if (absl::Status parsed = kvwire::testing::ParseArgs(argc, argv, &args); !parsed.ok()) {
    std::fprintf(stderr, "hostile_peer: bad arguments: %s\n", parsed.ToString().c_str());
    return 2;
  }
  return kvwire::testing::Run(args);
}

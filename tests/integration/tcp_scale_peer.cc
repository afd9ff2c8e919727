// The peer program of tcp_peer_scale_test: holds many engines in one process, each one a peer
// of the test's hub engine over TRANSPORT (tcp or shm; over shm each engine's buffer is a
// ShareableBuffer, so the hub maps it). Driven line by line over stdin/stdout:
//
//   argv: HUB_ADDRESS FIRST_SLOT ENGINES SLOT_BYTES HUB_REGION PEERS TRANSPORT
//   -> "READY"          every engine connected to the hub (its buffer exported to it)
//   <- "GO"             every engine WRITEs pattern(slot, 1) into hub area A and READs hub
//                       area B, all at once; the READ is checked against pattern(slot, 2)
//   -> "DONE <errors>"
//   <- "CHECK"          checks the second half of each buffer, which the hub wrote
//                       (pattern(slot, 3))
//   -> "CHECKED <errors>"
//   <- end of input     the engines are destroyed and the program exits
//
// Engine i's buffer: [0, SLOT_BYTES) pattern(slot, 0) for the hub to READ, [SLOT_BYTES,
// 2*SLOT_BYTES) for the hub to WRITE. Hub region: area A = [0, n*S), B = [n*S, 2n*S), ...
// indexed by slot.
#include <sys/resource.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"
#include "tests/integration/tcp_scale_pattern.h"

namespace kvwire {
namespace {

int Run(int argc, char** argv) {
  if (argc != 8) {
    std::cerr
        << "usage: tcp_scale_peer HUB FIRST_SLOT ENGINES SLOT_BYTES HUB_REGION PEERS TRANSPORT\n";
    return 2;
  }
  const std::string transport = argv[7];
  if (transport != "tcp" && transport != "shm") {
    std::cerr << "tcp_scale_peer: transport must be tcp or shm\n";
    return 2;
  }
  const TransportKind kind = transport == "shm" ? TransportKind::kShm : TransportKind::kTcp;
  const std::string hub = argv[1];
  uint64_t first = 0, engines = 0, slot_bytes = 0, hub_region = 0, peers = 0;
  if (!absl::SimpleAtoi(argv[2], &first) || !absl::SimpleAtoi(argv[3], &engines) ||
      !absl::SimpleAtoi(argv[4], &slot_bytes) || !absl::SimpleAtoi(argv[5], &hub_region) ||
      !absl::SimpleAtoi(argv[6], &peers)) {
    std::cerr << "tcp_scale_peer: bad arguments\n";
    return 2;
  }
  // Every engine holds a few descriptors (listeners, epoll, control and data sockets).
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
  }
  struct Peer {
    std::unique_ptr<Engine> engine;
    ShareableBuffer shared;  // over shm: the buffer (the hub maps it)
    std::vector<std::byte> plain;
    std::byte* buffer = nullptr;
    RegionId region = 0;
    PeerId hub = 0;
  };
  std::vector<Peer> all(engines);
  for (uint64_t i = 0; i < engines; ++i) {
    const uint64_t slot = first + i;
    EngineOptions options;
    options.name = absl::StrCat("c", slot);
    options.transport = transport;
    options.tcp().connections = 1;
    options.tcp().io_threads = 1;
    // The test's readiness backend (tcp_peer_scale_test runs over epoll and over io_uring).
    if (const char* backend = std::getenv("KVWIRE_TCP_IO_BACKEND");
        backend != nullptr && *backend != '\0') {
      options.tcp().io_backend = backend;
    }
    // Heartbeats are the control channel's per-peer timer; the hub measures its idle CPU.
    options.heartbeat_interval = absl::Seconds(30);
    options.peer_lease = absl::Seconds(120);
    auto engine = Engine::Create(options);
    if (!engine.ok()) {
      std::cerr << "engine " << slot << ": " << engine.status() << "\n";
      return 1;
    }
    Peer& p = all[i];
    p.engine = std::move(*engine);
    if (kind == TransportKind::kShm) {
      auto shared = ShareableBuffer::Create(2 * slot_bytes, "scale-peer");
      if (!shared.ok()) {
        std::cerr << "buffer " << slot << ": " << shared.status() << "\n";
        return 1;
      }
      p.shared = std::move(*shared);
      p.buffer = p.shared.data();
    } else {
      p.plain.resize(2 * slot_bytes);
      p.buffer = p.plain.data();
    }
    testing::FillPattern(p.buffer, slot_bytes, slot, 0);
    RegionOptions region;
    region.export_to_all_peers = true;
    auto id = p.engine->RegisterMemory(p.buffer, 2 * slot_bytes, region);
    if (!id.ok()) {
      std::cerr << "register " << slot << ": " << id.status() << "\n";
      return 1;
    }
    p.region = *id;
    auto peer = p.engine->Connect(hub);
    if (!peer.ok()) {
      std::cerr << "connect " << slot << ": " << peer.status() << "\n";
      return 1;
    }
    p.hub = *peer;
  }
  for (Peer& p : all) {
    if (absl::Status s = p.engine->WaitForRemoteRegion(p.hub, hub_region, absl::Seconds(60));
        !s.ok()) {
      std::cerr << "hub region: " << s << "\n";
      return 1;
    }
  }
  std::cout << "READY" << std::endl;

  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "GO") {
      std::vector<std::vector<std::byte>> reads(engines, std::vector<std::byte>(slot_bytes));
      std::vector<std::vector<std::byte>> writes(engines, std::vector<std::byte>(slot_bytes));
      uint64_t errors = 0;
      std::vector<std::pair<uint64_t, TransferId>> ids;  // engine index, transfer
      for (uint64_t i = 0; i < engines; ++i) {
        const uint64_t slot = first + i;
        Peer& p = all[i];
        testing::FillPattern(writes[i].data(), slot_bytes, slot, 1);
        auto w = p.engine->RegisterMemory(writes[i].data(), slot_bytes);
        auto r = p.engine->RegisterMemory(reads[i].data(), slot_bytes);
        if (!w.ok() || !r.ok()) {
          ++errors;
          continue;
        }
        auto wid = p.engine->Transfer(p.hub, OpKind::kWrite,
                                      {Op{*w, 0, hub_region, slot * slot_bytes, slot_bytes}});
        auto rid = p.engine->Transfer(
            p.hub, OpKind::kRead, {Op{*r, 0, hub_region, (peers + slot) * slot_bytes, slot_bytes}});
        if (!wid.ok() || !rid.ok()) {
          std::cerr << "transfer " << slot << ": " << wid.status() << " " << rid.status() << "\n";
          ++errors;
          continue;
        }
        ids.push_back({i, *wid});
        ids.push_back({i, *rid});
      }
      for (const auto& [i, id] : ids) {
        if (absl::Status s = all[i].engine->Wait(id, absl::Seconds(120)); !s.ok()) {
          std::cerr << "transfer " << (first + i) << ": " << s << "\n";
          ++errors;
        }
      }
      for (uint64_t i = 0; i < engines; ++i) {
        if (!testing::CheckPattern(reads[i].data(), slot_bytes, first + i, 2)) ++errors;
      }
      std::cout << "DONE " << errors << std::endl;
    } else if (line == "CHECK") {
      uint64_t errors = 0;
      for (uint64_t i = 0; i < engines; ++i) {
        if (!testing::CheckPattern(all[i].buffer + slot_bytes, slot_bytes, first + i, 3)) {
          ++errors;
        }
      }
      std::cout << "CHECKED " << errors << std::endl;
    }
  }
  all.clear();
  return 0;
}

}  // namespace
}  // namespace kvwire

int main(int argc, char** argv) { return kvwire::Run(argc, argv); }

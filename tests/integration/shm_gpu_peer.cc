// The other process of shm_gpu_test: a kvwire engine (shm) whose regions are emulated GPU
// memory (guarded: the CPU cannot touch it), plus one host region. It prints one READY line
// (as kvwire_test_peer does, so PeerProcess starts it), then takes commands sent to its inbox
// "gpu-peer" (Engine::SendMessage) and prints one reply line for each on stdout, until stdin
// closes:
//
//   FNV <index> <offset> <length>   -> "FNV <hash>" of the region's bytes now (device memory
//                                      read through the emulated runtime, never the CPU)
//   DEREG <index>                   -> "OK" once DeregisterMemory returned, or "ERR <why>"
//   REREG <index>                   -> "REGION <id>": registered (and exported) again
//
// Regions: 0 and 1 are two sub-ranges of ONE device allocation (one IPC handle); 2 is a
// memfd-backed host buffer (mapped by the tester), 3 plain heap memory (cross-memory attach).
// Each starts filled with PatternByte(seed, index, offset).
//
//   shm_gpu_peer --copy_delay_us=0 --seed=7 --name=gpu-peer
#include <cstdio>
#include <cstring>
#include <poll.h>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"
#include "src/gpu/runtime.h"
#include "tests/integration/shm_gpu_layout.h"
#include "tests/integration/test_pattern.h"
#include "tests/support/emulated_gpu.h"
#include "tests/support/flags.h"

namespace kvwire::testing {
namespace {

bool StdinClosed() {
  pollfd p{STDIN_FILENO, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  char c;
  return read(STDIN_FILENO, &c, 1) <= 0;
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "shm_gpu_peer: %s\n", what.c_str());
  return 1;
}

int Run(int argc, char** argv) {
  int64_t copy_delay_us = 0;
  uint64_t seed = 1;
  std::string name = "gpu-peer";
  absl::Status parsed = FlagParser()
                            .Int("copy_delay_us", &copy_delay_us)
                            .Int("seed", &seed)
                            .String("name", &name)
                            .Parse(argc, argv);
  if (!parsed.ok()) return Fail(std::string(parsed.message()));
  EmulatedGpu emulated({.devices = 1, .copy_delay = absl::Microseconds(copy_delay_us)});
  gpu::SetDefaultRuntime(&emulated.runtime());
  EngineOptions options;
  options.name = name;
  // Offers tcp too: a tester that cannot use the GPU regions over shm falls back to it.
  options.transport = "auto";
  options.shm().cma = true;  // its heap region is reached by cross-memory attach (opted in)
  options.peer_lease = absl::Seconds(5);
  options.heartbeat_interval = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(options);
  if (!engine.ok()) return Fail(engine.status().ToString());

  absl::StatusOr<gpu::DeviceBuffer> device =
      gpu::DeviceBuffer::Allocate(emulated.runtime(), 0, kPeerAllocationBytes);
  if (!device.ok()) return Fail(device.status().ToString());
  absl::StatusOr<ShareableBuffer> host = ShareableBuffer::Create(kPeerRegionBytes, "gpu-peer");
  if (!host.ok()) return Fail(host.status().ToString());
  std::vector<std::byte> heap(kPeerRegionBytes);
  std::byte* const bases[kPeerRegions] = {
      static_cast<std::byte*>(device->data()) + kPeerRegionOffset[0],
      static_cast<std::byte*>(device->data()) + kPeerRegionOffset[1], host->data(), heap.data()};
  std::vector<std::byte> fill(kPeerRegionBytes);
  for (int r = 0; r < kPeerRegions; ++r) {
    FillPattern(fill.data(), fill.size(), seed, r);
    if (r < 2) {
      if (absl::Status s = emulated.WriteDevice(bases[r], fill.data(), fill.size()); !s.ok()) {
        return Fail(s.ToString());
      }
    } else {
      std::memcpy(bases[r], fill.data(), fill.size());
    }
  }
  auto register_region = [&](int r) {
    RegionOptions ropts;
    ropts.kind = r < 2 ? MemoryKind::kGpu : MemoryKind::kHost;
    ropts.export_to_all_peers = true;
    return (*engine)->RegisterMemory(bases[r], kPeerRegionBytes, ropts);
  };
  RegionId ids[kPeerRegions];
  for (int r = 0; r < kPeerRegions; ++r) {
    absl::StatusOr<RegionId> id = register_region(r);
    if (!id.ok()) return Fail(id.status().ToString());
    ids[r] = *id;
  }
  absl::StatusOr<std::unique_ptr<Inbox>> inbox =
      (*engine)->OpenInbox("gpu-peer", InboxOptions{.peer_events = false});
  if (!inbox.ok()) return Fail(inbox.status().ToString());
  std::printf("READY address=%s name=%s regions=%s pid=%d\n", (*engine)->address().c_str(),
              (*engine)->name().c_str(), absl::StrJoin(ids, ",").c_str(), getpid());
  std::fflush(stdout);

  while (!StdinClosed()) {
    for (const InboxEvent& event : (*inbox)->Wait(absl::Milliseconds(50))) {
      const std::string& line = event.payload;
      std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
      int r = -1;
      std::string reply;
      if (words.size() < 2 || !absl::SimpleAtoi(words[1], &r) || r < 0 || r >= kPeerRegions) {
        reply = absl::StrCat("ERR bad command: ", line);
      } else if (words[0] == "FNV" && words.size() == 4) {
        uint64_t offset = 0, length = 0;
        if (!absl::SimpleAtoi(words[2], &offset) || !absl::SimpleAtoi(words[3], &length) ||
            offset > kPeerRegionBytes || length > kPeerRegionBytes - offset) {
          reply = "ERR bad range";
        } else {
          std::vector<std::byte> bytes(length);
          absl::Status read = absl::OkStatus();
          if (r < 2) {
            read = emulated.ReadDevice(bytes.data(), bases[r] + offset, length);
          } else {
            std::memcpy(bytes.data(), bases[r] + offset, length);
          }
          reply = read.ok() ? absl::StrCat("FNV ", Fnv1a(bytes.data(), length))
                            : absl::StrCat("ERR ", read.ToString());
        }
      } else if (words[0] == "DEREG") {
        absl::Status s = (*engine)->DeregisterMemory(ids[r]);
        reply = s.ok() ? "OK" : absl::StrCat("ERR ", s.ToString());
      } else if (words[0] == "REREG") {
        absl::StatusOr<RegionId> id = register_region(r);
        if (id.ok()) ids[r] = *id;
        reply =
            id.ok() ? absl::StrCat("REGION ", *id) : absl::StrCat("ERR ", id.status().ToString());
      } else {
        reply = absl::StrCat("ERR bad command: ", line);
      }
      std::printf("%s\n", reply.c_str());
      std::fflush(stdout);
    }
  }
  inbox->reset();
  engine->reset();
  return 0;
}

}  // namespace
}  // namespace kvwire::testing

int main(int argc, char** argv) { return kvwire::testing::Run(argc, argv); }

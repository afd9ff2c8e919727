// What both sides of a kvwire-perf test share: the engine built from the options, the
// registered buffer, and the side-channel messages they exchange.
//
//   initiator -> target   HELLO kvwire-perf/1 <agreed settings>
//   target -> initiator   OK port=<engine port> region=<id> bytes=<n>  |  ERROR <why>
//   initiator -> target   RUN <size> <ops per thread, 0 = until told>      (per size)
//   target -> initiator   READY                       (destinations cleared when checking)
//   initiator -> target   DONE <size> <ops done by thread 0>,<thread 1>,...
//   target -> initiator   CHECK ok | CHECK - | CHECK <error>    (target verifies WRITEs)
//   initiator -> target   BYE
#ifndef KVWIRE_PERF_SESSION_H_
#define KVWIRE_PERF_SESSION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"
#include "perf/perf_options.h"
#include "src/gpu/runtime.h"

namespace kvwire::perf {

inline constexpr char kProtocol[] = "kvwire-perf/1";

// Engine for this side: transport, connections per peer, rdma device and GID passed through.
absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(const PerfOptions& options,
                                                   const std::string& listen_address);

// This side's buffer, registered with the engine (exported to every peer on the target).
// Host memory (`memory`), or GPU memory (`device`, with --use_cuda/--use_rocm/--memory gpu:
// never touched on the host, so --check is refused with it).
struct LocalBuffer {
  ShareableBuffer memory;
  gpu::DeviceBuffer device;
  RegionId region = 0;
  uint64_t size() const { return device.data() != nullptr ? device.size() : memory.size(); }
};
// Allocates `bytes`, touches every page (so no run pays page faults), fills it with the
// check pattern when `source`, and registers it.
absl::StatusOr<LocalBuffer> MakeBuffer(Engine& engine, uint64_t bytes, bool source,
                                       bool export_all);

// The same in the memory of GPU `device` (the build's runtime), registered as such.
absl::StatusOr<LocalBuffer> MakeGpuBuffer(Engine& engine, uint64_t bytes, int device,
                                          bool export_all);

std::string EncodeOps(const std::vector<uint64_t>& ops);
absl::StatusOr<std::vector<uint64_t>> DecodeOps(const std::string& text, int threads);

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_SESSION_H_

#include "perf/session.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "perf/buffer_plan.h"
#include "src/util/secret_file.h"

namespace kvwire::perf {

absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(const PerfOptions& o,
                                                   const std::string& listen_address) {
  absl::StatusOr<EngineOptions> from_env = EngineOptions::FromEnvironment({});
  if (!from_env.ok()) return from_env.status();
  EngineOptions e = *std::move(from_env);
  if (o.transport == TransportKind::kRdma) {
    // By the rdma transport's own setter: the flags get the library's parsing (a
    // comma-separated device list), and Engine::Create its ranges (-1..1023, 1..64).
    if (!o.device.empty()) {
      if (absl::Status s = e.transports.Set("rdma", "devices", o.device); !s.ok()) return s;
    }
    if (o.gid_index >= 0) e.rdma().gid_index = o.gid_index;
    if (o.connections > 0) e.rdma().qps_per_peer = o.connections;
  }
  if (!o.secret_file.empty()) {
    absl::StatusOr<std::string> secret = ReadSecretFile(o.secret_file);
    if (!secret.ok()) return secret.status();
    e.shared_secret = *std::move(secret);
  } else if (!o.secret.empty()) {
    e.shared_secret = o.secret;
  }
  e.name = "";
  e.listen_address = listen_address;
  e.transport = TransportKindName(o.transport);
  if (o.connections > 0) e.tcp().connections = o.connections;
  e.transfer_timeout = absl::Seconds(120);
  e.verify_checksums = o.verify_checksums;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(e);
  if (!engine.ok() && o.transport == TransportKind::kRdma) {
    return absl::Status(engine.status().code(),
                        absl::StrCat("transport rdma: ", engine.status().message()));
  }
  return engine;
}

absl::StatusOr<LocalBuffer> MakeBuffer(Engine& engine, uint64_t bytes, bool source,
                                       bool export_all) {
  LocalBuffer b;
  absl::StatusOr<ShareableBuffer> memory = ShareableBuffer::Create(bytes, "kvwire-perf");
  if (!memory.ok()) return memory.status();
  b.memory = *std::move(memory);
  if (source) {
    FillPattern(b.memory.data(), 0, b.memory.size());
  } else {
    std::memset(b.memory.data(), 0x5a, b.memory.size());
  }
  RegionOptions options;
  options.export_to_all_peers = export_all;
  absl::StatusOr<RegionId> region =
      engine.RegisterMemory(b.memory.data(), b.memory.size(), options);
  if (!region.ok()) return region.status();
  b.region = *region;
  return b;
}

absl::StatusOr<LocalBuffer> MakeGpuBuffer(Engine& engine, uint64_t bytes, int device,
                                          bool export_all) {
  LocalBuffer b;
  absl::StatusOr<gpu::DeviceBuffer> memory =
      gpu::DeviceBuffer::Allocate(gpu::DefaultRuntime(), device, bytes);
  if (!memory.ok()) return memory.status();
  b.device = *std::move(memory);
  RegionOptions options;
  options.kind = MemoryKind::kGpu;
  options.gpu_device = device;
  options.export_to_all_peers = export_all;
  absl::StatusOr<RegionId> region =
      engine.RegisterMemory(b.device.data(), b.device.size(), options);
  if (!region.ok()) return region.status();
  b.region = *region;
  return b;
}

std::string EncodeOps(const std::vector<uint64_t>& ops) { return absl::StrJoin(ops, ","); }

absl::StatusOr<std::vector<uint64_t>> DecodeOps(const std::string& text, int threads) {
  std::vector<uint64_t> ops;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    uint64_t n = 0;
    if (!absl::SimpleAtoi(part, &n)) {
      return absl::InvalidArgumentError(absl::StrCat("bad op count list \"", text, "\""));
    }
    ops.push_back(n);
  }
  if (static_cast<int>(ops.size()) != threads) {
    return absl::InvalidArgumentError(
        absl::StrCat("op counts for ", ops.size(), " threads, expected ", threads));
  }
  return ops;
}

}  // namespace kvwire::perf

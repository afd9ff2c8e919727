// The KV connector's public facade (Connector forwards to Connector::Impl), start-up, KV cache
// registration, and the mapping of byte ranges to registered regions. See connector_impl.h
// for the files that implement the rest.
#include "kvwire/connector.h"

#include <time.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "kvwire/options_check.h"
#include "src/connector/connector_impl.h"
#include "src/connector/metrics_http.h"
#include "src/util/clock.h"
#include "src/util/log.h"

namespace kvwire {
namespace connector_internal {

absl::StatusOr<std::pair<RegionId, uint64_t>> FindRegion(const std::vector<RegionSpan>& regions,
                                                         uint64_t addr, uint64_t length,
                                                         const char* side) {
  for (const RegionSpan& r : regions) {
    if (addr >= r.base && addr + length <= r.base + r.length) return {{r.id, addr - r.base}};
  }
  return absl::OutOfRangeError(
      absl::StrFormat("%s range [0x%x, +%u) is in no registered region", side, addr, length));
}

nlohmann::json BlocksToJson(const BlockTable& t) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [g, ids] : t) j[g] = ids;
  return j;
}

BlockTable BlocksFromJson(JsonFields& f, absl::string_view field, bool required) {
  constexpr size_t kMaxGroups = 256, kMaxIds = 1 << 20, kMaxName = 256;
  constexpr int64_t kMaxBlockId = int64_t{1} << 40;
  BlockTable t;
  const nlohmann::json* j = f.Object(field, required);
  if (j == nullptr) return t;
  if (j->size() > kMaxGroups) {
    f.Fail(field, absl::StrCat("has ", j->size(), " groups, over the limit of ", kMaxGroups));
    return t;
  }
  JsonFields groups = f.Nested(field, required);
  for (const auto& [g, ids] : j->items()) {
    if (g.size() > kMaxName) {
      groups.Fail("<group>", absl::StrCat("is a name of ", g.size(), " bytes"));
      break;
    }
    t[g] = groups.IntArray(g, /*required=*/true, -1, kMaxBlockId, kMaxIds);
    if (!f.ok()) break;
  }
  if (!f.ok()) t.clear();
  return t;
}

double ThreadCpuUs() { return static_cast<double>(ClockNanos(CLOCK_THREAD_CPUTIME_ID)) / 1e3; }

double Us(absl::Time a, absl::Time b) {
  if (a == absl::InfinitePast() || b == absl::InfinitePast()) return -1;
  return absl::ToDoubleMicroseconds(b - a);
}

}  // namespace connector_internal

// --- Connector::Impl: start-up and registration ---------------------------------------------

absl::Status Connector::Impl::Init() {
  gpu_runtime_ = &gpu::DefaultRuntime();  // what Engine::Create takes too
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(options_.engine);
  if (!engine.ok()) return engine.status();
  engine_ = std::move(*engine);
  InboxOptions inbox_options;
  inbox_options.on_event = [signal = signal_] { signal->Notify(); };
  // A pending hello is answered when the regions it names arrive: the engine's event wakes
  // the progress loop (ServePendingHellos), nothing polls for them.
  inbox_options.region_events = true;
  absl::StatusOr<std::unique_ptr<Inbox>> inbox =
      engine_->OpenInbox(connector_internal::kTopic, inbox_options);
  if (!inbox.ok()) return inbox.status();
  inbox_ = std::move(*inbox);
  if (absl::Status s = InitDiscovery(); !s.ok()) return s;
  progress_ = std::thread([this] { ProgressLoop(); });
  if (!options_.metrics_address.empty()) {
    absl::StatusOr<std::unique_ptr<connector_internal::MetricsServer>> server =
        connector_internal::MetricsServer::Start(options_.metrics_address, [this](bool json) {
          return json ? StatsJson() : StatsPrometheus();
        });
    if (!server.ok()) return server.status();
    metrics_ = std::move(*server);
  }
  return absl::OkStatus();
}

// --- registration -----------------------------------------------------------------------
absl::Status Connector::Impl::RegisterKvCaches(const Layout& layout,
                                               const std::vector<KvMemory>& memory) {
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  for (const CacheGroup& g : layout.groups) {
    // With read grants, the rows a request did not fill are cleared before its pages go out
    // whole (ScrubUnfilledLocked: a read grant, or write mode's push); where they are is
    // unknown for this group, so a hand-off of a partly filled block of it fails.
    if (absl::StatusOr<std::vector<uint64_t>> sections = PageSections(g);
        options_.read_grants && !sections.ok()) {
      KVW_LOG(kWarning, kLog) << "hand-offs of partly filled blocks will fail (read grants and "
                                 "write-mode pushes)"
                              << Kv("error", sections.status().message());
    }
  }
  std::vector<RegionSpan> spans;
  for (const KvMemory& m : memory) {
    RegionOptions ro;
    ro.export_to_all_peers = true;
    // Peers read the KV only where a read-mode hand-off granted it to them (OnReadStart): a
    // peer never reads another request's blocks, nor freed ones. Without read_grants the
    // hand-off still grants (the protocol is the same) but the engine does not enforce it.
    ro.reads_need_grant = options_.read_grants;
    ro.kind = m.kind;
    ro.gpu_device = m.gpu_device;
    absl::StatusOr<RegionId> id = engine_->RegisterMemory(m.ptr, m.length, ro);
    if (!id.ok()) return id.status();
    spans.push_back({reinterpret_cast<uint64_t>(m.ptr), m.length, *id});
  }
  for (const CacheGroup& g : layout.groups) {
    if (g.layer_base.size() != g.layers.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cache group '", g.name, "' has no backing memory"));
    }
    const uint64_t span = (g.num_blocks - 1) * g.block_stride +
                          (g.components - 1) * g.component_stride + g.page_bytes;
    for (size_t l = 0; l < g.layers.size(); ++l) {
      absl::StatusOr<std::pair<RegionId, uint64_t>> r =
          connector_internal::FindRegion(spans, g.layer_base[l], span, "local");
      if (!r.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("cache group '", g.name, "' layer ",
                                                       g.layers[l], ": ", r.status().message()));
      }
    }
  }
  MutexLock lock(&mu_);
  layout_ = layout;
  local_regions_ = std::move(spans);
  local_memory_ = memory;
  registered_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Op>> Connector::Impl::ToOps(const std::vector<ByteRange>& ranges,
                                                       const Peer& p, bool local_is_src) {
  std::vector<Op> ops;
  ops.reserve(ranges.size());
  // Consecutive ranges are mostly in the region of the one before (a layer's pages): that one
  // is tried first, so a request costs a scan of the regions per region change, not per page.
  connector_internal::RegionFinder local_regions(local_regions_);
  connector_internal::RegionFinder remote_regions(p.regions);
  for (const ByteRange& br : ranges) {
    const uint64_t local = local_is_src ? br.src : br.dst;
    const uint64_t remote = local_is_src ? br.dst : br.src;
    const RegionSpan* l = local_regions.Find(local, br.length);
    if (l == nullptr) {
      return connector_internal::FindRegion(local_regions_, local, br.length, "local").status();
    }
    const RegionSpan* rr = remote_regions.Find(remote, br.length);
    if (rr == nullptr) {
      return connector_internal::FindRegion(p.regions, remote, br.length, "remote").status();
    }
    ops.push_back({l->id, local - l->base, rr->id, remote - rr->base, br.length});
  }
  return ops;
}

// --- Connector ----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Connector>> Connector::Create(ConnectorOptions options) {
  if (absl::Status s = ValidateConnectorOptions(options); !s.ok()) return s;
  auto impl = std::make_unique<Impl>(std::move(options));
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<Connector>(new Connector(std::move(impl)));
}
Connector::Connector(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Connector::~Connector() = default;
Engine& Connector::engine() { return impl_->engine(); }
const std::string& Connector::engine_id() const { return impl_->engine_id(); }
std::string Connector::metrics_address() const { return impl_->metrics_address(); }
absl::Status Connector::RegisterKvCaches(const Layout& layout,
                                         const std::vector<KvMemory>& memory) {
  return impl_->RegisterKvCaches(layout, memory);
}
// The calls that create, advance or end requests (and so may set an earlier deadline) wake
// the progress thread once they return, so that it recomputes when to look next.
absl::StatusOr<MatchResult> Connector::GetNumNewMatchedTokens(const std::string& request_id,
                                                              uint64_t num_tokens,
                                                              uint64_t num_computed_tokens,
                                                              const std::string& params) {
  auto result = impl_->GetNumNewMatchedTokens(request_id, num_tokens, num_computed_tokens, params);
  impl_->WakeProgress();
  return result;
}
absl::Status Connector::UpdateStateAfterAlloc(const std::string& request_id,
                                              const BlockTable& blocks,
                                              uint64_t num_external_tokens) {
  absl::Status result = impl_->UpdateStateAfterAlloc(request_id, blocks, num_external_tokens);
  impl_->WakeProgress();
  return result;
}
std::string Connector::BuildConnectorMeta() { return impl_->BuildConnectorMeta(); }
absl::StatusOr<RequestFinishedResult> Connector::RequestFinished(
    const std::string& request_id, const BlockTable& blocks, uint64_t num_tokens,
    const std::string& params, bool aborted, const std::string& transfer_id) {
  auto result =
      impl_->RequestFinished(request_id, blocks, num_tokens, params, aborted, transfer_id);
  impl_->WakeProgress();
  return result;
}
absl::Status Connector::BindConnectorMeta(const std::string& meta) {
  absl::Status result = impl_->BindConnectorMeta(meta);
  impl_->WakeProgress();
  return result;
}
absl::Status Connector::StartLoadKv() {
  absl::Status result = impl_->StartLoadKv();
  impl_->WakeProgress();
  return result;
}
absl::Status Connector::WaitForLayerLoad(int layer) { return impl_->WaitForLayerLoad(layer); }
absl::Status Connector::SaveKvLayer(int layer) {
  absl::Status result = impl_->SaveKvLayer(layer);
  impl_->WakeProgress();
  return result;
}
absl::Status Connector::SaveKvLayer(int layer, GpuEvent ready) {
  absl::Status result = impl_->SaveKvLayer(layer, ready);
  impl_->WakeProgress();
  return result;
}
absl::Status Connector::WaitForSave() { return impl_->WaitForSave(); }
FinishedRequests Connector::GetFinished() { return impl_->GetFinished(); }
absl::Status Connector::Abort(const std::string& request_id) {
  absl::Status result = impl_->Abort(request_id);
  impl_->WakeProgress();
  return result;
}

absl::Status Connector::ReleaseUnread(const std::string& request_id,
                                      const std::string& kv_transfer_params,
                                      const std::string& reason) {
  return impl_->ReleaseUnread(request_id, kv_transfer_params, reason);
}
size_t Connector::LiveRequests() const { return impl_->LiveRequests(); }
std::string Connector::StatsJson() const { return impl_->StatsJson(); }
std::string Connector::StatsPrometheus() const { return impl_->StatsPrometheus(); }

}  // namespace kvwire

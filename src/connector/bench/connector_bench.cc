// Connector benchmark (not a test): one DeepSeek-V4-Pro request of N prompt tokens with
// fragmented block allocation, moved prefill -> decode through two kvwire::Connectors in one
// process, over shm and tcp, in read and write mode. Reports bytes, op counts before and after
// merging, transfer time (median of runs, decimal GB/s), the connector's CPU time per request
// on the calling threads, and the shm floor: the same merged ranges copied with memcpy from a
// cold pool.
//
//   kvwire_connector_bench [--tokens=8192] [--runs=5] [--layout=deepseek-v4-pro]
//                          [--transports=shm,tcp] [--modes=read,write] [--max_run=8]
// --max_run: free blocks come in runs of 1..max_run consecutive ids (1: fully scattered).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <time.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "kvwire/connector.h"
#include "tests/connector/kv_sim.h"

namespace {

using kvwire::testing::KvCache;

double ThreadCpuUs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void Die(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "bench: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

// Evicts caches by touching a buffer larger than the last-level cache.
void Evict() {
  static std::vector<char> junk(256 << 20);
  for (size_t i = 0; i < junk.size(); i += 64) junk[i]++;
}

struct Result {
  double seconds = 0, cpu_us = 0, connector_us = 0;
};

// The connector's own CPU for the newest request in a StatsJson snapshot (planning, op
// building, bookkeeping; the engine's transport work excluded).
double ConnectorCpuUs(const std::string& stats) {
  nlohmann::json j = nlohmann::json::parse(stats, nullptr, false);
  if (j.is_discarded() || j["requests"].empty()) return 0;
  return j["requests"].back().value("connector_cpu_us", 0.0);
}

class Pair {
 public:
  Pair(const std::string& layout, const std::string& transport, uint64_t tokens, uint64_t max_run) {
    for (int side = 0; side < 2; ++side) {
      kvwire::ConnectorOptions o;
      o.engine.name = side == 0 ? "bench-prefill" : "bench-decode";
      o.engine.transport = transport;
      auto c = kvwire::Connector::Create(o);
      Die(c.status(), "connector");
      const uint64_t blocks = 2 * (tokens / 64) + 8;
      auto kv = KvCache::Create(layout, blocks, 2, 11 + side);
      Die(kv.status(), "kv cache");
      (*kv)->FragmentInRuns(max_run);
      Die((*c)->RegisterKvCaches((*kv)->layout(), (*kv)->memory()), "register");
      connectors[side] = std::move(*c);
      caches[side] = std::move(*kv);
    }
  }

  // One request; returns wall time of the transfer and connector CPU on the caller thread.
  Result Run(const std::string& id, uint64_t tokens, bool write) {
    kvwire::Connector& p = *connectors[0];
    kvwire::Connector& d = *connectors[1];
    auto pb = caches[0]->Allocate(id, tokens);
    auto db = caches[1]->Allocate(id, tokens);
    Die(pb.status(), "alloc");
    Die(db.status(), "alloc");
    Result r;
    double cpu = 0;
    kvwire::KvTransferParams in;
    in.do_remote_decode = true;
    in.mode = write ? kvwire::KvMode::kWrite : kvwire::KvMode::kRead;
    in.transfer_id = "t-" + id;
    std::string dparams;
    absl::Time start;
    if (!write) {
      double c0 = ThreadCpuUs();
      auto fin = p.RequestFinished(id, *pb, tokens, in.ToJson());
      cpu += ThreadCpuUs() - c0;
      Die(fin.status(), "request_finished");
      dparams = fin->kv_transfer_params;
    } else {
      kvwire::KvTransferParams w;
      const std::string addr = p.engine().address();
      w.host = addr.substr(0, addr.rfind(':'));
      w.port = std::stoi(addr.substr(addr.rfind(':') + 1));
      w.transfer_id = in.transfer_id;
      w.mode = kvwire::KvMode::kWrite;
      w.num_tokens = tokens;
      w.do_remote_prefill = true;
      dparams = w.ToJson();
    }
    Evict();
    start = absl::Now();
    double c0 = ThreadCpuUs();
    auto m = d.GetNumNewMatchedTokens(id, tokens, 0, dparams);
    Die(m.status(), "match");
    Die(d.UpdateStateAfterAlloc(id, *db, m->num_external_tokens), "alloc");
    Die(d.BindConnectorMeta(d.BuildConnectorMeta()), "bind");
    Die(d.StartLoadKv(), "start");
    cpu += ThreadCpuUs() - c0;
    if (write) {
      c0 = ThreadCpuUs();
      Die(p.GetNumNewMatchedTokens(id, tokens, 0, in.ToJson()).status(), "p match");
      Die(p.UpdateStateAfterAlloc(id, *pb, 0), "p alloc");
      Die(p.BindConnectorMeta(p.BuildConnectorMeta()), "p bind");
      for (int layer : Layers()) Die(p.SaveKvLayer(layer), "save");
      Die(p.WaitForSave(), "wait save");
      cpu += ThreadCpuUs() - c0;
    }
    bool done = false;
    while (!done) {
      kvwire::FinishedRequests f = d.GetFinished();
      for (const auto& fl : f.failed_loads) {
        std::fprintf(stderr, "bench: load failed: %s\n", fl.reason.c_str());
        std::exit(1);
      }
      done = !f.finished_recving.empty();
    }
    r.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    r.connector_us = ConnectorCpuUs(d.StatsJson());
    if (write) {
      auto fin = p.RequestFinished(id, *pb, tokens, in.ToJson());
      Die(fin.status(), "p finish");
    }
    // Prefill reports the blocks free (read: after decode's release).
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (p.LiveRequests() != 0 && absl::Now() < deadline) (void)p.GetFinished();
    (void)p.GetFinished();
    if (write) r.connector_us += ConnectorCpuUs(p.StatsJson());
    caches[0]->Release(id);
    caches[1]->Release(id);
    r.cpu_us = cpu;
    return r;
  }

  std::vector<int> Layers() const {
    std::vector<int> out;
    for (const kvwire::CacheGroup& g : caches[0]->layout().groups) {
      out.insert(out.end(), g.layers.begin(), g.layers.end());
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }

  std::unique_ptr<kvwire::Connector> connectors[2];
  std::unique_ptr<KvCache> caches[2];
};

}  // namespace

int main(int argc, char** argv) {
  uint64_t tokens = 8192;
  int runs = 5;
  uint64_t max_run = 8;
  std::string layout = "deepseek-v4-pro";
  std::vector<std::string> transports = {"shm", "tcp"}, modes = {"read", "write"};
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2) continue;
    if (kv[0] == "--tokens") (void)absl::SimpleAtoi(kv[1], &tokens);
    if (kv[0] == "--runs") (void)absl::SimpleAtoi(kv[1], &runs);
    if (kv[0] == "--max_run") (void)absl::SimpleAtoi(kv[1], &max_run);
    if (kv[0] == "--layout") layout = kv[1];
    if (kv[0] == "--transports") transports = absl::StrSplit(kv[1], ',');
    if (kv[0] == "--modes") modes = absl::StrSplit(kv[1], ',');
  }

  // The plan of one fragmented request, and the cold memcpy floor of its merged ranges.
  {
    auto src = KvCache::Create(layout, 2 * (tokens / 64) + 8, 2, 1);
    auto dst = KvCache::Create(layout, 2 * (tokens / 64) + 8, 2, 2);
    Die(src.status(), "cache");
    Die(dst.status(), "cache");
    (*src)->FragmentInRuns(max_run);
    (*dst)->FragmentInRuns(max_run);
    auto sb = (*src)->Allocate("plan", tokens);
    auto db = (*dst)->Allocate("plan", tokens);
    double c0 = ThreadCpuUs();
    auto plan = kvwire::PlanTransfer((*src)->layout(), *sb, (*dst)->layout(), *db, tokens);
    const double plan_us = ThreadCpuUs() - c0;
    Die(plan.status(), "plan");
    std::printf(
        "# kvwire connector bench: %s, %lu prompt tokens, fragmented blocks (runs of 1..%lu)\n",
        layout.c_str(), static_cast<unsigned long>(tokens), static_cast<unsigned long>(max_run));
    std::printf("# bytes %lu (%.2f MB), ops before merge %lu, after merge %lu, plan CPU %.0f us\n",
                static_cast<unsigned long>(plan->bytes), plan->bytes / 1e6,
                static_cast<unsigned long>(plan->ops_before_merge),
                static_cast<unsigned long>(plan->ops_after_merge), plan_us);
    for (const kvwire::GroupPlan& g : plan->groups) {
      std::printf("#   %-30s %10lu B  %5lu -> %5lu ops\n", g.group.c_str(),
                  static_cast<unsigned long>(g.bytes),
                  static_cast<unsigned long>(g.ops_before_merge),
                  static_cast<unsigned long>(g.ranges.size()));
    }
    std::vector<double> floor;
    for (int i = 0; i < runs; ++i) {
      Evict();
      const absl::Time t0 = absl::Now();
      for (const kvwire::GroupPlan& g : plan->groups) {
        for (const kvwire::ByteRange& r : g.ranges) {
          std::memcpy(reinterpret_cast<void*>(r.dst), reinterpret_cast<const void*>(r.src),
                      r.length);
        }
      }
      floor.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    }
    const double f = Median(floor);
    std::printf("# shm floor (memcpy of the merged ranges, cold pool): %.3f ms, %.2f GB/s\n",
                f * 1e3, plan->bytes / f / 1e9);
    std::printf(
        "# caller CPU: the calling threads' CPU in connector calls (with shm the engine\n"
        "# copies inline there); connector CPU: planning and bookkeeping, transport excluded\n");
    std::printf("%-9s %-6s %10s %8s %5s %14s %16s\n", "transport", "mode", "median ms", "GB/s",
                "runs", "caller CPU us", "connector CPU us");
    for (const std::string& t : transports) {
      Pair pair(layout, t, tokens, max_run);
      for (const std::string& m : modes) {
        std::vector<double> secs, cpus, conn;
        (void)pair.Run(absl::StrCat("warm-", t, m), tokens, m == "write");
        for (int i = 0; i < runs; ++i) {
          Result r = pair.Run(absl::StrCat(t, "-", m, "-", i), tokens, m == "write");
          secs.push_back(r.seconds);
          cpus.push_back(r.cpu_us);
          conn.push_back(r.connector_us);
        }
        const double s = Median(secs);
        std::printf("%-9s %-6s %10.3f %8.2f %5d %14.0f %16.0f\n", t.c_str(), m.c_str(), s * 1e3,
                    plan->bytes / s / 1e9, runs, Median(cpus), Median(conn));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

#include "perf/report.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#include "src/util/crc32c.h"
#include "src/util/json_escape.h"

namespace kvwire::perf {
namespace {

constexpr const char* kRule =
    "---------------------------------------------------------------------------------------"
    "------------------------------";

double Bw(const PerfOptions& o, double gbs) { return o.report_gbits ? gbs * 8 : gbs; }
const char* BwUnit(const PerfOptions& o) { return o.report_gbits ? "Gb/sec" : "GB/sec"; }

std::string JsonString(const std::string& s) { return "\"" + JsonEscape(s) + "\""; }

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  if (!f) return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", strerror(errno)));
  f << text;
  f.close();
  if (!f) return absl::UnavailableError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

OpKind Opposite(OpKind op) { return op == OpKind::kWrite ? OpKind::kRead : OpKind::kWrite; }

std::string TestName(const PerfOptions& o) {
  if (o.workload == Workload::kKv) return absl::StrCat(OpName(o.op), " KV request");
  if (o.bidirectional) {
    return absl::StrCat(OpName(o.op), " + ", OpName(Opposite(o.op)), " BW (bidirectional)");
  }
  return absl::StrCat(OpName(o.op), " BW");
}

}  // namespace

void PrintRule(std::FILE* out) { std::fprintf(out, "%s\n", kRule); }

void PrintHeader(std::FILE* out, const PerfOptions& o, const RunInfo& info) {
  PrintRule(out);
  std::fprintf(out, "                    kvwire %s Test (kvwire-perf)\n", TestName(o).c_str());
  std::fprintf(out, " Role              : %s%s%s\n", info.role.c_str(),
               info.peer.empty() ? "" : ", peer ", info.peer.c_str());
  std::fprintf(out, " Transport         : %s (requested %s)%s%s\n",
               info.transport.empty() ? "-" : info.transport.c_str(),
               TransportKindName(o.transport), info.transport_reason.empty() ? "" : ": ",
               info.transport_reason.c_str());
  std::fprintf(out, " Device            : %s   GID index: %s   MTU: %s\n",
               o.device.empty() ? "- (rdma only)" : o.device.c_str(),
               o.gid_index < 0 ? "-" : absl::StrCat(o.gid_index).c_str(),
               o.transport == TransportKind::kRdma ? "from the port" : "- (rdma only)");
  std::fprintf(out, " Connections/QPs   : %s per peer (tcp connections; rdma QPs)\n",
               o.connections == 0 ? "engine default" : absl::StrCat(o.connections).c_str());
  const std::string kind =
      o.memory == MemoryKind::kGpu
          ? absl::StrCat("gpu", o.gpu_api.empty() ? "" : absl::StrCat(" (", o.gpu_api, ")"),
                         " device ", o.gpu_device)
          : "host";
  std::string memory = absl::StrCat(kind, " -> ", kind);
  if (o.workload == Workload::kRaw) {
    absl::StrAppend(&memory, ", ",
                    o.pattern == Pattern::kHot ? "one buffer per thread reused (hot)"
                                               : absl::StrCat("blocks in random order over ",
                                                              o.pool_mib, " MiB per side (pool)"));
  }
  std::fprintf(out, " Memory            : %s\n", memory.c_str());
  if (o.verify_checksums) {
    std::fprintf(out, " Checksums         : CRC32C end to end on every op (%s)\n",
                 Crc32cHardware() ? "crc32 instruction" : "table");
  }
  if (o.workload == Workload::kRaw) {
    std::fprintf(out,
                 " Mode              : %s, %d op(s) per transfer, %d transfer(s) outstanding"
                 ", %d thread(s)\n",
                 o.bidirectional ? absl::StrCat(OpName(o.op), " and ", OpName(Opposite(o.op)),
                                                " alternating (bidirectional)")
                                       .c_str()
                                 : OpName(o.op),
                 o.batch, o.outstanding, o.threads);
    std::fprintf(out, " Iterations        : %s per thread and size, warm-up %s\n",
                 o.duration_s > 0   ? absl::StrCat(o.duration_s, " s").c_str()
                 : o.iterations > 0 ? absl::StrCat(o.iterations, " ops").c_str()
                                    : "about 2 GiB (200..20000 ops)",
                 o.warmup >= 0 ? absl::StrCat(o.warmup, " ops").c_str() : "2 windows or n/20");
  } else {
    std::fprintf(out,
                 " Workload          : %s, layout %s, prompt %llu tokens, fragmentation "
                 "%.2f, %d request(s) in flight, %d thread(s)\n",
                 OpName(o.op), o.layout.c_str(), static_cast<unsigned long long>(o.prompt_tokens),
                 o.fragmentation, o.requests, o.threads);
  }
  std::fprintf(out, " Data check        : %s\n",
               o.check ? "on (every byte of every destination compared)" : "off");
  std::fprintf(out,
               " Units             : bandwidth in decimal %s (1 GB = 1e9 bytes); latency "
               "per transfer in us,\n                     submission to completion; post = "
               "time inside Transfer()\n",
               o.report_gbits ? "Gb/s" : "GB/s");
  PrintRule(out);
}

void PrintTableHeader(std::FILE* out, const PerfOptions& o) {
  if (o.workload == Workload::kKv) {
    std::fprintf(out, " %-10s %-9s %-13s %-13s %-10s %-10s %-10s %-10s %-10s %-9s %-9s %-9s %s\n",
                 "#bytes/req", "#requests", absl::StrCat("BW peak[", BwUnit(o), "]").c_str(),
                 absl::StrCat("BW avg[", BwUnit(o), "]").c_str(), "req/s", "t_avg[ms]", "t_p50[ms]",
                 "t_p99[ms]", "floor[ms]", "ops/req", "merged", "posted", "check");
    return;
  }
  std::fprintf(out, " %-10s %-11s %-16s %-18s %-15s %-10s %-10s %-10s %-12s %s\n", "#bytes",
               "#iterations", absl::StrCat("BW peak[", BwUnit(o), "]").c_str(),
               absl::StrCat("BW average[", BwUnit(o), "]").c_str(), "MsgRate[Mpps]", "t_avg[us]",
               "t_p50[us]", "t_p99[us]", "post_avg[us]", "check");
}

void PrintRow(std::FILE* out, const PerfOptions& o, const Result& r) {
  if (o.workload == Workload::kKv) {
    std::fprintf(out,
                 " %-10llu %-9llu %-13.2f %-13.2f %-10.1f %-10.3f %-10.3f %-10.3f %-10s %-9llu "
                 "%-9llu %-9llu %s\n",
                 static_cast<unsigned long long>(r.bytes),
                 static_cast<unsigned long long>(r.requests), Bw(o, r.bw_peak_gbs),
                 Bw(o, r.bw_avg_gbs), r.requests_per_s, r.lat_avg_us / 1e3, r.lat_p50_us / 1e3,
                 r.lat_p99_us / 1e3,
                 r.floor_ms > 0 ? absl::StrFormat("%.3f", r.floor_ms).c_str() : "-",
                 static_cast<unsigned long long>(r.ops_before_merge),
                 static_cast<unsigned long long>(r.ops_after_merge),
                 static_cast<unsigned long long>(r.ops_posted), r.check.c_str());
  } else {
    std::fprintf(out,
                 " %-10llu %-11llu %-16.2f %-18.2f %-15.6f %-10.2f %-10.2f %-10.2f %-12.2f %s\n",
                 static_cast<unsigned long long>(r.bytes), static_cast<unsigned long long>(r.ops),
                 Bw(o, r.bw_peak_gbs), Bw(o, r.bw_avg_gbs), r.msg_rate_mops, r.lat_avg_us,
                 r.lat_p50_us, r.lat_p99_us, r.post_avg_us, r.check.c_str());
  }
  std::fflush(out);
}

absl::Status WriteJson(const std::string& path, const PerfOptions& o, const RunInfo& info,
                       const std::vector<Result>& results) {
  std::vector<std::string> settings;
  for (const auto& [k, v] : AgreedSettings(o)) {
    settings.push_back(absl::StrCat(JsonString(k), ": ", JsonString(v)));
  }
  std::vector<std::string> rows;
  for (const Result& r : results) {
    rows.push_back(absl::StrFormat(
        "    {\"bytes\": %d, \"ops\": %d, \"transfers\": %d, \"seconds\": %.6f, "
        "\"bw_peak_gbs\": %.4f, \"bw_avg_gbs\": %.4f, \"msg_rate_mops\": %.6f, "
        "\"lat_avg_us\": %.3f, \"lat_p50_us\": %.3f, \"lat_p99_us\": %.3f, "
        "\"post_avg_us\": %.3f, \"requests\": %d, \"requests_per_s\": %.3f, "
        "\"ops_before_merge\": %d, \"ops_after_merge\": %d, \"ops_posted\": %d, "
        "\"floor_ms\": %.4f, \"check\": %s}",
        r.bytes, r.ops, r.transfers, r.seconds, r.bw_peak_gbs, r.bw_avg_gbs, r.msg_rate_mops,
        r.lat_avg_us, r.lat_p50_us, r.lat_p99_us, r.post_avg_us, r.requests, r.requests_per_s,
        r.ops_before_merge, r.ops_after_merge, r.ops_posted, r.floor_ms, JsonString(r.check)));
  }
  std::string text = absl::StrCat(
      "{\n  \"tool\": \"kvwire-perf\",\n  \"units\": \"decimal GB/s (1e9 B/s), microseconds\",\n",
      "  \"role\": ", JsonString(info.role), ",\n  \"transport\": ", JsonString(info.transport),
      ",\n  \"transport_reason\": ", JsonString(info.transport_reason), ",\n  \"settings\": {",
      absl::StrJoin(settings, ", "), "},\n  \"results\": [\n", absl::StrJoin(rows, ",\n"),
      "\n  ]\n}\n");
  return WriteFile(path, text);
}

absl::Status WriteCsv(const std::string& path, const PerfOptions& o, const RunInfo& info,
                      const std::vector<Result>& results) {
  std::string text =
      "workload,op,transport,pattern,threads,batch,outstanding,bytes,ops,transfers,seconds,"
      "bw_peak_gbs,bw_avg_gbs,msg_rate_mops,lat_avg_us,lat_p50_us,lat_p99_us,post_avg_us,"
      "requests,requests_per_s,ops_before_merge,ops_after_merge,ops_posted,floor_ms,check\n";
  for (const Result& r : results) {
    absl::StrAppendFormat(
        &text,
        "%s,%s,%s,%s,%d,%d,%d,%d,%d,%d,%.6f,%.4f,%.4f,%.6f,%.3f,%.3f,%.3f,%.3f,%d,%.3f,"
        "%d,%d,%d,%.4f,\"%s\"\n",
        WorkloadName(o.workload), OpName(o.op), info.transport, PatternName(o.pattern), o.threads,
        o.batch, o.outstanding, r.bytes, r.ops, r.transfers, r.seconds, r.bw_peak_gbs, r.bw_avg_gbs,
        r.msg_rate_mops, r.lat_avg_us, r.lat_p50_us, r.lat_p99_us, r.post_avg_us, r.requests,
        r.requests_per_s, r.ops_before_merge, r.ops_after_merge, r.ops_posted, r.floor_ms, r.check);
  }
  return WriteFile(path, text);
}

ProgressLine::ProgressLine() : enabled_(::isatty(STDERR_FILENO) == 1) {}

void ProgressLine::Show(const std::string& text) {
  if (!enabled_) return;
  std::fprintf(stderr, "\r%-*s", static_cast<int>(width_), text.c_str());
  width_ = std::max(width_, text.size());
  std::fflush(stderr);
}

void ProgressLine::Clear() {
  if (!enabled_ || width_ == 0) return;
  std::fprintf(stderr, "\r%*s\r", static_cast<int>(width_), "");
  std::fflush(stderr);
  width_ = 0;
}

}  // namespace kvwire::perf

#include "perf/initiator.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "perf/buffer_plan.h"
#include "perf/kv_workload.h"
#include "perf/pump.h"
#include "perf/report.h"
#include "perf/session.h"
#include "perf/side_channel.h"

namespace kvwire::perf {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvwire-perf: %s\n", std::string(s.message()).c_str());
  return 1;
}

// Reads "key=value" from an OK line.
bool Field(const std::string& line, const std::string& key, uint64_t* out) {
  for (absl::string_view part : absl::StrSplit(line, ' ')) {
    if (absl::ConsumePrefix(&part, key + "=")) return absl::SimpleAtoi(part, out);
  }
  return false;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

absl::StatusOr<Result> RunSize(const PerfOptions& o, Engine& engine, PeerId peer,
                               LocalBuffer& local, RegionId remote, uint64_t size, LineSocket& sock,
                               ProgressLine* progress) {
  BufferPlan plan(o.pattern, o.threads, size, local.size());
  const uint64_t iters = o.IterationsFor(size);
  PumpSpec spec;
  spec.kind = o.op;
  spec.bidirectional = o.bidirectional;
  spec.threads = o.threads;
  spec.outstanding = o.outstanding;
  spec.warmup_transfers = CeilDiv(WarmupOps(o, plan, iters), o.batch);
  spec.transfers = o.duration_s > 0 ? 0 : CeilDiv(iters, o.batch);
  spec.duration_s = o.duration_s;
  spec.label = absl::StrCat(size, " B");
  const RegionId local_region = local.region;
  spec.make_ops = [&plan, o, local_region, remote, size](int thread, uint64_t index,
                                                         std::vector<Op>* ops) {
    for (uint64_t i = index * o.batch; i < (index + 1) * o.batch; ++i) {
      ops->push_back(Op{local_region, plan.LocalOffset(thread, i), remote,
                        plan.RemoteOffset(thread, i), size});
    }
  };
  const uint64_t planned =
      spec.transfers == 0 ? 0 : (spec.transfers + spec.warmup_transfers) * o.batch;
  const bool verify_here = o.check && o.op == OpKind::kRead;
  if (verify_here) {
    for (int t = 0; t < o.threads; ++t) {
      plan.ClearDestinations(local.memory.data(), false, t, planned == 0 ? UINT64_MAX : planned);
    }
  }
  if (absl::Status s = sock.SendLine(absl::StrCat("RUN ", size, " ", planned)); !s.ok()) return s;
  absl::StatusOr<std::string> ready = sock.ReadLine(absl::Seconds(120));
  if (!ready.ok()) return ready.status();
  if (*ready != "READY") {
    return absl::InternalError(absl::StrCat("target answered \"", *ready, "\" to RUN"));
  }
  absl::StatusOr<PumpResult> pumped = Pump(engine, peer, spec, progress);
  if (!pumped.ok()) return pumped.status();
  // On stderr, so the table on stdout keeps its shape: faults inside the timed run mean the
  // run paid for first touches (issue 15's pool investigation).
  std::fprintf(stderr,
               " %llu B: %ld minor, %ld major page faults (initiator process) while measured\n",
               static_cast<unsigned long long>(size), pumped->minor_faults, pumped->major_faults);
  std::vector<uint64_t> ops;
  for (uint64_t t : pumped->transfers_per_thread) ops.push_back(t * o.batch);
  if (absl::Status s = sock.SendLine(absl::StrCat("DONE ", size, " ", EncodeOps(ops))); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::string> checked = sock.ReadLine(absl::Seconds(600));
  if (!checked.ok()) return checked.status();
  if (!absl::StartsWith(*checked, "CHECK ")) {
    return absl::InternalError(absl::StrCat("target answered \"", *checked, "\" to DONE"));
  }
  Result r;
  r.bytes = size;
  r.check = checked->substr(6);
  if (r.check == "-") r.check = "off";
  if (verify_here) {
    absl::Status s = absl::OkStatus();
    for (int t = 0; t < o.threads && s.ok(); ++t) {
      s = plan.Verify(local.memory.data(), false, t, ops[t]);
    }
    r.check = s.ok() ? "ok" : std::string(s.message());
  }
  const int window = static_cast<int>(
      std::max<uint64_t>(2 * o.outstanding * o.threads, pumped->samples.size() / 50));
  Summarize(std::move(pumped->samples), pumped->seconds, window, &r);
  return r;
}

}  // namespace

int RunInitiator(const PerfOptions& o) {
  absl::StatusOr<std::unique_ptr<Engine>> engine = MakeEngine(o, "127.0.0.1:0");
  if (!engine.ok()) return Fail(engine.status());
  std::unique_ptr<KvSide> kv;
  LocalBuffer local;
  if (o.workload == Workload::kKv) {
    absl::StatusOr<std::unique_ptr<KvSide>> side = KvSide::Create(o, **engine, /*initiator=*/true);
    if (!side.ok()) return Fail(side.status());
    kv = *std::move(side);
  } else {
    absl::StatusOr<LocalBuffer> b =
        o.memory == MemoryKind::kGpu
            ? MakeGpuBuffer(**engine, RawRegionBytes(o), o.gpu_device, false)
            : MakeBuffer(**engine, RawRegionBytes(o), o.check && o.op == OpKind::kWrite, false);
    if (!b.ok()) return Fail(b.status());
    local = *std::move(b);
  }

  absl::StatusOr<LineSocket> sock = LineSocket::Dial(o.host, o.port, absl::Seconds(15));
  if (!sock.ok()) return Fail(sock.status());
  if (absl::Status s =
          sock->SendLine(absl::StrCat("HELLO ", kProtocol, " ", EncodeSettings(AgreedSettings(o))));
      !s.ok()) {
    return Fail(s);
  }
  absl::StatusOr<std::string> reply = sock->ReadLine(absl::Seconds(120));
  if (!reply.ok()) return Fail(reply.status());
  if (absl::StartsWith(*reply, "ERROR ")) {
    std::fprintf(stderr, "kvwire-perf: the target refused the test: %s\n", reply->c_str() + 6);
    return 2;
  }
  uint64_t port = 0, remote = 0;
  if (!absl::StartsWith(*reply, "OK ") || !Field(*reply, "port", &port) ||
      !Field(*reply, "region", &remote)) {
    return Fail(absl::InternalError(absl::StrCat("unexpected answer \"", *reply, "\"")));
  }
  const std::string target = absl::StrCat(o.host, ":", port);
  absl::StatusOr<PeerId> peer = (*engine)->Connect(target);
  if (!peer.ok()) return Fail(peer.status());
  if (absl::Status s = (*engine)->WaitForRemoteRegion(*peer, remote, absl::Seconds(30)); !s.ok()) {
    return Fail(s);
  }

  RunInfo info;
  info.role = "initiator";
  info.peer = absl::StrCat(o.host, ":", o.port, " (engine ", target, ")");
  for (const PeerStats& p : (*engine)->Stats().peers) {
    if (p.peer_id != *peer) continue;
    info.transport = p.transport;
    info.transport_reason = p.transport_reason;
  }
  for (const PeerInfo& p : (*engine)->Peers()) {
    if (p.id == *peer && !p.transport.empty()) info.transport = p.transport;
  }
  PrintHeader(stdout, o, info);
  PrintTableHeader(stdout, o);
  ProgressLine progress;
  std::vector<Result> results;
  int status = 0;
  if (kv) {
    absl::StatusOr<Result> r = kv->Run(**engine, *peer, remote, *sock, &progress);
    if (!r.ok()) return Fail(r.status());
    PrintRow(stdout, o, *r);
    results.push_back(*r);
  } else {
    for (uint64_t size : o.Sizes()) {
      absl::StatusOr<Result> r = RunSize(o, **engine, *peer, local, remote, size, *sock, &progress);
      if (!r.ok()) return Fail(r.status());
      PrintRow(stdout, o, *r);
      results.push_back(*r);
    }
  }
  for (const Result& r : results) {
    if (r.check != "off" && r.check != "ok") status = 1;
  }
  PrintRule(stdout);
  if (o.bidirectional) {
    // Both directions moved: this engine's counters say how much each way.
    for (const PeerStats& p : (*engine)->Stats().peers) {
      if (p.peer_id != *peer) continue;
      std::printf(" Bidirectional     : %llu bytes written, %llu bytes read\n",
                  static_cast<unsigned long long>(p.bytes_written),
                  static_cast<unsigned long long>(p.bytes_read));
    }
  }
  (void)sock->SendLine("BYE");
  if (!o.json_file.empty()) {
    if (absl::Status s = WriteJson(o.json_file, o, info, results); !s.ok()) return Fail(s);
  }
  if (!o.csv_file.empty()) {
    if (absl::Status s = WriteCsv(o.csv_file, o, info, results); !s.ok()) return Fail(s);
  }
  return status;
}

}  // namespace kvwire::perf

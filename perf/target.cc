#include "perf/target.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

#include "perf/buffer_plan.h"
#include "perf/kv_workload.h"
#include "perf/report.h"
#include "perf/session.h"
#include "perf/side_channel.h"

namespace kvwire::perf {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvwire-perf (target): %s\n", std::string(s.message()).c_str());
  return 1;
}

absl::Duration SideTimeout(const PerfOptions& o) { return absl::Seconds(o.side_timeout_s); }

// A protocol error of the initiator: refused with an ERROR line, and the target goes on.
bool IsRefusal(const absl::Status& s) { return s.code() == absl::StatusCode::kInvalidArgument; }

// Checks a RUN line of the raw workload against what this side agreed to and allocated: the
// size is one of the agreed sizes and every thread's block of it lies inside the buffer.
absl::Status CheckRun(const PerfOptions& o, uint64_t buffer_bytes,
                      const std::vector<std::string>& run, uint64_t* size, uint64_t* planned) {
  if (run.size() != 3 || !absl::SimpleAtoi(run[1], size) || !absl::SimpleAtoi(run[2], planned)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "malformed RUN line (expected \"RUN <size> <ops>\"): \"", absl::StrJoin(run, " "), "\""));
  }
  const std::vector<uint64_t> sizes = o.Sizes();
  if (std::find(sizes.begin(), sizes.end(), *size) == sizes.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RUN size ", *size, " is not one of the agreed sizes (", absl::StrJoin(sizes, ", "), ")"));
  }
  if (*size == 0 || *size > buffer_bytes / static_cast<uint64_t>(o.threads)) {
    return absl::InvalidArgumentError(absl::StrCat("RUN size ", *size, " for ", o.threads,
                                                   " threads exceeds the target buffer of ",
                                                   buffer_bytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

// Handles one RUN/DONE exchange of a raw size; the reply to DONE says whether WRITEs landed.
absl::Status ServeSize(const PerfOptions& o, LineSocket& sock, std::byte* host, uint64_t bytes,
                       const std::vector<std::string>& run) {
  uint64_t size = 0, planned = 0;
  if (absl::Status s = CheckRun(o, bytes, run, &size, &planned); !s.ok()) {
    return s;
  }
  const bool verify = o.check && o.op == OpKind::kWrite;
  BufferPlan plan(o.pattern, o.threads, size, bytes);
  if (verify) {
    for (int t = 0; t < o.threads; ++t) {
      plan.ClearDestinations(host, true, t, planned == 0 ? UINT64_MAX : planned);
    }
  }
  if (absl::Status s = sock.SendLine("READY"); !s.ok()) return s;
  absl::StatusOr<std::string> done = sock.ReadLine(SideTimeout(o));
  if (!done.ok()) return done.status();
  std::vector<std::string> parts = absl::StrSplit(*done, ' ');
  uint64_t done_size = 0;
  if (parts.size() != 3 || parts[0] != "DONE" || !absl::SimpleAtoi(parts[1], &done_size) ||
      done_size != size) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected \"DONE ", size, " <ops>\", got \"", *done, "\""));
  }
  absl::StatusOr<std::vector<uint64_t>> ops = DecodeOps(parts[2], o.threads);
  if (!ops.ok()) return ops.status();
  std::string verdict = "-";
  if (verify) {
    absl::Status checked = absl::OkStatus();
    for (int t = 0; t < o.threads && checked.ok(); ++t) {
      checked = plan.Verify(host, true, t, (*ops)[t]);
    }
    verdict = checked.ok() ? "ok" : std::string(checked.message());
    std::printf(" %-10llu check %s\n", static_cast<unsigned long long>(size), verdict.c_str());
    std::fflush(stdout);
  }
  return sock.SendLine(absl::StrCat("CHECK ", verdict));
}

absl::StatusOr<std::map<std::string, std::string>> ReadHello(const PerfOptions& o,
                                                             LineSocket& sock) {
  const std::string prefix = absl::StrCat("HELLO ", kProtocol, " ");
  absl::StatusOr<std::string> hello = sock.ReadLine(std::min(absl::Seconds(30), SideTimeout(o)));
  if (!hello.ok()) return hello.status();
  if (!absl::StartsWith(*hello, prefix)) {
    return absl::InvalidArgumentError(absl::StrCat("not a ", kProtocol, " HELLO"));
  }
  return DecodeSettings(hello->substr(prefix.size()));
}

absl::Status ServeInitiator(const PerfOptions& o, LineSocket& sock, std::byte* host, uint64_t bytes,
                            KvSide* kv) {
  while (true) {
    absl::StatusOr<std::string> line = sock.ReadLine(SideTimeout(o));
    if (!line.ok()) return line.status();
    std::vector<std::string> parts = absl::StrSplit(*line, ' ');
    if (parts[0] == "BYE") return absl::OkStatus();
    absl::Status served;
    if (parts[0] == "RUN" && kv == nullptr) {
      served = ServeSize(o, sock, host, bytes, parts);
    } else if (parts[0] == "RUN") {
      served = kv->Serve(sock, parts, SideTimeout(o));
    } else {
      served = absl::InvalidArgumentError(absl::StrCat("unexpected \"", *line, "\""));
    }
    if (IsRefusal(served)) {
      // The initiator learns what was wrong; this side stays ready for a correct request.
      std::fprintf(stderr, "kvwire-perf (target): refused: %s\n",
                   std::string(served.message()).c_str());
      if (absl::Status s = sock.SendLine(absl::StrCat("ERROR ", served.message())); !s.ok()) {
        return s;
      }
      continue;
    }
    if (!served.ok()) return served;
  }
}

namespace {

// Waits for an initiator that says HELLO in this tool's protocol. A connection that says
// something else, or nothing within the deadline, gets an ERROR line (when it can take one)
// and is closed; the target keeps waiting. Settings that differ end the target (exit 2).
absl::StatusOr<LineSocket> AcceptInitiator(const PerfOptions& o, LineListener& listener,
                                           std::map<std::string, std::string>* theirs) {
  while (true) {
    absl::StatusOr<LineSocket> sock = listener.Accept(absl::Hours(24 * 365));
    if (!sock.ok()) return sock.status();
    absl::StatusOr<std::map<std::string, std::string>> settings = ReadHello(o, *sock);
    if (settings.ok()) {
      *theirs = *std::move(settings);
      return sock;
    }
    const absl::Status refused = settings.status();
    (void)sock->SendLine(absl::StrCat("ERROR target speaks ", kProtocol, ": ", refused.message()));
    std::fprintf(stderr, "kvwire-perf (target): side-channel connection refused: %s\n",
                 std::string(refused.message()).c_str());
  }
}

}  // namespace

int RunTarget(const PerfOptions& o) {
  absl::StatusOr<LineListener> listener = LineListener::Listen(o.bind, o.port);
  if (!listener.ok()) return Fail(listener.status());
  absl::StatusOr<std::unique_ptr<Engine>> engine = MakeEngine(o, absl::StrCat(o.bind, ":0"));
  if (!engine.ok()) return Fail(engine.status());

  std::unique_ptr<KvSide> kv;
  LocalBuffer buffer;
  if (o.workload == Workload::kKv) {
    absl::StatusOr<std::unique_ptr<KvSide>> side = KvSide::Create(o, **engine, /*initiator=*/false);
    if (!side.ok()) return Fail(side.status());
    kv = *std::move(side);
  } else {
    absl::StatusOr<LocalBuffer> b =
        o.memory == MemoryKind::kGpu
            ? MakeGpuBuffer(**engine, RawRegionBytes(o), o.gpu_device, true)
            : MakeBuffer(**engine, RawRegionBytes(o), o.check && o.op == OpKind::kRead, true);
    if (!b.ok()) return Fail(b.status());
    buffer = *std::move(b);
  }
  RunInfo info;
  info.role = absl::StrCat("target, waiting on port ", listener->port());
  info.transport = "chosen by the initiator";
  PrintHeader(stdout, o, info);
  std::fflush(stdout);

  std::map<std::string, std::string> theirs;
  absl::StatusOr<LineSocket> sock = AcceptInitiator(o, *listener, &theirs);
  if (!sock.ok()) return Fail(sock.status());
  if (absl::Status agree = CheckAgreement(AgreedSettings(o), theirs, "initiator"); !agree.ok()) {
    (void)sock->SendLine(absl::StrCat("ERROR ", agree.message()));
    std::fprintf(stderr, "kvwire-perf (target): %s\n", std::string(agree.message()).c_str());
    return 2;
  }
  const std::string address = (*engine)->address();
  const std::string port = address.substr(address.rfind(':') + 1);
  const RegionId region = kv ? kv->region() : buffer.region;
  if (absl::Status s = sock->SendLine(absl::StrCat("OK port=", port, " region=", region));
      !s.ok()) {
    return Fail(s);
  }
  std::printf(" initiator connected; serving\n");
  std::fflush(stdout);
  if (absl::Status s = ServeInitiator(o, *sock, buffer.memory.data(), buffer.size(), kv.get());
      !s.ok()) {
    return Fail(s);
  }
  std::printf(" done\n");
  return 0;
}

}  // namespace kvwire::perf

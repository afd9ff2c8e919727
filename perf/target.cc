#include "perf/target.h"

#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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

}  // namespace

// Handles one RUN/DONE exchange of a raw size; the reply to DONE says whether WRITEs landed.
absl::Status ServeSize(const PerfOptions& o, LineSocket& sock, LocalBuffer& buffer,
                       const std::vector<std::string>& run) {
  uint64_t size = 0, planned = 0;
  if (run.size() != 3 || !absl::SimpleAtoi(run[1], &size) || !absl::SimpleAtoi(run[2], &planned) ||
      size == 0) {
    return absl::InvalidArgumentError("malformed RUN line");
  }
  const bool verify = o.check && o.op == OpKind::kWrite;
  BufferPlan plan(o.pattern, o.threads, size, buffer.memory.size());
  if (verify) {
    for (int t = 0; t < o.threads; ++t) {
      plan.ClearDestinations(buffer.memory.data(), true, t, planned == 0 ? UINT64_MAX : planned);
    }
  }
  if (absl::Status s = sock.SendLine("READY"); !s.ok()) return s;
  absl::StatusOr<std::string> done = sock.ReadLine(absl::InfiniteDuration());
  if (!done.ok()) return done.status();
  std::vector<std::string> parts = absl::StrSplit(*done, ' ');
  if (parts.size() != 3 || parts[0] != "DONE") {
    return absl::InvalidArgumentError(absl::StrCat("expected DONE, got \"", *done, "\""));
  }
  absl::StatusOr<std::vector<uint64_t>> ops = DecodeOps(parts[2], o.threads);
  if (!ops.ok()) return ops.status();
  std::string verdict = "-";
  if (verify) {
    absl::Status checked = absl::OkStatus();
    for (int t = 0; t < o.threads && checked.ok(); ++t) {
      checked = plan.Verify(buffer.memory.data(), true, t, (*ops)[t]);
    }
    verdict = checked.ok() ? "ok" : std::string(checked.message());
    std::printf(" %-10llu check %s\n", static_cast<unsigned long long>(size), verdict.c_str());
    std::fflush(stdout);
  }
  return sock.SendLine(absl::StrCat("CHECK ", verdict));
}

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
        MakeBuffer(**engine, RawRegionBytes(o), o.check && o.op == OpKind::kRead, true);
    if (!b.ok()) return Fail(b.status());
    buffer = *std::move(b);
  }
  RunInfo info;
  info.role = absl::StrCat("target, waiting on port ", listener->port());
  info.transport = "chosen by the initiator";
  PrintHeader(stdout, o, info);
  std::fflush(stdout);

  absl::StatusOr<LineSocket> sock = listener->Accept(absl::Hours(24 * 365));
  if (!sock.ok()) return Fail(sock.status());
  absl::StatusOr<std::string> hello = sock->ReadLine(absl::Seconds(30));
  if (!hello.ok()) return Fail(hello.status());
  const std::string prefix = absl::StrCat("HELLO ", kProtocol, " ");
  if (!absl::StartsWith(*hello, prefix)) {
    (void)sock->SendLine(absl::StrCat("ERROR target speaks ", kProtocol));
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("the initiator does not speak ", kProtocol, ": \"", *hello, "\"")));
  }
  absl::StatusOr<std::map<std::string, std::string>> theirs =
      DecodeSettings(hello->substr(prefix.size()));
  if (!theirs.ok()) return Fail(theirs.status());
  if (absl::Status agree = CheckAgreement(AgreedSettings(o), *theirs, "initiator"); !agree.ok()) {
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
  while (true) {
    absl::StatusOr<std::string> line = sock->ReadLine(absl::InfiniteDuration());
    if (!line.ok()) return Fail(line.status());
    std::vector<std::string> parts = absl::StrSplit(*line, ' ');
    if (parts[0] == "BYE") break;
    absl::Status served;
    if (parts[0] == "RUN" && !kv) {
      served = ServeSize(o, *sock, buffer, parts);
    } else if (parts[0] == "RUN" && kv) {
      served = kv->Serve(*sock, parts);
    } else {
      served = absl::InvalidArgumentError(absl::StrCat("unexpected \"", *line, "\""));
    }
    if (!served.ok()) return Fail(served);
  }
  std::printf(" done\n");
  return 0;
}

}  // namespace kvwire::perf

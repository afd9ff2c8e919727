// kvwire_netfault_serve: the client of the serving fault test (tests/netfault/README.md, "The
// reference servers under faults"). It runs in the router's network namespace of the test VM
// (netfault_serve_in_vm.sh starts the servers); prefill and decode sit in two other
// namespaces whose link nf_serve_net.sh degrades with netem.
//
//   kvwire_netfault_serve --aggregated=H:P --prefill=H:P --decode=H:P --read_router=H:P
//       --write_router=H:P --link=/path/nf_serve_net.sh
//       [--scenarios=clean,delay20loss1,partition3] [--requests=8] [--window=2] [--after=2]
//       [--max_tokens=8] [--timeout_s=150] [--drain_s=90] [--partition_s=3]
//
// First the greedy answer of every prompt from the aggregated server (one process, no
// transfer): the reference. Then per scenario and mode (read, then write router): apply the
// fault, send `requests` greedy requests (streamed and not, alternating) with `window` in
// flight, each with a deadline of `timeout_s`; for a partition, cut the prefill-decode link
// (every packet dropped) once a quarter of them have ended, and heal it `partition_s` later.
// Each answer is classified:
//   ok     200, complete (a stream ended with [DONE]), and byte for byte the reference's text,
//          token ids and finish reason;
//   error  a transport error, a non-200 status, an error event or a stream cut short;
//   WRONG  complete but not the reference's (the row fails);
//   hung   no answer by its deadline (the row fails).
// Without a partition every answer must be ok. After the fault is gone, `after` more
// requests must all be ok (the same servers, never restarted), and both servers must come
// back to holding nothing: /health's used_blocks, held_blocks, active_requests and
// live_connector_requests all 0 within `drain_s`, and /metrics' kvwire_dsv4_held_blocks and
// kvwire_dsv4_used_blocks 0 (both reported). One KVWIRE_NFS_ANSWER line per request, one
// KVWIRE_NFS_ROW line (JSON) per scenario and mode; exits 0 only when every row passes.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/http_client.h"

namespace {

using dsv4::serve::CompletionResult;
using nlohmann::json;

struct Options {
  std::string aggregated, prefill, decode, read_router, write_router, link;
  std::vector<std::string> scenarios = {"clean", "delay20loss1", "partition3"};
  int requests = 8, window = 2, after = 2, max_tokens = 8, timeout_s = 150, drain_s = 90;
  int partition_s = 3;
};

struct Scenario {
  std::string netem;  // netem arguments ("" for none)
  bool partition = false;
};

const std::map<std::string, Scenario>& Scenarios() {
  static const auto* m = new std::map<std::string, Scenario>{
      {"clean", {"", false}},
      {"delay20loss1", {"delay 20ms loss 1%", false}},
      {"partition3", {"", true}},
  };
  return *m;
}

// Prompts of a few lengths (tokens: BOS + one a byte), crossing the 4-token compression
// boundary and the 64-token block size; short: the model is slow under TCG (a 130-token
// prompt took 40 s there).
std::string Prompt(int i) {
  static const int kLengths[] = {5, 37, 70, 20, 12, 66, 9, 3};
  // Request i asks prompt i % 8: the reference has each once.
  const int j = i % 8, n = kLengths[j];
  std::string s;
  for (int k = 0; k + 1 < n; ++k) s += static_cast<char>('a' + (k * 7 + n + j) % 26);
  return s;
}

json Request(int i, int max_tokens) {
  return {{"prompt", Prompt(i)},
          {"max_tokens", max_tokens},
          {"stream", i % 2 == 0},
          {"temperature", 0}};
}

bool RunLink(const Options& o, const std::string& args) {
  const std::string cmd = absl::StrCat(o.link, " ", args);
  const int rc = std::system(cmd.c_str());
  if (rc != 0) std::printf("KVWIRE_NFS_LINK_FAILED `%s` rc=%d\n", cmd.c_str(), rc);
  std::fflush(stdout);
  return rc == 0;
}

struct Answer {
  std::string kind;    // ok, error, WRONG, hung
  std::string detail;  // the error, or what differs
  double ms = 0;
  absl::Time start, end;
};

struct Reference {
  std::vector<int32_t> tokens;
  std::string text, finish_reason;
};

// A complete answer: 200, no error, a stream that ended with [DONE], a finish reason.
bool Complete(const CompletionResult& r, bool stream) {
  return r.status == 200 && r.error.empty() && (!stream || r.done) && !r.finish_reason.empty();
}

Answer Ask(const std::string& address, int i, const Options& o, const Reference* ref) {
  const bool stream = i % 2 == 0;
  const absl::Time start = absl::Now();
  absl::StatusOr<CompletionResult> r =
      dsv4::serve::Complete(address, Request(i, o.max_tokens), absl::Seconds(o.timeout_s));
  Answer a;
  a.start = start;
  a.end = absl::Now();
  a.ms = absl::ToDoubleMilliseconds(a.end - start);
  if (!r.ok()) {
    a.kind = absl::IsDeadlineExceeded(r.status()) ? "hung" : "error";
    a.detail = r.status().ToString();
  } else if (!Complete(*r, stream)) {
    a.kind = "error";
    a.detail = r->error.empty() ? absl::StrCat("HTTP ", r->status, " incomplete") : r->error;
    if (r->status != 200) a.detail = absl::StrCat("HTTP ", r->status, ": ", a.detail);
  } else if (ref != nullptr && (r->tokens != ref->tokens || r->text != ref->text ||
                                r->finish_reason != ref->finish_reason)) {
    a.kind = "WRONG";
    a.detail =
        absl::StrCat("tokens [", absl::StrJoin(r->tokens, ","), "] text '", r->text, "' finish ",
                     r->finish_reason, " (want [", absl::StrJoin(ref->tokens, ","), "] '",
                     ref->text, "' ", ref->finish_reason, ")");
  } else {
    a.kind = "ok";
  }
  return a;
}

// The error's class for the row: its first words (status code or HTTP status).
std::string ErrorClass(const std::string& detail) {
  std::string s = detail.substr(0, detail.find(':'));
  if (absl::StartsWith(detail, "HTTP ")) s = detail.substr(0, 8);
  return s;
}

double Metric(const std::string& body, const std::string& name) {
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (!absl::StartsWith(line, name) || line.size() <= name.size() ||
        (line[name.size()] != ' ' && line[name.size()] != '{')) {
      continue;
    }
    double v = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) return v;
  }
  return -1;
}

// Waits (by `deadline`) until the server at `address` holds nothing; returns what /metrics
// says it holds then, and the last /health.
json Drained(const std::string& address, absl::Time deadline) {
  json last;
  bool idle = false;
  while (true) {
    absl::StatusOr<json> h = dsv4::serve::GetJson(address, "/health", absl::Seconds(10));
    if (h.ok()) {
      last = *h;
      idle = last.value("used_blocks", 1) == 0 && last.value("held_blocks", 1) == 0 &&
             last.value("active_requests", 1) == 0 && last.value("live_connector_requests", 1) == 0;
    }
    if (idle || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  json out = {{"idle", idle}, {"health", last}};
  dsv4::serve::HttpCallOptions co;
  co.deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<dsv4::serve::HttpResponse> m =
      dsv4::serve::HttpCall(address, "GET", "/metrics", "", co);
  out["held_blocks"] = m.ok() ? Metric(m->body, "kvwire_dsv4_held_blocks") : -1;
  out["used_blocks"] = m.ok() ? Metric(m->body, "kvwire_dsv4_used_blocks") : -1;
  return out;
}

// One scenario in one mode: returns its row.
json RunRow(const Options& o, const std::string& name, const Scenario& sc, const std::string& mode,
            const std::vector<Reference>& refs) {
  const std::string router = mode == "read" ? o.read_router : o.write_router;
  std::vector<std::string> problems;
  if (!sc.netem.empty() && !RunLink(o, absl::StrCat("set ", sc.netem))) {
    problems.push_back("could not apply the fault");
  }
  std::vector<Answer> answers(o.requests);
  std::atomic<int> next{0}, ended{0};
  absl::Mutex mu;  // problems, from the partition thread
  const absl::Time start = absl::Now();
  double cut_s = -1, healed_s = -1;
  absl::Time cut_at = absl::InfiniteFuture(), healed_at = absl::InfinitePast();
  std::thread partition;
  if (sc.partition) {
    partition = std::thread([&] {
      // Once a quarter have ended (or every request has), cut; heal `partition_s` later.
      const int quarter = std::max(1, o.requests / 4);
      const absl::Time wait_until = start + absl::Seconds(o.timeout_s);
      while (ended.load() < quarter && absl::Now() < wait_until) {
        absl::SleepFor(absl::Milliseconds(20));
      }
      // From the moment the cut is in place to the moment the heal is (tc itself takes a
      // second or more under TCG).
      const bool cut = RunLink(o, "set loss 100%");
      cut_at = absl::Now();
      absl::SleepFor(absl::Seconds(o.partition_s));
      const bool healed = RunLink(o, "clear");
      healed_at = absl::Now();
      cut_s = absl::ToDoubleSeconds(cut_at - start);
      healed_s = absl::ToDoubleSeconds(healed_at - start);
      absl::MutexLock lock(&mu);
      if (!cut) problems.push_back("could not cut the link");
      if (!healed) problems.push_back("could not heal the link");
      std::printf("KVWIRE_NFS_PARTITION %s %s cut at %.2f s, healed at %.2f s\n", name.c_str(),
                  mode.c_str(), cut_s, healed_s);
      std::fflush(stdout);
    });
  }
  std::vector<std::thread> workers;
  for (int w = 0; w < o.window; ++w) {
    workers.emplace_back([&] {
      for (int i = next++; i < o.requests; i = next++) {
        answers[i] = Ask(router, i, o, &refs[i % refs.size()]);
        ++ended;
      }
    });
  }
  for (std::thread& t : workers) t.join();
  if (partition.joinable()) partition.join();
  absl::MutexLock lock(&mu);
  const double phase_s = absl::ToDoubleSeconds(absl::Now() - start);
  if (!RunLink(o, "clear")) problems.push_back("could not clear the fault");

  int ok = 0, errors = 0, wrong = 0, hung = 0, across = 0;
  std::map<std::string, int> error_classes;
  std::vector<double> ok_ms;
  for (int i = 0; i < o.requests; ++i) {
    const Answer& a = answers[i];
    std::printf("KVWIRE_NFS_ANSWER %s %s #%d %s %.1f ms %s\n", name.c_str(), mode.c_str(), i,
                a.kind.c_str(), a.ms, a.detail.c_str());
    // In flight while the link was cut (or hung, which ends after it).
    if (a.start < healed_at && (a.end > cut_at || a.kind == "hung")) ++across;
    if (a.kind == "ok") {
      ++ok;
      ok_ms.push_back(a.ms);
    } else if (a.kind == "error") {
      ++errors;
      ++error_classes[ErrorClass(a.detail)];
    } else if (a.kind == "WRONG") {
      ++wrong;
    } else {
      ++hung;
    }
  }
  if (wrong > 0) problems.push_back(absl::StrCat(wrong, " wrong answer(s)"));
  if (hung > 0) problems.push_back(absl::StrCat(hung, " answer(s) past the deadline"));
  // A partition that no request crossed would test nothing.
  if (sc.partition && across == 0) problems.push_back("no request was in flight in the partition");
  if (!sc.partition && ok != o.requests) {
    problems.push_back(absl::StrCat(o.requests - ok, " request(s) failed without a partition"));
  }
  // After the fault: the same servers serve exactly again.
  int after_ok = 0;
  for (int i = 0; i < o.after; ++i) {
    const Answer a = Ask(router, o.requests + i, o, &refs[(o.requests + i) % refs.size()]);
    std::printf("KVWIRE_NFS_ANSWER %s %s after#%d %s %.1f ms %s\n", name.c_str(), mode.c_str(), i,
                a.kind.c_str(), a.ms, a.detail.c_str());
    if (a.kind == "ok") ++after_ok;
  }
  if (after_ok != o.after) {
    problems.push_back(absl::StrCat("after the fault ", after_ok, "/", o.after, " ok"));
  }
  // Nothing held afterwards.
  const absl::Time drain_start = absl::Now();
  const absl::Time deadline = drain_start + absl::Seconds(o.drain_s);
  json held = json::object();
  for (const auto& [role, address] : {std::pair{"prefill", o.prefill}, {"decode", o.decode}}) {
    json d = Drained(address, deadline);
    if (!d["idle"].get<bool>() || d["held_blocks"] != 0 || d["used_blocks"] != 0) {
      problems.push_back(absl::StrCat(role, " still holds: ", d["health"].dump(), " metrics held ",
                                      d["held_blocks"].dump(), " used ", d["used_blocks"].dump()));
    }
    held[role] = {{"held_blocks", d["held_blocks"]}, {"used_blocks", d["used_blocks"]}};
  }
  std::sort(ok_ms.begin(), ok_ms.end());
  json row = {{"scenario", name},
              {"mode", mode},
              {"netem", sc.partition ? absl::StrCat("loss 100% for ", o.partition_s, "s")
                                     : (sc.netem.empty() ? "-" : sc.netem)},
              {"requests", o.requests},
              {"ok", ok},
              {"errors", errors},
              {"error_classes", error_classes},
              {"wrong", wrong},
              {"hung", hung},
              {"after", absl::StrCat(after_ok, "/", o.after)},
              {"p50_ms", ok_ms.empty() ? 0.0 : ok_ms[ok_ms.size() / 2]},
              {"max_ms", ok_ms.empty() ? 0.0 : ok_ms.back()},
              {"phase_s", phase_s},
              {"cut_s", cut_s},
              {"healed_s", healed_s},
              {"in_partition", sc.partition ? across : -1},
              {"drain_s", absl::ToDoubleSeconds(absl::Now() - drain_start)},
              {"held", held},
              {"verdict", problems.empty() ? "PASS" : "FAIL"},
              {"problems", absl::StrJoin(problems, "; ")}};
  return row;
}

bool ParseFlag(absl::string_view arg, const char* name, std::string* out) {
  const std::string prefix = absl::StrCat("--", name, "=");
  if (!absl::StartsWith(arg, prefix)) return false;
  *out = std::string(arg.substr(prefix.size()));
  return true;
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string v;
    const absl::string_view a = argv[i];
    bool good = true;
    if (ParseFlag(a, "aggregated", &o.aggregated) || ParseFlag(a, "prefill", &o.prefill) ||
        ParseFlag(a, "decode", &o.decode) || ParseFlag(a, "read_router", &o.read_router) ||
        ParseFlag(a, "write_router", &o.write_router) || ParseFlag(a, "link", &o.link)) {
    } else if (ParseFlag(a, "scenarios", &v)) {
      o.scenarios = absl::StrSplit(v, ',', absl::SkipEmpty());
    } else {
      good = false;
      for (auto [name, field] : {std::pair{"requests", &o.requests},
                                 {"window", &o.window},
                                 {"after", &o.after},
                                 {"max_tokens", &o.max_tokens},
                                 {"timeout_s", &o.timeout_s},
                                 {"drain_s", &o.drain_s},
                                 {"partition_s", &o.partition_s}}) {
        if (ParseFlag(a, name, &v)) good = absl::SimpleAtoi(v, field) && *field >= 0;
      }
    }
    if (!good) {
      std::fprintf(stderr, "kvwire_netfault_serve: bad argument %s\n", argv[i]);
      return 2;
    }
  }
  if (o.aggregated.empty() || o.prefill.empty() || o.decode.empty() || o.read_router.empty() ||
      o.write_router.empty() || o.link.empty() || o.requests < 1 || o.window < 1) {
    std::fprintf(stderr, "kvwire_netfault_serve: see the usage at the top of serve_driver.cc\n");
    return 2;
  }
  for (const std::string& s : o.scenarios) {
    if (Scenarios().count(s) == 0) {
      std::fprintf(stderr, "kvwire_netfault_serve: unknown scenario %s\n", s.c_str());
      return 2;
    }
  }
  // The reference: every prompt once, from the aggregated server, on no faulty link.
  const int distinct = std::min(8, o.requests + o.after);
  std::vector<Reference> refs(distinct);
  for (int i = 0; i < distinct; ++i) {
    absl::StatusOr<CompletionResult> r =
        dsv4::serve::Complete(o.aggregated, Request(i, o.max_tokens), absl::Seconds(o.timeout_s));
    if (!r.ok() || !Complete(*r, i % 2 == 0)) {
      std::printf("KVWIRE_NFS_FATAL the aggregated server did not answer prompt %d: %s\n", i,
                  r.ok() ? absl::StrCat("HTTP ", r->status, " ", r->error).c_str()
                         : r.status().ToString().c_str());
      return 1;
    }
    refs[i] = {r->tokens, r->text, r->finish_reason};
    std::printf("KVWIRE_NFS_REFERENCE #%d prompt of %zu bytes: [%s]\n", i, Prompt(i).size(),
                absl::StrJoin(r->tokens, ",").c_str());
  }
  std::fflush(stdout);
  bool all = true;
  for (const std::string& s : o.scenarios) {
    for (const char* mode : {"read", "write"}) {
      const json row = RunRow(o, s, Scenarios().at(s), mode, refs);
      std::printf("KVWIRE_NFS_ROW %s\n", row.dump().c_str());
      std::fflush(stdout);
      all = all && row["verdict"] == "PASS";
    }
  }
  RunLink(o, "show");
  return all ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }

// kvwire-request-bench: the CPU and wall time of whole requests through the connector, each
// side in its own process, next to the bare engine Transfer of the same pages (issue 15).
//
// For each layout (dsv4-pro, dsv4-flash), transport (shm, tcp) and mode (read, write) this
// process (decode) starts itself again as the prefill (--prefill-child) with a socketpair
// between them, and both build a kvwire::Connector over a simulated KV cache (the connector
// tests' KvCache, fragmented into runs of 1..--max-run free blocks) on 127.0.0.1. Then:
//   1. connector phase: --warmup + --requests requests one after another, driven like vLLM's
//      scheduler and worker (read: prefill RequestFinished -> decode match, alloc, bind,
//      StartLoadKv, GetFinished until finished_recving; prefill GetFinished until
//      finished_sending. write: decode StartLoadKv, prefill match, alloc, bind, SaveKvLayer
//      of every layer, WaitForSave, RequestFinished; both GetFinished until done). Wall time
//      per request: decode's first connector call of the load to finished_recving.
//   2. bare phase: the connectors are destroyed; two plain Engines (same transport) with a
//      buffer of the same size move the SAME pages (PlanTransfer of the same block tables,
//      as region offsets) as one Transfer per request, initiated by the side that moves the
//      bytes in that mode (read: decode READs; write: prefill WRITEs); wall time per Transfer.
//
// What is counted as a side's CPU (user + sys, getrusage(RUSAGE_SELF) of that side's process
// over the measured requests, so every thread of the process: connector, engine, control,
// transport threads, idle heartbeats and polling included), minus the CPU the benchmark's own
// driver thread spent outside connector (or engine) calls (side-channel I/O, block
// allocation, sleeping between GetFinished polls), measured with CLOCK_THREAD_CPUTIME_ID
// around each call. The driver polls GetFinished every --poll-us (default 50) microseconds,
// like a scheduler step; those calls count as connector CPU.
// Allocations: operator new calls of the whole process per request (counting allocator).
//
//   kvwire-request-bench [--layouts dsv4-pro,dsv4-flash] [--tokens 8192] [--requests 20]
//                        [--warmup 5] [--transports shm,tcp] [--modes read,write]
//                        [--max-run 8] [--poll-us 50] [--csv FILE]
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <map>
#include <memory>
#include <poll.h>
#include <string>
#include <time.h>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "kvwire/connector.h"
#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "kvwire/memory.h"
#include "perf/cpu/counting_alloc.h"
#include "tests/connector/kv_sim.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvwire::perf::cpu::ProcessAllocs;

struct Config {
  std::string layout = "dsv4-pro";  // preset short name
  std::string transport = "shm";
  std::string mode = "read";
  uint64_t tokens = 8192;
  uint64_t requests = 20;
  uint64_t warmup = 5;
  uint64_t max_run = 8;
  uint64_t poll_us = 50;
  // ConnectorOptions::read_grants (default on): grant-guarded KV is never mapped over shm, so
  // with it on the connector's bytes go over tcp even between shm engines while the bare
  // Transfer uses shm; off, both move the bytes the same way.
  bool read_grants = true;
  std::string tag;  // unique per configuration, part of every request id

  bool write() const { return mode == "write"; }
  std::string Preset() const {
    if (layout == "dsv4-pro") return "deepseek-v4-pro";
    if (layout == "dsv4-flash") return "deepseek-v4-flash";
    return layout;
  }
  uint64_t Blocks() const { return 2 * (tokens / 64) + 8; }
  std::vector<std::string> Args() const {
    return {"--layouts",     layout,
            "--transports",  transport,
            "--modes",       mode,
            "--tokens",      absl::StrCat(tokens),
            "--requests",    absl::StrCat(requests),
            "--warmup",      absl::StrCat(warmup),
            "--max-run",     absl::StrCat(max_run),
            "--poll-us",     absl::StrCat(poll_us),
            "--read-grants", read_grants ? "1" : "0",
            "--tag",         tag};
  }
};

[[noreturn]] void Die(const std::string& who, const std::string& what) {
  std::fprintf(stderr, "kvwire-request-bench (%s): %s\n", who.c_str(), what.c_str());
  std::exit(1);
}

void Check(const absl::Status& s, const std::string& who, const char* what) {
  if (!s.ok()) Die(who, absl::StrCat(what, ": ", s.ToString()));
}

double ThreadCpuUs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

double ProcessCpuUs() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 + ru.ru_utime.tv_usec +
         ru.ru_stime.tv_usec;
}

// CPU of this side over a window: the process, less the driver thread's time outside
// library calls (`inside` accumulates the driver's CPU inside them).
class CpuWindow {
 public:
  void Start() {
    process_ = ProcessCpuUs();
    thread_ = ThreadCpuUs();
    inside_ = 0;
    news_ = ProcessAllocs().news;
  }
  // Runs `f` on the driver thread, counting its CPU as the library's.
  template <typename F>
  auto Call(F&& f) {
    const double t0 = ThreadCpuUs();
    auto r = f();
    inside_ += ThreadCpuUs() - t0;
    return r;
  }
  // Side CPU (us) and allocations since Start.
  double SideUs() const {
    const double outside = (ThreadCpuUs() - thread_) - inside_;
    return ProcessCpuUs() - process_ - outside;
  }
  uint64_t News() const { return ProcessAllocs().news - news_; }

 private:
  double process_ = 0, thread_ = 0, inside_ = 0;
  uint64_t news_ = 0;
};

// One line at a time over a socket, every read bounded by a deadline.
class LineChannel {
 public:
  explicit LineChannel(int fd, std::string who) : fd_(fd), who_(std::move(who)) {}
  void Send(const std::string& line) {
    std::string l = line + "\n";
    size_t done = 0;
    while (done < l.size()) {
      const ssize_t n = write(fd_, l.data() + done, l.size() - done);
      if (n <= 0) Die(who_, "side channel write failed (the other side exited?)");
      done += static_cast<size_t>(n);
    }
  }
  std::string Read(int timeout_ms = 120000) {
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (true) {
      const size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        if (absl::StartsWith(line, "FAIL ")) Die(who_, absl::StrCat("other side: ", line));
        return line;
      }
      const int64_t left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) Die(who_, "side channel: no line within the deadline");
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char buf[65536];
      const ssize_t n = read(fd_, buf, sizeof(buf));
      if (n <= 0) Die(who_, "side channel closed (the other side exited?)");
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }
  // Reads a line that must start with `word` + " " (or be `word`); returns the rest.
  std::string Expect(const std::string& word) {
    std::string line = Read();
    if (line == word) return "";
    if (!absl::StartsWith(line, word + " ")) {
      Die(who_, absl::StrCat("expected ", word, ", got \"", line.substr(0, 200), "\""));
    }
    return line.substr(word.size() + 1);
  }

 private:
  int fd_;
  std::string who_;
  std::string buffer_;
};

std::string TableJson(const kvwire::BlockTable& t) { return nlohmann::json(t).dump(); }
kvwire::BlockTable TableFromJson(const std::string& s, const std::string& who) {
  nlohmann::json j = nlohmann::json::parse(s, nullptr, false);
  if (j.is_discarded()) Die(who, "bad block table JSON");
  return j.get<kvwire::BlockTable>();
}

void SleepUs(uint64_t us) {
  timespec ts{0, static_cast<long>(us * 1000)};
  nanosleep(&ts, nullptr);
}

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

std::vector<int> AllLayers(const kvwire::Layout& layout) {
  std::vector<int> out;
  for (const kvwire::CacheGroup& g : layout.groups) {
    out.insert(out.end(), g.layers.begin(), g.layers.end());
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::unique_ptr<kvwire::Connector> MakeConnector(const Config& c, const std::string& name) {
  kvwire::ConnectorOptions o;
  o.role = name == "prefill" ? "prefill" : "decode";
  o.engine.name = absl::StrCat("req-bench-", name, "-", c.tag);
  o.engine.transport = c.transport;
  // A request that stalls fails (failed_loads, with the connector's reason) well before the
  // driver's own deadline below.
  o.request_timeout = absl::Seconds(20);
  o.read_grants = c.read_grants;
  absl::StatusOr<std::unique_ptr<kvwire::Connector>> conn = kvwire::Connector::Create(o);
  Check(conn.status(), name, "connector");
  return *std::move(conn);
}

std::unique_ptr<kvwire::testing::KvCache> MakeCache(const Config& c, uint64_t seed,
                                                    const std::string& who) {
  auto kv = kvwire::testing::KvCache::Create(c.Preset(), c.Blocks(), 2, seed);
  Check(kv.status(), who, "kv cache");
  (*kv)->FragmentInRuns(c.max_run);
  return *std::move(kv);
}

// The layout at offset 0 of a KvCache's memory: PlanTransfer's addresses become offsets.
kvwire::Layout LayoutAtZero(const Config& c) {
  absl::StatusOr<kvwire::Layout> l = kvwire::testing::MakeLayout(c.Preset());
  Check(l.status(), "plan", "layout");
  kvwire::AssignBacking(&*l, 0, c.Blocks(), 2);
  return *l;
}

// The bare phase's engine and buffer on one side.
struct BareSide {
  std::unique_ptr<kvwire::Engine> engine;
  kvwire::ShareableBuffer buffer;
  kvwire::RegionId region = 0;
};

BareSide MakeBare(const Config& c, uint64_t bytes, const std::string& who) {
  BareSide b;
  kvwire::EngineOptions o;
  o.name = absl::StrCat("req-bench-bare-", who, "-", c.tag);
  o.transport = c.transport;
  auto e = kvwire::Engine::Create(o);
  Check(e.status(), who, "bare engine");
  b.engine = *std::move(e);
  auto buf = kvwire::ShareableBuffer::Create(bytes, "req-bench-bare");
  Check(buf.status(), who, "bare buffer");
  b.buffer = *std::move(buf);
  std::memset(b.buffer.data(), 0x3c, b.buffer.size());
  kvwire::RegionOptions ro;
  ro.export_to_all_peers = true;
  auto r = b.engine->RegisterMemory(b.buffer.data(), b.buffer.size(), ro);
  Check(r.status(), who, "bare register");
  b.region = *r;
  return b;
}

// The initiator's ops of one request: the plan's ranges as offsets of the two buffers.
std::vector<kvwire::Op> BareOps(const Config& c, const kvwire::BlockTable& prefill,
                                const kvwire::BlockTable& decode, kvwire::RegionId local,
                                kvwire::RegionId remote, uint64_t* pages, uint64_t* merged,
                                uint64_t* bytes) {
  const kvwire::Layout l = LayoutAtZero(c);
  auto plan = kvwire::PlanTransfer(l, prefill, l, decode, c.tokens);
  Check(plan.status(), "plan", "PlanTransfer");
  std::vector<kvwire::Op> ops;
  for (const kvwire::GroupPlan& g : plan->groups) {
    for (const kvwire::ByteRange& r : g.ranges) {
      // write: prefill (local) -> decode (remote); read: decode (local) <- prefill (remote).
      ops.push_back(c.write() ? kvwire::Op{local, r.src, remote, r.dst, r.length}
                              : kvwire::Op{local, r.dst, remote, r.src, r.length});
    }
  }
  if (pages != nullptr) *pages = plan->ops_before_merge;
  if (merged != nullptr) *merged = plan->ops_after_merge;
  if (bytes != nullptr) *bytes = plan->bytes;
  return ops;
}

// Runs the bare transfers of the measured requests on the initiating side (a warm-up round of
// all of them first, unless --warmup 0); returns the wall time of each measured Transfer (us).
std::vector<double> RunBare(const Config& c, BareSide& me, kvwire::PeerId peer,
                            kvwire::RegionId remote, const std::vector<kvwire::BlockTable>& p,
                            const std::vector<kvwire::BlockTable>& d, CpuWindow* cpu,
                            const std::string& who, const std::function<void()>& measuring) {
  std::vector<std::vector<kvwire::Op>> all;
  for (size_t i = 0; i < p.size(); ++i) {
    all.push_back(BareOps(c, p[i], d[i], me.region, remote, nullptr, nullptr, nullptr));
  }
  const kvwire::OpKind kind = c.write() ? kvwire::OpKind::kWrite : kvwire::OpKind::kRead;
  auto one = [&](const std::vector<kvwire::Op>& ops) {
    auto id = cpu->Call([&] { return me.engine->Transfer(peer, kind, ops); });
    Check(id.status(), who, "bare Transfer");
    Check(cpu->Call([&] { return me.engine->Wait(*id, absl::Seconds(120)); }), who, "bare Wait");
  };
  // Warm-up: every measured request once, so that each page has been touched through this
  // pair's mappings before the clock starts (a first touch through a peer's populated memfd
  // mapping costs ~10x a copy on some VMs: perf/cpu/README.md), as in the connector phase
  // after its warm-up requests.
  if (c.warmup > 0) {
    for (const auto& ops : all) one(ops);
  }
  std::vector<double> us;
  measuring();  // the other side starts its window after this side's warm-up
  cpu->Start();
  for (const auto& ops : all) {
    const Clock::time_point t0 = Clock::now();
    one(ops);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return us;
}

// --- prefill (child process) ---

int PrefillMain(const Config& c, int fd) {
  const std::string who = absl::StrCat("prefill ", c.tag);
  LineChannel ch(fd, who);
  std::vector<kvwire::BlockTable> tables;
  kvwire::Layout layout0;
  uint64_t kv_bytes = 0;
  {
    std::unique_ptr<kvwire::Connector> conn = MakeConnector(c, "prefill");
    auto kv = MakeCache(c, 11, who);
    kv_bytes = kv->memory()[0].length;
    Check(conn->RegisterKvCaches(kv->layout(), kv->memory()), who, "register");
    const std::vector<int> layers = AllLayers(kv->layout());
    ch.Send(absl::StrCat("READY ", conn->engine().address()));
    CpuWindow cpu;
    bool measuring = false;
    while (true) {
      const std::string line = ch.Read();
      if (line == "MEASURE") {
        cpu.Start();
        measuring = true;
        ch.Send("OK");
        continue;
      }
      if (line == "END") {
        ch.Send(absl::StrCat("CPU ", cpu.SideUs(), " ", cpu.News()));
        break;
      }
      std::vector<std::string> w = absl::StrSplit(line, ' ');
      if (w.size() != 2 || w[0] != "REQ") Die(who, absl::StrCat("unexpected \"", line, "\""));
      const std::string& id = w[1];
      auto blocks = kv->Allocate(id, c.tokens);
      Check(blocks.status(), who, "allocate");
      if (measuring) tables.push_back(*blocks);
      kvwire::KvTransferParams in;
      in.do_remote_decode = true;
      in.mode = c.write() ? kvwire::KvMode::kWrite : kvwire::KvMode::kRead;
      in.transfer_id = "t-" + id;
      const std::string in_json = in.ToJson();
      // As in vLLM: without delay_free the blocks are free at once, and the request never
      // shows up in finished_sending (write mode, when its WRITEs have already completed).
      bool delay_free = true;
      if (!c.write()) {
        auto fin = cpu.Call([&] { return conn->RequestFinished(id, *blocks, c.tokens, in_json); });
        Check(fin.status(), who, "RequestFinished");
        delay_free = fin->delay_free;
        ch.Send(absl::StrCat("PARAMS ", fin->kv_transfer_params));
      } else {
        auto m = cpu.Call([&] { return conn->GetNumNewMatchedTokens(id, c.tokens, 0, in_json); });
        Check(m.status(), who, "match");
        Check(cpu.Call([&] { return conn->UpdateStateAfterAlloc(id, *blocks, 0); }), who, "alloc");
        Check(cpu.Call([&] { return conn->BindConnectorMeta(conn->BuildConnectorMeta()); }), who,
              "bind");
        for (int layer : layers) {
          Check(cpu.Call([&] { return conn->SaveKvLayer(layer); }), who, "SaveKvLayer");
        }
        Check(cpu.Call([&] { return conn->WaitForSave(); }), who, "WaitForSave");
        auto fin = cpu.Call([&] { return conn->RequestFinished(id, *blocks, c.tokens, in_json); });
        Check(fin.status(), who, "RequestFinished");
        delay_free = fin->delay_free;
      }
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(40);
      while (delay_free) {
        kvwire::FinishedRequests f = cpu.Call([&] { return conn->GetFinished(); });
        if (Contains(f.finished_sending, id)) break;
        if (Clock::now() > deadline) {
          // What the connector knows of it, for whoever debugs the stall.
          Die(who, absl::StrCat("request ", id, " never reported in finished_sending (",
                                conn->LiveRequests(),
                                " live); stats: ", conn->StatsJson().substr(0, 3000)));
        }
        SleepUs(c.poll_us);
      }
      kv->Release(id);
      ch.Send(absl::StrCat("FREED ", id));
    }
  }
  // Bare phase: the decode side's tables come over; the initiator (write: here) dials.
  layout0 = LayoutAtZero(c);
  BareSide bare = MakeBare(c, kv_bytes, who);
  ch.Send(absl::StrCat("BARE ", bare.engine->address(), " ", bare.region));
  for (const kvwire::BlockTable& t : tables) ch.Send(absl::StrCat("PTABLE ", TableJson(t)));
  std::vector<kvwire::BlockTable> decode_tables;
  for (size_t i = 0; i < tables.size(); ++i) {
    decode_tables.push_back(TableFromJson(ch.Expect("DTABLE"), who));
  }
  std::vector<std::string> theirs = absl::StrSplit(ch.Expect("PEER"), ' ');
  uint64_t remote = 0;
  if (theirs.size() != 2 || !absl::SimpleAtoi(theirs[1], &remote)) Die(who, "bad PEER line");
  CpuWindow cpu;
  if (c.write()) {
    auto peer = bare.engine->Connect(theirs[0]);
    Check(peer.status(), who, "bare connect");
    Check(bare.engine->WaitForRemoteRegion(*peer, remote, absl::Seconds(30)), who, "region");
    ch.Expect("BGO");
    std::vector<double> us =
        RunBare(c, bare, *peer, remote, tables, decode_tables, &cpu, who, [&ch] {
          ch.Send("BSTART");
          ch.Expect("BSTARTED");
        });
    ch.Send(absl::StrCat("BDONE ", cpu.SideUs(), " ", absl::StrJoin(us, ",")));
  } else {
    ch.Expect("BGO");
    cpu.Start();
    ch.Send("BOK");
    ch.Expect("BEND");
    ch.Send(absl::StrCat("BCPU ", cpu.SideUs()));
  }
  ch.Expect("BYE");
  return 0;
}

// --- decode (this process) ---

struct Row {
  Config c;
  uint64_t pages = 0, merged = 0, bytes = 0;
  double wall_us = 0, decode_us = 0, prefill_us = 0;  // connector phase, per request
  double decode_news = 0, prefill_news = 0;           // allocations per request
  double bare_wall_us = 0, bare_decode_us = 0, bare_prefill_us = 0;
};

// The goal column: met / no (wall <= 1.2 x bare + 200 us), or inval when the baseline cannot
// be right: no bare figure, or a bare Transfer slower than the connector request that wraps
// the same Transfer (a "met" on such a baseline would be a goal met by a broken yardstick).
const char* GoalVerdict(const Row& r) {
  if (r.bare_wall_us <= 0 || r.wall_us < r.bare_wall_us) return "inval";
  return r.wall_us <= 1.2 * r.bare_wall_us + 200 ? "met" : "no";
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Row RunDecode(const Config& c, const char* self) {
  const std::string who = absl::StrCat("decode ", c.tag);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) Die(who, "socketpair");
  std::vector<std::string> args = c.Args();
  args.insert(args.begin(), {self, "--prefill-child", absl::StrCat(sv[1])});
  const pid_t pid = fork();
  if (pid < 0) Die(who, "fork");
  if (pid == 0) {
    // Only exec after fork (this process may have threads): the child starts afresh.
    fcntl(sv[1], F_SETFD, 0);  // the prefill's end survives exec
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(self, argv.data());
    _exit(127);
  }
  close(sv[1]);
  LineChannel ch(sv[0], who);
  Row row;
  row.c = c;
  std::vector<kvwire::BlockTable> tables;
  uint64_t kv_bytes = 0;
  {
    std::unique_ptr<kvwire::Connector> conn = MakeConnector(c, "decode");
    auto kv = MakeCache(c, 12, who);
    kv_bytes = kv->memory()[0].length;
    Check(conn->RegisterKvCaches(kv->layout(), kv->memory()), who, "register");
    const std::string prefill_address = ch.Expect("READY");
    CpuWindow cpu;
    std::vector<double> walls;
    for (uint64_t i = 0; i < c.warmup + c.requests; ++i) {
      if (i == c.warmup) {
        ch.Send("MEASURE");
        ch.Expect("OK");
        cpu.Start();
      }
      const std::string id = absl::StrCat(c.tag, "-", i);
      auto blocks = kv->Allocate(id, c.tokens);
      Check(blocks.status(), who, "allocate");
      if (i >= c.warmup) tables.push_back(*blocks);
      std::string params;
      if (!c.write()) {
        ch.Send(absl::StrCat("REQ ", id));
        params = ch.Expect("PARAMS");
      } else {
        kvwire::KvTransferParams w;
        w.host = prefill_address.substr(0, prefill_address.rfind(':'));
        w.port = std::stoi(prefill_address.substr(prefill_address.rfind(':') + 1));
        w.transfer_id = "t-" + id;
        w.mode = kvwire::KvMode::kWrite;
        w.num_tokens = c.tokens;
        w.do_remote_prefill = true;
        params = w.ToJson();
      }
      const Clock::time_point t0 = Clock::now();
      auto m = cpu.Call([&] { return conn->GetNumNewMatchedTokens(id, c.tokens, 0, params); });
      Check(m.status(), who, "match");
      Check(cpu.Call(
                [&] { return conn->UpdateStateAfterAlloc(id, *blocks, m->num_external_tokens); }),
            who, "alloc");
      Check(cpu.Call([&] { return conn->BindConnectorMeta(conn->BuildConnectorMeta()); }), who,
            "bind");
      Check(cpu.Call([&] { return conn->StartLoadKv(); }), who, "StartLoadKv");
      if (c.write()) ch.Send(absl::StrCat("REQ ", id));
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(40);
      while (true) {
        kvwire::FinishedRequests f = cpu.Call([&] { return conn->GetFinished(); });
        if (!f.failed_loads.empty()) Die(who, "load failed: " + f.failed_loads[0].reason);
        if (Contains(f.finished_recving, id)) break;
        if (Clock::now() > deadline) {
          Die(who, absl::StrCat("request ", id, " never reported in finished_recving; stats: ",
                                conn->StatsJson().substr(0, 3000)));
        }
        SleepUs(c.poll_us);
      }
      if (i >= c.warmup) {
        walls.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
      kv->Release(id);
      ch.Expect("FREED");
    }
    row.decode_us = cpu.SideUs() / c.requests;
    row.decode_news = static_cast<double>(cpu.News()) / c.requests;
    ch.Send("END");
    std::vector<std::string> w = absl::StrSplit(ch.Expect("CPU"), ' ');
    double p_us = 0, p_news = 0;
    if (w.size() != 2 || !absl::SimpleAtod(w[0], &p_us) || !absl::SimpleAtod(w[1], &p_news)) {
      Die(who, "bad CPU line");
    }
    row.prefill_us = p_us / c.requests;
    row.prefill_news = p_news / c.requests;
    row.wall_us = Median(walls);
  }
  // Bare phase.
  BareSide bare = MakeBare(c, kv_bytes, who);
  std::vector<std::string> b = absl::StrSplit(ch.Expect("BARE"), ' ');
  uint64_t remote = 0;
  if (b.size() != 2 || !absl::SimpleAtoi(b[1], &remote)) Die(who, "bad BARE line");
  std::vector<kvwire::BlockTable> prefill_tables;
  for (size_t i = 0; i < tables.size(); ++i) {
    prefill_tables.push_back(TableFromJson(ch.Expect("PTABLE"), who));
  }
  for (const kvwire::BlockTable& t : tables) ch.Send(absl::StrCat("DTABLE ", TableJson(t)));
  ch.Send(absl::StrCat("PEER ", bare.engine->address(), " ", bare.region));
  (void)BareOps(c, prefill_tables[0], tables[0], 0, 0, &row.pages, &row.merged, &row.bytes);
  CpuWindow cpu;
  std::vector<double> us;
  if (!c.write()) {
    auto peer = bare.engine->Connect(b[0]);
    Check(peer.status(), who, "bare connect");
    Check(bare.engine->WaitForRemoteRegion(*peer, remote, absl::Seconds(30)), who, "region");
    us = RunBare(c, bare, *peer, remote, prefill_tables, tables, &cpu, who, [&ch] {
      ch.Send("BGO");
      ch.Expect("BOK");
    });
    row.bare_decode_us = cpu.SideUs() / c.requests;
    ch.Send("BEND");
    double p = 0;
    if (!absl::SimpleAtod(ch.Expect("BCPU"), &p)) Die(who, "bad BCPU line");
    row.bare_prefill_us = p / c.requests;
  } else {
    ch.Send("BGO");
    ch.Expect("BSTART");  // the prefill's warm-up is done
    cpu.Start();
    ch.Send("BSTARTED");
    std::vector<std::string> d = absl::StrSplit(ch.Expect("BDONE"), ' ');
    row.bare_decode_us = cpu.SideUs() / c.requests;
    double p = 0;
    if (d.size() != 2 || !absl::SimpleAtod(d[0], &p)) Die(who, "bad BDONE line");
    row.bare_prefill_us = p / c.requests;
    for (absl::string_view v : absl::StrSplit(d[1], ',')) {
      double x = 0;
      if (absl::SimpleAtod(v, &x)) us.push_back(x);
    }
  }
  row.bare_wall_us = Median(us);
  ch.Send("BYE");
  int status = 0;
  waitpid(pid, &status, 0);
  close(sv[0]);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die(who, "the prefill process failed");
  return row;
}

std::string LoadAvg() {
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return "?";
  char buf[128] = {0};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  std::vector<std::string> w = absl::StrSplit(s, ' ');
  return w.size() >= 3 ? absl::StrCat(w[0], " ", w[1], " ", w[2]) : s;
}

}  // namespace

int main(int argc, char** argv) {
  Config base;
  std::vector<std::string> layouts = {"dsv4-pro", "dsv4-flash"};
  std::vector<std::string> transports = {"shm", "tcp"}, modes = {"read", "write"};
  int child_fd = -1;
  std::string csv;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) Die("args", absl::StrCat(k, " needs a value"));
    const std::string v = argv[++i];
    bool ok = true;
    if (k == "--layouts") {
      layouts = absl::StrSplit(v, ',');
    } else if (k == "--transports") {
      transports = absl::StrSplit(v, ',');
    } else if (k == "--modes") {
      modes = absl::StrSplit(v, ',');
      for (const std::string& m : modes) ok = ok && (m == "read" || m == "write");
    } else if (k == "--tokens") {
      ok = absl::SimpleAtoi(v, &base.tokens) && base.tokens >= 64;
    } else if (k == "--requests") {
      ok = absl::SimpleAtoi(v, &base.requests) && base.requests > 0;
    } else if (k == "--warmup") {
      ok = absl::SimpleAtoi(v, &base.warmup);
    } else if (k == "--max-run") {
      ok = absl::SimpleAtoi(v, &base.max_run) && base.max_run > 0;
    } else if (k == "--poll-us") {
      ok = absl::SimpleAtoi(v, &base.poll_us) && base.poll_us < 1000000;
    } else if (k == "--read-grants") {
      ok = v == "0" || v == "1";
      base.read_grants = v == "1";
    } else if (k == "--csv") {
      csv = v;
    } else if (k == "--tag") {
      base.tag = v;
    } else if (k == "--prefill-child") {
      ok = absl::SimpleAtoi(v, &child_fd);
    } else {
      ok = false;
    }
    if (!ok) Die("args", absl::StrCat("bad option ", k, " ", v));
  }
  for (const std::string& t : transports) {
    if (t != "shm" && t != "tcp") Die("args", absl::StrCat("transport ", t, ": shm or tcp"));
  }
  if (child_fd >= 0) {
    base.layout = layouts.at(0);
    base.transport = transports.at(0);
    base.mode = modes.at(0);
    return PrefillMain(base, child_fd);
  }
  const std::string load_before = LoadAvg();
  std::printf(
      "# kvwire-request-bench: %llu-token requests, blocks fragmented in runs of 1..%llu, %llu "
      "measured after %llu warm-up, each side its own process on 127.0.0.1, read grants %s\n"
      "# load before: %s\n"
      "# CPU = user+sys of the side's process over the measured requests (every thread), less the\n"
      "# benchmark driver's own time outside connector/engine calls; per request. Wall: decode's\n"
      "# start of load to finished_recving (median). bare: one engine Transfer of the same pages\n"
      "# between plain engines (median wall; CPU likewise). goal: wall <= 1.2 x bare + 200 us.\n",
      static_cast<unsigned long long>(base.tokens), static_cast<unsigned long long>(base.max_run),
      static_cast<unsigned long long>(base.requests), static_cast<unsigned long long>(base.warmup),
      base.read_grants ? "on (the connector's default: its READs are checked by the prefill's "
                         "engine: served copies over shm, tcp otherwise)"
                       : "off",
      load_before.c_str());
  std::printf(
      "%-10s %-4s %-5s %6s %6s %7s | %9s %9s %9s %7s %6s %6s | %9s %8s %8s | %8s %8s | %6s %5s\n",
      "layout", "tx", "mode", "pages", "merged", "MB", "wall us", "dec CPU", "pre CPU", "ns/page",
      "dec al", "pre al", "bare us", "b.dec", "b.pre", "+dec", "+pre", "ratio", "goal");
  std::vector<Row> rows;
  int invalid = 0;
  int tag = 0;
  for (const std::string& l : layouts) {
    for (const std::string& t : transports) {
      for (const std::string& m : modes) {
        Config c = base;
        c.layout = l;
        c.transport = t;
        c.mode = m;
        c.tag = absl::StrCat("c", getpid(), "x", tag++);
        Row r = RunDecode(c, argv[0]);
        const double worst = std::max(r.decode_us, r.prefill_us);
        const char* verdict = GoalVerdict(r);
        if (std::strcmp(verdict, "inval") == 0) ++invalid;
        std::printf(
            "%-10s %-4s %-5s %6llu %6llu %7.2f | %9.0f %9.0f %9.0f %7.1f %6.0f %6.0f | %9.0f %8.0f "
            "%8.0f | %8.0f %8.0f | %6.2f %5s\n",
            l.c_str(), t.c_str(), m.c_str(), static_cast<unsigned long long>(r.pages),
            static_cast<unsigned long long>(r.merged), r.bytes / 1e6, r.wall_us, r.decode_us,
            r.prefill_us, r.pages ? worst * 1e3 / r.pages : 0.0, r.decode_news, r.prefill_news,
            r.bare_wall_us, r.bare_decode_us, r.bare_prefill_us, r.decode_us - r.bare_decode_us,
            r.prefill_us - r.bare_prefill_us, r.bare_wall_us > 0 ? r.wall_us / r.bare_wall_us : 0.0,
            verdict);
        std::fflush(stdout);
        rows.push_back(r);
      }
    }
  }
  std::printf("# load after: %s\n", LoadAvg().c_str());
  if (invalid > 0) {
    std::printf(
        "# %d row(s) with goal inval: the bare Transfer took longer than the connector request "
        "that wraps the same Transfer, so the baseline is wrong (load, or a slow bare path), "
        "and the goal is not judged\n",
        invalid);
  }
  std::printf(
      "# columns: pages = pages moved (ops before merging), merged = ops after merging; dec/pre "
      "CPU = us of CPU per request on decode / prefill; ns/page = the larger side's CPU per page; "
      "dec/pre al = operator new calls per request per process; bare us, b.dec, b.pre = the bare "
      "Transfer's wall and CPU per side; +dec, +pre = CPU the connector adds over the bare "
      "Transfer on that side (both include the copy where that side copies: shm initiator, tcp "
      "both); ratio = wall / bare wall; goal = wall <= 1.2 x bare + 200 us (met / no), or "
      "inval when ratio < 1 (the bare Transfer slower than the request wrapping it: an invalid "
      "baseline) or no bare figure\n");
  if (!csv.empty()) {
    FILE* f = std::fopen(csv.c_str(), "w");
    if (f == nullptr) Die("csv", absl::StrCat("cannot write ", csv));
    std::fprintf(f,
                 "layout,transport,mode,tokens,pages,merged,bytes,wall_us,decode_cpu_us,"
                 "prefill_cpu_us,decode_allocs,prefill_allocs,bare_wall_us,bare_decode_cpu_us,"
                 "bare_prefill_cpu_us,load_before,load_after\n");
    for (const Row& r : rows) {
      std::fprintf(
          f, "%s,%s,%s,%llu,%llu,%llu,%llu,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%s,%s\n",
          r.c.layout.c_str(), r.c.transport.c_str(), r.c.mode.c_str(),
          static_cast<unsigned long long>(r.c.tokens), static_cast<unsigned long long>(r.pages),
          static_cast<unsigned long long>(r.merged), static_cast<unsigned long long>(r.bytes),
          r.wall_us, r.decode_us, r.prefill_us, r.decode_news, r.prefill_news, r.bare_wall_us,
          r.bare_decode_us, r.bare_prefill_us, load_before.c_str(), LoadAvg().c_str());
    }
    std::fclose(f);
  }
  return 0;
}

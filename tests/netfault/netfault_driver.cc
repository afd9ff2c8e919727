// kvwire_netfault: the two engines of the tcp network fault matrix (tests/netfault/README.md).
// Each runs in its own network namespace of the test VM; the namespaces are joined by a veth
// pair whose two ends nf_link.sh degrades with netem (so both directions see the fault).
//
//   kvwire_netfault serve --listen=10.9.0.2:7700 [--max_seconds=3600]
//   kvwire_netfault run --server=10.9.0.2:7700 --listen=10.9.0.1:0 --link=/path/nf_link.sh
//       --scenarios=clean,delay10,loss1,partition3 [--transfers=12] [--after=4] [--window=4]
//       [--ops=8] [--op_bytes=32768] [--deadline_s=20] [--grace_s=10] [--partition_s=3]
//
// `run` drives every scenario against `serve`: it asks the server for fresh regions (a
// read-only source filled with a known pattern, a write target), applies the scenario's fault,
// keeps `window` transfers in flight (READs and WRITEs alternating, each `ops` ops of
// `op_bytes` placed so that none merge, each with a deadline of `deadline_s`), compares every
// byte of every transfer that succeeded (READs here, WRITEs on the server, which also checks
// that each one's notification arrived), clears the fault, reconnects if the peer was lost,
// runs `after` more transfers that must all succeed byte-exact, and finally has both sides
// deregister their regions and report what they still hold. It prints one KVWIRE_NF_XFER line
// per transfer and one KVWIRE_NF_ROW line per scenario, and exits 0 only when every row passes:
//   - every transfer ended (success or error) within its deadline plus `grace_s`;
//   - no transfer that succeeded has a byte that differs from its source;
//   - every WRITE that succeeded had its notification delivered, where the peer survived (a
//     connection the fault killed loses the notifications it still queued: reported, allowed);
//   - after the fault is gone (a healed partition included), `after` transfers succeed without
//     restarting either engine (a reconnect from the same engine is allowed, and reported);
//   - both sides deregister every region (no op still pins one) and hold no transfer, no
//     region, no stale peer and no stale data connection afterwards.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "tests/integration/test_pattern.h"

namespace {

using kvwire::Engine;
using kvwire::EngineOptions;
using kvwire::EngineStats;
using kvwire::InboxEvent;
using kvwire::Op;
using kvwire::OpKind;
using kvwire::PeerId;
using kvwire::RegionId;
using kvwire::RegionOptions;
using kvwire::TransferOptions;
using kvwire::testing::PatternWord;

constexpr char kCtlTopic[] = "nf-ctl";
constexpr char kReplyTopic[] = "nf-reply";
// Region indexes of the pattern: the server's read source, and what the client writes.
constexpr uint64_t kReadPattern = 0;
constexpr uint64_t kWritePattern = 1;

// Fills [dst, dst+length) with the pattern of `region_index` at absolute offsets
// [offset, offset+length) (both multiples of 8): the bytes PatternByte gives, word at a time.
void FillRange(std::byte* dst, uint64_t seed, uint64_t region_index, uint64_t offset,
               uint64_t length) {
  for (uint64_t i = 0; i < length; i += 8) {
    const uint64_t w = PatternWord(seed, region_index, (offset + i) / 8);
    for (int b = 0; b < 8; ++b) dst[i + b] = static_cast<std::byte>((w >> (8 * b)) & 0xff);
  }
}

// Bytes of `actual` that differ from the pattern of `region_index` at `offset`.
uint64_t CountMismatched(const std::byte* actual, uint64_t seed, uint64_t region_index,
                         uint64_t offset, uint64_t length) {
  std::vector<std::byte> expected(length);
  FillRange(expected.data(), seed, region_index, offset, length);
  if (std::memcmp(expected.data(), actual, length) == 0) return 0;
  uint64_t n = 0;
  for (uint64_t i = 0; i < length; ++i) n += expected[i] != actual[i];
  return n;
}

std::map<std::string, std::string> ParseFlags(int argc, char** argv, int first) {
  std::map<std::string, std::string> flags;
  for (int i = first; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2 || kv[0].rfind("--", 0) != 0) {
      std::fprintf(stderr, "bad argument %s (want --key=value)\n", argv[i]);
      std::exit(2);
    }
    flags[kv[0].substr(2)] = kv[1];
  }
  return flags;
}

std::string Flag(std::map<std::string, std::string>& flags, const std::string& key,
                 const std::string& fallback) {
  auto it = flags.find(key);
  if (it == flags.end()) return fallback;
  std::string v = it->second;
  flags.erase(it);
  return v;
}

int64_t IntFlag(std::map<std::string, std::string>& flags, const std::string& key,
                int64_t fallback) {
  const std::string v = Flag(flags, key, "");
  if (v.empty()) return fallback;
  int64_t n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < 0) {
    std::fprintf(stderr, "--%s=%s: not a number >= 0\n", key.c_str(), v.c_str());
    std::exit(2);
  }
  return n;
}

void NoUnknownFlags(const std::map<std::string, std::string>& flags) {
  for (const auto& [k, v] : flags) {
    std::fprintf(stderr, "unknown flag --%s\n", k.c_str());
    std::exit(2);
  }
}

// key=value tokens of a reply (the first token, its verb, is skipped).
std::map<std::string, std::string> ParseReply(const std::string& reply) {
  std::map<std::string, std::string> out;
  for (absl::string_view token : absl::StrSplit(reply, ' ', absl::SkipEmpty())) {
    std::vector<std::string> kv = absl::StrSplit(token, absl::MaxSplits('=', 1));
    if (kv.size() == 2) out[kv[0]] = kv[1];
  }
  return out;
}

uint64_t ListenerConnections(const EngineStats& s) {
  return s.TransportStatValue("tcp_listener", "connections");
}

int AlivePeers(const Engine& engine) {
  int n = 0;
  for (const auto& p : engine.Peers()) n += p.alive;
  return n;
}

// ------------------------------------------------------------------------------------------
// serve

struct ServedScenario {
  std::string name;
  uint64_t seed = 0;
  uint64_t slot_bytes = 0;
  std::unique_ptr<std::byte[]> source;  // READ source, the read pattern
  std::unique_ptr<std::byte[]> target;  // WRITE target, zeroed
  uint64_t bytes = 0;
  RegionId source_id = 0;
  RegionId target_id = 0;
  std::set<uint64_t> notified;  // slots whose WRITE notification arrived
};

class Server {
 public:
  Server(std::unique_ptr<Engine> engine, int lanes) : lanes_(lanes), engine_(std::move(engine)) {}

  int Serve(absl::Duration max_time) {
    auto inbox = engine_->OpenInbox(kCtlTopic);
    if (!inbox.ok()) {
      std::fprintf(stderr, "serve: %s\n", inbox.status().ToString().c_str());
      return 1;
    }
    std::printf("KVWIRE_NF_SERVER listening=%s\n", engine_->address().c_str());
    std::fflush(stdout);
    const absl::Time until = absl::Now() + max_time;
    while (absl::Now() < until) {
      for (const InboxEvent& ev : (*inbox)->Wait(absl::Milliseconds(200))) {
        if (ev.kind != InboxEvent::Kind::kMessage) continue;
        std::string reply = Handle(ev.payload);
        if (reply == "bye") {
          (void)engine_->SendMessage(ev.peer, kReplyTopic, reply);
          absl::SleepFor(absl::Milliseconds(200));
          return 0;
        }
        if (absl::Status s = engine_->SendMessage(ev.peer, kReplyTopic, reply); !s.ok()) {
          std::printf("KVWIRE_NF_SERVER reply lost: %s\n", s.ToString().c_str());
        }
      }
      DrainNotifications();
    }
    std::printf("KVWIRE_NF_SERVER stopping: no quit within %s\n",
                absl::FormatDuration(max_time).c_str());
    return 1;
  }

 private:
  void DrainNotifications() {
    for (const auto& n : engine_->TakeNotifications()) Note(n.payload);
  }
  void Note(const std::string& payload) {
    // "w <scenario> <slot>"
    std::vector<std::string> parts = absl::StrSplit(payload, ' ');
    uint64_t slot = 0;
    if (parts.size() == 3 && parts[0] == "w" && current_ && parts[1] == current_->name &&
        absl::SimpleAtoi(parts[2], &slot)) {
      current_->notified.insert(slot);
    }
  }

  std::string Handle(const std::string& message) {
    std::vector<std::string> w = absl::StrSplit(message, ' ', absl::SkipEmpty());
    if (w.empty()) return "error empty request";
    if (w[0] == "quit") return "bye";
    if (w[0] == "ping") return "pong";
    if (w[0] == "begin" && w.size() == 5) return Begin(w);
    if (w[0] == "end" && w.size() == 3) return End(w);
    return absl::StrCat("error unknown request '", message, "'");
  }

  // begin <scenario> <slots> <slot_bytes> <seed>
  std::string Begin(const std::vector<std::string>& w) {
    if (current_) {  // the client gave up on it (its row failed): let it go
      std::printf("KVWIRE_NF_SERVER scenario %s was never ended; dropping it\n",
                  current_->name.c_str());
      const bool ok = engine_->DeregisterMemory(current_->source_id).ok() &
                      engine_->DeregisterMemory(current_->target_id).ok();
      if (ok) {
        current_.reset();
      } else {
        graveyard_.push_back(std::move(current_));
      }
    }
    auto s = std::make_unique<ServedScenario>();
    s->name = w[1];
    uint64_t slots = 0;
    if (!absl::SimpleAtoi(w[2], &slots) || !absl::SimpleAtoi(w[3], &s->slot_bytes) ||
        !absl::SimpleAtoi(w[4], &s->seed) || slots == 0 || s->slot_bytes % 8 != 0) {
      return "error bad begin";
    }
    s->bytes = slots * s->slot_bytes;
    s->source = std::make_unique<std::byte[]>(s->bytes);
    s->target = std::make_unique<std::byte[]>(s->bytes);  // value-initialised: zeros
    FillRange(s->source.get(), s->seed, kReadPattern, 0, s->bytes);
    RegionOptions ro;
    ro.access = kvwire::kRemoteRead;
    ro.export_to_all_peers = true;
    auto src = engine_->RegisterMemory(s->source.get(), s->bytes, ro);
    if (!src.ok()) return absl::StrCat("error register source: ", src.status().ToString());
    RegionOptions rw;
    rw.export_to_all_peers = true;
    auto dst = engine_->RegisterMemory(s->target.get(), s->bytes, rw);
    if (!dst.ok()) {
      (void)engine_->DeregisterMemory(*src);
      return absl::StrCat("error register target: ", dst.status().ToString());
    }
    s->source_id = *src;
    s->target_id = *dst;
    engine_->PublishMemory();
    current_ = std::move(s);
    return absl::StrCat("begun ", current_->name, " ", current_->source_id, " ",
                        current_->target_id);
  }

  // end <scenario> <comma list of the slots whose WRITE succeeded, or ->
  std::string End(const std::vector<std::string>& w) {
    if (!current_ || current_->name != w[1]) return "error no such scenario open";
    ServedScenario& s = *current_;
    std::vector<uint64_t> slots;
    if (w[2] != "-") {
      for (absl::string_view v : absl::StrSplit(w[2], ',')) {
        uint64_t slot = 0;
        if (!absl::SimpleAtoi(v, &slot) || (slot + 1) * s.slot_bytes > s.bytes) {
          return "error bad slot list";
        }
        slots.push_back(slot);
      }
    }
    // Notifications come after the initiator saw its WRITE succeed: wait (a bounded time) for
    // each one the client says succeeded.
    const absl::Time notify_until = absl::Now() + absl::Seconds(10);
    auto missing = [&] {
      int n = 0;
      for (uint64_t slot : slots) n += !s.notified.contains(slot);
      return n;
    };
    while (missing() > 0 && absl::Now() < notify_until) {
      auto n = engine_->WaitNotification(absl::Milliseconds(100));
      if (n.ok()) Note(n->payload);
    }
    DrainNotifications();
    uint64_t mismatched_bytes = 0;
    std::vector<std::string> mismatched_slots;
    for (uint64_t slot : slots) {
      const uint64_t off = slot * s.slot_bytes;
      const uint64_t bad =
          CountMismatched(s.target.get() + off, s.seed, kWritePattern, off, s.slot_bytes);
      if (bad > 0) {
        mismatched_bytes += bad;
        mismatched_slots.push_back(absl::StrCat(slot));
        std::printf("KVWIRE_NF_SERVER scenario=%s slot=%lu MISMATCH bytes=%lu\n", s.name.c_str(),
                    static_cast<unsigned long>(slot), static_cast<unsigned long>(bad));
      }
    }
    // The source must still hold its pattern (it was exported read-only).
    const uint64_t source_changed =
        CountMismatched(s.source.get(), s.seed, kReadPattern, 0, s.bytes);
    // Deregistration waits for every op that still pins a region (up to 10 s): an error here
    // is a leaked pin. The memory is kept whatever happens (an op may still touch it).
    const absl::Time dereg_start = absl::Now();
    absl::Status d1 = engine_->DeregisterMemory(s.source_id);
    absl::Status d2 = engine_->DeregisterMemory(s.target_id);
    const double dereg_ms = absl::ToDoubleMilliseconds(absl::Now() - dereg_start);
    std::string dereg = "ok";
    if (!d1.ok() || !d2.ok()) {
      dereg = absl::StrCat("FAILED(", d1.ok() ? d2.ToString() : d1.ToString(), ")");
      for (char& c : dereg) {
        if (c == ' ') c = '_';
      }
    }
    // Stale peers and their data connections: one live peer (the client, however often it
    // reconnected) with `lanes` data connections into this engine, once the old ones are
    // noticed gone (within a lease).
    const absl::Time settle_until = absl::Now() + absl::Seconds(12);
    EngineStats st = engine_->Stats();
    int alive = AlivePeers(*engine_);
    while ((alive > 1 || ListenerConnections(st) > static_cast<uint64_t>(lanes_ * alive)) &&
           absl::Now() < settle_until) {
      absl::SleepFor(absl::Milliseconds(100));
      st = engine_->Stats();
      alive = AlivePeers(*engine_);
    }
    const int missing_notifications = missing();
    std::string reply = absl::StrCat(
        "ended ", s.name, " checked=", slots.size(), " mismatched_bytes=", mismatched_bytes,
        " mismatched_slots=", mismatched_slots.empty() ? "-" : absl::StrJoin(mismatched_slots, ","),
        " missing_notifications=", missing_notifications, " source_changed=", source_changed,
        " dereg=", dereg, " dereg_ms=", static_cast<int64_t>(dereg_ms), " regions=", st.regions,
        " alive=", alive, " data_conns=", ListenerConnections(st),
        " tokens=", st.control.session_tokens,
        " in_flight=", st.transfers_started - st.transfers_succeeded - st.transfers_failed);
    std::printf("KVWIRE_NF_SERVER %s\n", reply.c_str());
    std::fflush(stdout);
    if (dereg == "ok") {
      current_.reset();
    } else {
      graveyard_.push_back(std::move(current_));  // an op may still touch the memory
    }
    return reply;
  }

  const int lanes_;
  std::unique_ptr<ServedScenario> current_;
  std::vector<std::unique_ptr<ServedScenario>> graveyard_;
  // Declared last, destroyed first: its regions' memory outlives it.
  std::unique_ptr<Engine> engine_;
};

// ------------------------------------------------------------------------------------------
// run

struct Scenario {
  const char* name;
  const char* netem;  // netem arguments (both ends of the link); the partition's for those
  enum Kind { kSteady, kPartitionHeals, kPartitionForever } kind;
  // The client's engine sets EngineOptions::verify_checksums (the pair then checks every op
  // end to end, docs/CHECKSUMS.md): a corrupted op must fail, never land.
  bool verify = false;
};

// Delays carry 20% jitter (normal distribution); reordering needs a delay to reorder against.
constexpr Scenario kScenarios[] = {
    {"clean", "", Scenario::kSteady},
    {"delay10", "delay 10ms 2ms distribution normal", Scenario::kSteady},
    {"delay50", "delay 50ms 10ms distribution normal", Scenario::kSteady},
    {"loss1", "loss 1%", Scenario::kSteady},
    {"loss10", "loss 10%", Scenario::kSteady},
    {"reorder25", "delay 10ms reorder 25% 50%", Scenario::kSteady},
    {"duplicate1", "duplicate 1%", Scenario::kSteady},
    {"corrupt0.1", "corrupt 0.1%", Scenario::kSteady},
    {"corrupt0.1+verify", "corrupt 0.1%", Scenario::kSteady, /*verify=*/true},
    {"partition3", "loss 100%", Scenario::kPartitionHeals},
    {"partition-forever", "loss 100%", Scenario::kPartitionForever},
};

constexpr Scenario kWarmup = {"warmup", "", Scenario::kSteady};

struct Config {
  std::string server;
  std::string link;
  int transfers = 12;
  int after = 4;
  int window = 4;
  uint64_t ops = 8;
  uint64_t op_bytes = 32768;
  absl::Duration deadline = absl::Seconds(20);
  absl::Duration grace = absl::Seconds(10);
  absl::Duration partition = absl::Seconds(3);
  int lanes = 4;
};

struct Record {
  uint64_t slot = 0;
  OpKind kind = OpKind::kRead;
  const char* phase = "";
  absl::Time submitted;
  // Set by the completion callback (under Client::mu_).
  bool done = false;
  absl::Time ended;
  absl::Status status;
};

struct Row {
  std::string scenario;
  std::string netem;
  int transfers = 0, ok = 0, failed = 0, hung = 0;
  uint64_t compared_bytes = 0;
  uint64_t mismatched_bytes = 0;  // in transfers that succeeded (READs here, WRITEs there)
  int missing_notifications = 0;
  std::map<std::string, int> errors;  // status code name -> count
  std::vector<double> ok_ms;
  double error_max_ms = 0;  // the latest end of a transfer that failed (against its deadline)
  double phase_s = 0;
  bool peer_lost = false;  // the fault closed the peer (seen here after the fault)
  bool reconnected = false;
  std::string close_reason;  // why the lost peer closed (PeerInfo::close_reason)
  int after_ok = 0, after_total = 0;
  // The kernel's counters of both namespaces over the fault phase (nf_link.sh tcpstats): TCP
  // segments retransmitted, segments TCP dropped for a bad checksum, packets IP dropped for a
  // bad header. They show the fault was there (and what TCP caught of a corruption).
  std::map<std::string, int64_t> kernel;
  std::vector<std::string> problems;  // why the row fails

  double MedianMs() const {
    if (ok_ms.empty()) return 0;
    std::vector<double> v = ok_ms;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }
};

// The client's engine, with or without end-to-end checksums.
using EngineFactory = std::function<std::unique_ptr<Engine>(bool verify_checksums)>;

class Client {
 public:
  Client(Config config, EngineFactory make_engine)
      : config_(std::move(config)),
        make_engine_(std::move(make_engine)),
        engine_(make_engine_(false)) {}

  absl::Status Start() {
    auto inbox = engine_->OpenInbox(kReplyTopic);
    if (!inbox.ok()) return inbox.status();
    replies_ = *std::move(inbox);
    return Reconnect(absl::Seconds(60));
  }

  bool RunAll(const std::vector<const Scenario*>& scenarios) {
    // A clean round first, not reported: the first transfers of a run pay for cold caches
    // (and, in the VM, the emulator's translation), which would make the clean row slower
    // than faults measured after it. Its checks still count.
    const Row warmup = RunScenario(kWarmup);
    bool all = warmup.problems.empty();
    if (!all) PrintRow(warmup);
    for (const Scenario* sc : scenarios) {
      Row row = RunScenario(*sc);
      all &= row.problems.empty();
      PrintRow(row);
    }
    auto bye = Request("quit", "bye", absl::Seconds(5));
    if (!bye.ok()) std::printf("KVWIRE_NF_NOTE quit: %s\n", bye.status().ToString().c_str());
    return all;
  }

 private:
  // Dials the server until it answers or `timeout` passes (it may still be starting).
  absl::Status Reconnect(absl::Duration timeout) {
    const absl::Time until = absl::Now() + timeout;
    absl::Status last;
    while (absl::Now() < until) {
      auto p = engine_->Connect(config_.server);
      if (p.ok()) {
        peer_ = *p;
        for (const auto& info : engine_->Peers()) {
          if (info.id == peer_) {
            std::printf("KVWIRE_NF_CONNECTED peer=%lu transport=\"%s\"\n",
                        static_cast<unsigned long>(peer_), info.transport.c_str());
            if (info.transport.rfind("tcp", 0) != 0) {
              return absl::FailedPreconditionError(
                  absl::StrCat("transport is '", info.transport, "', not tcp"));
            }
          }
        }
        return absl::OkStatus();
      }
      last = p.status();
      absl::SleepFor(absl::Milliseconds(500));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("no connection to ", config_.server, ": ", last.ToString()));
  }

  absl::Status SwitchEngine(bool verify) {
    if (peer_ != 0) (void)engine_->Disconnect(peer_);
    replies_.reset();
    engine_.reset();
    engine_ = make_engine_(verify);
    verify_ = verify;
    peer_ = 0;
    std::printf("KVWIRE_NF_NOTE client engine replaced: verify_checksums=%d\n", verify ? 1 : 0);
    return Start();
  }

  bool PeerAlive() const {
    for (const auto& info : engine_->Peers()) {
      if (info.id == peer_) return info.alive;
    }
    return false;
  }

  // Sends `request` and waits for the reply whose verb is `verb` (or an "error ..." reply).
  absl::StatusOr<std::string> Request(const std::string& request, const std::string& verb,
                                      absl::Duration timeout) {
    if (absl::Status s = engine_->SendMessage(peer_, kCtlTopic, request); !s.ok()) return s;
    const absl::Time until = absl::Now() + timeout;
    while (absl::Now() < until) {
      for (const InboxEvent& ev : replies_->Wait(until - absl::Now())) {
        if (ev.kind != InboxEvent::Kind::kMessage || ev.peer != peer_) continue;
        if (ev.payload.rfind(verb, 0) == 0) return ev.payload;
        if (ev.payload.rfind("error", 0) == 0) return absl::InternalError(ev.payload);
      }
    }
    return absl::DeadlineExceededError(absl::StrCat("no reply to '", request.substr(0, 40),
                                                    "' within ", absl::FormatDuration(timeout)));
  }

  int Link(const std::string& args) {
    const std::string cmd = absl::StrCat(config_.link, " ", args);
    // Wall-clock time, as the engine's log lines show it.
    std::printf("KVWIRE_NF_LINK %s %s\n",
                absl::FormatTime("%H:%M:%E6S", absl::Now(), absl::UTCTimeZone()).c_str(),
                args.c_str());
    std::fflush(stdout);
    const int rc = std::system(cmd.c_str());
    if (rc != 0) std::printf("KVWIRE_NF_LINK failed rc=%d: %s\n", rc, cmd.c_str());
    std::fflush(stdout);
    return rc;
  }

  // nf_link.sh tcpstats, parsed ("retrans=N csum_errors=N ip_hdr_errors=N").
  std::map<std::string, int64_t> KernelCounters() {
    std::map<std::string, int64_t> out;
    const std::string cmd = absl::StrCat(config_.link, " tcpstats");
    FILE* f = popen(cmd.c_str(), "r");
    if (f == nullptr) return out;
    char buf[256] = {};
    const bool got = std::fgets(buf, sizeof(buf), f) != nullptr;
    pclose(f);
    if (!got) return out;
    for (const auto& [k, v] : ParseReply(absl::StrCat("counters ", buf))) {
      int64_t n = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &n)) out[k] = n;
    }
    return out;
  }

  uint64_t SlotBytes() const { return config_.ops * config_.op_bytes; }
  // Op k of a slot: in order locally, in reverse order remotely (so that no two merge).
  uint64_t LocalOffset(uint64_t slot, uint64_t k) const {
    return slot * SlotBytes() + k * config_.op_bytes;
  }
  uint64_t RemoteOffset(uint64_t slot, uint64_t k) const {
    return slot * SlotBytes() + (config_.ops - 1 - k) * config_.op_bytes;
  }

  Record* Submit(uint64_t slot, OpKind kind, const char* phase) {
    records_.push_back(std::make_unique<Record>());
    Record* r = records_.back().get();
    r->slot = slot;
    r->kind = kind;
    r->phase = phase;
    std::vector<Op> ops;
    for (uint64_t k = 0; k < config_.ops; ++k) {
      Op op;
      op.local_region = kind == OpKind::kRead ? local_read_ : local_write_;
      op.local_offset = LocalOffset(slot, k);
      op.remote_region = kind == OpKind::kRead ? remote_source_ : remote_target_;
      op.remote_offset = RemoteOffset(slot, k);
      op.length = config_.op_bytes;
      ops.push_back(op);
    }
    TransferOptions t;
    t.timeout = config_.deadline;
    if (kind == OpKind::kWrite) t.notification = absl::StrCat("w ", scenario_, " ", slot);
    t.on_complete = [this, r](kvwire::TransferId, const absl::Status& s) {
      absl::MutexLock lock(&mu_);
      r->status = s;
      r->ended = absl::Now();
      r->done = true;
      cv_.SignalAll();
    };
    r->submitted = absl::Now();
    auto id = engine_->Transfer(peer_, kind, ops, t);
    if (!id.ok()) {  // refused at once (e.g. the peer is closed): it ended, with that error
      absl::MutexLock lock(&mu_);
      if (!r->done) {
        r->status = id.status();
        r->ended = absl::Now();
        r->done = true;
      }
    }
    return r;
  }

  // A transfer that ended: compares a READ's bytes, remembers a WRITE that succeeded (its
  // bytes are compared by the server), and prints its line.
  void Finish(const Record& r, Row* row, bool after) {
    const double ms = absl::ToDoubleMilliseconds(r.ended - r.submitted);
    uint64_t bad = 0;
    if (r.status.ok()) {
      if (r.kind == OpKind::kRead) {
        for (uint64_t k = 0; k < config_.ops; ++k) {
          bad += CountMismatched(read_buf_ + LocalOffset(r.slot, k), seed_, kReadPattern,
                                 RemoteOffset(r.slot, k), config_.op_bytes);
        }
        row->compared_bytes += SlotBytes();
        row->mismatched_bytes += bad;
      } else {
        written_slots_.push_back(r.slot);
      }
    }
    if (after) {
      ++row->after_total;
      row->after_ok += r.status.ok() && bad == 0;
    } else {
      ++row->transfers;
      if (r.status.ok()) {
        ++row->ok;
        row->ok_ms.push_back(ms);
      } else {
        ++row->failed;
        ++row->errors[absl::StatusCodeToString(r.status.code())];
        row->error_max_ms = std::max(row->error_max_ms, ms);
      }
    }
    std::string why(r.status.message().substr(0, 160));
    for (char& c : why) {
      if (c == '"') c = '\'';
    }
    std::printf(
        "KVWIRE_NF_XFER scenario=%s phase=%s slot=%lu kind=%s status=%s ms=%.1f bytes=%lu "
        "mismatched=%s%s%s%s\n",
        scenario_.c_str(), r.phase, static_cast<unsigned long>(r.slot),
        r.kind == OpKind::kRead ? "read" : "write",
        r.status.ok() ? "ok" : absl::StatusCodeToString(r.status.code()).c_str(), ms,
        static_cast<unsigned long>(SlotBytes()),
        !r.status.ok() ? "n/a" : (r.kind == OpKind::kWrite ? "server" : absl::StrCat(bad).c_str()),
        r.status.ok() ? "" : " why=\"", why.c_str(), r.status.ok() ? "" : "\"");
    std::fflush(stdout);
  }

  // Runs `count` transfers from slot `first`, `window` at a time. With `partition_after`
  // >= 0, starts the partition once that many have ended, and submits nothing more until it
  // is in place: the rest go into the partitioned link (and are in flight when it heals).
  void RunPhase(const char* phase, uint64_t first, int count, Row* row, int partition_after,
                const Scenario& sc, std::thread* partition) {
    const bool after = std::string(phase) == "after";
    {
      absl::MutexLock lock(&mu_);
      partition_applied_ = false;
    }
    std::vector<Record*> inflight;
    int next = 0, ended = 0;
    bool applied = false;
    while (next < count || !inflight.empty()) {
      const bool hold = partition->joinable() && !applied;  // started, not in place yet
      while (!hold && next < count && static_cast<int>(inflight.size()) < config_.window) {
        inflight.push_back(
            Submit(first + next, next % 2 == 0 ? OpKind::kRead : OpKind::kWrite, phase));
        ++next;
      }
      absl::Time hang_at = absl::Now() + config_.deadline + config_.grace;  // when holding
      for (const Record* r : inflight) {
        hang_at = std::min(hang_at, r->submitted + config_.deadline + config_.grace);
      }
      std::vector<Record*> finished;
      {
        absl::MutexLock lock(&mu_);
        auto wake = [&] {
          return (hold && partition_applied_) ||
                 std::any_of(inflight.begin(), inflight.end(), [](Record* r) { return r->done; });
        };
        while (!wake() && absl::Now() < hang_at) cv_.WaitWithDeadline(&mu_, hang_at);
        if (hold && partition_applied_) {
          applied = true;
          int pending = 0;
          for (const Record* r : inflight) pending += !r->done;
          std::printf(
              "KVWIRE_NF_NOTE %s: partition in place with %d transfers in flight, %d "
              "more to submit into it\n",
              scenario_.c_str(), pending, count - next);
        }
        for (auto it = inflight.begin(); it != inflight.end();) {
          if ((*it)->done) {
            finished.push_back(*it);
            it = inflight.erase(it);
          } else if (absl::Now() >= (*it)->submitted + config_.deadline + config_.grace) {
            // Still pending past its deadline and the grace: a hang. It stays in records_
            // (its callback may still come, until ~Engine).
            ++row->hung;
            std::printf("KVWIRE_NF_XFER scenario=%s phase=%s slot=%lu status=HUNG\n",
                        scenario_.c_str(), phase, static_cast<unsigned long>((*it)->slot));
            row->problems.push_back(
                absl::StrCat("slot ", (*it)->slot, " did not end within deadline+grace"));
            it = inflight.erase(it);
          } else {
            ++it;
          }
        }
      }
      if (hold && !applied && inflight.empty() && absl::Now() >= hang_at) {
        row->problems.push_back("the partition was not in place within deadline+grace");
        applied = true;  // submit the rest anyway
      }
      for (Record* r : finished) {
        Finish(*r, row, after);
        ++ended;
      }
      if (partition_after >= 0 && ended >= partition_after && !partition->joinable()) {
        const bool heals = sc.kind == Scenario::kPartitionHeals;
        *partition = std::thread([this, sc, heals] {
          const int rc = Link(absl::StrCat("set ", sc.netem));
          {
            absl::MutexLock lock(&mu_);
            partition_applied_ = true;
            partition_failed_ = rc != 0;
            cv_.SignalAll();
          }
          if (heals) {
            absl::SleepFor(config_.partition);
            Link("show");  // what the partition dropped
            Link("clear");
          }
        });
      }
    }
  }

  Row RunScenario(const Scenario& sc) {
    Row row;
    row.scenario = sc.name;
    row.netem =
        sc.kind == Scenario::kSteady
            ? sc.netem
            : absl::StrCat(sc.netem,
                           sc.kind == Scenario::kPartitionHeals
                               ? absl::StrCat(" for ", absl::FormatDuration(config_.partition))
                               : " for good");
    if (sc.verify != verify_) {
      // A fresh client engine that asks for checksums (or no longer does); the server's stays.
      if (absl::Status s = SwitchEngine(sc.verify); !s.ok()) {
        row.problems.push_back(absl::StrCat("switching the client engine: ", s.ToString()));
        return row;
      }
    }
    scenario_ = sc.name;
    seed_ = ++scenario_count_ * 1000003ull;
    written_slots_.clear();
    std::printf("KVWIRE_NF_SCENARIO %s netem=\"%s\"\n", sc.name, row.netem.c_str());
    std::fflush(stdout);
    if (Link("clear") != 0) row.problems.push_back("could not clear the link");
    if (!PeerAlive()) {
      if (absl::Status s = Reconnect(absl::Seconds(30)); !s.ok()) {
        row.problems.push_back(absl::StrCat("no peer before the scenario: ", s.ToString()));
        return row;
      }
    }
    const uint64_t slots = config_.transfers + config_.after;
    auto begun = Request(absl::StrCat("begin ", sc.name, " ", slots, " ", SlotBytes(), " ", seed_),
                         "begun", absl::Seconds(20));
    std::vector<std::string> b;
    if (begun.ok()) {
      std::vector<std::string> words = absl::StrSplit(*begun, ' ');
      b = std::move(words);
    }
    if (!begun.ok() || b.size() != 4 || !absl::SimpleAtoi(b[2], &remote_source_) ||
        !absl::SimpleAtoi(b[3], &remote_target_)) {
      row.problems.push_back(
          absl::StrCat("begin: ", begun.ok() ? *begun : begun.status().ToString()));
      return row;
    }
    if (!WaitRemote(&row)) return row;
    const uint64_t bytes = slots * SlotBytes();
    auto read_buf = std::make_unique<std::byte[]>(bytes);
    auto write_buf = std::make_unique<std::byte[]>(bytes);
    std::memset(read_buf.get(), 0xee, bytes);
    for (uint64_t slot = 0; slot < slots; ++slot) {
      for (uint64_t k = 0; k < config_.ops; ++k) {
        FillRange(write_buf.get() + LocalOffset(slot, k), seed_, kWritePattern,
                  RemoteOffset(slot, k), config_.op_bytes);
      }
    }
    read_buf_ = read_buf.get();
    auto lr = engine_->RegisterMemory(read_buf.get(), bytes);
    auto lw = engine_->RegisterMemory(write_buf.get(), bytes);
    if (!lr.ok() || !lw.ok()) {
      row.problems.push_back("registering local memory failed");
      return row;
    }
    local_read_ = *lr;
    local_write_ = *lw;

    // The fault.
    const std::map<std::string, int64_t> kernel_before = KernelCounters();
    if (sc.kind == Scenario::kSteady && *sc.netem != '\0' &&
        Link(absl::StrCat("set ", sc.netem)) != 0) {
      row.problems.push_back("the fault could not be applied");
    }
    std::thread partition;
    const int partition_after =
        sc.kind == Scenario::kSteady ? -1 : std::max(1, config_.transfers / 4);
    const absl::Time phase_start = absl::Now();
    RunPhase("fault", 0, config_.transfers, &row, partition_after, sc, &partition);
    row.phase_s = absl::ToDoubleSeconds(absl::Now() - phase_start);
    const bool partitioned = partition.joinable();
    if (partitioned) partition.join();  // a healing partition has healed
    if (sc.kind != Scenario::kSteady && !partitioned) {
      row.problems.push_back("the partition never started");
    }
    {
      absl::MutexLock lock(&mu_);
      if (partitioned && partition_failed_) row.problems.push_back("the partition failed");
    }
    // A partition that never heals must end the peer (lease) and fail what went into it; if
    // not, the fault was not there.
    if (sc.kind == Scenario::kPartitionForever && (PeerAlive() || row.failed == 0)) {
      row.problems.push_back("the peer and its transfers survived a partition that never heals");
    }
    for (const auto& [k, v] : KernelCounters()) {
      auto it = kernel_before.find(k);
      row.kernel[k] = v - (it == kernel_before.end() ? 0 : it->second);
    }
    Link("show");
    if (Link("clear") != 0) row.problems.push_back("could not clear the link");

    // After the fault: the same engines (reconnected if the fault closed the peer) move bytes.
    row.peer_lost = !PeerAlive();
    if (!row.peer_lost) {
      // The peer may look alive here and be gone there (or be half-open): ask it.
      auto pong = Request("ping", "pong", absl::Seconds(12));
      if (!pong.ok()) {
        std::printf("KVWIRE_NF_NOTE %s: no pong after the fault (%s); alive=%d\n", sc.name,
                    pong.status().ToString().c_str(), PeerAlive());
        row.peer_lost = true;
        if (PeerAlive()) {
          row.problems.push_back("peer unresponsive but still alive after the lease");
          (void)engine_->Disconnect(peer_);
        }
      }
    }
    if (row.peer_lost) {
      for (const auto& info : engine_->Peers()) {
        if (info.id == peer_) row.close_reason = info.close_reason;
      }
      if (absl::Status s = Reconnect(absl::Seconds(30)); !s.ok()) {
        row.problems.push_back(absl::StrCat("reconnect failed: ", s.ToString()));
      } else {
        row.reconnected = true;
        WaitRemote(&row);
      }
    }
    std::thread none;
    RunPhase("after", config_.transfers, config_.after, &row, -1, sc, &none);
    if (row.after_ok != config_.after) {
      row.problems.push_back(
          absl::StrCat("after the fault ", row.after_ok, "/", config_.after, " succeeded"));
    }

    // Both sides let go of everything.
    std::vector<std::string> ws;
    for (uint64_t s : written_slots_) ws.push_back(absl::StrCat(s));
    auto ended =
        Request(absl::StrCat("end ", sc.name, " ", ws.empty() ? "-" : absl::StrJoin(ws, ",")),
                "ended", absl::Seconds(45));
    if (!ended.ok()) {
      row.problems.push_back(absl::StrCat("end: ", ended.status().ToString()));
    } else {
      std::map<std::string, std::string> e = ParseReply(*ended);
      uint64_t n = 0;
      if (absl::SimpleAtoi(e["mismatched_bytes"], &n)) row.mismatched_bytes += n;
      row.compared_bytes += written_slots_.size() * SlotBytes();
      int missing = 0;
      if (absl::SimpleAtoi(e["missing_notifications"], &missing))
        row.missing_notifications = missing;
      auto expect = [&](const char* key, const std::string& want) {
        if (e[key] != want) {
          row.problems.push_back(absl::StrCat("server ", key, "=", e[key], " (want ", want, ")"));
        }
      };
      expect("checked", absl::StrCat(written_slots_.size()));
      expect("source_changed", "0");
      expect("dereg", "ok");
      expect("regions", "0");
      expect("alive", "1");
      expect("data_conns", absl::StrCat(config_.lanes));
      expect("in_flight", "0");
      // A WRITE succeeds once its data is acknowledged and its notification is queued on the
      // control connection (engine.h); a connection that the fault then kills loses what it
      // still queued. So a lost notification fails the row only where the peer survived.
      if (missing > 0 && !row.peer_lost) {
        row.problems.push_back(absl::StrCat(
            missing, " WRITE notifications never arrived although the connection survived"));
      }
    }
    if (row.mismatched_bytes > 0) {
      row.problems.push_back(
          absl::StrCat(row.mismatched_bytes, " bytes differ in transfers that succeeded"));
    }
    absl::Status d1 = engine_->DeregisterMemory(local_read_);
    absl::Status d2 = engine_->DeregisterMemory(local_write_);
    if (!d1.ok() || !d2.ok()) {
      row.problems.push_back(
          absl::StrCat("local deregister: ", d1.ok() ? d2.ToString() : d1.ToString()));
      keep_.push_back(std::move(read_buf));  // an op may still touch them
      keep_.push_back(std::move(write_buf));
    }
    read_buf_ = nullptr;
    // This side: no region, no transfer, one live peer and its data connections.
    const absl::Time settle_until = absl::Now() + absl::Seconds(12);
    EngineStats st = engine_->Stats();
    while ((AlivePeers(*engine_) != 1 ||
            ListenerConnections(st) != static_cast<uint64_t>(config_.lanes)) &&
           absl::Now() < settle_until) {
      absl::SleepFor(absl::Milliseconds(100));
      st = engine_->Stats();
    }
    const uint64_t in_flight = st.transfers_started - st.transfers_succeeded - st.transfers_failed;
    std::printf("KVWIRE_NF_CLIENT scenario=%s regions=%lu in_flight=%lu alive=%d data_conns=%lu\n",
                sc.name, static_cast<unsigned long>(st.regions),
                static_cast<unsigned long>(in_flight), AlivePeers(*engine_),
                static_cast<unsigned long>(ListenerConnections(st)));
    if (st.regions != 0) row.problems.push_back(absl::StrCat("client regions=", st.regions));
    if (in_flight != 0) row.problems.push_back(absl::StrCat("client in_flight=", in_flight));
    if (AlivePeers(*engine_) != 1) {
      row.problems.push_back(absl::StrCat("client alive peers=", AlivePeers(*engine_)));
    }
    if (ListenerConnections(st) != static_cast<uint64_t>(config_.lanes)) {
      row.problems.push_back(absl::StrCat("client data_conns=", ListenerConnections(st)));
    }
    return row;
  }

  bool WaitRemote(Row* row) {
    for (RegionId r : {remote_source_, remote_target_}) {
      if (absl::Status s = engine_->WaitForRemoteRegion(peer_, r, absl::Seconds(10)); !s.ok()) {
        row->problems.push_back(absl::StrCat("remote region ", r, ": ", s.ToString()));
        return false;
      }
    }
    return true;
  }

  static std::string Counter(const Row& row, const std::string& key) {
    auto it = row.kernel.find(key);
    return it == row.kernel.end() ? "?" : absl::StrCat(it->second);
  }

  void PrintRow(const Row& row) {
    std::vector<std::string> errors;
    for (const auto& [code, n] : row.errors) errors.push_back(absl::StrCat(code, ":", n));
    std::string problems = absl::StrJoin(row.problems, "; ");
    std::string close_reason = row.close_reason.substr(0, 300);
    for (std::string* text : {&problems, &close_reason}) {
      for (char& c : *text) {
        if (c == '"') c = '\'';
      }
    }
    double max_ms = 0;
    for (double ms : row.ok_ms) max_ms = std::max(max_ms, ms);
    const std::string line = absl::StrCat(
        "KVWIRE_NF_ROW scenario=", row.scenario, " netem=\"", row.netem,
        "\" transfers=", row.transfers, " ok=", row.ok, " failed=", row.failed, " hung=", row.hung,
        " errors=", errors.empty() ? "-" : absl::StrJoin(errors, ","),
        " compared_bytes=", row.compared_bytes, " mismatched_bytes=", row.mismatched_bytes,
        " missing_notifications=", row.missing_notifications,
        " p50_ms=", absl::StrFormat("%.1f", row.MedianMs()),
        " max_ms=", absl::StrFormat("%.1f", max_ms),
        " error_max_ms=", absl::StrFormat("%.1f", row.error_max_ms),
        " phase_s=", absl::StrFormat("%.2f", row.phase_s), " peer_lost=", row.peer_lost ? 1 : 0,
        " reconnected=", row.reconnected ? 1 : 0, " after=", row.after_ok, "/", row.after_total,
        " tcp_retrans=", Counter(row, "retrans"), " tcp_csum_errors=", Counter(row, "csum_errors"),
        " ip_hdr_errors=", Counter(row, "ip_hdr_errors"), " close_reason=\"", close_reason,
        "\" verdict=", row.problems.empty() ? "PASS" : "FAIL", " problems=\"", problems, "\"");
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

  const Config config_;
  const EngineFactory make_engine_;
  bool verify_ = false;
  // Declared before the engine, destroyed after it (callbacks may reach them until ~Engine).
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::vector<std::unique_ptr<Record>> records_;
  std::vector<std::unique_ptr<std::byte[]>> keep_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<kvwire::Inbox> replies_;
  PeerId peer_ = 0;
  std::string scenario_;
  uint64_t scenario_count_ = 0;
  uint64_t seed_ = 0;
  RegionId remote_source_ = 0, remote_target_ = 0;
  RegionId local_read_ = 0, local_write_ = 0;
  std::byte* read_buf_ = nullptr;
  std::vector<uint64_t> written_slots_;
  bool partition_applied_ ABSL_GUARDED_BY(mu_) = false;
  bool partition_failed_ ABSL_GUARDED_BY(mu_) = false;
};

std::unique_ptr<Engine> MakeEngine(const std::string& name, const std::string& listen, int lanes,
                                   bool verify_checksums = false) {
  EngineOptions o;
  o.verify_checksums = verify_checksums;
  o.name = name;
  o.listen_address = listen;
  // Both namespaces share one kernel: kAuto would take shm (or rdma, on the VM's rxe).
  o.transport = "tcp";
  o.tcp().connections = lanes;
  auto engine = Engine::Create(o);
  if (!engine.ok()) {
    std::fprintf(stderr, "engine %s: %s\n", name.c_str(), engine.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(engine);
}

int Usage() {
  std::fprintf(stderr,
               "usage: kvwire_netfault serve --listen=HOST:PORT [--max_seconds=N]\n"
               "       kvwire_netfault run --server=HOST:PORT --listen=HOST:0 --link=SCRIPT\n"
               "           --scenarios=a,b,... [--transfers=N --after=N --window=N --ops=N\n"
               "            --op_bytes=N --deadline_s=N --grace_s=N --partition_s=N]\n"
               "scenarios:");
  for (const Scenario& s : kScenarios) std::fprintf(stderr, " %s", s.name);
  std::fprintf(stderr, "\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage();
  const std::string role = argv[1];
  std::map<std::string, std::string> flags = ParseFlags(argc, argv, 2);
  const int lanes = 4;
  if (role == "serve") {
    const std::string listen = Flag(flags, "listen", "");
    const int64_t max_s = IntFlag(flags, "max_seconds", 3600);
    NoUnknownFlags(flags);
    if (listen.empty()) return Usage();
    Server server(MakeEngine("nf-server", listen, lanes), lanes);
    return server.Serve(absl::Seconds(max_s));
  }
  if (role != "run") return Usage();
  Config c;
  c.server = Flag(flags, "server", "");
  const std::string listen = Flag(flags, "listen", "");
  c.link = Flag(flags, "link", "");
  const std::string names = Flag(flags, "scenarios", "");
  c.transfers = static_cast<int>(IntFlag(flags, "transfers", c.transfers));
  c.after = static_cast<int>(IntFlag(flags, "after", c.after));
  c.window = static_cast<int>(IntFlag(flags, "window", c.window));
  c.ops = IntFlag(flags, "ops", c.ops);
  c.op_bytes = IntFlag(flags, "op_bytes", c.op_bytes);
  c.deadline = absl::Seconds(IntFlag(flags, "deadline_s", 20));
  c.grace = absl::Seconds(IntFlag(flags, "grace_s", 10));
  c.partition = absl::Seconds(IntFlag(flags, "partition_s", 3));
  c.lanes = lanes;
  NoUnknownFlags(flags);
  if (c.server.empty() || listen.empty() || c.link.empty() || names.empty() || c.window < 1 ||
      c.transfers < 4 || c.after < 1 || c.ops < 1 || c.op_bytes == 0 || c.op_bytes % 8 != 0) {
    return Usage();
  }
  std::vector<const Scenario*> scenarios;
  for (absl::string_view name : absl::StrSplit(names, ',', absl::SkipEmpty())) {
    const Scenario* found = nullptr;
    for (const Scenario& s : kScenarios) {
      if (name == s.name) found = &s;
    }
    if (found == nullptr) {
      std::fprintf(stderr, "unknown scenario %s\n", std::string(name).c_str());
      return Usage();
    }
    scenarios.push_back(found);
  }
  Client client(c, [&](bool verify) {
    return MakeEngine(verify ? "nf-client-verify" : "nf-client", listen, lanes, verify);
  });
  if (absl::Status s = client.Start(); !s.ok()) {
    std::printf("KVWIRE_NF_FATAL %s\n", s.ToString().c_str());
    return 1;
  }
  const bool all = client.RunAll(scenarios);
  std::printf("KVWIRE_NF_DONE %s\n", all ? "PASS" : "FAIL");
  std::fflush(stdout);
  return all ? 0 : 1;
}

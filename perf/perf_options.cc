#include "perf/perf_options.h"

#include <algorithm>
#include <functional>
#include <getopt.h>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#include "src/gpu/runtime.h"

namespace kvwire::perf {
namespace {

absl::Status Bad(const std::string& option, const std::string& value, const std::string& want) {
  return absl::InvalidArgumentError(
      absl::StrCat("option ", option, ": \"", value, "\" is not ", want));
}

// Accepts "65536", "64K", "64KiB", "1M", "4MiB", "1G".
bool ParseBytes(std::string text, uint64_t* out) {
  uint64_t scale = 1;
  absl::string_view v = text;
  absl::ConsumeSuffix(&v, "iB") || absl::ConsumeSuffix(&v, "B");
  if (!v.empty()) {
    switch (v.back()) {
      case 'K':
      case 'k':
        scale = 1ull << 10;
        break;
      case 'M':
      case 'm':
        scale = 1ull << 20;
        break;
      case 'G':
      case 'g':
        scale = 1ull << 30;
        break;
      default:
        break;
    }
    if (scale != 1) v.remove_suffix(1);
  }
  uint64_t n = 0;
  if (!absl::SimpleAtoi(v, &n)) return false;
  *out = n * scale;
  return true;
}

template <typename T>
absl::Status ParseInt(const std::string& option, const std::string& value, T min, T max, T* out) {
  T n{};
  if (!absl::SimpleAtoi(value, &n) || n < min || n > max) {
    return Bad(option, value, absl::StrCat("an integer in [", min, ", ", max, "]"));
  }
  *out = n;
  return absl::OkStatus();
}

std::string FormatDouble(double v) { return absl::StrCat(v); }

// GPU memory needs the build's runtime to be the one asked for; the device itself is checked
// when the buffer is allocated (the runtime's own error then).
absl::Status ValidateGpu(const PerfOptions& o) {
  const std::string flag = o.gpu_api.empty() ? "--memory gpu" : absl::StrCat("--use_", o.gpu_api);
  const gpu::Backend backend = gpu::DefaultRuntime().backend();
  if (backend != gpu::Backend::kCuda && backend != gpu::Backend::kHip) {
    return absl::UnimplementedError(absl::StrCat(
        flag, ": this build has no GPU runtime (configure with -DKVWIRE_GPU=cuda or hip)"));
  }
  const gpu::Backend want = o.gpu_api == "cuda"   ? gpu::Backend::kCuda
                            : o.gpu_api == "rocm" ? gpu::Backend::kHip
                                                  : backend;
  if (want != backend) {
    return absl::UnimplementedError(absl::StrCat(flag, ": this build's GPU runtime is ",
                                                 gpu::BackendName(backend), ", not ",
                                                 gpu::BackendName(want)));
  }
  if (o.check) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag,
                     " and --check exclude each other (the check reads the buffers on "
                     "the host)"));
  }
  if (o.workload == Workload::kKv) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " applies to --workload raw only"));
  }
  return absl::OkStatus();
}

absl::Status Validate(const PerfOptions& o) {
  if (o.memory == MemoryKind::kGpu) {
    if (absl::Status s = ValidateGpu(o); !s.ok()) return s;
  }
  if (o.bidirectional && o.check) {
    return absl::InvalidArgumentError(
        "-b (bidirectional) and --check exclude each other (both directions share the buffers)");
  }
  if (o.bidirectional && o.workload == Workload::kKv) {
    return absl::InvalidArgumentError("-b (bidirectional) applies to --workload raw only");
  }
  if ((!o.device.empty() || o.gid_index >= 0) && o.transport != TransportKind::kRdma) {
    return absl::InvalidArgumentError(
        "-d (device) and -x (GID index) apply to the rdma transport only: add --transport rdma");
  }
  if (o.iterations > 0 && o.duration_s > 0) {
    return absl::InvalidArgumentError("-n (iterations) and -D (seconds) exclude each other");
  }
  if (!o.dump_ranges_file.empty() && o.workload != Workload::kKv) {
    return absl::InvalidArgumentError("--dump-ranges applies to --workload kv only");
  }
  if (o.all_sizes && o.workload == Workload::kKv) {
    return absl::InvalidArgumentError("-a (all sizes) applies to --workload raw only");
  }
  if (o.pattern == Pattern::kPool) {
    const uint64_t largest = o.all_sizes ? kMaxAllSize : o.size;
    const uint64_t slots = (o.pool_mib << 20) / largest;
    if (slots < static_cast<uint64_t>(o.threads)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--pool-mib ", o.pool_mib, " holds fewer than one ", largest, "-byte block per thread"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* OpName(OpKind op) { return op == OpKind::kRead ? "READ" : "WRITE"; }
const char* PatternName(Pattern p) { return p == Pattern::kHot ? "hot" : "pool"; }
const char* WorkloadName(Workload w) { return w == Workload::kRaw ? "raw" : "kv"; }

std::vector<uint64_t> PerfOptions::Sizes() const {
  if (!all_sizes) return {size};
  std::vector<uint64_t> sizes;
  for (uint64_t s = kMinAllSize; s <= kMaxAllSize; s *= 2) sizes.push_back(s);
  return sizes;
}

uint64_t PerfOptions::IterationsFor(uint64_t bytes) const {
  if (iterations > 0) return iterations;
  // About 2 GiB per size, between 200 and 20000 ops.
  return std::clamp<uint64_t>((2ull << 30) / std::max<uint64_t>(1, bytes), 200, 20000);
}

uint64_t PerfOptions::WarmupFor(uint64_t iters) const {
  if (warmup >= 0) return static_cast<uint64_t>(warmup);
  const uint64_t window = static_cast<uint64_t>(batch) * outstanding * 2;
  return std::max<uint64_t>(window, iters / 20);
}

std::string UsageText() {
  return R"(usage: kvwire-perf [options]          target (server): waits for one initiator
       kvwire-perf [options] HOST     initiator (client): runs the test against HOST

Both sides take the same test options; they are compared at connect time.
  -o, --op read|write          one-sided operation (default write)
      --transport T            rdma|tcp|shm|auto (default auto: shm on one host, else tcp)
      --workload raw|kv        raw messages (default) or whole requests' KV (kv)
  -s, --size BYTES             bytes per op, e.g. 65536, 64K, 4M (default 64K)
  -a, --all                    every size 2^k from 4 KiB to 64 MiB
  -b, --bidirectional          data both ways at once: every other transfer is the opposite
                               operation; bandwidth counts both directions
  -l, --post_list N            ops per transfer (default 1)
  -n, --iters N                ops per thread and size (default: about 2 GiB, 200..20000)
  -D, --duration SECONDS       run each size for this long instead of -n
  -w, --warmup N               warm-up ops per thread and size (default: 2 windows or n/20)
  -q, --qps N                  tcp connections (rdma QPs) per peer (default: engine's, 4)
  -t, --tx-depth N             transfers outstanding per thread (default 8)
  -T, --threads N              initiator threads sharing one engine (default 1)
  -d, --ib-dev DEV[,DEV]       rdma device(s) (rdma only)
  -x, --gid-index N            rdma GID index (rdma only)
      --memory host|gpu        memory kind on both sides (default host)
      --use_cuda=N             GPU memory of CUDA device N (a CUDA build; raw workload)
      --use_rocm=N             GPU memory of ROCm device N (a HIP build; raw workload)
      --pattern hot|pool       hot: one buffer reused; pool: blocks in random order over a
                               large pool on each side (default hot)
      --pool-mib N             pool per side for --pattern pool, and the least the kv
                               workload backs its layout with (default 1024)
      --check                  fill sources with a position-dependent pattern, clear the
                               destinations, and compare every byte moved after each size
      --verify-checksums       both engines check every op end to end (CRC32C,
                               EngineOptions::verify_checksums): measures its cost
      --layout NAME            kv: dsv4-pro|dsv4-flash|v3-mla|mha (default dsv4-pro)
      --prompt TOKENS          kv: prompt length (default 8192)
      --frag SHARE             kv: share of blocks not next to the previous one (default 0.5)
      --requests N             kv: requests in flight (default 4)
      --json FILE, --csv FILE  also write the results there
      --dump-ranges FILE       kv: write one request's byte ranges (the plan's, merged where
                               contiguous on both sides) to FILE and exit: no engine, no peer
      --report_gbits           bandwidth in Gb/s instead of GB/s (both decimal)
  -F, --CPU-freq               accepted for perftest's command lines (kvwire-perf never
                               warns about CPU frequency scaling)
  -p, --port N                 side-channel TCP port (default 18515; 0 on the target: any)
      --bind ADDR              target: address to listen on (default 127.0.0.1; the side
                               channel is unauthenticated: give 0.0.0.0 or a NIC's address
                               only on a trusted network, for a run across hosts)
      --side-timeout SECONDS   longest wait for a side-channel line, a whole run included
                               (default 600)
      --secret-file FILE       the engines' shared secret, from FILE (mode 600); both sides
                               need the same one (default: KVWIRE_SECRET, if set)
      --secret S               the same on the command line (visible to local users: prefer
                               --secret-file)
  -h, --help
Short options take attached values (-s65536) and long ones --name=value or --name value.
Bandwidth is decimal: 1 GB/s = 1e9 bytes/s.
)";
}

absl::StatusOr<PerfOptions> ParsePerfOptions(int argc, const char* const* argv) {
  PerfOptions o;
  bool size_given = false;
  using Handler = std::function<absl::Status(const std::string& option, const std::string& v)>;
  struct Spec {
    std::vector<std::string> names;
    bool takes_value;
    Handler handle;
  };
  const std::vector<Spec> specs = {
      {{"-o", "--op"},
       true,
       [&](const std::string& n, const std::string& v) {
         if (v == "read") {
           o.op = OpKind::kRead;
         } else if (v == "write") {
           o.op = OpKind::kWrite;
         } else {
           return Bad(n, v, "read or write");
         }
         return absl::OkStatus();
       }},
      {{"--transport"},
       true,
       [&](const std::string& n, const std::string& v) {
         auto kind = ParseTransportKind(v);
         if (!kind.ok()) return Bad(n, v, "rdma, tcp, shm or auto");
         o.transport = *kind;
         return absl::OkStatus();
       }},
      {{"--workload"},
       true,
       [&](const std::string& n, const std::string& v) {
         if (v == "raw") {
           o.workload = Workload::kRaw;
         } else if (v == "kv") {
           o.workload = Workload::kKv;
         } else {
           return Bad(n, v, "raw or kv");
         }
         return absl::OkStatus();
       }},
      {{"-s", "--size"},
       true,
       [&](const std::string& n, const std::string& v) {
         if (!ParseBytes(v, &o.size) || o.size == 0 || o.size > (1ull << 34)) {
           return Bad(n, v, "a size in bytes between 1 and 16G (suffixes K, M, G)");
         }
         size_given = true;
         return absl::OkStatus();
       }},
      {{"-a", "--all"},
       false,
       [&](const std::string&, const std::string&) {
         o.all_sizes = true;
         return absl::OkStatus();
       }},
      {{"-l", "--post_list"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt(n, v, 1, 65536, &o.batch);
       }},
      {{"-b", "--bidirectional"},
       false,
       [&](const std::string&, const std::string&) {
         o.bidirectional = true;
         return absl::OkStatus();
       }},
      {{"-F", "--CPU-freq"},
       false,
       [&](const std::string&, const std::string&) { return absl::OkStatus(); }},
      {{"--use_cuda"},
       true,
       [&](const std::string& n, const std::string& v) {
         o.memory = MemoryKind::kGpu;
         o.gpu_api = "cuda";
         return ParseInt(n, v, 0, 1023, &o.gpu_device);
       }},
      {{"--use_rocm"},
       true,
       [&](const std::string& n, const std::string& v) {
         o.memory = MemoryKind::kGpu;
         o.gpu_api = "rocm";
         return ParseInt(n, v, 0, 1023, &o.gpu_device);
       }},
      {{"-n", "--iters"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt<uint64_t>(n, v, 1, uint64_t{1} << 40, &o.iterations);
       }},
      {{"-D", "--duration"},
       true,
       [&](const std::string& n, const std::string& v) {
         if (!absl::SimpleAtod(v, &o.duration_s) || !(o.duration_s > 0) || o.duration_s > 86400) {
           return Bad(n, v, "a number of seconds in (0, 86400]");
         }
         return absl::OkStatus();
       }},
      {{"-w", "--warmup"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt<int64_t>(n, v, 0, int64_t{1} << 40, &o.warmup);
       }},
      {{"-q", "--qps"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt(n, v, 1, 64, &o.connections);
       }},
      {{"-t", "--tx-depth"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt(n, v, 1, 4096, &o.outstanding);
       }},
      {{"-T", "--threads"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt(n, v, 1, 256, &o.threads);
       }},
      {{"-d", "--ib-dev"},
       true,
       [&](const std::string& n, const std::string& v) {
         o.device = v;
         return absl::OkStatus();
       }},
      {{"-x", "--gid-index"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt(n, v, 0, 1023, &o.gid_index);
       }},
      {{"--memory"},
       true,
       [&](const std::string& n, const std::string& v) {
         if (v == "host") {
           o.memory = MemoryKind::kHost;
         } else if (v == "gpu") {
           o.memory = MemoryKind::kGpu;
         } else {
           return Bad(n, v, "host or gpu");
         }
         return absl::OkStatus();
       }},
      {{"--pattern"},
       true,
       [&](const std::string& n, const std::string& v) {
         if (v == "hot") {
           o.pattern = Pattern::kHot;
         } else if (v == "pool") {
           o.pattern = Pattern::kPool;
         } else {
           return Bad(n, v, "hot or pool");
         }
         return absl::OkStatus();
       }},
      {{"--pool-mib"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt<uint64_t>(n, v, 1, 1 << 20, &o.pool_mib);
       }},
      {{"--check"},
       false,
       [&](const std::string&, const std::string&) {
         o.check = true;
         return absl::OkStatus();
       }},
      {{"--verify-checksums"},
       false,
       [&](const std::string&, const std::string&) {
         o.verify_checksums = true;
         return absl::OkStatus();
       }},
      {{"--layout"},
       true,
       [&](const std::string& n, const std::string& v) {
         if (v != "dsv4-pro" && v != "dsv4-flash" && v != "v3-mla" && v != "mha") {
           return Bad(n, v, "dsv4-pro, dsv4-flash, v3-mla or mha");
         }
         o.layout = v;
         return absl::OkStatus();
       }},
      {{"--prompt"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt<uint64_t>(n, v, 1, 1 << 24, &o.prompt_tokens);
       }},
      {{"--frag"},
       true,
       [&](const std::string& n, const std::string& v) {
         if (!absl::SimpleAtod(v, &o.fragmentation) || o.fragmentation < 0 || o.fragmentation > 1) {
           return Bad(n, v, "a share in [0, 1]");
         }
         return absl::OkStatus();
       }},
      {{"--requests"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt(n, v, 1, 1024, &o.requests);
       }},
      {{"--json"},
       true,
       [&](const std::string&, const std::string& v) {
         o.json_file = v;
         return absl::OkStatus();
       }},
      {{"--dump-ranges"},
       true,
       [&](const std::string&, const std::string& v) {
         o.dump_ranges_file = v;
         return absl::OkStatus();
       }},
      {{"--csv"},
       true,
       [&](const std::string&, const std::string& v) {
         o.csv_file = v;
         return absl::OkStatus();
       }},
      {{"--report_gbits", "--report-gbits"},
       false,
       [&](const std::string&, const std::string&) {
         o.report_gbits = true;
         return absl::OkStatus();
       }},
      {{"-p", "--port"},
       true,
       [&](const std::string& n, const std::string& v) {
         return ParseInt(n, v, 0, 65535, &o.port);
       }},
      {{"--bind"},
       true,
       [&](const std::string&, const std::string& v) {
         o.bind = v;
         return absl::OkStatus();
       }},
      {{"--side-timeout"},
       true,
       [&](const std::string& n, const std::string& v) {
         double seconds = 0;
         if (!absl::SimpleAtod(v, &seconds) || !(seconds >= 1 && seconds <= 86400)) {
           return absl::InvalidArgumentError(
               absl::StrCat(n, " ", v, ": expected seconds between 1 and 86400"));
         }
         o.side_timeout_s = seconds;
         return absl::OkStatus();
       }},
      {{"--secret-file"},
       true,
       [&](const std::string&, const std::string& v) {
         o.secret_file = v;
         return absl::OkStatus();
       }},
      {{"--secret"},
       true,
       [&](const std::string& n, const std::string& v) {
         if (v.empty()) return absl::InvalidArgumentError(absl::StrCat(n, " is empty"));
         o.secret = v;
         return absl::OkStatus();
       }},
      {{"-h", "--help"},
       false,
       [&](const std::string&, const std::string&) {
         o.help = true;
         return absl::OkStatus();
       }},
  };

  // getopt_long's tables from the specs: a short name adds its letter, a long one an entry
  // whose value is 1000 + the spec's index.
  constexpr int kLongBase = 1000;
  std::string shortopts = ":";  // ':' first: a missing value is reported as ':'
  std::vector<option> longopts;
  std::map<int, size_t> by_short;
  for (size_t i = 0; i < specs.size(); ++i) {
    for (const std::string& name : specs[i].names) {
      if (name.size() == 2) {
        shortopts += name[1];
        if (specs[i].takes_value) shortopts += ':';
        by_short[name[1]] = i;
      } else {
        longopts.push_back(option{name.c_str() + 2,
                                  specs[i].takes_value ? required_argument : no_argument, nullptr,
                                  kLongBase + static_cast<int>(i)});
      }
    }
  }
  longopts.push_back(option{nullptr, 0, nullptr, 0});
  // getopt permutes its argv: work on a copy.
  std::vector<std::string> storage(argv, argv + argc);
  std::vector<char*> args;
  for (std::string& a : storage) args.push_back(a.data());
  args.push_back(nullptr);
  optind = 0;  // glibc: start over (this parser may run more than once in a process)
  opterr = 0;  // errors are ours
  auto name_of = [&](int at) {
    const std::string arg = at > 0 && at < argc ? std::string(args[at]) : "";
    return arg.substr(0, arg.find('='));
  };
  int index = 0;
  while (true) {
    const int c = getopt_long(argc, args.data(), shortopts.c_str(), longopts.data(), &index);
    if (c == -1) break;
    if (c == ':') {
      const std::string name = optopt >= kLongBase || optopt == 0
                                   ? name_of(optind - 1)
                                   : std::string("-") + static_cast<char>(optopt);
      return absl::InvalidArgumentError(absl::StrCat("option ", name, " needs a value"));
    }
    if (c == '?') {
      if (optopt >= kLongBase) {
        return absl::InvalidArgumentError(
            absl::StrCat("option ", name_of(optind - 1), " takes no value"));
      }
      const std::string name =
          optopt != 0 ? std::string("-") + static_cast<char>(optopt) : name_of(optind - 1);
      return absl::InvalidArgumentError(absl::StrCat("unknown option ", name, " (see --help)"));
    }
    const bool is_long = c >= kLongBase;
    const size_t i = is_long ? static_cast<size_t>(c - kLongBase) : by_short.at(c);
    const std::string name = is_long ? absl::StrCat("--", longopts[index].name)
                                     : std::string("-") + static_cast<char>(c);
    const std::string value = specs[i].takes_value && optarg != nullptr ? optarg : "";
    if (absl::Status s = specs[i].handle(name, value); !s.ok()) return s;
  }
  std::vector<std::string> positional;
  for (int i = optind; i < argc; ++i) positional.push_back(args[i]);
  if (positional.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("more than one HOST given: ", absl::StrJoin(positional, " ")));
  }
  if (!positional.empty()) o.host = positional[0];
  if (o.help) return o;
  if (!o.secret.empty() && !o.secret_file.empty()) {
    return absl::InvalidArgumentError("--secret and --secret-file exclude each other");
  }
  if (size_given && o.all_sizes) {
    return absl::InvalidArgumentError("-s (size) and -a (all sizes) exclude each other");
  }
  if (absl::Status s = Validate(o); !s.ok()) return s;
  return o;
}

std::map<std::string, std::string> AgreedSettings(const PerfOptions& o) {
  std::map<std::string, std::string> s;
  s["--op"] = o.op == OpKind::kRead ? "read" : "write";
  s["--transport"] = TransportKindName(o.transport);
  s["--workload"] = WorkloadName(o.workload);
  s["--memory"] = o.memory == MemoryKind::kGpu ? "gpu" : "host";
  s["--pattern"] = PatternName(o.pattern);
  s["--check"] = o.check ? "on" : "off";
  s["--verify-checksums"] = o.verify_checksums ? "on" : "off";
  s["-l"] = absl::StrCat(o.batch);
  s["-b"] = o.bidirectional ? "on" : "off";
  s["-n"] = o.iterations == 0 ? "auto" : absl::StrCat(o.iterations);
  s["-D"] = o.duration_s == 0 ? "off" : FormatDouble(o.duration_s);
  s["-w"] = o.warmup < 0 ? "auto" : absl::StrCat(o.warmup);
  s["-q"] = o.connections == 0 ? "default" : absl::StrCat(o.connections);
  s["-t"] = absl::StrCat(o.outstanding);
  s["-T"] = absl::StrCat(o.threads);
  if (o.pattern == Pattern::kPool || o.workload == Workload::kKv) {
    s["--pool-mib"] = absl::StrCat(o.pool_mib);
  }
  if (o.workload == Workload::kRaw) {
    s["-s/-a"] = o.all_sizes ? "all" : absl::StrCat(o.size);
  } else {
    s["--layout"] = o.layout;
    s["--prompt"] = absl::StrCat(o.prompt_tokens);
    s["--frag"] = FormatDouble(o.fragmentation);
    s["--requests"] = absl::StrCat(o.requests);
  }
  return s;
}

std::string EncodeSettings(const std::map<std::string, std::string>& settings) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : settings) parts.push_back(absl::StrCat(k, "=", v));
  return absl::StrJoin(parts, " ");
}

absl::StatusOr<std::map<std::string, std::string>> DecodeSettings(const std::string& text) {
  std::map<std::string, std::string> out;
  for (absl::string_view part : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    const size_t eq = part.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("malformed setting \"", part, "\""));
    }
    out[std::string(part.substr(0, eq))] = std::string(part.substr(eq + 1));
  }
  return out;
}

absl::Status CheckAgreement(const std::map<std::string, std::string>& mine,
                            const std::map<std::string, std::string>& theirs,
                            const std::string& their_role) {
  std::vector<std::string> diffs;
  std::map<std::string, std::string> keys;
  for (const auto& [k, v] : mine) keys[k];
  for (const auto& [k, v] : theirs) keys[k];
  for (const auto& [k, unused] : keys) {
    auto a = mine.find(k);
    auto b = theirs.find(k);
    const std::string here = a == mine.end() ? "(unset)" : a->second;
    const std::string there = b == theirs.end() ? "(unset)" : b->second;
    if (here != there) {
      diffs.push_back(absl::StrCat(k, " is ", here, " here but ", there, " on the ", their_role));
    }
  }
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("options differ between the two sides (give both the same test options): ",
                   absl::StrJoin(diffs, "; ")));
}

}  // namespace kvwire::perf

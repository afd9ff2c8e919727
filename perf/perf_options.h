// kvwire-perf command line: every option in one struct, parsed in one place, and the subset
// of them that both sides of a test must agree on (checked at connect time).
#ifndef KVWIRE_PERF_PERF_OPTIONS_H_
#define KVWIRE_PERF_PERF_OPTIONS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "kvwire/engine.h"

namespace kvwire::perf {

enum class Workload { kRaw, kKv };
enum class Pattern {
  kHot,   // one buffer per thread, reused by every op (what perftest and ucx_perftest do)
  kPool,  // blocks in random order over a large pool on each side (what a KV cache is)
};

struct PerfOptions {
  // Initiator (client) when set: the target's host. Empty: this process is the target.
  std::string host;
  // Side-channel TCP port (settings exchange, like perftest's 18515).
  int port = 18515;
  // Address the target binds (side channel and engine). Loopback unless told otherwise: the
  // side channel is unauthenticated, so listening elsewhere is an explicit choice.
  std::string bind = "127.0.0.1";
  // --side-timeout: longest wait for any side-channel line (a whole run between RUN and
  // DONE included); the target's wait for HELLO is at most 30 s of it.
  double side_timeout_s = 600;

  OpKind op = OpKind::kWrite;                      // --op read|write
  TransportKind transport = TransportKind::kAuto;  // --transport rdma|tcp|shm|auto
  Workload workload = Workload::kRaw;              // --workload raw|kv

  uint64_t size = 65536;   // -s: bytes per op (raw)
  bool all_sizes = false;  // -a: 4 KiB .. 64 MiB, powers of two
  int batch = 1;           // -l, --post_list: ops per transfer (perftest's WQE list)
  // -b, --bidirectional: data flows both ways at once; every other transfer of each thread
  // is the opposite operation (a WRITE's bytes go out, a READ's come in), and the bandwidth
  // counts both directions, as perftest's -b does.
  bool bidirectional = false;
  uint64_t iterations = 0;  // -n: ops per thread and size (0: chosen from the size)
  double duration_s = 0;    // -D: seconds per size instead of -n
  int64_t warmup = -1;      // -w: warm-up ops per thread and size (-1: chosen)
  int connections = 0;      // -q: tcp connections (or rdma QPs) per peer; 0: engine default
  int outstanding = 8;      // -t: transfers in flight per thread
  int threads = 1;          // -T: initiator threads (one engine, one peer)
  std::string device;       // -d: rdma device
  int gid_index = -1;       // -x: rdma GID index
  MemoryKind memory = MemoryKind::kHost;  // --memory host|gpu, --use_cuda, --use_rocm
  int gpu_device = 0;                     // --use_cuda=N / --use_rocm=N: device ordinal
  std::string gpu_api;                    // "cuda", "rocm" or "" (whichever the build has)
  Pattern pattern = Pattern::kHot;        // --pattern hot|pool
  uint64_t pool_mib = 1024;               // --pool-mib: pool per side for --pattern pool
  bool check = false;                     // --check: verify every byte moved
  bool verify_checksums = false;          // --verify-checksums: EngineOptions::verify_checksums

  // kv workload.
  std::string layout = "dsv4-pro";  // --layout dsv4-pro|dsv4-flash|v3-mla|mha
  uint64_t prompt_tokens = 8192;    // --prompt
  double fragmentation = 0.5;       // --frag: share of blocks not contiguous with the previous
  int requests = 4;                 // --requests: requests in flight

  // --dump-ranges FILE (kv workload): write one request's byte ranges there and exit, without
  // an engine or a peer (the page set `make compare` gives every peer's batch API).
  std::string dump_ranges_file;
  std::string json_file;      // --json FILE
  std::string csv_file;       // --csv FILE
  bool report_gbits = false;  // --report_gbits: Gb/s instead of GB/s (both decimal)
  bool help = false;
  // The engines' shared secret (never sent over the side channel): --secret-file FILE
  // (recommended: argv is visible to every local user) or --secret S; neither: KVWIRE_SECRET.
  std::string secret_file;
  std::string secret;

  bool is_client() const { return !host.empty(); }
  // Message sizes to run (raw workload).
  std::vector<uint64_t> Sizes() const;
  // Ops per thread for `size` when -n was not given.
  uint64_t IterationsFor(uint64_t size) const;
  uint64_t WarmupFor(uint64_t iterations) const;
};

inline constexpr uint64_t kMinAllSize = 4096;
inline constexpr uint64_t kMaxAllSize = 64ull << 20;

// Parses argv (argv[0] is the program) with getopt_long, as perftest does: short options take
// attached values ("-s65536") and may be grouped ("-ac"), long ones "--size=N" or "--size N".
// Errors name the option and the accepted values. GPU memory is checked against the build's
// GPU runtime (a build without one refuses --use_cuda/--use_rocm/--memory gpu, saying so).
absl::StatusOr<PerfOptions> ParsePerfOptions(int argc, const char* const* argv);
std::string UsageText();

// The settings both sides must share, as "key=value" pairs (keys are the option names).
std::map<std::string, std::string> AgreedSettings(const PerfOptions& options);
std::string EncodeSettings(const std::map<std::string, std::string>& settings);
absl::StatusOr<std::map<std::string, std::string>> DecodeSettings(const std::string& text);
// OK when equal; else FailedPrecondition naming every option that differs and both values.
absl::Status CheckAgreement(const std::map<std::string, std::string>& mine,
                            const std::map<std::string, std::string>& theirs,
                            const std::string& their_role);

const char* OpName(OpKind op);       // "WRITE", "READ"
const char* PatternName(Pattern p);  // "hot", "pool"
const char* WorkloadName(Workload w);

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_PERF_OPTIONS_H_

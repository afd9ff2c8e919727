// A prefill instance in its own process for the connector tests: a kvwire::Connector over a
// simulated KV cache, driven like vLLM's scheduler and worker through stdin commands:
//
//   req <id> <tokens> <read|write> <transfer_id> <layers_now|all>
//       allocate fragmented blocks, write the pattern; read: RequestFinished and print
//       "PARAMS <id> <json>"; write: announce the request and save `layers_now` layers
//       (all: every layer, then RequestFinished), print "SAVED <id> <n>"
//   finish <id>      write mode: save the remaining layers, RequestFinished, "SAVED <id> all"
//   abort <id>       Connector::Abort (+ RequestFinished(aborted) in write mode), "ABORTED <id>"
//   acct             "ACCT <accounting error or ok> live=<requests> connector_live=<n>"
//   stats            "STATS <json>"
//   engine_stats     "ESTATS <json>" (the engine's: grant_refused, grants_live, ...)
//   quit             exits (destroying the connector), like closing stdin
// Between commands it polls GetFinished and frees the blocks of finished requests, printing
// "FREED <id>". Prints "READY <address>" first; exits when stdin closes.
//
// With --role=decode it is a decode instance instead (for tests that kill decode):
//   load <id> <tokens> <kv_transfer_params json>
//       match, allocate, bind and start the load; prints "STARTED <id>", later
//       "LOADED <id> <verify error or ok>" or "FAILED <id> <reason>" (blocks freed on either)
//
// --secret=S sets the engine's shared secret; --handshake_ms=N the connector's
// handshake_timeout (also how long a read_start for a transfer not held waits for its hold);
// --read_grants=0 turns ConnectorOptions::read_grants off.
//
// --metrics=host:port starts the connector's metrics endpoint and prints "METRICS <address>"
// after READY.
//
// --gpu=emulated installs the emulated GPU runtime (tests/support/emulated_gpu.h) before the
// connector exists and keeps the KV cache in its device memory (registered as kGpu).
//
//   kvwire_connector_peer --layout=deepseek-v4-pro --transport=tcp --mode=auto --blocks=64
//                         --state_blocks=4 --seed=1 --timeout_ms=60000 --name=prefill
#include <cstdio>
#include <iostream>
#include <map>
#include <poll.h>
#include <set>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

#include "kvwire/connector.h"
#include "src/gpu/runtime.h"
#include "tests/connector/kv_sim.h"
#include "tests/support/emulated_gpu.h"
#include "tests/support/flags.h"

namespace {

struct Args {
  std::string layout = "deepseek-v3";
  std::string transport = "auto";
  std::string mode = "auto";
  uint64_t blocks = 64;
  uint64_t state_blocks = 8;
  uint64_t seed = 1;
  int timeout_ms = 60000;
  std::string name = "prefill";
  std::string role = "prefill";
  std::string gpu;  // "" (host memory) or "emulated"
  std::string metrics;
  std::string secret;
  int handshake_ms = 0;  // 0: the connector's default
  bool read_grants = true;
};

absl::Status ParseArgs(int argc, char** argv, Args* a) {
  return kvwire::testing::FlagParser()
      .String("layout", &a->layout)
      .String("transport", &a->transport)
      .String("mode", &a->mode)
      .Int("blocks", &a->blocks)
      .Int("state_blocks", &a->state_blocks)
      .Int("seed", &a->seed)
      .Int("timeout_ms", &a->timeout_ms)
      .String("name", &a->name)
      .String("role", &a->role)
      .String("metrics", &a->metrics)
      .String("secret", &a->secret)
      .Int("handshake_ms", &a->handshake_ms)
      .Bool("read_grants", &a->read_grants)
      .Custom("gpu", [a](const std::string& v) { return (a->gpu = v) == "emulated"; })
      .Parse(argc, argv);
}

void Say(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

struct Pending {
  uint64_t tokens = 0;
  std::string params;
  std::vector<int> layers_left;
};

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (absl::Status parsed = ParseArgs(argc, argv, &args); !parsed.ok()) {
    std::fprintf(stderr, "connector_peer: bad arguments: %s\n", parsed.ToString().c_str());
    return 2;
  }
  kvwire::ConnectorOptions options;
  options.role = args.role;
  options.engine.name = args.name;
  options.request_timeout = absl::Milliseconds(args.timeout_ms);
  options.engine.peer_lease = absl::Seconds(3);
  options.engine.heartbeat_interval = absl::Milliseconds(200);
  auto mode = kvwire::ParseKvMode(args.mode);
  if (!mode.ok()) {
    std::fprintf(stderr, "connector_peer: bad mode\n");
    return 2;
  }
  options.engine.transport = args.transport;
  options.engine.shared_secret = args.secret;
  if (args.handshake_ms > 0) options.handshake_timeout = absl::Milliseconds(args.handshake_ms);
  options.mode = *mode;
  options.metrics_address = args.metrics;
  options.read_grants = args.read_grants;
  // Before the connector: its engine keeps the runtime it was created with.
  std::unique_ptr<kvwire::testing::EmulatedGpu> emulated;
  if (args.gpu == "emulated") {
    emulated = std::make_unique<kvwire::testing::EmulatedGpu>();
    kvwire::gpu::SetDefaultRuntime(&emulated->runtime());
  }
  auto connector = kvwire::Connector::Create(options);
  kvwire::testing::KvCache::DeviceWriter writer;
  if (emulated) {
    writer = [&emulated](void* device, const void* host, size_t bytes) {
      return emulated->WriteDevice(device, host, bytes);
    };
  }
  auto cache =
      kvwire::testing::KvCache::Create(args.layout, args.blocks, args.state_blocks, args.seed,
                                       emulated ? &emulated->runtime() : nullptr, 0, writer);
  if (!connector.ok() || !cache.ok()) {
    std::fprintf(stderr, "connector_peer: %s %s\n", connector.status().ToString().c_str(),
                 cache.status().ToString().c_str());
    return 1;
  }
  kvwire::Connector& c = **connector;
  kvwire::testing::KvCache& kv = **cache;
  if (absl::Status s = c.RegisterKvCaches(kv.layout(), kv.memory()); !s.ok()) {
    std::fprintf(stderr, "connector_peer: %s\n", s.ToString().c_str());
    return 1;
  }
  std::set<int> all_layers;
  for (const kvwire::CacheGroup& g : kv.layout().groups) {
    all_layers.insert(g.layers.begin(), g.layers.end());
  }
  std::map<std::string, Pending> pending;
  std::map<std::string, uint64_t> loads;  // decode: tokens of each started load
  Say("READY " + c.engine().address());
  if (!args.metrics.empty()) Say("METRICS " + c.metrics_address());

  std::string buffer;
  bool quit = false;
  while (!quit) {
    kvwire::FinishedRequests f = c.GetFinished();
    for (const std::string& id : f.finished_sending) {
      if (kv.Release(id)) Say("FREED " + id);
    }
    for (const std::string& id : f.finished_recving) {
      auto it = loads.find(id);
      if (it == loads.end() || kv.live().count(id) == 0) continue;
      const std::string err = kv.Verify(id, kv.live().at(id), it->second, 0);
      kv.Release(id);
      loads.erase(it);
      Say("LOADED " + id + " " + (err.empty() ? std::string("ok") : err));
    }
    for (const kvwire::FailedLoad& fl : f.failed_loads) {
      kv.Release(fl.request_id);
      loads.erase(fl.request_id);
      Say("FAILED " + fl.request_id + " " + fl.reason);
    }
    pollfd p{STDIN_FILENO, POLLIN, 0};
    if (poll(&p, 1, 5) <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(STDIN_FILENO, chunk, sizeof(chunk));
    if (n <= 0) break;
    buffer.append(chunk, n);
    size_t nl;
    while ((nl = buffer.find('\n')) != std::string::npos) {
      const std::string line = buffer.substr(0, nl);
      buffer.erase(0, nl + 1);
      std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (w.empty()) continue;
      const std::string& cmd = w[0];
      if (cmd == "load" && w.size() >= 4) {
        const std::string& id = w[1];
        uint64_t tokens = 0;
        if (!absl::SimpleAtoi(w[2], &tokens)) tokens = 1;
        const std::string params = line.substr(line.find(w[3]));
        auto match = c.GetNumNewMatchedTokens(id, tokens, 0, params);
        absl::StatusOr<kvwire::BlockTable> blocks =
            match.ok() ? kv.Allocate(id, tokens) : match.status();
        absl::Status s = blocks.status();
        if (s.ok()) s = c.UpdateStateAfterAlloc(id, *blocks, match->num_external_tokens);
        if (s.ok()) s = c.BindConnectorMeta(c.BuildConnectorMeta());
        if (s.ok()) s = c.StartLoadKv();
        if (!s.ok()) {
          kv.Release(id);
          Say("ERROR " + id + " " + std::string(s.message()));
          continue;
        }
        loads[id] = tokens;
        Say("STARTED " + id);
      } else if (cmd == "req" && w.size() == 6) {
        const std::string& id = w[1];
        uint64_t tokens = 0;
        if (!absl::SimpleAtoi(w[2], &tokens)) tokens = 1;
        absl::StatusOr<kvwire::BlockTable> blocks = kv.Allocate(id, tokens);
        if (!blocks.ok()) {
          Say("ERROR " + id + " " + std::string(blocks.status().message()));
          continue;
        }
        kv.Fill(id, *blocks);
        kvwire::KvTransferParams in;
        in.do_remote_decode = true;
        in.mode = w[3] == "write" ? kvwire::KvMode::kWrite : kvwire::KvMode::kRead;
        in.transfer_id = w[4];
        const std::string params = in.ToJson();
        if (w[3] != "write") {
          // Read mode: "-" lets the connector draw the transfer id; any other word is the id
          // (a vLLM scheduler gives every tensor-parallel rank of a hand-off the same one).
          auto done = c.RequestFinished(id, *blocks, tokens, params, /*aborted=*/false,
                                        w[4] == "-" ? std::string() : w[4]);
          if (!done.ok()) {
            kv.Release(id);
            Say("ERROR " + id + " " + std::string(done.status().message()));
            continue;
          }
          if (!done->delay_free && kv.Release(id)) Say("FREED " + id);
          Say("PARAMS " + id + " " + done->kv_transfer_params);
          continue;
        }
        auto match = c.GetNumNewMatchedTokens(id, tokens, 0, params);
        absl::Status s = match.status();
        if (s.ok()) s = c.UpdateStateAfterAlloc(id, *blocks, 0);
        if (s.ok()) s = c.BindConnectorMeta(c.BuildConnectorMeta());
        if (!s.ok()) {
          kv.Release(id);
          Say("ERROR " + id + " " + std::string(s.message()));
          continue;
        }
        Pending& pr = pending[id];
        pr.tokens = tokens;
        pr.params = params;
        pr.layers_left.assign(all_layers.begin(), all_layers.end());
        size_t now = pr.layers_left.size();
        if (w[5] != "all" && !absl::SimpleAtoi(w[5], &now)) now = 0;
        now = std::min(now, pr.layers_left.size());
        for (size_t i = 0; i < now; ++i) (void)c.SaveKvLayer(pr.layers_left[i]);
        pr.layers_left.erase(pr.layers_left.begin(), pr.layers_left.begin() + now);
        (void)c.WaitForSave();
        if (pr.layers_left.empty()) {
          auto done = c.RequestFinished(id, *blocks, tokens, params);
          if (done.ok() && !done->delay_free && kv.Release(id)) Say("FREED " + id);
          pending.erase(id);
          Say("SAVED " + id + " all");
        } else {
          Say("SAVED " + id + " " + std::to_string(now));
        }
      } else if (cmd == "finish" && w.size() == 2) {
        auto it = pending.find(w[1]);
        if (it == pending.end() || kv.live().count(w[1]) == 0) {
          Say("ERROR " + w[1] + " unknown");
          continue;
        }
        (void)c.BindConnectorMeta(R"({"loads":[],"saves":[{"request_id":")" + w[1] + "\"}]}");
        for (int layer : it->second.layers_left) (void)c.SaveKvLayer(layer);
        auto done =
            c.RequestFinished(w[1], kv.live().at(w[1]), it->second.tokens, it->second.params);
        if (done.ok() && !done->delay_free && kv.Release(w[1])) Say("FREED " + w[1]);
        pending.erase(it);
        Say("SAVED " + w[1] + " all");
      } else if (cmd == "abort" && w.size() == 2) {
        absl::Status s = c.Abort(w[1]);
        auto it = pending.find(w[1]);
        if (it != pending.end() && kv.live().count(w[1]) != 0) {
          auto done = c.RequestFinished(w[1], kv.live().at(w[1]), it->second.tokens,
                                        it->second.params, /*aborted=*/true);
          if (done.ok() && !done->delay_free && kv.Release(w[1])) Say("FREED " + w[1]);
          pending.erase(it);
        }
        Say("ABORTED " + w[1] + " " + (s.ok() ? "ok" : std::string(s.message())));
      } else if (cmd == "acct") {
        std::string err = kv.CheckAccounting();
        if (err.empty()) err = kvwire::testing::MachineErrors(c);
        Say("ACCT " + (err.empty() ? std::string("ok") : err) +
            " live=" + std::to_string(kv.live().size()) +
            " connector_live=" + std::to_string(c.LiveRequests()));
      } else if (cmd == "stats") {
        Say("STATS " + c.StatsJson());
      } else if (cmd == "engine_stats") {
        Say("ESTATS " + c.engine().Stats().ToJson());
      } else if (cmd == "quit") {
        quit = true;
        break;
      } else {
        Say("ERROR bad command: " + line);
      }
    }
  }
  return 0;
}

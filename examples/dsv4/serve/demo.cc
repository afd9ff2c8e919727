#include "examples/dsv4/serve/demo.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "examples/dsv4/model/config.h"
#include "examples/dsv4/model/generate.h"
#include "examples/dsv4/model/kv_cache.h"
#include "examples/dsv4/model/model.h"
#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/process.h"

namespace dsv4::serve {

using nlohmann::json;

namespace {

std::string SelfPath(const std::string& argv0) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? argv0 : p.string();
}

// Printable, single line, at most `n` characters.
std::string Show(const std::string& s, size_t n = 70) {
  std::string out;
  for (unsigned char c : s) {
    if (out.size() >= n) {
      out += "...";
      break;
    }
    out += (c >= 32 && c < 127) ? static_cast<char>(c) : '.';
  }
  return out;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Server {
  std::unique_ptr<Process> process;
  std::string address;
};

absl::StatusOr<Server> Launch(const std::string& self, const std::string& dir,
                              const std::string& name, std::vector<std::string> args) {
  const std::string ready = absl::StrCat(dir, "/", name, ".ready");
  std::filesystem::remove(ready);
  args.push_back("--ready-file");
  args.push_back(ready);
  absl::StatusOr<std::unique_ptr<Process>> p =
      Process::Start(self, args, absl::StrCat(dir, "/", name, ".log"));
  if (!p.ok()) return p.status();
  absl::StatusOr<json> j = WaitForReadyFile(ready, **p, absl::Seconds(120));
  if (!j.ok()) return j.status();
  return Server{std::move(*p), (*j)["address"].get<std::string>()};
}

}  // namespace

int RunDemo(const Flags& f, const std::string& argv0) {
  const std::string self = SelfPath(argv0);
  const std::string config_path = f.Get("config", "examples/dsv4/configs/small.json");
  const std::string dir = f.Get("work-dir", "/tmp/kvwire-dsv4-demo");
  const std::string weights = f.Get("weights", absl::StrCat(dir, "/weights.safetensors"));
  const int max_tokens = static_cast<int>(f.GetInt("max-tokens", 24).value_or(24));
  const std::vector<std::string> transports =
      absl::StrSplit(f.Get("transports", "tcp,shm"), ',', absl::SkipEmpty());
  std::filesystem::create_directories(dir);

  absl::StatusOr<Config> config = Config::FromFile(config_path);
  if (!config.ok()) {
    std::fprintf(stderr, "demo: %s\n", std::string(config.status().message()).c_str());
    return 1;
  }
  if (absl::Status s = EnsureWeights(*config, weights); !s.ok()) {
    std::fprintf(stderr, "demo: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("== kvwire-dsv4 demo: config %s (%d layers, ratios", config->name.c_str(),
              config->num_layers);
  for (int r : config->compress_ratios) std::printf(" %d", r);
  std::printf("), weights %s\n", weights.c_str());

  const std::vector<std::string> prompts = {
      "The KV cache moves from prefill to decode.",
      std::string(
          "DeepSeek-V4 keeps a 128-token sliding window on every layer and compressed history "
          "on the others: every fourth token on the c4a layers, every 128th on the c128a ones, "
          "and a lightning indexer picks the entries worth attending to."),
      std::string(300, 'k') + " and then some more words at the end of a long prompt.",
  };

  // The single-process reference: `generate` in this process.
  std::vector<GenerateResult> reference;
  {
    absl::StatusOr<std::unique_ptr<Model>> model = Model::Load(*config, weights);
    if (!model.ok()) {
      std::fprintf(stderr, "demo: %s\n", std::string(model.status().message()).c_str());
      return 1;
    }
    absl::StatusOr<std::unique_ptr<KvCache>> cache =
        KvCache::Create(*config, config->max_seq_len / 64 + 2, 1, 5);
    if (!cache.ok()) return 1;
    GenerateOptions o;
    o.max_tokens = max_tokens;
    for (const std::string& p : prompts) {
      absl::StatusOr<GenerateResult> r = Generate(**model, **cache, p, o);
      if (!r.ok()) {
        std::fprintf(stderr, "demo: generate: %s\n", std::string(r.status().message()).c_str());
        return 1;
      }
      reference.push_back(std::move(*r));
    }
  }
  std::printf("single process (generate): %zu prompts, %d tokens each\n\n", prompts.size(),
              max_tokens);

  int failures = 0;
  std::map<std::string, std::vector<double>> share, ttft, prefill_tps, decode_tps, gbps, tail;
  for (const std::string& transport : transports) {
    std::printf("-- transport %s: starting prefill, decode and two routers (read, write)\n",
                transport.c_str());
    std::vector<std::string> common = {"--config",    config_path, "--weights", weights,
                                       "--transport", transport,   "--mode",    "auto"};
    // The servers' KV peers authenticate each other with it.
    if (f.Has("secret-file")) {
      common.push_back("--secret-file");
      common.push_back(f.Get("secret-file"));
    }
    auto with = [&](std::vector<std::string> a) {
      a.insert(a.end(), common.begin(), common.end());
      return a;
    };
    absl::StatusOr<Server> prefill =
        Launch(self, dir, "prefill-" + transport, with({"serve", "--role", "prefill"}));
    absl::StatusOr<Server> decode =
        Launch(self, dir, "decode-" + transport, with({"serve", "--role", "decode"}));
    if (!prefill.ok() || !decode.ok()) {
      std::fprintf(stderr, "demo: server did not start: %s %s\n",
                   std::string(prefill.status().message()).c_str(),
                   std::string(decode.status().message()).c_str());
      return 1;
    }
    for (const char* mode : {"read", "write"}) {
      absl::StatusOr<Server> router = Launch(
          self, dir, absl::StrCat("router-", mode, "-", transport),
          {"router", "--prefill", prefill->address, "--decode", decode->address, "--mode", mode});
      if (!router.ok()) {
        std::fprintf(stderr, "demo: router did not start: %s\n",
                     std::string(router.status().message()).c_str());
        return 1;
      }
      // One warm-up request per router (not counted): the first request to a prefill pays
      // the connector handshake (and, for shm, mapping the peer's memory), once per pair.
      (void)Complete(router->address,
                     {{"prompt", "warm up"}, {"max_tokens", 2}, {"temperature", 0}},
                     absl::Seconds(300));
      for (size_t i = 0; i < prompts.size(); ++i) {
        // Greedy, as the reference (the servers default to vLLM's temperature 1).
        json req = {{"prompt", prompts[i]},
                    {"max_tokens", max_tokens},
                    {"stream", true},
                    {"temperature", 0}};
        absl::StatusOr<CompletionResult> r = Complete(router->address, req, absl::Seconds(300));
        const std::string tag = absl::StrCat(mode, "/", transport);
        if (!r.ok() || r->status != 200 || !r->error.empty()) {
          ++failures;
          std::printf("[%-10s] prompt %zu: FAILED %s\n", tag.c_str(), i,
                      r.ok() ? r->error.c_str() : std::string(r.status().message()).c_str());
          continue;
        }
        const bool match = r->tokens == reference[i].tokens;
        if (!match) ++failures;
        const json& t = r->kvwire.value("transfer", json::object());
        const json& p = r->kvwire.value("prefill", json::object());
        const double wait = t.value("load_wait_ms", 0.0);
        const double pct = r->ttft_ms > 0 ? 100.0 * wait / r->ttft_ms : 0.0;
        share[mode].push_back(pct);
        ttft[mode].push_back(r->ttft_ms);
        prefill_tps["all"].push_back(p.value("prefill_tokens_per_s", 0.0));
        decode_tps["all"].push_back(r->kvwire.value("decode_tokens_per_s", 0.0));
        std::string kv;
        if (t.value("mode", "") == "write") {
          kv = absl::StrFormat(
              "mode write, transport %s, %d bytes in %d pages, pushed layer by layer during "
              "prefill; in place %+.3f ms from prefill's Forward returning",
              t.value("transport", "?"), t.value("bytes", uint64_t{0}),
              t.value("pages", uint64_t{0}), t.value("tail_ms", 0.0));
          tail[tag].push_back(t.value("tail_ms", 0.0));
        } else {
          kv = absl::StrFormat(
              "mode %s, transport %s, %d bytes in %d pages (%d ops), %.3f ms, %.2f GB/s",
              t.value("mode", "?"), t.value("transport", "?"), t.value("bytes", uint64_t{0}),
              t.value("pages", uint64_t{0}), t.value("ops", uint64_t{0}),
              t.value("transfer_ms", 0.0), t.value("gbps", 0.0));
          gbps[tag].push_back(t.value("gbps", 0.0));
        }
        std::printf(
            "[%-10s] prompt %zu (%zu tokens) -> \"%s\"\n"
            "             kv: %s\n"
            "             TTFT %.1f ms, KV wait %.3f ms (%.2f%% of TTFT) | prefill %.0f tok/s, "
            "decode %.1f tok/s | %s\n",
            tag.c_str(), i, reference[i].prompt_tokens.size(), Show(r->text).c_str(), kv.c_str(),
            r->ttft_ms, wait, pct, p.value("prefill_tokens_per_s", 0.0),
            r->kvwire.value("decode_tokens_per_s", 0.0),
            match ? "MATCH" : "MISMATCH (single process differs)");
        if (!match) {
          std::printf("             single process: \"%s\"\n", Show(reference[i].text).c_str());
        }
      }
    }
    std::printf("\n");
    // Servers stop here (SIGTERM, then SIGKILL after a grace period).
  }
  std::printf("== summary (medians; GB/s = 10^9 B/s)\n");
  for (const char* mode : {"read", "write"}) {
    std::printf("  %-5s: TTFT %.1f ms, KV transfer wait %.2f%% of TTFT\n", mode, Median(ttft[mode]),
                Median(share[mode]));
  }
  for (const auto& [tag, v] : gbps) {
    std::printf("  %-10s: %.2f GB/s (decode READs, whole request)\n", tag.c_str(), Median(v));
  }
  for (const auto& [tag, v] : tail) {
    std::printf("  %-10s: KV in place %+.3f ms from prefill's Forward returning\n", tag.c_str(),
                Median(v));
  }
  std::printf("  prefill %.0f tokens/s, decode %.1f tokens/s (config %s)\n",
              Median(prefill_tps["all"]), Median(decode_tps["all"]), config->name.c_str());
  std::printf("%s\n", failures == 0 ? "demo: all requests MATCH the single-process run"
                                    : "demo: FAILED (see above)");
  return failures == 0 ? 0 : 1;
}

}  // namespace dsv4::serve

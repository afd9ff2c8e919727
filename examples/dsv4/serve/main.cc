// kvwire-dsv4: the reference DeepSeek-V4 engine's command line.
//
//   kvwire-dsv4 weights  --config C.json --out W.safetensors
//   kvwire-dsv4 generate --config C.json --weights W --prompt TEXT [--prompt ...]
//                        [--max-tokens 32 --temperature 0 --seed 0 --threads 0]
//                        [--kv-device cpu|gpu]
//   kvwire-dsv4 serve    --role prefill|decode|both --config C.json --weights W
//                        [--port 0 --kv-port 0 --transport auto|tcp|shm --mode read|write|auto]
//                        [--secret-file F | --secret S]
//   kvwire-dsv4 router   --prefill host:port[,...] --decode host:port[,...] --mode read|write
//                        [--port 0] [--policy round_robin|least_loaded]
//   kvwire-dsv4 router   --etcd URL --cluster NAME --mode read|write (servers given
//                        --etcd URL --cluster NAME register themselves; the router follows)
//   kvwire-dsv4 demo     (see demo.cc)
//
// Servers print one "listening" line, write --ready-file (JSON with the ports) once they
// serve, and stop cleanly on SIGINT or SIGTERM.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_split.h"

#include "examples/dsv4/model/config.h"
#include "examples/dsv4/model/generate.h"
#include "examples/dsv4/model/kv_cache.h"
#include "examples/dsv4/model/model.h"
#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/demo.h"
#include "examples/dsv4/serve/flags.h"
#include "examples/dsv4/serve/model_server.h"
#include "examples/dsv4/serve/planted_defect.h"
#include "examples/dsv4/serve/process.h"
#include "examples/dsv4/serve/router.h"
#include "kvwire/connector.h"
#include "src/discovery/etcd_client.h"
#include "src/util/secret_file.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;

int Usage() {
  std::fprintf(stderr,
               "usage: kvwire-dsv4 <weights|generate|serve|router|demo> [flags]\n"
               "  weights  --config C.json --out W.safetensors\n"
               "  generate --config C.json --weights W --prompt TEXT [--prompt TEXT ...]\n"
               "           [--max-tokens 32] [--temperature 0] [--seed 0] [--threads 0]\n"
               "           [--kv-device cpu|gpu]\n"
               "  serve    --role prefill|decode|both --config C.json --weights W [--port 0]\n"
               "           [--kv-port 0] [--transport auto|tcp|shm] [--mode read|write|auto]\n"
               "           [--num-blocks N] [--max-requests 32] [--max-queue 128]\n"
               "           [--max-queue-wait-s 30] [--threads 0] (docs/dsv4-capacity.md)\n"
               "           [--request-timeout-s 60] [--peer-lease-ms 5000] [--ready-file F]\n"
               "           [--max-connections-per-source 128] (HTTP, per client address)\n"
               "           [--max-logprobs 20] (per token a request may ask for; -1: all)\n"
               "           [--corrupt-kv-page] [--inject-delay-ms 0]\n"
               "           [--verify-kv] (CRC32C of every KV op end to end: a corrupted\n"
               "           transfer fails instead of landing; docs/CHECKSUMS.md)\n"
               "           [--secret-file F | --secret S] (shared secret of the KV peers;\n"
               "           a file (mode 600) is recommended: argv is visible to local users;\n"
               "           neither: KVWIRE_SECRET)\n"
               "           [--etcd http://H:P[,...] --cluster NAME [--etcd-lease-s 10]]\n"
               "           (register in etcd under /kvwire/NAME/instances/<engine id>)\n"
               "           [--etcd-user U --etcd-password-file F | --etcd-password P]\n"
               "           [--etcd-cacert CA.pem] [--etcd-cert C.pem --etcd-key K.pem]\n"
               "           (etcd's own auth and TLS: https://H:P endpoints; docs/SECURITY.md)\n"
               "  router   --prefill H:P[,H:P] --decode H:P[,H:P] --mode read|write [--port 0]\n"
               "           [--timeout-s 300] [--ready-file F] [--policy round_robin|least_loaded]\n"
               "           [--max-connections-per-source 64] (HTTP, per client address)\n"
               "           [--max-upstream-body-mib 8] (non-streamed answers; larger: 502)\n"
               "           [--forget-instance-s 30] (metrics of a departed instance kept)\n"
               "  router   --etcd http://H:P[,...] --cluster NAME --mode read|write [...]\n"
               "           [--secret-file F | --secret S] (the servers' shared secret: every\n"
               "           instance must prove it holds it; neither: KVWIRE_SECRET; none: etcd\n"
               "           records are trusted) (instances discovered and followed through etcd)\n"
               "           [--etcd-user U --etcd-password-file F] [--etcd-cacert CA.pem]\n"
               "           [--etcd-cert C.pem --etcd-key K.pem] (as for serve)\n"
               "  demo     [--config C.json] [--weights W] [--work-dir D] [--secret-file F]\n"
               "           (make demo)\n");
  return 2;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvwire-dsv4: %s\n", std::string(s.message()).c_str());
  return 1;
}

// Blocks SIGINT/SIGTERM in every thread (call before starting any) and waits for one.
void BlockStopSignals(sigset_t* set) {
  sigemptyset(set);
  sigaddset(set, SIGINT);
  sigaddset(set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, set, nullptr);
}

int WaitForStop(sigset_t* set) {
  int sig = 0;
  sigwait(set, &sig);
  return sig;
}

// --secret-file, --secret, or neither (the connector then takes KVWIRE_SECRET, if set).
absl::StatusOr<std::optional<std::string>> SecretFromFlags(const Flags& f) {
  if (f.Has("secret") && f.Has("secret-file")) {
    return absl::InvalidArgumentError("--secret and --secret-file exclude each other");
  }
  if (f.Has("secret-file")) {
    absl::StatusOr<std::string> s = kvwire::ReadSecretFile(f.Get("secret-file"));
    if (!s.ok()) return s.status();
    return std::optional<std::string>(*std::move(s));
  }
  if (f.Has("secret")) {
    if (f.Get("secret").empty()) return absl::InvalidArgumentError("--secret is empty");
    std::fprintf(stderr,
                 "kvwire-dsv4: warning: --secret is visible to every local user (ps, "
                 "/proc/<pid>/cmdline); prefer --secret-file\n");
    return std::optional<std::string>(f.Get("secret"));
  }
  return std::optional<std::string>();
}

// etcd's own authentication and TLS: --etcd-user with --etcd-password-file (or
// --etcd-password), --etcd-cacert, --etcd-cert and --etcd-key. Only with --etcd. Under the
// flags, KVWIRE_ETCD_* (ConnectorOptions::FromEnvironment, kvwire's one reader of them), as
// the etcd client took them before it stopped reading the environment.
absl::StatusOr<kvwire::discovery::EtcdOptions> EtcdAccessFromFlags(const Flags& f) {
  kvwire::discovery::EtcdOptions o;
  if (f.Has("etcd")) {
    absl::StatusOr<kvwire::ConnectorOptions> env =
        kvwire::ConnectorOptions::FromEnvironment(kvwire::ConnectorOptions());
    if (!env.ok()) return env.status();
    o.user = env->etcd_user;
    o.password = env->etcd_password;
    o.ca_file = env->etcd_ca_file;
    o.cert_file = env->etcd_cert_file;
    o.key_file = env->etcd_key_file;
  }
  const bool any = f.Has("etcd-user") || f.Has("etcd-password") || f.Has("etcd-password-file") ||
                   f.Has("etcd-cacert") || f.Has("etcd-cert") || f.Has("etcd-key");
  if (any && !f.Has("etcd")) {
    return absl::InvalidArgumentError(
        "--etcd-user/--etcd-password*/--etcd-cacert/--etcd-cert/"
        "--etcd-key need --etcd");
  }
  if (f.Has("etcd-password") && f.Has("etcd-password-file")) {
    return absl::InvalidArgumentError(
        "--etcd-password and --etcd-password-file exclude each other");
  }
  if ((f.Has("etcd-password") || f.Has("etcd-password-file")) != f.Has("etcd-user")) {
    return absl::InvalidArgumentError("--etcd-user and --etcd-password(-file) go together");
  }
  if (f.Has("etcd-user")) o.user = f.Get("etcd-user");
  if (f.Has("etcd-password-file")) {
    absl::StatusOr<std::string> p =
        kvwire::discovery::ReadPasswordFile(f.Get("etcd-password-file"));
    if (!p.ok()) return p.status();
    o.password = *std::move(p);
  } else if (f.Has("etcd-password")) {
    std::fprintf(stderr,
                 "kvwire-dsv4: warning: --etcd-password is visible to every local user (ps, "
                 "/proc/<pid>/cmdline); prefer --etcd-password-file\n");
    o.password = f.Get("etcd-password");
  }
  if (f.Has("etcd-cacert")) o.ca_file = f.Get("etcd-cacert");
  if (f.Has("etcd-cert")) o.cert_file = f.Get("etcd-cert");
  if (f.Has("etcd-key")) o.key_file = f.Get("etcd-key");
  return o;
}

int Weights(const Flags& f) {
  if (absl::Status s = f.Require({"config", "out"}); !s.ok()) return Fail(s);
  absl::StatusOr<Config> config = Config::FromFile(f.Get("config"));
  if (!config.ok()) return Fail(config.status());
  if (absl::Status s = GenerateWeights(*config, f.Get("out")); !s.ok()) return Fail(s);
  std::printf("wrote %s (config %s, seed %llu)\n", f.Get("out").c_str(), config->name.c_str(),
              static_cast<unsigned long long>(config->seed));
  return 0;
}

int Generate(const Flags& f) {
  if (absl::Status s = f.Require({"config", "weights", "prompt"}); !s.ok()) return Fail(s);
  absl::StatusOr<Config> config = Config::FromFile(f.Get("config"));
  if (!config.ok()) return Fail(config.status());
  absl::StatusOr<int64_t> max_tokens = f.GetInt("max-tokens", 32);
  absl::StatusOr<double> temperature = f.GetDouble("temperature", 0);
  absl::StatusOr<int64_t> seed = f.GetInt("seed", 0);
  absl::StatusOr<int64_t> threads = f.GetInt("threads", 0);
  absl::StatusOr<KvDevice> kv_device = ParseKvDevice(f.Get("kv-device", "cpu"));
  for (const absl::Status& s : {max_tokens.status(), temperature.status(), seed.status(),
                                threads.status(), kv_device.status()}) {
    if (!s.ok()) return Fail(s);
  }
  // The cache first: --kv-device gpu on a machine without one fails before the weights load.
  const uint64_t blocks = config->max_seq_len / 64 + 2;
  KvCacheOptions cache_options;
  cache_options.device = *kv_device;
  absl::StatusOr<std::unique_ptr<KvCache>> cache =
      KvCache::Create(*config, blocks, 1, 1, cache_options);
  if (!cache.ok()) return Fail(cache.status());
  absl::StatusOr<std::unique_ptr<Model>> model =
      Model::Load(*config, f.Get("weights"), static_cast<int>(*threads));
  if (!model.ok()) return Fail(model.status());
  GenerateOptions o;
  o.max_tokens = static_cast<int>(*max_tokens);
  o.temperature = static_cast<float>(*temperature);
  o.seed = static_cast<uint64_t>(*seed);
  for (const std::string& prompt : f.GetAll("prompt")) {
    absl::StatusOr<GenerateResult> r = dsv4::Generate(**model, **cache, prompt, o);
    if (!r.ok()) return Fail(r.status());
    const size_t n = r->prompt_tokens.size();
    json j = {
        {"prompt_tokens", n},
        {"kv_device", KvDeviceName(*kv_device)},
        {"tokens", r->tokens},
        {"text", r->text},
        {"prefill_ms", r->prefill_seconds * 1e3},
        {"decode_ms", r->decode_seconds * 1e3},
        {"prefill_tokens_per_s", n / std::max(1e-9, r->prefill_seconds)},
        {"decode_tokens_per_s",
         r->tokens.size() > 1 ? (r->tokens.size() - 1) / std::max(1e-9, r->decode_seconds) : 0.0}};
    std::printf("%s\n", Dump(j).c_str());
  }
  return 0;
}

int Serve(const Flags& f) {
  if (absl::Status s = f.Require({"role", "config", "weights"}); !s.ok()) return Fail(s);
  ModelServerOptions o;
  o.role = f.Get("role");
  o.config_path = f.Get("config");
  o.weights_path = f.Get("weights");
  o.host = f.Get("host", "127.0.0.1");
  o.kv_host = f.Get("kv-host", o.host);
  o.transport = f.Get("transport", "auto");
  o.mode = f.Get("mode", "auto");
  o.name = f.Get("name");
  o.etcd = f.Get("etcd");
  o.cluster = f.Get("cluster");
  if (o.etcd.empty() != o.cluster.empty()) {
    return Fail(absl::InvalidArgumentError("--etcd and --cluster go together"));
  }
  absl::StatusOr<kvwire::discovery::EtcdOptions> etcd_access = EtcdAccessFromFlags(f);
  if (!etcd_access.ok()) return Fail(etcd_access.status());
  o.etcd_user = etcd_access->user;
  o.etcd_password = etcd_access->password;
  o.etcd_ca_file = etcd_access->ca_file;
  o.etcd_cert_file = etcd_access->cert_file;
  o.etcd_key_file = etcd_access->key_file;
  o.corrupt_kv_page = f.Has("corrupt-kv-page") || getenv("KVWIRE_DSV4_CORRUPT_KV_PAGE") != nullptr;
  o.verify_kv = f.Has("verify-kv");
  absl::StatusOr<std::optional<std::string>> secret = SecretFromFlags(f);
  if (!secret.ok()) return Fail(secret.status());
  o.shared_secret = *std::move(secret);
  absl::StatusOr<int64_t> port = f.GetInt("port", 0), kv_port = f.GetInt("kv-port", 0),
                          blocks = f.GetInt("num-blocks", 0),
                          requests = f.GetInt("max-requests", 32), threads = f.GetInt("threads", 0),
                          max_queue = f.GetInt("max-queue", 128),
                          queue_wait = f.GetInt("max-queue-wait-s", 30),
                          timeout = f.GetInt("request-timeout-s", 60),
                          lease = f.GetInt("peer-lease-ms", 5000),
                          delay = f.GetInt("inject-delay-ms", 0),
                          seed = f.GetInt("allocation-seed", 0),
                          etcd_lease = f.GetInt("etcd-lease-s", 10),
                          per_source = f.GetInt("max-connections-per-source", 128),
                          max_logprobs = f.GetInt("max-logprobs", 20);
  for (const auto* v : {&port, &kv_port, &blocks, &requests, &threads, &timeout, &lease, &delay,
                        &seed, &max_queue, &queue_wait, &etcd_lease, &per_source, &max_logprobs}) {
    if (!v->ok()) return Fail(v->status());
  }
  o.port = static_cast<int>(*port);
  o.kv_port = static_cast<int>(*kv_port);
  o.num_blocks = static_cast<uint64_t>(*blocks);
  o.max_requests = static_cast<uint64_t>(std::max<int64_t>(1, *requests));
  o.threads = static_cast<int>(*threads);
  o.request_timeout = absl::Seconds(*timeout);
  o.peer_lease = absl::Milliseconds(*lease);
  o.inject_delay_ms = static_cast<int>(*delay);
  o.allocation_seed = static_cast<uint64_t>(*seed);
  o.max_queue = static_cast<uint64_t>(std::max<int64_t>(0, *max_queue));
  o.max_queue_wait = absl::Seconds(std::max<int64_t>(0, *queue_wait));
  o.etcd_lease_s = *etcd_lease;
  o.max_connections_per_source = static_cast<int>(std::clamp<int64_t>(*per_source, 1, 1 << 20));
  if (*max_logprobs < -1) return Fail(absl::InvalidArgumentError("--max-logprobs: -1 or >= 0"));
  o.max_logprobs = *max_logprobs;
  sigset_t set;
  BlockStopSignals(&set);
  absl::StatusOr<std::unique_ptr<ModelServer>> server = ModelServer::Start(o);
  if (!server.ok()) return Fail(server.status());
  std::printf("kvwire-dsv4 serve: role=%s listening on %s:%d, kv %s (transport %s, mode %s)\n",
              o.role.c_str(), o.host.c_str(), (*server)->port(), (*server)->kv_address().c_str(),
              o.transport.c_str(), o.mode.c_str());
  std::printf("kvwire-dsv4 serve: %s\n", (*server)->capacity().c_str());
  std::fflush(stdout);
  if (f.Has("ready-file")) {
    json ready = {{"port", (*server)->port()},
                  {"address", absl::StrCat(o.host, ":", (*server)->port())},
                  {"kv_address", (*server)->kv_address()},
                  {"pid", getpid()}};
    if (absl::Status s = WriteReadyFile(f.Get("ready-file"), ready); !s.ok()) return Fail(s);
  }
  const int sig = WaitForStop(&set);
  std::fprintf(stderr, "kvwire-dsv4 serve: signal %d, stopping\n", sig);
  server->reset();
  return 0;
}

int RouterMain(const Flags& f) {
  if (!f.Has("etcd")) {
    if (absl::Status s = f.Require({"prefill", "decode"}); !s.ok()) return Fail(s);
  }
  RouterOptions o;
  o.etcd = f.Get("etcd");
  absl::StatusOr<kvwire::discovery::EtcdOptions> etcd_access = EtcdAccessFromFlags(f);
  if (!etcd_access.ok()) return Fail(etcd_access.status());
  o.etcd_access = *std::move(etcd_access);
  o.cluster = f.Get("cluster");
  o.policy = f.Get("policy");
  for (const std::string& v : f.GetAll("prefill")) {
    for (absl::string_view a : absl::StrSplit(v, ',', absl::SkipEmpty())) o.prefill.emplace_back(a);
  }
  for (const std::string& v : f.GetAll("decode")) {
    for (absl::string_view a : absl::StrSplit(v, ',', absl::SkipEmpty())) o.decode.emplace_back(a);
  }
  o.mode = f.Get("mode", "read");
  o.host = f.Get("host", "127.0.0.1");
  absl::StatusOr<int64_t> port = f.GetInt("port", 0), timeout = f.GetInt("timeout-s", 300),
                          per_source = f.GetInt("max-connections-per-source", 64),
                          body_mib = f.GetInt("max-upstream-body-mib", 8),
                          forget_s = f.GetInt("forget-instance-s", 30);
  for (const auto* v : {&port, &timeout, &per_source, &body_mib, &forget_s}) {
    if (!v->ok()) return Fail(v->status());
  }
  o.port = static_cast<int>(*port);
  o.timeout = absl::Seconds(*timeout);
  o.max_connections_per_source = static_cast<int>(std::clamp<int64_t>(*per_source, 1, 1 << 20));
  o.max_upstream_body = static_cast<uint64_t>(std::clamp<int64_t>(*body_mib, 1, 4096)) << 20;
  o.forget_instance_after = absl::Seconds(std::clamp<int64_t>(*forget_s, 0, 86400));
  // The servers' secret: with etcd, instances must prove they hold it. KVWIRE_SECRET as the
  // servers' connectors take it when neither flag is given.
  absl::StatusOr<std::optional<std::string>> secret = SecretFromFlags(f);
  if (!secret.ok()) return Fail(secret.status());
  if (*secret) {
    o.secret = **secret;
  } else if (const char* env = getenv("KVWIRE_SECRET"); env != nullptr) {
    o.secret = env;
  }
  sigset_t set;
  BlockStopSignals(&set);
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(o);
  if (!router.ok()) return Fail(router.status());
  std::printf("kvwire-dsv4 router: mode=%s listening on %s:%d (%zu prefill, %zu decode)\n",
              o.mode.c_str(), o.host.c_str(), (*router)->port(), o.prefill.size(), o.decode.size());
  std::fflush(stdout);
  if (f.Has("ready-file")) {
    json ready = {{"port", (*router)->port()},
                  {"address", absl::StrCat(o.host, ":", (*router)->port())},
                  {"pid", getpid()}};
    if (absl::Status s = WriteReadyFile(f.Get("ready-file"), ready); !s.ok()) return Fail(s);
  }
  const int sig = WaitForStop(&set);
  std::fprintf(stderr, "kvwire-dsv4 router: signal %d, stopping\n", sig);
  router->reset();
  return 0;
}

int Main(int argc, char** argv) {
  if (argc < 2) return Usage();
  const std::string cmd = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  auto parse = [&](const std::set<std::string>& known, const std::set<std::string>& bools = {}) {
    return Flags::Parse(args, known, bools);
  };
  absl::StatusOr<Flags> f = absl::InvalidArgumentError("unknown subcommand");
  if (cmd == "weights") {
    f = parse({"config", "out"});
    if (f.ok()) return Weights(*f);
  } else if (cmd == "generate") {
    f = parse({"config", "weights", "prompt", "max-tokens", "temperature", "seed", "threads",
               "kv-device"});
    if (f.ok()) return Generate(*f);
  } else if (cmd == "serve") {
    f = parse({"role",
               "config",
               "weights",
               "host",
               "port",
               "kv-host",
               "kv-port",
               "transport",
               "mode",
               "name",
               "num-blocks",
               "max-requests",
               "max-queue",
               "max-queue-wait-s",
               "threads",
               "request-timeout-s",
               "peer-lease-ms",
               "inject-delay-ms",
               "allocation-seed",
               "ready-file",
               "secret",
               "secret-file",
               "etcd",
               "cluster",
               "etcd-lease-s",
               "etcd-user",
               "etcd-password",
               "etcd-password-file",
               "etcd-cacert",
               "etcd-cert",
               "etcd-key",
               "max-connections-per-source",
               "max-logprobs"},
              {"corrupt-kv-page", "verify-kv"});
    if (f.ok()) return Serve(*f);
  } else if (cmd == "router") {
    f = parse({"prefill",
               "decode",
               "mode",
               "host",
               "port",
               "timeout-s",
               "ready-file",
               "etcd",
               "cluster",
               "policy",
               "max-connections-per-source",
               "max-upstream-body-mib",
               "secret",
               "secret-file",
               "forget-instance-s",
               "etcd-user",
               "etcd-password",
               "etcd-password-file",
               "etcd-cacert",
               "etcd-cert",
               "etcd-key"});
    if (f.ok()) return RouterMain(*f);
  } else if (cmd == "demo") {
    f = parse(
        {"config", "weights", "work-dir", "max-tokens", "transports", "threads", "secret-file"});
    if (f.ok()) return RunDemo(*f, argv[0]);
  } else {
    return Usage();
  }
  std::fprintf(stderr, "kvwire-dsv4 %s: %s\n", cmd.c_str(),
               std::string(f.status().message()).c_str());
  return Usage();
}

}  // namespace
}  // namespace dsv4::serve

int main(int argc, char** argv) {
  return dsv4::serve::CommitPlantedDefectIfAsked(dsv4::serve::Main(argc, argv));
}

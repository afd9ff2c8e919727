// kvwire-dsv4 processes for the serving tests (e2e, load, soak, abuse, metrics, sampling,
// xpyd, hostile_http): weights generated into a temporary folder, servers and routers started
// with a ready file on loopback ports, restartable on their port, and stopped with SIGTERM at
// the end (each must exit cleanly, unless the test killed it). KVWIRE_DSV4_BIN and
// KVWIRE_DSV4_CONFIG come from CMake.
#ifndef KVWIRE_TESTS_DSV4_SERVE_SERVE_CLUSTER_H_
#define KVWIRE_TESTS_DSV4_SERVE_SERVE_CLUSTER_H_

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/process.h"

namespace dsv4::serve::test_support {

// Deadlines the tests give the servers (request timeout, admission wait) are scaled by this in
// sanitizer builds: the model runs several times slower there, on the same two cores, and a
// request that is merely slow must not be mistaken for one that was lost.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr int kServerDeadlineScale = 5;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr int kServerDeadlineScale = 5;
#else
inline constexpr int kServerDeadlineScale = 1;
#endif
#else
inline constexpr int kServerDeadlineScale = 1;
#endif

// A prompt of exactly `tokens` tokens (BOS + bytes), the same for the same length.
inline std::string PromptOfTokens(int tokens) {
  std::string s;
  for (int i = 0; i + 1 < tokens; ++i) s += static_cast<char>('a' + (i * 7 + tokens) % 26);
  return s;
}

// Polls `pred` every 20 ms until it holds or `timeout` passes; its last answer.
inline bool WaitFor(const std::function<bool()>& pred, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return pred();
}

// The flags every server and router of a cluster gets, and how their ends are judged.
struct ServeClusterOptions {
  std::string dir_tag = "load";  // the folder: /tmp/kvwire-dsv4-<dir_tag>-XXXXXX
  int threads = 1;
  // The peer lease is the servers' default: 2 s declared live peers dead on a loaded 2-core
  // machine (heartbeats late), failing their write-mode transfers.
  int peer_lease_ms = 5000;
  int request_timeout_s = 0;  // 0: the server's own default
  int router_timeout_s = 120;
  // False: a process that is no longer running at the end fails the test ("exited by
  // itself"). True: it passes when it ended cleanly or by the test's own SIGKILL
  // (StopAndJudge), for tests that kill servers on purpose.
  bool servers_may_end_early = false;
};

class ServeCluster {
 public:
  explicit ServeCluster(ServeClusterOptions options = {}) : options_(std::move(options)) {
    std::string tmpl = "/tmp/kvwire-dsv4-" + options_.dir_tag + "-XXXXXX";
    dir_ = mkdtemp(tmpl.data());
    weights_ = dir_ + "/tiny.safetensors";
  }
  ~ServeCluster() {
    for (auto& [name, p] : procs_) {
      if (options_.servers_may_end_early) {
        StopAndJudge(name, *p);
        continue;
      }
      if (!p->Running()) {
        if (killed_.count(name) == 0) {
          ADD_FAILURE() << name << " exited by itself (" << p->exit_code() << "):\n"
                        << p->LogTail();
        }
        continue;
      }
      p->Stop(SIGTERM, absl::Seconds(30));
      EXPECT_EQ(p->exit_code(), 0) << name << " did not stop cleanly:\n" << p->LogTail();
    }
    procs_.clear();
    if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir_);
  }
  ServeCluster(const ServeCluster&) = delete;
  ServeCluster& operator=(const ServeCluster&) = delete;

  // A server still running stops cleanly on SIGTERM, and one that ended before ended cleanly
  // or by the test's own SIGKILL (sanitizer reports, leaks included, make the exit code
  // non-zero): anything else fails the test.
  static void StopAndJudge(const std::string& name, Process& p) {
    if (p.Running()) p.Stop(SIGTERM, absl::Seconds(30));
    EXPECT_EQ(p.EndProblem(), "") << name << " did not end cleanly:\n" << p.LogTail();
  }

  const std::string& dir() const { return dir_; }

  // Runs a kvwire-dsv4 command to completion; returns its output.
  absl::StatusOr<std::string> Run(const std::string& name, const std::vector<std::string>& args,
                                  absl::Duration timeout = absl::Seconds(120)) {
    const std::string log = dir_ + "/" + name + ".log";
    absl::StatusOr<std::unique_ptr<Process>> p = Process::Start(KVWIRE_DSV4_BIN, args, log);
    if (!p.ok()) return p.status();
    absl::StatusOr<int> code = (*p)->Wait(timeout);
    if (!code.ok()) return code.status();
    if (*code != 0) {
      return absl::InternalError(absl::StrCat(name, " exited ", *code, ":\n", (*p)->LogTail()));
    }
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  absl::Status MakeWeights() {
    return Run("weights", {"weights", "--config", KVWIRE_DSV4_CONFIG, "--out", weights_}).status();
  }

  // Token ids `generate` produces for each prompt, in one process.
  absl::StatusOr<std::vector<std::vector<int32_t>>> Reference(
      const std::vector<std::string>& prompts, int max_tokens) {
    std::vector<std::string> args = {
        "generate", "--config",     KVWIRE_DSV4_CONFIG,      "--weights",
        weights_,   "--max-tokens", absl::StrCat(max_tokens)};
    for (const std::string& p : prompts) {
      args.push_back("--prompt");
      args.push_back(p);
    }
    absl::StatusOr<std::string> out = Run("generate", args);
    if (!out.ok()) return out.status();
    std::vector<std::vector<int32_t>> tokens;
    for (absl::string_view line : absl::StrSplit(*out, '\n')) {
      if (line.empty() || line[0] != '{') continue;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.contains("tokens")) continue;
      tokens.push_back(j["tokens"].get<std::vector<int32_t>>());
    }
    if (tokens.size() != prompts.size()) {
      return absl::InternalError(absl::StrCat("generate printed ", tokens.size(), " results for ",
                                              prompts.size(), " prompts:\n", *out));
    }
    return tokens;
  }

  // A model server with the common flags (ServeClusterOptions) and `extra` (not repeating
  // them). Returns its address.
  absl::StatusOr<std::string> Serve(const std::string& name, const std::string& role,
                                    const std::string& transport,
                                    const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"serve",
                                     "--role",
                                     role,
                                     "--config",
                                     KVWIRE_DSV4_CONFIG,
                                     "--weights",
                                     weights_,
                                     "--transport",
                                     transport,
                                     "--mode",
                                     "auto",
                                     "--threads",
                                     absl::StrCat(options_.threads)};
    if (options_.request_timeout_s > 0) {
      args.push_back("--request-timeout-s");
      args.push_back(absl::StrCat(options_.request_timeout_s));
    }
    args.push_back("--peer-lease-ms");
    args.push_back(absl::StrCat(options_.peer_lease_ms));
    args.insert(args.end(), extra.begin(), extra.end());
    return Launch(name, args);
  }

  absl::StatusOr<std::string> Router(const std::string& name, const std::string& prefill,
                                     const std::string& decode, const std::string& mode) {
    return Launch(name, {"router", "--prefill", prefill, "--decode", decode, "--mode", mode,
                         "--timeout-s", absl::StrCat(options_.router_timeout_s)});
  }

  Process& process(const std::string& name) { return *procs_.at(name); }
  // Hands a server over to the test, which then judges its end itself.
  std::unique_ptr<Process> Take(const std::string& name) {
    std::unique_ptr<Process> p = std::move(procs_.at(name));
    procs_.erase(name);
    return p;
  }

  // SIGKILL, then the same command again on the same HTTP port. Call it from the thread that
  // will outlive the process: a child dies with the thread that started it
  // (PR_SET_PDEATHSIG).
  absl::Status KillAndRestart(const std::string& name) {
    procs_.at(name)->Stop(SIGKILL);
    std::vector<std::string> args = args_.at(name);
    args.push_back("--port");
    args.push_back(std::to_string(ports_.at(name)));
    return Launch(name, args).status();
  }

  // Any kvwire-dsv4 command that writes a ready file (a router discovering through etcd).
  absl::StatusOr<std::string> Start(const std::string& name, std::vector<std::string> args) {
    return Launch(name, std::move(args));
  }

  // SIGKILL on purpose: the process may be gone at teardown without failing the test.
  void Kill(const std::string& name) {
    killed_.insert(name);
    procs_.at(name)->Stop(SIGKILL);
  }

  // SIGTERM to one process, which must exit cleanly; it is forgotten.
  void StopOne(const std::string& name) {
    auto it = procs_.find(name);
    if (it == procs_.end()) return;
    it->second->Stop(SIGTERM, absl::Seconds(30));
    EXPECT_EQ(it->second->exit_code(), 0) << name << " did not stop cleanly:\n"
                                          << it->second->LogTail();
    procs_.erase(it);
  }

  // The process id of a running server or router (e.g. for its /proc/<pid>/status).
  pid_t Pid(const std::string& name) const { return procs_.at(name)->pid(); }

  std::string Logs() const {
    std::string all;
    for (const auto& [name, p] : procs_) absl::StrAppend(&all, "--- ", name, "\n", p->LogTail());
    return all;
  }

 private:
  absl::StatusOr<std::string> Launch(const std::string& name, std::vector<std::string> args) {
    const std::string ready = dir_ + "/" + name + ".ready";
    std::filesystem::remove(ready);
    if (args_.count(name) == 0) args_[name] = args;
    args.push_back("--ready-file");
    args.push_back(ready);
    absl::StatusOr<std::unique_ptr<Process>> p =
        Process::Start(KVWIRE_DSV4_BIN, args, dir_ + "/" + name + ".log");
    if (!p.ok()) return p.status();
    absl::StatusOr<nlohmann::json> j = WaitForReadyFile(ready, **p, absl::Seconds(60));
    if (!j.ok()) {
      return absl::Status(j.status().code(),
                          absl::StrCat(name, ": ", j.status().message(), "\n", (*p)->LogTail()));
    }
    procs_[name] = std::move(*p);
    ports_[name] = (*j)["port"].get<int>();
    return (*j)["address"].get<std::string>();
  }

  const ServeClusterOptions options_;
  std::string dir_, weights_;
  std::map<std::string, std::unique_ptr<Process>> procs_;
  std::map<std::string, std::vector<std::string>> args_;
  std::map<std::string, int> ports_;
  std::set<std::string> killed_;
};

}  // namespace dsv4::serve::test_support

#endif  // KVWIRE_TESTS_DSV4_SERVE_SERVE_CLUSTER_H_

// ModelServer::Impl (model_server.h), shared by the files that implement it, one job each:
//   model_server.cc             start-up (model, KV cache, connector, HTTP), shutdown, the
//                               worker thread's loop, the public facade
//   model_server_http.cc        HTTP thread: routes, request checks, queued jobs, /health,
//                               /metrics, attestation
//   model_server_admission.cc   worker: the admission queue (admission.h), refusals, releases
//                               of refused hand-offs, dispatch to the roles
//   model_server_prefill.cc     worker: the prefill role (read and write mode hand-offs)
//   model_server_decode.cc      worker: the decode role (prepare, load, first token)
//   model_server_generation.cc  worker: local prefill, token steps, sampling, streaming, the
//                               answer, and a request's ends (finish, cancel)
//
// One worker thread owns the model, the cache's allocations and the connector's scheduler and
// worker calls; the HTTP thread only queues jobs (under mu_) and reads counters (atomics).
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_MODEL_SERVER_IMPL_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_MODEL_SERVER_IMPL_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "examples/dsv4/model/config.h"
#include "examples/dsv4/model/kv_cache.h"
#include "examples/dsv4/model/model.h"
#include "examples/dsv4/model/tokenizer.h"
#include "examples/dsv4/serve/admission.h"
#include "examples/dsv4/serve/choices.h"
#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/generation_output.h"
#include "examples/dsv4/serve/http_server.h"
#include "examples/dsv4/serve/model_server.h"
#include "examples/dsv4/serve/request_check.h"
#include "examples/dsv4/serve/sampler.h"
#include "kvwire/connector.h"
#include "src/util/mutex.h"

namespace dsv4::serve {

class ModelServer::Impl {
 public:
  explicit Impl(ModelServerOptions options) : options_(std::move(options)) {}
  ~Impl();

  absl::Status Init();
  int port() const { return http_->port(); }
  std::string kv_address() const { return connector_->engine().address(); }
  const std::string& capacity() const { return capacity_; }

 private:
  static constexpr char kLog[] = "dsv4-serve";

  struct Job {
    enum class Kind { kCompletion, kPrepare, kAbort, kRelease } kind = Kind::kCompletion;
    CompletionRequest req;
    std::string transfer_id;                     // kAbort
    std::string release_params, release_reason;  // kRelease (handoff_release.h)
    std::shared_ptr<Responder> resp;
    absl::Time arrived;
  };

  // A request that holds blocks on this server across worker iterations: a decode (loading,
  // then generating) or a local generation.
  struct Active {
    std::string id;
    bool remote = false;  // KV comes from a prefill server
    bool loading = false;
    bool load_done = false, load_failed = false;
    std::string load_error;
    bool aborting = false;  // blocks go back once the connector has reported the load
    CompletionRequest req;
    std::shared_ptr<Responder> resp;  // null: prepared (write mode), not yet claimed
    std::vector<int32_t> prompt;
    kvwire::BlockTable blocks;
    std::vector<int32_t> out;
    std::string transfer_id, peer;
    std::optional<Sampler> sampler;  // set when the request's answer goes to a client
    GenerationOutput output;         // what the client sees of `out`
    absl::Time arrived, claimed, load_start, load_end, decode_start, deadline;
    double prefill_ms = 0;
    nlohmann::json transfer;  // per-request transfer stats once loaded
    bool corrupted = false;
  };

  static double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

  // The tokens a request runs: its token ids as given, or BOS and the bytes of its text.
  // PromptTokenCount (request_check.h) counts them without encoding: the one count that the
  // request checks and KV admission use, so that a token-id prompt (whose `prompt` text is
  // empty) is counted as what it is, not as one BOS.
  static std::vector<int32_t> PromptTokens(const CompletionRequest& req) {
    return req.prompt_ids ? *req.prompt_ids : Encode(req.prompt);
  }

  // Tokens of an n-token prompt whose KV moves from prefill to decode: all but the last, which
  // decode runs again for the logits of its first token (as vLLM's scheduler does), so that no
  // sampled token has to travel with the KV. Rerunning the last token rewrites its own slots
  // with the same values and recomputes a compression window it completes from the ring slots
  // that moved; a one-token prompt moves whole.
  static uint64_t KvTokens(uint64_t n) { return n > 1 ? n - 1 : n; }

  static std::string DecodeTokens(std::span<const int32_t> tokens) { return Decode(tokens); }

  // --- HTTP thread (model_server_http.cc) -----------------------------------------------------
  void Handle(const HttpRequest& r, std::shared_ptr<Responder> resp);
  void StartChoices(const std::string& path, const HttpRequest& r, int n, bool stream,
                    const std::shared_ptr<Responder>& resp);
  void QueueRelease(std::optional<std::string> params, absl::string_view why);
  void Attest(const std::string& target, Responder& resp) const;
  absl::StatusOr<CompletionRequest> ParseRequest(const std::string& path,
                                                 const std::string& body) const;
  std::string Metrics() const;
  void AddLoadHealth(nlohmann::json& j) const;

  // --- worker thread (model_server.cc) --------------------------------------------------------
  void Loop();
  void Shutdown();
  void PollConnector();
  std::string NewId() { return absl::StrCat("cmpl-", getpid(), "-", ++seq_); }
  void Fail(const std::shared_ptr<Responder>& resp, int status, const std::string& message);
  void Delay() {
    if (options_.inject_delay_ms > 0) absl::SleepFor(absl::Milliseconds(options_.inject_delay_ms));
  }

  // --- admission (model_server_admission.cc) --------------------------------------------------
  void ReleaseHandOff(const CompletionRequest& req, absl::string_view why);
  void ReleaseHandOff(const std::string& params, absl::string_view why);
  void AdmitGuarded(Job& job);
  void Enqueue(Job& job);
  std::optional<uint64_t> TokensToHold(const Job& job) const;
  void PumpAdmission();
  BlockCounts Available() const;
  uint64_t HeldBlocks() const;
  void Overloaded(const std::shared_ptr<Responder>& resp, const std::string& message);
  void Admit(Job& job);

  // --- prefill (model_server_prefill.cc) ------------------------------------------------------
  void RunPrefill(Job& job);
  void Release(const std::string& id, kvwire::BlockTable& blocks, uint64_t n,
               const std::string& params, bool aborted = true);

  // --- decode (model_server_decode.cc) --------------------------------------------------------
  bool StartLoad(Active& a, const std::shared_ptr<Responder>& resp);
  void Prepare(Job& job);
  void StartDecode(Job& job);
  void Loaded(Active& a);

  // --- generation (model_server_generation.cc) ------------------------------------------------
  void StartLocal(Job& job);
  // A request that starts now: its id, prompt, sampling state, arrival and deadline.
  Active ActiveFrom(const Job& job);
  void Step(Active& a);
  static void InitSampling(Active& a);
  void Emit(Active& a, const Sampled& sampled);
  bool Advance(Active& a);
  void Cancel(Active& a, const std::string& why);
  void Finish(Active& a);

  const ModelServerOptions options_;
  std::string capacity_;
  Config config_;
  ServerLimits limits_;  // set in Init
  std::unique_ptr<Model> model_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<kvwire::Connector> connector_;
  std::unique_ptr<HttpServer> http_;
  std::atomic<int> http_port_{0};  // for handlers, which run before http_ is assigned
  std::unique_ptr<ChoicesRunner> choices_ = std::make_unique<ChoicesRunner>();
  std::thread worker_;
  uint64_t total_blocks_ = 0;  // over the paged groups (set in Init)
  std::string attest_secret_;  // the engine's shared secret (set in Init; empty: none)

  kvwire::Mutex mu_;
  kvwire::CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);

  // Worker thread only.
  std::map<std::string, Active> active_;
  std::map<std::string, std::string> prepared_;     // transfer id -> request id
  std::map<std::string, kvwire::BlockTable> held_;  // prefill: until finished_sending
  uint64_t seq_ = 0;

  std::unique_ptr<AdmissionQueue<Job>> admission_;  // queue: worker only; stats: any thread
  std::atomic<int> active_count_{0}, held_count_{0}, prefilling_{0};
  std::atomic<uint64_t> held_blocks_{0};
  std::atomic<uint64_t> requests_ok_{0}, requests_error_{0}, prompt_tokens_{0},
      generated_tokens_{0}, prefill_us_{0}, decode_us_{0}, load_wait_us_{0};
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_MODEL_SERVER_IMPL_H_

// kvwire::SchedulerHalf: the scheduler half of a KV connector whose scheduler runs apart from
// its workers (vLLM's engine core: no engine, no KV memory in that process).
//
// It decides per request and says what the workers must do each step, as JSON
// (BuildConnectorMeta): "loads" (decode: start a load), "saves" (prefill, write mode: push the
// KV once the last prompt chunk is computed), "holds" (prefill, read mode: keep the blocks for
// a reader under a transfer id), "finishes" (the scheduler finished a request the workers
// still move), "failed" (decode loads refused before they started) and "releases" (decode
// will not load a prefill's hand-off). Each worker replays those on its kvwire::Connector.
//
// This is the one implementation of the scheduler's decisions for vLLM's plugin
// (python/kvwire/vllm_scheduler.py converts vLLM's objects and calls it): matching of remote
// prefills, transfer ids (the connector's own CSPRNG ids), the kv_transfer_params a prefill
// hands off (KvTransferParams, vLLM's names), and the bookkeeping of asynchronous loads.
//
// Calls never fail on what a request carries: a bad kv_transfer_params becomes a failed load
// (decode) or no hand-off (prefill), with the reason in TakeLog(), because an error thrown
// into a serving engine's scheduler loop would end it. Not thread-safe: one scheduler thread
// calls it (vLLM's), as it calls the connector.
#ifndef KVWIRE_SCHEDULER_HALF_H_
#define KVWIRE_SCHEDULER_HALF_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

#include "kvwire/connector.h"
#include "kvwire/layout.h"

namespace kvwire {

struct SchedulerHalfOptions {
  std::string engine_id;  // the instance's engine id (remote_engine_id of its hand-offs)
  KvMode mode = KvMode::kAuto;
  // The KV cache groups in the framework's order: a request's block lists are per group, in
  // this order. Names "0", "1", ... make kv_transfer_params carry per-group lists.
  std::vector<std::string> groups = {"0"};
  uint64_t block_size = 16;  // tokens per block (the first group's: prefix hits are whole blocks)
  int tp_size = 1;
  std::string host_ip;  // the host named in hand-offs instead of the workers' own ("": theirs)
};

// A worker's control address (its handshake), per tensor-parallel rank.
struct SchedulerWorker {
  std::string engine_id;
  std::string address;  // host:port
  std::string host;     // "" : the address's host
};

// One step of the scheduler's output, as far as the connector needs it.
struct SchedulerStep {
  std::map<std::string, uint64_t> scheduled_tokens;  // request -> tokens scheduled this step
  // request -> its computed tokens before this step, where the output says (else tracked)
  std::map<std::string, uint64_t> computed_tokens;
  // request -> blocks allocated this step, per group
  std::map<std::string, std::vector<std::vector<int64_t>>> new_blocks;
};

using BlockLists = std::vector<std::vector<int64_t>>;

class SchedulerHalf {
 public:
  // Log levels of TakeLog(), Python's numbers (the plugin logs through Python's logging).
  static constexpr int kInfo = 20, kWarning = 30, kError = 40;

  static absl::StatusOr<std::unique_ptr<SchedulerHalf>> Create(SchedulerHalfOptions options);
  ~SchedulerHalf();
  SchedulerHalf(const SchedulerHalf&) = delete;
  SchedulerHalf& operator=(const SchedulerHalf&) = delete;

  // The workers' handshakes, by rank (rank 0's address goes into hand-offs).
  void SetWorkers(std::map<int, SchedulerWorker> workers);
  std::optional<SchedulerWorker> Worker(int rank) const;

  // Decode (do_remote_prefill): the prompt tokens past the local prefix come from the prefill,
  // asynchronously. No side effects (a scheduler may ask again).
  MatchResult GetNumNewMatchedTokens(const std::string& request_id, uint64_t prompt_tokens,
                                     uint64_t num_computed_tokens, const std::string& params);
  // Blocks allocated (per group). computed_tokens: the request's computed tokens now.
  void UpdateStateAfterAlloc(const std::string& request_id, uint64_t prompt_tokens,
                             uint64_t computed_tokens, const std::string& params,
                             const BlockLists& blocks, uint64_t num_external_tokens);
  // This step's work for the workers (JSON, the fields above); the queues empty.
  std::string BuildConnectorMeta(const SchedulerStep& step);
  // The request ended. hands_off: it ran to its hand-off (prefill: max_tokens reached or a
  // stop token), else it was aborted or failed. flat: the framework passed one flat block
  // list (the hand-off then carries one). Returns delay_free and, in read mode, the
  // kv_transfer_params for the decode.
  RequestFinishedResult RequestFinished(const std::string& request_id, uint64_t prompt_tokens,
                                        const std::string& params, const BlockLists& blocks,
                                        bool hands_off, bool flat);
  // The workers reported these done.
  void UpdateConnectorOutput(const std::vector<std::string>& finished_recving,
                             const std::vector<std::string>& finished_sending);
  // Saves queued or on the way (vLLM's has_pending_push_work).
  bool PendingPushWork() const;
  // What happened since the last call that the caller should log: (level, message).
  std::vector<std::pair<int, std::string>> TakeLog();
  // The requests it tracks and their transfer ids, as JSON (tests, debugging).
  std::string StateJson() const;

  class Impl;

 private:
  explicit SchedulerHalf(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvwire

#endif  // KVWIRE_SCHEDULER_HALF_H_

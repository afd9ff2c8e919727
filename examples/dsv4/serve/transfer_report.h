// What a decode server reports about the KV transfer of one request (the "transfer" object of
// its last stream chunk or response, under "kvwire"), and the fault injection that corrupts
// one received page (--corrupt-kv-page). Split out of model_server.cc: these read the
// connector's statistics and the cache, nothing of the server's own state.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_TRANSFER_REPORT_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_TRANSFER_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/time/time.h"

#include "examples/dsv4/model/kv_cache.h"
#include "kvwire/connector.h"

namespace dsv4::serve {

// The request's transfer as the connector counted it: request and transfer ids, peer, mode,
// bytes, pages (ops before merging), ops, transfer_ms (first to last byte), gbps (decimal),
// and the transport of the live peer it came from.
nlohmann::json TransferJson(kvwire::Connector& connector, const std::string& request_id,
                            const std::string& transfer_id, const std::string& peer);

// Write mode: the plan lives on the prefill; both layouts are the same, so the bytes and pages
// of the push follow from this side's `blocks` for `kv_tokens` tokens (ops and gbps, which
// this side did not see, are dropped). tail_ms: from the prefill's Forward returning
// (`prefill_computed_unix_us`) to the last layer landing here (`load_end`); negative when the
// layers had landed before it returned (the final norm and the logits come after them).
void AddWriteModeTransfer(const kvwire::Layout& layout, const kvwire::BlockTable& blocks,
                          uint64_t kv_tokens, std::optional<int64_t> prefill_computed_unix_us,
                          absl::Time load_end, nlohmann::json& transfer);

// Fault injection: flips the sign of every fp8 NoPE value of the last SWA page that moved (of
// `kv_tokens` tokens) in the first layer, so the next token attends to it. False when there is
// no such page.
bool CorruptLastMovedSwaPage(KvCache& cache, const kvwire::BlockTable& blocks, uint64_t kv_tokens,
                             const std::string& request_id);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_TRANSFER_REPORT_H_

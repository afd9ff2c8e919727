// A decode server that refuses a request carrying a prefill's read-mode hand-off (a bad
// parameter, overload, a deadline) tells that prefill to free the blocks it holds for the
// request at once (Connector::ReleaseUnread), instead of holding them until their lease ends:
// vLLM's proxies send the same request to prefill first, so a parameter only decode refuses
// would otherwise leave a prefill's blocks held for a reader that never comes.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_HANDOFF_RELEASE_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_HANDOFF_RELEASE_H_

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "examples/dsv4/serve/completion_api.h"

namespace dsv4::serve {

// The kv_transfer_params (null fields dropped, as JSON) of a read-mode hand-off: an object
// with do_remote_prefill true and a transfer_id, not in write mode (there the decode's own
// blocks receive the KV and prefill holds nothing). nullopt otherwise.
std::optional<std::string> UnreadHandOff(const nlohmann::json& kv_transfer_params);
// The same, for a request body that may have failed to parse as a request: read within
// kHttpJsonLimits; a body that is not a JSON object has none.
std::optional<std::string> UnreadHandOffInBody(const std::string& body);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_HANDOFF_RELEASE_H_

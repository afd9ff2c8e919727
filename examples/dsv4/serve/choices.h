// `n` > 1 (several choices for one prompt), as vLLM's parallel sampling: the request runs as n
// requests for one choice each, choice i sampling with seed + i when the request has a seed
// (each draws its own otherwise), sent to the server itself (a model server, or the router:
// there each choice is a whole prefill/decode hand-off). Their answers come back as one: the
// choices with their index, the usage summed; a stream relays every choice's chunks as they
// come (index rewritten), then the summed usage (when asked for) and [DONE].
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_CHOICES_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_CHOICES_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/time/time.h"

#include "examples/dsv4/serve/http_server.h"
#include "src/util/mutex.h"

namespace dsv4::serve {

// The body of choice `index` of `body` (a request with "n" > 1).
nlohmann::json ChoiceRequest(const nlohmann::json& body, int index);

// Sends the n one-choice requests of `body` to `address` (POST `path`) at once and answers
// `resp` (see above). Blocks until every one ended; `cancelled` (polled) stops them.
void RunChoices(const std::string& address, const std::string& path, const nlohmann::json& body,
                int n, bool stream, Responder& resp, absl::Time deadline,
                const std::function<bool()>& cancelled);

// Threads that run RunChoices off an HTTP server's I/O thread; joined when destroyed.
class ChoicesRunner {
 public:
  ChoicesRunner() = default;
  ~ChoicesRunner();
  ChoicesRunner(const ChoicesRunner&) = delete;
  ChoicesRunner& operator=(const ChoicesRunner&) = delete;

  // Runs `work` on a thread of its own; false when no thread could be started.
  bool Start(std::function<void()> work);

 private:
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  kvwire::Mutex mu_;
  std::vector<Worker> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_CHOICES_H_

// One HTTP/1.1 POST on Boost.Beast with a deadline for the whole exchange, for the etcd
// client (the library cannot use examples/dsv4/serve/http_client, which sits above it). The
// body can be taken piece by piece (etcd's watch stream), and another thread can end the
// exchange at once with Cancel().
#ifndef KVWIRE_SRC_DISCOVERY_HTTP_EXCHANGE_H_
#define KVWIRE_SRC_DISCOVERY_HTTP_EXCHANGE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/util/mutex.h"

namespace kvwire::discovery {

struct HttpReply {
  int status = 0;
  std::string body;  // empty when the caller took the body piece by piece
};

class HttpExchange {
 public:
  HttpExchange();
  ~HttpExchange();
  HttpExchange(const HttpExchange&) = delete;
  HttpExchange& operator=(const HttpExchange&) = delete;

  // POSTs `body` (JSON) to http://host:port`target`. `on_body`, when set, receives the body
  // as it arrives (after a 200 status; any other status collects the body for the error) and
  // returns false to stop. Errors: Unavailable when no connection was made (nothing was sent),
  // DeadlineExceeded at `deadline`, Aborted when the connection failed after it was made,
  // Cancelled after Cancel(). Body over `max_body` bytes: ResourceExhausted.
  absl::StatusOr<HttpReply> Post(const std::string& host, int port, const std::string& target,
                                 const std::string& body, absl::Time deadline,
                                 const std::function<bool(std::string_view)>& on_body = nullptr,
                                 size_t max_body = 16 << 20);

  // Ends a Post in progress (or the next one) with Cancelled; callable from any thread.
  void Cancel();

 private:
  struct State;
  // Post runs on one thread; Cancel may come from another while it does.
  Mutex mu_;
  std::unique_ptr<State> state_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// "http://host:port" (or "host:port") → host and port. https is refused: the client speaks
// plain HTTP (put an etcd gRPC proxy or a local member in front of a TLS cluster).
absl::Status ParseEndpoint(const std::string& url, std::string* host, int* port);

}  // namespace kvwire::discovery

#endif  // KVWIRE_SRC_DISCOVERY_HTTP_EXCHANGE_H_

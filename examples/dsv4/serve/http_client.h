// A blocking HTTP/1.1 client call on Boost.Beast with one deadline for the whole exchange,
// for the router (upstream calls), the demo and the tests. The body can be consumed as it
// arrives (server-sent events).
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_HTTP_CLIENT_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_HTTP_CLIENT_H_

#include <functional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dsv4::serve {

struct HttpResponse {
  int status = 0;
  std::string content_type;
  std::string retry_after;  // the Retry-After header ("" when absent)
  std::string body;         // empty when HttpCallOptions::on_body consumed it
};

struct HttpCallOptions {
  absl::Time deadline = absl::Now() + absl::Seconds(30);
  // Called once the status line and headers are in.
  std::function<void(const HttpResponse& head)> on_headers;
  // Receives the body piece by piece (chunked encoding removed); returning false stops the
  // call (Cancelled). Unset: the body is collected into HttpResponse::body.
  std::function<bool(std::string_view piece)> on_body;
  // The most body bytes accepted (the whole answer, streamed or not); beyond it the call
  // ends with ResourceExhausted and whatever was read is dropped.
  uint64_t body_limit = 256ull << 20;
  // Polled every `poll_interval` while the call waits: true stops the call (Cancelled) and
  // closes its connection, so the server sees its client go (the router's client left while
  // a non-streamed answer, which sends nothing until it is complete, was being computed).
  std::function<bool()> cancelled;
  absl::Duration poll_interval = absl::Milliseconds(50);
};

// `address` is "host:port". Errors: Unavailable when no connection could be made (nothing
// was sent), DeadlineExceeded when the deadline passed, Aborted when the connection failed
// or closed after the request went out (a server that died mid-request), ResourceExhausted
// when the answer's body passed HttpCallOptions::body_limit, Cancelled when on_body or
// cancelled stopped it.
absl::StatusOr<HttpResponse> HttpCall(const std::string& address, const std::string& method,
                                      const std::string& target, const std::string& body,
                                      const HttpCallOptions& options = HttpCallOptions());

// "host:port" → host and port; false when malformed.
bool SplitHostPort(const std::string& address, std::string* host, int* port);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_HTTP_CLIENT_H_

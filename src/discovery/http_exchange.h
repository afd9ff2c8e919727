// One HTTP/1.1 POST on Boost.Beast with a deadline for the whole exchange, for the etcd
// client (the library cannot use examples/dsv4/serve/http_client, which sits above it), over
// plain TCP or TLS (https:// endpoints). The body can be taken piece by piece (etcd's watch
// stream), and another thread can end the exchange at once with Cancel().
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

namespace boost::asio::ssl {
class context;
}  // namespace boost::asio::ssl

namespace kvwire::discovery {

// Where a POST goes: host, port, and TLS (an https:// endpoint).
struct HttpEndpoint {
  std::string host;
  int port = 0;
  bool tls = false;
};

// What travels with every POST of one client.
struct HttpExchangeOptions {
  // For TLS endpoints: trusted CAs and the client's certificate (MakeTlsContext). The
  // member's certificate must be valid for the endpoint's host (name or IP address).
  boost::asio::ssl::context* tls = nullptr;
  // The Authorization header ("" for none): etcd's auth token.
  std::string authorization;
};

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
  // A TLS endpoint needs options.tls; a member whose certificate does not verify is
  // Unavailable (nothing was sent), naming the TLS error.
  absl::StatusOr<HttpReply> Post(const HttpEndpoint& endpoint, const std::string& target,
                                 const std::string& body, absl::Time deadline,
                                 const std::function<bool(std::string_view)>& on_body = nullptr,
                                 size_t max_body = 16 << 20,
                                 const HttpExchangeOptions& options = HttpExchangeOptions());

  // Ends a Post in progress (or the next one) with Cancelled; callable from any thread.
  void Cancel();

 private:
  struct State;
  // Post runs on one thread; Cancel may come from another while it does.
  Mutex mu_;
  std::unique_ptr<State> state_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// "http://host:port" (or "host:port") → host and port; "https://host:port" → the same with
// tls set.
absl::Status ParseEndpoint(const std::string& url, HttpEndpoint* endpoint);

// A TLS client context: verifies servers against `ca_file` (PEM; empty: the system's CAs)
// and presents `cert_file`/`key_file` (PEM; both or neither) to members that require a client
// certificate. Errors name the file that could not be used.
absl::StatusOr<std::shared_ptr<boost::asio::ssl::context>> MakeTlsContext(
    const std::string& ca_file, const std::string& cert_file, const std::string& key_file);

}  // namespace kvwire::discovery

#endif  // KVWIRE_SRC_DISCOVERY_HTTP_EXCHANGE_H_

// A small HTTP/1.1 server on Boost.Beast for the dsv4 servers and the router: one io_context
// thread accepts connections and reads one request each (Connection: close); the handler runs
// on that thread and answers through a Responder, which may be used from any thread (the model
// worker, a router thread) and may stream server-sent events. Every read and write has a
// deadline.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_HTTP_SERVER_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dsv4::serve {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path (query string included)
  std::string body;
};

class Session;

// Answers one request. Thread-safe. Exactly one of Respond / StartEvents should be used;
// a Responder dropped without an answer sends 500.
class Responder {
 public:
  explicit Responder(std::shared_ptr<Session> session);
  ~Responder();
  Responder(const Responder&) = delete;
  Responder& operator=(const Responder&) = delete;

  void Respond(int status, std::string body, std::string content_type = "application/json");
  // A JSON error body {"error": {"message", "type", "code"}} with `status`.
  void Error(int status, const std::string& message);
  // Error() with a Retry-After header (whole seconds, at least 1), for an overloaded server
  // (503) so that clients back off rather than retry at once.
  void ErrorRetryAfter(int status, const std::string& message, absl::Duration retry_after);
  // 200, text/event-stream, chunked; then Event() for each "data: ..." and EndEvents().
  void StartEvents();
  void Event(const std::string& data);
  // Sends "data: [DONE]" (when `done`) and ends the stream.
  void EndEvents(bool done = true);
  // Sends raw body bytes of a started stream (the router forwards upstream SSE unchanged).
  void Raw(std::string bytes);
  bool answered() const { return answered_.load(); }
  bool streaming() const { return streaming_.load(); }
  // The client went away (its connection closed or failed).
  bool closed() const;
  // Bytes queued for the client and not yet written: a relay (the router forwarding a
  // stream) waits while this is high rather than hold what a slow reader has not taken.
  uint64_t pending_bytes() const;

 private:
  std::shared_ptr<Session> session_;
  std::atomic<bool> answered_{false};
  std::atomic<bool> streaming_{false};
  std::atomic<bool> ended_{false};
};

// A JSON error body as OpenAI-style servers send it.
std::string ErrorJson(int status, const std::string& message);

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: a free port (see HttpServer::port())
  // For the whole request (headers and body), however slowly it trickles in: 408 after it.
  absl::Duration read_timeout = absl::Seconds(10);
  // For each write of the answer (a client that stops reading is dropped).
  absl::Duration write_timeout = absl::Seconds(30);
  uint64_t body_limit = 4 << 20;     // 413 beyond it
  uint32_t header_limit = 64 << 10;  // 431 beyond it
  // Connections open at once (being read, or waiting for their answer); one more is answered
  // 503 and closed at once, so a flood costs neither file descriptors nor memory.
  int max_connections = 256;
  // Connections open at once from one source address (as the control port's handshakes):
  // one host that opens and holds connections (slow loris) is refused past this, and the
  // other max_connections - max_connections_per_source slots stay free for everyone else.
  // A model server's clients are routers (one address each, one connection per request in
  // flight): its cap must cover a router's --max-inflight.
  int max_connections_per_source = 64;
};

class HttpServer {
 public:
  using Handler = std::function<void(const HttpRequest&, std::shared_ptr<Responder>)>;
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                           Handler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  // Times accept failed (out of descriptors or buffers) and the server paused before trying
  // again: for tests that must know the failure happened.
  uint64_t accept_failures() const;

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_HTTP_SERVER_H_

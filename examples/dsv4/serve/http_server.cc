#include "examples/dsv4/serve/http_server.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <optional>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "boost/asio.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"

#include "src/util/log.h"

namespace dsv4::serve {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

std::string ErrorJson(int status, const std::string& message) {
  const char* type = status == 400   ? "invalid_request_error"
                     : status == 404 ? "not_found"
                     : status == 408 ? "request_timeout"
                     : status == 413 ? "request_too_large"
                     : status == 431 ? "request_header_fields_too_large"
                     : status == 502 ? "bad_gateway"
                     : status == 503 ? "service_unavailable"
                     : status == 504 ? "timeout"
                                     : "server_error";
  nlohmann::json j = {{"error", {{"message", message}, {"type", type}, {"code", status}}}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// One connection: reads a request, hands it to the handler, writes what the Responder queues,
// then closes. All socket work happens on the io thread; Responders post to it.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, std::string source, const HttpServerOptions& options,
          const HttpServer::Handler& handler)
      : source_(std::move(source)),
        socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        write_timer_(socket_.get_executor()),
        options_(options),
        handler_(handler) {}

  void Start() {
    parser_.emplace();
    parser_->body_limit(options_.body_limit);
    parser_->header_limit(options_.header_limit);
    // One deadline for the whole request: a client that trickles bytes does not extend it.
    timer_.expires_after(absl::ToChronoNanoseconds(options_.read_timeout));
    timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (ec || self->read_done_) return;
      self->read_timed_out_ = true;
      error_code ignored;
      self->socket_.cancel(ignored);  // OnRead answers 408
    });
    http::async_read(socket_, buffer_, *parser_,
                     [self = shared_from_this()](error_code ec, size_t) { self->OnRead(ec); });
  }

  // Answers `status` without reading a request (the server is full), then closes.
  void Refuse(int status, const std::string& message) {
    read_done_ = true;
    Reject(status, message);
  }

  // Queues bytes; `last` closes the connection once they are written.
  void Post(std::string bytes, bool last) {
    pending_.fetch_add(bytes.size());
    net::post(socket_.get_executor(), [self = shared_from_this(), b = std::move(bytes),
                                       last]() mutable { self->Queue(std::move(b), last); });
  }

  bool closed() const { return closed_.load(); }
  uint64_t pending() const { return pending_.load(); }
  // The client's address ("" when unknown): what the per-source cap counts.
  const std::string& source() const { return source_; }
  // Server shutdown (io thread).
  void Shutdown() { Close(); }

 private:
  void Arm(net::steady_timer& t, absl::Duration d) {
    t.expires_after(absl::ToChronoNanoseconds(d));
    t.async_wait([self = shared_from_this()](error_code ec) {
      if (!ec) self->Close();  // deadline passed: give up on this connection
    });
  }

  void OnRead(error_code ec) {
    read_done_ = true;
    timer_.cancel();
    if (ec) {
      if (read_timed_out_) {
        Reject(408, absl::StrCat("request not received in full within ",
                                 absl::FormatDuration(options_.read_timeout)));
      } else if (ec == http::error::body_limit) {
        Reject(413,
               absl::StrCat("request body too large (at most ", options_.body_limit, " bytes)"));
      } else if (ec == http::error::header_limit) {
        Reject(431, absl::StrCat("request headers too large (at most ", options_.header_limit,
                                 " bytes)"));
      } else if (ec != http::error::end_of_stream && ec != net::error::operation_aborted) {
        Reject(400, absl::StrCat("malformed HTTP request: ", ec.message()));
      } else {
        Close();
      }
      return;
    }
    http::request<http::string_body> req = parser_->release();
    HttpRequest r;
    r.method = std::string(req.method_string());
    r.target = std::string(req.target());
    r.body = std::move(req.body());
    // Watch the connection: a read that ends means the client went away.
    socket_.async_read_some(net::buffer(probe_),
                            [self = shared_from_this()](error_code ec, size_t) {
                              if (ec) self->closed_.store(true);
                            });
    auto responder = std::make_shared<Responder>(shared_from_this());
    // Handlers check what they parse; this keeps a bug in one from ending the io thread (and
    // with it the process).
    try {
      handler_(r, responder);
    } catch (const std::exception& e) {
      KVW_LOG(kError, "http") << "request handler threw" << kvwire::Kv("error", e.what());
      responder->Error(500, absl::StrCat("internal error: ", e.what()));
    } catch (...) {
      KVW_LOG(kError, "http") << "request handler threw";
      responder->Error(500, "internal error");
    }
  }

  // An error answer to a request that was not (fully) read. The client may still be sending:
  // closing with unread input would send a reset that can overtake the answer, so the
  // connection lingers (reading and dropping, at most a second) after the answer.
  void Reject(int status, const std::string& message) {
    linger_ = true;
    std::string answer = Format(status, ErrorJson(status, message), "application/json");
    pending_.fetch_add(answer.size());
    Queue(std::move(answer), true);
  }

  void Linger() {
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    Arm(timer_, absl::Seconds(1));
    Drain();
  }

  void Drain() {
    socket_.async_read_some(net::buffer(probe_),
                            [self = shared_from_this()](error_code ec, size_t) {
                              if (ec) return self->Close();
                              self->Drain();
                            });
  }

  void Queue(std::string bytes, bool last) {
    if (done_) {
      pending_.fetch_sub(bytes.size());
      return;
    }
    queue_.push_back(std::move(bytes));
    if (last) last_queued_ = true;
    if (!writing_) WriteNext();
  }

  void WriteNext() {
    if (queue_.empty()) {
      if (last_queued_) linger_ ? Linger() : Close();
      return;
    }
    writing_ = true;
    Arm(write_timer_, options_.write_timeout);
    net::async_write(socket_, net::buffer(queue_.front()),
                     [self = shared_from_this()](error_code ec, size_t) {
                       self->write_timer_.cancel();
                       self->writing_ = false;
                       // Closed while this write completed: Close dropped the queue.
                       if (self->done_) return;
                       if (ec) {
                         self->closed_.store(true);
                         self->Close();
                         return;
                       }
                       self->pending_.fetch_sub(self->queue_.front().size());
                       self->queue_.pop_front();
                       self->WriteNext();
                     });
  }

  void Close() {
    if (done_) return;
    done_ = true;
    closed_.store(true);
    for (const std::string& b : queue_) pending_.fetch_sub(b.size());
    queue_.clear();
    error_code ignored;
    timer_.cancel();
    write_timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

 public:
  static std::string Format(int status, const std::string& body, const std::string& type,
                            int64_t retry_after_s = 0) {
    http::response<http::string_body> res{static_cast<http::status>(status), 11};
    res.set(http::field::server, "kvwire-dsv4");
    res.set(http::field::content_type, type);
    if (retry_after_s > 0) res.set(http::field::retry_after, std::to_string(retry_after_s));
    res.set(http::field::connection, "close");
    res.body() = body;
    res.prepare_payload();
    std::ostringstream out;
    out << res;
    return out.str();
  }

 private:
  const std::string source_;
  tcp::socket socket_;
  net::steady_timer timer_, write_timer_;
  const HttpServerOptions& options_;
  const HttpServer::Handler& handler_;
  boost::beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  char probe_[64];
  std::deque<std::string> queue_;
  bool writing_ = false, last_queued_ = false, done_ = false;
  bool read_done_ = false, read_timed_out_ = false, linger_ = false;
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> pending_{0};  // bytes posted and not yet written or dropped
};

// --- Responder ----------------------------------------------------------------------------

Responder::Responder(std::shared_ptr<Session> session) : session_(std::move(session)) {}

Responder::~Responder() {
  if (!answered_.load()) {
    Error(500, "the request was dropped without an answer");
  } else if (streaming_.load() && !ended_.load()) {
    EndEvents(false);
  }
}

bool Responder::closed() const { return session_->closed(); }

uint64_t Responder::pending_bytes() const { return session_->pending(); }

void Responder::Respond(int status, std::string body, std::string content_type) {
  if (answered_.exchange(true)) return;
  session_->Post(Session::Format(status, body, content_type), true);
}

void Responder::Error(int status, const std::string& message) {
  Respond(status, ErrorJson(status, message));
}

void Responder::ErrorRetryAfter(int status, const std::string& message,
                                absl::Duration retry_after) {
  if (answered_.exchange(true)) return;
  const int64_t seconds =
      std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(retry_after, absl::Seconds(1))));
  session_->Post(Session::Format(status, ErrorJson(status, message), "application/json", seconds),
                 true);
}

void Responder::StartEvents() {
  if (answered_.exchange(true)) return;
  streaming_.store(true);
  session_->Post(
      "HTTP/1.1 200 OK\r\nServer: kvwire-dsv4\r\nContent-Type: text/event-stream\r\n"
      "Cache-Control: no-cache\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n",
      false);
}

void Responder::Raw(std::string bytes) {
  if (!streaming_.load() || ended_.load() || bytes.empty()) return;
  std::string chunk = absl::StrCat(absl::Hex(bytes.size()), "\r\n");
  chunk += bytes;
  chunk += "\r\n";
  session_->Post(std::move(chunk), false);
}

void Responder::Event(const std::string& data) { Raw(absl::StrCat("data: ", data, "\n\n")); }

void Responder::EndEvents(bool done) {
  if (!streaming_.load() || ended_.exchange(true)) return;
  std::string tail;
  if (done) {
    const std::string d = "data: [DONE]\n\n";
    tail = absl::StrCat(absl::Hex(d.size()), "\r\n", d, "\r\n");
  }
  tail += "0\r\n\r\n";
  session_->Post(std::move(tail), true);
}

// --- HttpServer ---------------------------------------------------------------------------

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options, Handler handler)
      : options_(std::move(options)),
        handler_(std::move(handler)),
        acceptor_(io_),
        accept_retry_(io_) {}

  absl::Status Listen() {
    error_code ec;
    const net::ip::address addr = net::ip::make_address(options_.host, ec);
    if (ec) return absl::InvalidArgumentError(absl::StrCat("bad host '", options_.host, "'"));
    const tcp::endpoint ep(addr, static_cast<uint16_t>(options_.port));
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", options_.host, ":", options_.port, ": ", ec.message()));
    }
    port_ = acceptor_.local_endpoint().port();
    Accept();
    thread_ = std::thread([this] { io_.run(); });
    return absl::OkStatus();
  }

  // Responders must be gone before the server (their sessions post to this io_context).
  ~Impl() {
    net::post(io_, [this] {
      error_code ignored;
      acceptor_.close(ignored);
      accept_retry_.cancel();
      for (const auto* list : {&sessions_, &refusing_}) {
        for (const std::weak_ptr<Session>& w : *list) {
          if (std::shared_ptr<Session> s = w.lock()) s->Shutdown();
        }
      }
      io_.stop();
    });
    if (thread_.joinable()) thread_.join();
  }

  int port() const { return port_; }
  uint64_t accept_failures() const { return accept_failures_.load(std::memory_order_relaxed); }

 private:
  void Accept() {
    acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !acceptor_.is_open()) return;
      if (ec) {
        // Out of file descriptors (or buffers): accepting again at once would spin on the
        // same error, so pause.
        accept_failures_.fetch_add(1, std::memory_order_relaxed);
        KVW_LOG(kWarning, "http") << "accept failed, pausing" << kvwire::Kv("error", ec.message());
        accept_retry_.expires_after(std::chrono::milliseconds(100));
        accept_retry_.async_wait([this](error_code e) {
          if (!e && acceptor_.is_open()) Accept();
        });
        return;
      }
      auto expired = [](const std::weak_ptr<Session>& w) { return w.expired(); };
      std::erase_if(sessions_, expired);
      std::erase_if(refusing_, expired);
      const int open = static_cast<int>(sessions_.size());
      error_code endpoint_error;
      const tcp::endpoint remote = socket.remote_endpoint(endpoint_error);
      std::string source = endpoint_error ? std::string() : remote.address().to_string();
      int from_source = 0;
      for (const std::weak_ptr<Session>& w : sessions_) {
        if (std::shared_ptr<Session> s = w.lock(); s && s->source() == source) ++from_source;
      }
      auto session = std::make_shared<Session>(std::move(socket), source, options_, handler_);
      if (open < options_.max_connections &&
          from_source < std::max(options_.max_connections_per_source, 1)) {
        sessions_.push_back(session);
        session->Start();
      } else if (open < options_.max_connections &&
                 static_cast<int>(refusing_.size()) < kMaxRefusing) {
        refusing_.push_back(session);
        session->Refuse(503, absl::StrCat("too many connections from ", source, " (", from_source,
                                          " open, at most ", options_.max_connections_per_source,
                                          " per source address)"));
      } else if (static_cast<int>(refusing_.size()) < kMaxRefusing) {
        refusing_.push_back(session);
        session->Refuse(503, absl::StrCat("too many connections (", open, " open, at most ",
                                          options_.max_connections, ")"));
      }  // else: the flood outruns even the refusals; the socket just closes
      Accept();
    });
  }

  // Connections being refused (answered 503, lingering at most a second) at once.
  static constexpr int kMaxRefusing = 64;

  const HttpServerOptions options_;
  const Handler handler_;
  net::io_context io_;
  tcp::acceptor acceptor_;
  std::atomic<uint64_t> accept_failures_{0};
  std::thread thread_;
  int port_ = 0;
  net::steady_timer accept_retry_;
  std::vector<std::weak_ptr<Session>> sessions_;  // io thread only
  std::vector<std::weak_ptr<Session>> refusing_;  // io thread only
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              Handler handler) {
  auto impl = std::make_unique<Impl>(options, std::move(handler));
  if (absl::Status s = impl->Listen(); !s.ok()) return s;
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpServer::~HttpServer() = default;
int HttpServer::port() const { return impl_->port(); }
uint64_t HttpServer::accept_failures() const { return impl_->accept_failures(); }

}  // namespace dsv4::serve

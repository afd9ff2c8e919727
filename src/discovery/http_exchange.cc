#include "src/discovery/http_exchange.h"

#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "boost/asio.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"

#include "src/util/mutex.h"

namespace kvwire::discovery {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

absl::Status ParseEndpoint(const std::string& url, std::string* host, int* port) {
  std::string rest = url;
  if (absl::StartsWith(rest, "https://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd endpoint '", url,
                     "': https is not supported (plain http to a local member or "
                     "an etcd grpc-proxy)"));
  }
  if (absl::StartsWith(rest, "http://")) rest = rest.substr(7);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || rest.find('/') != std::string::npos ||
      !absl::SimpleAtoi(rest.substr(colon + 1), port) || *port <= 0 || *port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd endpoint '", url, "' is not http://host:port"));
  }
  *host = rest.substr(0, colon);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return absl::OkStatus();
}

// One exchange; every step runs on its own io_context, on the thread that called Post.
struct HttpExchange::State {
  State() : resolver(io), socket(io), timer(io) {}

  void Close() {
    error_code ignored;
    timer.cancel();
    resolver.cancel();
    socket.shutdown(tcp::socket::shutdown_both, ignored);
    socket.close(ignored);
  }

  void Fail(error_code ec, const char* step) {
    if (!error.ok()) return Close();
    if (cancelled) {
      error = absl::CancelledError("etcd call cancelled");
    } else if (timed_out) {
      error = absl::DeadlineExceededError(
          absl::StrCat("etcd at ", where, ": no answer before the deadline (", step, ")"));
    } else if (!connected) {
      error =
          absl::UnavailableError(absl::StrCat("etcd at ", where, ": ", step, ": ", ec.message()));
    } else {
      error = absl::AbortedError(
          absl::StrCat("etcd at ", where, ": connection lost during ", step, ": ", ec.message()));
    }
    Close();
  }

  void ReadBody() {
    if (parser->is_done()) return Close();
    http::async_read_some(socket, buffer, *parser, [this](error_code ec, size_t) {
      std::string& b = parser->get().body();
      if (!b.empty() && on_body && reply.status == 200) {
        if (!on_body(b)) {
          error = absl::CancelledError("stopped by the caller");
          return Close();
        }
        b.clear();
      }
      if (ec == http::error::end_of_stream || (!ec && parser->is_done())) return Close();
      if (ec == http::error::body_limit) {
        error = absl::ResourceExhaustedError(
            absl::StrCat("etcd at ", where, ": answer over ", max_body, " bytes"));
        return Close();
      }
      if (ec) return Fail(ec, "read");
      ReadBody();
    });
  }

  std::string where;
  net::io_context io;
  tcp::resolver resolver;
  tcp::socket socket;
  net::steady_timer timer;
  boost::beast::flat_buffer buffer;
  http::request<http::string_body> req;
  std::optional<http::response_parser<http::string_body>> parser;
  std::function<bool(std::string_view)> on_body;
  size_t max_body = 0;
  HttpReply reply;
  absl::Status error;
  bool timed_out = false, connected = false, cancelled = false;
};

HttpExchange::HttpExchange() = default;
HttpExchange::~HttpExchange() = default;

void HttpExchange::Cancel() {
  MutexLock lock(&mu_);
  cancelled_ = true;
  if (state_ == nullptr) return;
  State* s = state_.get();
  net::post(s->io, [s] {
    s->cancelled = true;
    s->Fail(error_code(), "cancel");
  });
}

absl::StatusOr<HttpReply> HttpExchange::Post(const std::string& host, int port,
                                             const std::string& target, const std::string& body,
                                             absl::Time deadline,
                                             const std::function<bool(std::string_view)>& on_body,
                                             size_t max_body) {
  State* s = nullptr;
  {
    MutexLock lock(&mu_);
    if (cancelled_) return absl::CancelledError("etcd call cancelled");
    state_ = std::make_unique<State>();
    s = state_.get();
  }
  s->where = absl::StrCat(host, ":", port);
  s->on_body = on_body;
  s->max_body = max_body;
  s->req.method(http::verb::post);
  s->req.target(target);
  s->req.version(11);
  s->req.set(http::field::host, s->where);
  s->req.set(http::field::user_agent, "kvwire");
  s->req.set(http::field::connection, "close");
  s->req.set(http::field::content_type, "application/json");
  s->req.body() = body;
  s->req.prepare_payload();
  s->parser.emplace();
  s->parser->body_limit(max_body);
  s->parser->header_limit(16 << 10);
  const absl::Duration left = deadline - absl::Now();
  absl::StatusOr<HttpReply> out = absl::DeadlineExceededError(
      absl::StrCat("etcd at ", s->where, ": deadline passed before the call"));
  if (left > absl::ZeroDuration()) {
    s->timer.expires_after(absl::ToChronoNanoseconds(left));
    s->timer.async_wait([s](error_code ec) {
      if (ec) return;
      s->timed_out = true;
      s->Fail(ec, "wait");
    });
    s->resolver.async_resolve(
        host, std::to_string(port), [s](error_code ec, tcp::resolver::results_type r) {
          if (ec) return s->Fail(ec, "resolve");
          net::async_connect(s->socket, r, [s](error_code ec, auto&&) {
            if (ec) return s->Fail(ec, "connect");
            s->connected = true;
            http::async_write(s->socket, s->req, [s](error_code ec, size_t) {
              if (ec) return s->Fail(ec, "send");
              http::async_read_header(s->socket, s->buffer, *s->parser, [s](error_code ec, size_t) {
                if (ec) return s->Fail(ec, "read");
                s->reply.status = static_cast<int>(s->parser->get().result_int());
                s->ReadBody();
              });
            });
          });
        });
    s->io.run();
    if (s->error.ok()) {
      s->reply.body = std::move(s->parser->get().body());
      out = std::move(s->reply);
    } else {
      out = s->error;
    }
  }
  MutexLock lock(&mu_);
  state_.reset();
  return out;
}

}  // namespace kvwire::discovery

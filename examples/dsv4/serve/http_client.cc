#include "examples/dsv4/serve/http_client.h"

#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "boost/asio.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"

namespace dsv4::serve {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

bool SplitHostPort(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  *host = address.substr(0, colon);
  return absl::SimpleAtoi(address.substr(colon + 1), port) && *port > 0 && *port < 65536;
}

namespace {

// The state of one call; every step runs on the call's own io_context.
class Call {
 public:
  Call(const std::string& address, const HttpCallOptions& options)
      : address_(address),
        options_(options),
        resolver_(io_),
        socket_(io_),
        timer_(io_),
        poll_timer_(io_) {}

  absl::StatusOr<HttpResponse> Run(const std::string& host, int port, http::verb verb,
                                   const std::string& target, const std::string& body) {
    req_.method(verb);
    req_.target(target);
    req_.version(11);
    req_.set(http::field::host, address_);
    req_.set(http::field::user_agent, "kvwire-dsv4");
    req_.set(http::field::connection, "close");
    if (!body.empty() || verb == http::verb::post) {
      req_.set(http::field::content_type, "application/json");
      req_.body() = body;
    }
    req_.prepare_payload();
    parser_.emplace();
    parser_->body_limit(options_.body_limit);
    // Beast reads as much as the buffer holds (at least 512 bytes): an empty buffer would
    // stay about the size of the headers, and a relayed 250 MiB stream would take half a
    // million reads and as many pieces (each a chunk and a write to the router's client).
    buffer_.reserve(kReadBytes);
    const absl::Duration left = options_.deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat("HTTP call to ", address_, ": deadline"));
    }
    timer_.expires_after(absl::ToChronoNanoseconds(left));
    timer_.async_wait([this](error_code ec) {
      if (ec) return;
      timed_out_ = true;
      error_code ignored;
      resolver_.cancel();
      socket_.close(ignored);
    });
    if (options_.cancelled) Poll();
    resolver_.async_resolve(host, std::to_string(port),
                            [this](error_code ec, tcp::resolver::results_type r) {
                              if (ec) return Fail(ec, "resolve");
                              net::async_connect(socket_, r, [this](error_code ec, auto&&) {
                                if (ec) return Fail(ec, "connect");
                                connected_ = true;
                                Write();
                              });
                            });
    io_.run();
    if (!error_.ok()) return error_;
    return response_;
  }

 private:
  void Poll() {
    poll_timer_.expires_after(absl::ToChronoNanoseconds(options_.poll_interval));
    poll_timer_.async_wait([this](error_code ec) {
      if (ec || stopped_) return;
      if (options_.cancelled()) {
        error_ = absl::CancelledError("stopped by the caller");
        return Stop();
      }
      Poll();
    });
  }

  void Write() {
    http::async_write(socket_, req_, [this](error_code ec, size_t) {
      if (ec) return Fail(ec, "send");
      sent_ = true;
      http::async_read_header(socket_, buffer_, *parser_, [this](error_code ec, size_t) {
        if (ec) return Fail(ec, "read");
        response_.status = static_cast<int>(parser_->get().result_int());
        response_.content_type = std::string(parser_->get()[http::field::content_type]);
        response_.retry_after = std::string(parser_->get()[http::field::retry_after]);
        if (options_.on_headers) options_.on_headers(response_);
        ReadBody();
      });
    });
  }

  void ReadBody() {
    if (parser_->is_done()) return Finish();
    http::async_read_some(socket_, buffer_, *parser_, [this](error_code ec, size_t) {
      if (stopped_) return;  // cancelled while the read was in flight
      std::string& b = parser_->get().body();
      if (!b.empty()) {
        if (options_.on_body) {
          if (!options_.on_body(b)) {
            b.clear();
            error_ = absl::CancelledError("stopped by the caller");
            return Stop();
          }
        } else {
          response_.body += b;
        }
        b.clear();
      }
      if (ec == http::error::end_of_stream || (!ec && parser_->is_done())) return Finish();
      if (ec) return Fail(ec, "read");
      ReadBody();
    });
  }

  void Finish() { Stop(); }

  void Stop() {
    stopped_ = true;
    error_code ignored;
    timer_.cancel();
    poll_timer_.cancel();
    resolver_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  void Fail(error_code ec, const char* step) {
    if (stopped_) return;  // cancelled: the error is already set
    if (ec == http::error::body_limit) {
      error_ = absl::ResourceExhaustedError(absl::StrCat(
          "the answer of ", address_, " is larger than ", options_.body_limit, " bytes"));
    } else if (timed_out_) {
      error_ = absl::DeadlineExceededError(
          absl::StrCat("HTTP call to ", address_, ": deadline passed (", step, ")"));
    } else if (!connected_) {
      error_ = absl::UnavailableError(absl::StrCat(step, " ", address_, ": ", ec.message()));
    } else {
      error_ =
          absl::AbortedError(absl::StrCat("connection to ", address_, " lost during ", step,
                                          sent_ ? " (request was sent)" : "", ": ", ec.message()));
    }
    Stop();
  }

  static constexpr size_t kReadBytes = 64 << 10;

  const std::string address_;
  const HttpCallOptions& options_;
  net::io_context io_;
  tcp::resolver resolver_;
  tcp::socket socket_;
  net::steady_timer timer_, poll_timer_;
  boost::beast::flat_buffer buffer_;
  http::request<http::string_body> req_;
  std::optional<http::response_parser<http::string_body>> parser_;
  HttpResponse response_;
  absl::Status error_;
  bool timed_out_ = false, connected_ = false, sent_ = false, stopped_ = false;
};

}  // namespace

absl::StatusOr<HttpResponse> HttpCall(const std::string& address, const std::string& method,
                                      const std::string& target, const std::string& body,
                                      const HttpCallOptions& options) {
  std::string host;
  int port = 0;
  if (!SplitHostPort(address, &host, &port)) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not host:port"));
  }
  const http::verb verb = http::string_to_verb(method);
  if (verb == http::verb::unknown) {
    return absl::InvalidArgumentError(absl::StrCat("unknown HTTP method ", method));
  }
  Call call(address, options);
  return call.Run(host, port, verb, target, body);
}

}  // namespace dsv4::serve

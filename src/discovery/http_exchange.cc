#include "src/discovery/http_exchange.h"

#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "boost/asio.hpp"
#include "boost/asio/ssl.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"

#include "src/util/mutex.h"

namespace kvwire::discovery {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

absl::Status ParseEndpoint(const std::string& url, HttpEndpoint* endpoint) {
  std::string rest = url;
  endpoint->tls = false;
  if (absl::StartsWith(rest, "https://")) {
    endpoint->tls = true;
    rest = rest.substr(8);
  } else if (absl::StartsWith(rest, "http://")) {
    rest = rest.substr(7);
  }
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || rest.find('/') != std::string::npos ||
      !absl::SimpleAtoi(rest.substr(colon + 1), &endpoint->port) || endpoint->port <= 0 ||
      endpoint->port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd endpoint '", url, "' is not http://host:port or https://host:port"));
  }
  endpoint->host = rest.substr(0, colon);
  if (endpoint->host.size() > 2 && endpoint->host.front() == '[' && endpoint->host.back() == ']') {
    endpoint->host = endpoint->host.substr(1, endpoint->host.size() - 2);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<net::ssl::context>> MakeTlsContext(const std::string& ca_file,
                                                                  const std::string& cert_file,
                                                                  const std::string& key_file) {
  if (cert_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError(
        "etcd TLS: a client certificate needs its key and a key its certificate");
  }
  auto ctx = std::make_shared<net::ssl::context>(net::ssl::context::tls_client);
  ctx->set_options(net::ssl::context::default_workarounds | net::ssl::context::no_sslv2 |
                   net::ssl::context::no_sslv3 | net::ssl::context::no_tlsv1 |
                   net::ssl::context::no_tlsv1_1);
  error_code ec;
  if (ca_file.empty()) {
    ctx->set_default_verify_paths(ec);
    if (ec) return absl::InternalError(absl::StrCat("etcd TLS: system CAs: ", ec.message()));
  } else {
    ctx->load_verify_file(ca_file, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd TLS: cannot use CA file '", ca_file, "': ", ec.message()));
    }
  }
  if (!cert_file.empty()) {
    ctx->use_certificate_chain_file(cert_file, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd TLS: cannot use certificate '", cert_file, "': ", ec.message()));
    }
    ctx->use_private_key_file(key_file, net::ssl::context::pem, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd TLS: cannot use key '", key_file, "': ", ec.message()));
    }
  }
  ctx->set_verify_mode(net::ssl::verify_peer);
  return ctx;
}

// One exchange; every step runs on its own io_context, on the thread that called Post.
struct HttpExchange::State {
  State() : resolver(io), socket(io), timer(io) {}

  void Close() {
    error_code ignored;
    timer.cancel();
    resolver.cancel();
    // TLS: no close_notify (the request said Connection: close); closing the socket ends
    // any TLS operation in flight.
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

  // The request and its answer, over the socket or TLS.
  template <typename Stream>
  void Exchange(Stream& stream) {
    http::async_write(stream, req, [this, &stream](error_code ec, size_t) {
      if (ec) return Fail(ec, "send");
      http::async_read_header(stream, buffer, *parser, [this, &stream](error_code ec, size_t) {
        if (ec) return Fail(ec, "read");
        reply.status = static_cast<int>(parser->get().result_int());
        ReadBody(stream);
      });
    });
  }

  template <typename Stream>
  void ReadBody(Stream& stream) {
    if (parser->is_done()) return Close();
    http::async_read_some(stream, buffer, *parser, [this, &stream](error_code ec, size_t) {
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
      ReadBody(stream);
    });
  }

  std::string where;
  net::io_context io;
  tcp::resolver resolver;
  tcp::socket socket;
  std::optional<net::ssl::stream<tcp::socket&>> tls;
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

absl::StatusOr<HttpReply> HttpExchange::Post(const HttpEndpoint& endpoint,
                                             const std::string& target, const std::string& body,
                                             absl::Time deadline,
                                             const std::function<bool(std::string_view)>& on_body,
                                             size_t max_body, const HttpExchangeOptions& options) {
  if (endpoint.tls && options.tls == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("etcd at ", endpoint.host, ":", endpoint.port,
                                                   ": https without a TLS context"));
  }
  State* s = nullptr;
  {
    MutexLock lock(&mu_);
    if (cancelled_) return absl::CancelledError("etcd call cancelled");
    state_ = std::make_unique<State>();
    s = state_.get();
  }
  const std::string& host = endpoint.host;
  s->where = absl::StrCat(endpoint.tls ? "https://" : "", host, ":", endpoint.port);
  s->on_body = on_body;
  s->max_body = max_body;
  s->req.method(http::verb::post);
  s->req.target(target);
  s->req.version(11);
  s->req.set(http::field::host, absl::StrCat(host, ":", endpoint.port));
  s->req.set(http::field::user_agent, "kvwire");
  s->req.set(http::field::connection, "close");
  s->req.set(http::field::content_type, "application/json");
  if (!options.authorization.empty()) {
    s->req.set(http::field::authorization, options.authorization);
  }
  s->req.body() = body;
  s->req.prepare_payload();
  s->parser.emplace();
  s->parser->body_limit(max_body);
  s->parser->header_limit(16 << 10);
  if (endpoint.tls) {
    s->tls.emplace(s->socket, *options.tls);
    // SNI for a name; the certificate must be valid for the host, a name or an IP address.
    error_code not_an_address;
    (void)net::ip::make_address(host, not_an_address);
    if (not_an_address) SSL_set_tlsext_host_name(s->tls->native_handle(), host.c_str());
    s->tls->set_verify_callback(net::ssl::host_name_verification(host));
  }
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
        host, std::to_string(endpoint.port), [s](error_code ec, tcp::resolver::results_type r) {
          if (ec) return s->Fail(ec, "resolve");
          net::async_connect(s->socket, r, [s](error_code ec, auto&&) {
            if (ec) return s->Fail(ec, "connect");
            if (!s->tls) {
              s->connected = true;
              return s->Exchange(s->socket);
            }
            // A member whose certificate does not verify counts as not reached: nothing was
            // sent to it.
            s->tls->async_handshake(net::ssl::stream_base::client, [s](error_code ec) {
              if (ec) return s->Fail(ec, "TLS handshake");
              s->connected = true;
              s->Exchange(*s->tls);
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

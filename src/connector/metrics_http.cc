// The connector's metrics endpoint on Boost.Asio/Beast: every socket operation is
// asynchronous on one io thread, each connection has one absolute deadline (Beast's
// tcp_stream timer) and a cap on its request size, and the number of connections is capped,
// so no client can block the thread, and destruction (io_context::stop) never waits on one.
#include "src/connector/metrics_http.h"

#include <exception>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "boost/asio/io_context.hpp"
#include "boost/asio/ip/tcp.hpp"
#include "boost/asio/steady_timer.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"

#include "src/util/log.h"

namespace kvwire::connector_internal {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

class MetricsServer::Impl {
 public:
  Impl(Handler handler, Limits limits)
      : handler_(std::move(handler)), limits_(limits), acceptor_(io_), retry_(io_) {}

  ~Impl() {
    io_.stop();
    if (thread_.joinable()) thread_.join();
  }

  absl::Status Listen(const tcp::endpoint& endpoint) {
    beast::error_code ec;
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return absl::UnavailableError(ec.message());
    return absl::OkStatus();
  }
  uint16_t port() const {
    beast::error_code ec;
    return acceptor_.local_endpoint(ec).port();
  }

  void Run() {
    Accept();
    thread_ = std::thread([this] {
      try {
        io_.run();
      } catch (const std::exception& e) {
        // Nothing here throws by design (error codes everywhere); if something does, the
        // endpoint stops rather than the process.
        KVW_LOG(kError, "connector") << "metrics endpoint stopped" << Kv("error", e.what());
      }
    });
  }

  const Limits& limits() const { return limits_; }
  // The answer to GET `target`: status, content type, body.
  void Answer(const std::string& target, http::response<http::string_body>* res) const {
    std::string body, type = "text/plain; version=0.0.4";
    http::status status = http::status::ok;
    try {
      if (target == "/metrics") {
        body = handler_(false);
      } else if (target == "/stats.json") {
        body = handler_(true);
        type = "application/json";
      } else {
        status = http::status::not_found;
        body = "not found: try /metrics or /stats.json\n";
      }
    } catch (const std::exception& e) {
      status = http::status::internal_server_error;
      body = absl::StrCat("metrics: ", e.what(), "\n");
    }
    res->result(status);
    res->set(http::field::content_type, type);
    res->body() = std::move(body);
  }

 private:
  void Accept();

  const Handler handler_;
  const Limits limits_;
  // Live sessions; declared before io_ so that sessions destroyed with io_'s pending handlers
  // still find it.
  size_t live_ = 0;
  asio::io_context io_{1};
  tcp::acceptor acceptor_;
  asio::steady_timer retry_;
  std::thread thread_;
};

namespace {

// One connection: read one request (bounded in size), answer, close; all within the deadline.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(MetricsServer::Impl* server, size_t* live, tcp::socket socket)
      : server_(server),
        live_(live),
        stream_(std::move(socket)),
        buffer_(server->limits().max_request_bytes) {
    ++*live_;
  }
  ~Session() { --*live_; }

  void Start() {
    stream_.expires_after(absl::ToChronoNanoseconds(server_->limits().deadline));
    parser_.header_limit(static_cast<uint32_t>(server_->limits().max_request_bytes));
    parser_.body_limit(0);
    http::async_read(stream_, buffer_, parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       if (!ec) self->Respond();
                     });
  }

 private:
  void Respond() {
    const http::request<http::empty_body>& req = parser_.get();
    response_.version(req.version());
    response_.keep_alive(false);
    if (req.method() != http::verb::get) {
      response_.result(http::status::method_not_allowed);
      response_.set(http::field::content_type, "text/plain");
      response_.body() = "only GET\n";
    } else {
      server_->Answer(std::string(req.target()), &response_);
    }
    response_.prepare_payload();
    // The deadline set at accept still runs: a client that never reads is dropped then.
    http::async_write(stream_, response_,
                      [self = shared_from_this()](beast::error_code ec, size_t) {
                        beast::error_code ignored;
                        self->stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
                      });
  }

  MetricsServer::Impl* const server_;
  size_t* const live_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request_parser<http::empty_body> parser_;
  http::response<http::string_body> response_;
};

}  // namespace

void MetricsServer::Impl::Accept() {
  acceptor_.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted) return;
    if (ec) {
      // E.g. out of descriptors: try again a little later instead of spinning.
      retry_.expires_after(std::chrono::milliseconds(100));
      retry_.async_wait([this](beast::error_code e) {
        if (!e) Accept();
      });
      return;
    }
    if (live_ >= limits_.max_connections) {
      beast::error_code ignored;
      socket.close(ignored);  // over the cap: refused at once
    } else {
      std::make_shared<Session>(this, &live_, std::move(socket))->Start();
    }
    Accept();
  });
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                    Handler handler) {
  return Start(address, std::move(handler), Limits());
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                    Handler handler,
                                                                    Limits limits) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  const std::string host = address.substr(0, colon).empty() ? "0.0.0.0" : address.substr(0, colon);
  beast::error_code ec;
  const asio::ip::address ip = asio::ip::make_address(host, ec);
  if (ec)
    return absl::InvalidArgumentError(absl::StrCat("metrics host '", host, "': ", ec.message()));
  if (limits.max_connections == 0 || limits.max_request_bytes == 0 ||
      limits.deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("metrics endpoint limits must be positive");
  }
  auto impl = std::make_unique<Impl>(std::move(handler), limits);
  if (absl::Status s = impl->Listen(tcp::endpoint(ip, static_cast<uint16_t>(port))); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("metrics endpoint ", address, ": ", s.message()));
  }
  const uint16_t bound = impl->port();
  impl->Run();
  auto server = std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
  server->address_ = absl::StrCat(host, ":", bound);
  return server;
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsServer::~MetricsServer() = default;

}  // namespace kvwire::connector_internal

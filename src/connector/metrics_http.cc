// A minimal HTTP endpoint for the connector's metrics: GET /metrics (Prometheus text) and
// GET /stats.json (JSON snapshot). One thread, one short request per connection, every wait
// bounded (poll with a timeout) so that Stop() returns promptly.
#include "src/connector/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <poll.h>
#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "src/util/log.h"

namespace kvwire::connector_internal {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                    Handler handler) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const std::string host = address.substr(0, colon);
  if (inet_pton(AF_INET, host.empty() ? "0.0.0.0" : host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics host '", host, "' is not IPv4"));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 16) != 0) {
    const std::string err = std::strerror(errno);
    close(fd);
    return absl::UnavailableError(absl::StrCat("metrics endpoint ", address, ": ", err));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  auto server = std::unique_ptr<MetricsServer>(new MetricsServer(fd, std::move(handler)));
  server->address_ = absl::StrCat(host.empty() ? "0.0.0.0" : host, ":", ntohs(addr.sin_port));
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

MetricsServer::~MetricsServer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  close(fd_);
}

void MetricsServer::Loop() {
  while (!stop_.load()) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    std::string request;
    char buf[2048];
    // Read the request head, 1 s at most.
    for (int i = 0; i < 10 && request.find("\r\n\r\n") == std::string::npos; ++i) {
      pollfd q{c, POLLIN, 0};
      if (poll(&q, 1, 100) <= 0) continue;
      const ssize_t n = read(c, buf, sizeof(buf));
      if (n <= 0) break;
      request.append(buf, n);
      if (request.size() > 16384) break;
    }
    std::string path = "/";
    if (request.rfind("GET ", 0) == 0) {
      path = request.substr(4, request.find(' ', 4) - 4);
    }
    std::string body, type = "text/plain; version=0.0.4";
    int status = 200;
    if (path == "/metrics") {
      body = handler_(false);
    } else if (path == "/stats.json") {
      body = handler_(true);
      type = "application/json";
    } else {
      status = 404;
      body = "not found: try /metrics or /stats.json\n";
    }
    const std::string response = absl::StrCat(
        "HTTP/1.1 ", status, status == 200 ? " OK" : " Not Found", "\r\nContent-Type: ", type,
        "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
    size_t off = 0;
    while (off < response.size()) {
      const ssize_t n = send(c, response.data() + off, response.size() - off, MSG_NOSIGNAL);
      if (n <= 0) break;
      off += n;
    }
    close(c);
  }
}

}  // namespace kvwire::connector_internal

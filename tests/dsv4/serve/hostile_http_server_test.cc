// Hostile peers of the dsv4 HTTP plumbing on real loopback sockets, in one process: upstream
// "prefill" servers that answer the router with malformed or deeply nested JSON, and clients
// that flood the HTTP server with connections, trickle a request byte by byte, or send
// oversized headers, or find it out of file descriptors. Each gets a clear HTTP error (or a
// pause, not a spin); the server keeps serving a legitimate peer.
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <fcntl.h>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/http_server.h"
#include "examples/dsv4/serve/router.h"
#include "src/util/mutex.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;

std::string Addr(int port) { return absl::StrCat("127.0.0.1:", port); }

// A connected loopback socket with a receive timeout (every read in these tests is bounded).
class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    timeval tv{15, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~RawClient() { close(fd_); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }
  bool Send(const std::string& s) {
    return send(fd_, s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size());
  }
  // Everything until the server closes (or the receive timeout).
  std::string ReadAll() {
    std::string got;
    char buf[4096];
    ssize_t n;
    while ((n = read(fd_, buf, sizeof(buf))) > 0) got.append(buf, static_cast<size_t>(n));
    return got;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

std::unique_ptr<HttpServer> StartServer(HttpServer::Handler h,
                                        HttpServerOptions o = HttpServerOptions()) {
  auto s = HttpServer::Start(o, std::move(h));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// A "prefill" server that answers each completion with the body the test chose, a "decode"
// that answers a fixed completion, and a read-mode router in front of them.
TEST(HostileUpstream, MalformedPrefillAnswersAre502AndTheRouterKeepsServing) {
  std::atomic<int> which{0};
  const std::string good_prefill =
      R"({"choices":[{"token_ids":[65]}],"kv_transfer_params":{"do_remote_prefill":true}})";
  std::string deep = R"({"choices":[{"token_ids":[65]}],"kv_transfer_params":{},"kvwire":)";
  deep += std::string(200000, '[') + std::string(200000, ']') + "}";
  const std::vector<std::pair<int, std::string>> answers = {
      {200, R"({"choices":[{"token_ids":[65]}],"kv_transfer_params":{}})"},
      {200, R"({"choices":[{"token_ids":[65]}],"kv_transfer_params":{"do_remote_prefill":1}})"},
      {200, R"({"choices":[{}],"kv_transfer_params":{"do_remote_prefill":false}})"},
      {200, R"({"choices":[{"token_ids":[65]}]})"},
      {200, R"({"choices":[5],"kv_transfer_params":{}})"},
      {200, R"({"choices":"x"})"},
      {200, R"([])"},
      {200, R"({"choices":[{"token_ids":[1]}],"kv_transfer_params":5})"},
      {200, R"({"choices":[{"token_ids":[1]}],"kv_transfer_params":{},"kvwire":7})"},
      {200, deep},
      {200, "not json"},
      {500, R"({"error":{"message":5}})"},
      {500, R"({"error":"flat"})"},
      {500, R"({"error":{"message":{"nested":true}}})"},
  };
  auto prefill = StartServer([&](const HttpRequest&, std::shared_ptr<Responder> resp) {
    const int i = which.load();
    if (i < static_cast<int>(answers.size())) {
      resp->Respond(answers[i].first, answers[i].second);
    } else {
      resp->Respond(200, good_prefill);
    }
  });
  const std::string decode_answer =
      R"({"id":"d","object":"text_completion","choices":[{"index":0,"text":"AB","token_ids":[65,66],"finish_reason":"length"}],"kvwire":{"role":"decode"}})";
  kvwire::Mutex mu;  // the decode server's io thread writes, the test reads
  int decode_calls = 0;
  std::string decode_body;
  auto decode = StartServer([&](const HttpRequest& r, std::shared_ptr<Responder> resp) {
    if (r.method == "GET" && r.target == "/health") {
      // The router's instance set polls every instance's load; not a request sent on.
      resp->Respond(200, R"({"role":"decode"})");
      return;
    }
    {
      kvwire::MutexLock lock(&mu);
      ++decode_calls;
      decode_body = r.body;
    }
    resp->Respond(200, decode_answer);
  });
  ASSERT_NE(prefill, nullptr);
  ASSERT_NE(decode, nullptr);
  RouterOptions o;
  o.prefill = {Addr(prefill->port())};
  o.decode = {Addr(decode->port())};
  o.timeout = absl::Seconds(20);
  auto router = Router::Start(o);
  ASSERT_TRUE(router.ok()) << router.status();
  const std::string ra = Addr((*router)->port());
  for (size_t i = 0; i < answers.size(); ++i) {
    SCOPED_TRACE(answers[i].second.substr(0, 100));
    which.store(static_cast<int>(i));
    HttpCallOptions co;
    co.deadline = absl::Now() + absl::Seconds(20);
    auto r = HttpCall(ra, "POST", "/v1/completions", R"({"prompt":"hello","max_tokens":2})", co);
    ASSERT_TRUE(r.ok()) << "the router did not answer: " << r.status();
    EXPECT_EQ(r->status, 502) << r->body.substr(0, 300);
    EXPECT_NE(r->body.find("prefill"), std::string::npos) << r->body.substr(0, 300);
  }
  {
    kvwire::MutexLock lock(&mu);
    EXPECT_EQ(decode_calls, 0) << "a malformed prefill answer reached decode: "
                               << decode_body.substr(0, 300);
  }
  // A well-formed exchange afterwards: decode's answer reaches the client byte for byte, and
  // decode was sent prefill's kv_transfer_params (never a client's kvwire_prefill, and no
  // token: decode recomputes the first one).
  which.store(static_cast<int>(answers.size()));
  HttpCallOptions co;
  co.deadline = absl::Now() + absl::Seconds(20);
  auto r = HttpCall(ra, "POST", "/v1/completions",
                    R"({"prompt":"hello","max_tokens":2,"kvwire_prefill":{"forged":1}})", co);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->body, decode_answer);
  kvwire::MutexLock lock(&mu);
  json sent = json::parse(decode_body, nullptr, false);
  ASSERT_TRUE(sent.is_object()) << decode_body;
  EXPECT_FALSE(sent.contains("first_token")) << decode_body;
  EXPECT_EQ(sent["kv_transfer_params"], json({{"do_remote_prefill", true}})) << decode_body;
  EXPECT_FALSE(sent.contains("kvwire_prefill")) << decode_body;
}

// More connections than the cap: the extra ones get 503 at once; once the flood closes, the
// server serves again.
TEST(HttpLimits, ConnectionFloodGets503AndServerRecovers) {
  HttpServerOptions o;
  o.max_connections = 8;
  auto server = StartServer(
      [](const HttpRequest& r, std::shared_ptr<Responder> resp) {
        resp->Respond(200, "ok:" + r.body, "text/plain");
      },
      o);
  ASSERT_NE(server, nullptr);
  std::vector<std::unique_ptr<RawClient>> flood;
  for (int i = 0; i < 8; ++i) {
    flood.push_back(std::make_unique<RawClient>(server->port()));
    ASSERT_TRUE(flood.back()->connected());
    // A partial request: the connection holds its slot until the read deadline.
    ASSERT_TRUE(flood.back()->Send("POST / HTTP/1.1\r\n"));
  }
  // The server has taken all eight (a request on a ninth is refused, not queued).
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::string got;
  while (absl::Now() < deadline) {
    RawClient extra(server->port());
    ASSERT_TRUE(extra.connected());
    extra.Send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    got = extra.ReadAll();
    if (got.rfind("HTTP/1.1 503", 0) == 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(got.rfind("HTTP/1.1 503", 0), 0u) << got;
  EXPECT_NE(got.find("too many connections"), std::string::npos) << got;
  flood.clear();
  // Slots come back as the flood's connections close.
  absl::StatusOr<HttpResponse> r = absl::UnknownError("not run");
  const absl::Time again = absl::Now() + absl::Seconds(10);
  while (absl::Now() < again) {
    r = HttpCall(Addr(server->port()), "POST", "/", "legit");
    if (r.ok() && r->status == 200) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "ok:legit");
}

// A client that keeps sending one byte at a time never completes its request: the read
// deadline is for the whole request, not per byte, and it ends with a 408.
TEST(HttpLimits, SlowSenderIsCutOffAtTheRequestDeadline) {
  HttpServerOptions o;
  o.read_timeout = absl::Seconds(1);
  auto server = StartServer(
      [](const HttpRequest&, std::shared_ptr<Responder> resp) { resp->Respond(200, "{}"); }, o);
  ASSERT_NE(server, nullptr);
  RawClient slow(server->port());
  ASSERT_TRUE(slow.connected());
  const std::string request = "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n";
  const absl::Time start = absl::Now();
  bool refused = false;
  for (size_t i = 0; i < request.size() + 100 && absl::Now() - start < absl::Seconds(8); ++i) {
    if (!slow.Send(i < request.size() ? request.substr(i, 1) : "a")) {
      refused = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  const std::string got = slow.ReadAll();
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_EQ(got.rfind("HTTP/1.1 408", 0), 0u) << "refused=" << refused << " got: " << got;
  // The server still serves.
  auto r = HttpCall(Addr(server->port()), "POST", "/", "{}");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
}

TEST(HttpLimits, OversizedHeadersGet431) {
  auto server = StartServer(
      [](const HttpRequest&, std::shared_ptr<Responder> resp) { resp->Respond(200, "{}"); });
  ASSERT_NE(server, nullptr);
  RawClient c(server->port());
  ASSERT_TRUE(c.connected());
  std::string req = "GET / HTTP/1.1\r\nHost: x\r\n";
  for (int i = 0; i < 2000; ++i)
    req += absl::StrCat("X-Pad-", i, ": ", std::string(60, 'p'), "\r\n");
  req += "\r\n";
  c.Send(req);
  const std::string got = c.ReadAll();
  EXPECT_EQ(got.rfind("HTTP/1.1 431", 0), 0u) << got.substr(0, 200);
  auto r = HttpCall(Addr(server->port()), "GET", "/", "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
}

// Out of file descriptors, accept fails (EMFILE) while connections wait in the backlog: the
// server pauses between attempts instead of spinning on the error, and serves again once
// descriptors are free.
TEST(HttpLimits, OutOfFileDescriptorsDoesNotSpin) {
  auto server = StartServer(
      [](const HttpRequest&, std::shared_ptr<Responder> resp) { resp->Respond(200, "{}"); });
  ASSERT_NE(server, nullptr);
  // One answered request first: the server's thread is surely running before descriptors run
  // out (UBSan's checks at a thread's start need a pipe, and would misreport without one).
  absl::StatusOr<HttpResponse> warm = HttpCall(Addr(server->port()), "GET", "/", "");
  ASSERT_TRUE(warm.ok() && warm->status == 200) << warm.status();
  // Client sockets made first: connecting them needs no new descriptor.
  std::vector<int> clients;
  for (int i = 0; i < 4; ++i) clients.push_back(socket(AF_INET, SOCK_STREAM, 0));
  // The limit bounds descriptor numbers: below the lowest free one, none can be made.
  int lowest_free = 0;
  while (fcntl(lowest_free, F_GETFD) != -1) ++lowest_free;
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(server->port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int fd : clients) {
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  }
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  absl::SleepFor(absl::Seconds(1));
  getrusage(RUSAGE_SELF, &after);
  // The condition under test happened: no descriptor could be made, and the server's accept
  // failed (and paused) at least once.
  const int probe = socket(AF_INET, SOCK_STREAM, 0);
  const int probe_errno = errno;
  const uint64_t accept_failures = server->accept_failures();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  if (probe >= 0) close(probe);
  EXPECT_EQ(probe, -1) << "a descriptor could still be made: EMFILE was not reached";
  EXPECT_EQ(probe_errno, EMFILE);
  EXPECT_GE(accept_failures, 1u) << "the server's accept never failed: EMFILE was not reached";
  auto cpu = [](const rusage& r) {
    return absl::DurationFromTimeval(r.ru_utime) + absl::DurationFromTimeval(r.ru_stime);
  };
  // A server retrying at once burns the whole second on one core.
  EXPECT_LT(cpu(after) - cpu(before), absl::Milliseconds(300));
  for (int fd : clients) close(fd);
  absl::StatusOr<HttpResponse> r = absl::UnknownError("not run");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    r = HttpCall(Addr(server->port()), "GET", "/", "");
    if (r.ok() && r->status == 200) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
}

}  // namespace
}  // namespace dsv4::serve

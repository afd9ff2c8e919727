// The serving plumbing without a model: HTTP server and client on real loopback sockets,
// server-sent events, request validation, flags, and the router's answers when its
// upstream servers are unreachable or fail.
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/flags.h"
#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/http_server.h"
#include "examples/dsv4/serve/router.h"
#include "examples/dsv4/serve/sse.h"
#include "src/util/mutex.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;

std::string Addr(int port) { return absl::StrCat("127.0.0.1:", port); }

// A port nothing listens on (bound, then closed).
int DeadPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

TEST(Sse, EventsInAnyPieces) {
  const std::string s =
      "data: {\"a\":1}\n\n: comment\n\ndata: x\ndata: y\n\nevent: e\r\ndata: z\r\n\r\ndata: "
      "[DONE]\n\n";
  for (size_t piece : {1, 2, 5, 1000}) {
    SseParser p;
    std::vector<std::string> all;
    for (size_t i = 0; i < s.size(); i += piece) {
      for (std::string& e : p.Feed(s.substr(i, piece))) all.push_back(e);
    }
    EXPECT_EQ(all, (std::vector<std::string>{"{\"a\":1}", "x\ny", "z", "[DONE]"})) << piece;
    EXPECT_EQ(p.pending(), 0u);
  }
}

TEST(Flags, ParsesAndRejects) {
  auto f = Flags::Parse({"--a", "1", "--b=x", "--c", "--a", "2"}, {"a", "b"}, {"c"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->Get("a"), "2");
  EXPECT_EQ(f->GetAll("a"), (std::vector<std::string>{"1", "2"}));
  EXPECT_EQ(f->Get("b"), "x");
  EXPECT_TRUE(f->Has("c"));
  EXPECT_EQ(*f->GetInt("a", 0), 2);
  EXPECT_FALSE(f->GetInt("b", 0).ok());
  EXPECT_NE(Flags::Parse({"--zzz", "1"}, {"a"}).status().message().find("--zzz"),
            std::string::npos);
  EXPECT_NE(Flags::Parse({"--a"}, {"a"}).status().message().find("needs a value"),
            std::string::npos);
  EXPECT_NE(f->Require({"q"}).message().find("--q is required"), std::string::npos);
}

TEST(CompletionApi, ValidatesEveryField) {
  auto ok = ParseCompletionRequest(
      R"({"prompt":"hi","max_tokens":3,"temperature":0.5,"seed":7,"stream":true,
          "kv_transfer_params":{"do_remote_decode":true}})",
      258);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->prompt, "hi");
  EXPECT_EQ(ok->max_tokens, 3);
  EXPECT_DOUBLE_EQ(ok->sampling.temperature, 0.5);
  EXPECT_EQ(ok->sampling.seed, 7u);
  EXPECT_TRUE(ok->stream);
  EXPECT_TRUE(ok->kv_transfer_params.value("do_remote_decode", false));
  const std::pair<const char*, const char*> bad[] = {
      {"{not json", "not valid JSON"},
      {"[1]", "JSON object"},
      {"{}", "'prompt' is required"},
      {R"({"prompt":5})", "'prompt'"},
      {R"({"prompt":"a","max_tokens":0})", "'max_tokens'"},
      {R"({"prompt":"a","max_tokens":"3"})", "'max_tokens'"},
      {R"({"prompt":"a","temperature":-1})", "'temperature'"},
      {R"({"prompt":"a","seed":9223372036854775808})", "'seed'"},
      {R"({"prompt":"a","stream":"yes"})", "'stream'"},
      {R"({"prompt":"a","kv_transfer_params":"x"})", "'kv_transfer_params'"},
      {R"({"prompt":"a","first_token":65})", "'first_token' is not supported"},
  };
  for (const auto& [body, want] : bad) {
    auto r = ParseCompletionRequest(body, 258);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status() << " " << body;
  }
}

// A server whose handler the test controls.
class HttpTest : public ::testing::Test {
 protected:
  void Start(HttpServer::Handler h, HttpServerOptions o = HttpServerOptions()) {
    auto s = HttpServer::Start(o, std::move(h));
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  std::string address() const { return Addr(server_->port()); }
  std::unique_ptr<HttpServer> server_;
};

TEST_F(HttpTest, RequestResponseAndErrors) {
  Start([](const HttpRequest& r, std::shared_ptr<Responder> resp) {
    if (r.target == "/echo") return resp->Respond(200, r.method + ":" + r.body, "text/plain");
    if (r.target == "/drop") return;  // the Responder goes away unanswered
    resp->Error(404, "nothing at " + r.target);
  });
  auto r = HttpCall(address(), "POST", "/echo", "hello");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "POST:hello");
  r = HttpCall(address(), "GET", "/nope", "");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 404);
  json j = json::parse(r->body);
  EXPECT_EQ(j["error"]["code"], 404);
  EXPECT_EQ(j["error"]["message"], "nothing at /nope");
  r = HttpCall(address(), "GET", "/drop", "");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 500);
  // Nobody listening: Unavailable, nothing sent.
  r = HttpCall(Addr(DeadPort()), "GET", "/", "");
  EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
}

TEST_F(HttpTest, MalformedAndOversizedRequests) {
  HttpServerOptions o;
  o.body_limit = 1000;
  Start([](const HttpRequest&, std::shared_ptr<Responder> resp) { resp->Respond(200, "{}"); }, o);
  auto r = HttpCall(address(), "POST", "/x", std::string(5000, 'a'));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 413);
  // Not HTTP at all.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(server_->port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  const std::string junk = "\x01\x02 nonsense\r\n\r\n";
  ASSERT_EQ(write(fd, junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  std::string got;
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) got.append(buf, n);
  close(fd);
  EXPECT_EQ(got.rfind("HTTP/1.1 400", 0), 0u) << got;
}

TEST_F(HttpTest, StreamsEventsFromAnotherThread) {
  std::vector<std::thread> threads;
  kvwire::Mutex mu;
  Start([&](const HttpRequest&, std::shared_ptr<Responder> resp) {
    kvwire::MutexLock lock(&mu);
    threads.emplace_back([resp] {
      resp->StartEvents();
      for (int i = 0; i < 5; ++i) {
        json chunk = {{"choices", {{{"text", "t"}, {"token_ids", {i}}}}}};
        resp->Event(chunk.dump());
        absl::SleepFor(absl::Milliseconds(5));
      }
      json last = {
          {"choices", {{{"text", ""}, {"token_ids", json::array()}, {"finish_reason", "length"}}}},
          {"kvwire", {{"x", 1}}}};
      resp->Event(last.dump());
      resp->EndEvents();
    });
  });
  auto r = Complete(address(), {{"prompt", "p"}, {"stream", true}}, absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_TRUE(r->done);
  EXPECT_EQ(r->tokens, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(r->text, "ttttt");
  EXPECT_EQ(r->finish_reason, "length");
  EXPECT_EQ(r->kvwire["x"], 1);
  kvwire::MutexLock lock(&mu);
  for (std::thread& t : threads) t.join();
}

TEST_F(HttpTest, DeadlineAndClientGone) {
  std::shared_ptr<Responder> held;
  kvwire::Mutex mu;
  Start([&](const HttpRequest&, std::shared_ptr<Responder> resp) {
    kvwire::MutexLock lock(&mu);
    held = resp;  // never answered while the client waits
  });
  HttpCallOptions o;
  o.deadline = absl::Now() + absl::Milliseconds(300);
  auto r = HttpCall(address(), "GET", "/slow", "", o);
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  // The server notices that the client went away.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool closed = false;
  while (!closed && absl::Now() < deadline) {
    {
      kvwire::MutexLock lock(&mu);
      closed = held && held->closed();
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(closed);
  kvwire::MutexLock lock(&mu);
  held.reset();
}

TEST(Router, UnreachableServersGive503AndFailuresGive502) {
  // A "prefill" that answers 500 and one that is not there.
  auto failing = HttpServer::Start(HttpServerOptions(),
                                   [](const HttpRequest& r, std::shared_ptr<Responder> resp) {
                                     resp->Error(500, "model exploded");
                                   });
  ASSERT_TRUE(failing.ok());
  RouterOptions o;
  o.prefill = {Addr(DeadPort())};
  o.decode = {Addr(DeadPort())};
  o.timeout = absl::Seconds(20);
  auto router = Router::Start(o);
  ASSERT_TRUE(router.ok()) << router.status();
  const std::string ra = Addr((*router)->port());
  auto r = Complete(ra, {{"prompt", "hello"}, {"max_tokens", 4}}, absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 503);
  EXPECT_NE(r->error.find("prefill"), std::string::npos) << r->error;
  // Bad JSON never reaches a server.
  auto bad = HttpCall(ra, "POST", "/v1/completions", "{oops");
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(bad->status, 400);

  o.prefill = {Addr(DeadPort()), Addr((*failing)->port())};  // the dead one is skipped
  auto router2 = Router::Start(o);
  ASSERT_TRUE(router2.ok());
  r = Complete(Addr((*router2)->port()), {{"prompt", "hello"}, {"stream", true}},
               absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 502);
  EXPECT_NE(r->error.find("model exploded"), std::string::npos) << r->error;
  auto health = GetJson(Addr((*router2)->port()), "/health");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ((*health)["role"], "router");
}

}  // namespace
}  // namespace dsv4::serve

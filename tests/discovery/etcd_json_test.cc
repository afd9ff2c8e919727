// The etcd gateway's answers as etcd 3.4 writes them (captured from a real member), and the
// malformed ones a wrong endpoint could send: typed, bounded, never a throw.
#include "src/discovery/etcd_json.h"

#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

#include "src/discovery/instance.h"

namespace kvwire::discovery {
namespace {

constexpr char kHeader[] =
    R"("header":{"cluster_id":"15118495548433857066","member_id":"13668033151171901709","revision":"7","raft_term":"2"})";

TEST(EtcdJson, RangeWithKeys) {
  const std::string body = absl::StrCat(
      "{", kHeader,
      R"(,"kvs":[{"key":"L2t2d2lyZS9h","create_revision":"2","mod_revision":"5","version":"3","value":"aGVsbG8=","lease":"4111120375727928581"}],"count":"1"})");
  absl::StatusOr<EtcdRange> r = ParseRangeResponse(body);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->revision, 7);
  ASSERT_EQ(r->kvs.size(), 1u);
  EXPECT_EQ(r->kvs[0].key, "/kvwire/a");
  EXPECT_EQ(r->kvs[0].value, "hello");
  EXPECT_EQ(r->kvs[0].mod_revision, 5);
  EXPECT_EQ(r->kvs[0].lease, 4111120375727928581);
  EXPECT_FALSE(r->more);
}

TEST(EtcdJson, EmptyRangeLeavesKvsOut) {
  absl::StatusOr<EtcdRange> r = ParseRangeResponse(absl::StrCat("{", kHeader, "}"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->kvs.empty());
  EXPECT_EQ(r->revision, 7);
}

TEST(EtcdJson, ErrorsKeepEtcdsCode) {
  absl::Status s = EtcdError(
      404,
      R"({"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5})");
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_NE(s.message().find("requested lease not found"), std::string::npos);
  // The watch stream's form.
  s = EtcdError(200, R"({"error":{"grpc_code":14,"http_code":503,"message":"no leader"}})");
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  // Not JSON with a non-200 status (a proxy's page).
  s = EtcdError(502, "<html>bad gateway</html>");
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_TRUE(EtcdError(200, absl::StrCat("{", kHeader, "}")).ok());
  // A parser surfaces the error too.
  EXPECT_TRUE(
      absl::IsNotFound(ParseRangeResponse(R"({"error":"x","message":"x","code":5})").status()));
}

TEST(EtcdJson, LeaseGrantAndKeepAlive) {
  absl::StatusOr<EtcdLease> g =
      ParseLeaseGrantResponse(absl::StrCat("{", kHeader, R"(,"ID":"4111","TTL":"2"})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->id, 4111);
  EXPECT_EQ(g->ttl, 2);
  EXPECT_FALSE(ParseLeaseGrantResponse(absl::StrCat("{", kHeader, "}")).ok());
  absl::StatusOr<EtcdLease> k = ParseKeepAliveResponse(
      absl::StrCat(R"({"result":{)", kHeader, R"(,"ID":"4111","TTL":"2"}})"));
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->ttl, 2);
  // An expired lease: TTL left out (zero).
  k = ParseKeepAliveResponse(absl::StrCat(R"({"result":{)", kHeader, R"(,"ID":"4111"}})"));
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->ttl, 0);
}

TEST(EtcdJson, WatchMessages) {
  absl::StatusOr<EtcdWatchMessage> m =
      ParseWatchMessage(absl::StrCat(R"({"result":{)", kHeader, R"(,"created":true}})"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->created);
  EXPECT_TRUE(m->events.empty());
  m = ParseWatchMessage(absl::StrCat(
      R"({"result":{)", kHeader,
      R"(,"events":[{"kv":{"key":"L2t2d2lyZS9h","create_revision":"2","mod_revision":"2","version":"1","value":"aGVsbG8="}},{"type":"DELETE","kv":{"key":"L2t2d2lyZS9h","mod_revision":"3"}}]}})"));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->events.size(), 2u);
  EXPECT_FALSE(m->events[0].deleted);
  EXPECT_EQ(m->events[0].kv.value, "hello");
  EXPECT_TRUE(m->events[1].deleted);
  EXPECT_EQ(m->events[1].kv.mod_revision, 3);
  m = ParseWatchMessage(
      absl::StrCat(R"({"result":{)", kHeader, R"(,"canceled":true,"compact_revision":"5"}})"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->canceled);
  EXPECT_EQ(m->compact_revision, 5);
}

TEST(EtcdJson, MalformedIsAnErrorNamingTheField) {
  const std::vector<std::string> bad = {
      "",
      "[]",
      "{",
      R"({"header":{"revision":"x"}})",
      R"({"header":{"revision":"-1"}})",
      R"({"header":{"revision":"99999999999999999999999"}})",
      R"({"header":{"revision":"1"},"kvs":[{"key":"!!!"}]})",
      R"({"header":{"revision":"1"},"kvs":[{"value":"aGk="}]})",
      R"({"header":{"revision":"1"},"kvs":{"key":"aGk="}})",
      R"({"header":{"revision":"1"},"kvs":[{"key":"aGk=","mod_revision":[]}]})",
      R"({"header":{"revision":"1"},"kvs":[{"key":"aGk=","value":7}]})",
  };
  for (const std::string& b : bad) {
    absl::StatusOr<EtcdRange> r = ParseRangeResponse(b);
    EXPECT_FALSE(r.ok()) << b;
  }
  absl::StatusOr<EtcdRange> r =
      ParseRangeResponse(R"({"header":{"revision":"1"},"kvs":[{"key":"!!!"}]})");
  EXPECT_NE(r.status().message().find("key"), std::string::npos) << r.status();
  EXPECT_FALSE(
      ParseWatchMessage(
          R"({"result":{"header":{"revision":"1"},"events":[{"type":"MOVE","kv":{"key":"aGk="}}]}})")
          .ok());
  // A value over the cap.
  const std::string big = absl::Base64Escape(std::string(kEtcdMaxValueBytes + 10, 'x'));
  EXPECT_FALSE(ParseRangeResponse(
                   absl::StrCat(R"({"header":{"revision":"1"},"kvs":[{"key":"aGk=","value":")", big,
                                R"("}]})"))
                   .ok());
}

TEST(EtcdJson, PrefixRangeEnd) {
  EXPECT_EQ(PrefixRangeEnd("/kvwire/c/"), "/kvwire/c0");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff", 2)), "b");
  EXPECT_EQ(PrefixRangeEnd(""), std::string(1, '\0'));
}

TEST(InstanceRecord, RoundTripAndChecks) {
  InstanceRecord r;
  r.name = "dsv4-decode-1";
  r.role = "decode";
  r.kv_address = "127.0.0.1:4000";
  r.http_address = "127.0.0.1:8200";
  r.transports = {"tcp", "shm"};
  r.compat_hash = "00ff";
  r.layout = {{"groups", 5}};
  absl::StatusOr<InstanceRecord> back = InstanceRecord::FromJson(r.ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ToJson(), r.ToJson());
  EXPECT_FALSE(InstanceRecord::FromJson(R"({"name":"a/b","role":"decode"})").ok());
  EXPECT_FALSE(InstanceRecord::FromJson(R"({"name":"a","role":"boss"})").ok());
  EXPECT_FALSE(InstanceRecord::FromJson(R"({"name":"a","role":"decode","transports":[1]})").ok());
  EXPECT_EQ(InstanceKey("c1", "e1"), "/kvwire/c1/instances/e1");
  EXPECT_FALSE(CheckName("cluster", "").ok());
  EXPECT_FALSE(CheckName("cluster", "a b").ok());
  EXPECT_TRUE(CheckName("cluster", "prod-1.eu_west").ok());
}

}  // namespace
}  // namespace kvwire::discovery

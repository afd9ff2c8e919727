// kv_transfer_params, mode negotiation and the C API's error reporting, without peers.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <string>
#include <unistd.h>
#include <utility>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"

#include "kvwire/connector.h"
#include "kvwire/kvwire.h"

namespace kvwire {
namespace {

TEST(KvModeTest, Negotiation) {
  EXPECT_EQ(*NegotiateKvMode(KvMode::kAuto, KvMode::kAuto), KvMode::kRead);
  EXPECT_EQ(*NegotiateKvMode(KvMode::kAuto, KvMode::kWrite), KvMode::kWrite);
  EXPECT_EQ(*NegotiateKvMode(KvMode::kWrite, KvMode::kAuto), KvMode::kWrite);
  EXPECT_EQ(*NegotiateKvMode(KvMode::kRead, KvMode::kRead), KvMode::kRead);
  absl::StatusOr<KvMode> conflict = NegotiateKvMode(KvMode::kRead, KvMode::kWrite);
  ASSERT_FALSE(conflict.ok());
  EXPECT_NE(conflict.status().message().find("prefill is 'read', decode is 'write'"),
            std::string::npos);
  EXPECT_FALSE(ParseKvMode("push").ok());
}

TEST(KvTransferParamsTest, RoundTripAndValidation) {
  KvTransferParams p;
  p.engine_id = "prefill-0";
  p.host = "10.0.0.1";
  p.port = 5555;
  p.transfer_id = "t-1";
  p.mode = KvMode::kRead;
  p.num_tokens = 300;
  p.block_ids = {{"mla_kv", {3, 9, -1}}};
  p.do_remote_prefill = true;
  absl::StatusOr<KvTransferParams> back = KvTransferParams::FromJson(p.ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ToJson(), p.ToJson());
  EXPECT_EQ(back->block_ids.at("mla_kv")[2], -1);
  for (const char* bad :
       {"", "[]", "{\"mode\": \"sideways\"}", "{\"remote_port\": 70000}",
        "{\"do_remote_prefill\": true, \"remote_host\": \"h\", \"remote_port\": 1}",
        "{\"do_remote_prefill\": true, \"remote_host\": \"h\", \"remote_port\": 1, "
        "\"transfer_id\": \"t\", \"num_tokens\": 5, \"mode\": \"read\"}",
        "{\"block_ids\": [1, 2]}"}) {
    EXPECT_FALSE(KvTransferParams::FromJson(bad).ok()) << bad;
  }
}

// vLLM's P/D connectors' names (NIXL, MoRIIO) as their proxies pass them on: nulls and unknown
// fields read as absent; remote_block_ids flat, per group, or by name; remote_request_id
// stands in for transfer_id.
TEST(KvTransferParamsTest, VllmNames) {
  absl::StatusOr<KvTransferParams> proxy = KvTransferParams::FromJson(
      R"({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
          "remote_block_ids": null, "remote_host": null, "remote_port": null,
          "tp_size": null, "something_new": {"x": [1, null]}})");
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  EXPECT_TRUE(proxy->do_remote_decode);
  EXPECT_TRUE(proxy->host.empty());
  EXPECT_EQ(proxy->tp_size, 1);

  absl::StatusOr<KvTransferParams> nixl = KvTransferParams::FromJson(
      R"({"do_remote_prefill": true, "remote_engine_id": "p0", "remote_host": "10.0.0.1",
          "remote_port": 5600, "remote_request_id": "cmpl-7", "tp_size": 2,
          "remote_block_ids": [[3, 7], [9]]})");
  ASSERT_TRUE(nixl.ok()) << nixl.status();
  EXPECT_EQ(nixl->engine_id, "p0");
  EXPECT_EQ(nixl->transfer_id, "cmpl-7");
  EXPECT_EQ(nixl->tp_size, 2);
  EXPECT_EQ(nixl->num_tokens, 0u);  // absent: the whole prompt
  EXPECT_EQ(nixl->block_ids, (BlockTable{{"0", {3, 7}}, {"1", {9}}}));
  // Written back in the same names, per-group lists included.
  const std::string out = nixl->ToJson();
  EXPECT_NE(out.find(R"("remote_block_ids":[[3,7],[9]])"), std::string::npos) << out;
  EXPECT_NE(out.find(R"("remote_engine_id":"p0")"), std::string::npos) << out;
  EXPECT_NE(out.find(R"("remote_request_id":"cmpl-7")"), std::string::npos) << out;
  EXPECT_NE(out.find(R"("tp_size":2)"), std::string::npos) << out;

  absl::StatusOr<KvTransferParams> flat = KvTransferParams::FromJson(
      R"({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1,
          "transfer_id": "t", "remote_request_id": "r", "remote_block_ids": [4, 5]})");
  ASSERT_TRUE(flat.ok()) << flat.status();
  EXPECT_EQ(flat->transfer_id, "t");  // transfer_id wins over remote_request_id
  EXPECT_EQ(flat->block_ids, (BlockTable{{"0", {4, 5}}}));

  absl::StatusOr<KvTransferParams> named = KvTransferParams::FromJson(
      R"({"remote_block_ids": {"swa_kv": [1]}, "block_ids": {"ignored": [2]}})");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->block_ids, (BlockTable{{"swa_kv", {1}}}));

  for (const char* bad : {R"({"remote_block_ids": [[1], 2]})", R"({"remote_block_ids": [1, [2]]})",
                          R"({"remote_block_ids": "1,2"})", R"({"remote_block_ids": [1.5]})",
                          R"({"tp_size": 0})", R"({"remote_engine_id": 5})"}) {
    absl::StatusOr<KvTransferParams> p = KvTransferParams::FromJson(bad);
    EXPECT_FALSE(p.ok()) << bad;
    EXPECT_TRUE(absl::IsInvalidArgument(p.status())) << bad;
  }
  // A bad id is named by its place (the name is built only for the error).
  for (const auto& [bad, place] :
       {std::pair{R"({"remote_block_ids": [4, 5, -2]})", "remote_block_ids[2]"},
        std::pair{R"({"remote_block_ids": [[4], [5, "x"]]})", "remote_block_ids[1][1]"},
        std::pair{R"({"block_ids": {"g": [1, 2, 3, 1e300]}})", "g[3]"}}) {
    absl::StatusOr<KvTransferParams> p = KvTransferParams::FromJson(bad);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_TRUE(absl::StrContains(p.status().message(), place)) << p.status();
  }
}

TEST(CApiTest, ErrorsComeBackAsCodesAndMessages) {
  char* err = nullptr;
  EXPECT_EQ(kvw_layout_preset("no-such-model", &err), nullptr);
  ASSERT_NE(err, nullptr);
  EXPECT_NE(std::string(err).find("no-such-model"), std::string::npos);
  kvw_free(err);
  err = nullptr;
  kvw_layout_t* pro = kvw_layout_preset("deepseek-v4-pro", &err);
  kvw_layout_t* flash = kvw_layout_preset("deepseek-v4-flash", &err);
  ASSERT_NE(pro, nullptr);
  ASSERT_NE(flash, nullptr);
  EXPECT_EQ(kvw_layout_num_groups(pro), 7u);
  EXPECT_EQ(kvw_layout_group_page_bytes(pro, 0), 37440u);
  EXPECT_NE(kvw_layout_check_compatible(pro, flash, &err), 0);
  ASSERT_NE(err, nullptr);
  EXPECT_NE(std::string(err).find("swa_kv"), std::string::npos);
  kvw_free(err);
  err = nullptr;
  char* json = kvw_layout_to_json(pro);
  kvw_layout_t* again = kvw_layout_from_json(json, &err);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(kvw_layout_check_compatible(pro, again, &err), 0);
  EXPECT_EQ(err, nullptr);
  kvw_free(json);
  kvw_options_t* o = kvw_options_create();
  // Any name is taken by the setter; Engine::Create (the one validator) refuses an unknown one.
  EXPECT_EQ(kvw_options_set_transport(o, "pigeon", &err), 0);
  kvw_options_set_name(o, "capi-unit");
  EXPECT_EQ(kvw_connector_create(o, &err), nullptr);
  ASSERT_NE(err, nullptr);
  EXPECT_THAT(std::string(err), ::testing::HasSubstr("unknown transport \"pigeon\""));
  kvw_free(err);
  err = nullptr;
  EXPECT_EQ(kvw_options_set_transport(o, "auto", &err), 0);
  kvw_connector_t* c = kvw_connector_create(o, &err);
  ASSERT_NE(c, nullptr) << err;
  uint64_t external = 7;
  int async = 0;
  EXPECT_EQ(kvw_get_num_new_matched_tokens(c, "r", 10, 0, "", &external, &async, &err), 0);
  EXPECT_EQ(external, 0u);
  EXPECT_NE(kvw_bind_connector_meta(c, "garbage", &err), 0);
  kvw_free(err);
  err = nullptr;
  EXPECT_NE(kvw_abort(c, "unknown", &err), 0);
  kvw_free(err);
  EXPECT_EQ(kvw_live_requests(c), 0u);
  kvw_connector_destroy(c);
  kvw_options_destroy(o);
  kvw_layout_destroy(again);
  kvw_layout_destroy(pro);
  kvw_layout_destroy(flash);
}

// The C ABI's memory kinds and event-gated saves, without a GPU: kinds are checked, host
// memory registers through either call, GPU memory that is not GPU memory is refused, and an
// event save with nothing to save returns at once without touching the event.
TEST(CApiTest, KvMemoryKindsAndEventSaves) {
  char* err = nullptr;
  kvw_layout_t* l = kvw_layout_preset("deepseek-v3", &err);
  ASSERT_NE(l, nullptr) << err;
  const uint64_t bytes = kvw_layout_assign_backing(l, 0, 8, 2) + 4096;
  kvw_buffer_t* buf = kvw_buffer_create(bytes, &err);
  ASSERT_NE(buf, nullptr) << err;
  kvw_layout_assign_backing(l, reinterpret_cast<uint64_t>(kvw_buffer_data(buf)), 8, 2);
  kvw_options_t* o = kvw_options_create();
  kvw_options_set_name(o, "capi-kinds");
  kvw_connector_t* c = kvw_connector_create(o, &err);
  ASSERT_NE(c, nullptr) << err;
  void* ptrs[] = {kvw_buffer_data(buf)};
  const size_t lengths[] = {kvw_buffer_size(buf)};
  const int bad_kind[] = {7};
  EXPECT_EQ(kvw_register_kv_memory(c, l, ptrs, lengths, bad_kind, nullptr, 1, &err),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  ASSERT_NE(err, nullptr);
  EXPECT_NE(std::string(err).find("unknown memory kind 7"), std::string::npos) << err;
  kvw_free(err);
  err = nullptr;
  // Host memory claimed to be GPU memory: the runtime does not know it.
  const int gpu_kind[] = {KVW_MEMORY_GPU};
  const int device[] = {0};
  EXPECT_NE(kvw_register_kv_memory(c, l, ptrs, lengths, gpu_kind, device, 1, &err), 0);
  ASSERT_NE(err, nullptr);
  kvw_free(err);
  err = nullptr;
  EXPECT_EQ(kvw_register_kv_memory(c, l, ptrs, lengths, nullptr, nullptr, 1, &err), 0) << err;
  EXPECT_EQ(kvw_save_kv_layer_event(c, 0, nullptr, 0, &err), 0) << err;
  int not_an_event = 0;  // never used: no request saves, so nothing waits for it
  EXPECT_EQ(kvw_save_kv_layer_event(c, 0, &not_an_event, 0, &err), 0) << err;
  EXPECT_EQ(kvw_wait_for_save(c, &err), 0) << err;
  EXPECT_EQ(err, nullptr);
  kvw_connector_destroy(c);
  kvw_options_destroy(o);
  kvw_buffer_destroy(buf);
  kvw_layout_destroy(l);
}

TEST(ConnectorTest, EventSaveNeedsAnEvent) {
  ConnectorOptions o;
  o.engine.name = "event-null";
  absl::StatusOr<std::unique_ptr<Connector>> c = Connector::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status s = (*c)->SaveKvLayer(3, GpuEvent{nullptr, 0});
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("SaveKvLayer(3)"), std::string::npos) << s;
}

std::string HttpGet(const std::string& address, const std::string& path) {
  const size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "connect failed";
  }
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  close(fd);
  return out;
}

TEST(ConnectorMetricsTest, PrometheusAndJsonOverHttp) {
  ConnectorOptions o;
  o.engine.name = "metrics-unit";
  o.metrics_address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<Connector>> c = Connector::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string address = (*c)->metrics_address();
  ASSERT_FALSE(address.empty());
  const std::string prom = HttpGet(address, "/metrics");
  EXPECT_NE(prom.find("200 OK"), std::string::npos) << prom;
  EXPECT_NE(prom.find("kvwire_connector_requests_total{engine=\"metrics-unit\""), std::string::npos)
      << prom;
  const std::string json = HttpGet(address, "/stats.json");
  EXPECT_NE(json.find("\"engine_id\":\"metrics-unit\""), std::string::npos) << json;
  EXPECT_NE(HttpGet(address, "/nope").find("404"), std::string::npos);
  o.metrics_address = "not-an-address";
  EXPECT_FALSE(Connector::Create(o).ok());
}

}  // namespace
}  // namespace kvwire

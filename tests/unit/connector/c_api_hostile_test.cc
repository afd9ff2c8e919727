// The C ABI against hostile or careless callers, and its shared secret. Every call that takes
// errptr gets NULL for each pointer it needs: it returns an error naming the argument (also
// when errptr itself is NULL) instead of crashing. The secret set through
// kvw_options_set_secret, or KVWIRE_SECRET through kvw_options_from_environment, really
// authenticates: two connectors (real sockets) move a request's KV only when their secrets
// match.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

#include "kvwire/kvwire.h"

namespace {

constexpr int kInvalid = 3;  // absl::StatusCode::kInvalidArgument

// The error a call reported, freed; "" when none.
std::string Take(char** err) {
  std::string s = *err == nullptr ? "" : *err;
  kvw_free(*err);
  *err = nullptr;
  return s;
}

// Runs `call` with an errptr and expects an invalid-argument error naming `what`; then runs
// it again with errptr NULL (only the code comes back).
template <typename F>
void ExpectNullRefused(const char* what, F call) {
  SCOPED_TRACE(what);
  char* err = nullptr;
  EXPECT_EQ(call(&err), kInvalid);
  const std::string message = Take(&err);
  EXPECT_NE(message.find(what), std::string::npos) << message;
  EXPECT_NE(message.find("is NULL"), std::string::npos) << message;
  EXPECT_EQ(call(nullptr), kInvalid);
}

template <typename T, typename F>
void ExpectNullObject(const char* what, F make) {
  SCOPED_TRACE(what);
  char* err = nullptr;
  T* made = make(&err);
  EXPECT_EQ(made, nullptr);
  const std::string message = Take(&err);
  EXPECT_NE(message.find(what), std::string::npos) << message;
  EXPECT_EQ(make(nullptr), nullptr);
}

TEST(CApiNullArguments, EveryErrptrCallReportsInsteadOfCrashing) {
  char* err = nullptr;
  kvw_layout_t* layout = kvw_layout_preset("deepseek-v3", &err);
  ASSERT_NE(layout, nullptr) << Take(&err);
  kvw_options_t* o = kvw_options_create();
  ASSERT_NE(o, nullptr);
  kvw_options_set_name(o, "capi-null");
  ASSERT_EQ(kvw_options_set_transport(o, "tcp", &err), 0) << Take(&err);
  kvw_connector_t* c = kvw_connector_create(o, &err);
  ASSERT_NE(c, nullptr) << Take(&err);
  kvw_block_table_t* table = kvw_block_table_create();
  void* ptrs[1] = {nullptr};
  size_t lengths[1] = {0};
  uint64_t external = 0;
  int async = 0, delay = 0;
  char* params_out = nullptr;

  ExpectNullObject<kvw_layout_t>("name", [](char** e) { return kvw_layout_preset(nullptr, e); });
  ExpectNullObject<kvw_layout_t>("json", [](char** e) { return kvw_layout_from_json(nullptr, e); });
  ExpectNullRefused("prefill",
                    [&](char** e) { return kvw_layout_check_compatible(nullptr, layout, e); });
  ExpectNullRefused("decode",
                    [&](char** e) { return kvw_layout_check_compatible(layout, nullptr, e); });
  ExpectNullRefused("options",
                    [&](char** e) { return kvw_options_set_transport(nullptr, "tcp", e); });
  ExpectNullRefused("transport",
                    [&](char** e) { return kvw_options_set_transport(o, nullptr, e); });
  ExpectNullRefused("options",
                    [&](char** e) { return kvw_options_set_secret(nullptr, "s", 1, e); });
  ExpectNullRefused("secret", [&](char** e) { return kvw_options_set_secret(o, nullptr, 5, e); });
  ExpectNullRefused("connector", [&](char** e) {
    return kvw_register_kv_caches(nullptr, layout, ptrs, lengths, 1, e);
  });
  ExpectNullRefused(
      "layout", [&](char** e) { return kvw_register_kv_caches(c, nullptr, ptrs, lengths, 1, e); });
  ExpectNullRefused(
      "ptrs", [&](char** e) { return kvw_register_kv_caches(c, layout, nullptr, lengths, 1, e); });
  ExpectNullRefused(
      "lengths", [&](char** e) { return kvw_register_kv_caches(c, layout, ptrs, nullptr, 1, e); });
  ExpectNullRefused("connector", [&](char** e) {
    return kvw_register_kv_memory(nullptr, layout, ptrs, lengths, nullptr, nullptr, 1, e);
  });
  ExpectNullRefused("layout", [&](char** e) {
    return kvw_register_kv_memory(c, nullptr, ptrs, lengths, nullptr, nullptr, 1, e);
  });
  ExpectNullRefused("ptrs", [&](char** e) {
    return kvw_register_kv_memory(c, layout, nullptr, lengths, nullptr, nullptr, 1, e);
  });
  ExpectNullRefused("lengths", [&](char** e) {
    return kvw_register_kv_memory(c, layout, ptrs, nullptr, nullptr, nullptr, 1, e);
  });
  ExpectNullRefused("connector", [&](char** e) {
    return kvw_get_num_new_matched_tokens(nullptr, "r", 10, 0, "", &external, &async, e);
  });
  ExpectNullRefused("request_id", [&](char** e) {
    return kvw_get_num_new_matched_tokens(c, nullptr, 10, 0, "", &external, &async, e);
  });
  ExpectNullRefused("connector", [&](char** e) {
    return kvw_update_state_after_alloc(nullptr, "r", table, 0, e);
  });
  ExpectNullRefused("request_id", [&](char** e) {
    return kvw_update_state_after_alloc(c, nullptr, table, 0, e);
  });
  ExpectNullRefused("connector", [&](char** e) {
    return kvw_request_finished(nullptr, "r", table, 10, "", 0, &delay, &params_out, e);
  });
  ExpectNullRefused("request_id", [&](char** e) {
    return kvw_request_finished(c, nullptr, table, 10, "", 0, &delay, &params_out, e);
  });
  ExpectNullRefused("connector",
                    [&](char** e) { return kvw_bind_connector_meta(nullptr, "{}", e); });
  ExpectNullRefused("meta", [&](char** e) { return kvw_bind_connector_meta(c, nullptr, e); });
  ExpectNullRefused("connector", [&](char** e) { return kvw_start_load_kv(nullptr, e); });
  ExpectNullRefused("connector", [&](char** e) { return kvw_wait_for_layer_load(nullptr, 0, e); });
  ExpectNullRefused("connector", [&](char** e) { return kvw_save_kv_layer(nullptr, 0, e); });
  ExpectNullRefused("connector",
                    [&](char** e) { return kvw_save_kv_layer_event(nullptr, 0, nullptr, 0, e); });
  ExpectNullRefused("connector", [&](char** e) { return kvw_wait_for_save(nullptr, e); });
  ExpectNullRefused("connector", [&](char** e) { return kvw_abort(nullptr, "r", e); });
  ExpectNullRefused("request_id", [&](char** e) { return kvw_abort(c, nullptr, e); });
  EXPECT_EQ(params_out, nullptr);

  // Errors with errptr NULL are still reported by their code, and the connector still works.
  EXPECT_NE(kvw_abort(c, "unknown", nullptr), 0);
  EXPECT_EQ(kvw_get_num_new_matched_tokens(c, "r", 10, 0, nullptr, &external, &async, &err), 0)
      << Take(&err);
  EXPECT_EQ(external, 0u);
  EXPECT_EQ(kvw_options_set_secret(o, nullptr, 0, &err), 0) << Take(&err);  // clears it
  kvw_block_table_destroy(table);
  kvw_connector_destroy(c);
  kvw_options_destroy(o);
  kvw_layout_destroy(layout);
}

// --- the shared secret ---------------------------------------------------------------------

// Token-major pages (section_row_bytes): read grants clear what a request did not fill.
constexpr char kLayout[] =
    R"({"model":"toy","groups":[{"name":"full","layers":[0,1],"tokens_per_block":16,)"
    R"("page_bytes":256,"section_row_bytes":[16]}]})";
constexpr uint64_t kBlocks = 8;
constexpr uint64_t kTokens = 40;  // three blocks

// One connector over its own KV memory. `secret` nullptr: none set (KVWIRE_SECRET applies).
struct Peer {
  kvw_layout_t* layout = nullptr;
  kvw_buffer_t* buffer = nullptr;
  kvw_connector_t* connector = nullptr;
  std::string error;

  Peer(const char* name, const std::string* secret) {
    char* err = nullptr;
    layout = kvw_layout_from_json(kLayout, &err);
    if (layout == nullptr) {
      error = Take(&err);
      return;
    }
    buffer = kvw_buffer_create(kvw_layout_assign_backing(layout, 0, kBlocks, 0), &err);
    if (buffer == nullptr) {
      error = Take(&err);
      return;
    }
    kvw_layout_assign_backing(layout, reinterpret_cast<uint64_t>(kvw_buffer_data(buffer)), kBlocks,
                              0);
    kvw_options_t* o = kvw_options_create();
    // The environment only where the caller asks for it (KVWIRE_SECRET in
    // EnvironmentSecretAuthenticates).
    if (kvw_options_from_environment(o, &err) != 0) {
      error = Take(&err);
      kvw_options_destroy(o);
      return;
    }
    kvw_options_set_name(o, name);
    kvw_options_set_listen_address(o, "127.0.0.1:0");
    kvw_options_set_request_timeout_ms(o, 10000);
    if (kvw_options_set_transport(o, "tcp", &err) != 0 ||
        (secret != nullptr &&
         kvw_options_set_secret(o, secret->data(), secret->size(), &err) != 0)) {
      error = Take(&err);
      kvw_options_destroy(o);
      return;
    }
    connector = kvw_connector_create(o, &err);
    kvw_options_destroy(o);
    if (connector == nullptr) {
      error = Take(&err);
      return;
    }
    void* ptrs[] = {kvw_buffer_data(buffer)};
    const size_t lengths[] = {kvw_buffer_size(buffer)};
    if (kvw_register_kv_caches(connector, layout, ptrs, lengths, 1, &err) != 0) {
      error = Take(&err);
    }
  }
  ~Peer() {
    kvw_connector_destroy(connector);
    kvw_buffer_destroy(buffer);
    kvw_layout_destroy(layout);
  }

  uint8_t* Page(int64_t block, size_t layer) {
    return reinterpret_cast<uint8_t*>(kvw_layout_block_address(layout, 0, layer, block));
  }
};

kvw_block_table_t* Table(std::vector<int64_t> ids) {
  kvw_block_table_t* t = kvw_block_table_create();
  kvw_block_table_set(t, "full", ids.data(), ids.size());
  return t;
}

// Prefill holds a request's KV (read mode); decode loads it. Returns "" when the bytes
// arrived intact, else the failed load's reason (or what went wrong).
std::string Transfer(Peer& prefill, Peer& decode, const std::string& rid) {
  char* err = nullptr;
  const std::vector<int64_t> src = {5, 1, 6}, dst = {2, 7, 0};
  for (size_t layer = 0; layer < 2; ++layer) {
    for (size_t i = 0; i < src.size(); ++i) {
      std::memset(prefill.Page(src[i], layer), static_cast<int>(17 + 31 * layer + 7 * i), 256);
      std::memset(decode.Page(dst[i], layer), 0, 256);
    }
  }
  uint64_t external = 0;
  int async = 0, delay = 0;
  kvw_block_table_t* ptable = Table(src);
  kvw_block_table_t* dtable = Table(dst);
  char* params = nullptr;
  std::string result = "not finished";
  if (kvw_get_num_new_matched_tokens(prefill.connector, rid.c_str(), kTokens, 0,
                                     R"({"do_remote_decode":true})", &external, &async,
                                     &err) != 0 ||
      kvw_update_state_after_alloc(prefill.connector, rid.c_str(), ptable, 0, &err) != 0 ||
      kvw_request_finished(prefill.connector, rid.c_str(), ptable, kTokens,
                           R"({"do_remote_decode":true})", 0, &delay, &params, &err) != 0 ||
      kvw_get_num_new_matched_tokens(decode.connector, rid.c_str(), kTokens, 0, params, &external,
                                     &async, &err) != 0 ||
      kvw_update_state_after_alloc(decode.connector, rid.c_str(), dtable, external, &err) != 0) {
    result = "setup: " + Take(&err);
  } else {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline && result == "not finished") {
      char* meta = kvw_build_connector_meta(decode.connector);
      (void)kvw_bind_connector_meta(decode.connector, meta, nullptr);
      kvw_free(meta);
      (void)kvw_start_load_kv(decode.connector, nullptr);
      kvw_finished_t* f = kvw_get_finished(decode.connector);
      for (size_t i = 0; i < kvw_finished_count(f, KVW_FINISHED_RECVING); ++i) {
        if (rid == kvw_finished_request(f, KVW_FINISHED_RECVING, i)) result = "";
      }
      for (size_t i = 0; i < kvw_finished_count(f, KVW_FAILED_LOADS); ++i) {
        if (rid == kvw_finished_request(f, KVW_FAILED_LOADS, i)) {
          result = std::string("failed load: ") + kvw_finished_reason(f, i);
        }
      }
      kvw_finished_destroy(f);
      absl::SleepFor(absl::Milliseconds(2));
    }
  }
  if (result.empty()) {
    for (size_t layer = 0; layer < 2 && result.empty(); ++layer) {
      for (size_t i = 0; i < src.size(); ++i) {
        if (std::memcmp(prefill.Page(src[i], layer), decode.Page(dst[i], layer), 256) != 0) {
          result = "bytes differ";
        }
      }
    }
  }
  kvw_free(params);
  kvw_block_table_destroy(ptable);
  kvw_block_table_destroy(dtable);
  return result;
}

TEST(CApiSecret, WrongSecretIsRefusedRightSecretMovesTheBytes) {
  unsetenv("KVWIRE_SECRET");
  const std::string right = std::string("s3cret\0with a NUL", 17), wrong = "guess";
  Peer prefill("capi-secret-prefill", &right);
  ASSERT_EQ(prefill.error, "");
  {
    Peer intruder("capi-secret-intruder", &wrong);
    ASSERT_EQ(intruder.error, "");
    const std::string r = Transfer(prefill, intruder, "intruder-1");
    EXPECT_NE(r.find("secret"), std::string::npos) << r;
  }
  {
    Peer no_secret("capi-secret-none", nullptr);
    ASSERT_EQ(no_secret.error, "");
    const std::string r = Transfer(prefill, no_secret, "none-1");
    EXPECT_NE(r.find("secret"), std::string::npos) << r;
  }
  Peer decode("capi-secret-decode", &right);
  ASSERT_EQ(decode.error, "");
  EXPECT_EQ(Transfer(prefill, decode, "right-1"), "");
}

// KVWIRE_SECRET fills the options kvw_options_from_environment is given (kvw_options_set_secret
// overrides).
TEST(CApiSecret, EnvironmentSecretAuthenticates) {
  const std::string right = "from-the-environment";
  setenv("KVWIRE_SECRET", right.c_str(), 1);
  Peer by_env("capi-env-decode", nullptr);
  const std::string other = "not-it";
  Peer overridden("capi-env-override", &other);
  unsetenv("KVWIRE_SECRET");
  ASSERT_EQ(by_env.error, "");
  ASSERT_EQ(overridden.error, "");
  Peer prefill("capi-env-prefill", &right);
  ASSERT_EQ(prefill.error, "");
  EXPECT_EQ(Transfer(prefill, by_env, "env-1"), "");
  // A prefill of its own: Transfer rewrites the source pages, and ThreadSanitizer cannot see
  // that the first READ's sends (on the tcp serving thread) ended before that, the causality
  // being carried by bytes between two sockets of this one process.
  Peer prefill2("capi-env-prefill-2", &right);
  ASSERT_EQ(prefill2.error, "");
  const std::string r = Transfer(prefill2, overridden, "env-2");
  EXPECT_NE(r.find("secret"), std::string::npos) << r;
}

}  // namespace

// etcd's credentials through the C ABI: the setters store what they are given and
// kvw_connector_create (ValidateConnectorOptions) refuses half a pair naming the option, a NULL
// options is refused, and credentials reach the connector (without endpoints, Create says
// they would be ignored).
TEST(CApiEtcdCredentials, PairsAreCheckedAndReachTheConnector) {
  char* err = nullptr;
  kvw_options_t* o = kvw_options_create();
  ASSERT_NE(o, nullptr);
  ASSERT_EQ(kvw_options_set_transport(o, "tcp", &err), 0) << Take(&err);
  auto create_error = [&] {
    kvw_connector_t* c = kvw_connector_create(o, &err);
    EXPECT_EQ(c, nullptr);
    kvw_connector_destroy(c);
    return Take(&err);
  };
  EXPECT_EQ(kvw_options_set_etcd_auth(o, "root", nullptr, &err), 0) << Take(&err);
  EXPECT_NE(create_error().find("etcd_user: set without etcd_password"), std::string::npos);
  EXPECT_EQ(kvw_options_set_etcd_auth(o, nullptr, "pw", &err), 0) << Take(&err);
  EXPECT_NE(create_error().find("etcd_password: set without etcd_user"), std::string::npos);
  EXPECT_EQ(kvw_options_set_etcd_auth(o, nullptr, nullptr, &err), 0) << Take(&err);
  EXPECT_EQ(kvw_options_set_etcd_tls(o, "/ca.pem", "/cert.pem", "", &err), 0) << Take(&err);
  EXPECT_NE(create_error().find("etcd_cert_file: set without etcd_key_file"), std::string::npos);
  ExpectNullRefused("options",
                    [&](char** e) { return kvw_options_set_etcd_auth(nullptr, "u", "p", e); });
  ExpectNullRefused("options", [&](char** e) {
    return kvw_options_set_etcd_tls(nullptr, nullptr, nullptr, nullptr, e);
  });
  EXPECT_EQ(kvw_options_set_etcd_tls(o, "/ca.pem", nullptr, nullptr, &err), 0) << Take(&err);
  EXPECT_EQ(kvw_options_set_etcd_auth(o, "root", "pw", &err), 0) << Take(&err);
  EXPECT_NE(create_error().find("etcd_user: set without etcd_endpoints"), std::string::npos);
  // Cleared again (both NULL): the connector is made.
  EXPECT_EQ(kvw_options_set_etcd_auth(o, nullptr, nullptr, &err), 0) << Take(&err);
  EXPECT_EQ(kvw_options_set_etcd_tls(o, nullptr, nullptr, nullptr, &err), 0) << Take(&err);
  kvw_connector_t* c = kvw_connector_create(o, &err);
  EXPECT_NE(c, nullptr) << Take(&err);
  kvw_connector_destroy(c);
  kvw_options_destroy(o);
}

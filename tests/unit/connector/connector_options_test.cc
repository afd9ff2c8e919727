// ConnectorOptions' one validator (ValidateConnectorOptions, the first step of
// Connector::Create) and its one environment reader (ConnectorOptions::FromEnvironment):
// every row of tests/support/bad_connector_options.tsv is refused with the table's message, as
// the C API (tests/capi/c_api_engine_test.c) and Python (python/test_options.py) refuse it.
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

#include "kvwire/connector.h"
#include "kvwire/options_check.h"
#include "tests/support/bad_option_table.h"
#include "tests/support/scoped_env.h"

namespace kvwire {
namespace {

using testing::BadOption;
using testing::ScopedEnv;

std::vector<BadOption> ReadTable() {
  return testing::ReadBadOptionTable(KVWIRE_SOURCE_DIR "/tests/support/bad_connector_options.tsv");
}

// Sets the row's option the way a C++ caller would; false when the table names an option this
// test does not know (a failure: the table and the readers must move together).
bool Set(ConnectorOptions& o, const BadOption& row, absl::Status* setter) {
  using Text = std::function<void(ConnectorOptions&, const std::string&)>;
  static const std::map<std::string, Text> kText = {
      {"role", [](auto& o, const std::string& v) { o.role = v; }},
      {"etcd_user", [](auto& o, const std::string& v) { o.etcd_user = v; }},
      {"etcd_password", [](auto& o, const std::string& v) { o.etcd_password = v; }},
      {"etcd_ca_file", [](auto& o, const std::string& v) { o.etcd_ca_file = v; }},
      {"etcd_cert_file", [](auto& o, const std::string& v) { o.etcd_cert_file = v; }},
      {"etcd_key_file", [](auto& o, const std::string& v) { o.etcd_key_file = v; }},
      {"etcd_endpoints", [](auto& o, const std::string& v) { o.etcd_endpoints = v; }},
      {"cluster", [](auto& o, const std::string& v) { o.cluster = v; }},
  };
  static const std::map<std::string, absl::Duration ConnectorOptions::*> kMs = {
      {"request_timeout", &ConnectorOptions::request_timeout},
      {"handshake_timeout", &ConnectorOptions::handshake_timeout},
      {"etcd_call_timeout", &ConnectorOptions::etcd_call_timeout},
  };
  if (row.kind == "text") {
    auto it = kText.find(row.option);
    if (it == kText.end()) return false;
    it->second(o, row.value);
    return true;
  }
  if (row.kind == "transport") {
    std::pair<std::string, std::string> name = absl::StrSplit(row.option, absl::MaxSplits('.', 1));
    *setter = o.engine.transports.Set(name.first, name.second, row.value);
    return true;
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(row.value, &value)) return false;
  if (row.kind == "ms") {
    auto it = kMs.find(row.option);
    if (it == kMs.end()) return false;
    o.*(it->second) = absl::Milliseconds(value);
    return true;
  }
  if (row.kind == "int" && row.option == "etcd_lease_seconds") {
    o.etcd_lease_seconds = value;
    return true;
  }
  return false;
}

TEST(ConnectorOptionsTest, DefaultsPass) {
  EXPECT_TRUE(ValidateConnectorOptions(ConnectorOptions()).ok());
}

TEST(ConnectorOptionsTest, SharedTableOfBadValues) {
  const std::vector<BadOption> rows = ReadTable();
  ASSERT_GE(rows.size(), 10u);
  for (const BadOption& row : rows) {
    SCOPED_TRACE(row.option + " = " + row.value);
    if (row.kind == "env") {
      ScopedEnv env({{row.option.c_str(), row.value.c_str()}});
      absl::StatusOr<ConnectorOptions> o = ConnectorOptions::FromEnvironment(ConnectorOptions());
      ASSERT_FALSE(o.ok());
      EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(o.status().message(), row.error);
      continue;
    }
    ConnectorOptions o;
    absl::Status setter;
    ASSERT_TRUE(Set(o, row, &setter)) << "unknown row " << row.option << " (" << row.kind << ")";
    if (!setter.ok()) {
      EXPECT_EQ(setter.message(), row.error);
      continue;
    }
    const absl::Status checked = ValidateConnectorOptions(o);
    EXPECT_EQ(checked.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(checked.message(), row.error);
    // Connector::Create runs the same check before it starts anything.
    absl::StatusOr<std::unique_ptr<Connector>> c = Connector::Create(o);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().message(), row.error);
  }
}

TEST(ConnectorOptionsTest, InRangeAndPairedValuesPass) {
  ConnectorOptions o;
  o.role = "prefill";
  o.request_timeout = absl::Milliseconds(1);
  o.handshake_timeout = absl::Hours(24);
  o.etcd_call_timeout = absl::Minutes(10);
  o.etcd_lease_seconds = 86400;
  o.etcd_endpoints = "http://127.0.0.1:1";
  o.cluster = "c1";
  o.etcd_user = "root";
  o.etcd_password = "pw";
  o.etcd_ca_file = "/ca.pem";
  o.etcd_cert_file = "/client.pem";
  o.etcd_key_file = "/client.key";
  EXPECT_TRUE(ValidateConnectorOptions(o).ok()) << ValidateConnectorOptions(o);
  o.mode = static_cast<KvMode>(3);
  EXPECT_EQ(ValidateConnectorOptions(o).message(), "mode: 3 is out of range (0..2)");
  o.mode = KvMode::kWrite;
  o.cluster = "no spaces";
  EXPECT_EQ(ValidateConnectorOptions(o).message(),
            "cluster 'no spaces' may hold only letters, digits, '.', '_' and '-'");
}

// Each KVWIRE_* connector variable replaces base's value when set and non-empty; the engine's
// go through EngineOptions::FromEnvironment.
TEST(ConnectorOptionsTest, FromEnvironmentTakesEachVariable) {
  const std::string file = ::testing::TempDir() + "/kvwire-etcd-password";
  std::ofstream(file) << "from-file\r\nsecond line\n";
  ConnectorOptions base;
  base.etcd_user = "base-user";
  base.etcd_ca_file = "/base-ca.pem";
  base.request_timeout = absl::Seconds(7);
  {
    ScopedEnv env({{"KVWIRE_ETCD_USER", "root"},
                   {"KVWIRE_ETCD_PASSWORD", ""},
                   {"KVWIRE_ETCD_PASSWORD_FILE", file.c_str()},
                   {"KVWIRE_ETCD_CACERT", ""},
                   {"KVWIRE_ETCD_CERT", "/client.pem"},
                   {"KVWIRE_ETCD_KEY", "/client.key"},
                   {"KVWIRE_TCP_CONNECTIONS", "3"},
                   {"KVWIRE_SECRET", "s3cret"}});
    absl::StatusOr<ConnectorOptions> o = ConnectorOptions::FromEnvironment(base);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->etcd_user, "root");
    EXPECT_EQ(o->etcd_password, "from-file");
    EXPECT_EQ(o->etcd_ca_file, "/base-ca.pem");  // empty variable: base's value
    EXPECT_EQ(o->etcd_cert_file, "/client.pem");
    EXPECT_EQ(o->etcd_key_file, "/client.key");
    EXPECT_EQ(o->request_timeout, absl::Seconds(7));
    EXPECT_EQ(o->engine.shared_secret, "s3cret");
    std::string connections;
    ASSERT_TRUE(o->engine.transports.Find("tcp")->Get("connections", &connections).ok());
    EXPECT_EQ(connections, "3");
  }
  {
    // KVWIRE_ETCD_PASSWORD wins over the file.
    ScopedEnv env({{"KVWIRE_ETCD_PASSWORD", "direct"},
                   {"KVWIRE_ETCD_PASSWORD_FILE", "/nonexistent/never-read"}});
    absl::StatusOr<ConnectorOptions> o = ConnectorOptions::FromEnvironment(base);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->etcd_user, "base-user");
    EXPECT_EQ(o->etcd_password, "direct");
  }
}

}  // namespace
}  // namespace kvwire

// Engine::Create's one validator (kvwire/options_check.h): every value of the shared table
// tests/support/bad_engine_options.tsv is refused with the table's message, as the C API
// (tests/capi/c_api_engine_test.c) and Python (python/test_options.py) refuse it; and the
// defaults pass.
#include "kvwire/options_check.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "src/util/option_range.h"
#include "tests/support/bad_option_table.h"

namespace kvwire {
namespace {

using testing::BadOption;

std::vector<BadOption> ReadTable() {
  return testing::ReadBadOptionTable(KVWIRE_SOURCE_DIR "/tests/support/bad_engine_options.tsv");
}

// Sets one option the way a C++ caller would (the table's int/ms names are EngineOptions'
// fields; a transport's options go by name, as any caller may set them); the setter's error
// when it refuses the value.
absl::Status Set(EngineOptions& o, const BadOption& row, bool* known) {
  *known = true;
  if (row.kind == "text") {
    std::pair<std::string, std::string> name = absl::StrSplit(row.option, absl::MaxSplits('.', 1));
    return o.transports.Set(name.first, name.second, row.value);
  }
  if (row.kind == "name") {
    o.transport = row.value;
    return absl::OkStatus();
  }
  int64_t value = 0;
  EXPECT_TRUE(absl::SimpleAtoi(row.value, &value)) << row.value;
  using Setter = std::function<void(EngineOptions&, int64_t)>;
  const absl::Duration ms = absl::Milliseconds(value);
  static const std::map<std::string, Setter> kInts = {
      {"max_frame_bytes", [](auto& o, int64_t v) { o.max_frame_bytes = v; }},
      {"io_threads", [](auto& o, int64_t v) { o.io_threads = v; }},
      {"closed_peers_kept", [](auto& o, int64_t v) { o.closed_peers_kept = v; }},
      {"max_undrained_notifications",
       [](auto& o, int64_t v) { o.max_undrained_notifications = v; }},
      {"max_message_bytes", [](auto& o, int64_t v) { o.max_message_bytes = v; }},
  };
  if (row.kind == "ms") {
    if (row.option == "heartbeat_interval") {
      o.heartbeat_interval = ms;
    } else if (row.option == "peer_lease") {
      o.peer_lease = ms;
    } else {
      *known = false;
    }
    return absl::OkStatus();
  }
  auto it = kInts.find(row.option);
  if (it == kInts.end()) {
    *known = false;
  } else {
    it->second(o, value);
  }
  return absl::OkStatus();
}

TEST(OptionsCheckTest, DefaultsPass) { EXPECT_TRUE(ValidateEngineOptions(EngineOptions()).ok()); }

TEST(OptionsCheckTest, SharedTableOfBadValues) {
  const std::vector<BadOption> rows = ReadTable();
  ASSERT_GE(rows.size(), 10u);
  for (const BadOption& row : rows) {
    SCOPED_TRACE(row.option + " = " + row.value);
    EngineOptions o;
    bool known = false;
    absl::Status status = Set(o, row, &known);
    ASSERT_TRUE(known) << "add " << row.option << " to Set()";
    if (status.ok()) status = Engine::Create(o).status();
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(), row.error);
  }
}

TEST(OptionsCheckTest, NoClampAtTheEdges) {
  // The ends of a range are taken as they are (no silent clamp inside, none outside).
  EngineOptions o;
  o.rdma().send_queue_depth = 16;
  EXPECT_TRUE(ValidateEngineOptions(o).ok());
  o.rdma().send_queue_depth = 16384;
  EXPECT_TRUE(ValidateEngineOptions(o).ok());
  o.rdma().send_queue_depth = 15;
  EXPECT_EQ(ValidateEngineOptions(o).message(),
            "rdma.send_queue_depth: 15 is out of range (16..16384)");
}

// Typed and by-name access reach the same field; Get gives back text Set takes; copies are deep.
TEST(OptionsCheckTest, TransportOptionsByNameAndTyped) {
  EngineOptions o;
  EXPECT_EQ(o.transports.Names(), (std::vector<std::string>{"rdma", "shm", "tcp"}));
  ASSERT_TRUE(o.transports.Set("tcp", "io_poll", "50us").ok());
  EXPECT_EQ(o.tcp().io_poll, absl::Microseconds(50));
  ASSERT_TRUE(o.transports.Set("rdma", "devices", "mlx5_0,,mlx5_1:1").ok());
  EXPECT_EQ(o.rdma().devices, (std::vector<std::string>{"mlx5_0", "mlx5_1:1"}));
  ASSERT_TRUE(o.transports.Set("shm", "cma", "true").ok());
  EXPECT_TRUE(o.shm().cma);
  o.tcp().io_threads = 3;
  std::string text;
  ASSERT_TRUE(o.transports.Find("tcp")->Get("io_threads", &text).ok());
  EXPECT_EQ(text, "3");
  ASSERT_TRUE(o.transports.Find("tcp")->Get("io_poll", &text).ok());
  EXPECT_EQ(text, "50us");
  ASSERT_TRUE(o.transports.Find("rdma")->Get("devices", &text).ok());
  EXPECT_EQ(text, "mlx5_0,mlx5_1:1");
  EXPECT_EQ(o.transports.Find("tcp")->Get("speed", &text).code(), absl::StatusCode::kNotFound);
  // Every key a transport lists round-trips through Get and Set.
  for (const std::string& name : o.transports.Names()) {
    TransportOptions* t = o.transports.Find(name);
    for (const std::string& key : t->Keys()) {
      ASSERT_TRUE(t->Get(key, &text).ok()) << name << "." << key;
      EXPECT_TRUE(t->Set(key, text).ok()) << name << "." << key << " = " << text;
    }
  }
  EngineOptions copy = o;
  copy.tcp().io_threads = 9;
  EXPECT_EQ(o.tcp().io_threads, 3);
  EXPECT_EQ(copy.tcp().io_poll, absl::Microseconds(50));
}

// An outside transport's options ride in the same map and are checked by the same validator.
struct PigeonOptions : TransportOptionsOf<PigeonOptions> {
  static constexpr char kName[] = "pigeon";
  int birds = 1;
  absl::Status Validate() const override { return CheckOptionRange("pigeon.birds", birds, 1, 8); }
  absl::Status Set(absl::string_view key, absl::string_view value) override {
    return SetOptionByName(kName, key, value, [this](auto&& f) { f("birds", birds); });
  }
  absl::Status Get(absl::string_view key, std::string* value) const override {
    return GetOptionByName(kName, key, value, [this](auto&& f) { f("birds", birds); });
  }
  std::vector<std::string> Keys() const override { return {"birds"}; }
};

TEST(OptionsCheckTest, OutsideTransportOptionsAreValidatedAndItsNameAccepted) {
  EngineOptions o;
  o.transport = "pigeon";
  EXPECT_EQ(ValidateEngineOptions(o).message(),
            "transport: unknown transport \"pigeon\" (expected auto, rdma, shm, tcp)");
  o.transports.Get<PigeonOptions>().birds = 2;
  EXPECT_TRUE(ValidateEngineOptions(o).ok());
  ASSERT_TRUE(o.transports.Set("pigeon", "birds", "9").ok());
  EXPECT_EQ(ValidateEngineOptions(o).message(), "pigeon.birds: 9 is out of range (1..8)");
  const EngineOptions copy = o;
  EXPECT_EQ(copy.transports.Get<PigeonOptions>().birds, 9);
}

TEST(OptionsCheckTest, StoreOptionRefusesWhatTheTypeCannotHold) {
  int i = 0;
  EXPECT_TRUE(StoreOption("x", -5, &i).ok());
  EXPECT_EQ(i, -5);
  EXPECT_EQ(StoreOption("x", int64_t{1} << 40, &i).message(),
            "x: 1099511627776 is out of range (-2147483648..2147483647)");
  uint32_t u = 0;
  EXPECT_EQ(StoreOption("y", -1, &u).message(), "y: -1 is out of range (0..4294967295)");
  bool b = false;
  EXPECT_TRUE(StoreOption("z", 1, &b).ok());
  EXPECT_TRUE(b);
  EXPECT_EQ(StoreOption("z", 2, &b).message(), "z: 2 is out of range (0..1)");
}

}  // namespace
}  // namespace kvwire

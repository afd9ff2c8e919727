// Engine::Create's one validator (src/core/options_check.h): every value of the shared table
// tests/support/bad_engine_options.tsv is refused with the table's message, as the C API
// (tests/capi/c_api_engine_test.c) and Python (python/test_options.py) refuse it; and the
// defaults pass.
#include "src/core/options_check.h"

#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "src/util/option_range.h"

namespace kvwire {
namespace {

struct BadOption {
  std::string option;
  std::string kind;
  int64_t value = 0;
  std::string error;
};

std::vector<BadOption> ReadTable() {
  std::ifstream in(KVWIRE_SOURCE_DIR "/tests/support/bad_engine_options.tsv");
  std::vector<BadOption> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f = absl::StrSplit(line, '\t');
    if (f.size() != 4) {
      ADD_FAILURE() << "bad row: " << line;
      continue;
    }
    BadOption row{f[0], f[1], 0, f[3]};
    EXPECT_TRUE(absl::SimpleAtoi(f[2], &row.value)) << line;
    rows.push_back(row);
  }
  return rows;
}

// Sets one option the way a C++ caller would (the table's names are EngineOptions' fields).
bool Set(EngineOptions& o, const BadOption& row) {
  using Setter = std::function<void(EngineOptions&, int64_t)>;
  const absl::Duration ms = absl::Milliseconds(row.value);
  static const std::map<std::string, Setter> kInts = {
      {"rdma_send_queue_depth", [](auto& o, int64_t v) { o.rdma_send_queue_depth = v; }},
      {"rdma_qps_per_peer", [](auto& o, int64_t v) { o.rdma_qps_per_peer = v; }},
      {"rdma_gid_index", [](auto& o, int64_t v) { o.rdma_gid_index = v; }},
      {"rdma_retry_count", [](auto& o, int64_t v) { o.rdma_retry_count = v; }},
      {"rdma_max_qps_per_device", [](auto& o, int64_t v) { o.rdma_max_qps_per_device = v; }},
      {"tcp_connections", [](auto& o, int64_t v) { o.tcp_connections = v; }},
      {"tcp_max_pending_hellos", [](auto& o, int64_t v) { o.tcp_max_pending_hellos = v; }},
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
    } else if (row.option == "tcp_io_timeout") {
      o.tcp_io_timeout = ms;
    } else {
      return false;
    }
    return true;
  }
  auto it = kInts.find(row.option);
  if (it == kInts.end()) return false;
  it->second(o, row.value);
  return true;
}

TEST(OptionsCheckTest, DefaultsPass) { EXPECT_TRUE(ValidateEngineOptions(EngineOptions()).ok()); }

TEST(OptionsCheckTest, SharedTableOfBadValues) {
  const std::vector<BadOption> rows = ReadTable();
  ASSERT_GE(rows.size(), 10u);
  for (const BadOption& row : rows) {
    SCOPED_TRACE(row.option + " = " + std::to_string(row.value));
    EngineOptions o;
    ASSERT_TRUE(Set(o, row)) << "add " << row.option << " to Set()";
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(o);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(engine.status().message(), row.error);
  }
}

TEST(OptionsCheckTest, NoClampAtTheEdges) {
  // The ends of a range are taken as they are (no silent clamp inside, none outside).
  EngineOptions o;
  o.rdma_send_queue_depth = 16;
  EXPECT_TRUE(ValidateEngineOptions(o).ok());
  o.rdma_send_queue_depth = 16384;
  EXPECT_TRUE(ValidateEngineOptions(o).ok());
  o.rdma_send_queue_depth = 15;
  EXPECT_EQ(ValidateEngineOptions(o).message(),
            "rdma_send_queue_depth: 15 is out of range (16..16384)");
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

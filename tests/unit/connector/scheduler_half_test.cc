// SchedulerHalf without an engine: matching, transfer ids, hand-off params, failed loads,
// releases and write-mode saves, as the JSON its workers get.
#include "kvwire/scheduler_half.h"

#include <set>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace kvwire {
namespace {

using nlohmann::json;

std::unique_ptr<SchedulerHalf> Make(KvMode mode = KvMode::kAuto) {
  SchedulerHalfOptions o;
  o.engine_id = "p";
  o.mode = mode;
  o.groups = {"0", "1"};
  o.block_size = 16;
  absl::StatusOr<std::unique_ptr<SchedulerHalf>> s = SchedulerHalf::Create(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

const std::string kLoad =
    R"({"do_remote_prefill": true, "remote_host": "h", "remote_port": 5, "transfer_id": "t1",
        "remote_block_ids": [[1, 2, 3], [4, 5, 6]]})";

TEST(SchedulerHalfTest, LoadsThePromptPastTheLocalPrefix) {
  auto s = Make();
  MatchResult m = s->GetNumNewMatchedTokens("d", 40, 16, kLoad);
  EXPECT_EQ(m.num_external_tokens, 24u);
  EXPECT_TRUE(m.load_async);
  // Only the last token is not in the local prefix: vLLM computes it, nothing is loaded.
  EXPECT_FALSE(s->GetNumNewMatchedTokens("d", 40, 39, kLoad).load_async);
  EXPECT_FALSE(s->GetNumNewMatchedTokens("d", 40, 0, "").load_async);
  s->UpdateStateAfterAlloc("d", 40, 16, kLoad, {{7, 8, 9}, {10, 11, 12}}, 24);
  // Asked again after its blocks were allocated: the load is under way, nothing more.
  EXPECT_FALSE(s->GetNumNewMatchedTokens("d", 40, 16, kLoad).load_async);
  json meta = json::parse(s->BuildConnectorMeta({}));
  ASSERT_EQ(meta["loads"].size(), 1u);
  const json& load = meta["loads"][0];
  EXPECT_EQ(load["blocks"], json::parse(R"({"0": [7, 8, 9], "1": [10, 11, 12]})"));
  EXPECT_EQ(load["num_computed"], 16);
  json params = json::parse(load["params"].get<std::string>());
  EXPECT_EQ(params["remote_block_ids"], json::parse(R"({"0": [1, 2, 3], "1": [4, 5, 6]})"));
  EXPECT_EQ(params["num_tokens"], 40);
  EXPECT_TRUE(json::parse(s->BuildConnectorMeta({}))["loads"].empty());  // the queue emptied
  // Aborted while loading: the workers are told to stop it.
  EXPECT_FALSE(
      s->RequestFinished("d", 40, kLoad, {{7, 8, 9}, {10, 11, 12}}, false, false).delay_free);
  meta = json::parse(s->BuildConnectorMeta({}));
  ASSERT_EQ(meta["finishes"].size(), 1u);
  EXPECT_EQ(meta["finishes"][0]["aborted"], true);
}

TEST(SchedulerHalfTest, BadParamsFailTheLoadWithItsOwnBlocksOnly) {
  auto s = Make();
  const std::string bad = R"({"do_remote_prefill": true, "remote_block_ids": [[1], [2], [3]]})";
  ASSERT_TRUE(s->GetNumNewMatchedTokens("d", 40, 16, bad).load_async);
  s->UpdateStateAfterAlloc("d", 40, 16, bad, {{7, 8, 9}, {10, 11, 12}}, 24);
  json meta = json::parse(s->BuildConnectorMeta({}));
  ASSERT_EQ(meta["failed"].size(), 1u);
  // The first block of each group holds the local prefix (16 tokens): never reported.
  EXPECT_EQ(meta["failed"][0]["block_ids"], json::parse("[8, 9, 11, 12]"));
  EXPECT_NE(meta["failed"][0]["reason"].get<std::string>().find("bad kv_transfer_params"),
            std::string::npos);
  ASSERT_EQ(s->TakeLog().size(), 1u);
  EXPECT_TRUE(s->TakeLog().empty());
}

TEST(SchedulerHalfTest, PrefixHitReleasesThePrefill) {
  auto s = Make();
  s->UpdateStateAfterAlloc("d", 40, 39, kLoad, {{7, 8, 9}, {10, 11, 12}}, 0);
  json meta = json::parse(s->BuildConnectorMeta({}));
  ASSERT_EQ(meta["releases"].size(), 1u);
  EXPECT_TRUE(meta["loads"].empty());
}

TEST(SchedulerHalfTest, ReadHandOffHoldsUnderAFreshTransferId) {
  auto s = Make(KvMode::kRead);
  const std::string p = R"({"do_remote_decode": true})";
  // No worker address yet: no hand-off, and the reason is logged.
  EXPECT_FALSE(s->RequestFinished("r0", 40, p, {{1}, {2}}, true, false).delay_free);
  EXPECT_EQ(s->TakeLog().size(), 1u);
  s->SetWorkers({{0, {"p/tp0", "10.1.2.3:4567", ""}}, {1, {"p/tp1", "10.1.2.4:4568", ""}}});
  std::set<std::string> ids;
  for (const char* id : {"r1", "r2"}) {
    RequestFinishedResult r = s->RequestFinished(id, 40, p, {{1, 2, 3}, {4, 5, 6}}, true, false);
    ASSERT_TRUE(r.delay_free);
    json out = json::parse(r.kv_transfer_params);
    EXPECT_EQ(out["remote_host"], "10.1.2.3");
    EXPECT_EQ(out["remote_port"], 4567);
    EXPECT_EQ(out["remote_block_ids"], json::parse("[[1, 2, 3], [4, 5, 6]]"));
    EXPECT_EQ(out["remote_request_id"], id);
    ASSERT_EQ(out["tp_sources"].size(), 1u);
    EXPECT_EQ(out["tp_sources"][0]["transfer_id"], out["transfer_id"]);
    const std::string tid = out["transfer_id"];
    EXPECT_EQ(tid.size(), 32u);  // 128 random bits
    ids.insert(tid);
    EXPECT_TRUE(KvTransferParams::FromJson(r.kv_transfer_params).ok());
    EXPECT_EQ(json::parse(s->StateJson())["holding"][id], tid);
  }
  EXPECT_EQ(ids.size(), 2u);
  json meta = json::parse(s->BuildConnectorMeta({}));
  ASSERT_EQ(meta["holds"].size(), 2u);
  // Aborted prefills hand nothing off.
  EXPECT_FALSE(s->RequestFinished("r3", 40, p, {{1}, {2}}, false, false).delay_free);
}

TEST(SchedulerHalfTest, WriteSaveWaitsForTheLastPromptChunk) {
  auto s = Make();
  const std::string p = R"({"do_remote_decode": true, "mode": "write", "transfer_id": "tw"})";
  EXPECT_FALSE(s->GetNumNewMatchedTokens("w", 100, 0, p).load_async);
  s->UpdateStateAfterAlloc("w", 100, 0, p, {{1, 2, 3, 4}, {5, 6, 7, 8}}, 0);
  SchedulerStep first;
  first.scheduled_tokens["w"] = 64;
  EXPECT_TRUE(json::parse(s->BuildConnectorMeta(first))["saves"].empty());
  EXPECT_TRUE(s->PendingPushWork());
  SchedulerStep last;  // no computed count in the output: the half counted 64
  last.scheduled_tokens["w"] = 36;
  last.new_blocks["w"] = {{9, 10}, {11, 12}};
  json meta = json::parse(s->BuildConnectorMeta(last));
  ASSERT_EQ(meta["saves"].size(), 1u);
  EXPECT_EQ(meta["saves"][0]["blocks"],
            json::parse(R"({"0": [1, 2, 3, 4, 9, 10], "1": [5, 6, 7, 8, 11, 12]})"));
  RequestFinishedResult r = s->RequestFinished("w", 100, p, {{1}, {2}}, true, false);
  EXPECT_TRUE(r.delay_free);
  EXPECT_TRUE(r.kv_transfer_params.empty());
  EXPECT_FALSE(s->PendingPushWork());
  s->UpdateConnectorOutput({}, {"w"});
  EXPECT_TRUE(json::parse(s->StateJson())["holding"].empty());
}

TEST(SchedulerHalfTest, RefusesBadOptions) {
  SchedulerHalfOptions o;
  o.groups = {"a", "a"};
  EXPECT_FALSE(SchedulerHalf::Create(o).ok());
  o.groups = {};
  EXPECT_FALSE(SchedulerHalf::Create(o).ok());
}

}  // namespace
}  // namespace kvwire

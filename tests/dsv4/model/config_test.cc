// Config parsing (errors name the field), the cache layout it implies, and the tokenizer.
#include "examples/dsv4/model/config.h"

#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "examples/dsv4/model/tokenizer.h"

namespace dsv4 {
namespace {

std::string TinyText() {
  std::ifstream in(std::string(DSV4_CONFIG_DIR) + "/tiny.json");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(ConfigTest, ShippedConfigsLoad) {
  for (const char* name : {"tiny", "small"}) {
    absl::StatusOr<Config> c =
        Config::FromFile(std::string(DSV4_CONFIG_DIR) + "/" + name + ".json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->head_dim, 512);
    EXPECT_EQ(c->rope_dim, 64);
    EXPECT_EQ(c->window, 128);
    EXPECT_EQ(c->vocab_size, kByteVocab);
    bool has[129] = {};
    for (int r : c->compress_ratios) has[r] = true;
    EXPECT_TRUE(has[0] && has[4] && has[128]) << name << " must cover ratios 0, 4 and 128";
    kvwire::Layout layout = c->CacheLayout();
    ASSERT_TRUE(layout.Validate().ok()) << layout.Validate();
    EXPECT_EQ(layout.FindGroup("swa_kv")->layers.size(), c->compress_ratios.size());
    EXPECT_EQ(layout.FindGroup("swa_kv")->page_bytes, 37440u);
    EXPECT_EQ(layout.FindGroup("c128a_kv")->page_bytes, 1728u);
    EXPECT_EQ(layout.FindGroup("c4a_indexer_k")->page_bytes, 8640u);
  }
}

TEST(ConfigTest, ErrorsNameTheField) {
  const nlohmann::json base = nlohmann::json::parse(TinyText());
  struct Case {
    const char* field;
    nlohmann::json value;  // null: remove the field
  };
  const Case cases[] = {
      {"dim", nullptr},         {"dim", "64"},  {"num_heads", -1},      {"head_dim", 256},
      {"rope_dim", 32},         {"window", 64}, {"index_head_dim", 64}, {"o_groups", 3},
      {"experts_per_token", 9}, {"seed", -4},   {"vocab_size", 100},    {"num_hash_layers", 7},
      {"norm_eps", "x"},        {"name", ""},
  };
  for (const Case& c : cases) {
    nlohmann::json j = base;
    if (c.value.is_null()) {
      j.erase(c.field);
    } else {
      j[c.field] = c.value;
    }
    absl::StatusOr<Config> got = Config::FromJson(j.dump());
    ASSERT_FALSE(got.ok()) << c.field << " = " << c.value;
    EXPECT_NE(got.status().message().find(c.field), std::string::npos) << got.status();
  }
  nlohmann::json j = base;
  j["compress_ratios"] = {0, 4, 8, 4, 128, 0};
  EXPECT_NE(Config::FromJson(j.dump()).status().message().find("compress_ratios"),
            std::string::npos);
  j["compress_ratios"] = {0, 4};
  EXPECT_NE(Config::FromJson(j.dump()).status().message().find("compress_ratios"),
            std::string::npos);
  EXPECT_FALSE(Config::FromJson("{not json").ok());
  EXPECT_FALSE(Config::FromFile("/nonexistent/dsv4.json").ok());
}

TEST(TokenizerTest, RoundTrip) {
  const std::string text = std::string("Hello, \xC3\xA9t\xC3\xA9 \x00\xFF!", 16);
  std::vector<int32_t> tokens = Encode(text);
  ASSERT_EQ(tokens.size(), text.size() + 1);
  EXPECT_EQ(tokens[0], kBosToken);
  EXPECT_EQ(tokens[tokens.size() - 2], 255);
  EXPECT_EQ(Decode(tokens), text);
  tokens.push_back(kEosToken);
  tokens.push_back(9999);
  tokens.push_back(-1);
  EXPECT_EQ(Decode(tokens), text);
  EXPECT_EQ(Encode(""), std::vector<int32_t>{kBosToken});
}

}  // namespace
}  // namespace dsv4

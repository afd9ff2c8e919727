// safetensors: round trip, and every kind of bad file refused with the tensor named.
#include "examples/dsv4/model/safetensors.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <unistd.h>

#include <gtest/gtest.h>

#include "examples/dsv4/model/config.h"
#include "examples/dsv4/model/model.h"

namespace dsv4 {
namespace {

std::vector<uint8_t> Raw(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes, 0);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

std::string Message(const std::vector<uint8_t>& bytes) {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(bytes, "test");
  return f.ok() ? "" : std::string(f.status().message());
}

TEST(SafetensorsTest, RoundTrip) {
  const float a[6] = {1, 2, 3, 4, 5, 6};
  const int32_t b[2] = {7, -8};
  std::vector<TensorToWrite> t = {
      {"a", "F32", {2, 3}, {reinterpret_cast<const uint8_t*>(a), sizeof(a)}},
      {"b", "I32", {2}, {reinterpret_cast<const uint8_t*>(b), sizeof(b)}},
      {"empty", "F32", {0, 4}, {}}};
  absl::StatusOr<std::vector<uint8_t>> bytes = SerializeSafetensors(t, {{"k", "v"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  uint64_t header = 0;
  std::memcpy(&header, bytes->data(), 8);
  EXPECT_EQ((8 + header) % 8, 0u);  // data aligned
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(*bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata().at("k"), "v");
  absl::StatusOr<TensorView> va = f->Get("a");
  ASSERT_TRUE(va.ok());
  EXPECT_EQ(va->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(va->bytes.data(), a, sizeof(a)), 0);
  EXPECT_EQ(f->Get("b")->dtype, "I32");
  EXPECT_EQ(f->Get("empty")->numel(), 0);
  EXPECT_EQ(f->Get("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, BadFilesAreRefused) {
  EXPECT_NE(Message({1, 2, 3}).find("truncated"), std::string::npos);
  std::vector<uint8_t> huge(8, 0);
  huge[6] = 1;  // 2^48-byte header
  EXPECT_NE(Message(huge).find("exceeds"), std::string::npos);
  std::vector<uint8_t> longer = Raw("{}", 0);
  longer[0] = 200;  // claims more header than the file has
  EXPECT_NE(Message(longer).find("truncated"), std::string::npos);
  EXPECT_NE(Message(Raw("{\"a\":", 0)).find("JSON"), std::string::npos);
  EXPECT_NE(Message(Raw("[1]", 0)).find("JSON object"), std::string::npos);
  const std::string ok_entry = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  EXPECT_EQ(Message(Raw("{" + ok_entry + "}", 8)), "");
  // Offsets past the data section (file truncated inside the data).
  EXPECT_NE(Message(Raw("{" + ok_entry + "}", 4)).find("'w'"), std::string::npos);
  EXPECT_NE(Message(Raw("{" + ok_entry + "}", 4)).find("out of range"), std::string::npos);
  // Reversed offsets, wrong byte count for the shape, unknown dtype, bad shape.
  EXPECT_NE(
      Message(Raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8)).find("'w'"),
      std::string::npos);
  EXPECT_NE(Message(Raw(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 12))
                .find("needs 12"),
            std::string::npos);
  EXPECT_NE(Message(Raw(R"({"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8))
                .find("unknown dtype"),
            std::string::npos);
  EXPECT_NE(
      Message(Raw(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)).find("'w'"),
      std::string::npos);
  EXPECT_NE(Message(Raw(R"({"w":{"dtype":"F32","shape":[2]}})", 8)).find("data_offsets"),
            std::string::npos);
  // Overlap.
  const std::string overlap = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  const std::string msg = Message(Raw(overlap, 12));
  EXPECT_NE(msg.find("overlaps"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'b'"), std::string::npos) << msg;
  EXPECT_NE(Message(Raw(R"({"__metadata__":{"k":1}})", 0)).find("__metadata__"), std::string::npos);
}

class WeightsFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<Config> c = Config::FromFile(std::string(DSV4_CONFIG_DIR) + "/tiny.json");
    ASSERT_TRUE(c.ok()) << c.status();
    config_ = *c;
    path_ = "/tmp/dsv4_weights_test_" + std::to_string(getpid()) + ".safetensors";
    ASSERT_TRUE(GenerateWeights(config_, path_).ok());
  }
  void TearDown() override { std::remove(path_.c_str()); }
  Config config_;
  std::string path_;
};

TEST_F(WeightsFileTest, GeneratedWeightsLoadAndAreDeterministic) {
  absl::StatusOr<std::unique_ptr<Model>> m = Model::Load(config_, path_, 1);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string again = path_ + ".2";
  ASSERT_TRUE(GenerateWeights(config_, again).ok());
  std::ifstream a(path_, std::ios::binary), b(again, std::ios::binary);
  std::string sa((std::istreambuf_iterator<char>(a)), {}),
      sb((std::istreambuf_iterator<char>(b)), {});
  std::remove(again.c_str());
  EXPECT_EQ(sa, sb);
  Config other = config_;
  other.seed += 1;
  ASSERT_TRUE(GenerateWeights(other, again).ok());
  std::ifstream c(again, std::ios::binary);
  std::string sc((std::istreambuf_iterator<char>(c)), {});
  std::remove(again.c_str());
  EXPECT_EQ(sa.size(), sc.size());
  EXPECT_NE(sa, sc);
}

TEST_F(WeightsFileTest, MismatchWithConfigNamesTheTensor) {
  Config wider = config_;
  wider.moe_inter_dim *= 2;
  absl::StatusOr<std::unique_ptr<Model>> m = Model::Load(wider, path_, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("layers.0.ffn.experts.0.w1"), std::string::npos)
      << m.status();
  Config deeper = config_;
  deeper.num_layers += 1;
  deeper.compress_ratios.push_back(0);
  m = Model::Load(deeper, path_, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("missing"), std::string::npos) << m.status();
  Config shallower = config_;
  shallower.num_layers -= 1;
  shallower.compress_ratios.pop_back();
  m = Model::Load(shallower, path_, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("unexpected tensor"), std::string::npos) << m.status();
  // A truncated file is refused by the reader.
  std::ifstream in(path_, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  {
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  m = Model::Load(config_, path_, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("out of range"), std::string::npos) << m.status();
  EXPECT_EQ(Model::Load(config_, "/nonexistent/w.safetensors", 1).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace dsv4

// JsonFields: every wrong type, null, missing field, out-of-range or oversized value is an
// error naming the field, and nothing throws.
#include "src/util/json_fields.h"

#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace kvwire {
namespace {

using nlohmann::json;

json Parse(const std::string& text) {
  absl::StatusOr<json> j = ParseJsonObject(text, "test");
  EXPECT_TRUE(j.ok()) << j.status();
  return j.ok() ? *j : json::object();
}

void ExpectError(const JsonFields& f, const std::string& field) {
  EXPECT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(f.status().message(), "ctx: '" + field + "'")) << f.status();
}

TEST(JsonFieldsTest, ReadsWellTypedFields) {
  json j = Parse(R"({"s":"x","i":-3,"u":7,"b":true,"a":[1,2],"o":{"k":"v"},"n":null})");
  JsonFields f(j, "ctx");
  EXPECT_EQ(f.String("s"), "x");
  EXPECT_EQ(f.Int("i", -10, 10), -3);
  EXPECT_EQ(f.Uint("u"), 7u);
  EXPECT_TRUE(f.Bool("b"));
  EXPECT_EQ(f.IntArray("a", true, 0, 5), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(f.Nested("o", true).String("k"), "v");
  // Missing and null optional fields take their fallback.
  EXPECT_EQ(f.OptString("missing", "d"), "d");
  EXPECT_EQ(f.OptString("n", "d"), "d");
  EXPECT_EQ(f.OptInt("n", 0, 9, 4), 4);
  EXPECT_FALSE(f.Has("n"));
  EXPECT_EQ(f.Nested("absent", false).OptUint("x", 10, 3), 3u);
  EXPECT_TRUE(f.ok()) << f.status();
}

TEST(JsonFieldsTest, EveryBadValueNamesItsField) {
  struct Case {
    std::string text;
    std::string field;
    std::function<void(JsonFields&)> read;
  };
  const std::vector<Case> cases = {
      {R"({"s":5})", "s", [](JsonFields& f) { f.String("s"); }},
      {R"({"s":null})", "s", [](JsonFields& f) { f.String("s"); }},
      {R"({})", "s", [](JsonFields& f) { f.String("s"); }},
      {R"({"s":"toolong"})", "s", [](JsonFields& f) { f.String("s", 3); }},
      {R"({"s":[]})", "s", [](JsonFields& f) { f.OptString("s"); }},
      {R"({"i":"1"})", "i", [](JsonFields& f) { f.Int("i", 0, 9); }},
      {R"({"i":1.5})", "i", [](JsonFields& f) { f.Int("i", 0, 9); }},
      {R"({"i":10})", "i", [](JsonFields& f) { f.Int("i", 0, 9); }},
      {R"({"i":-1})", "i", [](JsonFields& f) { f.OptInt("i", 0, 9, 0); }},
      {R"({"i":18446744073709551615})", "i", [](JsonFields& f) { f.Int("i", 0, 9); }},
      {R"({"u":-1})", "u", [](JsonFields& f) { f.Uint("u"); }},
      {R"({"u":1e300})", "u", [](JsonFields& f) { f.Uint("u"); }},
      {R"({"u":99999999999999999999999})", "u", [](JsonFields& f) { f.OptUint("u", 5, 0); }},
      {R"({"b":1})", "b", [](JsonFields& f) { f.Bool("b"); }},
      {R"({"b":"true"})", "b", [](JsonFields& f) { f.OptBool("b", false); }},
      {R"({"a":{}})", "a", [](JsonFields& f) { f.Array("a", true); }},
      {R"({"a":[1,2,3]})", "a", [](JsonFields& f) { f.Array("a", true, 2); }},
      {R"({"a":[1,"2"]})", "a[1]", [](JsonFields& f) { f.IntArray("a", true, 0, 9); }},
      {R"({"a":[1,-2]})", "a[1]", [](JsonFields& f) { f.UintArray("a", true, 9); }},
      {R"({"o":[]})", "o", [](JsonFields& f) { f.Object("o", true); }},
      {R"({"d":"1"})", "d", [](JsonFields& f) { f.Number("d", 0, 9); }},
      {R"({"d":true})", "d", [](JsonFields& f) { f.OptNumber("d", 0, 9, 1); }},
      {R"({"d":9.5})", "d", [](JsonFields& f) { f.Number("d", 0, 9); }},
      {R"({"d":-1e308})", "d", [](JsonFields& f) { f.OptNumber("d", 0, 9, 1); }},
      {R"({"d":null})", "d", [](JsonFields& f) { f.Number("d", 0, 9); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    json j = Parse(c.text);
    JsonFields f(j, "ctx");
    c.read(f);
    ExpectError(f, c.field);
  }
}

TEST(JsonFieldsTest, NumbersTakeIntegersAndFractionsInRange) {
  json j = Parse(R"({"f":0.5,"i":7,"u":18446744073709551615,"n":null})");
  JsonFields f(j, "ctx");
  EXPECT_EQ(f.Number("f", 0, 1), 0.5);
  EXPECT_EQ(f.Number("i", -10, 10), 7.0);
  EXPECT_EQ(f.OptNumber("n", 0, 1, 0.25), 0.25);
  EXPECT_EQ(f.OptNumber("missing", 0, 1, 0.25), 0.25);
  EXPECT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f.OptNumber("u", 0, 100, 3), 3);
  ExpectError(f, "u");
}

// A check the caller makes itself names the field and shows (a bounded rendering of) the
// value, never the value whole.
TEST(JsonFieldsTest, FailShowsTheValueFoundBounded) {
  json j = Parse(R"({"m":"sideways"})");
  JsonFields f(j, "ctx");
  f.Fail("m", "must be \"read\" or \"write\"", json("sideways"));
  ExpectError(f, "m");
  EXPECT_TRUE(absl::StrContains(f.status().message(), "got \"sideways\"")) << f.status();
  JsonFields g(j, "ctx");
  g.Fail("m", "must be short", json(std::string(10000, 'x')));
  EXPECT_TRUE(absl::StrContains(g.status().message(), "a string of 10000 bytes")) << g.status();
  EXPECT_LT(g.status().message().size(), 200u);
}

TEST(JsonFieldsTest, FirstErrorWinsAndNestedReadersShareIt) {
  json j = Parse(R"({"o":{"x":"bad"},"y":"also bad"})");
  JsonFields f(j, "ctx");
  JsonFields o = f.Nested("o", true);
  EXPECT_EQ(o.OptInt("x", 0, 9, 5), 5);
  EXPECT_EQ(f.Int("y", 0, 9), 0);
  EXPECT_FALSE(f.ok());
  EXPECT_TRUE(absl::StrContains(f.status().message(), "ctx.o: 'x'")) << f.status();
}

TEST(JsonFieldsTest, ParseRefusesNonObjectsDeepNestingAndOversizedText) {
  EXPECT_FALSE(ParseJsonObject("not json", "ctx").ok());
  EXPECT_FALSE(ParseJsonObject("[1]", "ctx").ok());
  EXPECT_FALSE(ParseJsonObject("null", "ctx").ok());
  const std::string deep = std::string(1000, '[') + std::string(1000, ']');
  absl::StatusOr<json> j = ParseJsonObject(deep, "ctx");
  ASSERT_FALSE(j.ok());
  EXPECT_TRUE(absl::StrContains(j.status().message(), "nested")) << j.status();
  // Brackets inside strings do not count.
  EXPECT_TRUE(ParseJsonObject(R"({"s":")" + std::string(100, '[') + R"("})", "ctx").ok());
  EXPECT_FALSE(ParseJsonObject(std::string(100, ' '), "ctx", {.max_bytes = 10}).ok());
  // A syntax error gives its position, not the parser's quote of the hostile text.
  absl::StatusOr<json> bad = ParseJsonObject("{\"k\":\x01}", "ctx");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "ctx: not valid JSON")) << bad.status();
  // A short flat text skips the limit scan (it cannot break the limits); its syntax error is
  // still placed, as a long one's is.
  for (const std::string& text :
       {std::string(R"({"k":[1,})"), R"({"k":")" + std::string(500, 'x')}) {
    absl::StatusOr<json> e = ParseJsonObject(text, "ctx");
    ASSERT_FALSE(e.ok());
    EXPECT_TRUE(absl::StrContains(e.status().message(), "error at byte")) << e.status();
  }
  // A number no double holds is no JSON the reader can use.
  EXPECT_FALSE(ParseJsonObject(R"({"d":1e400})", "ctx").ok());
  // A flat document of many values (here 1002: the object, the array, 1000 items) is refused
  // before it is built; keys do not count.
  std::string wide = R"({"a":[0)";
  for (int i = 1; i < 1000; ++i) wide += ",0";
  wide += "]}";
  EXPECT_TRUE(ParseJsonObject(wide, "ctx", {.max_values = 1002}).ok());
  absl::StatusOr<json> many = ParseJsonObject(wide, "ctx", {.max_values = 1001});
  ASSERT_FALSE(many.ok());
  EXPECT_TRUE(absl::StrContains(many.status().message(), "more than 1001 values")) << many.status();
  EXPECT_TRUE(ParseJsonObject(R"({"a":1,"b":2})", "ctx", {.max_values = 3}).ok());
  // The depth limit is the caller's to set.
  EXPECT_TRUE(ParseJsonObject(R"({"a":[[1]]})", "ctx", {.max_depth = 3}).ok());
  EXPECT_FALSE(ParseJsonObject(R"({"a":[[[1]]]})", "ctx", {.max_depth = 3}).ok());
  // A non-object given to a reader is an error, not a throw.
  JsonFields f(json(5), "ctx");
  EXPECT_FALSE(f.ok());
  EXPECT_EQ(f.OptString("x", "d"), "d");
}

}  // namespace
}  // namespace kvwire

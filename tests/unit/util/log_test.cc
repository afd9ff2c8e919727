#include "src/util/log.h"

#include <gtest/gtest.h>

namespace kvwire {
namespace {

TEST(LogTest, ParsesLevels) {
  LogLevel level;
  ASSERT_TRUE(ParseLogLevel("debug", &level));
  EXPECT_EQ(level, LogLevel::kDebug);
  ASSERT_TRUE(ParseLogLevel("error", &level));
  EXPECT_EQ(level, LogLevel::kError);
  EXPECT_FALSE(ParseLogLevel("loud", &level));
}

TEST(LogTest, FiltersBelowMinimumLevel) {
  const LogLevel saved = GetLogLevel();
  SetLogLevel(LogLevel::kError);
  EXPECT_FALSE(LogEnabled(LogLevel::kWarning));
  EXPECT_TRUE(LogEnabled(LogLevel::kError));
  int evaluated = 0;
  auto count = [&] { return ++evaluated; };
  KVW_LOG(kInfo, "test") << "not evaluated " << count();
  EXPECT_EQ(evaluated, 0);
  SetLogLevel(saved);
}

}  // namespace
}  // namespace kvwire

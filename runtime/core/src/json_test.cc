#include "moe/core/json.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe::core {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(JsonTest, PositionCountsLinesAndColumnsFromOne) {
  const std::string text = "ab\ncde\n\nf";
  EXPECT_EQ(PositionOf(text, 0).line, 1);
  EXPECT_EQ(PositionOf(text, 0).column, 1);
  EXPECT_EQ(PositionOf(text, 4).line, 2);
  EXPECT_EQ(PositionOf(text, 4).column, 2);
  EXPECT_EQ(PositionOf(text, 8).line, 4);
  EXPECT_EQ(PositionOf(text, 8).column, 1);
  EXPECT_EQ(PositionOf(text, 100).line, 4);  // past the end: the end
}

TEST(JsonTest, SyntaxErrorNamesFileLineAndColumn) {
  auto j = ParseJson("{\n  \"a\": 1,\n  \"b\": @\n}", "m/config.json");
  EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(j.status().message()), StartsWith("m/config.json:3:8: invalid JSON: "));
  EXPECT_THAT(j.status().message(), HasSubstr("invalid literal; last read: "));
  auto truncated = ParseJson("{\"a\": [1, 2", "index.json");
  EXPECT_THAT(std::string(truncated.status().message()), StartsWith("index.json:1:12: invalid JSON: "));
}

TEST(JsonTest, ObjectIsRequiredAtTheTopLevel) {
  auto j = ParseJsonObject("[1, 2, 3]", "config.json");
  EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(j.status().message(),
              HasSubstr("config.json: expected a JSON object at the top level, found a list of 3 values"));
  auto ok = ParseJsonObject("{\"a\": 1}", "config.json");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)["a"], 1);
}

TEST(JsonTest, DescribesValuesWithoutDumpingThemWhole) {
  EXPECT_EQ(DescribeJson(nlohmann::json(5)), "5");
  EXPECT_EQ(DescribeJson(nlohmann::json("x")), "\"x\"");
  EXPECT_EQ(DescribeJson(nlohmann::json::object()), "an object of 0 keys");
  const std::string described = DescribeJson(nlohmann::json(std::string(10000, 'a')));
  EXPECT_LT(described.size(), 80u);
  EXPECT_THAT(described, HasSubstr("..."));
  // A deep list is described by its length, not walked.
  std::string deep(100000, '[');
  deep += std::string(100000, ']');
  auto j = ParseJson(deep, "deep.json");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(DescribeJson(*j), "a list of 1 value");
}

}  // namespace
}  // namespace moe::core

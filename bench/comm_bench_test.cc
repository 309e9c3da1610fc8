#include "comm_bench.h"

#include <sstream>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::bench {
namespace {

// A small run end to end: three ranks as processes, the bound between two of them, both sizes.
TEST(CommBenchTest, MeasuresBothSizesAgainstTheTcpBound) {
  CommBenchOptions options;
  options.ranks = 3;
  options.hidden = 64;
  options.chunk_tokens = 16;
  options.seconds_per_point = 0.05;
  auto result = RunCommBench(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->ranks, 3);
  EXPECT_EQ(result->communicator.rfind("gloo tcp: rank 0 of 3", 0), 0u) << result->communicator;
  ASSERT_EQ(result->rows.size(), 2u);
  EXPECT_EQ(result->rows[0].name, "row (1 x 64 fp32)");
  EXPECT_EQ(result->rows[1].bytes, 16 * 64 * 4);
  for (const CommBenchRow& row : result->rows) {
    EXPECT_GE(row.repeats, 5) << row.name;
    EXPECT_GT(row.allreduce_seconds, 0) << row.name;
    EXPECT_GT(row.tcp_gbps, 0) << row.name;
    EXPECT_DOUBLE_EQ(row.busbw_gbps, row.algbw_gbps * 4.0 / 3.0) << row.name;  // 2 (n - 1) / n
  }
  std::ostringstream json;
  PrintCommBench(*result, /*json=*/true, json);
  const auto parsed = nlohmann::json::parse(json.str());
  EXPECT_EQ(parsed["rows"].size(), 2u);
  std::ostringstream text;
  PrintCommBench(*result, /*json=*/false, text);
  EXPECT_NE(text.str().find("busbw/TCP"), std::string::npos) << text.str();
}

TEST(CommBenchTest, OneRankIsRefused) {
  CommBenchOptions options;
  options.ranks = 1;
  EXPECT_EQ(RunCommBench(options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::bench

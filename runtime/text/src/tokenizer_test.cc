#include "moe/text/tokenizer.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::text {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using nlohmann::json;

std::string TestdataDir() {
  const char* env = std::getenv("MOE_TESTDATA_DIR");
  return env != nullptr && *env != '\0' ? env : MOE_TESTDATA_DIR;
}

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);
}

std::unique_ptr<Tokenizer> Load(const json& config) {
  auto tokenizer = Tokenizer::FromJson(config.dump(), "test tokenizer.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? *std::move(tokenizer) : nullptr;
}

TEST(TokenizerTest, MatchesTheTransformersGoldens) {
  const std::string dir = TestdataDir() + "/tokenizer";
  auto tokenizer = Tokenizer::FromFile(dir + "/tokenizer.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const json golden = ReadJson(dir + "/golden_tokenize.json");
  ASSERT_FALSE(golden["cases"].empty());
  for (const json& c : golden["cases"]) {
    const std::string text = c["text"];
    const std::vector<int32_t> want = c["ids"];
    const std::vector<int32_t> ids = (*tokenizer)->Encode(text);
    EXPECT_EQ(ids, want) << text;
    // The goldens decode with the special tokens kept.
    EXPECT_EQ((*tokenizer)->Decode(want, /*skip_special_tokens=*/false), c["decoded"].get<std::string>()) << text;
  }
}

}  // namespace
}  // namespace moe::text

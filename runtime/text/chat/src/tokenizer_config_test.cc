#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/text/chat_template.h"

namespace moe::text {
namespace {

using ::testing::HasSubstr;

// A fresh model folder under the temp dir, removed on destruction.
class ModelDir {
 public:
  ModelDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "moe_tokenizer_config_XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~ModelDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  void Write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ + "/" + name, std::ios::binary) << text;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(TokenizerConfigTest, ReadsStringsAndAddedTokenDicts) {
  ModelDir dir;
  dir.Write("tokenizer_config.json", R"({
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
    "eos_token": "</s>",
    "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"})");
  const absl::StatusOr<TokenizerConfig> config = LoadTokenizerConfig(dir.path());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->bos_token, "<s>");
  EXPECT_EQ(config->eos_token, "</s>");
  EXPECT_EQ(config->chat_template, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}");
}

TEST(TokenizerConfigTest, AbsentFieldsAreEmpty) {
  ModelDir dir;
  dir.Write("tokenizer_config.json", R"({"bos_token": null, "model_max_length": 2048})");
  const absl::StatusOr<TokenizerConfig> config = LoadTokenizerConfig(dir.path());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->bos_token, "");
  EXPECT_EQ(config->eos_token, "");
  EXPECT_EQ(config->chat_template, "");
}

TEST(TokenizerConfigTest, ANamedListGivesTheDefaultTemplate) {
  ModelDir dir;
  dir.Write("tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})");
  EXPECT_EQ(LoadTokenizerConfig(dir.path()).value().chat_template, "D");

  dir.Write("tokenizer_config.json", R"({"chat_template": [{"name": "tool_use", "template": "T"}]})");
  const absl::StatusOr<TokenizerConfig> no_default = LoadTokenizerConfig(dir.path());
  EXPECT_EQ(no_default.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_default.status().message(), HasSubstr("templates named tool_use but none named \"default\""));
}

// transformers reads chat_template.jinja in Python's text mode, so CRLF reads as LF.
TEST(TokenizerConfigTest, ChatTemplateJinjaOverridesTheConfig) {
  ModelDir dir;
  dir.Write("tokenizer_config.json", R"({"eos_token": "</s>", "chat_template": 7})");
  dir.Write("chat_template.jinja", "{% if x %}\r\nA\rB\n{% endif %}");
  const absl::StatusOr<TokenizerConfig> config = LoadTokenizerConfig(dir.path());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->chat_template, "{% if x %}\nA\nB\n{% endif %}");
  EXPECT_EQ(config->eos_token, "</s>");
}

TEST(TokenizerConfigTest, ErrorsNameTheFileAndField) {
  ModelDir dir;
  EXPECT_EQ(LoadTokenizerConfig(dir.path()).status().code(), absl::StatusCode::kNotFound);
  dir.Write("tokenizer_config.json", R"({"eos_token": 3})");
  absl::StatusOr<TokenizerConfig> bad = LoadTokenizerConfig(dir.path());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("tokenizer_config.json: eos_token is 3"));
  dir.Write("tokenizer_config.json", R"({"chat_template": 7})");
  bad = LoadTokenizerConfig(dir.path());
  EXPECT_THAT(bad.status().message(), HasSubstr("chat_template is 7"));
  dir.Write("tokenizer_config.json", "{\"eos_token\": ");
  bad = LoadTokenizerConfig(dir.path());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("invalid JSON"));
}

}  // namespace
}  // namespace moe::text

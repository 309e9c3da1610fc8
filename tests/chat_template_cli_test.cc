// `moeserve chat-template` as a user runs it: the goldens' prompts byte for byte, the model
// folder's special tokens, --now, and the exit codes of its errors.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;
using OrderedJson = nlohmann::ordered_json;

std::string ChatDir() { return testing::TestdataDir() + "/chat"; }

OrderedJson LoadChatGoldens() {
  std::ifstream in(ChatDir() + "/goldens.json");
  return OrderedJson::parse(in);
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

TEST(ChatTemplateCliTest, PrintsTheGoldenPromptsExactly) {
  const OrderedJson goldens = LoadChatGoldens();
  testing::ScratchDir dir;
  int checked = 0;
  for (const auto& [file, golden] : goldens["templates"].items()) {
    for (const OrderedJson& test_case : golden["cases"]) {
      // One process per case is slow; the library test covers the rest of the grid.
      if (!test_case["add_generation_prompt"].get<bool>() || !test_case["enable_thinking"].is_null()) continue;
      OrderedJson request = goldens["conversations"][test_case["conversation"].get<std::string>()];
      request["add_generation_prompt"] = true;
      request["bos_token"] = "<s>";
      request["eos_token"] = "</s>";
      WriteFile(dir / "request.json", request.dump(1));
      const testing::CommandResult r =
          testing::RunMoeserve({"chat-template", "--chat-template-file", ChatDir() + "/" + file, "--request",
                                dir / "request.json", "--now", "2026-11-29T12:00:00"});
      const std::string what = file + " " + test_case["conversation"].get<std::string>();
      if (test_case["error"].is_null()) {
        EXPECT_EQ(r.exit_code, 0) << what << ": " << r.err;
        EXPECT_EQ(r.out, test_case["rendered"].get<std::string>()) << what;
      } else {
        EXPECT_EQ(r.exit_code, 1) << what;
        EXPECT_EQ(r.out, "") << what;
        EXPECT_THAT(r.err, HasSubstr("moeserve chat-template: error: " + test_case["error"].get<std::string>()))
            << what;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 18);
}

TEST(ChatTemplateCliTest, TheModelFolderGivesTemplateAndSpecialTokensUnlessTheRequestDoes) {
  testing::ScratchDir dir;
  WriteFile(dir / "tokenizer_config.json",
            R"({"bos_token": {"__type": "AddedToken", "content": "<|begin|>"}, "eos_token": "<|end|>",
                "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}|{{ strftime_now('%d %b %Y') }}"})");
  WriteFile(dir / "request.json", R"({"messages": [{"role": "user", "content": "hé"}]})");
  testing::CommandResult r = testing::RunMoeserve({"chat-template", "--model", dir.path().string(), "--request",
                                                   dir / "request.json", "--now", "2026-11-29T12:00"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "<|begin|>|<|end|>|hé|29 Nov 2026");

  WriteFile(dir / "request.json", R"({"messages": [{"role": "user", "content": "x"}], "eos_token": "E"})");
  r = testing::RunMoeserve({"chat-template", "--model", dir.path().string(), "--request", dir / "request.json", "--now",
                            "2026-11-29T12:00:00"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "<|begin|>|E|x|29 Nov 2026");

  // chat_template.jinja wins over the config's template.
  WriteFile(dir / "chat_template.jinja", "jinja file: {{ messages | length }}\n");
  r = testing::RunMoeserve({"chat-template", "--model", dir.path().string(), "--request", dir / "request.json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "jinja file: 1");  // Jinja drops one trailing newline, as in transformers
}

TEST(ChatTemplateCliTest, TemplateErrorsExitOneAndUsageErrorsTwo) {
  testing::ScratchDir dir;
  WriteFile(dir / "request.json", R"({"messages": []})");
  WriteFile(dir / "raises.jinja", "{% if not messages %}\n{{ raise_exception('No messages given') }}\n{% endif %}");
  WriteFile(dir / "malformed.jinja", "{% for m in messages %}{{ m.content }}");
  WriteFile(dir / "not_json.json", "{\"messages\": [");

  testing::CommandResult r = testing::RunMoeserve(
      {"chat-template", "--chat-template-file", dir / "raises.jinja", "--request", dir / "request.json"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr("error: TemplateError: No messages given (chat template line 2)"));

  r = testing::RunMoeserve(
      {"chat-template", "--chat-template-file", dir / "malformed.jinja", "--request", dir / "request.json"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("TemplateSyntaxError: Unexpected end of template"));

  r = testing::RunMoeserve({"chat-template", "--model", dir.path().string(), "--request", dir / "request.json"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("has no tokenizer_config.json"));

  struct Usage {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Usage> usages = {
      {{"--request", dir / "request.json"}, "give one of --model DIR or --chat-template-file FILE"},
      {{"--model", dir.path().string(), "--chat-template-file", dir / "raises.jinja", "--request",
        dir / "request.json"},
       "--model excludes --chat-template-file"},
      {{"--chat-template-file", dir / "raises.jinja"}, "--request is required"},
      {{"--chat-template-file", dir / "raises.jinja", "--request", dir / "absent.json"}, "--request"},
      {{"--chat-template-file", dir / "absent.jinja", "--request", dir / "request.json"}, "--chat-template-file"},
      {{"--chat-template-file", dir / "raises.jinja", "--request", dir / "not_json.json"}, "invalid JSON"},
      {{"--chat-template-file", dir / "raises.jinja", "--request", dir / "request.json", "--now", "noon"},
       "--now 'noon' is not a time"},
  };
  for (const Usage& usage : usages) {
    std::vector<std::string> args = {"chat-template"};
    args.insert(args.end(), usage.args.begin(), usage.args.end());
    r = testing::RunMoeserve(args);
    EXPECT_EQ(r.exit_code, 2) << usage.message << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(usage.message));
    EXPECT_EQ(r.out, "");
  }
}

// Commands' inputs are bounded, as config.json is: a text file over 16 MiB for tokenize, and a chat
// template that would build a value or a prompt over 8 Mi characters, are refused with the limit
// (before the memory is taken), and an ordinary template still renders.
TEST(ChatTemplateCliTest, InputsAndWhatTemplatesBuildAreBounded) {
  testing::ScratchDir dir;
  { std::ofstream(dir / "big.txt") << "x"; }
  std::filesystem::resize_file(dir / "big.txt", size_t{17} << 20);
  const testing::CommandResult tokenize =
      testing::RunMoeserve({"tokenize", "--model", testing::FixtureDir("qwen3_moe"), "--text-file", dir / "big.txt"});
  EXPECT_EQ(tokenize.exit_code, 2);
  EXPECT_THAT(tokenize.err, HasSubstr("more than the 16 MiB allowed for --text-file"));

  WriteFile(dir / "request.json", R"({"messages": [{"role": "user", "content": "hi"}]})");
  const struct {
    std::string source, message;
  } templates[] = {
      {"{{ 'x' * 2000000000 }}",
       "SecurityError: the template would build a value of 2000000000 characters or items, more than the 8388608 a "
       "chat template may"},
      {"{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "the template would build a prompt of"},
      {"{{ 'x'|center(2000000000) }}", "the template would build 'center' output of 2000000000"},
  };
  for (const auto& t : templates) {
    WriteFile(dir / "template.jinja", t.source);
    const testing::CommandResult r = testing::RunMoeserve(
        {"chat-template", "--chat-template-file", dir / "template.jinja", "--request", dir / "request.json"});
    if (r.err.find("cannot import jinja2") != std::string::npos) GTEST_SKIP() << "no jinja2 on this machine";
    EXPECT_EQ(r.exit_code, 1) << t.source << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(t.message)) << t.source;
    EXPECT_EQ(r.out, "") << t.source;
  }
  WriteFile(dir / "template.jinja", "{% for m in messages %}{{ m.role + ': ' + m.content|center(6) }}{% endfor %}");
  const testing::CommandResult ok = testing::RunMoeserve(
      {"chat-template", "--chat-template-file", dir / "template.jinja", "--request", dir / "request.json"});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(ok.out, "user:   hi  ");
}

}  // namespace
}  // namespace moe

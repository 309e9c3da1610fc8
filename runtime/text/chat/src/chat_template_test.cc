#include "moe/text/chat_template.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/civil_time.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "python_runtime.h"

namespace moe::text {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using OrderedJson = nlohmann::ordered_json;

// testdata/ of the source tree, or $MOE_TESTDATA_DIR when the tests run from a bundle elsewhere.
std::string TestdataDir() {
  const char* env = std::getenv("MOE_TESTDATA_DIR");
  return env != nullptr && *env != '\0' ? env : MOE_TESTDATA_DIR;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The goldens keep the key order of the Python dicts they were made from, which tojson prints.
const OrderedJson& Goldens() {
  static const OrderedJson* const goldens =
      new OrderedJson(OrderedJson::parse(ReadFile(TestdataDir() + "/chat/goldens.json")));
  return *goldens;
}

// The time render_goldens.py gave strftime_now: datetime(2026, 11, 29, 12, 0), a local time.
std::chrono::system_clock::time_point GoldenNow() {
  return absl::ToChronoTime(absl::FromCivil(absl::CivilSecond(2026, 11, 29, 12, 0, 0), absl::LocalTimeZone()));
}

std::unique_ptr<ChatTemplate> MustCompile(const std::string& source) {
  absl::StatusOr<std::unique_ptr<ChatTemplate>> compiled = ChatTemplate::Compile(source);
  EXPECT_TRUE(compiled.ok()) << compiled.status();
  return compiled.ok() ? std::move(*compiled) : nullptr;
}

// The variables render_goldens.py passes: the conversation's keys, then add_generation_prompt,
// bos_token, eos_token, and enable_thinking unless it is null.
OrderedJson GoldenVariables(const OrderedJson& test_case) {
  OrderedJson variables = Goldens()["conversations"][test_case["conversation"].get<std::string>()];
  variables["add_generation_prompt"] = test_case["add_generation_prompt"];
  variables["bos_token"] = "<s>";
  variables["eos_token"] = "</s>";
  if (!test_case["enable_thinking"].is_null()) variables["enable_thinking"] = test_case["enable_thinking"];
  return variables;
}

std::string CaseName(const std::string& file, const OrderedJson& test_case) {
  return file + " " + test_case["conversation"].get<std::string>() +
         " add_generation_prompt=" + test_case["add_generation_prompt"].dump() +
         " enable_thinking=" + test_case["enable_thinking"].dump();
}

class ChatTemplateTest : public ::testing::Test {
 protected:
  void SetUp() override { ChatTemplate::SetNowForTesting(GoldenNow()); }
  void TearDown() override { ChatTemplate::SetNowForTesting(std::nullopt); }
};

TEST_F(ChatTemplateTest, EveryGoldenIsByteIdenticalOrFailsWithJinjasMessage) {
  int rendered = 0, failed = 0;
  for (const auto& [file, golden] : Goldens()["templates"].items()) {
    const std::string source = ReadFile(TestdataDir() + "/chat/" + file);
    ASSERT_EQ(source, golden["source"].get<std::string>()) << file;
    std::unique_ptr<ChatTemplate> chat = MustCompile(source);
    ASSERT_NE(chat, nullptr) << file;
    for (const OrderedJson& test_case : golden["cases"]) {
      const absl::StatusOr<std::string> text = chat->RenderJsonText(GoldenVariables(test_case).dump());
      if (test_case["error"].is_null()) {
        ASSERT_TRUE(text.ok()) << CaseName(file, test_case) << ": " << text.status();
        EXPECT_EQ(*text, test_case["rendered"].get<std::string>()) << CaseName(file, test_case);
        ++rendered;
      } else {
        ASSERT_FALSE(text.ok()) << CaseName(file, test_case);
        EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(text.status().message()), StartsWith(test_case["error"].get<std::string>()))
            << CaseName(file, test_case);
        ++failed;
      }
    }
  }
  EXPECT_EQ(rendered, 68);
  EXPECT_EQ(failed, 4);
}

// nlohmann::json sorts keys, so only a template that prints a dict in its own order (`tools` via
// tojson) can tell the two entry points apart; everything else renders the same.
TEST_F(ChatTemplateTest, SortedJsonRendersTheGoldensThatPrintNoDict) {
  for (const auto& [file, golden] : Goldens()["templates"].items()) {
    std::unique_ptr<ChatTemplate> chat = MustCompile(golden["source"].get<std::string>());
    ASSERT_NE(chat, nullptr);
    for (const OrderedJson& test_case : golden["cases"]) {
      const OrderedJson variables = GoldenVariables(test_case);
      if (variables.contains("tools") || !test_case["error"].is_null()) continue;
      const absl::StatusOr<std::string> text = chat->Render(nlohmann::json::parse(variables.dump()));
      ASSERT_TRUE(text.ok()) << text.status();
      EXPECT_EQ(*text, test_case["rendered"].get<std::string>()) << CaseName(file, test_case);
    }
  }
}

TEST_F(ChatTemplateTest, RaiseExceptionIsInvalidArgumentWithItsText) {
  std::unique_ptr<ChatTemplate> chat = MustCompile(
      "{% if messages[0].role == 'system' %}\n{{ raise_exception('System role not supported') }}\n{% endif %}");
  const absl::StatusOr<std::string> text = chat->Render({{"messages", {{{"role", "system"}, {"content", "x"}}}}});
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(text.status().message(), "TemplateError: System role not supported (chat template line 2)");
}

TEST_F(ChatTemplateTest, AnUndefinedVariableIsNamed) {
  std::unique_ptr<ChatTemplate> chat = MustCompile("{{ bos_token }}{{ tools.name }}");
  const absl::StatusOr<std::string> text = chat->Render({{"bos_token", "<s>"}});
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(text.status().message(), HasSubstr("UndefinedError: 'tools' is undefined"));
}

TEST_F(ChatTemplateTest, AMalformedTemplateIsInvalidArgumentWithTheLine) {
  const absl::StatusOr<std::unique_ptr<ChatTemplate>> chat =
      ChatTemplate::Compile("{% for m in messages %}\n{{ m.content }}\n{% endif %}");
  ASSERT_FALSE(chat.ok());
  EXPECT_EQ(chat.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(chat.status().message()), StartsWith("TemplateSyntaxError: Encountered unknown tag 'endif'"));
  EXPECT_THAT(chat.status().message(), HasSubstr("(chat template line 3)"));

  const absl::StatusOr<std::unique_ptr<ChatTemplate>> unclosed = ChatTemplate::Compile("{{ messages[0 }}");
  ASSERT_FALSE(unclosed.ok());
  EXPECT_THAT(unclosed.status().message(), HasSubstr("TemplateSyntaxError"));

  const absl::StatusOr<std::unique_ptr<ChatTemplate>> not_utf8 = ChatTemplate::Compile("\xff{{ x }}");
  ASSERT_FALSE(not_utf8.ok());
  EXPECT_EQ(not_utf8.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(not_utf8.status().message(), HasSubstr("not valid UTF-8"));
}

// transformers' tojson: json.dumps with ensure_ascii=False and its keyword arguments, and none of
// Jinja's HTML escaping.
TEST_F(ChatTemplateTest, ToJsonIsJsonDumpsWithoutAsciiEscapes) {
  std::unique_ptr<ChatTemplate> chat = MustCompile(
      "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}|"
      "{{ x | tojson(sort_keys=true) }}|{{ x | tojson(ensure_ascii=true) }}");
  const absl::StatusOr<std::string> text = chat->RenderJsonText(R"({"x": {"b": "<卡>&'", "a": [1, 2.5, null, true]}})");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text,
            "{\"b\": \"<卡>&'\", \"a\": [1, 2.5, null, true]}|"
            "{\n  \"b\": \"<卡>&'\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}|"
            "{\"b\":\"<卡>&'\",\"a\":[1,2.5,null,true]}|"
            "{\"a\": [1, 2.5, null, true], \"b\": \"<卡>&'\"}|"
            "{\"b\": \"<\\u5361>&'\", \"a\": [1, 2.5, null, true]}");
}

TEST_F(ChatTemplateTest, StrftimeNowUsesTheInjectedTime) {
  std::unique_ptr<ChatTemplate> chat = MustCompile("{{ strftime_now('%d %b %Y %H:%M') }}");
  EXPECT_EQ(chat->Render(nlohmann::json::object()).value_or("?"), "29 Nov 2026 12:00");
  ChatTemplate::SetNowForTesting(std::nullopt);
  const std::string year = absl::FormatTime("%Y", absl::Now(), absl::LocalTimeZone());
  EXPECT_THAT(chat->Render(nlohmann::json::object()).value_or("?"), HasSubstr(year));
}

TEST_F(ChatTemplateTest, LoopControlsTrimAndLstripBlocksAreOn) {
  std::unique_ptr<ChatTemplate> chat = MustCompile(
      "{% for i in items %}\n  {% if i == 3 %}{% break %}{% endif %}\n  {% if i == 1 %}{% continue %}{% endif %}\n"
      "{{ i }}\n{% endfor %}");
  EXPECT_EQ(chat->Render({{"items", {1, 2, 3, 4}}}).value_or("?"), "2\n");
}

// ImmutableSandboxedEnvironment: a template may not change the request nor reach Python internals.
TEST_F(ChatTemplateTest, TheSandboxIsImmutable) {
  std::unique_ptr<ChatTemplate> chat = MustCompile("{{ messages.append(1) }}");
  const absl::StatusOr<std::string> text = chat->Render({{"messages", nlohmann::json::array()}});
  ASSERT_FALSE(text.ok());
  EXPECT_THAT(text.status().message(), HasSubstr("SecurityError"));
  std::unique_ptr<ChatTemplate> escape = MustCompile("{{ x.__class__.__mro__ }}");
  EXPECT_FALSE(escape->Render({{"x", "s"}}).ok());
}

TEST_F(ChatTemplateTest, VariablesMustBeAJsonObjectOfUtf8Text) {
  std::unique_ptr<ChatTemplate> chat = MustCompile("{{ self }}-{{ x }}");
  // A key named like render()'s own parameter reaches the template (where Jinja's `self` wins).
  EXPECT_THAT(chat->Render({{"self", 1}, {"x", "y"}}).value_or("?"), ::testing::EndsWith("-y"));
  EXPECT_EQ(chat->Render(nlohmann::json::array()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(chat->Render({{"x", "\xff"}}).status().code(), absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<std::string> list = chat->RenderJsonText("[1]");
  EXPECT_EQ(list.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(list.status().message(), HasSubstr("must be a JSON object"));
  const absl::StatusOr<std::string> broken = chat->RenderJsonText("{\"x\": ");
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(broken.status().message(), HasSubstr("JSONDecodeError"));
  const absl::StatusOr<std::string> surrogate = chat->RenderJsonText(R"({"x": "\ud800"})");
  EXPECT_EQ(surrogate.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ChatTemplateTest, AMissingModuleIsUnavailableWithWhatToInstall) {
  EXPECT_TRUE(internal::ImportPythonModule("jinja2").ok());
  const absl::Status missing = internal::ImportPythonModule("moe_no_such_module");
  EXPECT_EQ(missing.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(missing.message(), HasSubstr("No module named 'moe_no_such_module'"));
  EXPECT_THAT(missing.message(), HasSubstr("install python3-jinja2"));
}

// Renders from many threads at once (each taking the GIL in turn) give what one thread gives.
TEST_F(ChatTemplateTest, ConcurrentRendersGiveTheSameText) {
  struct Job {
    const ChatTemplate* chat;
    std::string variables, want;
  };
  std::vector<std::unique_ptr<ChatTemplate>> chats;
  std::vector<Job> jobs;
  for (const auto& [file, golden] : Goldens()["templates"].items()) {
    chats.push_back(MustCompile(golden["source"].get<std::string>()));
    for (const OrderedJson& test_case : golden["cases"]) {
      if (!test_case["error"].is_null()) continue;
      jobs.push_back({chats.back().get(), GoldenVariables(test_case).dump(), test_case["rendered"].get<std::string>()});
    }
  }
  constexpr int kThreads = 8, kRounds = 10;
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        for (size_t j = 0; j < jobs.size(); ++j) {
          const Job& job = jobs[(j + t * 7) % jobs.size()];
          if (job.chat->RenderJsonText(job.variables).value_or("") != job.want) ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
  chats.clear();  // destroyed here, on this thread, with renders of other threads done
}

// The cost of one render (never asserted): Qwen3's template over a request that offers tools.
TEST_F(ChatTemplateTest, TimeToRenderOneRequest) {
  const OrderedJson& golden = Goldens()["templates"]["Qwen3-30B-A3B.jinja"];
  std::unique_ptr<ChatTemplate> chat = MustCompile(golden["source"].get<std::string>());
  for (const char* conversation : {"tools_offered", "tool_roundtrip"}) {
    OrderedJson variables = Goldens()["conversations"][conversation];
    variables["add_generation_prompt"] = true;
    const std::string text = variables.dump();
    std::vector<double> micros;
    for (int i = 0; i < 200; ++i) {
      const auto start = std::chrono::steady_clock::now();
      const absl::StatusOr<std::string> rendered = chat->RenderJsonText(text);
      micros.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
      ASSERT_TRUE(rendered.ok()) << rendered.status();
    }
    std::sort(micros.begin(), micros.end());
    std::printf("Qwen3-30B-A3B.jinja, %s (%zu bytes of JSON): median %.1f us per render, p90 %.1f us (200 renders)\n",
                conversation, text.size(), micros[100], micros[180]);
  }
}

}  // namespace
}  // namespace moe::text

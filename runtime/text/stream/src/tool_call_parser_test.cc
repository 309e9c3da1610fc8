#include "moe/text/tool_call_parser.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe::text {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

struct ExpectedCall {
  std::string name;
  Json arguments;
};

struct Expected {
  std::string content;
  std::vector<ExpectedCall> calls;
};

struct Collected {
  std::string content;
  std::map<int, ToolCall> streamed;  // The deltas, appended per index.
  std::vector<ToolCall> calls;
};

Collected Feed(const std::string& parser_name, const Json& tools, const std::vector<std::string>& pieces) {
  absl::StatusOr<std::unique_ptr<ToolCallParser>> parser = MakeToolCallParser(parser_name, tools);
  EXPECT_TRUE(parser.ok()) << parser.status();
  Collected out;
  auto absorb = [&out](const TextDelta& delta) {
    EXPECT_TRUE(delta.reasoning.empty());
    out.content += delta.content;
    for (const ToolCallDelta& call : delta.tool_calls) {
      ToolCall& streamed = out.streamed[call.index];
      // Only the first delta of a call carries its id and name.
      if (!call.id.empty()) {
        EXPECT_TRUE(streamed.id.empty()) << "a second id for call " << call.index;
      }
      streamed.id += call.id;
      streamed.name += call.name;
      streamed.arguments += call.arguments;
    }
  };
  for (const std::string& piece : pieces) absorb((*parser)->Add(piece));
  absorb((*parser)->Finish());
  out.calls = (*parser)->calls();
  return out;
}

void Check(const Collected& got, const Expected& expected, const std::string& how) {
  EXPECT_EQ(got.content, expected.content) << how;
  ASSERT_EQ(got.calls.size(), expected.calls.size()) << how;
  ASSERT_EQ(got.streamed.size(), expected.calls.size()) << how;
  for (size_t i = 0; i < expected.calls.size(); ++i) {
    const ToolCall& call = got.calls[i];
    const ToolCall& streamed = got.streamed.at(static_cast<int>(i));
    EXPECT_EQ(call.name, expected.calls[i].name) << how;
    EXPECT_FALSE(call.id.empty()) << how;
    EXPECT_EQ(streamed.id, call.id) << how;
    EXPECT_EQ(streamed.name, call.name) << how;
    EXPECT_EQ(streamed.arguments, call.arguments) << how;
    const Json arguments = Json::parse(call.arguments, nullptr, false);
    ASSERT_FALSE(arguments.is_discarded()) << how << ": " << call.arguments;
    EXPECT_TRUE(arguments.is_object()) << how;
    EXPECT_EQ(arguments, expected.calls[i].arguments) << how << ": " << call.arguments;
  }
}

// Pieces the way a tokenizer would cut them: each marker whole, other text in runs of up to
// three bytes.
std::vector<std::string> TokenPieces(const std::string& text, const std::vector<std::string>& markers) {
  std::vector<std::string> pieces;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t size = 0;
    for (const std::string& marker : markers) {
      if (text.compare(pos, marker.size(), marker) == 0) size = marker.size();
    }
    if (size == 0) {
      while (size < 3 && pos + size < text.size()) {
        bool at_marker = false;
        for (const std::string& marker : markers) {
          at_marker |= size > 0 && text.compare(pos + size, marker.size(), marker) == 0;
        }
        if (at_marker) break;
        ++size;
      }
    }
    pieces.push_back(text.substr(pos, size));
    pos += size;
  }
  return pieces;
}

// The whole text at once, token by token, byte by byte, and split in two at every byte.
void ExpectEverySplit(const std::string& parser_name, const Json& tools, const std::string& text,
                      const std::vector<std::string>& markers, const Expected& expected) {
  Check(Feed(parser_name, tools, {text}), expected, "whole");
  Check(Feed(parser_name, tools, TokenPieces(text, markers)), expected, "token by token");
  std::vector<std::string> bytes;
  for (char c : text) bytes.push_back(std::string(1, c));
  Check(Feed(parser_name, tools, bytes), expected, "byte by byte");
  for (size_t i = 0; i <= text.size(); ++i) {
    Check(Feed(parser_name, tools, {text.substr(0, i), text.substr(i)}), expected, "split at " + std::to_string(i));
  }
}

const std::vector<std::string> kHermesMarkers = {"<tool_call>", "</tool_call>"};

TEST(HermesToolCallParserTest, TwoCallsWithContentAround) {
  const std::string text =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Z\xC3\xBCrich\", \"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
      "\"arguments\": {}}\n</tool_call>\nDone.";
  ExpectEverySplit("hermes", nullptr, text, kHermesMarkers,
                   {"Let me check.\n\nDone.",
                    {{"get_weather", {{"city", "Z\xC3\xBCrich"}, {"days", 3}}}, {"get_time", Json::object()}}});
}

TEST(HermesToolCallParserTest, WhitespaceAfterTheLastCallIsDropped) {
  ExpectEverySplit("hermes", nullptr, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>\n\n",
                   kHermesMarkers, {"", {{"f", {{"a", 1}}}}});
}

TEST(HermesToolCallParserTest, MalformedCallIsContent) {
  const std::string bad = "<tool_call>\n{\"name\": \"f\", \"arguments\": {bad json}}\n</tool_call>";
  ExpectEverySplit("hermes", nullptr, "Try: " + bad, kHermesMarkers, {"Try: " + bad, {}});
  const std::string good = "<tool_call>{\"name\": \"g\", \"arguments\": {\"x\": [1, 2]}}</tool_call>";
  ExpectEverySplit("hermes", nullptr, bad + "\n" + good, kHermesMarkers, {bad, {{"g", {{"x", {1, 2}}}}}});
}

TEST(HermesToolCallParserTest, CutOffCallIsContent) {
  const std::string text = "Sure.<tool_call>\n{\"name\": \"f\", \"argu";
  ExpectEverySplit("hermes", nullptr, text, kHermesMarkers, {text, {}});
}

TEST(HermesToolCallParserTest, TextLikeAMarkerIsContent) {
  const std::string text = "Use <tool> or <tool_cal> tags; <tool_call";
  ExpectEverySplit("hermes", nullptr, text, kHermesMarkers, {text, {}});
}

TEST(HermesToolCallParserTest, HoldsBackOnlyAPossibleMarker) {
  std::unique_ptr<ToolCallParser> parser = *MakeToolCallParser("hermes", nullptr);
  EXPECT_EQ(parser->Add("Hello <tool").content, "Hello ");
  EXPECT_EQ(parser->Add("s> and <").content, "<tools> and ");
  EXPECT_EQ(parser->Add("tool_call>{\"name\": \"f\"}").content, "");
  TextDelta delta = parser->Add("</tool_call>");
  ASSERT_EQ(delta.tool_calls.size(), 2u);
  EXPECT_EQ(delta.tool_calls[0].index, 0);
  EXPECT_EQ(delta.tool_calls[0].name, "f");
  EXPECT_EQ(delta.tool_calls[0].id.substr(0, 5), "call_");
  EXPECT_EQ(delta.tool_calls[0].arguments, "");
  EXPECT_EQ(delta.tool_calls[1].arguments, "{}");
  EXPECT_TRUE(delta.tool_calls[1].name.empty());
}

const Json kWeatherTools = Json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                   "tags": {"type": "array"}, "unit": {"enum": ["c", "f"]},
                   "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}
])");

const std::vector<std::string> kQwen3CoderMarkers = {
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>"};

TEST(Qwen3CoderToolCallParserTest, ValuesTypedBySchema) {
  const std::string text =
      "I'll look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
      "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
      "<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
      "<parameter=unit>\n42\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n</function>\n"
      "</tool_call>";
  ExpectEverySplit("qwen3_coder", kWeatherTools, text, kQwen3CoderMarkers,
                   {"I'll look.\n\n",
                    {{"get_weather",
                      {{"city", "San Francisco"},
                       {"days", 3},
                       {"metric", true},
                       {"ratio", 0.5},
                       {"tags", {"a", "b"}},
                       {"unit", "42"},
                       {"limit", nullptr}}}}});
}

TEST(Qwen3CoderToolCallParserTest, UntypedValuesAreStringsAndKeepTheirLines) {
  const std::string text =
      "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
      "<parameter=content>\ndef f():\n    return 1\n\n</parameter>\n</function>\n</tool_call>\n"
      "<tool_call>\n<function=run>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>";
  ExpectEverySplit(
      "qwen3_coder", kWeatherTools, text, kQwen3CoderMarkers,
      {"", {{"write_file", {{"path", "/tmp/a.py"}, {"content", "def f():\n    return 1\n"}}}, {"run", {{"n", "7"}}}}});
}

TEST(Qwen3CoderToolCallParserTest, UnclosedParameterStillParses) {
  const std::string text =
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n"
      "</function>\n</tool_call>";
  ExpectEverySplit("qwen3_coder", kWeatherTools, text, kQwen3CoderMarkers,
                   {"", {{"get_weather", {{"city", "Oslo"}, {"days", 2}}}}});
}

TEST(Qwen3CoderToolCallParserTest, MalformedAndCutOffCallsAreContent) {
  const std::string bad = "<tool_call>\n<function>\n</function>\n</tool_call>";
  ExpectEverySplit("qwen3_coder", kWeatherTools, "x " + bad + " y", kQwen3CoderMarkers, {"x " + bad + " y", {}});
  const std::string cut = "ok <tool_call>\n<function=get_weather>\n<parameter=city>\nOs";
  ExpectEverySplit("qwen3_coder", kWeatherTools, cut, kQwen3CoderMarkers, {cut, {}});
}

const std::vector<std::string> kGlmMarkers = {"<tool_call>", "</tool_call>", "<arg_key>",
                                              "</arg_key>",  "<arg_value>",  "</arg_value>"};

TEST(Glm45ToolCallParserTest, CallsWithTypedAndUntypedValues) {
  const std::string text =
      "Checking both.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing"
      "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
      "<tool_call>search\n<arg_key>ids</arg_key>\n<arg_value>[1, 2]</arg_value>\n"
      "<arg_key>query</arg_key>\n<arg_value>weather in Beijing</arg_value>\n</tool_call>"
      "<tool_call>get_time\n</tool_call>";
  ExpectEverySplit("glm45", kWeatherTools, text, kGlmMarkers,
                   {"Checking both.\n",
                    {{"get_weather", {{"city", "Beijing"}, {"days", 2}}},
                     {"search", {{"ids", {1, 2}}, {"query", "weather in Beijing"}}},
                     {"get_time", Json::object()}}});
}

TEST(Glm45ToolCallParserTest, StringParameterStaysAString) {
  const std::string text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>2024</arg_value>\n</tool_call>";
  ExpectEverySplit("glm45", kWeatherTools, text, kGlmMarkers, {"", {{"get_weather", {{"city", "2024"}}}}});
}

TEST(Glm45ToolCallParserTest, MalformedCallIsContent) {
  const std::string bad = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>";
  ExpectEverySplit("glm45", kWeatherTools, bad + "after", kGlmMarkers, {bad + "after", {}});
}

const std::string kCallsBegin = "<｜tool▁calls▁begin｜>";
const std::string kCallsEnd = "<｜tool▁calls▁end｜>";
const std::string kCallBegin = "<｜tool▁call▁begin｜>";
const std::string kCallEnd = "<｜tool▁call▁end｜>";
const std::string kSep = "<｜tool▁sep｜>";
const std::vector<std::string> kDeepSeekMarkers = {kCallsBegin, kCallsEnd, kCallBegin, kCallEnd, kSep};

TEST(DeepSeekV31ToolCallParserTest, SectionWithTwoCalls) {
  const std::string text = "Checking." + kCallsBegin + kCallBegin + "get_weather" + kSep + "{\"city\": \"Paris\"}" +
                           kCallEnd + "\n" + kCallBegin + "get_time" + kSep + "{}" + kCallEnd + kCallsEnd +
                           " Then more.";
  ExpectEverySplit("deepseek_v31", nullptr, text, kDeepSeekMarkers,
                   {"Checking. Then more.", {{"get_weather", {{"city", "Paris"}}}, {"get_time", Json::object()}}});
}

TEST(DeepSeekV31ToolCallParserTest, MalformedCallIsContent) {
  const std::string text = kCallsBegin + kCallBegin + "f" + kSep + "{bad" + kCallEnd + kCallsEnd;
  ExpectEverySplit("deepseek_v31", nullptr, text, kDeepSeekMarkers, {text, {}});
  const std::string mixed = kCallsBegin + kCallBegin + "f" + kSep + "{\"a\": 1}" + kCallEnd + kCallBegin + "g" + kSep +
                            "[1]" + kCallEnd + kCallsEnd;
  ExpectEverySplit("deepseek_v31", nullptr, mixed, kDeepSeekMarkers,
                   {kCallBegin + "g" + kSep + "[1]" + kCallEnd, {{"f", {{"a", 1}}}}});
}

TEST(DeepSeekV31ToolCallParserTest, CutOffCallIsContent) {
  const std::string text = "Hi" + kCallsBegin + kCallBegin + "f" + kSep + "{\"a\": ";
  ExpectEverySplit("deepseek_v31", nullptr, text, kDeepSeekMarkers, {text, {}});
}

const std::vector<std::string> kMistralMarkers = {"[TOOL_CALLS]"};

TEST(MistralToolCallParserTest, ListOfCalls) {
  const std::string text =
      "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"q\": "
      "\"a]}\\\"b\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
  ExpectEverySplit("mistral", nullptr, text, kMistralMarkers,
                   {"", {{"get_weather", {{"city", "Paris"}, {"q", "a]}\"b"}}}, {"get_time", Json::object()}}});
  const Collected got = Feed("mistral", nullptr, {text});
  ASSERT_EQ(got.calls.size(), 2u);
  EXPECT_EQ(got.calls[0].id.size(), 9u);
  EXPECT_NE(got.calls[0].id, got.calls[1].id);
}

TEST(MistralToolCallParserTest, ContentBeforeAndASingleObject) {
  ExpectEverySplit("mistral", nullptr, "Sure. [TOOL_CALLS] {\"name\": \"f\", \"arguments\": {\"x\": true}}",
                   kMistralMarkers, {"Sure. ", {{"f", {{"x", true}}}}});
}

TEST(MistralToolCallParserTest, MalformedAndCutOffCallsAreContent) {
  const std::string prose = "[TOOL_CALLS] is a token";
  ExpectEverySplit("mistral", nullptr, prose, kMistralMarkers, {prose, {}});
  const std::string bad = "[TOOL_CALLS][{\"nam\": \"f\"}]";
  ExpectEverySplit("mistral", nullptr, bad, kMistralMarkers, {bad, {}});
  const std::string cut = "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": ";
  ExpectEverySplit("mistral", nullptr, cut, kMistralMarkers, {cut, {}});
}

TEST(ToolCallParserTest, UnknownNameListsTheKnownOnes) {
  absl::StatusOr<std::unique_ptr<ToolCallParser>> parser = MakeToolCallParser("pythonic", nullptr);
  ASSERT_FALSE(parser.ok());
  EXPECT_EQ(parser.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(parser.status().message(), HasSubstr("pythonic"));
  EXPECT_THAT(parser.status().message(), HasSubstr("deepseek_v31, glm45, hermes, mistral, qwen3_coder"));
  EXPECT_EQ(MakeToolCallParser("hermes", Json::object()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ToolCallParserTest, DefaultsByModelType) {
  EXPECT_EQ(DefaultToolCallParser("qwen3_moe"), "hermes");
  EXPECT_EQ(DefaultToolCallParser("qwen2_moe"), "hermes");
  EXPECT_EQ(DefaultToolCallParser("glm4_moe"), "glm45");
  EXPECT_EQ(DefaultToolCallParser("deepseek_v3"), "deepseek_v31");
  EXPECT_EQ(DefaultToolCallParser("mixtral"), "mistral");
  EXPECT_EQ(DefaultToolCallParser("llama"), "");
  for (const std::string& name : ToolCallParserNames()) {
    EXPECT_TRUE(MakeToolCallParser(name, nullptr).ok()) << name;
  }
}

}  // namespace
}  // namespace moe::text

#include "moe/text/reasoning_parser.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe::text {
namespace {

struct Split {
  std::string content;
  std::string reasoning;
};

Split Run(bool starts_in_reasoning, const std::vector<std::string>& pieces) {
  ReasoningParser parser("<think>", "</think>", starts_in_reasoning);
  Split out;
  auto absorb = [&out](const TextDelta& delta) {
    EXPECT_TRUE(delta.tool_calls.empty());
    out.content += delta.content;
    out.reasoning += delta.reasoning;
  };
  for (const std::string& piece : pieces) absorb(parser.Add(piece));
  absorb(parser.Finish());
  return out;
}

void ExpectAllSplits(bool starts_in_reasoning, const std::string& text, const std::string& reasoning,
                     const std::string& content) {
  for (size_t i = 0; i <= text.size(); ++i) {
    const Split s = Run(starts_in_reasoning, {text.substr(0, i), text.substr(i)});
    EXPECT_EQ(s.reasoning, reasoning) << "split at " << i;
    EXPECT_EQ(s.content, content) << "split at " << i;
  }
  std::vector<std::string> bytes;
  for (char c : text) bytes.push_back(std::string(1, c));
  const Split s = Run(starts_in_reasoning, bytes);
  EXPECT_EQ(s.reasoning, reasoning);
  EXPECT_EQ(s.content, content);
}

TEST(ReasoningParserTest, OpeningTagInTheOutput) {
  ExpectAllSplits(false, "<think>\nLet me add.\n</think>\n\nThe answer is 4.", "\nLet me add.\n",
                  "\n\nThe answer is 4.");
  ExpectAllSplits(false, "\n<think>a</think>b", "a", "b");
}

TEST(ReasoningParserTest, OpeningTagInThePrompt) {
  ExpectAllSplits(true, "Let me add.\n</think>\n\nThe answer is 4.", "Let me add.\n", "\n\nThe answer is 4.");
}

TEST(ReasoningParserTest, NoReasoning) {
  ExpectAllSplits(false, "The answer is 4.", "", "The answer is 4.");
  // A later tag is part of the answer, not reasoning.
  ExpectAllSplits(false, "Use <think> tags: <think>x</think>", "", "Use <think> tags: <think>x</think>");
  ExpectAllSplits(false, "<thin>", "", "<thin>");
}

TEST(ReasoningParserTest, EndTagOnlyOnce) { ExpectAllSplits(true, "a</think>b</think>c", "a", "b</think>c"); }

TEST(ReasoningParserTest, CutOffHoldsNothingBack) {
  ExpectAllSplits(false, "<think>hmm</thi", "hmm</thi", "");
  ExpectAllSplits(false, "<thi", "", "<thi");
  ExpectAllSplits(true, "hmm", "hmm", "");
}

TEST(ReasoningParserTest, StreamsReasoningAsItComes) {
  ReasoningParser parser;
  EXPECT_EQ(parser.Add("<think>").reasoning, "");
  EXPECT_EQ(parser.Add("step one").reasoning, "step one");
  TextDelta delta = parser.Add(" done</th");
  EXPECT_EQ(delta.reasoning, " done");
  delta = parser.Add("ink>Answer");
  EXPECT_EQ(delta.reasoning, "");
  EXPECT_EQ(delta.content, "Answer");
  EXPECT_EQ(parser.Add(" more").content, " more");
}

TEST(ReasoningParserTest, CustomTags) {
  ReasoningParser parser("[THINK]", "[/THINK]");
  TextDelta delta = parser.Add("[THINK]x[/THINK]y");
  EXPECT_EQ(delta.reasoning, "x");
  EXPECT_EQ(delta.content, "y");
}

TEST(ReasoningParserTest, DefaultsByModelType) {
  EXPECT_EQ(DefaultReasoningParser("qwen3_moe"), "qwen3");
  EXPECT_EQ(DefaultReasoningParser("glm4_moe"), "glm45");
  EXPECT_EQ(DefaultReasoningParser("mixtral"), "");
}

}  // namespace
}  // namespace moe::text

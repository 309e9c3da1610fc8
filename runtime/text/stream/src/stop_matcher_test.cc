#include "moe/text/stop_matcher.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe::text {
namespace {

struct Result {
  std::string text;
  bool stopped = false;
  std::string matched;
};

Result Run(const std::vector<std::string>& stops, bool include, const std::vector<std::string>& pieces) {
  StopMatcher matcher(stops, include);
  Result result;
  for (const std::string& piece : pieces) result.text += matcher.Add(piece);
  result.text += matcher.Finish();
  result.stopped = matcher.stopped();
  result.matched = matcher.matched();
  return result;
}

// Every split of `text` in two, and one byte at a time, gives `expected`.
void ExpectAllSplits(const std::vector<std::string>& stops, bool include, const std::string& text,
                     const std::string& expected, const std::string& matched) {
  for (size_t i = 0; i <= text.size(); ++i) {
    const Result r = Run(stops, include, {text.substr(0, i), text.substr(i)});
    EXPECT_EQ(r.text, expected) << "split at " << i;
    EXPECT_EQ(r.matched, matched) << "split at " << i;
    EXPECT_EQ(r.stopped, !matched.empty()) << "split at " << i;
  }
  std::vector<std::string> bytes;
  for (char c : text) bytes.push_back(std::string(1, c));
  const Result r = Run(stops, include, bytes);
  EXPECT_EQ(r.text, expected);
  EXPECT_EQ(r.matched, matched);
}

TEST(StopMatcherTest, StopSplitAcrossPieces) {
  StopMatcher matcher({"STOP"}, false);
  EXPECT_EQ(matcher.Add("hello ST"), "hello ");
  EXPECT_FALSE(matcher.stopped());
  EXPECT_EQ(matcher.Add("OP world"), "");
  EXPECT_TRUE(matcher.stopped());
  EXPECT_EQ(matcher.matched(), "STOP");
  EXPECT_EQ(matcher.Add("more"), "");
  EXPECT_EQ(matcher.Finish(), "");
}

TEST(StopMatcherTest, EverySplitStopsBeforeTheStop) {
  ExpectAllSplits({"STOP"}, false, "abc STOP def", "abc ", "STOP");
  ExpectAllSplits({"\n\nUser:"}, false, "Sure.\n\nUser: hi", "Sure.", "\n\nUser:");
}

TEST(StopMatcherTest, IncludeStopInOutput) {
  ExpectAllSplits({"STOP"}, true, "abc STOP def", "abc STOP", "STOP");
  ExpectAllSplits({"ab", "abc"}, true, "xxabcd", "xxab", "ab");
}

TEST(StopMatcherTest, OverlappingStopsTakeTheOneEndingFirst) {
  ExpectAllSplits({"abc", "ab"}, false, "xxabcd", "xx", "ab");
  ExpectAllSplits({"ab", "abc"}, false, "xxabcd", "xx", "ab");
  // Both end at the same byte: the longer one, which starts first.
  ExpectAllSplits({"bc", "abc"}, false, "xabcd", "x", "abc");
  ExpectAllSplits({"abcd", "bc"}, false, "xabcd", "xa", "bc");
}

TEST(StopMatcherTest, PrefixThatDoesNotCompleteIsReleased) {
  StopMatcher matcher({"</end>"}, false);
  EXPECT_EQ(matcher.Add("a</e"), "a");
  EXPECT_EQ(matcher.Add("nx"), "</enx");
  EXPECT_EQ(matcher.Add("</en"), "");
  EXPECT_EQ(matcher.Finish(), "</en");
  EXPECT_FALSE(matcher.stopped());
  ExpectAllSplits({"</end>"}, false, "a</en</end", "a</en</end", "");
}

TEST(StopMatcherTest, NoStopPrefixLeaksBeforeTheStop) {
  const std::string stop = "<|im_end|>";
  const std::string text = "one <|im two <|im_en three<|im_end|> four";
  StopMatcher matcher({stop}, false);
  std::string shown;
  for (char c : text) {
    shown += matcher.Add(std::string(1, c));
    // What is shown is always a prefix of the final answer.
    ASSERT_EQ(shown, std::string("one <|im two <|im_en three").substr(0, shown.size()));
  }
  EXPECT_EQ(shown, "one <|im two <|im_en three");
  EXPECT_TRUE(matcher.stopped());
}

TEST(StopMatcherTest, NoStopsPassesThrough) {
  ExpectAllSplits({}, false, "anything at all", "anything at all", "");
  ExpectAllSplits({""}, false, "anything at all", "anything at all", "");
}

TEST(StopMatcherTest, MultiByteStops) { ExpectAllSplits({"。\n"}, false, "答案是四。\n下一个", "答案是四", "。\n"); }

}  // namespace
}  // namespace moe::text

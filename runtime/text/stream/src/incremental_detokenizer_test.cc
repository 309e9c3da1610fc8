#include "moe/text/incremental_detokenizer.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe::text {
namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";

// Length of the valid UTF-8 sequence at text[pos], or 0 when it is invalid or cut off.
size_t ValidSequenceAt(const std::string& text, size_t pos) {
  const unsigned char c = static_cast<unsigned char>(text[pos]);
  size_t size = 0;
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0)
    size = 2;
  else if ((c & 0xF0) == 0xE0)
    size = 3;
  else if ((c & 0xF8) == 0xF0)
    size = 4;
  else
    return 0;
  if (pos + size > text.size()) return 0;
  for (size_t i = 1; i < size; ++i) {
    if ((static_cast<unsigned char>(text[pos + i]) & 0xC0) != 0x80) return 0;
  }
  return size;
}

bool IsValidUtf8(const std::string& text) {
  for (size_t pos = 0; pos < text.size();) {
    const size_t size = ValidSequenceAt(text, pos);
    if (size == 0) return false;
    pos += size;
  }
  return true;
}

// A byte-level vocabulary, decoded as Hugging Face tokenizers do: the bytes of the ids, with
// each invalid or incomplete sequence replaced by U+FFFD.
class ByteLevelVocab {
 public:
  explicit ByteLevelVocab(std::vector<std::string> pieces) : pieces_(std::move(pieces)) {}

  std::string Decode(const std::vector<int32_t>& ids) {
    max_ids_per_decode_ = std::max(max_ids_per_decode_, ids.size());
    std::string bytes;
    for (int32_t id : ids) bytes += pieces_.at(id);
    std::string text;
    for (size_t pos = 0; pos < bytes.size();) {
      const size_t size = ValidSequenceAt(bytes, pos);
      if (size == 0) {
        text += kReplacement;
        ++pos;
      } else {
        text.append(bytes, pos, size);
        pos += size;
      }
    }
    return text;
  }

  IncrementalDetokenizer::DecodeFn Fn() {
    return [this](const std::vector<int32_t>& ids) { return Decode(ids); };
  }
  size_t max_ids_per_decode() const { return max_ids_per_decode_; }

 private:
  std::vector<std::string> pieces_;
  size_t max_ids_per_decode_ = 0;
};

// 😀 is F0 9F 98 80, é is C3 A9, 你 is E4 BD A0.
ByteLevelVocab TestVocab() {
  return ByteLevelVocab({"Hello", " ", "\xF0\x9F", "\x98", "\x80", "\xC3", "\xA9", "!", "\xE4\xBD", "\xA0", " world"});
}

struct Streamed {
  std::vector<std::string> deltas;  // One per Add, then Finish's.
  std::string text;
};

Streamed Stream(IncrementalDetokenizer& detokenizer, const std::vector<int32_t>& ids) {
  Streamed out;
  for (int32_t id : ids) out.deltas.push_back(detokenizer.Add(id));
  out.deltas.push_back(detokenizer.Finish());
  for (const std::string& delta : out.deltas) out.text += delta;
  return out;
}

TEST(IncrementalDetokenizerTest, HoldsPartialCharactersUntilComplete) {
  ByteLevelVocab vocab = TestVocab();
  const std::vector<int32_t> ids = {0, 1, 2, 3, 4, 7, 5, 6, 8, 9};
  IncrementalDetokenizer detokenizer(vocab.Fn());
  const Streamed out = Stream(detokenizer, ids);
  EXPECT_EQ(out.text, vocab.Decode(ids));
  EXPECT_EQ(out.text, "Hello \xF0\x9F\x98\x80!\xC3\xA9\xE4\xBD\xA0");
  const std::vector<std::string> expected = {"Hello",        " ", "", "", "\xF0\x9F\x98\x80", "!", "", "\xC3\xA9", "",
                                             "\xE4\xBD\xA0", ""};
  EXPECT_EQ(out.deltas, expected);
  for (const std::string& delta : out.deltas) {
    EXPECT_TRUE(IsValidUtf8(delta)) << delta;
    EXPECT_EQ(delta.find(kReplacement), std::string::npos) << delta;
  }
}

TEST(IncrementalDetokenizerTest, EveryOrderOfPiecesConcatenatesToTheDecode) {
  ByteLevelVocab vocab = TestVocab();
  // All sequences of length 4 over the vocabulary: partial characters everywhere, including
  // ones that are never completed.
  const int32_t n = 11;
  for (int32_t code = 0; code < n * n * n * n; ++code) {
    std::vector<int32_t> ids;
    for (int32_t c = code, i = 0; i < 4; ++i, c /= n) ids.push_back(c % n);
    IncrementalDetokenizer detokenizer(vocab.Fn());
    const Streamed out = Stream(detokenizer, ids);
    ASSERT_EQ(out.text, vocab.Decode(ids)) << code;
    for (size_t i = 0; i + 1 < out.deltas.size(); ++i) {
      ASSERT_TRUE(IsValidUtf8(out.deltas[i])) << code;
      // Before Finish, a delta never ends in a replacement character that a later id might
      // still have completed.
      ASSERT_FALSE(out.deltas[i].size() >= 3 && out.deltas[i].compare(out.deltas[i].size() - 3, 3, kReplacement) == 0)
          << code;
    }
  }
}

TEST(IncrementalDetokenizerTest, FinishFlushesAnIncompleteCharacter) {
  ByteLevelVocab vocab = TestVocab();
  IncrementalDetokenizer detokenizer(vocab.Fn());
  EXPECT_EQ(detokenizer.Add(0), "Hello");
  EXPECT_EQ(detokenizer.Add(2), "");
  EXPECT_EQ(detokenizer.Add(3), "");
  EXPECT_EQ(detokenizer.Finish(), vocab.Decode({2, 3}));
  EXPECT_EQ(detokenizer.Finish(), "");
}

TEST(IncrementalDetokenizerTest, DecoderThatReturnsRawBytes) {
  // A decoder that does not replace incomplete sequences: the partial bytes are held the same.
  const std::vector<std::string> pieces = {"a", "\xF0\x9F", "\x98", "\x80", "\xC3"};
  auto decode = [&pieces](const std::vector<int32_t>& ids) {
    std::string bytes;
    for (int32_t id : ids) bytes += pieces.at(id);
    return bytes;
  };
  IncrementalDetokenizer detokenizer(decode);
  EXPECT_EQ(detokenizer.Add(0), "a");
  EXPECT_EQ(detokenizer.Add(1), "");
  EXPECT_EQ(detokenizer.Add(2), "");
  EXPECT_EQ(detokenizer.Add(3), "\xF0\x9F\x98\x80");
  EXPECT_EQ(detokenizer.Add(4), "");
  // At the end the decoder's own text comes out, whatever it is.
  EXPECT_EQ(detokenizer.Finish(), "\xC3");
}

TEST(IncrementalDetokenizerTest, PromptGivesLeftContext) {
  // A SentencePiece-like decode drops the leading space of the text, so " world" alone decodes
  // to "world"; after the prompt it must keep its space.
  ByteLevelVocab vocab = TestVocab();
  auto decode = [&vocab](const std::vector<int32_t>& ids) {
    std::string text = vocab.Decode(ids);
    if (!text.empty() && text[0] == ' ') text.erase(0, 1);
    return text;
  };
  IncrementalDetokenizer with_prompt(decode, {7, 0});
  EXPECT_EQ(with_prompt.Add(10), " world");
  EXPECT_EQ(with_prompt.Add(10), " world");
  EXPECT_EQ(with_prompt.Finish(), "");

  IncrementalDetokenizer without_prompt(decode);
  EXPECT_EQ(without_prompt.Add(10), "world");
  EXPECT_EQ(without_prompt.Add(10), " world");
}

TEST(IncrementalDetokenizerTest, DecodesABoundedWindow) {
  ByteLevelVocab vocab = TestVocab();
  std::vector<int32_t> prompt(1000, 0);
  IncrementalDetokenizer detokenizer(vocab.Fn(), prompt);
  std::vector<int32_t> ids;
  for (int i = 0; i < 2000; ++i) {
    ids.push_back(i % 3 == 0 ? 0 : (i % 3 == 1 ? 5 : 6));  // "Hello", then é over two ids.
  }
  const Streamed out = Stream(detokenizer, ids);
  EXPECT_LE(vocab.max_ids_per_decode(), 8u);
  EXPECT_EQ(out.text, vocab.Decode(ids));
}

}  // namespace
}  // namespace moe::text

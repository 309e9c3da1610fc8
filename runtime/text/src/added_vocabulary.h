// The added tokens of tokenizer.json ("<|im_start|>", "<s>", ...), found in text before the
// model sees it, with HF's rules: leftmost match, longest first among those starting there;
// single_word matches only between non-word characters; lstrip/rstrip swallow the whitespace
// beside the token.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moe::text::internal {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool normalized = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// A stretch of text: an added token (id >= 0) or plain text (id -1) to tokenize further.
struct TextSplit {
  size_t begin;
  size_t end;
  int32_t id;
};

// Matches a fixed set of added tokens; immutable after construction, so thread-safe.
class AddedTokenMatcher {
 public:
  // `patterns[i]` is the text that stands for `tokens[i]` (its content, normalized for tokens
  // matched after normalization). Empty patterns are ignored.
  AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns);
  bool empty() const { return tokens_.empty(); }
  std::vector<TextSplit> Split(std::string_view text) const;

 private:
  // Leftmost-longest: the token that starts first, the longest of those; -1 if none.
  int FindAt(std::string_view text, size_t from, size_t* begin, size_t* end) const;

  struct Node {
    std::vector<std::pair<unsigned char, int>> children;  // sorted by byte
    int token = -1;                                       // index into tokens_, or -1
  };
  int Child(int node, unsigned char byte) const;

  std::vector<AddedToken> tokens_;
  std::vector<Node> trie_;
  bool first_byte_[256] = {};
};

}  // namespace moe::text::internal

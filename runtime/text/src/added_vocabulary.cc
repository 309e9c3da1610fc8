#include "added_vocabulary.h"

#include <algorithm>

#include "unicode.h"

namespace moe::text::internal {
namespace {

// The code point that ends just before `at`.
char32_t PreviousCodePoint(std::string_view text, size_t at) {
  size_t begin = at - 1;
  while (begin > 0 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
  return NextCodePoint(text, &begin);
}

// Word characters as in the regex \w that HF checks single_word with.
bool IsWordChar(char32_t cp) { return cp == '_' || IsAlphanumeric(cp); }

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns)
    : tokens_(std::move(tokens)) {
  trie_.emplace_back();
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const std::string& pattern = patterns[i];
    if (pattern.empty()) continue;
    int node = 0;
    for (unsigned char c : pattern) {
      int child = Child(node, c);
      if (child < 0) {
        child = static_cast<int>(trie_.size());
        trie_.emplace_back();
        auto& children = trie_[node].children;
        children.insert(std::lower_bound(children.begin(), children.end(), std::make_pair(c, 0)), {c, child});
      }
      node = child;
    }
    // Two tokens with the same text: the first one listed wins.
    if (trie_[node].token < 0) trie_[node].token = static_cast<int>(i);
    first_byte_[static_cast<unsigned char>(pattern[0])] = true;
  }
}

int AddedTokenMatcher::Child(int node, unsigned char byte) const {
  const auto& children = trie_[node].children;
  auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, 0));
  return it != children.end() && it->first == byte ? it->second : -1;
}

int AddedTokenMatcher::FindAt(std::string_view text, size_t from, size_t* begin, size_t* end) const {
  for (size_t start = from; start < text.size(); ++start) {
    if (!first_byte_[static_cast<unsigned char>(text[start])]) continue;
    int node = 0, best = -1;
    size_t best_end = 0;
    for (size_t i = start; i < text.size(); ++i) {
      node = Child(node, static_cast<unsigned char>(text[i]));
      if (node < 0) break;
      if (trie_[node].token >= 0) {
        best = trie_[node].token;
        best_end = i + 1;
      }
    }
    if (best >= 0) {
      *begin = start;
      *end = best_end;
      return best;
    }
  }
  return -1;
}

std::vector<TextSplit> AddedTokenMatcher::Split(std::string_view text) const {
  std::vector<TextSplit> splits;
  size_t done = 0;  // text before this is in `splits`
  size_t search = 0;
  while (search < text.size()) {
    size_t begin = 0, end = 0;
    const int index = FindAt(text, search, &begin, &end);
    if (index < 0) break;
    const AddedToken& token = tokens_[index];
    // Matches do not overlap: the next search starts after this match, whether or not it counts.
    search = end;
    if (token.single_word) {
      const bool space_before = begin == 0 || !IsWordChar(PreviousCodePoint(text, begin));
      size_t after = end;
      const bool space_after = end == text.size() || !IsWordChar(NextCodePoint(text, &after));
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) {
      size_t new_begin = begin;
      while (new_begin > done) {
        size_t at = new_begin - 1;
        while (at > 0 && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) --at;
        size_t pos = at;
        if (!IsWhitespace(NextCodePoint(text, &pos))) break;
        new_begin = at;
      }
      begin = new_begin;
    }
    if (token.rstrip) {
      for (size_t pos = end; pos < text.size();) {
        if (!IsWhitespace(NextCodePoint(text, &pos))) break;
        end = pos;
      }
      search = end;
    }
    if (begin > done) splits.push_back({done, begin, -1});
    splits.push_back({begin, end, token.id});
    done = end;
  }
  if (done < text.size()) splits.push_back({done, text.size(), -1});
  return splits;
}

}  // namespace moe::text::internal

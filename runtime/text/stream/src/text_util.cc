#include "text_util.h"

#include <algorithm>

namespace moe::text::internal {

size_t PartialSuffixLength(std::string_view text, std::string_view tag) {
  // Tags are short (a few dozen bytes), so trying each length is cheaper than building a
  // failure table per call.
  for (size_t k = std::min(text.size(), tag.empty() ? 0 : tag.size() - 1); k > 0; --k) {
    if (text.substr(text.size() - k) == tag.substr(0, k)) return k;
  }
  return 0;
}

size_t IncompleteUtf8Tail(std::string_view text) {
  const size_t limit = std::min<size_t>(text.size(), 3);
  for (size_t i = 1; i <= limit; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[text.size() - i]);
    if ((c & 0xC0) == 0x80) continue;  // A continuation byte: look further back for the lead.
    size_t needed = 1;
    if ((c & 0xE0) == 0xC0) {
      needed = 2;
    } else if ((c & 0xF0) == 0xE0) {
      needed = 3;
    } else if ((c & 0xF8) == 0xF0) {
      needed = 4;
    }
    return needed > i ? i : 0;
  }
  return 0;
}

bool EndsWithReplacementChar(std::string_view text) {
  return text.size() >= 3 && text.substr(text.size() - 3) == "\xEF\xBF\xBD";
}

std::string_view TrimSpace(std::string_view text) {
  while (!text.empty() && IsJsonSpace(text.front())) text.remove_prefix(1);
  while (!text.empty() && IsJsonSpace(text.back())) text.remove_suffix(1);
  return text;
}

}  // namespace moe::text::internal

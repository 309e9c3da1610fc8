// A compiled PCRE2 pattern (UTF, Unicode properties, JIT) for the tokenizer's Split, Replace and
// ByteLevel patterns. HF's patterns are written for Oniguruma; the constructs they use ((?i:...),
// \p{L}, \p{N}, (?!\S), possessive-free alternations) mean the same in PCRE2 with PCRE2_UCP.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::text::internal {

struct ByteSpan {
  size_t begin = 0;
  size_t end = 0;
};

// Thread-safe: the compiled code is shared read-only and each call has its own match data.
class Regex {
 public:
  // kInvalidArgument with PCRE2's message and the offset for a pattern that does not compile.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern);
  // A literal string, matched as is.
  static absl::StatusOr<std::unique_ptr<Regex>> Literal(std::string_view text);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The non-empty, non-overlapping matches in `text` (valid UTF-8), left to right.
  std::vector<ByteSpan> FindAll(std::string_view text) const;
  // `text` with every match replaced by `replacement` (taken literally).
  std::string ReplaceAll(std::string_view text, std::string_view replacement) const;

 private:
  Regex() = default;
  void* code_ = nullptr;  // pcre2_code_8, kept out of this header
  std::string literal_;   // non-empty for a literal pattern, matched with find() instead
  bool is_literal_ = false;
};

}  // namespace moe::text::internal

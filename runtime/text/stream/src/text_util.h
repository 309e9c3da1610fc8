// Byte-level helpers shared by the streaming text pieces.
#pragma once

#include <cstddef>
#include <string_view>

namespace moe::text::internal {

// The length of the longest proper prefix of `tag` that `text` ends with: the bytes a streaming
// parser must hold back because the next piece may complete them into `tag`.
size_t PartialSuffixLength(std::string_view text, std::string_view tag);

// The number of bytes at the end of `text` that start a UTF-8 sequence without finishing it
// (0 when `text` ends on a character boundary).
size_t IncompleteUtf8Tail(std::string_view text);

// Whether `text` ends with U+FFFD, what decoders put in place of an incomplete byte sequence.
bool EndsWithReplacementChar(std::string_view text);

inline bool IsUtf8Continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

inline bool IsJsonSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// `text` without leading and trailing JSON whitespace.
std::string_view TrimSpace(std::string_view text);

}  // namespace moe::text::internal

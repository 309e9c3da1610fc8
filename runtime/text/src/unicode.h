// UTF-8 and Unicode helpers for the tokenizer: decoding, repair, character classes with the
// meanings Rust's `char` gives them (the reference implementation is written in Rust), the
// utf8proc normal forms, and GPT-2's byte-to-character map.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moe::text::internal {

// The code point at `text[*pos]`, advancing *pos past it. The text must be valid UTF-8.
char32_t NextCodePoint(std::string_view text, size_t* pos);
// The byte length of the UTF-8 sequence that starts with `lead` (1 for a stray byte).
inline size_t CodePointLength(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }
void AppendUtf8(char32_t cp, std::string* out);

// `text` with every maximal invalid subsequence replaced by U+FFFD (WHATWG / Python "replace").
std::string RepairUtf8(std::string_view text);
bool IsValidUtf8(std::string_view text);

// Rust's char::is_whitespace (the White_Space property).
bool IsWhitespace(char32_t cp);
// Rust's char::is_alphanumeric, approximated by the L* and N* categories.
bool IsAlphanumeric(char32_t cp);
// Rust's char::is_numeric: Nd, Nl, No.
bool IsNumeric(char32_t cp);
// The tokenizers crate's is_punc: ASCII punctuation (symbols included) or a P* category.
bool IsPunctuation(char32_t cp);

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
std::string Normalize(std::string_view text, NormalForm form);
std::string Lowercase(std::string_view text);

// GPT-2's map from each byte to a printable character, as UTF-8, and back (-1: not a byte).
const std::string& ByteToUnicode(uint8_t byte);
int UnicodeToByte(char32_t cp);

}  // namespace moe::text::internal

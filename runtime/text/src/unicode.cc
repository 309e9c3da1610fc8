#include "unicode.h"

#include <array>
#include <cstdlib>

#include "utf8proc.h"

namespace moe::text::internal {

char32_t NextCodePoint(std::string_view text, size_t* pos) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  size_t i = *pos;
  const unsigned char c = s[i];
  if (c < 0x80) {
    *pos = i + 1;
    return c;
  }
  const size_t len = CodePointLength(c);
  char32_t cp = c & (len == 2 ? 0x1F : len == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < len && i + k < text.size(); ++k) cp = (cp << 6) | (s[i + k] & 0x3F);
  *pos = std::min(text.size(), i + len);
  return cp;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {

// The length of the valid sequence at s[i], or 0 with *invalid_len set to the length of the
// maximal invalid subsequence there (Unicode's "maximal subpart", which Python also uses).
size_t ValidSequenceAt(const unsigned char* s, size_t n, size_t i, size_t* invalid_len) {
  const unsigned char c = s[i];
  if (c < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *invalid_len = 1;
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    const unsigned char lower = k == 1 ? lo : 0x80, upper = k == 1 ? hi : 0xBF;
    if (i + k >= n || s[i + k] < lower || s[i + k] > upper) {
      *invalid_len = k;
      return 0;
    }
  }
  return len;
}

}  // namespace

bool IsValidUtf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  size_t invalid = 0;
  for (size_t i = 0; i < text.size();) {
    const size_t len = ValidSequenceAt(s, text.size(), i, &invalid);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string RepairUtf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    size_t invalid = 0;
    const size_t len = ValidSequenceAt(s, text.size(), i, &invalid);
    if (len > 0) {
      out.append(text.data() + i, len);
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");
      i += invalid;
    }
  }
  return out;
}

bool IsWhitespace(char32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  switch (cp) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool IsAlphanumeric(char32_t cp) {
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z');
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

bool IsNumeric(char32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

bool IsPunctuation(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= 0x21 && cp <= 0x2F) || (cp >= 0x3A && cp <= 0x40) || (cp >= 0x5B && cp <= 0x60) ||
           (cp >= 0x7B && cp <= 0x7E);
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

namespace {

std::string MapWithUtf8proc(std::string_view text, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &mapped, static_cast<utf8proc_option_t>(options));
  // The input is valid UTF-8 (Encode repairs it first), so a failure can only be memory; the
  // text is then left as it is rather than lost.
  if (n < 0) return std::string(text);
  std::string out(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
  std::free(mapped);
  return out;
}

// Code points that NFC leaves alone whatever surrounds them: starters (combining class 0) that
// are NFC_QC=Yes and never the second half of a composition. Covers the scripts of most
// prompts so that utf8proc runs only where something may change.
bool NfcInert(char32_t cp) {
  return (cp >= 0xA0 && cp <= 0xFF) || (cp >= 0x400 && cp <= 0x482) || (cp >= 0x48A && cp <= 0x4FF) ||
         (cp >= 0x3000 && cp <= 0x3029) || (cp >= 0x3041 && cp <= 0x3096) || (cp >= 0x30A1 && cp <= 0x30FA) ||
         (cp >= 0x3400 && cp <= 0x4DBF) || (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0xAC00 && cp <= 0xD7A3) ||
         (cp >= 0xFF01 && cp <= 0xFF60) || (cp >= 0x1F300 && cp <= 0x1FAFF);
}

}  // namespace

std::string Normalize(std::string_view text, NormalForm form) {
  // ASCII is its own normal form in all four forms and neither composes with what precedes it
  // nor decomposes, so only runs of non-ASCII text (with the ASCII character before each, which
  // a combining mark may join) need utf8proc; for NFC, not even those when every character in
  // the run is inert.
  std::string out;
  out.reserve(text.size());
  size_t done = 0;
  for (size_t i = 0; i < text.size();) {
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t run_begin = i > done ? i - 1 : i;
    bool inert = form == NormalForm::kNfc;
    size_t end = i;
    while (end < text.size() && static_cast<unsigned char>(text[end]) >= 0x80) {
      const char32_t cp = NextCodePoint(text, &end);
      inert = inert && NfcInert(cp);
    }
    if (!inert) {
      out.append(text.substr(done, run_begin - done));
      out += MapWithUtf8proc(text.substr(run_begin, end - run_begin), form);
      done = end;
    }
    i = end;
  }
  if (done == 0) return std::string(text);
  out.append(text.substr(done));
  return out;
}

std::string Lowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[pos]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c));
      ++pos;
      continue;
    }
    const char32_t cp = NextCodePoint(text, &pos);
    AppendUtf8(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))), &out);
  }
  return out;
}

namespace {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100 onwards in byte order, so that every byte has a visible, non-space character.
struct ByteLevelTables {
  std::array<std::string, 256> to_unicode;
  std::array<int, 324> to_byte;  // code points < 324 cover the whole image
  ByteLevelTables() {
    to_byte.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const int cp = printable ? b : next++;
      AppendUtf8(static_cast<char32_t>(cp), &to_unicode[b]);
      to_byte[cp] = b;
    }
  }
};

const ByteLevelTables& Tables() {
  static const ByteLevelTables* tables = new ByteLevelTables();
  return *tables;
}

}  // namespace

const std::string& ByteToUnicode(uint8_t byte) { return Tables().to_unicode[byte]; }

int UnicodeToByte(char32_t cp) { return cp < 324 ? Tables().to_byte[cp] : -1; }

}  // namespace moe::text::internal

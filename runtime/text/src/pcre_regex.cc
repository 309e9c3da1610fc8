#include "pcre_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"

namespace moe::text::internal {
namespace {

pcre2_code* Code(void* code) { return static_cast<pcre2_code*>(code); }

// One thread's match data and JIT stack, reused across calls: allocating them per call would
// dominate the cost of matching a short word.
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_jit_stack* stack = nullptr;
  pcre2_match_context* context = nullptr;
  MatchScratch() {
    data = pcre2_match_data_create(32, nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    context = pcre2_match_context_create(nullptr);
    if (stack != nullptr && context != nullptr) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

MatchScratch& Scratch() {
  thread_local MatchScratch scratch;
  return scratch;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                                   &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat("regex /", std::string(pattern), "/ does not compile at offset ",
                                                   offset, ": ", reinterpret_cast<const char*>(message)));
  }
  // Without JIT matching still works, only slower; so a JIT failure is not an error.
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  auto regex = std::unique_ptr<Regex>(new Regex());
  regex->code_ = code;
  return regex;
}

absl::StatusOr<std::unique_ptr<Regex>> Regex::Literal(std::string_view text) {
  auto regex = std::unique_ptr<Regex>(new Regex());
  regex->literal_ = std::string(text);
  regex->is_literal_ = true;
  return regex;
}

Regex::~Regex() { pcre2_code_free(Code(code_)); }

std::vector<ByteSpan> Regex::FindAll(std::string_view text) const {
  std::vector<ByteSpan> spans;
  if (is_literal_) {
    if (literal_.empty()) return spans;
    for (size_t at = text.find(literal_); at != std::string_view::npos; at = text.find(literal_, at + literal_.size()))
      spans.push_back({at, at + literal_.size()});
    return spans;
  }
  MatchScratch& scratch = Scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    int rc = pcre2_match(Code(code_), subject, text.size(), start, PCRE2_NO_UTF_CHECK, scratch.data, scratch.context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT || rc == PCRE2_ERROR_MATCHLIMIT) {
      // A pathological subject: the interpreter has its own, heap-based limits.
      rc = pcre2_match(Code(code_), subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, scratch.data,
                       nullptr);
    }
    if (rc < 0) break;  // no further match (or a limit even the interpreter hit: the rest stays unsplit)
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch.data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      spans.push_back({begin, end});
      start = end;
    } else {
      // An empty match splits nothing; step over one character and go on.
      if (begin >= text.size()) break;
      start = begin + 1;
      while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
    }
  }
  return spans;
}

std::string Regex::ReplaceAll(std::string_view text, std::string_view replacement) const {
  std::string out;
  size_t at = 0;
  for (const ByteSpan& span : FindAll(text)) {
    out.append(text.substr(at, span.begin - at));
    out.append(replacement);
    at = span.end;
  }
  out.append(text.substr(at));
  return out;
}

}  // namespace moe::text::internal

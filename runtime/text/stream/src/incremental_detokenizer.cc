#include "moe/text/incremental_detokenizer.h"

#include <algorithm>
#include <utility>

#include "text_util.h"

namespace moe::text {
namespace {

// How many prompt ids seed the window: enough left context for a SentencePiece space or a
// byte-level merge, as vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET.
constexpr size_t kPromptContextIds = 5;

// The part of `text` past `prefix`. Decoders normally extend the prefix's text; when one does
// not (a normaliser rewrote the seam), the delta starts after the common part, moved back to a
// character boundary so that it stays valid UTF-8.
std::string TextPast(const std::string& prefix, const std::string& text) {
  if (text.compare(0, prefix.size(), prefix) == 0) return text.substr(prefix.size());
  size_t common = 0;
  const size_t limit = std::min(prefix.size(), text.size());
  while (common < limit && prefix[common] == text[common]) ++common;
  while (common > 0 && common < text.size() && internal::IsUtf8Continuation(text[common])) {
    --common;
  }
  return text.substr(common);
}

}  // namespace

IncrementalDetokenizer::IncrementalDetokenizer(DecodeFn decode, std::vector<int32_t> prompt_ids)
    : decode_(std::move(decode)) {
  const size_t context = std::min(prompt_ids.size(), kPromptContextIds);
  window_.assign(prompt_ids.end() - static_cast<std::ptrdiff_t>(context), prompt_ids.end());
  read_offset_ = window_.size();
  if (!window_.empty()) prefix_text_ = decode_(window_);
}

std::string IncrementalDetokenizer::Add(int32_t id) {
  window_.push_back(id);
  return EmitIfComplete(/*final=*/false);
}

std::string IncrementalDetokenizer::Finish() {
  if (window_.size() == read_offset_) return "";
  return EmitIfComplete(/*final=*/true);
}

std::string IncrementalDetokenizer::EmitIfComplete(bool final) {
  std::string text = decode_(window_);
  // A decode no longer than the prefix's means the new ids have not produced visible text yet
  // (or the decoder merged them into the prefix); wait for more.
  if (text.size() <= prefix_text_.size() && !final) return "";
  if (!final && (internal::EndsWithReplacementChar(text) || internal::IncompleteUtf8Tail(text) > 0)) {
    return "";
  }
  std::string delta = text.size() > prefix_text_.size() ? TextPast(prefix_text_, text) : "";
  // Restart the window at the old read offset: the ids before it are behind a character
  // boundary the emitted text has passed, and keeping the ids since keeps the left context.
  window_.erase(window_.begin(), window_.begin() + static_cast<std::ptrdiff_t>(read_offset_));
  read_offset_ = window_.size();
  prefix_text_ = decode_(window_);
  return delta;
}

}  // namespace moe::text

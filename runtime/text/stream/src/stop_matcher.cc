#include "moe/text/stop_matcher.h"

#include <algorithm>
#include <utility>

#include "text_util.h"

namespace moe::text {

StopMatcher::StopMatcher(std::vector<std::string> stops, bool include_stop_in_output)
    : include_stop_in_output_(include_stop_in_output) {
  for (std::string& stop : stops) {
    if (stop.empty()) continue;
    max_stop_size_ = std::max(max_stop_size_, stop.size());
    stops_.push_back(std::move(stop));
  }
}

std::string StopMatcher::Add(std::string_view text) {
  if (stopped_) return "";
  text_.append(text);
  if (stops_.empty()) {
    std::string out = std::move(text_);
    text_.clear();
    return out;
  }

  // Every match inside the text seen before would have stopped already, so any match here ends
  // in the new text; the earliest end is what a token-by-token stream would have seen first.
  size_t best_start = std::string::npos;
  size_t best_end = std::string::npos;
  const std::string* best = nullptr;
  for (const std::string& stop : stops_) {
    const size_t start = text_.find(stop);
    if (start == std::string::npos) continue;
    const size_t end = start + stop.size();
    if (best == nullptr || end < best_end || (end == best_end && start < best_start)) {
      best_start = start;
      best_end = end;
      best = &stop;
    }
  }
  if (best != nullptr) {
    stopped_ = true;
    matched_ = *best;
    // Held-back text always covers a partial stop, so without include_stop_in_output the match
    // starts at or after emitted_.
    const size_t cut = include_stop_in_output_ ? best_end : std::max(best_start, emitted_);
    std::string out = text_.substr(emitted_, cut - emitted_);
    text_.clear();
    emitted_ = 0;
    return out;
  }

  size_t hold = 0;
  if (!include_stop_in_output_) {
    for (const std::string& stop : stops_) {
      hold = std::max(hold, internal::PartialSuffixLength(text_, stop));
    }
  }
  const size_t show_end = std::max(emitted_, text_.size() - hold);
  std::string out = text_.substr(emitted_, show_end - emitted_);
  emitted_ = show_end;
  TrimEmitted();
  return out;
}

std::string StopMatcher::Finish() {
  if (stopped_) return "";
  std::string out = text_.substr(emitted_);
  text_.clear();
  emitted_ = 0;
  return out;
}

void StopMatcher::TrimEmitted() {
  // A future match starts at most max_stop_size_ - 1 bytes before the current end.
  const size_t keep = max_stop_size_ - 1;
  const size_t droppable = text_.size() > keep ? text_.size() - keep : 0;
  const size_t drop = std::min(emitted_, droppable);
  text_.erase(0, drop);
  emitted_ -= drop;
}

}  // namespace moe::text

// Stop strings matched across the boundaries of generated text pieces.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moe::text {

// Text goes in as it is generated; text that is safe to show comes out. A suffix that could
// still grow into a stop string is held back, so a stop string never leaks into the output even
// when it arrives split over several tokens. Once a stop string matches, the output ends before
// it (or after it when `include_stop_in_output`), stopped() turns true and later text is dropped.
//
// When several stop strings match, the one that ends first wins (that is what a token-by-token
// stream sees first), and of those the longest; so the result does not depend on how the text
// was split. Empty stop strings are ignored.
//
// Input is expected to be whole UTF-8 characters (IncrementalDetokenizer's deltas); the output
// is then cut only at character boundaries. Not thread-safe.
class StopMatcher {
 public:
  StopMatcher(std::vector<std::string> stops, bool include_stop_in_output);

  // Appends `text`; returns what can be shown now.
  std::string Add(std::string_view text);

  // The held-back text when generation ended without a stop; "" after a stop.
  std::string Finish();

  bool stopped() const { return stopped_; }
  // The stop string that matched; "" until stopped().
  const std::string& matched() const { return matched_; }

 private:
  // Drops emitted text that no future match can reach back into.
  void TrimEmitted();

  std::vector<std::string> stops_;
  bool include_stop_in_output_;
  size_t max_stop_size_ = 0;
  // Recent text: text_[0, emitted_) was shown already and is kept only so a stop string that
  // starts there can still be found (include_stop_in_output); the rest is held back.
  std::string text_;
  size_t emitted_ = 0;
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace moe::text

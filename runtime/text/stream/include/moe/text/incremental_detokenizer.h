// Incremental detokenization: turns a stream of token ids into a stream of text deltas whose
// concatenation equals the decode of all the ids.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace moe::text {

// Decoding one id at a time is wrong for byte-level and SentencePiece vocabularies: a character
// can span several tokens, and a token's leading space depends on its left neighbour. So this
// keeps a short window of recent ids (the prefix/read offsets method of TGI and vLLM): it decodes
// the window, and emits the part that extends past the text already emitted for the window's
// older ids. The window restarts each time text is emitted, so a step costs O(window), not O(n).
//
// A delta never ends inside a UTF-8 character and never ends in a U+FFFD that an incomplete byte
// sequence produced: such text is held back until a later id completes it, or until Finish().
// (A genuine trailing U+FFFD is held the same way and comes out with the next delta.)
//
// Not thread-safe; one per sequence. `decode` is called from Add() and Finish() only and must
// stay valid for the life of this object.
class IncrementalDetokenizer {
 public:
  using DecodeFn = std::function<std::string(const std::vector<int32_t>& ids)>;

  // `prompt_ids`: the prompt; its last few ids seed the window so that the first generated
  // token decodes with its real left context (spaces, merges).
  explicit IncrementalDetokenizer(DecodeFn decode, std::vector<int32_t> prompt_ids = {});

  // Appends `id`; returns the text it completes (often empty while a character is partial).
  std::string Add(int32_t id);

  // Returns what is still held back, as the decoder produces it, even if it ends in U+FFFD.
  std::string Finish();

 private:
  // Text of window_ past prefix_text_, when it is complete enough to show; "" otherwise.
  std::string EmitIfComplete(bool final);

  DecodeFn decode_;
  std::vector<int32_t> window_;  // Ids from the prefix offset on.
  size_t read_offset_ = 0;       // window_[0, read_offset_) has been emitted.
  std::string prefix_text_;      // decode_(window_[0, read_offset_)).
};

}  // namespace moe::text

// Splits a reasoning block (<think>...</think>) off the generated text.
#pragma once

#include <string>
#include <string_view>

#include "moe/text/text_delta.h"

namespace moe::text {

// Text between the start and end tags goes to `reasoning`, the rest to `content`; the tags
// themselves go nowhere. The start tag opens a reasoning block only at the beginning of the
// output (after optional whitespace), and only one block is split off: Qwen3, GLM-4.5 and
// DeepSeek-R1 think once, first, and a later "<think>" in an answer is content. A suffix that
// could still become a tag is held back until it is decided, so a tag is never shown in part.
//
// `starts_in_reasoning`: the chat template's generation prompt already opened the block, so the
// output starts inside it and only the end tag is looked for.
//
// Not thread-safe; one per sequence.
class ReasoningParser {
 public:
  ReasoningParser(std::string start = "<think>", std::string end = "</think>", bool starts_in_reasoning = false);

  TextDelta Add(std::string_view text);
  // Flushes what was held back: inside the block as reasoning, before it as content.
  TextDelta Finish();

 private:
  enum class State { kStart, kReasoning, kContent };

  std::string start_;
  std::string end_;
  State state_;
  std::string pending_;  // Text not yet emitted: a possible tag, or leading whitespace.
};

// The reasoning parser name for a model family: "qwen3" for qwen3_moe and "glm45" for glm4_moe
// (both use <think>...</think>), "" for families without a reasoning block.
std::string DefaultReasoningParser(const std::string& model_type);

}  // namespace moe::text

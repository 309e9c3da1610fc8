#include "moe/text/reasoning_parser.h"

#include <utility>

#include "text_util.h"

namespace moe::text {

ReasoningParser::ReasoningParser(std::string start, std::string end, bool starts_in_reasoning)
    : start_(std::move(start)), end_(std::move(end)), state_(starts_in_reasoning ? State::kReasoning : State::kStart) {}

TextDelta ReasoningParser::Add(std::string_view text) {
  TextDelta out;
  if (state_ == State::kContent) {
    out.content.append(text);
    return out;
  }
  pending_.append(text);
  if (state_ == State::kStart) {
    size_t lead = 0;
    while (lead < pending_.size() && internal::IsJsonSpace(pending_[lead])) ++lead;
    const std::string_view rest = std::string_view(pending_).substr(lead);
    if (!start_.empty() && rest.substr(0, start_.size()) == start_) {
      // Whitespace before the opening tag is noise, not an answer.
      pending_.erase(0, lead + start_.size());
      state_ = State::kReasoning;
    } else if (!start_.empty() && rest.size() < start_.size() &&
               std::string_view(start_).substr(0, rest.size()) == rest) {
      return out;  // Still possibly the opening tag.
    } else {
      state_ = State::kContent;
      out.content = std::move(pending_);
      pending_.clear();
      return out;
    }
  }
  // state_ == kReasoning.
  const size_t end_pos = end_.empty() ? std::string::npos : pending_.find(end_);
  if (end_pos != std::string::npos) {
    out.reasoning = pending_.substr(0, end_pos);
    out.content = pending_.substr(end_pos + end_.size());
    pending_.clear();
    state_ = State::kContent;
    return out;
  }
  const size_t hold = internal::PartialSuffixLength(pending_, end_);
  out.reasoning = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

TextDelta ReasoningParser::Finish() {
  TextDelta out;
  if (state_ == State::kReasoning) {
    out.reasoning = std::move(pending_);
  } else {
    out.content = std::move(pending_);
  }
  pending_.clear();
  return out;
}

std::string DefaultReasoningParser(const std::string& model_type) {
  if (model_type == "qwen3_moe") return "qwen3";
  if (model_type == "glm4_moe") return "glm45";
  return "";
}

}  // namespace moe::text

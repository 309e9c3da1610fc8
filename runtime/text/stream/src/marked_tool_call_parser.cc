#include "marked_tool_call_parser.h"

#include <algorithm>
#include <utility>

#include "text_util.h"

namespace moe::text::internal {

MarkedToolCallParser::MarkedToolCallParser(CallMarkers markers, std::string id_prefix, int id_size)
    : markers_(std::move(markers)), id_prefix_(std::move(id_prefix)), id_size_(id_size) {}

TextDelta MarkedToolCallParser::Add(std::string_view text) {
  TextDelta out;
  buffer_.append(text);
  while (Step(&out)) {
  }
  return out;
}

TextDelta MarkedToolCallParser::Finish() {
  // Add() has run the state machine as far as the text goes; what is left is undecided.
  TextDelta out;
  switch (state_) {
    case State::kContent:
      // A partial marker at the end is plain text after all.
      AppendContent(buffer_, &out);
      break;
    case State::kSection:
      if (section_had_call_) {
        AppendContent(buffer_, &out);
      } else {
        // A section that never held a call is text the model wrote; give all of it back.
        out.content += std::exchange(unaccepted_section_begin_, "");
        out.content += held_whitespace_;
        out.content += buffer_;
      }
      break;
    case State::kCall:
      ReturnCallAsContent(buffer_, &out);
      break;
  }
  buffer_.clear();
  held_whitespace_.clear();
  unaccepted_section_begin_.clear();
  state_ = State::kContent;
  in_section_ = false;
  return out;
}

bool MarkedToolCallParser::Step(TextDelta* out) {
  switch (state_) {
    case State::kContent:
      return StepContent(out);
    case State::kSection:
      return StepSection(out);
    case State::kCall:
      return StepCall(out);
  }
  return false;
}

bool MarkedToolCallParser::StepContent(TextDelta* out) {
  const bool sectioned = !markers_.section_begin.empty();
  const std::string& marker = sectioned ? markers_.section_begin : markers_.call_begin;
  const size_t pos = buffer_.find(marker);
  if (pos == std::string::npos) {
    const size_t show = buffer_.size() - PartialSuffixLength(buffer_, marker);
    AppendContent(std::string_view(buffer_).substr(0, show), out);
    buffer_.erase(0, show);
    return false;
  }
  AppendContent(std::string_view(buffer_).substr(0, pos), out);
  held_whitespace_.clear();
  buffer_.erase(0, pos + marker.size());
  if (sectioned) {
    in_section_ = true;
    section_had_call_ = false;
    unaccepted_section_begin_ = marker;
    hold_whitespace_ = true;
    state_ = State::kSection;
  } else {
    StartCall();
  }
  return true;
}

bool MarkedToolCallParser::StepSection(TextDelta* out) {
  const size_t call_pos = buffer_.find(markers_.call_begin);
  const size_t end_pos = buffer_.find(markers_.section_end);
  if (call_pos == std::string::npos && end_pos == std::string::npos) {
    const size_t hold =
        std::max(PartialSuffixLength(buffer_, markers_.call_begin), PartialSuffixLength(buffer_, markers_.section_end));
    const size_t show = buffer_.size() - hold;
    // Stray text inside a section is shown rather than dropped; whitespace is held.
    AppendContent(std::string_view(buffer_).substr(0, show), out);
    buffer_.erase(0, show);
    return false;
  }
  const size_t pos = std::min(call_pos, end_pos);
  AppendContent(std::string_view(buffer_).substr(0, pos), out);
  held_whitespace_.clear();
  if (pos == call_pos) {
    buffer_.erase(0, pos + markers_.call_begin.size());
    StartCall();
  } else {
    buffer_.erase(0, pos + markers_.section_end.size());
    // A section without a call is text the model wrote; give its markers back.
    if (!section_had_call_) {
      AppendContent(std::exchange(unaccepted_section_begin_, "") + markers_.section_end, out);
    }
    in_section_ = false;
    state_ = State::kContent;
  }
  return true;
}

bool MarkedToolCallParser::StepCall(TextDelta* out) {
  const BodyEnd end = FindBodyEnd(buffer_);
  if (end.kind == BodyEnd::Kind::kNeedMore) return false;
  std::optional<std::vector<ParsedCall>> parsed;
  if (end.kind == BodyEnd::Kind::kComplete) {
    parsed = ParseBody(std::string_view(buffer_).substr(0, end.body_size));
  }
  if (parsed.has_value() && !parsed->empty()) {
    AcceptCalls(*std::move(parsed), out);
  } else {
    ReturnCallAsContent(std::string_view(buffer_).substr(0, end.consumed), out);
  }
  buffer_.erase(0, end.consumed);
  hold_whitespace_ = true;
  state_ = in_section_ ? State::kSection : State::kContent;
  return true;
}

void MarkedToolCallParser::AppendContent(std::string_view text, TextDelta* out) {
  if (!hold_whitespace_) {
    out->content.append(text);
    return;
  }
  size_t lead = 0;
  while (lead < text.size() && IsJsonSpace(text[lead])) ++lead;
  held_whitespace_.append(text.substr(0, lead));
  if (lead == text.size()) return;
  out->content.append(held_whitespace_);
  held_whitespace_.clear();
  hold_whitespace_ = false;
  out->content.append(text.substr(lead));
}

void MarkedToolCallParser::ReturnCallAsContent(std::string_view body_text, TextDelta* out) {
  // The section's opening marker goes back with the first call that cannot be used; the
  // section's end marker follows when the section ends without an accepted call.
  std::string raw = std::exchange(unaccepted_section_begin_, "");
  raw += markers_.call_begin;
  raw.append(body_text);
  hold_whitespace_ = false;
  out->content.append(raw);
}

void MarkedToolCallParser::AcceptCalls(std::vector<ParsedCall> parsed, TextDelta* out) {
  section_had_call_ = true;
  unaccepted_section_begin_.clear();
  for (ParsedCall& call : parsed) {
    const int index = static_cast<int>(calls_.size());
    ToolCall& accepted = calls_.emplace_back();
    accepted.id = NewCallId();
    accepted.name = std::move(call.name);
    accepted.arguments = std::move(call.arguments);
    out->tool_calls.push_back({index, accepted.id, accepted.name, ""});
    out->tool_calls.push_back({index, "", "", accepted.arguments});
  }
}

void MarkedToolCallParser::StartCall() {
  state_ = State::kCall;
  ResetBodyScan();
}

BodyEnd MarkedToolCallParser::FindBodyEnd(std::string_view text) {
  const std::string& end_marker = markers_.call_end;
  const size_t from = searched_ >= end_marker.size() ? searched_ - end_marker.size() + 1 : 0;
  const size_t pos = text.find(end_marker, from);
  searched_ = text.size();
  if (pos == std::string_view::npos) return {};
  return {BodyEnd::Kind::kComplete, pos, pos + end_marker.size()};
}

std::string MarkedToolCallParser::NewCallId() {
  static constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string id = id_prefix_;
  for (int i = 0; i < id_size_; ++i) {
    id.push_back(kAlphabet[absl::Uniform<size_t>(bitgen_, 0, sizeof(kAlphabet) - 1)]);
  }
  return id;
}

}  // namespace moe::text::internal

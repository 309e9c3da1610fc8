// The streaming machinery the tool-call formats share: find the markers that open a call (or a
// section of calls), buffer the call until it ends, then let the format parse it.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/random/random.h"
#include "moe/text/tool_call_parser.h"

namespace moe::text::internal {

// How a format marks its calls. A section (DeepSeek) wraps consecutive calls; without one, each
// call stands in the content on its own.
struct CallMarkers {
  std::string section_begin;  // "" when calls are not wrapped.
  std::string section_end;
  std::string call_begin;
  std::string call_end;  // "" when the body's own syntax ends it (FindBodyEnd is overridden).
};

// A parsed call before it gets an id.
struct ParsedCall {
  std::string name;
  std::string arguments;  // A JSON object as text.
};

// Where the body of a call ends, as far as the text so far tells.
struct BodyEnd {
  enum class Kind { kNeedMore, kComplete, kMalformed };
  Kind kind = Kind::kNeedMore;
  size_t body_size = 0;  // kComplete: the body is text[0, body_size).
  size_t consumed = 0;   // kComplete, kMalformed: text[0, consumed) belongs to the call.
};

class MarkedToolCallParser : public ToolCallParser {
 public:
  TextDelta Add(std::string_view text) final;
  TextDelta Finish() final;

 protected:
  // `id_size`: the number of random letters and digits in a call id; `id_prefix` goes before.
  MarkedToolCallParser(CallMarkers markers, std::string id_prefix = "call_", int id_size = 24);

  // Finds the end of the call body that starts `text` (the text after call_begin). The default
  // looks for call_end, searching only what is new since the last look.
  virtual BodyEnd FindBodyEnd(std::string_view text);
  // Called when a new call body starts, so that FindBodyEnd can keep per-call scan state.
  virtual void ResetBodyScan() { searched_ = 0; }
  // The calls in `body`, or nullopt when it is malformed.
  virtual std::optional<std::vector<ParsedCall>> ParseBody(std::string_view body) const = 0;

  const CallMarkers& markers() const { return markers_; }

  size_t searched_ = 0;  // Bytes of the current body the default FindBodyEnd has looked at.

 private:
  enum class State { kContent, kSection, kCall };

  // One step of the state machine over buffer_; false when it needs more text.
  bool Step(TextDelta* out);
  bool StepContent(TextDelta* out);
  bool StepSection(TextDelta* out);
  bool StepCall(TextDelta* out);

  // Content goes out through here so that whitespace after a call can be held and dropped.
  void AppendContent(std::string_view text, TextDelta* out);
  // Returns the text of a call that could not be used to the content, markers included.
  void ReturnCallAsContent(std::string_view body_text, TextDelta* out);
  void AcceptCalls(std::vector<ParsedCall> parsed, TextDelta* out);
  void StartCall();
  std::string NewCallId();

  CallMarkers markers_;
  std::string id_prefix_;
  int id_size_;
  absl::BitGen bitgen_;

  State state_ = State::kContent;
  std::string buffer_;  // Text not yet decided.
  bool in_section_ = false;
  bool section_had_call_ = false;  // A call in the current section was accepted.
  // The section's opening marker until a call in the section is accepted or one is given back:
  // it goes back to content with a malformed or cut-off call so that nothing is lost.
  std::string unaccepted_section_begin_;
  // After a call, leading whitespace is held here and dropped if only a call or the end follows.
  bool hold_whitespace_ = false;
  std::string held_whitespace_;
};

}  // namespace moe::text::internal

// Tool calls parsed out of generated text as it streams, for the formats the supported model
// families are trained on.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/text/text_delta.h"
#include "nlohmann/json.hpp"

namespace moe::text {

// Text goes in as it is generated; content and tool-call deltas come out, as OpenAI streams
// them. Text that could still be the start of a call marker is held back, never shown in part.
// A call is emitted once it is complete and parses (a header delta with index, id and name, then
// one delta with all its arguments), so a client never sees half of a call that turns out to be
// malformed; a malformed call, or one cut off by the end of generation, comes back as content
// with its markers, so no text is lost. Whitespace between and after calls is dropped.
//
// Not thread-safe; one per sequence.
class ToolCallParser {
 public:
  virtual ~ToolCallParser() = default;

  virtual TextDelta Add(std::string_view text) = 0;
  // Flushes held-back text; a call cut off mid-way is returned as content.
  virtual TextDelta Finish() = 0;

  // The complete calls so far, in order; the index of a delta is its position here.
  const std::vector<ToolCall>& calls() const { return calls_; }

 protected:
  std::vector<ToolCall> calls_;
};

// Parsers by name:
//   "hermes"       Qwen2.5 / Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
//   "qwen3_coder"  <tool_call><function=NAME><parameter=P>value</parameter>...</function>
//                  </tool_call>; values typed by the tool's parameter schema, else strings.
//   "glm45"        <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>;
//                  values typed by the schema, else JSON when they parse as JSON, else strings.
//   "deepseek_v31" <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}
//                  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
//   "mistral"      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]; ids are 9 letters and
//                  digits, which Mistral chat templates require when the call is sent back.
// `tools` is the request's OpenAI "tools" list (or null); it gives the parameter types.
// kInvalidArgument for an unknown name (the message lists the known ones) or a `tools` that is
// not a list.
absl::StatusOr<std::unique_ptr<ToolCallParser>> MakeToolCallParser(const std::string& name,
                                                                   const nlohmann::json& tools);

// The parser names MakeToolCallParser accepts, sorted.
std::vector<std::string> ToolCallParserNames();

// The tool-call parser name for a model family (qwen3_moe and qwen2_moe -> hermes, glm4_moe ->
// glm45, deepseek_v3 -> deepseek_v31, mixtral -> mistral); "" when there is none.
std::string DefaultToolCallParser(const std::string& model_type);

}  // namespace moe::text

// The pieces a streaming response is made of: visible content, reasoning, and tool-call
// fragments in the shape OpenAI's chat-completion chunks carry them.
#pragma once

#include <string>
#include <vector>

namespace moe::text {

// One fragment of a streamed tool call. The first fragment of a call carries its index, id and
// function name with empty arguments; later fragments carry only the index and argument text to
// append. The appended arguments of one index form a complete JSON object.
struct ToolCallDelta {
  int index = 0;
  std::string id;
  std::string name;
  std::string arguments;
};

// What one step of generated text adds to the response.
struct TextDelta {
  std::string content;
  std::string reasoning;
  std::vector<ToolCallDelta> tool_calls;

  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty(); }
};

// A complete tool call; `arguments` is a JSON object serialised as text.
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;
};

}  // namespace moe::text

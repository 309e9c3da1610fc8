// Converts tool-call parameter values written as plain text (Qwen3-Coder, GLM-4.5) to JSON by
// the types the request's tool schemas give.
#pragma once

#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "nlohmann/json.hpp"

namespace moe::text::internal {

class ParameterTypes {
 public:
  // `tools`: the request's OpenAI tools list; entries that are not functions with a parameters
  // schema are skipped (the request validator reports them, not the output parser).
  explicit ParameterTypes(const nlohmann::json& tools);

  // The JSON schema type of `function`'s parameter `param` ("string", "integer", ...), "" when
  // the tools do not say.
  std::string TypeOf(std::string_view function, std::string_view param) const;

  // `text` as a JSON value of `type`. A value that does not fit its type stays a string, so a
  // call is never lost over a type. Untyped values are strings, or with `untyped_as_json` JSON
  // when they parse as JSON.
  static nlohmann::ordered_json Convert(std::string_view text, std::string_view type, bool untyped_as_json);

 private:
  // function name -> parameter name -> type.
  absl::flat_hash_map<std::string, absl::flat_hash_map<std::string, std::string>> types_;
};

// `value` as compact JSON text; invalid UTF-8 in strings is replaced rather than thrown on.
std::string DumpJson(const nlohmann::ordered_json& value);

}  // namespace moe::text::internal

// The parts of ChatTemplate that do not depend on how the interpreter is reached.
#include "moe/text/chat_template.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace moe::text {

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::json& variables) const {
  if (!variables.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the template variables must be a JSON object, not ", variables.type_name()));
  }
  std::string text;
  try {
    // Compact, UTF-8 as it is (dump escapes only what JSON requires); json.loads reads it back.
    text = variables.dump();
  } catch (const nlohmann::json::exception& e) {
    // A string that is not valid UTF-8 cannot be written as JSON (nor be a Python str).
    return absl::InvalidArgumentError(absl::StrCat("the template variables cannot be passed to jinja2: ", e.what()));
  }
  return RenderJsonText(text);
}

}  // namespace moe::text

// ChatTemplate in a build without libpython: every Compile answers kUnavailable, so a server
// refuses chat requests with the reason and serves everything else.
#include <string>

#include "moe/text/chat_template.h"
#include "python_runtime.h"

namespace moe::text {
namespace {

constexpr const char kNoPython[] =
    "this moeserve was built without an embedded Python, which chat templates need: install libpython3-dev and "
    "python3-jinja2, then configure and build again";

}  // namespace

namespace internal {

absl::Status ImportPythonModule(const std::string& module) { return absl::UnavailableError(kNoPython); }

}  // namespace internal

struct ChatTemplate::PythonTemplate {};

ChatTemplate::ChatTemplate(std::unique_ptr<PythonTemplate> compiled) : compiled_(std::move(compiled)) {}
ChatTemplate::~ChatTemplate() = default;

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::Compile(const std::string& source) {
  return absl::UnavailableError(kNoPython);
}

absl::StatusOr<std::string> ChatTemplate::RenderJsonText(std::string_view variables_json) const {
  return absl::UnavailableError(kNoPython);
}

void ChatTemplate::SetNowForTesting(std::optional<std::chrono::system_clock::time_point> now) {}

}  // namespace moe::text

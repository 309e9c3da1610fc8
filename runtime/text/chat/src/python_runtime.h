// The embedded CPython behind ChatTemplate, as far as code outside chat_template_python.cc needs
// it (the tests). Python.h stays out of this header.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace moe::text::internal {

// Starts the process's interpreter if no one has (once; never finalized) and imports `module`.
// kUnavailable when the interpreter cannot start or the import fails, with Python's own message
// and what to install ("... install python3-jinja2").
absl::Status ImportPythonModule(const std::string& module);

}  // namespace moe::text::internal

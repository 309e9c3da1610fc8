// JSON with errors that say where: a parse error names the file, line and column, and values are
// described in messages without dumping whatever a file holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace moe::core {

// 1-based line and column of byte `offset` of `text` (columns count bytes).
struct TextPosition {
  int64_t line = 1;
  int64_t column = 1;
};
TextPosition PositionOf(std::string_view text, size_t offset);

// Parses `text`. A syntax error is kInvalidArgument "<source>:<line>:<column>: invalid JSON: ...".
absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, std::string_view source);

// Parses `text` and requires an object at the top level ("<source>: expected a JSON object at
// the top level, found a list").
absl::StatusOr<nlohmann::json> ParseJsonObject(std::string_view text, std::string_view source);

// A value for a message: a scalar as JSON (cut to about 60 characters), otherwise its kind
// ("a list of 3 values", "an object"); never the whole of a large or deeply nested value.
std::string DescribeJson(const nlohmann::json& value);

}  // namespace moe::core

#include "moe/core/json.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moe::core {
namespace {

using Json = nlohmann::json;

constexpr size_t kMaxShown = 60;

std::string Cut(std::string s, size_t max) {
  if (s.size() > max) {
    s.resize(max);
    s += "...";
  }
  return s;
}

}  // namespace

TextPosition PositionOf(std::string_view text, size_t offset) {
  offset = std::min(offset, text.size());
  TextPosition p;
  size_t line_start = 0;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++p.line;
      line_start = i + 1;
    }
  }
  p.column = static_cast<int64_t>(offset - line_start) + 1;
  return p;
}

absl::StatusOr<Json> ParseJson(std::string_view text, std::string_view source) {
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::parse_error& e) {
    // e.byte counts the bytes read, the offending one included; the error is at e.byte - 1.
    const TextPosition at = PositionOf(text, e.byte > 0 ? e.byte - 1 : 0);
    // what() reads "[json.exception.parse_error.101] parse error at line 1, column 2: <detail>";
    // its position is replaced by ours, which names the file.
    const std::string what = e.what();
    const size_t colon = what.find(": ");
    const std::string detail = colon == std::string::npos ? what : what.substr(colon + 2);
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(source), ":", at.line, ":", at.column, ": invalid JSON: ", Cut(detail, 200)));
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(source), ": invalid JSON: ", Cut(e.what(), 200)));
  }
}

absl::StatusOr<Json> ParseJsonObject(std::string_view text, std::string_view source) {
  absl::StatusOr<Json> j = ParseJson(text, source);
  if (j.ok() && !j->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(source), ": expected a JSON object at the top level, found ", DescribeJson(*j)));
  }
  return j;
}

std::string DescribeJson(const Json& value) {
  const char* plural = value.size() == 1 ? "" : "s";
  if (value.is_array()) return absl::StrCat("a list of ", value.size(), " value", plural);
  if (value.is_object()) return absl::StrCat("an object of ", value.size(), " key", plural);
  if (value.is_null()) return "null";
  // A long string (a header can hold megabytes) is cut before it is escaped, not after.
  if (value.is_string() && value.get_ref<const std::string&>().size() > kMaxShown) {
    return Cut(Json(value.get_ref<const std::string&>().substr(0, kMaxShown + 1))
                   .dump(-1, ' ', false, Json::error_handler_t::replace),
               kMaxShown);
  }
  return Cut(value.dump(-1, ' ', false, Json::error_handler_t::replace), kMaxShown);
}

}  // namespace moe::core

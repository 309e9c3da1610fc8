#include "parameter_types.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"

namespace moe::text::internal {
namespace {

// The Abseil this builds against has its own string_view type, not std::string_view.
absl::string_view AbslView(std::string_view text) { return {text.data(), text.size()}; }

// The type a parameter schema names: "type" as a string, the first non-null one of a list, or
// the first typed alternative of anyOf / oneOf (how Pydantic writes Optional[int]).
std::string SchemaType(const nlohmann::json& schema) {
  if (!schema.is_object()) return "";
  if (auto it = schema.find("type"); it != schema.end()) {
    if (it->is_string()) return it->get<std::string>();
    if (it->is_array()) {
      for (const nlohmann::json& t : *it) {
        if (t.is_string() && t.get<std::string>() != "null") return t.get<std::string>();
      }
    }
  }
  for (const char* key : {"anyOf", "oneOf"}) {
    if (auto it = schema.find(key); it != schema.end() && it->is_array()) {
      for (const nlohmann::json& alternative : *it) {
        std::string type = SchemaType(alternative);
        if (!type.empty() && type != "null") return type;
      }
    }
  }
  if (schema.contains("enum")) return "string";
  return "";
}

}  // namespace

ParameterTypes::ParameterTypes(const nlohmann::json& tools) {
  if (!tools.is_array()) return;
  for (const nlohmann::json& tool : tools) {
    if (!tool.is_object()) continue;
    auto function = tool.find("function");
    if (function == tool.end() || !function->is_object()) continue;
    auto name = function->find("name");
    auto parameters = function->find("parameters");
    if (name == function->end() || !name->is_string() || parameters == function->end() || !parameters->is_object()) {
      continue;
    }
    auto properties = parameters->find("properties");
    if (properties == parameters->end() || !properties->is_object()) continue;
    auto& types = types_[name->get<std::string>()];
    for (const auto& [param, schema] : properties->items()) {
      types[param] = SchemaType(schema);
    }
  }
}

std::string ParameterTypes::TypeOf(std::string_view function, std::string_view param) const {
  auto f = types_.find(std::string(function));
  if (f == types_.end()) return "";
  auto p = f->second.find(std::string(param));
  return p == f->second.end() ? "" : p->second;
}

nlohmann::ordered_json ParameterTypes::Convert(std::string_view text, std::string_view type, bool untyped_as_json) {
  const std::string as_string(text);
  if (type == "string") return as_string;
  if (type.empty() && !untyped_as_json) return as_string;
  const absl::string_view trimmed = absl::StripAsciiWhitespace(AbslView(text));
  if (!type.empty() && absl::AsciiStrToLower(trimmed) == "null") return nullptr;
  if (type == "integer") {
    int64_t value = 0;
    if (absl::SimpleAtoi(trimmed, &value)) return value;
    return as_string;
  }
  if (type == "number") {
    int64_t integer = 0;
    if (absl::SimpleAtoi(trimmed, &integer)) return integer;
    double value = 0;
    if (absl::SimpleAtod(trimmed, &value) && std::isfinite(value)) return value;
    return as_string;
  }
  if (type == "boolean") {
    const std::string lower = absl::AsciiStrToLower(trimmed);
    if (lower == "true") return true;
    if (lower == "false") return false;
    return as_string;
  }
  // object, array, an unknown type name, or untyped: JSON when it is JSON.
  nlohmann::ordered_json value =
      nlohmann::ordered_json::parse(std::string_view(trimmed.data(), trimmed.size()), nullptr,
                                    /*allow_exceptions=*/false);
  if (value.is_discarded()) return as_string;
  return value;
}

std::string DumpJson(const nlohmann::ordered_json& value) {
  return value.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

}  // namespace moe::text::internal

// The tool-call formats: each says how its calls are marked and how a call's body reads.
#include "moe/text/tool_call_parser.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "marked_tool_call_parser.h"
#include "parameter_types.h"
#include "text_util.h"

namespace moe::text {
namespace {

using internal::BodyEnd;
using internal::CallMarkers;
using internal::DumpJson;
using internal::ParsedCall;
using internal::TrimSpace;
using OrderedJson = nlohmann::ordered_json;

// Arguments as models write them: an object, a string holding an object (some fine-tunes
// double-encode), or absent for a call without parameters. Anything else is malformed.
std::optional<std::string> ArgumentsText(const OrderedJson& call) {
  auto it = call.find("arguments");
  if (it == call.end()) it = call.find("parameters");
  if (it == call.end() || it->is_null()) return "{}";
  if (it->is_object()) return DumpJson(*it);
  if (it->is_string()) {
    OrderedJson inner = OrderedJson::parse(it->get<std::string>(), nullptr, false);
    if (!inner.is_discarded() && inner.is_object()) return DumpJson(inner);
  }
  return std::nullopt;
}

// {"name": ..., "arguments": ...} as one call.
std::optional<ParsedCall> JsonCall(const OrderedJson& call) {
  if (!call.is_object()) return std::nullopt;
  auto name = call.find("name");
  if (name == call.end() || !name->is_string() || name->get<std::string>().empty()) {
    return std::nullopt;
  }
  std::optional<std::string> arguments = ArgumentsText(call);
  if (!arguments.has_value()) return std::nullopt;
  return ParsedCall{name->get<std::string>(), *std::move(arguments)};
}

// A function name as the tag formats carry it: one token of text, no markup.
bool IsPlausibleName(std::string_view name) {
  return !name.empty() && std::none_of(name.begin(), name.end(),
                                       [](char c) { return c == '<' || c == '>' || internal::IsJsonSpace(c); });
}

// Qwen2.5 / Qwen3: <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
class HermesParser final : public internal::MarkedToolCallParser {
 public:
  HermesParser() : MarkedToolCallParser({"", "", "<tool_call>", "</tool_call>"}) {}

 protected:
  std::optional<std::vector<ParsedCall>> ParseBody(std::string_view body) const override {
    OrderedJson call = OrderedJson::parse(TrimSpace(body), nullptr, false);
    std::optional<ParsedCall> parsed = JsonCall(call);
    if (!parsed.has_value()) return std::nullopt;
    return std::vector<ParsedCall>{*std::move(parsed)};
  }
};

// Qwen3-Coder:
// <tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>
// Values are plain text, typed by the tool schema. Like vLLM's parser this accepts a parameter
// or function the model forgot to close, since the next tag makes the intent plain.
class Qwen3CoderParser final : public internal::MarkedToolCallParser {
 public:
  explicit Qwen3CoderParser(const nlohmann::json& tools)
      : MarkedToolCallParser({"", "", "<tool_call>", "</tool_call>"}), types_(tools) {}

 protected:
  std::optional<std::vector<ParsedCall>> ParseBody(std::string_view body) const override {
    constexpr std::string_view kFunction = "<function=";
    constexpr std::string_view kParameter = "<parameter=";
    constexpr std::string_view kParameterEnd = "</parameter>";
    constexpr std::string_view kFunctionEnd = "</function>";
    const size_t function = body.find(kFunction);
    if (function == std::string_view::npos) return std::nullopt;
    const size_t name_begin = function + kFunction.size();
    const size_t name_end = body.find('>', name_begin);
    if (name_end == std::string_view::npos) return std::nullopt;
    ParsedCall call;
    call.name = std::string(TrimSpace(body.substr(name_begin, name_end - name_begin)));
    if (!IsPlausibleName(call.name)) return std::nullopt;

    std::string_view rest = body.substr(name_end + 1);
    if (const size_t end = rest.find(kFunctionEnd); end != std::string_view::npos) {
      if (!TrimSpace(rest.substr(end + kFunctionEnd.size())).empty()) return std::nullopt;
      rest = rest.substr(0, end);
    }
    OrderedJson arguments = OrderedJson::object();
    size_t pos = 0;
    while ((pos = rest.find(kParameter, pos)) != std::string_view::npos) {
      const size_t param_begin = pos + kParameter.size();
      const size_t param_end = rest.find('>', param_begin);
      if (param_end == std::string_view::npos) return std::nullopt;
      const std::string param(TrimSpace(rest.substr(param_begin, param_end - param_begin)));
      if (param.empty()) return std::nullopt;
      const size_t value_begin = param_end + 1;
      size_t value_end = rest.find(kParameterEnd, value_begin);
      size_t next = value_end + kParameterEnd.size();
      if (value_end == std::string_view::npos) {
        value_end = std::min(rest.find(kParameter, value_begin), rest.size());
        next = value_end;
      }
      arguments[param] =
          internal::ParameterTypes::Convert(StripOneNewline(rest.substr(value_begin, value_end - value_begin)),
                                            types_.TypeOf(call.name, param), /*untyped_as_json=*/false);
      pos = next;
    }
    call.arguments = DumpJson(arguments);
    return std::vector<ParsedCall>{std::move(call)};
  }

 private:
  // The template puts each value on lines of its own; those two newlines are not the value.
  static std::string_view StripOneNewline(std::string_view value) {
    if (!value.empty() && value.front() == '\n') value.remove_prefix(1);
    if (!value.empty() && value.back() == '\n') value.remove_suffix(1);
    return value;
  }

  internal::ParameterTypes types_;
};

// GLM-4.5: <tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>
class Glm45Parser final : public internal::MarkedToolCallParser {
 public:
  explicit Glm45Parser(const nlohmann::json& tools)
      : MarkedToolCallParser({"", "", "<tool_call>", "</tool_call>"}), types_(tools) {}

 protected:
  std::optional<std::vector<ParsedCall>> ParseBody(std::string_view body) const override {
    constexpr std::string_view kKey = "<arg_key>";
    constexpr std::string_view kKeyEnd = "</arg_key>";
    constexpr std::string_view kValue = "<arg_value>";
    constexpr std::string_view kValueEnd = "</arg_value>";
    const size_t first_key = std::min(body.find(kKey), body.size());
    ParsedCall call;
    call.name = std::string(TrimSpace(body.substr(0, first_key)));
    if (!IsPlausibleName(call.name)) return std::nullopt;

    OrderedJson arguments = OrderedJson::object();
    size_t pos = first_key;
    while (pos < body.size()) {
      if (body.substr(pos, kKey.size()) != kKey) return std::nullopt;
      const size_t key_begin = pos + kKey.size();
      const size_t key_end = body.find(kKeyEnd, key_begin);
      if (key_end == std::string_view::npos) return std::nullopt;
      const std::string key(TrimSpace(body.substr(key_begin, key_end - key_begin)));
      const size_t value_tag = SkipSpace(body, key_end + kKeyEnd.size());
      if (key.empty() || body.substr(value_tag, kValue.size()) != kValue) return std::nullopt;
      const size_t value_begin = value_tag + kValue.size();
      const size_t value_end = body.find(kValueEnd, value_begin);
      if (value_end == std::string_view::npos) return std::nullopt;
      // Untyped values are JSON when they parse as JSON, as GLM writes numbers and lists bare.
      arguments[key] = internal::ParameterTypes::Convert(body.substr(value_begin, value_end - value_begin),
                                                         types_.TypeOf(call.name, key),
                                                         /*untyped_as_json=*/true);
      pos = SkipSpace(body, value_end + kValueEnd.size());
    }
    call.arguments = DumpJson(arguments);
    return std::vector<ParsedCall>{std::move(call)};
  }

 private:
  static size_t SkipSpace(std::string_view text, size_t pos) {
    while (pos < text.size() && internal::IsJsonSpace(text[pos])) ++pos;
    return pos;
  }

  internal::ParameterTypes types_;
};

// DeepSeek-V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}
// <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
class DeepSeekV31Parser final : public internal::MarkedToolCallParser {
 public:
  DeepSeekV31Parser()
      : MarkedToolCallParser(
            {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"}) {}

 protected:
  std::optional<std::vector<ParsedCall>> ParseBody(std::string_view body) const override {
    constexpr std::string_view kSeparator = "<｜tool▁sep｜>";
    const size_t sep = body.find(kSeparator);
    if (sep == std::string_view::npos) return std::nullopt;
    ParsedCall call;
    call.name = std::string(TrimSpace(body.substr(0, sep)));
    if (!IsPlausibleName(call.name)) return std::nullopt;
    OrderedJson arguments = OrderedJson::parse(TrimSpace(body.substr(sep + kSeparator.size())), nullptr, false);
    if (arguments.is_discarded() || !arguments.is_object()) return std::nullopt;
    call.arguments = DumpJson(arguments);
    return std::vector<ParsedCall>{std::move(call)};
  }
};

// Mistral / Mixtral: [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]. No end marker: the
// JSON value ends the calls, so the body end is found by scanning brackets outside strings.
class MistralParser final : public internal::MarkedToolCallParser {
 public:
  // Mistral chat templates reject tool call ids that are not 9 letters and digits.
  MistralParser() : MarkedToolCallParser({"", "", "[TOOL_CALLS]", ""}, "", 9) {}

 protected:
  void ResetBodyScan() override { scan_ = {}; }

  BodyEnd FindBodyEnd(std::string_view text) override {
    for (; scan_.pos < text.size(); ++scan_.pos) {
      const char c = text[scan_.pos];
      if (!scan_.started) {
        if (internal::IsJsonSpace(c)) continue;
        // Not a JSON list or object: the marker was text, not calls.
        if (c != '[' && c != '{') return {BodyEnd::Kind::kMalformed, 0, 0};
        scan_.started = true;
      }
      if (scan_.in_string) {
        if (scan_.escaped) {
          scan_.escaped = false;
        } else if (c == '\\') {
          scan_.escaped = true;
        } else if (c == '"') {
          scan_.in_string = false;
        }
        continue;
      }
      if (c == '"') {
        scan_.in_string = true;
      } else if (c == '[' || c == '{') {
        ++scan_.depth;
      } else if (c == ']' || c == '}') {
        if (--scan_.depth == 0) {
          const size_t end = scan_.pos + 1;
          return {BodyEnd::Kind::kComplete, end, end};
        }
      }
    }
    return {};
  }

  std::optional<std::vector<ParsedCall>> ParseBody(std::string_view body) const override {
    OrderedJson value = OrderedJson::parse(TrimSpace(body), nullptr, false);
    if (value.is_discarded()) return std::nullopt;
    if (value.is_object()) value = OrderedJson::array({std::move(value)});
    std::vector<ParsedCall> calls;
    for (const OrderedJson& item : value) {
      std::optional<ParsedCall> call = JsonCall(item);
      if (!call.has_value()) return std::nullopt;
      calls.push_back(*std::move(call));
    }
    return calls;
  }

 private:
  struct Scan {
    size_t pos = 0;
    int depth = 0;
    bool started = false;
    bool in_string = false;
    bool escaped = false;
  };
  Scan scan_;
};

}  // namespace

std::vector<std::string> ToolCallParserNames() { return {"deepseek_v31", "glm45", "hermes", "mistral", "qwen3_coder"}; }

absl::StatusOr<std::unique_ptr<ToolCallParser>> MakeToolCallParser(const std::string& name,
                                                                   const nlohmann::json& tools) {
  if (!tools.is_null() && !tools.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tools: expected a list of tools, found ", tools.is_object() ? "an object" : tools.type_name()));
  }
  if (name == "hermes") return std::make_unique<HermesParser>();
  if (name == "qwen3_coder") return std::make_unique<Qwen3CoderParser>(tools);
  if (name == "glm45") return std::make_unique<Glm45Parser>(tools);
  if (name == "deepseek_v31") return std::make_unique<DeepSeekV31Parser>();
  if (name == "mistral") return std::make_unique<MistralParser>();
  return absl::InvalidArgumentError(absl::StrCat("unknown tool-call parser \"", name,
                                                 "\"; known parsers: ", absl::StrJoin(ToolCallParserNames(), ", ")));
}

std::string DefaultToolCallParser(const std::string& model_type) {
  if (model_type == "qwen3_moe" || model_type == "qwen2_moe") return "hermes";
  if (model_type == "glm4_moe") return "glm45";
  if (model_type == "deepseek_v3") return "deepseek_v31";
  if (model_type == "mixtral") return "mistral";
  return "";
}

}  // namespace moe::text

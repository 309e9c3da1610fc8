#include "openai_api.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moe/core/json.h"
#include "moe/scheduler/http_server.h"
#include "moe/scheduler/structured_output.h"

namespace moe::scheduler::internal {
namespace {

using nlohmann::json;

constexpr int kMaxLogprobs = 20;
constexpr auto kPollInterval = std::chrono::milliseconds(20);
// A stream that has sent nothing for this long gets an SSE comment, so that a client gone while
// its request waits in the queue is noticed (the write fails) and the request cancelled.
constexpr auto kKeepAliveInterval = std::chrono::seconds(1);

// A refused request, as OpenAI's error JSON says it.
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // the request field at fault; "" for none
  std::string type = "invalid_request_error";
};

ApiError BadParam(std::string param, std::string message) {
  return ApiError{400, std::move(message), std::move(param)};
}

void SetError(httplib::Response& response, const ApiError& error) {
  SetJsonError(response, error.status, error.message, error.type, error.param);
}

// The scheduler names gRPC's fields; an HTTP client knows OpenAI's.
ApiError FromEngineStatus(const absl::Status& status, bool chat) {
  const std::string message(status.message());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument: {
      static const std::pair<const char*, const char*> kFields[] = {
          {"token_ids", "prompt"},
          {"max_new_tokens", "max_tokens"},
          {"min_new_tokens", "min_tokens"},
          {"logprobs", "logprobs"},
          {"sampling.temperature", "temperature"},
          {"sampling.top_p", "top_p"},
          {"sampling.top_k", "top_k"},
          {"sampling.min_p", "min_p"},
          {"sampling.repetition_penalty", "repetition_penalty"},
          {"sampling.presence_penalty", "presence_penalty"},
          {"sampling.frequency_penalty", "frequency_penalty"},
          {"stop_token_ids", "stop_token_ids"},
          {"stop", "stop"}};
      for (const auto& [prefix, field] : kFields) {
        if (!absl::StartsWith(message, prefix)) continue;
        std::string param = field;
        if (param == "prompt" && chat) param = "messages";
        return BadParam(param, absl::StrCat(param, message.substr(std::string_view(prefix).size())));
      }
      return BadParam("", message);
    }
    case absl::StatusCode::kResourceExhausted:
      // A request that could never fit the KV cache is the client's to shrink, not to retry.
      if (absl::StartsWith(message, "request needs")) return BadParam("max_tokens", message);
      return ApiError{429, message, "", "rate_limit_error"};
    case absl::StatusCode::kUnavailable:
      return ApiError{503, message, "", "server_error"};
    case absl::StatusCode::kFailedPrecondition:
      return ApiError{400, message, chat ? "messages" : "", "invalid_request_error"};
    case absl::StatusCode::kDeadlineExceeded:
      return ApiError{504, message, "", "server_error"};
    default:
      return ApiError{500, message, "", "server_error"};
  }
}

// The offset of the first byte of `text` that is not part of well-formed UTF-8 (RFC 3629: no
// overlong forms, surrogates or code points past U+10FFFF), or npos.
size_t FirstInvalidUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t n = 0;
    unsigned char lo = 0x80, hi = 0xbf;  // the range of the second byte
    if (c >= 0xc2 && c <= 0xdf) {
      n = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      n = 2;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      n = 3;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    } else {
      return i;
    }
    if (i + n >= text.size()) return i;
    for (size_t k = 1; k <= n; ++k) {
      const auto b = static_cast<unsigned char>(text[i + k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xbf)) return i;
    }
    i += n + 1;
  }
  return std::string_view::npos;
}

// The JSON path ("messages[0].content") of the string that holds byte `offset` of `body`: a SAX
// parse of what comes before that string, keeping the path of containers and keys.
class PathTracker : public nlohmann::json_sax<json> {
 public:
  bool null() override { return Value(); }
  bool boolean(bool) override { return Value(); }
  bool number_integer(number_integer_t) override { return Value(); }
  bool number_unsigned(number_unsigned_t) override { return Value(); }
  bool number_float(number_float_t, const string_t&) override { return Value(); }
  bool string(string_t&) override { return Value(); }
  bool binary(binary_t&) override { return Value(); }
  bool start_object(std::size_t) override {
    stack_.push_back({true, "", -1});
    return true;
  }
  bool key(string_t& k) override {
    stack_.back().key = k;
    return true;
  }
  bool end_object() override { return End(); }
  bool start_array(std::size_t) override {
    stack_.push_back({false, "", -1});
    return true;
  }
  bool end_array() override { return End(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

  // The path of the next value (or key) after what was parsed.
  std::string Path(bool next_is_key) const {
    std::string path;
    for (size_t i = 0; i < stack_.size(); ++i) {
      const Level& l = stack_[i];
      const bool last = i + 1 == stack_.size();
      if (l.object) {
        if (last && next_is_key) break;
        absl::StrAppend(&path, path.empty() ? "" : ".", l.key);
      } else {
        absl::StrAppend(&path, "[", l.index + 1, "]");  // the element being read
      }
    }
    return path;
  }
  bool InObject() const { return !stack_.empty() && stack_.back().object; }

 private:
  struct Level {
    bool object;
    std::string key;
    int64_t index;  // arrays: the last element read
  };
  bool Value() {
    if (!stack_.empty() && !stack_.back().object) ++stack_.back().index;
    return true;
  }
  bool End() {
    stack_.pop_back();
    return Value();
  }
  std::vector<Level> stack_;
};

// "messages[0].content" for the string of `body` holding invalid UTF-8, and the top-level field.
std::pair<std::string, std::string> FieldAt(std::string_view body, size_t offset) {
  // Where the string holding `offset` starts: the last opening quote before it.
  size_t start = std::string_view::npos;
  bool in_string = false;
  for (size_t i = 0; i < offset && i < body.size(); ++i) {
    if (in_string && body[i] == '\\') {
      ++i;
    } else if (body[i] == '"') {
      in_string = !in_string;
      if (in_string) start = i;
    }
  }
  if (!in_string || start == std::string_view::npos) return {"", ""};
  PathTracker tracker;
  const std::string prefix(body.substr(0, start));
  (void)json::sax_parse(prefix, &tracker, json::input_format_t::json, /*strict=*/false);
  // In an object the string is a key when the last key's value was read (or none was given yet).
  const size_t last = prefix.find_last_not_of(" \t\r\n");
  const bool is_key = last != std::string::npos && (prefix[last] == '{' || prefix[last] == ',') && tracker.InObject();
  std::string path = tracker.Path(is_key);
  if (is_key) path = path.empty() ? "a key" : absl::StrCat("a key of ", path);
  const std::string top = path.substr(0, path.find_first_of(".[ "));
  return {path, is_key ? "" : top};
}

// A field that is present and not null, or null.
const json* Field(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::optional<ApiError> ReadFloat(const json& body, const char* name, float* out) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number()) {
    return BadParam(name, absl::StrCat(name, ": expected a number, found ", core::DescribeJson(*v)));
  }
  *out = v->get<float>();
  return std::nullopt;
}

std::optional<ApiError> ReadInt(const json& body, const char* name, int64_t lo, int64_t hi, int64_t* out) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::nullopt;
  const bool integral = v->is_number_integer() || (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>());
  if (!integral || v->get<double>() < static_cast<double>(lo) || v->get<double>() > static_cast<double>(hi)) {
    return BadParam(name, absl::StrCat(name, ": expected an integer in [", lo, ", ", hi, "], found ",
                                       core::DescribeJson(*v)));
  }
  *out = v->is_number_unsigned() ? static_cast<int64_t>(v->get<uint64_t>()) : v->get<int64_t>();
  return std::nullopt;
}

std::optional<ApiError> ReadBool(const json& body, const char* name, bool* out) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean()) return BadParam(name, absl::StrCat(name, ": expected true or false, found ", core::DescribeJson(*v)));
  *out = v->get<bool>();
  return std::nullopt;
}

// What a request asks for, beyond the engine's Request.
struct Parsed {
  Request request;
  OutputTextOptions text;
  bool stream = false;
  bool include_usage = false;
  int logprobs = -1;  // alternatives per token; -1: no logprobs
  bool return_token_ids = false;
  std::optional<int64_t> max_tokens;
  // tool_choice enforced by a grammar: "required", or the named function; the output is JSON that
  // becomes the response's tool calls.
  std::string enforced_tools;
  std::string enforced_function;
};

#define MOE_API_TRY(expr)                              \
  if (std::optional<ApiError> e_ = (expr); e_) return *e_

// `speculative`: "off", or {"n_max": N} (N in 0..16; 0 is off) to limit this request's drafts.
std::optional<ApiError> ReadSpeculative(const json& body, Request* request) {
  const json* spec = Field(body, "speculative");
  if (spec == nullptr) return std::nullopt;
  const char* kShape = "speculative: expected \"off\" or {\"n_max\": N} with N in 0..16";
  if (spec->is_string()) {
    if (spec->get<std::string>() != "off") return BadParam("speculative", kShape);
    request->max_draft = 0;
    return std::nullopt;
  }
  if (!spec->is_object()) return BadParam("speculative", kShape);
  for (const auto& [key, value] : spec->items()) {
    if (key != "n_max") return BadParam("speculative", absl::StrCat("speculative.", key, ": unknown; ", kShape));
  }
  if (const json* n = Field(*spec, "n_max")) {
    if (!n->is_number_integer() || n->get<int64_t>() < 0 || n->get<int64_t>() > runtime::kMaxDraftTokens) {
      return BadParam("speculative", absl::StrCat("speculative.n_max: ", n->dump(), " is not an integer in 0..",
                                                  runtime::kMaxDraftTokens));
    }
    request->max_draft = n->get<int>();
  }
  return std::nullopt;
}

// Fields other servers take that would change the output here if they were honoured: refused
// while they carry a value, never ignored.
std::optional<ApiError> RefuseUnsupported(const json& body) {
  static const std::pair<const char*, const char*> kRefused[] = {
      {"logit_bias", "logit_bias: not supported yet (no biased sampling)"},
      {"prompt_logprobs", "prompt_logprobs: not supported (log-probabilities come for generated tokens only)"},
      {"continue_final_message", "continue_final_message: not supported yet"},
      {"functions", "functions: not supported; use tools"},
      {"function_call", "function_call: not supported; use tool_choice"},
      {"guided_json", "guided_json: no constrained decoding yet"},
      {"guided_regex", "guided_regex: no constrained decoding yet"},
      {"guided_choice", "guided_choice: no constrained decoding yet"},
      {"guided_grammar", "guided_grammar: no constrained decoding yet"},
      {"structured_outputs", "structured_outputs: no constrained decoding yet"},
  };
  for (const auto& [name, message] : kRefused) {
    const json* v = Field(body, name);
    if (v == nullptr || *v == false || (v->is_object() && v->empty()) || (v->is_array() && v->empty())) continue;
    return BadParam(name, message);
  }
  return std::nullopt;
}

// The fields completions and chat share.
// The grammar of a structured output, or the 400 saying why there is none.
std::optional<ApiError> UseGrammar(const char* param, absl::StatusOr<std::shared_ptr<const TokenGrammar>> grammar,
                                   Parsed* p) {
  if (!grammar.ok()) return BadParam(param, std::string(grammar.status().message()));
  p->request.grammar = *std::move(grammar);
  return std::nullopt;
}

std::optional<ApiError> ParseResponseFormat(const json& format, StructuredOutputs* structured, Parsed* p) {
  absl::StatusOr<std::shared_ptr<const TokenGrammar>> grammar = GrammarForResponseFormat(format, structured);
  if (grammar.ok() && *grammar == nullptr) return std::nullopt;  // {"type": "text"}
  return UseGrammar("response_format", std::move(grammar), p);
}

std::optional<ApiError> ParseCommon(const json& body, const std::string& model_id, StructuredOutputs* structured,
                                    Parsed* p) {
  if (const json* model = Field(body, "model")) {
    if (!model->is_string()) return BadParam("model", "model: expected a string");
    if (model->get<std::string>() != model_id) {
      // 404, as OpenAI and vLLM answer it: the resource named does not exist here.
      return ApiError{404,
                      absl::StrCat("The model '", model->get<std::string>(), "' does not exist; this server serves '",
                                   model_id, "'"),
                      "model", "NotFoundError"};
    }
  }
  int64_t n = 1;
  MOE_API_TRY(ReadInt(body, "n", 1, 1 << 20, &n));
  if (n != 1) return BadParam("n", absl::StrCat("n: only 1 choice per request is supported, got ", n));
  if (const json* best_of = Field(body, "best_of"); best_of != nullptr && *best_of != 1) {
    return BadParam("best_of", "best_of: only 1 is supported");
  }
  if (const json* format = Field(body, "response_format")) {
    if (auto e = ParseResponseFormat(*format, structured, p)) return e;
  }
  MOE_API_TRY(RefuseUnsupported(body));
  MOE_API_TRY(ReadBool(body, "stream", &p->stream));
  if (const json* options = Field(body, "stream_options")) {
    if (!options->is_object()) return BadParam("stream_options", "stream_options: expected an object");
    if (!p->stream) return BadParam("stream_options", "stream_options: only allowed when stream is true");
    MOE_API_TRY(ReadBool(*options, "include_usage", &p->include_usage));
    bool continuous = false;
    MOE_API_TRY(ReadBool(*options, "continuous_usage_stats", &continuous));
    if (continuous) {
      return BadParam("stream_options",
                      "stream_options.continuous_usage_stats: not supported (usage comes in the "
                      "last chunk with include_usage)");
    }
  }
  if (const json* stop = Field(body, "stop")) {
    if (stop->is_string()) {
      p->text.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& s : *stop) {
        if (!s.is_string()) return BadParam("stop", "stop: expected a string or a list of strings");
        p->text.stop.push_back(s.get<std::string>());
      }
    } else {
      return BadParam("stop", "stop: expected a string or a list of strings");
    }
    // Their count and sizes: TextModel::NewOutput, for both APIs alike.
  }
  int64_t max_tokens = 0;
  if (Field(body, "max_completion_tokens") != nullptr) {
    MOE_API_TRY(ReadInt(body, "max_completion_tokens", 1, INT32_MAX, &max_tokens));
    p->max_tokens = max_tokens;
  } else if (Field(body, "max_tokens") != nullptr) {
    MOE_API_TRY(ReadInt(body, "max_tokens", 1, INT32_MAX, &max_tokens));
    p->max_tokens = max_tokens;
  }
  runtime::SamplingParams& s = p->request.sampling;
  s.temperature = 1.0f;  // OpenAI's default
  MOE_API_TRY(ReadFloat(body, "temperature", &s.temperature));
  MOE_API_TRY(ReadFloat(body, "top_p", &s.top_p));
  MOE_API_TRY(ReadFloat(body, "min_p", &s.min_p));
  MOE_API_TRY(ReadFloat(body, "presence_penalty", &s.presence_penalty));
  MOE_API_TRY(ReadFloat(body, "frequency_penalty", &s.frequency_penalty));
  MOE_API_TRY(ReadFloat(body, "repetition_penalty", &s.repetition_penalty));
  int64_t top_k = 0;
  MOE_API_TRY(ReadInt(body, "top_k", -1, INT32_MAX, &top_k));
  s.top_k = top_k < 0 ? 0 : static_cast<int>(top_k);  // -1 is vLLM's "off"
  if (Field(body, "seed") != nullptr) {
    int64_t seed = 0;
    MOE_API_TRY(ReadInt(body, "seed", INT64_MIN, INT64_MAX, &seed));
    s.seed = static_cast<uint64_t>(seed);
  }
  int64_t min_tokens = 0;
  MOE_API_TRY(ReadInt(body, "min_tokens", 0, INT32_MAX, &min_tokens));
  p->request.stopping.min_new_tokens = static_cast<int>(min_tokens);
  MOE_API_TRY(ReadBool(body, "ignore_eos", &p->request.stopping.ignore_eos));
  if (const json* ids = Field(body, "stop_token_ids")) {
    if (!ids->is_array()) return BadParam("stop_token_ids", "stop_token_ids: expected a list of token ids");
    for (const json& id : *ids) {
      if (!id.is_number_integer()) return BadParam("stop_token_ids", "stop_token_ids: expected a list of token ids");
      p->request.stopping.stop_token_ids.push_back(id.get<int32_t>());
    }
  }
  MOE_API_TRY(ReadBool(body, "include_stop_str_in_output", &p->text.include_stop_str_in_output));
  MOE_API_TRY(ReadBool(body, "skip_special_tokens", &p->text.skip_special_tokens));
  MOE_API_TRY(ReadBool(body, "return_token_ids", &p->return_token_ids));
  MOE_API_TRY(ReadSpeculative(body, &p->request));
  return std::nullopt;
}

std::optional<ApiError> ParseCompletion(const json& body, const TextModel& text, Parsed* p) {
  if (const json* echo = Field(body, "echo"); echo != nullptr && *echo != false) {
    return BadParam("echo", "echo: not supported");
  }
  if (Field(body, "suffix") != nullptr) return BadParam("suffix", "suffix: not supported");
  int64_t logprobs = -1;
  MOE_API_TRY(ReadInt(body, "logprobs", 0, kMaxLogprobs, &logprobs));
  p->logprobs = static_cast<int>(logprobs);
  const json* prompt = Field(body, "prompt");
  if (prompt == nullptr) return BadParam("prompt", "prompt: required");
  // One prompt per request: a list of one string or of one id list is that prompt.
  if (prompt->is_array() && prompt->size() == 1 && ((*prompt)[0].is_string() || (*prompt)[0].is_array())) {
    prompt = &(*prompt)[0];
  }
  if (prompt->is_string()) {
    auto ids = text.EncodeText(prompt->get<std::string>());
    if (!ids.ok()) return BadParam("prompt", absl::StrCat("prompt: ", ids.status().message()));
    p->request.prompt = *std::move(ids);
  } else if (prompt->is_array() && std::all_of(prompt->begin(), prompt->end(), [](const json& v) { return v.is_number_integer(); })) {
    for (const json& id : *prompt) {
      const int64_t v = id.get<int64_t>();
      if (v < INT32_MIN || v > INT32_MAX) return BadParam("prompt", absl::StrCat("prompt: token id ", v, " is out of range"));
      p->request.prompt.push_back(static_cast<int32_t>(v));
    }
  } else if (prompt->is_array() && !prompt->empty() && ((*prompt)[0].is_string() || (*prompt)[0].is_array())) {
    return BadParam("prompt", absl::StrCat("prompt: only one prompt per request is supported, got ", prompt->size()));
  } else {
    return BadParam("prompt", "prompt: expected a string, a list of token ids, or a list of one of them");
  }
  if (!p->max_tokens) p->max_tokens = 16;  // OpenAI's default for completions
  return std::nullopt;
}

}  // namespace

json EnforcedToolCalls(const std::string& enforced, const std::string& function, const std::string& id_prefix,
                       const std::string& text) {
  const json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return json();
  json calls = json::array();
  auto add = [&](const std::string& name, const json& arguments) {
    calls.push_back({{"id", absl::StrCat(id_prefix, calls.size())},
                     {"type", "function"},
                     {"function", {{"name", name}, {"arguments", arguments.dump()}}}});
  };
  if (enforced == "named") {
    add(function, parsed);
  } else {
    if (!parsed.is_array()) return json();
    for (const json& call : parsed) add(call.value("name", ""), call.value("parameters", json::object()));
  }
  return calls;
}

absl::StatusOr<ToolChoice> ResolveToolChoice(const json* tools, const json* tool_choice, bool constrained,
                                             StructuredOutputs* structured) {
  if (tools != nullptr) {
    if (!tools->is_array()) return absl::InvalidArgumentError("tools: expected a list of tools");
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      if (!t.is_object() || t.value("type", "function") != "function" || !t.contains("function") ||
          !t["function"].is_object() || !t["function"].contains("name") || !t["function"]["name"].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat("tools[", i,
                                              "]: expected {\"type\": \"function\", \"function\": {\"name\": ...}}"));
      }
    }
  }
  const bool has_tools = tools != nullptr && !tools->empty();
  std::string choice = has_tools ? "auto" : "none";
  json selected = has_tools ? *tools : json();
  if (tool_choice != nullptr) {
    if (tool_choice->is_string()) {
      choice = tool_choice->get<std::string>();
      if (choice != "auto" && choice != "none" && choice != "required") {
        return absl::InvalidArgumentError("tool_choice: expected auto, none, required or a named function");
      }
    } else if (tool_choice->is_object() && tool_choice->value("type", "") == "function" &&
               tool_choice->contains("function") && (*tool_choice)["function"].is_object() &&
               (*tool_choice)["function"].contains("name") && (*tool_choice)["function"]["name"].is_string()) {
      const std::string name = (*tool_choice)["function"]["name"];
      choice = "named";
      selected = json::array();
      if (has_tools) {
        for (const json& t : *tools) {
          if (t["function"]["name"] == name) selected.push_back(t);
        }
      }
      if (selected.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("tool_choice: the function '", name, "' is not in tools"));
      }
    } else {
      return absl::InvalidArgumentError("tool_choice: expected auto, none, required or a named function");
    }
    if (choice != "none" && !has_tools) {
      return absl::InvalidArgumentError(absl::StrCat("tool_choice: '", choice == "named" ? "a named function" : choice,
                                                  "' needs tools"));
    }
  }
  ToolChoice result;
  if (choice != "none") {
    result.tools = selected;
    result.parse_tool_calls = true;
  }
  // "required" and a named function are enforced by a grammar: a list of calls to the tools, or
  // the named function's arguments; the output becomes the response's tool calls.
  if (choice == "required" || choice == "named") {
    if (constrained) {
      return absl::InvalidArgumentError(absl::StrCat("tool_choice: '", choice == "named" ? "a named function" : choice,
                                                  "' cannot go with a response_format that constrains the output"));
    }
    if (structured == nullptr) {
      return absl::InvalidArgumentError("tool_choice: enforcing a tool call needs the model's tokenizer (tokenizer.json)");
    }
    if (choice == "required") {
      auto grammar = structured->ForToolCalls(selected);
      if (!grammar.ok()) return absl::InvalidArgumentError(grammar.status().message());
      result.grammar = *std::move(grammar);
      result.enforced = "required";
    } else {
      const json& function = selected[0]["function"];
      auto grammar = structured->ForJsonSchema(function.value("parameters", json::object()),
                                               "tools[].function.parameters");
      if (!grammar.ok()) return absl::InvalidArgumentError(grammar.status().message());
      result.grammar = *std::move(grammar);
      result.enforced = "named";
      result.function = function["name"];
    }
    result.parse_tool_calls = false;
  }
  return result;
}

namespace {

std::optional<ApiError> ParseTools(const json& body, StructuredOutputs* structured, Parsed* p, ChatPrompt* chat,
                                   bool* parse_tools) {
  absl::StatusOr<ToolChoice> choice =
      ResolveToolChoice(Field(body, "tools"), Field(body, "tool_choice"), p->request.grammar != nullptr, structured);
  if (!choice.ok()) {
    const std::string message(choice.status().message());
    return BadParam(absl::StartsWith(message, "tool_choice") ? "tool_choice" : "tools", message);
  }
  if (!choice->tools.is_null()) {
    chat->tools = choice->tools;
    p->text.tools = choice->tools;
  }
  *parse_tools = choice->parse_tool_calls;
  if (choice->grammar != nullptr) p->request.grammar = choice->grammar;
  p->enforced_tools = choice->enforced;
  p->enforced_function = choice->function;
  return std::nullopt;
}

std::optional<ApiError> ParseChat(const json& body, const TextModel& text, int context, StructuredOutputs* structured,
                                  Parsed* p) {
  if (const json* echo = Field(body, "echo"); echo != nullptr && *echo != false) {
    return BadParam("echo", "echo: not supported");
  }
  bool logprobs = false;
  MOE_API_TRY(ReadBool(body, "logprobs", &logprobs));
  int64_t top = 0;
  MOE_API_TRY(ReadInt(body, "top_logprobs", 0, kMaxLogprobs, &top));
  if (Field(body, "top_logprobs") != nullptr && !logprobs) {
    return BadParam("top_logprobs", "top_logprobs: needs logprobs set to true");
  }
  if (logprobs) p->logprobs = static_cast<int>(top);
  const json* messages = Field(body, "messages");
  if (messages == nullptr) return BadParam("messages", "messages: required");
  if (!messages->is_array() || messages->empty()) return BadParam("messages", "messages: expected a non-empty list");
  ChatPrompt chat;
  chat.messages = *messages;
  bool parse_tools = false;
  MOE_API_TRY(ParseTools(body, structured, p, &chat, &parse_tools));
  if (const json* kwargs = Field(body, "chat_template_kwargs")) {
    if (!kwargs->is_object()) return BadParam("chat_template_kwargs", "chat_template_kwargs: expected an object");
    chat.template_kwargs = *kwargs;
  }
  MOE_API_TRY(ReadBool(body, "add_generation_prompt", &chat.add_generation_prompt));
  auto ids = text.EncodeChat(chat);
  if (!ids.ok()) {
    ApiError e = FromEngineStatus(ids.status(), /*chat=*/true);
    e.param = "messages";
    return e;
  }
  p->request.prompt = *std::move(ids);
  p->text.parse_reasoning = p->enforced_tools.empty();
  p->text.parse_tool_calls = parse_tools;
  // Chat has no default limit: what the context leaves (the scheduler refuses a prompt that
  // leaves nothing).
  if (!p->max_tokens) {
    p->max_tokens = std::max<int64_t>(1, context - static_cast<int64_t>(p->request.prompt.size()));
  }
  return std::nullopt;
}

#undef MOE_API_TRY

// OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache held;
// completion_tokens_details: speculative decoding's drafts kept (accepted_prediction_tokens) and
// thrown away (rejected_prediction_tokens).
json Usage(int prompt, int completion, int cached, const DraftCounts& drafts) {
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}},
          {"completion_tokens_details",
           {{"accepted_prediction_tokens", drafts.accepted},
            {"rejected_prediction_tokens", drafts.draft_tokens - drafts.accepted}}}};
}

// JSON has no infinities: an impossible token's log-probability is written as vLLM writes it.
double Logprob(float v) { return std::isfinite(v) ? static_cast<double>(v) : -9999.0; }

json Bytes(const std::string& s) {
  json out = json::array();
  for (unsigned char c : s) out.push_back(static_cast<int>(c));
  return out;
}

const char* FinishReasonText(FinishReason reason, bool tool_calls) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
    case FinishReason::kStopToken:
    case FinishReason::kStopString:
      return tool_calls ? "tool_calls" : "stop";
    case FinishReason::kAborted:
    case FinishReason::kDeadline:
    case FinishReason::kError:
      return "abort";
  }
  return "stop";
}

// What one engine output added, after the text pipeline.
struct Piece {
  TextChunk text;
  std::vector<int32_t> tokens;  // the tokens that count (none after a stop string)
  std::vector<runtime::TokenLogprobs> logprobs;
  bool finished = false;
  std::string finish_reason;
  absl::Status error;
};

// One running request: reads the engine's stream and runs the text pipeline. When a stop string
// matches, the engine is told to stop the request. Thread-safety: one thread at a time.
class Generation {
 public:
  Generation(Engine& engine, std::string id, std::shared_ptr<Stream> stream, std::unique_ptr<OutputText> text)
      : engine_(engine), id_(std::move(id)), stream_(std::move(stream)), text_(std::move(text)) {}
  ~Generation() {
    if (!finished_) engine_.Abort(id_);  // the client went away: free its KV blocks
  }

  // Waits up to `wait` for the engine's next output; false on timeout.
  bool Next(std::chrono::milliseconds wait, Piece* piece) {
    Output out;
    if (!stream_->Next(&out, wait)) return false;
    *piece = Piece();
    if (!stopped_) {
      const int before = text_->tokens();
      piece->text = text_->Add(out.new_tokens);
      const size_t taken = static_cast<size_t>(text_->tokens() - before);
      piece->tokens.assign(out.new_tokens.begin(), out.new_tokens.begin() + std::min(taken, out.new_tokens.size()));
      if (out.logprobs.size() >= taken) piece->logprobs.assign(out.logprobs.begin(), out.logprobs.begin() + taken);
      completion_tokens_ += static_cast<int>(taken);
      if (text_->stopped()) {
        stopped_ = true;
        engine_.FinishByStopString(id_);  // generating on would only be thrown away
      }
    }
    if (out.finished) {
      finished_ = true;
      piece->finished = true;
      piece->text.Append(text_->Finish());
      stopped_ = stopped_ || text_->stopped();
      piece->finish_reason = stopped_ ? "stop" : FinishReasonText(*out.finished, text_->has_tool_calls());
      if (!stopped_) piece->error = out.error;
      prompt_tokens_ = out.prompt_tokens;
      cached_tokens_ = out.cached_tokens;
      drafts_ = out.drafts;
    }
    return true;
  }

  void Cancel() {
    if (!finished_) engine_.Abort(id_);
    finished_ = true;
  }
  bool finished() const { return finished_; }
  const std::shared_ptr<Stream>& stream() const { return stream_; }
  int prompt_tokens() const { return prompt_tokens_; }
  int cached_tokens() const { return cached_tokens_; }
  int completion_tokens() const { return completion_tokens_; }
  const DraftCounts& drafts() const { return drafts_; }

 private:
  Engine& engine_;
  const std::string id_;
  std::shared_ptr<Stream> stream_;
  std::unique_ptr<OutputText> text_;
  bool stopped_ = false;
  bool finished_ = false;
  int prompt_tokens_ = 0;
  int cached_tokens_ = 0;
  int completion_tokens_ = 0;
  DraftCounts drafts_;
};

// Builds the JSON of responses and chunks for one request, in the shapes OpenAI sends.
class ResponseWriter {
 public:
  ResponseWriter(bool chat, std::string id, std::string model, const TextModel& text, const Parsed& parsed)
      : chat_(chat), id_(std::move(id)), model_(std::move(model)), created_(std::time(nullptr)), text_(text),
        logprobs_(parsed.logprobs), include_usage_(parsed.include_usage),
        token_ids_(parsed.return_token_ids || !text.has_tokenizer()),
        enforced_tools_(parsed.enforced_tools),
        enforced_function_(parsed.enforced_function) {}

  // Streaming: the chunks for one piece, each a JSON object.
  std::vector<json> Chunks(Piece piece) {
    std::vector<json> out;
    if (chat_ && !enforced_tools_.empty()) {
      // An enforced tool call streams whole at the end, once its JSON is complete.
      enforced_text_ += piece.text.content;
      piece.text.content.clear();
      if (piece.finished) {
        if (json calls = EnforcedCalls(enforced_text_); !calls.is_null()) {
          for (size_t i = 0; i < calls.size(); ++i) calls[i]["index"] = static_cast<int>(i);
          piece.text.content.clear();
          if (!sent_role_) {
            sent_role_ = true;
            out.push_back(Chunk({{"role", "assistant"}, {"content", nullptr}}, json(), json()));
          }
          out.push_back(Chunk({{"tool_calls", calls}}, json(), json()));
          if (piece.finish_reason == "stop") piece.finish_reason = "tool_calls";
        } else {
          piece.text.content = enforced_text_;  // cut short (max_tokens): what was written
        }
      }
    }
    if (chat_ && !sent_role_) {
      sent_role_ = true;
      out.push_back(Chunk({{"role", "assistant"}, {"content", ""}}, json(), json()));
    }
    json lp = piece.logprobs.empty() ? json() : Logprobs(piece);
    if (chat_) {
      if (!piece.text.reasoning.empty()) out.push_back(Chunk({{"reasoning_content", piece.text.reasoning}}, json(), json()));
      if (!piece.text.tool_calls.empty()) {
        json calls = json::array();
        for (const ToolCallChunk& c : piece.text.tool_calls) {
          json call = {{"index", c.index}};
          if (!c.id.empty()) call["id"] = c.id, call["type"] = "function";
          json function = json::object();
          if (!c.name.empty()) function["name"] = c.name;
          function["arguments"] = c.arguments;
          call["function"] = function;
          calls.push_back(call);
        }
        out.push_back(Chunk({{"tool_calls", calls}}, json(), json()));
      }
      if (!piece.text.content.empty() || (!lp.is_null() && out.empty())) {
        out.push_back(Chunk({{"content", piece.text.content}}, lp, json()));
        lp = json();
      } else if (!lp.is_null()) {
        out.back()["choices"][0]["logprobs"] = lp;
        lp = json();
      }
      if (token_ids_ && !piece.tokens.empty()) {
        if (out.empty()) out.push_back(Chunk(json::object(), json(), json()));
        out.back()["choices"][0]["token_ids"] = piece.tokens;
      }
      if (piece.finished) out.push_back(Chunk(json::object(), json(), piece.finish_reason));
    } else {
      if (!piece.text.content.empty() || !lp.is_null() || piece.finished || (token_ids_ && !piece.tokens.empty())) {
        json chunk = Chunk(piece.text.content, lp, piece.finished ? json(piece.finish_reason) : json());
        if (token_ids_) chunk["choices"][0]["token_ids"] = piece.tokens;
        out.push_back(std::move(chunk));
      }
    }
    return out;
  }

  // Streaming: the last chunk, with the usage and no choices, when the client asked for it.
  std::optional<json> UsageChunk(int prompt, int completion, int cached, const DraftCounts& drafts) const {
    if (!include_usage_) return std::nullopt;
    json chunk = Header();
    chunk["choices"] = json::array();
    chunk["usage"] = Usage(prompt, completion, cached, drafts);
    return chunk;
  }

  // Whole response: pieces accumulate, then Whole() answers.
  void Accumulate(const Piece& piece) {
    all_.text.Append(piece.text);
    all_.tokens.insert(all_.tokens.end(), piece.tokens.begin(), piece.tokens.end());
    all_.logprobs.insert(all_.logprobs.end(), piece.logprobs.begin(), piece.logprobs.end());
    if (piece.finished) all_.finish_reason = piece.finish_reason;
  }

  json Whole(int prompt, int completion, int cached, const DraftCounts& drafts) const {
    if (chat_ && !enforced_tools_.empty()) {
      if (json calls = EnforcedCalls(all_.text.content); !calls.is_null()) {
        json body = Header();
        body["object"] = "chat.completion";
        json choice = {{"index", 0},
                       {"message", {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", calls}}},
                       {"logprobs", logprobs_ >= 0 ? Logprobs(all_) : json()},
                       {"finish_reason", all_.finish_reason == "stop" ? "tool_calls" : all_.finish_reason}};
        if (token_ids_) choice["message"]["token_ids"] = all_.tokens;
        body["choices"] = json::array({choice});
        body["usage"] = Usage(prompt, completion, cached, drafts);
        return body;
      }
    }
    json body = Header();
    body["object"] = chat_ ? "chat.completion" : "text_completion";
    json choice = {{"index", 0}};
    const json lp = logprobs_ >= 0 ? Logprobs(all_) : json();
    if (chat_) {
      json message = {{"role", "assistant"}};
      std::map<int, json> calls;
      for (const ToolCallChunk& c : all_.text.tool_calls) {
        json& call = calls[c.index];
        if (call.is_null()) call = {{"id", ""}, {"type", "function"}, {"function", {{"name", ""}, {"arguments", ""}}}};
        if (!c.id.empty()) call["id"] = c.id;
        if (!c.name.empty()) call["function"]["name"] = c.name;
        call["function"]["arguments"] = call["function"]["arguments"].get<std::string>() + c.arguments;
      }
      message["content"] = calls.empty() || !all_.text.content.empty() ? json(all_.text.content) : json();
      if (!all_.text.reasoning.empty()) message["reasoning_content"] = all_.text.reasoning;
      if (!calls.empty()) {
        message["tool_calls"] = json::array();
        for (auto& [index, call] : calls) message["tool_calls"].push_back(call);
      }
      choice["message"] = message;
      if (token_ids_) choice["token_ids"] = all_.tokens;
    } else {
      choice["text"] = all_.text.content;
      if (token_ids_) choice["token_ids"] = all_.tokens;
    }
    choice["logprobs"] = lp;
    choice["finish_reason"] = all_.finish_reason;
    body["choices"] = json::array({choice});
    body["usage"] = Usage(prompt, completion, cached, drafts);
    return body;
  }

  json EnforcedCalls(const std::string& text) const {
    return EnforcedToolCalls(enforced_tools_, enforced_function_, absl::StrCat("call_", id_, "_"), text);
  }

 private:
  json Header() const {
    return {{"id", id_},
            {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", model_}};
  }

  // A chat chunk's `delta`, or a completion chunk's `text`.
  json Chunk(json delta_or_text, json logprobs, json finish_reason) const {
    json chunk = Header();
    json choice = {{"index", 0}};
    choice[chat_ ? "delta" : "text"] = std::move(delta_or_text);
    choice["logprobs"] = std::move(logprobs);
    choice["finish_reason"] = std::move(finish_reason);
    chunk["choices"] = json::array({choice});
    if (include_usage_) chunk["usage"] = nullptr;
    return chunk;
  }

  json Logprobs(const Piece& piece) const {
    if (logprobs_ < 0) return json();
    const size_t n = std::min(piece.tokens.size(), piece.logprobs.size());
    if (chat_) {
      json content = json::array();
      for (size_t i = 0; i < n; ++i) {
        const std::string token = text_.TokenText(piece.tokens[i]);
        json top = json::array();
        for (size_t k = 0; k < piece.logprobs[i].top.size() && static_cast<int>(k) < logprobs_; ++k) {
          const auto& [alt, alt_lp] = piece.logprobs[i].top[k];
          top.push_back(
              {{"token", text_.TokenText(alt)}, {"logprob", Logprob(alt_lp)}, {"bytes", Bytes(text_.TokenBytes(alt))}});
        }
        content.push_back({{"token", token},
                           {"logprob", Logprob(piece.logprobs[i].logprob)},
                           {"bytes", Bytes(text_.TokenBytes(piece.tokens[i]))},
                           {"top_logprobs", top}});
      }
      return {{"content", content}};
    }
    json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
         offsets = json::array();
    for (size_t i = 0; i < n; ++i) {
      const std::string token = text_.TokenText(piece.tokens[i]);
      tokens.push_back(token);
      token_logprobs.push_back(Logprob(piece.logprobs[i].logprob));
      json top = json::object();
      for (size_t k = 0; k < piece.logprobs[i].top.size() && static_cast<int>(k) < logprobs_; ++k) {
        top[text_.TokenText(piece.logprobs[i].top[k].first)] = Logprob(piece.logprobs[i].top[k].second);
      }
      top_logprobs.push_back(top);
      offsets.push_back(text_offset_);
      text_offset_ += static_cast<int64_t>(token.size());
    }
    return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top_logprobs},
            {"text_offset", offsets}};
  }

  const bool chat_;
  const std::string id_, model_;
  const int64_t created_;
  const TextModel& text_;
  const int logprobs_;
  const bool include_usage_;
  const bool token_ids_;
  const std::string enforced_tools_;     // "", "required" or "named" (Parsed::enforced_tools)
  const std::string enforced_function_;  // with "named"
  std::string enforced_text_;            // streaming an enforced call: its JSON so far
  bool sent_role_ = false;
  mutable int64_t text_offset_ = 0;  // completions' logprobs: where each token starts
  Piece all_;
};

std::string Event(const json& data) {
  return absl::StrCat("data: ", data.dump(-1, ' ', false, json::error_handler_t::replace), "\n\n");
}

double MsSince(std::optional<Clock::time_point> at, Clock::time_point from) {
  return at ? std::chrono::duration<double, std::milli>(*at - from).count() : -1.0;
}

// What the request log says of one HTTP request, written once when it ends.
struct RequestRecord {
  OpenAiApi::RequestLogFn log;
  std::string id, peer, path;
  Clock::time_point arrival = Clock::now();

  void Write(int http_status, const std::string& finish_reason, const std::string& error,
             const Generation* generation) const {
    if (!log) return;
    nlohmann::ordered_json line = {{"event", "request"},         {"api", "openai"},
                                   {"id", id},                   {"peer", peer},
                                   {"path", path},               {"http_status", http_status},
                                   {"finish_reason", finish_reason}};
    if (!error.empty()) line["error"] = error;
    if (generation != nullptr) {
      line["prompt_tokens"] = generation->prompt_tokens();
      line["cached_tokens"] = generation->cached_tokens();
      line["output_tokens"] = generation->completion_tokens();
      if (generation->drafts().drafts > 0) {
        line["spec_drafts"] = generation->drafts().drafts;
        line["draft_tokens"] = generation->drafts().draft_tokens;
        line["accepted_draft_tokens"] = generation->drafts().accepted;
      }
      line["queue_ms"] = MsSince(generation->stream()->admitted(), arrival);
      line["ttft_ms"] = MsSince(generation->stream()->first_token(), arrival);
    }
    line["total_ms"] = MsSince(Clock::now(), arrival);
    log(line);
  }
};

// A streamed response: the HTTP server's content provider pumps it until the request ends.
class EventStream {
 public:
  EventStream(std::unique_ptr<Generation> generation, ResponseWriter writer, RequestRecord record)
      : generation_(std::move(generation)),
        writer_(std::move(writer)),
        record_(std::move(record)),
        last_write_(Clock::now()) {}
  // Writes the request's log line: when the stream ended, or when the client left.
  ~EventStream() {
    record_.Write(200, finish_reason_.empty() ? "client went away" : finish_reason_, error_, generation_.get());
  }

  // One round: waits briefly for the engine, writes what came. False ends the response (the
  // client is gone, or the stream is complete and closed).
  bool Pump(httplib::DataSink& sink) {
    if (done_) return false;
    Piece piece;
    if (!generation_->Next(kPollInterval, &piece)) {
      if (Clock::now() - last_write_ < kKeepAliveInterval) return true;
      return Write(sink, ": keep-alive\n\n");
    }
    for (const json& chunk : writer_.Chunks(piece)) {
      if (!Write(sink, Event(chunk))) return false;
    }
    if (!piece.finished) return true;
    finish_reason_ = piece.finish_reason;
    if (!piece.error.ok()) {
      error_ = std::string(piece.error.message());
      const ApiError e = FromEngineStatus(piece.error, false);
      const json error = {{"error", {{"message", e.message}, {"type", e.type}, {"param", nullptr}, {"code", e.status}}}};
      if (!Write(sink, Event(error))) return false;
    }
    if (auto usage = writer_.UsageChunk(generation_->prompt_tokens(), generation_->completion_tokens(),
                                           generation_->cached_tokens(), generation_->drafts())) {
      if (!Write(sink, Event(*usage))) return false;
    }
    if (!Write(sink, "data: [DONE]\n\n")) return false;
    done_ = true;
    sink.done();
    return true;
  }

  void Cancel() { generation_->Cancel(); }

 private:
  bool Write(httplib::DataSink& sink, const std::string& data) {
    last_write_ = Clock::now();
    if (sink.write(data.data(), data.size())) return true;
    generation_->Cancel();  // the client went away
    return false;
  }

  std::unique_ptr<Generation> generation_;
  ResponseWriter writer_;
  const RequestRecord record_;
  Clock::time_point last_write_;
  bool done_ = false;
  std::string finish_reason_, error_;
};

// Whether the peer of connection `fd` has closed it (or reset it).
bool PeerClosed(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

std::string RandomPrefix() {
  std::random_device device;
  return absl::StrFormat("%08x", device());
}

}  // namespace

OpenAiApi::OpenAiApi(Engine& engine, const TextModel& text, std::string model_id, StructuredOutputsFn structured,
                     RequestLogFn log)
    : engine_(engine),
      text_(text),
      model_id_(std::move(model_id)),
      id_prefix_(RandomPrefix()),
      log_(std::move(log)),
      structured_(std::move(structured)) {}

json OpenAiApi::ModelCard() const {
  return {{"id", model_id_},
          {"object", "model"},
          {"created", 0},
          {"owned_by", "moeserve"},
          {"max_model_len", engine_.config().context},
          {"has_chat_template", text_.has_chat_template()},
          {"supports_tools", text_.has_chat_template() && !text_.tool_call_parser().empty()},
          {"tool_call_parser", text_.tool_call_parser()},
          {"eos_token_ids", engine_.config().eos_token_ids}};
}

void OpenAiApi::ListModels(const httplib::Request&, httplib::Response& response) {
  const json body = {{"object", "list"}, {"data", json::array({ModelCard()})}};
  response.set_content(body.dump(), "application/json");
}

void OpenAiApi::GetModel(const httplib::Request& request, httplib::Response& response) {
  const std::string id = request.matches.size() > 1 ? std::string(request.matches[1]) : "";
  if (id != model_id_) {
    SetJsonError(response, 404, absl::StrCat("The model '", id, "' does not exist; this server serves '", model_id_, "'"),
                 "invalid_request_error", "model");
    return;
  }
  response.set_content(ModelCard().dump(), "application/json");
}

void OpenAiApi::Completions(const httplib::Request& request, httplib::Response& response) {
  Generate(Kind::kCompletion, request, response);
}

void OpenAiApi::ChatCompletions(const httplib::Request& request, httplib::Response& response) {
  Generate(Kind::kChat, request, response);
}

void OpenAiApi::Generate(Kind kind, const httplib::Request& request, httplib::Response& response) {
  const bool chat = kind == Kind::kChat;
  RequestRecord record{log_, "", absl::StrCat(request.remote_addr, ":", request.remote_port), request.path};
  const auto refuse = [&](const ApiError& error) {
    engine_.CountRejected(error.status == 429   ? absl::StatusCode::kResourceExhausted
                          : error.status == 503 ? absl::StatusCode::kUnavailable
                          : error.status == 404 ? absl::StatusCode::kNotFound
                                                : absl::StatusCode::kInvalidArgument);
    SetError(response, error);
    record.Write(error.status, "", error.message, nullptr);
  };
  if (const size_t bad = FirstInvalidUtf8(request.body); bad != std::string_view::npos) {
    const auto [path, field] = FieldAt(request.body, bad);
    return refuse(BadParam(
        field,
        absl::StrFormat("%s: not valid UTF-8 (byte 0x%02x at offset %d of the body); JSON text must be UTF-8",
                        path.empty() ? "request body" : path, static_cast<unsigned char>(request.body[bad]), bad)));
  }
  auto body = core::ParseJsonObject(request.body, "request body");
  if (!body.ok()) return refuse(BadParam("", std::string(body.status().message())));
  Parsed parsed;
  StructuredOutputs* structured = structured_ != nullptr ? structured_() : nullptr;
  if (auto e = ParseCommon(*body, model_id_, structured, &parsed)) return refuse(*e);
  if (parsed.stream && request.version == "HTTP/1.0") {
    // A stream is sent in chunks, which HTTP/1.0 does not have.
    return refuse(BadParam("stream",
                           "stream: an HTTP/1.0 client cannot take a stream (chunked transfer is "
                           "HTTP/1.1); send HTTP/1.1, or stream: false"));
  }
  if (auto e = chat ? ParseChat(*body, text_, engine_.config().context, structured, &parsed)
                    : ParseCompletion(*body, text_, &parsed)) {
    return refuse(*e);
  }
  const std::string id = absl::StrCat(chat ? "chatcmpl-" : "cmpl-", id_prefix_, "-", next_id_++);
  parsed.request.id = id;
  record.id = id;
  parsed.request.stopping.max_new_tokens = static_cast<int>(std::min<int64_t>(*parsed.max_tokens, INT32_MAX));
  // Completions' logprobs=0 still wants the sampled token's log-probability; the engine's 0 is none.
  if (parsed.logprobs >= 0) parsed.request.logprobs = std::max(parsed.logprobs, 1);
  parsed.text.prompt = parsed.request.prompt;
  auto output = text_.NewOutput(parsed.text);
  if (!output.ok()) return refuse(FromEngineStatus(output.status(), chat));
  auto stream = engine_.Submit(parsed.request);
  if (!stream.ok()) return refuse(FromEngineStatus(stream.status(), chat));

  auto generation = std::make_unique<Generation>(engine_, id, *std::move(stream), *std::move(output));
  ResponseWriter writer(chat, id, model_id_, text_, parsed);
  if (parsed.stream) {
    auto events = std::make_shared<EventStream>(std::move(generation), std::move(writer), std::move(record));
    response.set_header("Cache-Control", "no-cache");
    response.set_header("X-Accel-Buffering", "no");  // a proxy in front must not hold the events back
    // The API (and so the engine) outlives the response: the provider holds it.
    response.set_chunked_content_provider(
        "text/event-stream",
        [events, self = shared_from_this()](size_t, httplib::DataSink& sink) { return events->Pump(sink); },
        [events](bool success) {
          if (!success) events->Cancel();
        });
    return;
  }
  // cpp-httplib 0.11 tells a handler nothing of its connection: the request's socket is found
  // by its addresses and watched, so that a client gone while it waits for a whole response
  // cancels the request within a step, as a stream's does.
  const int connection = ConnectionSocketOf(request);
  Piece piece;
  while (!piece.finished) {
    if (connection >= 0 && PeerClosed(connection)) {
      generation->Cancel();  // counted as aborted; its KV blocks are freed at the next step
      record.Write(499, "client went away", "the client closed the connection", generation.get());
      response.status = 499;  // nobody reads it
      return;
    }
    if (!generation->Next(kPollInterval, &piece)) continue;
    writer.Accumulate(piece);
  }
  if (!piece.error.ok()) {
    const ApiError e = FromEngineStatus(piece.error, chat);
    record.Write(e.status, piece.finish_reason, e.message, generation.get());
    return SetError(response, e);
  }
  record.Write(200, piece.finish_reason, "", generation.get());
  response.set_content(writer.Whole(generation->prompt_tokens(), generation->completion_tokens(), generation->cached_tokens(),
                                    generation->drafts())
                           .dump(
                           -1, ' ', false, json::error_handler_t::replace),
                       "application/json");
}

}  // namespace moe::scheduler::internal

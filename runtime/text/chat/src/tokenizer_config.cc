// LoadTokenizerConfig: the prompt-format fields of a model folder, read the way transformers reads
// them (tokenization_utils_base.py), so that a template sees the same bos/eos tokens and source.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moe/core/file.h"
#include "moe/core/json.h"
#include "moe/core/status.h"
#include "moe/text/chat_template.h"

namespace moe::text {
namespace {

using Json = nlohmann::json;

// Far above any real file (those with every added token listed are a few MiB), low enough that a
// wrong path cannot take the memory.
constexpr size_t kMaxConfigBytes = size_t{64} << 20;
constexpr size_t kMaxTemplateBytes = size_t{16} << 20;

// A special token as tokenizer_config.json writes it: a string, an AddedToken dict
// ({"__type": "AddedToken", "content": "<s>", ...}) or null.
absl::StatusOr<std::string> SpecialToken(const Json& config, const char* field, const std::string& source) {
  const auto it = config.find(field);
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    const auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", field, " is ", core::DescribeJson(*it),
                                                 "; expected a string or an object with a string \"content\""));
}

// "chat_template": a string, or a list of {"name", "template"} of which transformers takes
// "default" when the caller names none.
absl::StatusOr<std::string> ChatTemplateField(const Json& config, const std::string& source) {
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": chat_template is ", core::DescribeJson(*it),
                                                   "; expected a string or a list of {name, template}"));
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& entry = (*it)[i];
    const auto name = entry.is_object() ? entry.find("name") : entry.end();
    const auto text = entry.is_object() ? entry.find("template") : entry.end();
    if (name == entry.end() || !name->is_string() || text == entry.end() || !text->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": chat_template[", i, "] is ", core::DescribeJson(entry),
                                                     "; expected {\"name\": string, \"template\": string}"));
    }
    if (name->get<std::string>() == "default") return text->get<std::string>();
    names.push_back(name->get<std::string>());
  }
  return absl::InvalidArgumentError(absl::StrCat(source, ": chat_template lists templates named ",
                                                 absl::StrJoin(names, ", "), " but none named \"default\""));
}

// Python's text mode (newline=None), as transformers opens chat_template.jinja: "\r\n" and a lone
// "\r" read as "\n".
std::string UniversalNewlines(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\r') {
      out += text[i];
      continue;
    }
    out += '\n';
    if (i + 1 < text.size() && text[i + 1] == '\n') ++i;
  }
  return out;
}

}  // namespace

absl::StatusOr<TokenizerConfig> LoadTokenizerConfig(const std::string& model_dir) {
  const std::string path = model_dir + "/tokenizer_config.json";
  absl::StatusOr<std::string> text = core::ReadBoundedFile(path, kMaxConfigBytes, "tokenizer_config.json");
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(absl::StrCat(model_dir, " has no tokenizer_config.json"));
  }
  if (!text.ok()) return text.status();
  MOE_ASSIGN_OR_RETURN(const Json config, core::ParseJsonObject(*text, path));
  TokenizerConfig out;
  MOE_ASSIGN_OR_RETURN(out.bos_token, SpecialToken(config, "bos_token", path));
  MOE_ASSIGN_OR_RETURN(out.eos_token, SpecialToken(config, "eos_token", path));

  // chat_template.jinja wins over the config's field, which then need not be valid.
  const std::string jinja_path = model_dir + "/chat_template.jinja";
  absl::StatusOr<std::string> jinja = core::ReadBoundedFile(jinja_path, kMaxTemplateBytes, "chat_template.jinja");
  if (jinja.ok()) {
    out.chat_template = UniversalNewlines(*jinja);
    return out;
  }
  if (!absl::IsNotFound(jinja.status())) return jinja.status();
  MOE_ASSIGN_OR_RETURN(out.chat_template, ChatTemplateField(config, path));
  return out;
}

}  // namespace moe::text

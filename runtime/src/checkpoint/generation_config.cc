#include "checkpoint/generation_config.h"

#include <algorithm>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "moe/core/file.h"
#include "moe/core/json.h"
#include "moe/core/status.h"

namespace moe::runtime::internal {
namespace {

constexpr size_t kMaxSmallJsonBytes = size_t{4} << 20;
constexpr size_t kMaxTokenizerBytes = size_t{64} << 20;

// `dir/name` parsed as a JSON object, or nullopt when the file does not exist.
absl::StatusOr<std::optional<nlohmann::json>> ReadOptionalJson(const std::string& dir, const std::string& name,
                                                               size_t max_bytes) {
  const std::string path = absl::StrCat(dir, "/", name);
  auto text = core::ReadBoundedFile(path, max_bytes, name);
  if (text.status().code() == absl::StatusCode::kNotFound) return std::optional<nlohmann::json>();
  if (!text.ok()) return text.status();
  MOE_ASSIGN_OR_RETURN(nlohmann::json j, core::ParseJsonObject(*text, path));
  return std::optional<nlohmann::json>(std::move(j));
}

void AddOnce(std::vector<int>& ids, int id) {
  if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
}

absl::Status AddId(const nlohmann::json& value, const std::string& where, int64_t vocab_size, std::vector<int>& ids) {
  if (!value.is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " must be a token id or a list of them, found ", core::DescribeJson(value)));
  }
  const int64_t id = value.get<int64_t>();
  if (id < 0 || id >= vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(where, "=", id, " is out of range: must be between 0 and ",
                                                   vocab_size - 1, " (vocab_size=", vocab_size, ")"));
  }
  AddOnce(ids, static_cast<int>(id));
  return absl::OkStatus();
}

// The text of a special token as tokenizer_config.json writes it: a string, or an AddedToken
// object {"content": ...}.
std::optional<std::string> TokenContent(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string()) {
    return value["content"].get<std::string>();
  }
  return std::nullopt;
}

// The id of special token `content`: tokenizer_config.json's added_tokens_decoder, then
// tokenizer.json's added_tokens and its model's vocabulary.
absl::StatusOr<std::optional<int64_t>> SpecialTokenId(const std::string& dir, const nlohmann::json& tokenizer_config,
                                                      const std::string& content) {
  if (auto decoder = tokenizer_config.find("added_tokens_decoder");
      decoder != tokenizer_config.end() && decoder->is_object()) {
    for (const auto& [key, token] : decoder->items()) {
      int64_t id = 0;
      if (TokenContent(token) == content && absl::SimpleAtoi(key, &id)) return std::optional<int64_t>(id);
    }
  }
  MOE_ASSIGN_OR_RETURN(auto tokenizer, ReadOptionalJson(dir, "tokenizer.json", kMaxTokenizerBytes));
  if (!tokenizer) return std::optional<int64_t>();
  if (auto added = tokenizer->find("added_tokens"); added != tokenizer->end() && added->is_array()) {
    for (const nlohmann::json& token : *added) {
      if (token.is_object() && TokenContent(token) == content && token.contains("id") &&
          token["id"].is_number_integer()) {
        return std::optional<int64_t>(token["id"].get<int64_t>());
      }
    }
  }
  if (auto model = tokenizer->find("model"); model != tokenizer->end() && model->is_object()) {
    if (auto vocab = model->find("vocab"); vocab != model->end() && vocab->is_object()) {
      if (auto it = vocab->find(content); it != vocab->end() && it->is_number_integer()) {
        return std::optional<int64_t>(it->get<int64_t>());
      }
    }
  }
  return std::optional<int64_t>();
}

}  // namespace

absl::StatusOr<std::vector<int>> StopTokenIds(const std::string& model_dir, int64_t vocab_size,
                                              const std::vector<int>& config_ids) {
  std::vector<int> ids = config_ids;
  MOE_ASSIGN_OR_RETURN(auto generation, ReadOptionalJson(model_dir, "generation_config.json", kMaxSmallJsonBytes));
  if (generation && generation->contains("eos_token_id") && !(*generation)["eos_token_id"].is_null()) {
    const nlohmann::json& eos = (*generation)["eos_token_id"];
    const std::string where = absl::StrCat(model_dir, "/generation_config.json: eos_token_id");
    if (eos.is_array()) {
      for (size_t i = 0; i < eos.size(); ++i) {
        MOE_RETURN_IF_ERROR(AddId(eos[i], absl::StrCat(where, "[", i, "]"), vocab_size, ids));
      }
    } else {
      MOE_RETURN_IF_ERROR(AddId(eos, where, vocab_size, ids));
    }
  }
  // The tokenizer's files are the text side's: one that does not read adds no id here (a model
  // served by token ids alone still loads), and the text pipeline says what is wrong with it.
  auto tokenizer_config = ReadOptionalJson(model_dir, "tokenizer_config.json", kMaxSmallJsonBytes);
  if (tokenizer_config.ok() && *tokenizer_config && (**tokenizer_config).contains("eos_token")) {
    if (const std::optional<std::string> content = TokenContent((**tokenizer_config)["eos_token"])) {
      const auto id_or = SpecialTokenId(model_dir, **tokenizer_config, *content);
      const std::optional<int64_t> id = id_or.ok() ? *id_or : std::nullopt;
      if (id) {
        MOE_RETURN_IF_ERROR(AddId(nlohmann::json(*id),
                                  absl::StrCat(model_dir, "/tokenizer_config.json: eos_token '", *content, "'"),
                                  vocab_size, ids));
      }
    }
  }
  return ids;
}

}  // namespace moe::runtime::internal

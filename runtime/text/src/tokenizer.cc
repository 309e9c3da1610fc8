#include "moe/text/tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "added_vocabulary.h"
#include "bpe_model.h"
#include "components.h"
#include "moe/core/file.h"
#include "moe/core/json.h"
#include "moe/core/status.h"
#include "unicode.h"

namespace moe::text {
namespace internal {

// Everything a loaded tokenizer.json holds; all of it immutable after loading.
struct TokenizerParts {
  std::unique_ptr<BpeModel> model;
  std::unique_ptr<Normalizer> normalizer;         // may be null
  std::unique_ptr<PreTokenizer> pre_tokenizer;    // may be null: the whole text is one word
  std::unique_ptr<PostProcessor> post_processor;  // may be null
  std::unique_ptr<Decoder> decoder;               // may be null: tokens joined with spaces
  std::vector<AddedToken> added;
  absl::flat_hash_map<int32_t, size_t> added_by_id;  // id -> index into `added`
  absl::flat_hash_map<std::string, int32_t> added_by_text;
  // Tokens matched in the raw text (normalized: false) and in the normalized text (true).
  std::unique_ptr<AddedTokenMatcher> raw_matcher;
  std::unique_ptr<AddedTokenMatcher> normalized_matcher;
  int vocab_size = 0;
};

namespace {

// A tokenizer.json of a large model is tens of MB; far beyond that is not a tokenizer.
constexpr size_t kMaxTokenizerBytes = size_t{1} << 30;

absl::StatusOr<std::vector<AddedToken>> ParseAddedTokens(const nlohmann::json& root) {
  std::vector<AddedToken> tokens;
  auto list = root.find("added_tokens");
  if (list == root.end() || list->is_null()) return tokens;
  if (!list->is_array()) return absl::InvalidArgumentError("\"added_tokens\" must be a list");
  for (size_t i = 0; i < list->size(); ++i) {
    const nlohmann::json& entry = (*list)[i];
    const std::string where = absl::StrCat("added_tokens[", i, "]");
    if (!entry.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " must be an object"));
    AddedToken token;
    auto id = entry.find("id");
    if (id == entry.end() || !id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() >= (1 << 26))
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"id\" must be an id >= 0"));
    token.id = id->get<int32_t>();
    MOE_ASSIGN_OR_RETURN(token.content, GetString(entry, "content", where));
    MOE_ASSIGN_OR_RETURN(token.special, GetBool(entry, "special", false, where));
    // HF's default: special tokens are matched on the raw text, others after normalization.
    MOE_ASSIGN_OR_RETURN(token.normalized, GetBool(entry, "normalized", !token.special, where));
    MOE_ASSIGN_OR_RETURN(token.lstrip, GetBool(entry, "lstrip", false, where));
    MOE_ASSIGN_OR_RETURN(token.rstrip, GetBool(entry, "rstrip", false, where));
    MOE_ASSIGN_OR_RETURN(token.single_word, GetBool(entry, "single_word", false, where));
    tokens.push_back(std::move(token));
  }
  return tokens;
}

// Builds an optional component: absent or null means the stage is skipped.
template <typename T, typename Build>
absl::Status BuildOptional(const nlohmann::json& root, const char* key, Build build, std::unique_ptr<T>* out) {
  auto it = root.find(key);
  if (it == root.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" must be an object or null"));
  MOE_ASSIGN_OR_RETURN(*out, build(*it));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TokenizerParts>> BuildParts(const nlohmann::json& root) {
  auto parts = std::make_unique<TokenizerParts>();
  auto model = root.find("model");
  if (model == root.end()) return absl::InvalidArgumentError("there is no \"model\"");
  MOE_ASSIGN_OR_RETURN(parts->model, BpeModel::Build(*model));
  MOE_RETURN_IF_ERROR(BuildOptional(root, "normalizer", BuildNormalizer, &parts->normalizer));
  MOE_RETURN_IF_ERROR(BuildOptional(root, "pre_tokenizer", BuildPreTokenizer, &parts->pre_tokenizer));
  MOE_RETURN_IF_ERROR(BuildOptional(root, "post_processor", BuildPostProcessor, &parts->post_processor));
  MOE_RETURN_IF_ERROR(BuildOptional(root, "decoder", BuildDecoder, &parts->decoder));
  if (auto t = root.find("truncation"); t != root.end() && !t->is_null())
    return absl::InvalidArgumentError("truncation is not supported (it must be null; the server limits prompt length)");
  // Padding only concerns batches of several encodings, which Encode never makes; ignored.

  MOE_ASSIGN_OR_RETURN(parts->added, ParseAddedTokens(root));
  std::vector<AddedToken> raw, normalized;
  std::vector<std::string> raw_patterns, normalized_patterns;
  int32_t max_id = parts->model->max_id();
  for (size_t i = 0; i < parts->added.size(); ++i) {
    const AddedToken& token = parts->added[i];
    parts->added_by_id.try_emplace(token.id, i);
    parts->added_by_text.try_emplace(token.content, token.id);
    max_id = std::max(max_id, token.id);
    if (token.normalized) {
      // Matched in normalized text, so the pattern is the normalized content.
      std::string pattern = token.content;
      if (parts->normalizer != nullptr) parts->normalizer->Normalize(&pattern);
      normalized.push_back(token);
      normalized_patterns.push_back(std::move(pattern));
    } else {
      raw.push_back(token);
      raw_patterns.push_back(token.content);
    }
  }
  parts->raw_matcher = std::make_unique<AddedTokenMatcher>(std::move(raw), std::move(raw_patterns));
  parts->normalized_matcher =
      std::make_unique<AddedTokenMatcher>(std::move(normalized), std::move(normalized_patterns));
  parts->vocab_size = max_id + 1;
  return parts;
}

// Normalizes, pre-tokenizes and splits one stretch of text that holds no raw added token.
void EncodePlain(const TokenizerParts& parts, std::string_view text, bool at_start, std::vector<int32_t>* ids) {
  std::string normalized(text);
  if (parts.normalizer != nullptr) parts.normalizer->Normalize(&normalized);
  std::vector<Piece> pieces;
  if (parts.normalized_matcher->empty()) {
    pieces.push_back({std::move(normalized), at_start});
  }
  auto tokenize_pieces = [&](std::vector<Piece>* batch) {
    if (parts.pre_tokenizer != nullptr) parts.pre_tokenizer->PreTokenize(batch);
    for (const Piece& piece : *batch) parts.model->Tokenize(piece.text, ids);
  };
  if (!pieces.empty()) {
    tokenize_pieces(&pieces);
    return;
  }
  for (const TextSplit& split : parts.normalized_matcher->Split(normalized)) {
    if (split.id >= 0) {
      ids->push_back(split.id);
      continue;
    }
    std::vector<Piece> batch;
    batch.push_back({normalized.substr(split.begin, split.end - split.begin), at_start && split.begin == 0});
    tokenize_pieces(&batch);
  }
}

}  // namespace
}  // namespace internal

Tokenizer::Tokenizer(std::unique_ptr<internal::TokenizerParts> parts) : parts_(std::move(parts)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json, std::string_view source) {
  MOE_ASSIGN_OR_RETURN(nlohmann::json root, core::ParseJsonObject(json, source));
  absl::StatusOr<std::unique_ptr<internal::TokenizerParts>> parts;
  try {
    parts = internal::BuildParts(root);
  } catch (const nlohmann::json::exception& e) {
    // The builders check types before reading; this is a backstop so that no exception leaves
    // the module whatever the file holds.
    parts = absl::InvalidArgumentError(absl::StrCat("unexpected value: ", e.what()));
  }
  if (!parts.ok()) return core::Annotate(parts.status(), source);
  return std::unique_ptr<Tokenizer>(new Tokenizer(*std::move(parts)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  MOE_ASSIGN_OR_RETURN(const std::string text,
                       core::ReadBoundedFile(path, internal::kMaxTokenizerBytes, "tokenizer.json"));
  return FromJson(text, path);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromModelDir(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  auto tokenizer = FromFile(path);
  if (absl::IsNotFound(tokenizer.status()))
    return absl::NotFoundError(
        absl::StrCat(dir, " has no tokenizer.json (the model folder needs one for text prompts)"));
  return tokenizer;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  const internal::TokenizerParts& parts = *parts_;
  std::string repaired;
  if (!internal::IsValidUtf8(text)) {
    repaired = internal::RepairUtf8(text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (parts.raw_matcher->empty()) {
    internal::EncodePlain(parts, text, true, &ids);
  } else {
    for (const internal::TextSplit& split : parts.raw_matcher->Split(text)) {
      if (split.id >= 0) {
        ids.push_back(split.id);
      } else {
        internal::EncodePlain(parts, text.substr(split.begin, split.end - split.begin), split.begin == 0, &ids);
      }
    }
  }
  if (add_special_tokens && parts.post_processor != nullptr) parts.post_processor->ProcessSingle(&ids);
  return ids;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  const internal::TokenizerParts& parts = *parts_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (auto it = parts.added_by_id.find(id); it != parts.added_by_id.end()) {
      const internal::AddedToken& token = parts.added[it->second];
      if (!(skip_special_tokens && token.special)) tokens.push_back(token.content);
      continue;
    }
    if (const std::string* token = parts.model->IdToToken(id)) tokens.push_back(*token);
  }
  if (parts.decoder == nullptr) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) absl::StrAppend(&joined, i == 0 ? "" : " ", tokens[i]);
    return joined;
  }
  parts.decoder->DecodeChain(&tokens);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

std::string Tokenizer::TokenBytes(int32_t id) const {
  const internal::TokenizerParts& parts = *parts_;
  if (auto it = parts.added_by_id.find(id); it != parts.added_by_id.end()) return parts.added[it->second].content;
  const std::string* token = parts.model->IdToToken(id);
  if (token == nullptr) return "";
  std::vector<std::string> tokens = {*token};
  if (parts.decoder == nullptr) return *token;
  parts.decoder->DecodeBytes(&tokens);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

int Tokenizer::vocab_size() const { return parts_->vocab_size; }

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  if (auto it = parts_->added_by_text.find(absl::string_view(token.data(), token.size()));
      it != parts_->added_by_text.end())
    return it->second;
  return parts_->model->TokenToId(token);
}

std::string Tokenizer::IdToToken(int32_t id) const {
  if (auto it = parts_->added_by_id.find(id); it != parts_->added_by_id.end()) return parts_->added[it->second].content;
  const std::string* token = parts_->model->IdToToken(id);
  return token != nullptr ? *token : std::string();
}

bool Tokenizer::IsSpecial(int32_t id) const {
  auto it = parts_->added_by_id.find(id);
  return it != parts_->added_by_id.end() && parts_->added[it->second].special;
}

}  // namespace moe::text

// A vocabulary carried in a checkpoint (GGUF's tokenizer.ggml.*) as the tokenizer.json Hugging Face
// would have for it, so that one tokenizer implementation serves both: the ids equal those of the
// model's own tokenizer.json. The split patterns are the ones the models' tokenizer.json files hold;
// `tokenizer.ggml.pre` names which.
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moe/runtime/checkpoint.h"
#include "nlohmann/json.hpp"

namespace moe::runtime {
namespace {

using Json = nlohmann::json;

struct PreTokenizer {
  std::vector<std::string> names;     // tokenizer.ggml.pre values
  std::vector<std::string> patterns;  // Split pre-tokenizers, in order, each "isolated"
  bool nfc = false;                   // an NFC normalizer first
  bool ignore_merges = false;         // a whole word in the vocabulary is taken as it is
};

const std::vector<PreTokenizer>& PreTokenizers() {
  static const std::vector<PreTokenizer> table = {
      {{"qwen2", "deepseek-r1-qwen", "megrez"},
       {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
       /*nfc=*/true,
       /*ignore_merges=*/false},
      {{"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"},
       {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
       false,
       true},
      {{"glm4", "chatglm-bpe"},
       {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
       false,
       false},
      {{"deepseek-v3"},
       {R"(\p{N}{1,3})", R"([一-龥぀-ゟ゠-ヿ]+)",
        R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
       false,
       false},
      {{"gpt-2", "gpt2", "phi-2"},
       {R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"},
       false,
       false},
  };
  return table;
}

std::string KnownNames() {
  std::vector<std::string> names;
  for (const PreTokenizer& p : PreTokenizers()) names.insert(names.end(), p.names.begin(), p.names.end());
  return absl::StrJoin(names, ", ");
}

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool IsUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (int k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n;
  }
  return true;
}

// GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
constexpr int32_t kControl = 3, kUserDefined = 4;

}  // namespace

absl::StatusOr<std::string> EmbeddedTokenizerJson(const TokenizerSource& s) {
  const std::string instead = "; give --tokenizer DIR with the model's tokenizer.json instead";
  if (s.model != "gpt2") {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.ggml.model '", s.model,
                     "' is not read yet (only 'gpt2', byte-level BPE, is)", instead));
  }
  const PreTokenizer* pre = nullptr;
  for (const PreTokenizer& p : PreTokenizers()) {
    for (const std::string& n : p.names) {
      if (n == s.pre) pre = &p;
    }
  }
  if (pre == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.pre '", s.pre,
                                                   "' is not a pre-tokenizer moeserve knows (known: ", KnownNames(),
                                                   ")", instead));
  }
  if (s.merges.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("a 'gpt2' vocabulary without tokenizer.ggml.merges", instead));
  }
  // A byte-level vocabulary's tokens and merges are text: bytes that are not UTF-8 are a broken file.
  for (size_t id = 0; id < s.tokens.size(); ++id) {
    if (!IsUtf8(s.tokens[id])) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.tokens[", id, "] is not valid UTF-8"));
    }
  }
  for (size_t m = 0; m < s.merges.size(); ++m) {
    if (!IsUtf8(s.merges[m])) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.merges[", m, "] is not valid UTF-8"));
    }
  }
  Json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  Json added = Json::array();
  Json vocab = Json::object();
  std::set<std::string> seen;
  for (size_t id = 0; id < s.tokens.size(); ++id) {
    const std::string& token = s.tokens[id];
    const int32_t type = id < s.token_types.size() ? s.token_types[id] : 1;
    if (type == kControl || type == kUserDefined) {
      added.push_back({{"id", id},
                       {"content", token},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", type == kControl}});
    }
    if (seen.insert(token).second) vocab[token] = id;
  }
  j["added_tokens"] = added;
  j["normalizer"] = pre->nfc ? Json{{"type", "NFC"}} : Json(nullptr);
  Json splits = Json::array();
  for (const std::string& pattern : pre->patterns) {
    splits.push_back({{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}});
  }
  splits.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}});
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", splits}};
  if (s.add_bos && s.bos_id) {
    const std::string bos = s.tokens[*s.bos_id];
    j["post_processor"] = {
        {"type", "TemplateProcessing"},
        {"single", Json::array({Json{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                Json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"pair", Json::array({Json{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                              Json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              Json{{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
                              Json{{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
        {"special_tokens", {{bos, {{"id", bos}, {"ids", Json::array({*s.bos_id})}, {"tokens", Json::array({bos})}}}}}};
  } else {
    j["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                           {"use_regex", false}};
  }
  j["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", pre->ignore_merges},
                {"vocab", vocab},
                {"merges", s.merges}};
  return j.dump();
}

}  // namespace moe::runtime

// The Hugging Face `tokenizer.json` tokenizer: text to token ids and back, as the `tokenizers`
// library computes them, for the models moeserve serves (byte-level BPE as in Qwen, GLM and
// GPT-2; SentencePiece-style BPE with byte fallback as in Llama and Mixtral).
//
// The pipeline is HF's: added tokens are cut out of the raw text first (longest match first),
// the rest is normalized, normalized added tokens are cut out of that, the remainder is
// pre-tokenized into words, each word is split by the BPE model, and the post-processor adds the
// template's special tokens. Decoding maps ids to token strings and runs the decoder chain.
//
// What a file may hold (anything else is refused when loading, naming the component):
//   model: BPE (merges as "a b" strings or ["a", "b"] pairs, byte_fallback, ignore_merges,
//          unk_token, fuse_unk, continuing_subword_prefix, end_of_word_suffix; dropout null or 0).
//   normalizer: NFC, NFD, NFKC, NFKD, Lowercase, Strip, Replace, Prepend, Sequence.
//   pre_tokenizer: Split, ByteLevel, Metaspace, Digits, Punctuation, Whitespace,
//          WhitespaceSplit, BertPreTokenizer, Sequence.
//   post_processor: TemplateProcessing (its `single` template), ByteLevel, RobertaProcessing,
//          BertProcessing, Sequence.
//   decoder: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace, Sequence.
//
// Thread safety: a loaded Tokenizer is immutable apart from an internal word cache guarded by a
// mutex, so Encode and Decode may be called from any number of threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::text {

namespace internal {
struct TokenizerParts;
}  // namespace internal

class Tokenizer {
 public:
  // Loads a tokenizer.json. kNotFound when the file does not exist; kInvalidArgument naming the
  // file and component for a component or option that is not supported ("pre_tokenizer type
  // 'Foo' is not supported"), and for a malformed file (with line:column for a JSON syntax error).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& path);
  // DIR/tokenizer.json; kNotFound when the model has none.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromModelDir(const std::string& dir);
  // The same from the text of a tokenizer.json; `source` names it in messages.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json, std::string_view source);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The ids of `text`. add_special_tokens applies the post-processor's template (bos etc.).
  // Invalid UTF-8 in `text` is first replaced by U+FFFD, one per maximal invalid subsequence
  // (Python's errors="replace"), since a Python caller could not have passed such a string.
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens = true) const;
  // The text of `ids`. skip_special_tokens drops special added tokens. Ids outside the
  // vocabulary are skipped. Bytes that do not form UTF-8 become U+FFFD.
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special_tokens = true) const;

  int vocab_size() const;  // largest id + 1, added tokens included
  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::string IdToToken(int32_t id) const;  // "" when unknown
  // The bytes token `id` stands for, as Decode({id}) would give them before bytes that do not form
  // UTF-8 become U+FFFD (a byte-level token that is part of a character: its own bytes).
  std::string TokenBytes(int32_t id) const;
  bool IsSpecial(int32_t id) const;

 private:
  explicit Tokenizer(std::unique_ptr<internal::TokenizerParts> parts);
  std::unique_ptr<internal::TokenizerParts> parts_;
};

}  // namespace moe::text

// The stages of the tokenizer pipeline (normalizer, pre-tokenizer, post-processor, decoder), each
// an interface with one implementation per HF component type, built from its tokenizer.json
// object. Each stage is immutable once built and safe to share between threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace moe::text::internal {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void Normalize(std::string* text) const = 0;
};

// A word candidate from pre-tokenization. `at_start` is true for the piece that begins at
// offset 0 of the original text (Metaspace's prepend_scheme "first" prepends only there).
struct Piece {
  std::string text;
  bool at_start = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` by their splits; empty pieces are dropped.
  virtual void PreTokenize(std::vector<Piece>* pieces) const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Adds the special tokens of a single sequence around `ids`.
  virtual void ProcessSingle(std::vector<int32_t>* ids) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Rewrites the token strings; the decoded text is their concatenation afterwards.
  virtual void DecodeChain(std::vector<std::string>* tokens) const = 0;
  // As DecodeChain, but bytes that do not form UTF-8 stay as they are (a token's own bytes, for
  // logprobs' `bytes`): decoders that repair UTF-8 override it.
  virtual void DecodeBytes(std::vector<std::string>* tokens) const { DecodeChain(tokens); }
};

// Each builder takes the component's JSON object (never null) and returns kInvalidArgument,
// e.g. "pre_tokenizer type 'Foo' is not supported (supported: ...)", for what it cannot do.
absl::StatusOr<std::unique_ptr<Normalizer>> BuildNormalizer(const nlohmann::json& config);
absl::StatusOr<std::unique_ptr<PreTokenizer>> BuildPreTokenizer(const nlohmann::json& config);
absl::StatusOr<std::unique_ptr<Decoder>> BuildDecoder(const nlohmann::json& config);
// Special tokens named by a template are looked up in the template's own `special_tokens`
// (TemplateProcessing) or given with their ids (RobertaProcessing, BertProcessing).
absl::StatusOr<std::unique_ptr<PostProcessor>> BuildPostProcessor(const nlohmann::json& config);

// Helpers for reading component objects with errors instead of exceptions.
absl::StatusOr<std::string> GetString(const nlohmann::json& object, const char* key, const std::string& where);
absl::StatusOr<bool> GetBool(const nlohmann::json& object, const char* key, bool fallback, const std::string& where);
std::string TypeOf(const nlohmann::json& object);

}  // namespace moe::text::internal

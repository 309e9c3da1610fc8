// The ids that end a generation, gathered as transformers and vLLM gather them: config.json's
// eos_token_id, generation_config.json's eos_token_id (an id or a list; real checkpoints list their
// chat end-of-turn token there), and the tokenizer's eos_token (tokenizer_config.json, its id from
// added_tokens_decoder or tokenizer.json).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::runtime::internal {

// `config_ids` (config.json's) followed by the ids the other two files add, each once.
// kInvalidArgument naming the file and key for an id outside [0, vocab_size), a value that is
// neither an id nor a list of ids, or a generation_config.json that is not JSON (or over 4 MiB).
// Missing files add nothing; tokenizer files that do not read (tokenizer.json over 64 MiB, bad
// JSON), or an eos_token no file gives an id for, add nothing either.
absl::StatusOr<std::vector<int>> StopTokenIds(const std::string& model_dir, int64_t vocab_size,
                                              const std::vector<int>& config_ids);

}  // namespace moe::runtime::internal

#include "moe/runtime/generate.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"

namespace moe::runtime {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

uint64_t RandomSeed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}

}  // namespace

absl::StatusOr<GenerateResult> Generate(Model& model, const std::vector<int32_t>& prompt,
                                        const GenerateOptions& options) {
  const ModelSpec& spec = model.spec();
  if (prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  if (options.max_new_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens must be >= 0, got ", options.max_new_tokens));
  }
  MOE_RETURN_IF_ERROR(options.sampling.Validate());
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_new_tokens;
  if (total > spec.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", prompt.size(), " tokens plus max_new_tokens=",
                                                   options.max_new_tokens, " exceeds the context of ",
                                                   spec.max_position_embeddings, " positions"));
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= spec.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token ", i, " is ", prompt[i],
                                                     ", outside the vocabulary [0, ", spec.vocab_size, ")"));
    }
  }

  const int blocks = std::max(1, BlocksFor(total, options.block_size));
  MOE_ASSIGN_OR_RETURN(auto cache, model.NewKvCache(blocks, options.block_size));
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);

  GenerateResult result;
  // One seed for the whole generation; each token's draw is keyed by its position, so the same
  // seed gives the same tokens in any process.
  const uint64_t seed = options.sampling.seed.has_value() ? *options.sampling.seed : RandomSeed();
  const int vocab = spec.vocab_size;
  std::vector<float> logits, penalized;

  // Prefill in chunks of the largest step the model was loaded for (and of the logit rows it
  // returns, when every position's logits are wanted).
  const int prompt_len = static_cast<int>(prompt.size());
  int chunk = model.options().max_step_tokens;
  if (options.prompt_logits) chunk = std::min(chunk, model.options().max_logit_rows);
  auto start = std::chrono::steady_clock::now();
  ForwardBatch batch;
  for (int first = 0; first < prompt_len; first += chunk) {
    const int n = std::min(chunk, prompt_len - first);
    batch.token_ids.assign(prompt.begin() + first, prompt.begin() + first + n);
    batch.sequences = {SequenceChunk{first, n, table}};
    batch.logit_rows.clear();
    if (options.prompt_logits) {
      batch.logit_rows.resize(n);
      std::iota(batch.logit_rows.begin(), batch.logit_rows.end(), 0);
    } else if (first + n == prompt_len) {
      batch.logit_rows = {n - 1};
    }
    MOE_RETURN_IF_ERROR(model.Forward(batch, *cache, &logits));
    MOE_RETURN_IF_ERROR(CheckLogitsFinite(logits.data(), static_cast<int64_t>(logits.size()) / vocab, vocab));
    if (options.prompt_logits) {
      for (int i = 0; i < n; ++i) result.prompt_logits.emplace_back(logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab);
    }
  }
  result.prefill_seconds = SecondsSince(start);
  const float* last = logits.data() + (logits.size() - vocab);

  // Decode: one token per step, reading the cache.
  start = std::chrono::steady_clock::now();
  int64_t position = static_cast<int64_t>(prompt.size());
  for (int step = 0; step < options.max_new_tokens; ++step) {
    if (options.step_logits) result.step_logits.emplace_back(last, last + vocab);
    const SampleKey key{seed, 0, static_cast<uint32_t>(position)};
    int32_t token;
    if (options.sampling.penalized()) {
      penalized.assign(last, last + vocab);
      ApplyPenalties(options.sampling, prompt.data(), static_cast<int>(prompt.size()), result.generated_ids.data(),
                     static_cast<int>(result.generated_ids.size()), penalized.data(), vocab);
      token = SampleToken(penalized.data(), vocab, options.sampling, key);
    } else {
      token = SampleToken(last, vocab, options.sampling, key);
    }
    result.generated_ids.push_back(token);
    if (options.stop_at_eos &&
        std::find(spec.eos_token_ids.begin(), spec.eos_token_ids.end(), token) != spec.eos_token_ids.end()) {
      break;
    }
    if (step + 1 == options.max_new_tokens) break;
    batch.token_ids = {token};
    batch.sequences = {SequenceChunk{position, 1, table}};
    batch.logit_rows = {0};
    MOE_RETURN_IF_ERROR(model.Forward(batch, *cache, &logits));
    MOE_RETURN_IF_ERROR(CheckLogitsFinite(logits.data(), 1, vocab));
    last = logits.data();
    ++position;
  }
  result.decode_seconds = SecondsSince(start);
  return result;
}

}  // namespace moe::runtime

#include "moe/runtime/generate.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"
#include "moe/runtime/model_executor.h"
#include "moe/runtime/mtp_executor.h"

namespace moe::runtime {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

uint64_t RandomSeed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}

// The sampling row that draws position `position` of a sequence whose tokens so far are
// `tokens` (the first `prompt_len` of them its prompt).
SampleRow RowAt(const SamplingParams& sampling, uint64_t seed, const std::vector<int32_t>& tokens, int64_t position,
                int prompt_len) {
  SampleRow row;
  row.sampling = sampling;
  row.seed = seed;
  row.position = static_cast<uint32_t>(position);
  row.prompt_len = static_cast<int32_t>(std::min<int64_t>(prompt_len, position));
  if (sampling.penalized()) row.history.assign(tokens.begin(), tokens.begin() + position);
  return row;
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
  const bool drafting = options.speculative.type != SpecType::kOff && !options.step_logits;
  if (drafting) {
    MOE_RETURN_IF_ERROR(options.speculative.Validate());
    const bool mtp = options.speculative.type == SpecType::kMtp && options.mtp_head != nullptr;
    if (options.speculative.type != SpecType::kNgram && !mtp) {
      return absl::FailedPreconditionError(absl::StrCat("speculative type ", SpecTypeName(options.speculative.type),
                                                        ": Generate drafts from n-grams, or an MTP head it is given"));
    }
    if (mtp && options.prompt_logits) {
      return absl::InvalidArgumentError("the prompt's logits are not returned while an MTP head drafts");
    }
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_new_tokens;
  if (total > spec.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt of ", prompt.size(), " tokens plus max_new_tokens=", options.max_new_tokens,
                     " exceeds the context of ", spec.max_position_embeddings, " positions"));
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= spec.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt token ", i, " is ", prompt[i], ", outside the vocabulary [0, ", spec.vocab_size, ")"));
    }
  }

  // The steps run on an executor of this one sequence, as the scheduler's would: one decode loop
  // and one way of sampling for both.
  const int blocks = std::max(1, BlocksFor(total, options.block_size));
  MOE_ASSIGN_OR_RETURN(auto executor, ModelExecutor::Create(model, blocks, options.block_size));
  // With an MTP head, the steps run through its executor, which drafts after each of them.
  std::unique_ptr<MtpExecutor> head;
  if (drafting && options.speculative.type == SpecType::kMtp) {
    MOE_ASSIGN_OR_RETURN(head, MtpExecutor::Create(std::move(executor), *options.mtp_head, 1));
  }
  const int want_drafts = head != nullptr ? options.speculative.n_max : 0;
  std::vector<int32_t> head_drafts;  // the head's drafts after the newest token
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);

  GenerateResult result;
  // One seed for the whole generation; each token's draw is keyed by its position, so the same
  // seed gives the same tokens in any process.
  const uint64_t seed = options.sampling.seed.has_value() ? *options.sampling.seed : RandomSeed();
  const int vocab = spec.vocab_size;
  const int prompt_len = static_cast<int>(prompt.size());
  std::vector<int32_t> tokens = prompt;  // the sequence so far
  std::vector<float> logits;
  // Runs `plan` (sampled on the host, the logits kept) and returns what the sequence gained.
  auto run_step = [&](const StepPlan& plan) -> absl::StatusOr<SequenceResult> {
    StepResult step;
    if (head != nullptr) {
      MOE_ASSIGN_OR_RETURN(step, head->Execute(plan));
    } else {
      MOE_ASSIGN_OR_RETURN(step, executor->ExecuteOnHost(plan, &logits));
    }
    if (step.sequences.empty()) {
      SequenceResult none;
      none.tokens = {-1};
      return none;
    }
    SequenceResult& r = step.sequences.back();
    if (!r.error.ok()) return r.error;
    head_drafts = r.drafts;
    return std::move(r);
  };
  auto run = [&](const StepPlan& plan) -> absl::StatusOr<int32_t> {
    MOE_ASSIGN_OR_RETURN(SequenceResult r, run_step(plan));
    return r.tokens.back();
  };

  // Prefill in chunks of the largest step the model was loaded for (and of the logit rows it
  // returns, when every position's logits are wanted).
  int chunk = model.options().max_step_tokens;
  if (options.prompt_logits) chunk = std::min(chunk, model.options().max_logit_rows);
  auto start = std::chrono::steady_clock::now();
  int32_t next = -1;
  for (int first = 0; first < prompt_len; first += chunk) {
    const int n = std::min(chunk, prompt_len - first);
    StepPlan plan;
    plan.batch.token_ids.assign(prompt.begin() + first, prompt.begin() + first + n);
    plan.batch.sequences = {SequenceChunk{first, n, table}};
    plan.batch.sequences[0].want_drafts = want_drafts;
    for (int i = options.prompt_logits ? 0 : n - 1; i < n; ++i) {
      if (!options.prompt_logits && first + n != prompt_len) break;
      plan.batch.logit_rows.push_back(i);
      plan.samples.push_back(RowAt(options.sampling, seed, tokens, first + i + 1, prompt_len));
    }
    MOE_ASSIGN_OR_RETURN(next, run(plan));
    if (options.prompt_logits) {
      for (int i = 0; i < n; ++i) {
        result.prompt_logits.emplace_back(logits.begin() + int64_t{i} * vocab, logits.begin() + int64_t{i + 1} * vocab);
      }
    }
  }
  result.prefill_seconds = SecondsSince(start);

  // Decode, reading the cache: one token per step, or with drafts the drafts kept and one more.
  DraftController controller({.n_max = drafting ? options.speculative.n_max : 0,
                              .adaptive = options.speculative.adaptive});
  AcceptanceHistory acceptance;
  start = std::chrono::steady_clock::now();
  std::vector<int32_t> fresh = {next};  // sampled, not yet appended
  bool done = options.max_new_tokens == 0;
  while (!done) {
    for (const int32_t token : fresh) {
      if (options.step_logits) result.step_logits.emplace_back(logits.end() - vocab, logits.end());
      result.generated_ids.push_back(token);
      tokens.push_back(token);
      done = (options.stop_at_eos &&
              std::find(spec.eos_token_ids.begin(), spec.eos_token_ids.end(), token) != spec.eos_token_ids.end()) ||
             static_cast<int>(result.generated_ids.size()) == options.max_new_tokens;
      if (done) break;
    }
    if (done) break;
    const int64_t position = static_cast<int64_t>(tokens.size()) - 1;
    std::vector<int32_t> draft;
    if (drafting) {
      const int room = options.max_new_tokens - static_cast<int>(result.generated_ids.size()) - 1;
      const int k = controller.Choose(&acceptance, 1, 1, room);
      if (head != nullptr) {
        draft.assign(head_drafts.begin(), head_drafts.begin() + std::min<size_t>(k, head_drafts.size()));
      } else {
        NgramDraft(tokens, k, &draft);
      }
    }
    const int k = static_cast<int>(draft.size());
    std::vector<int32_t> fed = tokens;  // what the draft rows' penalties read
    fed.insert(fed.end(), draft.begin(), draft.end());
    StepPlan plan;
    plan.batch.token_ids = {tokens.back()};
    plan.batch.token_ids.insert(plan.batch.token_ids.end(), draft.begin(), draft.end());
    plan.batch.sequences = {SequenceChunk{position, 1 + k, table}};
    plan.batch.sequences[0].num_draft = k;
    plan.batch.sequences[0].want_drafts = want_drafts;
    for (int i = 0; i <= k; ++i) {
      plan.batch.logit_rows.push_back(i);
      plan.samples.push_back(RowAt(options.sampling, seed, fed, position + 1 + i, prompt_len));
    }
    const auto step_start = std::chrono::steady_clock::now();
    MOE_ASSIGN_OR_RETURN(SequenceResult r, run_step(plan));
    controller.ObserveStep(1 + k, SecondsSince(step_start));
    ++result.decode_steps;
    if (k > 0) {
      controller.ObserveVerify(&acceptance, k, r.accepted);
      ++result.spec_drafts;
      result.draft_tokens += k;
      result.accepted_draft_tokens += r.accepted;
    }
    fresh = std::move(r.tokens);
  }
  result.decode_seconds = SecondsSince(start);
  return result;
}

}  // namespace moe::runtime

// The boundary between the scheduler and whatever runs the model. Once per step the scheduler
// builds a StepPlan and an Executor runs it, returning what each sequence gained: one sampled token
// per logit row, or with drafts (SequenceChunk::num_draft) the drafts the target agrees with and
// one token more.
// ModelExecutor (model_executor.h) runs plans on a model in this process; a worker process runs
// the same plans behind another Executor, so nothing here depends on the scheduler.
//
// A StepPlan is a value: it owns every token id, block table and sampling input it names, so it
// can be copied, kept, serialized and sent to every worker without pointing into the scheduler's
// memory. Sampling is keyed by (seed, sequence, position), so the token a row draws depends on the
// plan alone, not on which executor ran the earlier steps.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/runtime/model.h"
#include "moe/runtime/sampler.h"
#include "moe/runtime/token_mask.h"

namespace moe::runtime {

// The sampling inputs of one logit row of a step.
struct SampleRow {
  SamplingParams sampling;
  // The key of the draw. The scheduler sets a seed on every request (a random one when the client
  // gave none), so a request's tokens are the same whichever process samples them.
  uint64_t seed = 0;
  uint32_t sequence = 0;  // which of the request's sequences draws (0 while a request has one)
  // Position of the drawn token: the sequence's length so far (a sequence with drafts has one row
  // per draft more, each one position further).
  uint32_t position = 0;
  // What the penalties read: the prompt, then the tokens generated so far. Sent only when
  // sampling.penalized(), so that steps of unpenalized rows carry no token history; then
  // history.size() == position.
  std::vector<int32_t> history;
  int32_t prompt_len = 0;  // the first prompt_len tokens of the sequence are its prompt
  int logprobs = 0;        // top alternatives to return with the token's log-probability (0: none)
  // Structured outputs: the tokens this row may draw (invalid: any). It may still be being
  // computed while the step runs; the executor waits for it only to sample. Log-probabilities stay
  // those of the model's own distribution.
  PendingTokenMask allowed;
};

// The sample of one logit row, before drafts are accepted.
struct SampledToken {
  int32_t token = 0;
  std::optional<TokenLogprobs> logprobs;  // when the row asked for them
  // Set when this row's logits could not be sampled (not finite).
  absl::Status error;
};

// What one sequence of a step gained. Without drafts: one token per logit row of the sequence, in
// order. With num_draft = k (SequenceChunk::num_draft): the target is sampled at each of the k + 1
// rows with the row's whole sampler (row i draws at its own position), the drafts are kept while
// each equals the token sampled at the row before it, and the first disagreement's sample (or the
// last row's, when every draft is kept) is the bonus token: tokens holds the accepted drafts then
// the bonus, accepted + 1 tokens. Since a draw depends only on (seed, sequence, position) and the
// logits, the tokens are those decoding without drafts would give.
struct SequenceResult {
  std::vector<int32_t> tokens;
  std::vector<std::optional<TokenLogprobs>> logprobs;  // one per token: set when its row asked
  int drafted = 0;                                     // the sequence's num_draft in the plan
  int accepted = 0;                                    // of them, kept
  // Up to SequenceChunk::want_drafts tokens proposed by the executor's drafter to follow `tokens`,
  // for the next step to verify (none from an executor without a drafter).
  std::vector<int32_t> drafts;
  // Set when a row's logits could not be sampled (not finite, kInternal): the sequence fails with
  // it, the others in the step go on. tokens then holds what came before that row.
  absl::Status error;
};

struct StepResult {
  // One per plan sequence that has logit rows, in plan order; none on a rank that holds no logits.
  std::vector<SequenceResult> sequences;
};

struct StepPlan {
  ForwardBatch batch;
  std::vector<SampleRow> samples;  // one per batch.logit_rows entry, same order
  // Sequence ids (SequenceChunk::seq_id) that ended since the last plan: their blocks were freed
  // and the ids are not used again. An executor that mirrors sequences drops them.
  std::vector<uint64_t> released;
};

// For each sequence of `batch`, the indices into batch.logit_rows of its logit rows, in order.
std::vector<std::vector<int>> LogitRowsBySequence(const ForwardBatch& batch);
// kInvalidArgument unless every sequence with drafts has 0 <= num_draft < num_tokens and its logit
// rows are exactly its last num_draft + 1 rows, in order.
absl::Status CheckDrafts(const StepPlan& plan);
// The step's result from the samples of its logit rows (`sampled`: one per logit row, in order),
// as SequenceResult describes: what every executor that samples returns. The plan must pass
// CheckDrafts.
StepResult AcceptDrafts(const StepPlan& plan, std::vector<SampledToken> sampled);

// The KV cache an executor holds: the scheduler hands out block ids below num_blocks, each
// holding block_size positions. For several workers, the minimum over them.
struct KvCapacity {
  int num_blocks = 0;
  int block_size = 0;
};

// What the scheduler and the client API need to know of the model behind an executor, without
// holding the model (a worker process holds it): the vocabulary bounds token ids and top_k, the
// context limit bounds positions (no RoPE scaling yet), the end-of-sequence ids end requests,
// and the rest is reported to clients.
struct ModelInfo {
  std::string architecture;  // config.json's model_type
  int vocab_size = 0;
  int max_position_embeddings = 0;
  std::vector<int> eos_token_ids;
  int num_experts = 0;
  int experts_per_token = 0;
};

// Thread-safety: Execute is called by one thread at a time (the engine's loop). kv_capacity,
// model_info and Describe may be called from any thread; what they return does not change over
// the executor's life.
class Executor {
 public:
  virtual ~Executor() = default;

  // Runs one step: a SequenceResult per plan sequence with logit rows, in plan order (none on a
  // rank that holds no logits: a layer split's stage before the last). A sequence whose logits
  // are not finite gets its own error (kInternal) and the others are served. The whole step
  // fails with kInvalidArgument for a malformed plan (a token id outside the vocabulary, a block
  // outside the cache or a block table too short for its positions, sample rows that do not
  // match the logit rows, drafts whose rows are not the chunk's last logit rows), in which case
  // the cache is unchanged, and with kUnavailable when a worker is lost. Either error fails the
  // plan's sequences only.
  virtual absl::StatusOr<StepResult> Execute(const StepPlan& plan) = 0;

  virtual KvCapacity kv_capacity() const = 0;
  // Changes whenever the KV cache's contents were lost (workers restarted with empty caches), so
  // that a caller keeping blocks across requests (the prefix cache) forgets them. Any thread.
  virtual uint64_t cache_generation() const { return 0; }
  virtual const ModelInfo& model_info() const = 0;
  // One line for logs: what runs the plans, and where.
  virtual std::string Describe() const = 0;
};

}  // namespace moe::runtime

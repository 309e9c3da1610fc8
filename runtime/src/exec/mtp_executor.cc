#include "moe/runtime/mtp_executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"
#include "moe/runtime/speculative.h"

namespace moe::runtime {
namespace {

int32_t Argmax(const float* logits, int vocab) {
  return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MtpExecutor>> MtpExecutor::Create(std::unique_ptr<ModelExecutor> target, Model& head,
                                                                  int max_seqs) {
  if (target == nullptr) return absl::InvalidArgumentError("an MTP head needs a target executor, got none");
  if (!head.options().nextn_head) {
    return absl::InvalidArgumentError("the MTP drafter's head must be loaded as one (ModelOptions::nextn_head)");
  }
  const ModelSpec& spec = target->model().spec();
  if (head.spec().vocab_size != spec.vocab_size || head.spec().hidden_size != spec.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("the MTP head (vocabulary ", head.spec().vocab_size, ", hidden ",
                                                   head.spec().hidden_size, ") is not of this target's shape (",
                                                   spec.vocab_size, ", ", spec.hidden_size, ")"));
  }
  const KvCapacity kv = target->kv_capacity();
  // A chain writes at most kMaxDraftTokens positions past the step's last, which may start
  // anywhere in a block: that many positions more, and one block for the partial one.
  const int per_seq = BlocksFor(kMaxDraftTokens, kv.block_size) + 1;
  const int seqs = std::max(max_seqs, 1);
  MOE_ASSIGN_OR_RETURN(auto cache, head.NewKvCache(kv.num_blocks + seqs * per_seq, kv.block_size));
  target->set_keep_hidden(true);
  return std::unique_ptr<MtpExecutor>(
      new MtpExecutor(std::move(target), head, std::move(cache), kv.num_blocks, per_seq, seqs));
}

MtpExecutor::MtpExecutor(std::unique_ptr<ModelExecutor> target, Model& head, std::unique_ptr<KvCache> cache,
                         int scratch_first, int scratch_per_seq, int max_seqs)
    : target_(std::move(target)),
      head_(head),
      cache_(std::move(cache)),
      scratch_first_(scratch_first),
      scratch_per_seq_(scratch_per_seq),
      max_seqs_(max_seqs) {}

std::string MtpExecutor::Describe() const {
  return absl::StrCat(target_->Describe(), ", drafts from its MTP (nextn) head on the CPU");
}

absl::StatusOr<StepResult> MtpExecutor::Execute(const StepPlan& plan) {
  MOE_ASSIGN_OR_RETURN(StepResult result, target_->Execute(plan));
  // The target's tokens stand whatever happens to the head: a step it cannot follow proposes
  // nothing, and only later drafts may be worse for it.
  if (absl::Status s = Propose(plan, &result); !s.ok()) {
    for (SequenceResult& r : result.sequences) r.drafts.clear();
  }
  return result;
}

absl::Status MtpExecutor::Propose(const StepPlan& plan, StepResult* result) {
  const ForwardBatch& batch = plan.batch;
  const int64_t h = head_.spec().hidden_size;
  const int vocab = head_.spec().vocab_size;
  const std::vector<float>& hidden = target_->hidden();
  if (static_cast<int64_t>(hidden.size()) != static_cast<int64_t>(batch.token_ids.size()) * h) {
    return absl::InternalError("MTP head: the target's step left no hidden state for every row");
  }
  const std::vector<std::vector<int>> rows = LogitRowsBySequence(batch);
  const int block_size = kv_capacity().block_size;
  const int64_t context = head_.options().max_context;
  struct Chain {
    SequenceResult* out;
    int64_t position;  // where the next fed token goes
    int want;
    std::vector<int32_t> table;
    int32_t token = 0;
    std::vector<float> hidden;  // the head's output hidden state of the chain's last row
  };
  std::vector<Chain> chains;
  // The first head step: each sequence's positions whose following token is known now (the
  // step's own tokens, then the one just sampled after the newest kept position), each with the
  // target's hidden state there; the newest position's row starts the sequence's chain.
  ForwardBatch first;
  std::vector<float> first_hidden;
  std::map<std::pair<int32_t, int64_t>, std::vector<float>> waiting;
  auto block_of = [&](const SequenceChunk& c, int64_t position) {
    const int64_t b = position / block_size;
    return b < static_cast<int64_t>(c.block_table.size()) ? c.block_table[b] : -1;
  };
  size_t next = 0;
  int64_t row0 = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceChunk& c = batch.sequences[s];
    SequenceResult* r = nullptr;
    if (!rows[s].empty() && next < result->sequences.size()) r = &result->sequences[next++];
    const int64_t p = c.first_position;
    const bool sampled = r != nullptr && r->error.ok() && !r->tokens.empty();
    const int64_t end = sampled ? p + c.num_tokens - c.num_draft + r->accepted : p + c.num_tokens - 1;
    if (!sampled) {  // the chunk's last position waits for the next chunk's first token
      const int64_t last = p + c.num_tokens - 1;
      const int64_t row = row0 + c.num_tokens - 1;
      waiting[{block_of(c, last), last}].assign(hidden.begin() + row * h, hidden.begin() + (row + 1) * h);
    }
    // The position before the chunk, when the step before left it waiting.
    auto before = p > 0 ? waiting_.find({block_of(c, p - 1), p - 1}) : waiting_.end();
    const int64_t start = before != waiting_.end() ? p - 1 : p;
    if (end > start) {
      SequenceChunk& chunk = first.sequences.emplace_back();
      chunk.first_position = start;
      chunk.num_tokens = static_cast<int32_t>(end - start);
      chunk.block_table = c.block_table;
      if (before != waiting_.end()) {
        first.token_ids.push_back(batch.token_ids[row0]);
        first_hidden.insert(first_hidden.end(), before->second.begin(), before->second.end());
      }
      for (int64_t i = p; i < end; ++i) {
        const int64_t row = row0 + (i - p);
        first.token_ids.push_back(i + 1 < end || !sampled ? batch.token_ids[row + 1] : r->tokens.back());
        first_hidden.insert(first_hidden.end(), hidden.begin() + row * h, hidden.begin() + (row + 1) * h);
      }
      const int want = static_cast<int>(std::min<int64_t>({c.want_drafts, kMaxDraftTokens, context - (end - 1)}));
      if (sampled && want > 0 && static_cast<int>(chains.size()) < max_seqs_) {
        Chain chain{r, end, want, c.block_table};
        // Positions past the table go to this chain's scratch blocks.
        const int first_scratch = scratch_first_ + static_cast<int>(chains.size()) * scratch_per_seq_;
        const int need = BlocksFor(end - 1 + want, block_size) - static_cast<int>(chain.table.size());
        for (int b = 0; b < std::min(need, scratch_per_seq_); ++b) chain.table.push_back(first_scratch + b);
        if (need <= scratch_per_seq_) {
          first.logit_rows.push_back(static_cast<int32_t>(first.token_ids.size()) - 1);
          chains.push_back(std::move(chain));
        }
      }
    }
    row0 += c.num_tokens;
  }
  waiting_ = std::move(waiting);
  if (first.sequences.empty()) return absl::OkStatus();
  first.head_hidden = first_hidden.data();
  first.want_hidden = true;
  std::vector<float> logits, out_hidden;
  auto run = [&](const ForwardBatch& step) -> absl::Status {
    MOE_ASSIGN_OR_RETURN(StepOutputs out, head_.ForwardOnDevice(step, *cache_));
    logits.resize(static_cast<size_t>(out.logits.numel()));
    out_hidden.resize(static_cast<size_t>(out.hidden.numel()));
    if (out.logits) head_.backend().CopyToHost(out.logits, logits.data());
    if (out.hidden) head_.backend().CopyToHost(out.hidden, out_hidden.data());
    return head_.backend().Synchronize();
  };
  // Each round: one greedy draft per live chain, fed back with the head's own hidden state.
  std::vector<Chain*> live;
  for (Chain& chain : chains) live.push_back(&chain);
  MOE_RETURN_IF_ERROR(run(first));
  for (int round = 0;; ++round) {
    for (size_t i = 0; i < live.size(); ++i) {
      Chain& chain = *live[i];
      chain.token = Argmax(logits.data() + i * vocab, vocab);
      chain.out->drafts.push_back(chain.token);
      chain.hidden.assign(out_hidden.begin() + i * h, out_hidden.begin() + (i + 1) * h);
    }
    std::erase_if(live, [&](const Chain* chain) { return round + 1 >= chain->want; });
    if (live.empty()) break;
    ForwardBatch step;
    std::vector<float> step_hidden;
    for (Chain* chain : live) {
      step.token_ids.push_back(chain->token);
      SequenceChunk& c = step.sequences.emplace_back();
      c.first_position = chain->position++;
      c.num_tokens = 1;
      c.block_table = chain->table;
      step.logit_rows.push_back(static_cast<int32_t>(step.token_ids.size()) - 1);
      step_hidden.insert(step_hidden.end(), chain->hidden.begin(), chain->hidden.end());
    }
    step.head_hidden = step_hidden.data();
    step.want_hidden = true;
    MOE_RETURN_IF_ERROR(run(step));
  }
  return absl::OkStatus();
}

}  // namespace moe::runtime

#include "moe/scheduler/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "moe/runtime/cache.h"
#include "moe/scheduler/structured_output.h"

#include <chrono>
#include <future>
#include <optional>

namespace moe::scheduler {

constexpr int kMaxLogprobs = 20;

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStopToken:
      return "stop_token";
    case FinishReason::kStopString:
      return "stop_string";
    case FinishReason::kAborted:
      return "aborted";
    case FinishReason::kDeadline:
      return "deadline";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

uint64_t PrefixCacheSalt(const std::string& kv_cache_dtype) {
  std::vector<int32_t> bytes(kv_cache_dtype.begin(), kv_cache_dtype.end());
  return HashBlock(0x6b762d6474797065ull, bytes);  // "kv-dtype"
}

struct Scheduler::Sequence {
  Request request;              // its sampling seed is always set
  std::vector<int32_t> tokens;  // committed: prompt, then generated tokens (accepted drafts among them)
  int64_t computed = 0;         // committed tokens whose keys and values are in the cache
  // Speculative: drafts fed after `tokens` in the step being planned, until its result is applied.
  std::vector<int32_t> draft;
  // Drafts the executor's drafter proposed in the last step (SequenceResult::drafts), for the next.
  std::vector<int32_t> proposed;
  std::vector<int32_t> blocks;
  int generated = 0;
  bool running = false;
  bool started = false;  // admitted at least once (a preempted sequence is re-admitted)
  bool aborted = false;
  FinishReason abort_reason = FinishReason::kAborted;  // kStopString: a stop string ended it
  // This admission's id in step plans (SequenceChunk::seq_id; 0 while not running): a sequence
  // re-admitted after a preemption recomputes its cache from the start under a new id.
  uint64_t seq_id = 0;
  // Prefix cache: hashes of the sequence's first full blocks (they depend on its tokens only, so
  // they outlive a preemption); how many of its blocks are committed; the prompt tokens its first
  // admission found cached; whether this admission's first chunk, which starts on cached blocks,
  // is still to be planned (it carries the tokens before it, for executors that mirror sequences).
  std::vector<BlockHash> hashes;
  int64_t committed_blocks = 0;
  int cached_tokens = 0;
  bool send_prefix = false;
  // Structured outputs: where the tokens so far leave the request's grammar.
  std::optional<GrammarMatcher> matcher;
  // Speculative decoding: what the sequence's drafts were worth so far, and its counts.
  runtime::AcceptanceHistory acceptance;
  DraftCounts drafts;
  // Drafts this sequence may carry in a step: the request's limit within the server's.
  int max_draft = 0;
};

void NgramProposer::Propose(const std::string& id, std::span<const int32_t> tokens, int max_draft,
                            std::vector<int32_t>* draft) {
  runtime::NgramDraft(tokens, max_draft, draft, options_);
}

namespace {

// The output of request `id` in this step's outputs, added when it has none yet.
Output& OutputOf(const std::string& id, std::vector<Output>* outputs) {
  for (Output& o : *outputs) {
    if (o.id == id) return o;
  }
  outputs->push_back(OutputFor(id));
  return outputs->back();
}

}  // namespace

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config),
      blocks_(config.num_blocks),
      seeds_(std::random_device{}()),
      controller_({.n_max = std::max(config.max_draft, 0), .adaptive = config.draft_adaptive}) {
  if (config_.draft_type == runtime::SpecType::kNgram) proposer_ = &ngram_;
}
Scheduler::~Scheduler() = default;

Scheduler::Sequence* Scheduler::Find(const std::string& id) {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

absl::Status Scheduler::Add(Request r) {
  if (r.id.empty()) return absl::InvalidArgumentError("request_id: empty");
  if (Find(r.id) != nullptr)
    return absl::InvalidArgumentError(absl::StrCat("request_id: '", r.id, "' is already in use"));
  if (r.prompt.empty()) return absl::InvalidArgumentError("token_ids: empty prompt");
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token_ids[", i, "]: ", r.prompt[i],
                                                     " is outside the vocabulary [0, ", config_.vocab_size, ")"));
    }
  }
  const StoppingParams& s = r.stopping;
  if (s.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens: must be at least 1, got ", s.max_new_tokens));
  }
  if (s.min_new_tokens < 0 || s.min_new_tokens > s.max_new_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("min_new_tokens: ", s.min_new_tokens,
                                                   " must be between 0 and max_new_tokens (", s.max_new_tokens, ")"));
  }
  const int64_t prompt_len = static_cast<int64_t>(r.prompt.size());
  if (config_.max_prompt_tokens > 0 && prompt_len > config_.max_prompt_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_ids: prompt of ", prompt_len,
                     " tokens is longer than this server accepts (max_prompt_tokens=", config_.max_prompt_tokens, ")"));
  }
  if (prompt_len >= config_.context) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids: prompt of ", prompt_len,
                                                   " tokens leaves no room in the context of ", config_.context,
                                                   " for a new token"));
  }
  const int64_t total = prompt_len + s.max_new_tokens;
  if (total > config_.context) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens: prompt of ", r.prompt.size(),
                                                   " tokens plus max_new_tokens=", s.max_new_tokens,
                                                   " exceeds the context of ", config_.context));
  }
  if (absl::Status v = r.sampling.Validate(); !v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.", v.message()));
  }
  if (r.sampling.top_k > config_.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.top_k must be at most the vocabulary size (",
                                                   config_.vocab_size, "), got ", r.sampling.top_k));
  }
  if (r.max_draft.has_value() && (*r.max_draft < 0 || *r.max_draft > runtime::kMaxDraftTokens)) {
    return absl::InvalidArgumentError(absl::StrCat("speculative.n_max: must be between 0 and ",
                                                   runtime::kMaxDraftTokens, ", got ", *r.max_draft));
  }
  if (r.logprobs < 0 || r.logprobs > kMaxLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("logprobs: must be between 0 and ", kMaxLogprobs, ", got ", r.logprobs));
  }
  if (runtime::BlocksFor(total, config_.block_size) > config_.num_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat("request needs ", runtime::BlocksFor(total, config_.block_size),
                                                     " KV blocks; the cache has ", config_.num_blocks));
  }
  // Requests beyond the free slots wait; those are what max_queue bounds.
  const int64_t live = static_cast<int64_t>(running_.size() + waiting_.size());
  if (live >= config_.max_seqs && live - config_.max_seqs >= config_.max_queue) {
    if (config_.max_queue == 0) {
      return absl::ResourceExhaustedError(absl::StrCat("server busy: all ", config_.max_seqs,
                                                       " slots are taken (max_seqs) and there is no waiting room "
                                                       "(max_queue=0)"));
    }
    return absl::ResourceExhaustedError(absl::StrCat("queue full: ", live - config_.max_seqs,
                                                     " waiting for a slot (max_queue=", config_.max_queue, ")"));
  }
  // Drawn here, once, so that every step of the request, and a recompute after a preemption,
  // samples with the same key wherever it runs.
  if (!r.sampling.seed.has_value()) r.sampling.seed = seeds_();
  auto seq = std::make_unique<Sequence>();
  if (r.grammar != nullptr) seq->matcher = r.grammar->NewMatcher();
  seq->tokens = r.prompt;
  seq->max_draft = std::clamp(r.max_draft.value_or(config_.max_draft), 0, std::max(config_.max_draft, 0));
  seq->request = std::move(r);
  waiting_.push_back(seq.get());
  sequences_[seq->request.id] = std::move(seq);
  return absl::OkStatus();
}

void Scheduler::Abort(const std::string& id, FinishReason reason) {
  if (Sequence* seq = Find(id)) {
    seq->aborted = true;
    seq->abort_reason = reason;
  }
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s;
  s.running = static_cast<int>(running_.size());
  s.waiting = static_cast<int>(waiting_.size());
  s.blocks_free = blocks_.num_free();
  s.blocks_cached = blocks_.num_cached_free();
  s.blocks_used = blocks_.num_blocks() - blocks_.num_free();
  s.preemptions = preemptions_;
  s.prefix_queried_tokens = prefix_queried_tokens_;
  s.prefix_hit_tokens = prefix_hit_tokens_;
  return s;
}

void Scheduler::Finish(Sequence* seq, FinishReason reason, absl::Status error, std::vector<Output>* outputs) {
  Output* out = &OutputOf(seq->request.id, outputs);
  out->finished = reason;
  out->error = std::move(error);
  out->prompt_tokens = static_cast<int>(seq->request.prompt.size());
  out->completion_tokens = seq->generated;
  out->cached_tokens = seq->cached_tokens;
  out->drafts = seq->drafts;
  // A failed sequence's cache may hold what made it fail (non-finite values): never share it.
  if (reason != FinishReason::kError) CommitFullBlocks(seq);
  blocks_.Release(&seq->blocks);
  Release(seq);
  running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), seq), waiting_.end());
  sequences_.erase(seq->request.id);  // frees seq
}

void Scheduler::Preempt(Sequence* seq) {
  // Recompute later: drop the cache, keep every token, go first in line.
  CommitFullBlocks(seq);
  blocks_.Release(&seq->blocks);
  Release(seq);
  seq->computed = 0;
  seq->committed_blocks = 0;
  seq->send_prefix = false;
  seq->draft.clear();
  seq->proposed.clear();
  seq->running = false;
  running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  waiting_.push_front(seq);
  ++preemptions_;
}

void Scheduler::Release(Sequence* seq) {
  if (seq->seq_id != 0) released_.push_back(seq->seq_id);
  seq->seq_id = 0;
}

std::span<const BlockHash> Scheduler::HashesOf(Sequence* seq, int64_t n) {
  const int64_t bs = config_.block_size;
  for (int64_t i = static_cast<int64_t>(seq->hashes.size()); i < n; ++i) {
    const BlockHash parent = i == 0 ? config_.prefix_cache_salt : seq->hashes[i - 1];
    seq->hashes.push_back(HashBlock(parent, std::span<const int32_t>(seq->tokens.data() + i * bs, bs)));
  }
  return std::span<const BlockHash>(seq->hashes.data(), n);
}

void Scheduler::TakeCachedPrefix(Sequence* seq) {
  if (!config_.prefix_cache || !seq->blocks.empty()) return;
  // Full blocks before the last token: the last one is always computed, for its logits, so a
  // sequence never writes into a block it found cached.
  const int64_t n = (static_cast<int64_t>(seq->tokens.size()) - 1) / config_.block_size;
  const int hits = blocks_.Lookup(HashesOf(seq, n), &seq->blocks);
  seq->computed = static_cast<int64_t>(hits) * config_.block_size;
  seq->committed_blocks = hits;
  seq->send_prefix = hits > 0;
}

void Scheduler::CommitFullBlocks(Sequence* seq) {
  if (!config_.prefix_cache) return;
  const int64_t full = std::min<int64_t>(seq->computed / config_.block_size, static_cast<int64_t>(seq->blocks.size()));
  if (full <= seq->committed_blocks) return;
  const std::span<const BlockHash> hashes = HashesOf(seq, full);
  for (int64_t i = seq->committed_blocks; i < full; ++i) blocks_.Commit(seq->blocks[i], hashes[i]);
  seq->committed_blocks = full;
}

bool Scheduler::EnsureBlocks(Sequence* seq, int64_t positions, bool may_preempt) {
  const int need = runtime::BlocksFor(positions, config_.block_size) - static_cast<int>(seq->blocks.size());
  if (need <= 0) return true;
  while (blocks_.num_free() < need) {
    if (!may_preempt || running_.empty()) return false;
    Sequence* newest = running_.back();
    Preempt(newest);
    if (newest == seq) return false;
  }
  return blocks_.Allocate(need, &seq->blocks).ok();
}

bool Scheduler::CheckStop(Sequence* seq, int32_t token, std::vector<Output>* outputs) {
  const StoppingParams& s = seq->request.stopping;
  const bool may_stop = seq->generated >= s.min_new_tokens;
  if (may_stop && std::find(s.stop_token_ids.begin(), s.stop_token_ids.end(), token) != s.stop_token_ids.end()) {
    Finish(seq, FinishReason::kStopToken, absl::OkStatus(), outputs);
    return true;
  }
  if (may_stop && !s.ignore_eos &&
      std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(), token) != config_.eos_token_ids.end()) {
    Finish(seq, FinishReason::kEos, absl::OkStatus(), outputs);
    return true;
  }
  if (seq->generated >= s.max_new_tokens) {
    Finish(seq, FinishReason::kLength, absl::OkStatus(), outputs);
    return true;
  }
  return false;
}

runtime::SampleRow Scheduler::SampleRowFor(const Sequence& seq, int draft) const {
  runtime::SampleRow row;
  row.sampling = seq.request.sampling;
  row.seed = *seq.request.sampling.seed;
  row.position = static_cast<uint32_t>(seq.tokens.size() + draft);
  row.prompt_len = static_cast<int32_t>(seq.request.prompt.size());
  // Only the penalties read the history: other rows keep the plan small. A draft's row reads the
  // drafts before it, which are committed by the time its token counts.
  if (seq.request.sampling.penalized()) {
    row.history = seq.tokens;
    row.history.insert(row.history.end(), seq.draft.begin(), seq.draft.begin() + draft);
  }
  row.logprobs = seq.request.logprobs;
  if (seq.matcher.has_value()) {
    // A state seen before has its mask already; a new one is computed on another thread while the
    // step's forward pass runs, and the executor waits for it only to sample.
    const std::shared_ptr<const TokenGrammar>& grammar = seq.request.grammar;
    if (auto cached = grammar->CachedMask(*seq.matcher)) {
      row.allowed = runtime::ReadyTokenMask(std::move(cached));
    } else {
      row.allowed =
          std::async(std::launch::async, [grammar, matcher = *seq.matcher] { return grammar->Mask(matcher); }).share();
    }
  }
  return row;
}

void Scheduler::EndAbortedAndLate(Clock::time_point now, std::vector<Output>* outputs) {
  std::vector<Sequence*> ending;
  for (auto& [id, seq] : sequences_) {
    if (seq->aborted || (seq->request.deadline.has_value() && now >= *seq->request.deadline))
      ending.push_back(seq.get());
  }
  for (Sequence* seq : ending) {
    Finish(seq, seq->aborted ? seq->abort_reason : FinishReason::kDeadline,
           seq->aborted ? absl::OkStatus() : absl::DeadlineExceededError("deadline exceeded"), outputs);
  }
}

int Scheduler::ProposeDrafts(Sequence* seq, int budget, int rows, int tokens) {
  seq->draft.clear();
  std::vector<int32_t> proposed = std::move(seq->proposed);
  seq->proposed.clear();
  const int64_t pending = static_cast<int64_t>(seq->tokens.size()) - seq->computed;
  if (seq->max_draft <= 0 || pending != 1 || seq->matcher.has_value()) return 0;
  // Never past max_new_tokens: the bonus token of a step whose drafts are all kept is the last.
  const int room = seq->request.stopping.max_new_tokens - seq->generated - 1;
  int most = std::min({seq->max_draft, room, budget - 1});
  if (most <= 0) return 0;
  // Only as many as pay for the rows they add to the step.
  most = controller_.Choose(&seq->acceptance, rows, tokens, most);
  if (most <= 0) return 0;
  // The executor's drafter's proposal first; the scheduler's proposer when it made none.
  if (!proposed.empty()) {
    seq->draft = std::move(proposed);
  } else if (proposer_ != nullptr) {
    proposer_->Propose(seq->request.id, seq->tokens, most, &seq->draft);
  }
  if (static_cast<int>(seq->draft.size()) > most) seq->draft.resize(most);
  for (int32_t& t : seq->draft) {
    if (t < 0 || t >= config_.vocab_size) {  // a proposer's mistake must not fail the step
      seq->draft.clear();
      break;
    }
  }
  return static_cast<int>(seq->draft.size());
}

std::vector<Scheduler::Scheduled> Scheduler::Schedule(std::vector<Output>* outputs) {
  std::vector<Scheduled> scheduled;
  int budget = config_.max_batch_tokens;
  // For the draft-length controller: the step's rows and served tokens without drafts are about
  // the rows planned so far and one for each running sequence not yet planned.
  int unplanned = static_cast<int>(running_.size());
  // Blocks the running sequences from index i on need for their own pending tokens: drafts take
  // only the free blocks beyond those, so that they never cost another sequence its step or its
  // place (a preemption).
  std::vector<int> own_need(running_.size() + 1, 0);
  for (size_t i = running_.size(); i-- > 0;) {
    const Sequence* r = running_[i];
    const int need = runtime::BlocksFor(static_cast<int64_t>(r->tokens.size()), config_.block_size) -
                     static_cast<int>(r->blocks.size());
    own_need[i] = own_need[i + 1] + std::max(need, 0);
  }
  auto schedule = [&](Sequence* seq, bool may_preempt, int reserve) {
    const int64_t pending = static_cast<int64_t>(seq->tokens.size()) - seq->computed;
    const int32_t count = static_cast<int32_t>(std::min<int64_t>(pending, budget));
    if (count <= 0) return false;
    const int rows = config_.max_batch_tokens - budget + std::max(unplanned, 1);
    int num_draft =
        count == pending ? ProposeDrafts(seq, budget, rows, std::max(static_cast<int>(running_.size()), 1)) : 0;
    if (num_draft > 0) {
      const int need = runtime::BlocksFor(seq->computed + count + num_draft, config_.block_size) -
                       static_cast<int>(seq->blocks.size());
      if (need > blocks_.num_free() - reserve) {
        seq->draft.clear();
        num_draft = 0;
      }
    }
    if (!EnsureBlocks(seq, seq->computed + count + num_draft, may_preempt)) {
      seq->draft.clear();
      return false;
    }
    scheduled.push_back({seq, seq->computed, count + num_draft, num_draft});
    budget -= count + num_draft;
    return true;
  };
  // Running sequences first (decode tokens, then unfinished prefills), oldest first; a sequence
  // preempted on the way drops out of this step.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    schedule(running_[i], /*may_preempt=*/true, own_need[std::min(i + 1, running_.size())]);
    --unplanned;
  }
  // Then new requests, first come first served, while blocks and slots last (no preemption).
  while (!waiting_.empty() && budget > 0 && static_cast<int>(running_.size()) < config_.max_seqs) {
    Sequence* seq = waiting_.front();
    TakeCachedPrefix(seq);
    if (!schedule(seq, /*may_preempt=*/false, /*reserve=*/0)) {
      // It waits on: the cached blocks it took go back (still cached) until it can start.
      blocks_.Release(&seq->blocks);
      seq->computed = 0;
      seq->committed_blocks = 0;
      seq->send_prefix = false;
      break;
    }
    if (config_.prefix_cache) {
      prefix_queried_tokens_ += static_cast<int64_t>(seq->tokens.size());
      prefix_hit_tokens_ += seq->computed;
      if (!seq->started) seq->cached_tokens = static_cast<int>(seq->computed);
    }
    waiting_.pop_front();
    seq->running = true;
    seq->seq_id = ++last_seq_id_;
    running_.push_back(seq);
    if (!seq->started) {
      seq->started = true;
      Output admitted = OutputFor(seq->request.id);
      admitted.admitted = true;
      outputs->push_back(std::move(admitted));
    }
  }
  // Drop entries of sequences preempted after they were scheduled.
  scheduled.erase(
      std::remove_if(scheduled.begin(), scheduled.end(), [&](const Scheduled& s) { return !s.seq->running; }),
      scheduled.end());
  return scheduled;
}

runtime::StepPlan Scheduler::BuildPlan(const std::vector<Scheduled>& scheduled) {
  runtime::StepPlan plan;
  for (const Scheduled& s : scheduled) {
    Sequence& seq = *s.seq;
    const int32_t fed = s.count - s.num_draft;  // of the sequence's own tokens
    plan.batch.token_ids.insert(plan.batch.token_ids.end(), seq.tokens.begin() + s.first,
                                seq.tokens.begin() + s.first + fed);
    plan.batch.token_ids.insert(plan.batch.token_ids.end(), seq.draft.begin(), seq.draft.end());
    runtime::SequenceChunk& chunk = plan.batch.sequences.emplace_back();
    chunk.first_position = s.first;
    chunk.num_tokens = s.count;
    chunk.block_table = seq.blocks;
    chunk.seq_id = seq.seq_id;
    chunk.num_draft = s.num_draft;
    if (seq.send_prefix) {
      chunk.prefix.assign(seq.tokens.begin(), seq.tokens.begin() + s.first);
      seq.send_prefix = false;
    }
    // The chunk that reaches the last token samples the next one, and one more per draft; an
    // executor with a drafter proposes the next step's drafts.
    if (s.first + fed == static_cast<int64_t>(seq.tokens.size())) {
      chunk.want_drafts = seq.matcher.has_value() ? 0 : seq.max_draft;
      const int32_t end = static_cast<int32_t>(plan.batch.token_ids.size());
      for (int i = 0; i <= s.num_draft; ++i) {
        plan.batch.logit_rows.push_back(end - s.num_draft - 1 + i);
        plan.samples.push_back(SampleRowFor(seq, i));
      }
    }
  }
  plan.released = std::move(released_);
  released_.clear();
  return plan;
}

bool Scheduler::Accept(Sequence* seq, runtime::SequenceResult& result, std::vector<Output>* outputs) {
  Output* out = nullptr;
  for (size_t i = 0; i < result.tokens.size(); ++i) {
    const int32_t token = result.tokens[i];
    seq->tokens.push_back(token);
    ++seq->generated;
    if (out == nullptr) out = &OutputOf(seq->request.id, outputs);
    out->new_tokens.push_back(token);
    if (i < result.logprobs.size() && result.logprobs[i]) out->logprobs.push_back(std::move(*result.logprobs[i]));
    const TokenGrammar* grammar = seq->request.grammar.get();
    if (grammar != nullptr && !grammar->IsEos(token) && !grammar->Accept(&*seq->matcher, token)) {
      Finish(seq, FinishReason::kError,
             absl::InternalError(absl::StrCat("structured output: token ", token, " does not follow the grammar")),
             outputs);
      return false;
    }
    if (CheckStop(seq, token, outputs)) return false;
    if (grammar != nullptr && !seq->matcher->can_continue()) {  // the output is whole
      Finish(seq, FinishReason::kEos, absl::OkStatus(), outputs);
      return false;
    }
  }
  if (!result.error.ok()) {
    Finish(seq, FinishReason::kError, std::move(result.error), outputs);
    return false;
  }
  return true;
}

void Scheduler::CountVerify(Sequence* seq, int drafted, int accepted, std::vector<Output>* outputs) {
  controller_.ObserveVerify(&seq->acceptance, drafted, accepted);
  ++seq->drafts.drafts;
  seq->drafts.draft_tokens += drafted;
  seq->drafts.accepted += accepted;
  Output& out = OutputOf(seq->request.id, outputs);
  out.step_drafts = {1, drafted, accepted};
}

void Scheduler::TrimBlocks(Sequence* seq) {
  // The next step writes from the bonus token on, so the blocks up to it stay; those past it held
  // only rejected drafts (never committed: a committed block is full of computed tokens).
  const size_t keep = static_cast<size_t>(runtime::BlocksFor(static_cast<int64_t>(seq->tokens.size()),
                                                             config_.block_size));
  if (seq->blocks.size() <= keep) return;
  std::vector<int32_t> tail(seq->blocks.begin() + keep, seq->blocks.end());
  seq->blocks.resize(keep);
  blocks_.Release(&tail);
}

void Scheduler::Apply(const std::vector<Scheduled>& scheduled, runtime::StepResult& result,
                      std::vector<Output>* outputs) {
  size_t next = 0;
  for (const Scheduled& s : scheduled) {
    Sequence* seq = s.seq;
    const int64_t end = s.first + s.count - s.num_draft;
    seq->draft.clear();
    if (end != static_cast<int64_t>(seq->tokens.size())) {  // a prefill chunk
      seq->computed = end;
      CommitFullBlocks(seq);
      continue;
    }
    if (next >= result.sequences.size()) {
      Finish(seq, FinishReason::kError,
             absl::InternalError(absl::StrCat("the executor returned ", result.sequences.size(),
                                              " sequences' results for a larger step")),
             outputs);
      continue;
    }
    runtime::SequenceResult& r = result.sequences[next++];
    // The cache holds the sequence's own tokens and the drafts kept; the bonus token is fed next.
    const int accepted = std::clamp(r.accepted, 0, s.num_draft);
    seq->computed = end + accepted;
    if (s.num_draft > 0) CountVerify(seq, s.num_draft, accepted, outputs);
    std::vector<int32_t> proposed = std::move(r.drafts);
    if (Accept(seq, r, outputs)) {
      seq->proposed = std::move(proposed);
      CommitFullBlocks(seq);
      TrimBlocks(seq);
    }
  }
}

std::vector<Output> Scheduler::Step(runtime::Executor& executor, Clock::time_point now) {
  std::vector<Output> outputs;
  // Workers restarted since the last step hold none of the cached blocks.
  if (const uint64_t generation = executor.cache_generation(); generation != cache_generation_) {
    blocks_.ForgetAll();
    cache_generation_ = generation;
  }
  // Aborted and late requests end before any work is planned for them.
  EndAbortedAndLate(now, &outputs);
  const std::vector<Scheduled> scheduled = Schedule(&outputs);
  if (scheduled.empty()) return outputs;
  const runtime::StepPlan plan = BuildPlan(scheduled);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<runtime::StepResult> result = executor.Execute(plan);
  if (result.ok()) {
    controller_.ObserveStep(static_cast<int>(plan.batch.token_ids.size()),
                            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  // Masks still being computed (an executor that failed before sampling) end before the matchers
  // they read move on.
  for (const runtime::SampleRow& row : plan.samples) {
    if (row.allowed.valid()) row.allowed.wait();
  }
  if (!result.ok()) {
    for (const Scheduled& s : scheduled) Finish(s.seq, FinishReason::kError, result.status(), &outputs);
    // A malformed plan left the cache as it was; any other failure (a worker lost, restarted with
    // an empty cache) may not have: no cached block is trusted after it.
    if (result.status().code() != absl::StatusCode::kInvalidArgument) blocks_.ForgetAll();
    return outputs;
  }
  Apply(scheduled, *result, &outputs);
  return outputs;
}

}  // namespace moe::scheduler

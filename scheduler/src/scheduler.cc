#include "moe/scheduler/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "moe/runtime/kv_cache.h"

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

struct Scheduler::Sequence {
  Request request;              // its sampling seed is always set
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int64_t computed = 0;         // tokens whose keys and values are in the cache
  std::vector<int32_t> blocks;
  int generated = 0;
  bool running = false;
  bool started = false;  // admitted at least once (a preempted sequence is re-admitted)
  bool aborted = false;
  FinishReason abort_reason = FinishReason::kAborted;  // kStopString: a stop string ended it
  // This admission's id in step plans (0 while not running): a sequence re-admitted after a
  // preemption recomputes its cache from the start under a new id.
  uint64_t uid = 0;
};

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config), blocks_(config.num_blocks), seeds_(std::random_device{}()) {}
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
  seq->tokens = r.prompt;
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
  s.blocks_used = blocks_.num_blocks() - blocks_.num_free();
  s.preemptions = preemptions_;
  return s;
}

void Scheduler::Finish(Sequence* seq, FinishReason reason, absl::Status error, std::vector<Output>* outputs) {
  Output* out = nullptr;
  for (Output& o : *outputs) {
    if (o.id == seq->request.id) out = &o;
  }
  if (out == nullptr) {
    outputs->push_back(OutputFor(seq->request.id));
    out = &outputs->back();
  }
  out->finished = reason;
  out->error = std::move(error);
  out->prompt_tokens = static_cast<int>(seq->request.prompt.size());
  out->completion_tokens = seq->generated;
  blocks_.Free(&seq->blocks);
  Release(seq);
  running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), seq), waiting_.end());
  sequences_.erase(seq->request.id);  // frees seq
}

void Scheduler::Preempt(Sequence* seq) {
  // Recompute later: drop the cache, keep every token, go first in line.
  blocks_.Free(&seq->blocks);
  Release(seq);
  seq->computed = 0;
  seq->running = false;
  running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  waiting_.push_front(seq);
  ++preemptions_;
}

void Scheduler::Release(Sequence* seq) {
  if (seq->uid != 0) released_.push_back(seq->uid);
  seq->uid = 0;
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

void Scheduler::CheckStop(Sequence* seq, int32_t token, std::vector<Output>* outputs) {
  const StoppingParams& s = seq->request.stopping;
  const bool may_stop = seq->generated >= s.min_new_tokens;
  if (may_stop && std::find(s.stop_token_ids.begin(), s.stop_token_ids.end(), token) != s.stop_token_ids.end()) {
    return Finish(seq, FinishReason::kStopToken, absl::OkStatus(), outputs);
  }
  if (may_stop && !s.ignore_eos &&
      std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(), token) != config_.eos_token_ids.end()) {
    return Finish(seq, FinishReason::kEos, absl::OkStatus(), outputs);
  }
  if (seq->generated >= s.max_new_tokens) Finish(seq, FinishReason::kLength, absl::OkStatus(), outputs);
}

runtime::SampleRow Scheduler::SampleRowFor(const Sequence& seq) const {
  runtime::SampleRow row;
  row.sampling = seq.request.sampling;
  row.seed = *seq.request.sampling.seed;
  row.position = static_cast<uint32_t>(seq.tokens.size());
  row.prompt_len = static_cast<int32_t>(seq.request.prompt.size());
  // Only the penalties read the history: other rows keep the plan small.
  if (seq.request.sampling.penalized()) row.history = seq.tokens;
  row.logprobs = seq.request.logprobs;
  return row;
}

std::vector<Output> Scheduler::Step(runtime::Executor& executor, Clock::time_point now) {
  std::vector<Output> outputs;
  // Aborted and late requests end before any work is planned for them.
  std::vector<Sequence*> ending;
  for (auto& [id, seq] : sequences_) {
    if (seq->aborted || (seq->request.deadline.has_value() && now >= *seq->request.deadline))
      ending.push_back(seq.get());
  }
  for (Sequence* seq : ending) {
    Finish(seq, seq->aborted ? seq->abort_reason : FinishReason::kDeadline,
           seq->aborted ? absl::OkStatus() : absl::DeadlineExceededError("deadline exceeded"), &outputs);
  }

  struct Scheduled {
    Sequence* seq;
    int64_t first;
    int32_t count;
  };
  std::vector<Scheduled> scheduled;
  int budget = config_.max_batch_tokens;
  auto schedule = [&](Sequence* seq, bool may_preempt) {
    const int64_t pending = static_cast<int64_t>(seq->tokens.size()) - seq->computed;
    const int32_t count = static_cast<int32_t>(std::min<int64_t>(pending, budget));
    if (count <= 0 || !EnsureBlocks(seq, seq->computed + count, may_preempt)) return false;
    scheduled.push_back({seq, seq->computed, count});
    budget -= count;
    return true;
  };
  // Running sequences first (decode tokens, then unfinished prefills), oldest first; a sequence
  // preempted on the way drops out of this step.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) schedule(running_[i], /*may_preempt=*/true);
  // Then new requests, first come first served, while blocks and slots last (no preemption).
  while (!waiting_.empty() && budget > 0 && static_cast<int>(running_.size()) < config_.max_seqs) {
    Sequence* seq = waiting_.front();
    if (!schedule(seq, /*may_preempt=*/false)) break;
    waiting_.pop_front();
    seq->running = true;
    seq->uid = ++last_uid_;
    running_.push_back(seq);
    if (!seq->started) {
      seq->started = true;
      Output admitted = OutputFor(seq->request.id);
      admitted.admitted = true;
      outputs.push_back(std::move(admitted));
    }
  }
  // Drop entries of sequences preempted after they were scheduled.
  scheduled.erase(
      std::remove_if(scheduled.begin(), scheduled.end(), [&](const Scheduled& s) { return !s.seq->running; }),
      scheduled.end());
  if (scheduled.empty()) return outputs;

  runtime::StepPlan plan;
  for (const Scheduled& s : scheduled) {
    const int32_t row0 = static_cast<int32_t>(plan.batch.token_ids.size());
    plan.batch.token_ids.insert(plan.batch.token_ids.end(), s.seq->tokens.begin() + s.first,
                                s.seq->tokens.begin() + s.first + s.count);
    plan.batch.sequences.push_back(runtime::SequenceChunk{s.first, s.count, s.seq->blocks, s.seq->uid});
    // The chunk that reaches the last token samples the next one.
    if (s.first + s.count == static_cast<int64_t>(s.seq->tokens.size())) {
      plan.batch.logit_rows.push_back(row0 + s.count - 1);
      plan.samples.push_back(SampleRowFor(*s.seq));
    }
  }

  plan.released = std::move(released_);
  released_.clear();
  absl::StatusOr<std::vector<runtime::SampledToken>> sampled = executor.Execute(plan);
  if (!sampled.ok()) {
    for (const Scheduled& s : scheduled) Finish(s.seq, FinishReason::kError, sampled.status(), &outputs);
    return outputs;
  }
  size_t row = 0;
  for (const Scheduled& s : scheduled) {
    Sequence* seq = s.seq;
    seq->computed = s.first + s.count;
    if (seq->computed != static_cast<int64_t>(seq->tokens.size())) continue;  // a prefill chunk
    runtime::SampledToken& sample = (*sampled)[row++];
    if (!sample.error.ok()) {
      Finish(seq, FinishReason::kError, std::move(sample.error), &outputs);
      continue;
    }
    const int32_t token = sample.token;
    seq->tokens.push_back(token);
    ++seq->generated;
    Output* out = nullptr;
    for (Output& o : outputs) {
      if (o.id == seq->request.id) out = &o;
    }
    if (out == nullptr) {
      outputs.push_back(OutputFor(seq->request.id));
      out = &outputs.back();
    }
    out->new_tokens.push_back(token);
    if (sample.logprobs) out->logprobs.push_back(std::move(*sample.logprobs));
    CheckStop(seq, token, &outputs);
  }
  return outputs;
}

}  // namespace moe::scheduler

// Scheduler: continuous batching of many requests over one model.
//
// Each Step() builds one StepPlan under a token budget (max_batch_tokens) and a cap on running
// sequences (max_seqs): first one decode token for every running sequence, then prefill chunks
// (a long prompt is split over steps while the others keep decoding), then new requests, first
// come first served. KV blocks come from a block pool (block_pool.h) and go back the moment a sequence
// finishes, is aborted, fails or passes its deadline. When blocks run out, the newest running
// sequence is preempted (its blocks freed) and recomputed later, rather than failing older ones.
// With the prefix cache on, every full block a sequence has computed is committed to the pool under
// a hash chained over its tokens; a sequence being admitted takes the longest run of cached blocks
// that matches its tokens (shared read-only, refcounted) and prefills only the rest, always at
// least its last token, so no shared block is ever written. Freed blocks keep their contents until
// Allocate needs them (least recently freed first).
// Every request gets a sampling seed when it is added (a random one when it has none), so its
// tokens do not depend on which executor or process samples them. With a DraftProposer, a decoding
// sequence carries up to max_draft drafts a step; the executor keeps those its sampler agrees with
// (executor.h: SequenceResult), the stop conditions are checked after each token kept, and the
// next step starts after the kept ones (the rejected positions are written again, and blocks
// taken for rejected drafts go back the same step). Drafts take only the free blocks beyond those
// the other running sequences need for their own tokens: a sequence without room for its drafts
// decodes without them rather than cost another a preemption. With draft_type kNgram and no DraftProposer
// set, the scheduler drafts from n-grams of each sequence's prompt and output itself; with
// draft_adaptive, a DraftController (moe/runtime/speculative.h) picks each sequence's draft length
// per step from the measured step times and the sequence's acceptance, down to none.
//
// Thread-safety: none; the caller serializes every call (the engine's loop thread).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/executor.h"
#include "moe/runtime/speculative.h"
#include "moe/scheduler/block_pool.h"
#include "moe/scheduler/request.h"

namespace moe::scheduler {

// Proposes draft tokens for a decoding sequence (speculative decoding decided in the scheduler:
// n-grams of the prompt and output, or a test's script). The executor verifies them with the
// target's own sampler, so the tokens served are the same with or without drafts; good drafts only
// make a step serve more of them.
class DraftProposer {
 public:
  virtual ~DraftProposer() = default;
  // Appends to `draft` up to `max_draft` tokens likely to follow `tokens` (the prompt and the
  // tokens generated so far) of request `id`.
  virtual void Propose(const std::string& id, std::span<const int32_t> tokens, int max_draft,
                       std::vector<int32_t>* draft) = 0;
};

struct SchedulerConfig {
  int max_batch_tokens = 2048;
  int max_seqs = 64;
  // Requests waiting for a slot beyond the max_seqs that run; Add fails with kResourceExhausted
  // past it. 0: no waiting room, a request that cannot start at once is refused.
  int max_queue = 256;
  int context = 4096;         // prompt + max_new_tokens limit
  int max_prompt_tokens = 0;  // longest prompt accepted; 0: the context less one new token
  // The executor's KV cache and model; Engine::Start fills these in from the executor.
  int block_size = 16;
  int num_blocks = 0;  // KV blocks in the cache
  int vocab_size = 0;
  std::vector<int> eos_token_ids;
  // Drafts a decoding sequence may carry in one step (0: none): those the executor's own drafter
  // proposed in the step before (SequenceChunk::want_drafts asks for them), else a DraftProposer's.
  int max_draft = 0;
  // kNgram: the scheduler's own n-gram drafter proposes (when no DraftProposer is set).
  runtime::SpecType draft_type = runtime::SpecType::kOff;
  // Each sequence's draft length is chosen per step, up to max_draft (else always max_draft).
  bool draft_adaptive = false;
  // Automatic prefix caching (see above).
  bool prefix_cache = true;
  // Folded into every sequence's first block hash: whatever else changes what a block holds for the
  // same tokens (the KV cache's dtype, the model), so that such blocks never match.
  uint64_t prefix_cache_salt = 0;
};

// A prefix-cache salt from what changes a block's contents beyond its tokens: the KV cache's dtype
// as configured ("auto", "bf16", "fp8").
uint64_t PrefixCacheSalt(const std::string& kv_cache_dtype);

struct SchedulerStats {
  int running = 0;
  int waiting = 0;
  int blocks_used = 0;
  int blocks_free = 0;  // blocks_cached of them keep a committed prefix (block_pool.h)
  int blocks_cached = 0;
  int64_t preemptions = 0;
  // Prefix cache, over the life of the scheduler: prompt tokens of admitted sequences looked up,
  // and of them found in the cache (vLLM's prefix_cache_queries and prefix_cache_hits).
  int64_t prefix_queried_tokens = 0;
  int64_t prefix_hit_tokens = 0;
};

// Drafts n-grams of a sequence's own prompt and output (runtime::NgramDraft): no model, good for
// code edits, retrieval and any text that repeats itself.
class NgramProposer : public DraftProposer {
 public:
  explicit NgramProposer(runtime::NgramOptions options = {}) : options_(options) {}
  void Propose(const std::string& id, std::span<const int32_t> tokens, int max_draft,
               std::vector<int32_t>* draft) override;

 private:
  runtime::NgramOptions options_;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);
  ~Scheduler();

  // Queues a request. kInvalidArgument naming the field (empty or out-of-vocabulary token_ids, a
  // prompt longer than max_prompt_tokens or the context, prompt plus max_new_tokens beyond the
  // context, bad sampling values, a duplicate id); kResourceExhausted when no slot is free and
  // the queue is full, or the prompt could never fit the KV cache.
  absl::Status Add(Request request);
  // Ends the request at the next Step (reported as kAborted); unknown ids are ignored.
  // `reason` kStopString ends it as finished (a stop string matched).
  void Abort(const std::string& id, FinishReason reason = FinishReason::kAborted);

  // Runs one step on `executor` and returns what happened to each request it touched.
  std::vector<Output> Step(runtime::Executor& executor, Clock::time_point now = Clock::now());
  // Drafts for decoding sequences from now on (null: none); not owned, must outlive its use.
  void set_proposer(DraftProposer* proposer) { proposer_ = proposer; }
  // The draft-length controller (its step-time measurements), for tests.
  const runtime::DraftController& draft_controller() const { return controller_; }

  bool idle() const { return running_.empty() && waiting_.empty(); }
  SchedulerStats stats() const;

 private:
  struct Sequence;
  // One sequence's chunk in the step being planned: `count` tokens from position `first`, the
  // last `num_draft` of them drafts.
  struct Scheduled {
    Sequence* seq;
    int64_t first;
    int32_t count;
    int32_t num_draft;
  };
  Sequence* Find(const std::string& id);
  // The pieces of a step: end aborted and late requests; pick the chunks under the token budget
  // (admitting waiting requests); build their plan; apply the executor's result.
  void EndAbortedAndLate(Clock::time_point now, std::vector<Output>* outputs);
  std::vector<Scheduled> Schedule(std::vector<Output>* outputs);
  runtime::StepPlan BuildPlan(const std::vector<Scheduled>& scheduled);
  void Apply(const std::vector<Scheduled>& scheduled, runtime::StepResult& result, std::vector<Output>* outputs);
  // Appends the tokens a sequence gained, checking the stop conditions after each; false when
  // the sequence ended (it is gone then).
  bool Accept(Sequence* seq, runtime::SequenceResult& result, std::vector<Output>* outputs);
  // Fills seq->draft for a sequence that decodes this step, within `budget` tokens; its size.
  // `rows` and `tokens`: the rows and served tokens the step is expected to have without its drafts
  // (for the draft-length controller).
  int ProposeDrafts(Sequence* seq, int budget, int rows, int tokens);
  // Gives back the blocks past what seq's committed tokens need (those taken for rejected drafts).
  void TrimBlocks(Sequence* seq);
  // Records a verify's outcome: the sequence's counts and acceptance, and its step's output.
  void CountVerify(Sequence* seq, int drafted, int accepted, std::vector<Output>* outputs);
  void Finish(Sequence* seq, FinishReason reason, absl::Status error, std::vector<Output>* outputs);
  // Makes sure `seq` has blocks for `positions` positions, preempting newer sequences if needed.
  bool EnsureBlocks(Sequence* seq, int64_t positions, bool may_preempt);
  void Preempt(Sequence* seq);
  // Its blocks are gone: the next plan tells the executor its id is no more.
  void Release(Sequence* seq);
  // Prefix cache: the hashes of seq's first `n` full blocks (extended as needed); takes the cached
  // blocks of a sequence being admitted; commits the blocks the sequence has filled since.
  std::span<const BlockHash> HashesOf(Sequence* seq, int64_t n);
  void TakeCachedPrefix(Sequence* seq);
  void CommitFullBlocks(Sequence* seq);
  // Ends `seq` if `token` (just appended) stops it; true when it did (seq is gone then).
  bool CheckStop(Sequence* seq, int32_t token, std::vector<Output>* outputs);
  // The sampling row that draws the token after seq's tokens and its first `draft` drafts.
  runtime::SampleRow SampleRowFor(const Sequence& seq, int draft) const;

  SchedulerConfig config_;
  BlockPool blocks_;
  std::mt19937_64 seeds_;                                       // for requests that bring no seed
  std::map<std::string, std::unique_ptr<Sequence>> sequences_;  // every live request by id
  std::deque<Sequence*> waiting_;                               // FCFS; preempted ones go first
  std::vector<Sequence*> running_;                              // in admission order
  int64_t preemptions_ = 0;
  int64_t prefix_queried_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
  uint64_t cache_generation_ = 0;  // the executor's when the last step began
  uint64_t last_seq_id_ = 0;
  DraftProposer* proposer_ = nullptr;
  NgramProposer ngram_;  // the proposer when draft_type is kNgram and none is set
  runtime::DraftController controller_;
  std::vector<uint64_t> released_;  // ids of sequences released since the last plan
};

}  // namespace moe::scheduler

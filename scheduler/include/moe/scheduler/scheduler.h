// Scheduler: continuous batching of many requests over one model.
//
// Each Step() builds one StepPlan under a token budget (max_batch_tokens) and a cap on running
// sequences (max_seqs): first one decode token for every running sequence, then prefill chunks
// (a long prompt is split over steps while the others keep decoding), then new requests, first
// come first served. KV blocks come from a block allocator and go back the moment a sequence
// finishes, is aborted, fails or passes its deadline. When blocks run out, the newest running
// sequence is preempted (its blocks freed) and recomputed later, rather than failing older ones.
// Every request gets a sampling seed when it is added (a random one when it has none), so its
// tokens do not depend on which executor or process samples them.
//
// Thread-safety: none; the caller serializes every call (the engine's loop thread).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/executor.h"
#include "moe/scheduler/kv_block_allocator.h"
#include "moe/scheduler/request.h"

namespace moe::scheduler {

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
};

struct SchedulerStats {
  int running = 0;
  int waiting = 0;
  int blocks_used = 0;
  int blocks_free = 0;
  int64_t preemptions = 0;
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

  bool idle() const { return running_.empty() && waiting_.empty(); }
  SchedulerStats stats() const;

 private:
  struct Sequence;
  Sequence* Find(const std::string& id);
  void Finish(Sequence* seq, FinishReason reason, absl::Status error, std::vector<Output>* outputs);
  // Makes sure `seq` has blocks for `positions` positions, preempting newer sequences if needed.
  bool EnsureBlocks(Sequence* seq, int64_t positions, bool may_preempt);
  void Preempt(Sequence* seq);
  // Its blocks are gone: the next plan tells the executor its id is no more.
  void Release(Sequence* seq);
  void CheckStop(Sequence* seq, int32_t token, std::vector<Output>* outputs);
  runtime::SampleRow SampleRowFor(const Sequence& seq) const;

  SchedulerConfig config_;
  KvBlockAllocator blocks_;
  std::mt19937_64 seeds_;                                       // for requests that bring no seed
  std::map<std::string, std::unique_ptr<Sequence>> sequences_;  // every live request by id
  std::deque<Sequence*> waiting_;                               // FCFS; preempted ones go first
  std::vector<Sequence*> running_;                              // in admission order
  int64_t preemptions_ = 0;
  uint64_t last_uid_ = 0;
  std::vector<uint64_t> released_;  // ids of sequences released since the last plan
};

}  // namespace moe::scheduler

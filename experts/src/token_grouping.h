// Grouping a call's (token, choice) slots by expert, for the expert pool's schedules: a counting
// sort that every thread of the call shares.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "moe/experts/kernels.h"
#include "moe/experts/packed.h"
#include "phase_timing.h"
#include "worker_crew.h"

namespace moe::experts::internal {

// A call's slots (token, choice) ordered by expert: "positions". Kept across calls; the arrays
// grow as needed and are overwritten by each call.
//
// Thread-safety: one call at a time; written by its TokenGrouping, read by any of the call's
// threads once Run has returned there.
struct TokenGroups {
  std::vector<int32_t> count;     // slots per expert
  std::vector<int32_t> offset;    // each expert's first position; offset[num_experts]: the slots
  std::vector<int32_t> slot_of;   // slot (token * k + choice) of each position
  std::vector<int32_t> token_of;  // token of each position
  // token_positions[t * k .. t * k + k): token t's positions in increasing order, the order in
  // which both schedules sum its expert rows, then -1 for each of its skipped slots (id < 0).
  std::vector<int32_t> token_positions;
  std::vector<int32_t> token_slots;  // slots of each token that are not skipped

  std::vector<const float*> rows;  // input row of each position (unless gathered)
  // [sort chunk x expert]: the chunk's slots of each expert, then the chunk's first position in it.
  std::vector<int32_t> chunk_next;
  Activations tokens_in;  // every token's input row, quantized once (when gathered)
};

// One call's grouping into a TokenGroups, by every thread of the call: each thread of a
// schedule starts in Run, which returns once every slot has its position. First each chunk's
// slots per expert are counted (and, when gathering, its tokens quantized); the thread that
// counts the last chunk derives the offsets and active experts and runs `plan` (the schedule's
// set-up, which needs them) while the others wait; then each chunk lists its tokens' positions
// while each range of experts fills the per-position arrays. Positions within an expert follow
// the token order, as in a serial sort. (A serial sort took 0.14-0.22 ms of a 6 ms call at 1024
// tokens on the 32-core machine, and 0.63-0.83 ms at 4096, the other threads idle once the
// tokens were quantized.)
//
// Thread-safety: SetUp on one thread; then Run on any number of threads at once (the work is
// claimed through atomic counters, and the waits spin: the awaited work is on running threads).
// The results (active(), uniform(), the TokenGroups) may be read on a thread once Run has
// returned there.
class TokenGrouping {
 public:
  static constexpr int64_t kSortTokens = 32;  // tokens per chunk

  // `groups` and `times` are the pool's and must outlive the grouping; topk_ids [num_tokens x
  // top_k] and hidden [num_tokens x h] are the call's.
  TokenGrouping(TokenGroups& groups, PhaseTimes& times, int num_experts, int top_k, int64_t num_tokens,
                const int32_t* topk_ids, const float* hidden, int64_t h)
      : g_(groups),
        times_(times),
        num_experts_(num_experts),
        k_(top_k),
        num_tokens_(num_tokens),
        topk_ids_(topk_ids),
        hidden_(hidden),
        h_(h) {}

  // Sizes the arrays for the call, which `threads` threads share. With `gather` (the batch
  // schedule with int8 and int4), every token's input row is quantized once, into
  // groups.tokens_in laid out for `gate_up`, as its chunk is counted; the experts' rows are then
  // gathered from there instead of being quantized again for each of a token's k experts.
  // Errors: Activations::Reset's.
  absl::Status SetUp(int threads, bool gather, const MatrixLayout& gate_up);

  template <typename Plan>
  void Run(Plan&& plan) {
    for (int64_t q; (q = next_count_.fetch_add(1)) < sort_chunks_;) {
      CountChunk(q);
      if (counted_.fetch_add(1, std::memory_order_acq_rel) + 1 == sort_chunks_) {
        PlanPositions();
        plan();
        planned_.store(1, std::memory_order_release);
      }
    }
    SpinUntil(planned_, 1);  // the planning thread is running: it counted the last chunk
    const int num_experts = num_experts_;
    const int64_t items = sort_chunks_ + expert_ranges_;
    for (int64_t q; (q = next_place_.fetch_add(1)) < items;) {
      if (q < sort_chunks_) {
        PlaceChunk(q);
      } else {
        const int64_t r = q - sort_chunks_;
        PlaceExperts(static_cast<int>(r * num_experts / expert_ranges_),
                     static_cast<int>((r + 1) * num_experts / expert_ranges_));
      }
      placed_.fetch_add(1, std::memory_order_acq_rel);
    }
    SpinUntil(placed_, items);  // likewise: every item was claimed by a running thread
  }

  bool gathered() const { return gather_; }
  // The experts with slots, in increasing order (set before `plan` runs).
  const std::vector<int>& active() const { return active_; }
  // Whether every active expert has the same number of slots (set before `plan` runs).
  bool uniform() const { return uniform_; }

 private:
  void CountChunk(int64_t q);
  void PlanPositions();
  // Lists the positions of chunk q's tokens, each token's in increasing order (the order both
  // schedules sum in).
  void PlaceChunk(int64_t q);
  // Fills the per-position arrays of experts [e0, e1), from a scan of every slot: each thread
  // writes its own range of positions. (Written by token chunks instead, each cache line of them
  // would be written by the chunks of about eight threads; on the 32-core machine either way
  // took the same time within the noise, quantization being most of the sort's share.)
  void PlaceExperts(int e0, int e1);

  TokenGroups& g_;
  PhaseTimes& times_;
  const int num_experts_, k_;
  const int64_t num_tokens_;
  const int32_t* const topk_ids_;
  const float* const hidden_;
  const int64_t h_;
  bool gather_ = false;
  std::vector<const float*> token_rows_;  // hidden's rows, to quantize every token once (gather)
  std::vector<int> active_;
  bool uniform_ = true;
  int64_t sort_chunks_ = 1, expert_ranges_ = 1;
  std::atomic<int64_t> next_count_{0}, counted_{0}, planned_{0}, next_place_{0}, placed_{0};
};

}  // namespace moe::experts::internal

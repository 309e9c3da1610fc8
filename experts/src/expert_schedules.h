// The expert pool's two schedules of a call, and the steps they are made of. See README.md for
// how each came to be what it is.
//
// Decode (few tokens) is bound by streaming the active experts' weights: long contiguous runs
// of them, a few per thread. Batch (many tokens) is bound by the kernels' arithmetic: work items
// per expert, in three queues. Both sum each token's expert rows in position (expert) order, so
// they give the same bits, whatever the thread count or timing.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "first_error.h"
#include "moe/core/memory.h"
#include "moe/experts/expert_pool.h"
#include "moe/experts/kernels.h"
#include "packed_experts.h"
#include "phase_timing.h"
#include "token_grouping.h"
#include "worker_crew.h"

namespace moe::experts::internal {

// Blocks per work item of a batch call: about eight items per thread over the `active` experts'
// matrices of `blocks` blocks, in whole gate+up pairs. Down items are at most kDownItemBlocks.
int64_t BatchItemBlocks(int64_t active, int64_t blocks, int threads);
inline constexpr int64_t kDownItemBlocks = 16;

// What the calls work in, kept across calls and grown as needed. The buffers are never
// zero-filled: every row a call reads was written by it first.
//
// Thread-safety: one call at a time, whose threads share it as ExpertCall says.
struct CallScratch {
  explicit CallScratch(int num_experts) : act_in(num_experts), act_mid(num_experts) {}

  TokenGroups groups;
  core::AlignedBuffer inter;                 // [positions x I] floats
  core::AlignedBuffer expert_out;            // [positions x (H_pad + 16)] floats
  std::vector<Activations> act_in, act_mid;  // per expert
};

// One call: the slots grouped by expert, the active experts, and the steps both schedules are
// made of.
//
// Thread-safety: made and set up on the thread that runs the call; its steps then run on every
// thread of the call's broadcast at once, each on the work items it claimed from the schedule's
// atomic counters. An expert's input is prepared by whichever thread gets there first (in_state).
struct ExpertCall {
  // Everything referred to must outlive the call: the pool's (`pool` for its shape, options and
  // kernel choice; its experts, scratch and phase times) and the caller's arrays.
  ExpertCall(const ExpertPool& pool, const PackedExperts& experts, CallScratch& scratch, PhaseTimes& times, int layer,
             int64_t num_tokens, const int32_t* topk_ids, const float* hidden, const float* topk_weights, float* out);

  // Grows the scratch for the call and sizes its arrays; `batch`: for the batch schedule.
  // kResourceExhausted when the memory cannot be had.
  absl::Status SetUp(bool batch);

  float WeightOf(int64_t pos) const { return topk_weights[g.slot_of[pos]]; }
  // Expert e's kernel for a matrix of `layout`'s format.
  MatmulKernel KernelOf(int e, const MatrixLayout& layout) const {
    return GetKernel(pool.KernelFor(g.count[e]), layout.format);
  }

  // Prepares expert e's input activations unless another thread has started to; true if this
  // call did.
  bool StartInput(int e);
  // Expert e's input activations, prepared here or waited for.
  const Activations& Input(int e);
  // Gate and up blocks [b0, b1) of expert e, then SiLU(gate) * up into its intermediate rows.
  void GateUp(int e, const Activations& act, int64_t b0, int64_t b1);
  // Input, then GateUp, unless the call has failed (or fails preparing the input).
  void InputAndGateUp(int e, int64_t b0, int64_t b1);
  // Expert e's intermediate rows as the down kernel's activations.
  void PrepareMid(int e);
  // Down blocks [b0, b1) of expert e into its expert rows.
  void Down(int e, int64_t b0, int64_t b1);
  // out[t][c0, c1) = the weighted sum of token t's expert rows, in the order of their positions
  // (by expert), the order the batch schedule sums in too.
  void Reduce(int64_t t, int64_t c0, int64_t c1);

  // The slot of expert e's input activations: with one token every expert that has it once
  // shares the first such expert's (one row). An expert a row names more than once (hybrid
  // execution fills the slots it hands to the GPU with an expert the row reads anyway) has its own.
  int InputSlot(int e) const {
    if (num_tokens != 1 || g.count[e] != 1) return e;
    for (int a : grouping.active()) {
      if (g.count[a] == 1) return a;
    }
    return e;
  }

  const ExpertPool& pool;
  const PackedExperts experts;  // ForLayer(layer): the call's layer's layouts
  CallScratch& s;
  TokenGroups& g;
  PhaseTimes& times;
  TokenGrouping grouping;
  const int layer;
  const int64_t num_tokens;
  const float* const topk_weights;
  float* const out;
  const int64_t h, inter;
  // Row strides of the products are padded by one cache line: a power-of-two stride would put
  // every token's row in the same few L1 sets.
  const int64_t out_ld;
  float* inter_rows = nullptr;
  float* out_rows = nullptr;
  FirstError error;
  // An expert's input activations are prepared by the first work item that needs them (the
  // others wait: the preparing thread is running). With one token every expert reads the same
  // row, so they are prepared once, in the first active expert's slot. When gathered, the rows
  // were quantized once per token (g.tokens_in) and are copied from there.
  std::unique_ptr<std::atomic<int64_t>[]> in_state;  // per expert: 0, 1 being prepared, 2 ready
};

// Runs the call on the crew (from the lead): the decode schedule for few tokens, the batch
// schedule for more. Errors land in c.error.
void RunDecode(ExpertCall& c, Crew& crew);
void RunBatch(ExpertCall& c, Crew& crew);

}  // namespace moe::experts::internal

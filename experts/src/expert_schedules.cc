#include "expert_schedules.h"

#include <immintrin.h>

#include <algorithm>
#include <utility>

#include "absl/container/inlined_vector.h"

namespace moe::experts::internal {

using Timed = PhaseTimes::Timed;

int64_t BatchItemBlocks(int64_t active, int64_t blocks, int threads) {
  return std::max<int64_t>(2, (active * blocks / (8 * threads) + 1) / 2 * 2);
}

ExpertCall::ExpertCall(const ExpertPool& pool, const PackedExperts& experts, CallScratch& scratch, PhaseTimes& times,
                       int layer, int64_t num_tokens, const int32_t* topk_ids, const float* hidden,
                       const float* topk_weights, float* out)
    : pool(pool),
      experts(experts.ForLayer(layer)),
      s(scratch),
      g(scratch.groups),
      times(times),
      grouping(scratch.groups, times, pool.shape().num_experts, pool.shape().top_k, num_tokens, topk_ids, hidden,
               pool.shape().hidden),
      layer(layer),
      num_tokens(num_tokens),
      topk_weights(topk_weights),
      out(out),
      h(pool.shape().hidden),
      inter(pool.shape().intermediate),
      out_ld(experts.down.n_pad + 16) {}

absl::Status ExpertCall::SetUp(bool batch) {
  const int num_experts = pool.shape().num_experts;
  const int64_t slots = num_tokens * pool.shape().top_k;
  for (auto [buffer, floats] : {std::pair{&s.inter, slots * inter}, std::pair{&s.expert_out, slots * out_ld}}) {
    if (buffer->size() >= static_cast<size_t>(floats) * sizeof(float)) continue;
    auto grown = core::AlignedBuffer::Allocate(static_cast<size_t>(floats) * sizeof(float));
    if (!grown.ok()) return grown.status();
    *buffer = std::move(*grown);
  }
  inter_rows = s.inter.as<float>();
  out_rows = s.expert_out.as<float>();
  // Batch schedule with int8/int4: every token's input row is quantized once (while the slots
  // are counted), and each expert's rows are gathered from there.
  const bool gather = batch && !TakesFloatActivations(experts.gate_up.format);
  if (absl::Status st = grouping.SetUp(pool.threads(), gather, experts.gate_up); !st.ok()) return st;
  in_state.reset(new std::atomic<int64_t>[num_experts]);
  for (int e = 0; e < num_experts; ++e) in_state[e].store(0, std::memory_order_relaxed);
  return absl::OkStatus();
}

bool ExpertCall::StartInput(int e) {
  const int slot = InputSlot(e);
  int64_t expected = 0;
  if (!in_state[slot].compare_exchange_strong(expected, 1)) return false;
  Timed timed(times, Work::kInput);
  if (grouping.gathered()) {
    error.Set(s.act_in[slot].Gather(g.tokens_in, g.token_of.data() + g.offset[slot], g.count[slot],
                                    pool.KernelFor(g.count[slot])));
  } else {
    error.Set(s.act_in[slot].Prepare(g.rows.data() + g.offset[slot], g.count[slot], h, experts.gate_up.k_pad,
                                     pool.KernelFor(g.count[slot]), experts.gate_up.format, SumGroup(experts.gate_up)));
  }
  in_state[slot].store(2, std::memory_order_release);
  return true;
}

const Activations& ExpertCall::Input(int e) {
  const int slot = InputSlot(e);
  if (!StartInput(e)) {
    Timed timed(times, Work::kInput);
    SpinUntil(in_state[slot], 2);
  }
  return s.act_in[slot];
}

// Gate and up blocks alternate in the fused matrix: one kernel call over blocks [b0, b1) yields
// both, then SiLU(gate) * up goes into the intermediate rows. A kernel with a fused form (AMX
// int8) applies the SiLU as it finishes each pass, while the tiles compute the next (at 1024
// tokens on the 32-core machine the separate SiLU took 9% of the thread time, and the call was
// 0-6% slower). Otherwise long ranges go in pieces whose products stay in L2 until the SiLU
// reads them.
void ExpertCall::GateUp(int e, const Activations& act, int64_t b0, int64_t b1) {
  const int64_t m = g.count[e], base = g.offset[e];
  const PackedMatrix w = experts.GateUp(layer, e);
  if (const SwiGluKernel fused = GetSwiGluKernel(pool.KernelFor(m), w.layout.format); fused != nullptr) {
    Timed timed(times, Work::kGateUp);
    fused(w, act, b0, b1, inter, inter_rows + base * inter + b0 / 2 * 16, inter);
    return;
  }
  const MatmulKernel kernel = KernelOf(e, w.layout);
  const int64_t piece = std::max<int64_t>(2, 4096 / m / 2 * 2);  // blocks: at most 256 KB of products
  thread_local std::vector<float> tmp;
  for (int64_t p0 = b0; p0 < b1; p0 += piece) {
    const int64_t p1 = std::min(b1, p0 + piece), ld = (p1 - p0) * 16 + 16;
    if (tmp.size() < static_cast<size_t>(m * ld)) tmp.resize(m * ld);
    {
      Timed timed(times, Work::kGateUp);
      kernel(w, act, p0, p1, tmp.data(), ld);
    }
    Timed timed(times, Work::kSilu);
    for (int64_t b = p0; b < p1; b += 2) {
      const int64_t unit = b / 2 * 16, n = std::min<int64_t>(16, inter - unit);
      if (n <= 0) continue;
      const float* pair = tmp.data() + (b - p0) * 16;
      for (int64_t i = 0; i < m; ++i) {
        SiluMul(pair + i * ld, pair + i * ld + 16, n, inter_rows + (base + i) * inter + unit);
      }
    }
  }
}

void ExpertCall::InputAndGateUp(int e, int64_t b0, int64_t b1) {
  if (error.failed()) return;
  const Activations& act = Input(e);
  if (!error.failed()) GateUp(e, act, b0, b1);
}

void ExpertCall::PrepareMid(int e) {
  Timed timed(times, Work::kIntermediate);
  error.Set(s.act_mid[e].Prepare(inter_rows + g.offset[e] * inter, g.count[e], inter, experts.down.k_pad,
                                 pool.KernelFor(g.count[e]), experts.down.format, SumGroup(experts.down)));
}

void ExpertCall::Down(int e, int64_t b0, int64_t b1) {
  Timed timed(times, Work::kDown);
  KernelOf(e, experts.down)(experts.Down(layer, e), s.act_mid[e], b0, b1, out_rows + g.offset[e] * out_ld + b0 * 16, out_ld);
}

void ExpertCall::Reduce(int64_t t, int64_t c0, int64_t c1) {
  Timed timed(times, Work::kReduce);
  const int k = g.token_slots[t];  // its positions come first; skipped slots have none
  const int32_t* pos = g.token_positions.data() + t * pool.shape().top_k;
  absl::InlinedVector<const float*, 16> rows(k);
  absl::InlinedVector<float, 16> weights(k);
  for (int i = 0; i < k; ++i) {
    rows[i] = out_rows + pos[i] * out_ld + c0;
    weights[i] = WeightOf(pos[i]);
  }
  SumScaledRows(rows.data(), weights.data(), k, c1 - c0, out + t * h + c0);
}

// Decode schedule: few tokens, so the call is bound by streaming the active experts' weights.
// The gate+up block pairs of all active experts, concatenated, are cut into a few contiguous
// units per thread (long sequential streams, few starts), and so are the down block pairs;
// threads claim units in order. An expert's intermediate activations are prepared by the thread
// that completes its last gate+up unit; a down unit waits for its experts (they are in progress
// on running threads, since every gate+up unit is claimed before any down unit). Then a reduce
// over (token, column) chunks once every down unit is done.
void RunDecode(ExpertCall& c, Crew& crew) {
  const MatrixLayout &gate_up = c.experts.gate_up, &down = c.experts.down;
  const int num_experts = c.pool.shape().num_experts;
  const int64_t pairs1 = gate_up.blocks() / 2, pairs2 = (down.blocks() + 1) / 2;
  const int64_t units = static_cast<int64_t>(c.pool.threads()) * std::max(1, c.pool.options().decode_units_per_thread);
  constexpr int64_t kReduceColumns = 512;
  const int64_t col_chunks = (c.h + kReduceColumns - 1) / kReduceColumns, chunks3 = c.num_tokens * col_chunks;
  std::atomic<int64_t> next1{0}, next2{0}, next3{0}, done2{0};
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[num_experts]);   // gate+up pairs to go
  std::unique_ptr<std::atomic<int64_t>[]> ready(new std::atomic<int64_t>[num_experts]);  // 1: act_mid prepared
  int64_t n_active = 0, units1 = 0, units2 = 0;  // set by plan, once the slots are counted
  const std::vector<int>& active = c.grouping.active();
  auto plan = [&] {
    n_active = static_cast<int64_t>(active.size());
    units1 = std::min(units, n_active * pairs1);
    units2 = std::min(units, n_active * pairs2);
    for (int64_t i = 0; i < n_active; ++i) {
      left[i].store(pairs1, std::memory_order_relaxed);
      ready[i].store(0, std::memory_order_relaxed);
    }
  };
  // Runs f(expert index, first pair, end pair) over the concatenated pairs of unit u.
  auto for_unit = [&](int64_t u, int64_t units_n, int64_t pairs, auto&& f) {
    const int64_t total = n_active * pairs;
    for (int64_t q = u * total / units_n, q1 = (u + 1) * total / units_n; q < q1;) {
      const int64_t i = q / pairs, end = std::min(q1, (i + 1) * pairs);
      f(i, q - i * pairs, end - i * pairs);
      q = end;
    }
  };
  auto worker = [&] {
    c.grouping.Run(plan);
    for (int64_t u; (u = next1.fetch_add(1)) < units1;) {
      for_unit(u, units1, pairs1, [&](int64_t i, int64_t p0, int64_t p1) {
        const int e = active[i];
        c.InputAndGateUp(e, 2 * p0, 2 * p1);
        if (left[i].fetch_sub(p1 - p0) == p1 - p0) {
          if (!c.error.failed()) c.PrepareMid(e);
          ready[i].store(1, std::memory_order_release);
        }
      });
    }
    for (int64_t u; (u = next2.fetch_add(1)) < units2;) {
      for_unit(u, units2, pairs2, [&](int64_t i, int64_t p0, int64_t p1) {
        SpinUntil(ready[i], 1);
        if (!c.error.failed()) c.Down(active[i], 2 * p0, std::min(2 * p1, down.blocks()));
      });
      done2.fetch_add(1, std::memory_order_release);
    }
    if (next3.load() >= chunks3) return;
    SpinUntil(done2, units2);
    for (int64_t r; (r = next3.fetch_add(1)) < chunks3;) {
      const int64_t c0 = r % col_chunks * kReduceColumns;
      c.Reduce(r / col_chunks, c0, std::min(c.h, c0 + kReduceColumns));
    }
  };
  crew.Broadcast(worker);
}

// Batch schedule: many tokens per expert, so the kernels' arithmetic matters, and so does the
// memory traffic besides the weights.
//  1. (int8, int4) Every token's input row is quantized once, in parallel (with the counting of
//     the slots, TokenGrouping::Run); an expert's input rows are gathered from there (a copy of
//     int8 rows) instead of quantizing each token again for each of its k experts.
//  2. Every thread runs one loop over three queues, claimed with atomic counters, first come
//     first served in this order of preference:
//     - down items of at most 16 blocks, released per expert by the thread that finishes the
//       expert's gate+up and prepares its intermediate activations;
//     - reduce tasks (a token's columns, up to 128 blocks), queued by the thread that writes
//       the last of the token's k expert rows for them;
//     - gate+up items in expert order, about 8 per thread over the layer, the last experts'
//       four times finer, so that the call does not end on a long item. An expert's first
//       item also gathers the input rows of the expert two ahead, which the next items need
//       soon (a claimed item whose input is still being gathered waits for it).
//     Down projections and sums thus overlap the other experts' gate+up, and at the end of the
//     call every thread shares the last experts' down items and the sums, most of which only
//     become ready then (a token is done when the last of its experts is). When the last
//     writer did its own sums, threads were idle 5-9% of a 1024-token call at its end on the
//     32-core machine; with the queue, 0.2%.
//  3. Each sum runs in position (expert) order, as the decode schedule's reduce: the result
//     does not depend on the timing.
// (Splitting the down projection by output columns instead, each thread running every expert
// for its columns and summing in place, saves the expert-row buffer but was 15-50% slower at
// 1024 tokens on the 32-core machine: each thread then reads 128 short weight streams, and every
// expert's activations. With per-expert down items of 8 blocks run in expert order along each
// chain of output columns, adding in place, it was still 13-17% slower: the chains lag behind
// the gate+up and the adds read lines last written by other cores; see README.md.)
void RunBatch(ExpertCall& c, Crew& crew) {
  const int num_experts = c.pool.shape().num_experts;
  const int threads = c.pool.threads();
  struct Item {
    int64_t index;  // in active
    int64_t b0, b1;
  };
  constexpr int64_t kReduceBlocks = 128;
  const int64_t gu_blocks = c.experts.gate_up.blocks(), down_blocks = c.experts.down.blocks();
  const std::vector<int>& active = c.grouping.active();
  // The queues, set up by plan once the slots are counted (the other threads wait for it).
  int64_t n_active = 0;
  std::vector<Item> stage1;  // gate+up items
  // Per expert: its gate+up items to go.
  std::unique_ptr<std::atomic<int>[]> remaining(new std::atomic<int>[num_experts]);
  int64_t chunk2 = 0, per_expert = 0, total_down = 0, reduce_blocks = 0, col_chunks = 0, total_reduce = 0;
  std::unique_ptr<std::atomic<int>[]> items_left;  // [expert x reduce chunk]: down items to go
  std::unique_ptr<std::atomic<int>[]> rows_left;   // [token x reduce chunk]: expert rows to go
  // Released experts, in release order: slot i is valid once released[i] is set.
  std::vector<int> release_order(num_experts);
  std::unique_ptr<std::atomic<int>[]> released(new std::atomic<int>[num_experts]);
  // Reduce tasks (token * col_chunks + chunk) whose k expert rows are written, in that order.
  std::vector<int64_t> reduce_order;
  std::unique_ptr<std::atomic<int>[]> reduce_ready;
  std::atomic<int64_t> next_push{0}, next_reduce{0};
  auto plan = [&] {
    n_active = static_cast<int64_t>(active.size());
    auto chunk_for = [&](int64_t blocks) {
      return c.grouping.uniform() ? int64_t{2} : BatchItemBlocks(n_active, blocks, threads);
    };
    // Gate+up items, expert after expert; the last experts' (about one item per thread) are cut
    // four times finer.
    const int64_t chunk1 = chunk_for(gu_blocks);
    const int64_t fine1 = std::max<int64_t>(2, chunk1 / 4 / 2 * 2);
    const int64_t tail_experts = std::min<int64_t>(n_active, (threads * chunk1 + gu_blocks - 1) / gu_blocks);
    for (int64_t i = 0; i < n_active; ++i) {
      const int e = active[i];
      const int64_t chunk = i < n_active - tail_experts ? chunk1 : fine1;
      int items = 0;
      for (int64_t b = 0; b < gu_blocks; b += chunk, ++items) stage1.push_back({i, b, std::min(gu_blocks, b + chunk)});
      remaining[e].store(items, std::memory_order_relaxed);
      released[i].store(0, std::memory_order_relaxed);
    }
    // Down items: the same cut for every expert, released expert by expert.
    chunk2 = std::min(kDownItemBlocks, chunk_for(down_blocks));
    per_expert = (down_blocks + chunk2 - 1) / chunk2;
    total_down = n_active * per_expert;
    // A token's columns are summed in reduce chunks of several down items, so that a chunk's
    // last writer is found with one count per expert and chunk plus one per token and chunk.
    // (Whole rows of 2048 columns were 1-10% faster than chunks of 1024 in three paired rounds.)
    reduce_blocks = chunk2 * std::max<int64_t>(1, kReduceBlocks / chunk2);
    col_chunks = (down_blocks + reduce_blocks - 1) / reduce_blocks;
    items_left.reset(new std::atomic<int>[num_experts * col_chunks]);
    for (int e : active) {
      for (int64_t r = 0; r < col_chunks; ++r) {
        const int64_t first = r * reduce_blocks / chunk2, end = std::min(per_expert, (r + 1) * reduce_blocks / chunk2);
        items_left[e * col_chunks + r].store(static_cast<int>(end - first), std::memory_order_relaxed);
      }
    }
    total_reduce = c.num_tokens * col_chunks;
    rows_left.reset(new std::atomic<int>[total_reduce]);
    for (int64_t i = 0; i < total_reduce; ++i) {
      rows_left[i].store(c.g.token_slots[i / col_chunks], std::memory_order_relaxed);
    }
    reduce_order.resize(total_reduce);
    reduce_ready.reset(new std::atomic<int>[total_reduce]);
    for (int64_t i = 0; i < total_reduce; ++i) reduce_ready[i].store(0, std::memory_order_relaxed);
    // A token whose every slot is skipped has no expert row to wait for: its sums (zeros) are
    // ready now.
    for (int64_t i = 0; i < total_reduce; ++i) {
      if (c.g.token_slots[i / col_chunks] != 0) continue;
      const int64_t slot = next_push.fetch_add(1, std::memory_order_relaxed);
      reduce_order[slot] = i;
      reduce_ready[slot].store(1, std::memory_order_release);
    }
  };
  std::atomic<int64_t> next_gu{0}, next_release{0}, next_down{0};

  auto run_down = [&](int64_t d) {
    const int e = release_order[d / per_expert];
    const int64_t b0 = d % per_expert * chunk2, b1 = std::min(down_blocks, b0 + chunk2);
    if (!c.error.failed()) c.Down(e, b0, b1);
    Timed timed(c.times, Work::kReduce);
    const int64_t chunk = b0 / reduce_blocks;
    if (items_left[e * col_chunks + chunk].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    for (int32_t pos = c.g.offset[e]; pos < c.g.offset[e + 1]; ++pos) {
      const int64_t task = c.g.token_of[pos] * col_chunks + chunk;
      if (rows_left[task].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      const int64_t slot = next_push.fetch_add(1, std::memory_order_relaxed);
      reduce_order[slot] = task;
      reduce_ready[slot].store(1, std::memory_order_release);
    }
  };
  auto run_reduce = [&](int64_t r) {
    if (c.error.failed()) return;
    const int64_t task = reduce_order[r], t = task / col_chunks, chunk = task % col_chunks;
    c.Reduce(t, chunk * reduce_blocks * 16, std::min(c.h, (chunk + 1) * reduce_blocks * 16));
  };
  // Claims the next item of a queue whose slot i holds an item once ready[i] is set.
  auto claim = [](std::atomic<int64_t>& next, int64_t total, int64_t per_slot, const std::atomic<int>* ready,
                  int64_t* item) {
    for (int64_t cur = next.load(std::memory_order_relaxed); cur < total;) {
      if (ready[cur / per_slot].load(std::memory_order_acquire) == 0) return false;
      if (next.compare_exchange_weak(cur, cur + 1, std::memory_order_relaxed)) {
        *item = cur;
        return true;
      }
    }
    return false;
  };
  auto worker = [&] {
    c.grouping.Run(plan);
    for (;;) {
      int64_t d;
      if (claim(next_down, total_down, per_expert, released.get(), &d)) {
        run_down(d);
        continue;
      }
      if (claim(next_reduce, total_reduce, 1, reduce_ready.get(), &d)) {
        run_reduce(d);
        continue;
      }
      if (next_gu.load(std::memory_order_relaxed) < static_cast<int64_t>(stage1.size())) {
        const int64_t g = next_gu.fetch_add(1);
        if (g < static_cast<int64_t>(stage1.size())) {
          const Item& it = stage1[g];
          const int e = active[it.index];
          // The first item of each expert also prepares the input of the expert two ahead, so
          // that the items of one expert, claimed at nearly the same time, seldom wait for it.
          if (it.b0 == 0 && it.index + 2 < n_active) c.StartInput(active[it.index + 2]);
          c.InputAndGateUp(e, it.b0, it.b1);
          if (remaining[e].fetch_sub(1, std::memory_order_acq_rel) == 1) {
            if (!c.error.failed()) c.PrepareMid(e);
            const int64_t slot = next_release.fetch_add(1);
            release_order[slot] = e;
            released[slot].store(1, std::memory_order_release);
          }
          continue;
        }
      }
      if (next_reduce.load(std::memory_order_relaxed) >= total_reduce) return;
      _mm_pause();  // the last items are running on other threads
    }
  };
  crew.Broadcast(worker);
}

}  // namespace moe::experts::internal

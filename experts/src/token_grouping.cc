#include "token_grouping.h"

#include <algorithm>

#include "absl/container/inlined_vector.h"
#include "packed_experts.h"

namespace moe::experts::internal {

using Timed = PhaseTimes::Timed;

absl::Status TokenGrouping::SetUp(int threads, bool gather, const MatrixLayout& gate_up) {
  if (gather) {
    if (absl::Status st =
            g_.tokens_in.Reset(num_tokens_, h_, gate_up.k_pad, KernelKind::kVnni, gate_up.format, SumGroup(gate_up));
        !st.ok()) {
      return st;
    }
    token_rows_.resize(num_tokens_);
    for (int64_t t = 0; t < num_tokens_; ++t) token_rows_[t] = hidden_ + t * h_;
    gather_ = true;
  }
  sort_chunks_ = std::max<int64_t>(1, (num_tokens_ + kSortTokens - 1) / kSortTokens);
  expert_ranges_ = sort_chunks_ == 1 ? 1 : std::min<int64_t>(num_experts_, threads);
  const int64_t slots = num_tokens_ * k_;
  g_.chunk_next.resize(sort_chunks_ * num_experts_);
  g_.slot_of.resize(slots);
  g_.token_of.resize(slots);
  g_.token_positions.resize(slots);
  g_.token_slots.resize(num_tokens_);
  if (!gather_) g_.rows.resize(slots);
  return absl::OkStatus();
}

// The loops below read the counts into locals first: the int32 stores could otherwise alias the
// members, which the compiler would then load again at every step.
void TokenGrouping::CountChunk(int64_t q) {
  Timed timed(times_, Work::kSort);
  const int num_experts = num_experts_, k = k_;
  const int64_t t0 = q * kSortTokens, t1 = std::min(num_tokens_, t0 + kSortTokens);
  int32_t* n = g_.chunk_next.data() + q * num_experts;
  std::fill(n, n + num_experts, 0);
  // A skipped slot (id < 0) has no position; a token's own count of slots sizes its sums.
  for (int64_t t = t0; t < t1; ++t) {
    int32_t slots = 0;
    for (int j = 0; j < k; ++j) {
      const int32_t e = topk_ids_[t * k + j];
      if (e < 0) continue;
      ++n[e];
      ++slots;
    }
    g_.token_slots[t] = slots;
  }
  if (gather_) g_.tokens_in.FillRows(token_rows_.data(), t0, t1);
}

void TokenGrouping::PlanPositions() {
  Timed timed(times_, Work::kSort);
  const int num_experts = num_experts_;
  g_.count.assign(num_experts, 0);
  g_.offset.assign(num_experts + 1, 0);
  for (int64_t q = 0; q < sort_chunks_; ++q) {
    for (int e = 0; e < num_experts; ++e) g_.count[e] += g_.chunk_next[q * num_experts + e];
  }
  for (int e = 0; e < num_experts; ++e) g_.offset[e + 1] = g_.offset[e] + g_.count[e];
  std::vector<int32_t> next(g_.offset.begin(), g_.offset.end() - 1);
  for (int64_t q = 0; q < sort_chunks_; ++q) {
    for (int e = 0; e < num_experts; ++e) {
      int32_t& n = g_.chunk_next[q * num_experts + e];
      const int32_t slots = n;
      n = next[e];
      next[e] += slots;
    }
  }
  for (int e = 0; e < num_experts; ++e) {
    if (g_.count[e] == 0) continue;
    uniform_ = uniform_ && (active_.empty() || g_.count[e] == g_.count[active_[0]]);
    active_.push_back(e);
  }
}

void TokenGrouping::PlaceChunk(int64_t q) {
  Timed timed(times_, Work::kSort);
  const int k = k_;
  const int64_t t0 = q * kSortTokens, t1 = std::min(num_tokens_, t0 + kSortTokens);
  int32_t* next = g_.chunk_next.data() + q * num_experts_;
  for (int64_t t = t0; t < t1; ++t) {
    int32_t* mine = g_.token_positions.data() + t * k;
    int placed = 0;
    for (int j = 0; j < k; ++j) {
      const int32_t e = topk_ids_[t * k + j];
      if (e < 0) continue;
      const int32_t pos = next[e]++;
      int x = placed++;
      for (; x > 0 && mine[x - 1] > pos; --x) mine[x] = mine[x - 1];
      mine[x] = pos;
    }
    std::fill(mine + placed, mine + k, -1);
  }
}

void TokenGrouping::PlaceExperts(int e0, int e1) {
  Timed timed(times_, Work::kSort);
  const int k = k_;
  absl::InlinedVector<int32_t, 16> next(g_.offset.begin() + e0, g_.offset.begin() + e1);
  for (int64_t t = 0; t < num_tokens_; ++t) {
    for (int j = 0; j < k; ++j) {
      const int e = topk_ids_[t * k + j];
      if (e < e0 || e >= e1) continue;
      const int32_t pos = next[e - e0]++;
      g_.slot_of[pos] = static_cast<int32_t>(t * k + j);
      g_.token_of[pos] = static_cast<int32_t>(t);
      if (!gather_) g_.rows[pos] = hidden_ + t * h_;
    }
  }
}

}  // namespace moe::experts::internal

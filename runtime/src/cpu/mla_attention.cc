#include "cpu/mla_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/kernels.h"

namespace moe::runtime::internal {
namespace {

// The latent row of position p of a sequence whose block table row is `table`.
const float* LatentRow(const MlaDims& d, const PagedLatent& cache, const int32_t* table, int64_t p) {
  const int64_t width = d.latent();
  return cache.rows +
         (static_cast<int64_t>(table[p / cache.block_size]) * cache.block_size + p % cache.block_size) * width;
}

// scores[0..n) -> softmax weights in place (max subtracted first), with std::exp.
void Softmax(float* scores, int64_t n) {
  float max_score = -INFINITY;
  for (int64_t p = 0; p < n; ++p) max_score = std::max(max_score, scores[p]);
  float sum = 0;
  for (int64_t p = 0; p < n; ++p) {
    scores[p] = std::exp(scores[p] - max_score);
    sum += scores[p];
  }
  const float inv = 1.0f / sum;
  for (int64_t p = 0; p < n; ++p) scores[p] *= inv;
}

}  // namespace

void RotateMla(float* x, int rope, const float* inv_freq, int32_t position, float attention_factor, bool interleave) {
  const int half = rope / 2;
  const float pos = static_cast<float>(position);
  for (int i = 0; i < half; ++i) {
    const float angle = pos * inv_freq[i];
    const float c = std::cos(angle) * attention_factor, s = std::sin(angle) * attention_factor;
    const int i0 = interleave ? 2 * i : i, i1 = interleave ? 2 * i + 1 : i + half;
    const float a = x[i0], b = x[i1];
    x[i0] = a * c - b * s;
    x[i1] = b * c + a * s;
  }
}

void MlaAttendExpanded(const MlaDims& d, const float* kv_b, const PagedLatent& cache, const MlaQueries& q, int seq,
                       ParallelLoop parallel) {
  const int32_t first = q.seq_start[seq], last = q.seq_start[seq + 1];
  if (first == last) return;
  int64_t len = 0;  // keys any of the chunk's rows sees
  for (int32_t r = first; r < last; ++r) len = std::max<int64_t>(len, q.positions[r] + 1);
  const int32_t* table = q.block_table + static_cast<int64_t>(seq) * q.max_blocks;
  const int64_t per_head = d.nope + d.v;
  // Every head's [k_nope | v] of every position: [len x heads x (nope + v)].
  thread_local std::vector<float> kv;
  kv.resize(static_cast<size_t>(len * d.heads * per_head));
  float* expanded = kv.data();
  parallel(len, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* latent = LatentRow(d, cache, table, p);
      float* out = expanded + p * d.heads * per_head;
      for (int64_t j = 0; j < d.heads * per_head; ++j) out[j] = DotF32(latent, kv_b + j * d.lora, d.lora);
    }
  });
  const int64_t q_width = static_cast<int64_t>(d.heads) * d.qk(), out_width = static_cast<int64_t>(d.heads) * d.v;
  parallel(static_cast<int64_t>(last - first) * d.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = first + i / d.heads;
      const int h = static_cast<int>(i % d.heads);
      const int64_t n = q.positions[r] + 1;
      const float* qh = q.q + r * q_width + static_cast<int64_t>(h) * d.qk();
      scores.resize(n);
      for (int64_t p = 0; p < n; ++p) {
        const float* k_nope = expanded + (p * d.heads + h) * per_head;
        const float* k_rope = LatentRow(d, cache, table, p) + d.lora;
        scores[p] = (DotF32(qh, k_nope, d.nope) + DotF32(qh + d.nope, k_rope, d.rope)) * q.scale;
      }
      Softmax(scores.data(), n);
      float* o = q.out + r * out_width + static_cast<int64_t>(h) * d.v;
      std::fill(o, o + d.v, 0.0f);
      for (int64_t p = 0; p < n; ++p) Axpy(scores[p], expanded + (p * d.heads + h) * per_head + d.nope, d.v, o);
    }
  });
}

void MlaAttendAbsorbed(const MlaDims& d, const float* kv_b, const PagedLatent& cache, const MlaQueries& q,
                       int first_seq, int num_seqs, AttentionIsa isa, ParallelLoop parallel, AttentionScratch& scratch,
                       std::vector<float>* q_abs, std::vector<float>* o_abs) {
  const int32_t first = q.seq_start[first_seq], last = q.seq_start[first_seq + num_seqs];
  if (first == last) return;
  const int64_t per_head = d.nope + d.v, width = d.latent();
  const int64_t q_width = static_cast<int64_t>(d.heads) * d.qk(), out_width = static_cast<int64_t>(d.heads) * d.v;
  // Rows are indexed as in the step (the kernel reads row r at r), so the buffers hold rows [0, last).
  const size_t need = static_cast<size_t>(last) * d.heads * width;
  if (q_abs->size() < need) q_abs->resize(need);
  if (o_abs->size() < need) o_abs->resize(need);
  float* qa = q_abs->data();
  float* oa = o_abs->data();
  // Each head's query in latent space, q_nope . W_UK[h], beside its rotated q_rope.
  parallel(static_cast<int64_t>(last - first) * d.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = first + i / d.heads;
      const int h = static_cast<int>(i % d.heads);
      const float* qh = q.q + r * q_width + static_cast<int64_t>(h) * d.qk();
      const float* w_uk = kv_b + h * per_head * d.lora;  // [nope x lora]
      float* out = qa + (r * d.heads + h) * width;
      std::fill(out, out + d.lora, 0.0f);
      for (int c = 0; c < d.nope; ++c) Axpy(qh[c], w_uk + static_cast<int64_t>(c) * d.lora, d.lora, out);
      std::copy(qh + d.nope, qh + d.qk(), out + d.lora);
    }
  });
  const PagedKv kv{cache.rows, cache.rows, cache.block_size, 1, d.latent()};
  const AttentionQueries queries{qa,          oa,
                                 d.heads,     q.scale,
                                 q.positions, q.seq_start + first_seq,
                                 num_seqs,    q.block_table + static_cast<int64_t>(first_seq) * q.max_blocks,
                                 q.max_blocks};
  PagedAttention(kv, queries, isa, parallel, scratch);
  // Back from latent space: W_UV[h] . o_latent (the output's first kv_lora values).
  parallel(static_cast<int64_t>(last - first) * d.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = first + i / d.heads;
      const int h = static_cast<int>(i % d.heads);
      const float* w_uv = kv_b + (h * per_head + d.nope) * d.lora;  // [v x lora]
      const float* o_latent = oa + (r * d.heads + h) * width;
      float* o = q.out + r * out_width + static_cast<int64_t>(h) * d.v;
      for (int j = 0; j < d.v; ++j) o[j] = DotF32(w_uv + static_cast<int64_t>(j) * d.lora, o_latent, d.lora);
    }
  });
}

}  // namespace moe::runtime::internal

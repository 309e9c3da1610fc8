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

void MlaAttendAbsorbed(const MlaDims& d, const float* kv_b, const PagedLatent& cache, const MlaQueries& q, int seq,
                       ParallelLoop parallel) {
  const int32_t first = q.seq_start[seq], last = q.seq_start[seq + 1];
  const int32_t* table = q.block_table + static_cast<int64_t>(seq) * q.max_blocks;
  const int64_t per_head = d.nope + d.v;
  const int64_t q_width = static_cast<int64_t>(d.heads) * d.qk(), out_width = static_cast<int64_t>(d.heads) * d.v;
  parallel(static_cast<int64_t>(last - first) * d.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q_latent(d.lora), o_latent(d.lora);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = first + i / d.heads;
      const int h = static_cast<int>(i % d.heads);
      const int64_t n = q.positions[r] + 1;
      const float* qh = q.q + r * q_width + static_cast<int64_t>(h) * d.qk();
      const float* w_uk = kv_b + h * per_head * d.lora;                  // [nope x lora]
      const float* w_uv = w_uk + static_cast<int64_t>(d.nope) * d.lora;  // [v x lora]
      // The query in latent space: q_nope . W_UK[h].
      std::fill(q_latent.begin(), q_latent.end(), 0.0f);
      for (int c = 0; c < d.nope; ++c) Axpy(qh[c], w_uk + static_cast<int64_t>(c) * d.lora, d.lora, q_latent.data());
      scores.resize(n);
      for (int64_t p = 0; p < n; ++p) {
        const float* row = LatentRow(d, cache, table, p);
        scores[p] = (DotF32(q_latent.data(), row, d.lora) + DotF32(qh + d.nope, row + d.lora, d.rope)) * q.scale;
      }
      Softmax(scores.data(), n);
      std::fill(o_latent.begin(), o_latent.end(), 0.0f);
      for (int64_t p = 0; p < n; ++p) Axpy(scores[p], LatentRow(d, cache, table, p), d.lora, o_latent.data());
      // Back from latent space: W_UV[h] . o_latent.
      float* o = q.out + r * out_width + static_cast<int64_t>(h) * d.v;
      for (int j = 0; j < d.v; ++j) o[j] = DotF32(w_uv + static_cast<int64_t>(j) * d.lora, o_latent.data(), d.lora);
    }
  });
}

}  // namespace moe::runtime::internal

// Multi-head latent attention (DeepSeek-V3's MLA) over the CPU backend's paged fp32 latent cache,
// in its two forms:
// - expanded: each head's keys [k_nope | k_rope] and values are made from the cached latents by
//   kv_b_proj for every position the step's rows see, then attended as written (what transformers
//   computes; the cost grows with the context times kv_lora x heads x (nope + v), so it suits a
//   prefill chunk, whose rows share the expansion);
// - absorbed: kv_b_proj's K half is folded into each head's query (q_nope . W_UK[h] gives a
//   kv_lora-wide query) and its V half applied to the attention output, so every head attends over
//   the latent rows themselves (one KV head of kv_lora + rope keys and, sharing them, values), in
//   the blocked GQA kernel: a decode row reads each cached row once for 16 heads instead of
//   expanding the context.
// The two agree within fp32 rounding (mla_attention_test.cc).
//
// A row's result depends only on its own sequence, position and form: never on the rows it is
// batched with or on where its blocks lie.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/attention.h"

namespace moe::runtime::internal {

struct MlaDims {
  int heads = 0;
  int nope = 0;  // qk_nope_head_dim
  int rope = 0;  // qk_rope_head_dim
  int v = 0;     // v_head_dim
  int lora = 0;  // kv_lora_rank
  int qk() const { return nope + rope; }
  int latent() const { return lora + rope; }
};

// One layer's latent rows: [block][slot][lora + rope] fp32, the latent normed, k_rope rotated.
struct PagedLatent {
  const float* rows = nullptr;
  int block_size = 0;
};

// The step's rotated queries [rows x heads * (nope + rope)] and where the outputs
// [rows x heads * v] go; the same row bookkeeping as AttentionQueries.
struct MlaQueries {
  const float* q = nullptr;
  float* out = nullptr;
  float scale = 1.0f;
  const int32_t* positions = nullptr;
  const int32_t* seq_start = nullptr;
  const int32_t* block_table = nullptr;
  int max_blocks = 0;
};

// The rows of sequence `seq`, in the expanded form; kv_b is kv_b_proj [heads * (nope + v) x lora]
// fp32 (per head: nope rows of W_UK, then v rows of W_UV).
void MlaAttendExpanded(const MlaDims& d, const float* kv_b, const PagedLatent& cache, const MlaQueries& q, int seq,
                       ParallelLoop parallel);
// The rows of sequences [first_seq, first_seq + num_seqs), in the absorbed form: each head's query
// folded into latent space, then the blocked kernel of attention.h over the latent rows as one KV
// head of kv_lora + rope values (keys and values alike: the output's rope columns are dropped), so
// that each cached row is read once for up to 16 heads, and a long decode row's keys are split
// across the threads. `q_abs` and `o_abs` hold its queries and outputs, grown as needed.
void MlaAttendAbsorbed(const MlaDims& d, const float* kv_b, const PagedLatent& cache, const MlaQueries& q,
                       int first_seq, int num_seqs, AttentionIsa isa, ParallelLoop parallel, AttentionScratch& scratch,
                       std::vector<float>* q_abs, std::vector<float>* o_abs);

// RoPE of one vector of `rope` values by position * inv_freq[i], cos and sin scaled by
// `attention_factor` (YaRN's): neighbouring pairs (2i, 2i + 1) when `interleave` (DeepSeek-V3's
// rope_interleave: transformers de-interleaves them first, which permutes q and k alike and so
// leaves every score as it is), else the NeoX halves (i, i + rope / 2).
void RotateMla(float* x, int rope, const float* inv_freq, int32_t position, float attention_factor, bool interleave);

}  // namespace moe::runtime::internal

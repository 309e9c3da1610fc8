// The CUDA backend's kernels, behind plain host launchers. Nothing here allocates, synchronizes
// or owns memory: every pointer is device memory the caller owns (the step arena, the weights,
// the KV cache), every launcher enqueues on `stream` and returns at once, and launch errors are
// read by the caller (cudaGetLastError at Synchronize). So every launcher can be captured into a
// CUDA graph, and a replay with new data in the same buffers computes the new step.
//
// Conventions:
// - bf16 is __nv_bfloat16 in memory, passed as uint16_t* so that this header needs no CUDA
//   include; fp32 accumulation everywhere; norms, softmax and routing in fp32.
// - Matrices are row-major; weights are [out x in] (as checkpoints store them).
// - The residual stream is fp32 [T x hidden]; GEMM inputs are bf16.
// - T: tokens in the step (rows); S: sequences in the step.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "cuda/linear.h"

typedef struct CUstream_st* cudaStream_t;

namespace moe::runtime::cuda {

// Where each row of a step sits, uploaded once per step (all int32, device memory).
struct StepMeta {
  const int32_t* token_ids = nullptr;    // [T]
  const int32_t* positions = nullptr;    // [T] position of each row in its sequence
  const int32_t* row_seq = nullptr;      // [T] sequence index of each row
  const int32_t* seq_start = nullptr;    // [S+1] first row of each sequence; seq_start[S] = T
  const int32_t* seq_len = nullptr;      // [S] KV length after this step: first_position + num_tokens
  const int32_t* block_table = nullptr;  // [S x max_blocks] block ids, row-major, padded with a valid id
  int num_tokens = 0;                    // T
  int num_seqs = 0;                      // S
  int max_blocks = 0;                    // stride of block_table
  int max_q_len = 0;                     // most rows any sequence has in this step (1: all decode)
  int max_kv_len = 0;                    // an upper bound of seq_len (sizes the decode split)
};

// The paged KV cache of one layer: K and V each [num_blocks][kv_heads][block_size][head_dim] bf16.
// One layer of the paged KV cache (backend.h's layout): bf16 K and V, or fp8 e4m3 ones with an
// fp32 scale per position and KV head ([block][kv_head][slot]).
struct KvLayer {
  void* k = nullptr;
  void* v = nullptr;
  int block_size = 16;
  int kv_heads = 0;
  int head_dim = 0;
  bool fp8 = false;
  float* k_scale = nullptr;  // fp8 only
  float* v_scale = nullptr;
};

// ---- Dense operations (dense_ops.cu) ----

// x[t] = float(table[token_ids[t]]), table [vocab x hidden] bf16.
void Embed(const uint16_t* table, const int32_t* token_ids, int num_tokens, int hidden, float* x, cudaStream_t stream);

// Per row: if delta: x += delta (fp32, in place); then out = bf16(x * rsqrt(mean(x^2) + eps) * w).
// w fp32 [cols]. delta may be null.
void AddRmsNorm(float* x, const float* delta, const float* w, float eps, int rows, int cols, uint16_t* out,
                cudaStream_t stream);

// out[r][i] = bf16(silu(gate_up[r][i]) * gate_up[r][width + i]) for i < width; gate_up is
// [rows x 2*width] bf16 (the fused gate and up projections' output).
void SiluMul(const uint16_t* gate_up, int rows, int width, uint16_t* out, cudaStream_t stream);

// out[r] (+)= sigmoid(gate[r]) * shared[r] (gate null: factor 1), rows of `cols` fp32.
void AddSharedExpert(float* out, const float* shared, const float* gate, int rows, int cols, cudaStream_t stream);

// out[i] = src[rows[i]] for i < n; rows of `cols` fp32.
void GatherRows(const float* src, int cols, const int32_t* rows, int n, float* out, cudaStream_t stream);

// Linear layers through cuBLASLt (linear.cc, linear.h): class Linear, out [M x N] = x [M x K] .
// w^T (+ bias), w [N x K] bf16, fp32 accumulation, out bf16 or fp32. One per stream; the plan
// for each shape is chosen once and cached, so Run may be captured into a graph.

// ---- Attention (attention.cu) ----

// The fused step after the QKV projection. qkv is [T x (H + 2*KV) * head_dim] bf16 (q heads, then
// k heads, then v heads; the bias already added). Per row: q and k heads get the per-head RMSNorm
// (fp32 weights [head_dim]) when q_norm/k_norm are given, then RoPE (NeoX half-split layout) on
// their first rotary_dim dims with angle position * inv_freq[i] (fp32 [rotary_dim/2]) computed
// in fp32; q goes to q_out [T x H*head_dim] bf16; k and v go into the cache at the row's slot
// (block_table[row_seq][position / block_size], position % block_size).
void QkNormRopeStoreKv(const uint16_t* qkv, const StepMeta& meta, int num_heads, const KvLayer& kv, const float* q_norm,
                       const float* k_norm, float eps, int rotary_dim, const float* inv_freq, uint16_t* q_out,
                       cudaStream_t stream);

// Causal attention of every row's query over its sequence's cached keys [0, position] (GQA:
// query head h reads kv head h / (num_heads / kv_heads)); out [T x H*head_dim] bf16. Picks the
// decode kernel (split over the KV length, each KV block read once for all query heads of its
// group) when meta.max_q_len == 1, else the prefill kernel (flash-style, causal). `workspace`
// is fp32 scratch of AttentionWorkspaceFloats(meta, num_heads, head_dim) floats.
void PagedAttention(const uint16_t* q, const StepMeta& meta, int num_heads, const KvLayer& kv, float scale,
                    float* workspace, uint16_t* out, cudaStream_t stream);
int64_t AttentionWorkspaceFloats(int max_tokens, int max_kv_len, int num_heads, int head_dim);

// ---- Routing (routing.cu), as runtime/src/routing.cc defines it ----

struct RouterParams {
  bool sigmoid = false;  // false: softmax scoring
  int num_experts = 0;
  int top_k = 0;
  bool normalize_top_k = false;
  int n_group = 1;
  int topk_group = 1;
  float routed_scaling_factor = 1.0f;
  const float* correction_bias = nullptr;  // [num_experts] fp32 or null (sigmoid only)
};
// logits [T x E] fp32 -> ids [T x top_k] int32, weights [T x top_k] fp32, best expert first.
void RouteTopK(const float* logits, int num_tokens, const RouterParams& params, int32_t* ids, float* weights,
               cudaStream_t stream);

// ---- Routed experts on the GPU (moe.cu) ----

// One MoE layer's experts: gate_up [E x 2I x H] (each expert's gate rows, then its up rows),
// down [E x H x I], bf16.
struct ExpertWeights {
  const uint16_t* gate_up = nullptr;
  const uint16_t* down = nullptr;
  int num_experts = 0;
  int hidden = 0;        // H
  int intermediate = 0;  // I
};
// out[t] = sum_j weights[t][j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t][j]; out fp32
// [T x H], overwritten; x [T x H] bf16; ids [T x top_k] int32, weights [T x top_k] fp32. Tokens
// are grouped by expert on the device (no host sync; the launches depend only on T, top_k, E, H,
// I), each selected expert's rows are read once for all its tokens; few (token, slot) pairs take
// a tensor-core GEMV, many a grouped GEMM. The k slots of a token are summed in slot order, so
// the result does not depend on scheduling. An id outside [0, E) adds nothing. H and I must be
// multiples of 8 (at most 65536), 1 <= E <= 2048, T * top_k <= 2^24, pointers 16-byte aligned;
// otherwise out is filled with NaN.
// `workspace` holds MoeWorkspaceBytes(max_tokens, top_k, E, H, I) bytes, max_tokens >= T: the
// grouping, act [T*k x I] bf16 and each slot's output [T*k x H] fp32, which the slot sum reads.
void MoeExperts(const uint16_t* x, int num_tokens, const int32_t* ids, const float* weights, int top_k,
                const ExpertWeights& w, void* workspace, float* out, cudaStream_t stream);
int64_t MoeWorkspaceBytes(int max_tokens, int top_k, int num_experts, int hidden, int intermediate);

// ---- Sampling (sampling.cu), the algorithm of runtime/include/moe/runtime/sampler.h ----

struct SampleParamsGpu {  // one per row, device memory
  float temperature;      // 0: greedy
  int32_t top_k;          // 0: off
  float top_p;            // 1: off
  float min_p;            // 0: off
  float repetition_penalty, presence_penalty, frequency_penalty;
  uint32_t seed_lo, seed_hi;
  int32_t position;       // Philox counter word 0
  int32_t sequence;       // Philox counter word 1
  int32_t history_start;  // this row's tokens in `history`: [history_start, history_start + prompt_len + output_len)
  int32_t prompt_len, output_len;
  int32_t logprobs;  // top alternatives wanted (0: none; at most kMaxLogprobs)
};
constexpr int kMaxLogprobs = 20;
// logits [R x V] fp32, modified in place by the penalties. tokens [R]; when any row wants
// logprobs: logprob [R], top_ids [R x kMaxLogprobs], top_logprobs [R x kMaxLogprobs].
// `workspace` holds SamplingWorkspaceBytes(R, V) bytes.
void SampleRows(float* logits, int rows, int vocab, const SampleParamsGpu* params, const int32_t* history,
                void* workspace, int32_t* tokens, float* logprob, int32_t* top_ids, float* top_logprobs,
                cudaStream_t stream);
int64_t SamplingWorkspaceBytes(int rows, int vocab);

}  // namespace moe::runtime::cuda

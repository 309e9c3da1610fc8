// ModelSpec: everything the forward pass needs to know about a model's shape and math, read
// from a Hugging Face `config.json`. One struct for every supported architecture; the
// architecture-specific parts (routing function, shared experts, dense layers, partial rotary,
// QK-norm, attention bias) are plain fields so that the forward is written once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::runtime {

// Limits on config values that tools writing configs share (make-model): more layers or a larger
// vocabulary than any published model, small enough that nothing sized from them overflows.
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxVocab = int64_t{1} << 24;

enum class Architecture { kQwen3Moe, kQwen2Moe, kMixtral, kGlm4Moe, kDeepseekV3 };

// The `model_type` values moeserve can load, in the order they were added.
const std::vector<std::string>& SupportedModelTypes();
std::string_view ArchitectureName(Architecture arch);

enum class ScoringFunction {
  kSoftmax,  // softmax over all experts, then top-k (Qwen, Mixtral)
  kSigmoid,  // sigmoid per expert, bias-corrected group-limited top-k (GLM-4.5, DeepSeek-V3)
};

struct RoutingSpec {
  ScoringFunction scoring = ScoringFunction::kSoftmax;
  int num_experts = 0;
  int top_k = 0;
  bool normalize_top_k = false;      // renormalise the chosen weights to sum to 1
  bool has_correction_bias = false;  // `e_score_correction_bias` added for the choice only
  int n_group = 1;                   // experts split into groups; the best `topk_group` kept
  int topk_group = 1;
  float routed_scaling_factor = 1.0f;
};

// How a layer attends: grouped-query attention over paged K and V (every supported architecture),
// multi-head latent attention over a paged latent (deepseek_v3), or Gated DeltaNet linear attention
// over a recurrent state per sequence (qwen3_next's linear layers). The cache plan (cache.h) gives
// each kind its own group.
enum class AttentionKind { kGqa, kMla, kGatedDeltaNet };
std::string_view AttentionKindName(AttentionKind kind);

// How RoPE's frequencies are made: 1/theta^(2i/d) (default), or YaRN's blend of those and the
// same divided by `factor`, by a ramp over the dimensions between the corrections for beta_fast
// and beta_slow rotations in original_max_position_embeddings (DeepSeek-V3's context extension).
// YaRN also scales cos and sin by attention_factor, and MLA's softmax by mscale(mscale_all_dim)^2.
enum class RopeType { kDefault, kYarn };
struct RopeScaling {
  RopeType type = RopeType::kDefault;
  float factor = 1.0f;
  int original_max_position_embeddings = 0;
  float beta_fast = 32.0f;
  float beta_slow = 1.0f;
  float mscale = 0.0f;            // 0: not given
  float mscale_all_dim = 0.0f;    // 0: not given
  float attention_factor = 1.0f;  // the multiplier of cos and sin, as transformers derives it
  bool truncate = true;           // the correction range rounded outwards to whole dimensions
};
// YaRN's magnitude correction: 0.1 * mscale * ln(scale) + 1 above scale 1, else 1.
float YarnMscale(float scale, float mscale);

// Multi-head latent attention (deepseek_v3). Queries: q_a_proj to q_lora_rank, its RMSNorm, then
// q_b_proj to every head's [nope | rope] (q_proj straight from the hidden state when q_lora_rank
// is 0). Keys and values: kv_a_proj_with_mqa to one [latent (kv_lora_rank) | k_rope] row per
// token, the latent RMSNormed (kv_a_layernorm), then kv_b_proj to every head's [k_nope | v]. The
// rope halves are rotated (in pairs of neighbours when rope_interleave, else NeoX halves); k_rope
// is shared by every head. The cache keeps the normed latent and the rotated k_rope.
struct MlaSpec {
  int q_lora_rank = 0;  // 0: a plain q_proj
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  bool rope_interleave = false;
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // One cached row: the latent and the rotated k_rope.
  int latent_width() const { return kv_lora_rank + qk_rope_head_dim; }
};

struct ModelSpec {
  Architecture arch = Architecture::kQwen3Moe;
  std::string model_type;

  int vocab_size = 0;
  int hidden_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;  // head_dim * partial_rotary_factor; the rest of each head is not rotated
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;
  MlaSpec mla;  // when layers attend by kMla (head_dim is then qk_head_dim, rotary_dim the rope half)
  float rms_norm_eps = 1e-6f;
  bool qkv_bias = false;  // q/k/v projections carry a bias
  bool qk_norm = false;   // per-head RMSNorm of q and k before RoPE
  int max_position_embeddings = 0;
  bool tie_word_embeddings = false;

  int intermediate_size = 0;       // FFN width of dense layers
  int moe_intermediate_size = 0;   // FFN width of one routed expert
  std::vector<bool> layer_is_moe;  // per layer: routed experts (true) or a dense FFN
  RoutingSpec routing;
  int shared_expert_intermediate_size = 0;  // 0: no shared expert
  bool shared_expert_gate = false;          // shared output scaled by sigmoid(x . w_gate)

  std::vector<int> eos_token_ids;

  // MTP / nextn layers (GLM-4.5's and DeepSeek-V3's num_nextn_predict_layers): layer ids
  // [num_layers, num_layers + num_nextn_layers) after the model's own, each a decoder layer (with
  // routed experts when nextn_is_moe) plus its nextn tensors. The forward does not run them; the
  // speculative decoder does.
  int num_nextn_layers = 0;
  bool nextn_is_moe = false;
  // Per layer, nextn layers included: how it attends (every layer kGqa until MLA and Gated DeltaNet
  // land).
  std::vector<AttentionKind> layer_attention;

  int num_all_layers() const { return num_layers + num_nextn_layers; }
  bool IsMoeLayer(int layer) const { return layer < num_layers ? layer_is_moe[layer] : nextn_is_moe; }
  bool IsNextnLayer(int layer) const { return layer >= num_layers; }
  AttentionKind attention(int layer) const {
    return layer < static_cast<int>(layer_attention.size()) ? layer_attention[layer] : AttentionKind::kGqa;
  }
  int num_moe_layers() const;
  bool uses_mla() const;
  // The softmax scale of attention: head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for MLA
  // under YaRN.
  float attention_scale() const;
  // One line: "qwen3_moe: 48 layers, hidden 2048, 32/4 heads x 128, 128 experts top-8 ..."
  std::string Summary() const;
};

// The largest config.json read; real ones are a few KiB.
inline constexpr size_t kMaxConfigBytes = size_t{4} << 20;

// Parses and checks a config.json text. `source` names the file in error messages.
// kInvalidArgument for malformed JSON (with the line and column), a missing value, a value of
// the wrong type, or an impossible one, and for an unsupported model_type (the message lists the
// supported ones). Every integer is range-checked before it is narrowed or anything is sized from
// it: num_hidden_layers 1..1024, hidden_size 1..65536, heads 1..1024, head_dim 2..1024 (even),
// experts 1..4096, top-k 1..experts, intermediate sizes 1..2^20, vocab_size and
// max_position_embeddings 1..2^24, layer lists within the layers, token ids within the
// vocabulary. Floats must be finite in fp32: rope_theta in [1, 1e12], rms_norm_eps and
// partial_rotary_factor in (0, 1], routed_scaling_factor in (0, 1000].
absl::StatusOr<ModelSpec> ParseModelSpec(std::string_view config_json, std::string_view source);

// Reads `<model_dir>/config.json`: kNotFound when it is missing, kInvalidArgument when it is not
// a regular file (a device, fifo, directory or symbolic link loop) or is over kMaxConfigBytes.
absl::StatusOr<ModelSpec> LoadModelSpec(const std::string& model_dir);

}  // namespace moe::runtime

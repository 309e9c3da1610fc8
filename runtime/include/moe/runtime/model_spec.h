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

enum class Architecture { kQwen3Moe, kQwen2Moe, kMixtral, kGlm4Moe };

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

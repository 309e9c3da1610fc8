#include "moe/runtime/model_spec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/generation_config.h"
#include "moe/core/file.h"
#include "moe/core/json.h"
#include "moe/core/status.h"
#include "nlohmann/json.hpp"

namespace moe::runtime {
namespace {

using Json = nlohmann::json;
using core::DescribeJson;

// Sane limits for config values, checked before anything is sized from them. Generous for the
// largest published MoE models (DeepSeek-V3: 61 layers, hidden 7168, 128 heads, 256 experts,
// vocab 129280; Qwen3-235B-A22B: 94 layers, 128 experts; GLM-4.5: 92 layers, 160 experts).
constexpr int64_t kMaxHidden = 65536;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHeadDim = 1024;
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxSharedExperts = 64;
constexpr int64_t kMaxNextnLayers = 16;
constexpr int64_t kMaxIntermediate = int64_t{1} << 20;
constexpr int64_t kMaxPositions = int64_t{1} << 24;

// A config value found, with the key it was found under ("rope_parameters.rope_theta").
struct Found {
  const Json* value = nullptr;
  std::string key;
};

// Reads config keys, accepting several spellings, and remembers the file for messages. Every
// number is checked for its type and range before it is narrowed.
class ConfigReader {
 public:
  ConfigReader(const Json& j, std::string source) : j_(j), source_(std::move(source)) {}

  // The first of `keys` present and not null, looked up at the top level and then inside
  // `rope_parameters` / `rope_scaling` (newer transformers move RoPE keys there).
  Found Find(std::initializer_list<const char*> keys) const {
    for (const char* key : keys) {
      auto it = j_.find(key);
      if (it != j_.end() && !it->is_null()) return {&*it, key};
    }
    for (const char* nest : {"rope_parameters", "rope_scaling"}) {
      auto n = j_.find(nest);
      if (n == j_.end() || !n->is_object()) continue;
      for (const char* key : keys) {
        auto it = n->find(key);
        if (it != n->end() && !it->is_null()) return {&*it, absl::StrCat(nest, ".", key)};
      }
    }
    return {};
  }
  bool Has(std::initializer_list<const char*> keys) const { return Find(keys).value != nullptr; }

  // An integer in [min, max]; `bound` says what the upper limit is when it is not a constant
  // ("the number of experts (16)"), for the message.
  absl::StatusOr<int> Int(std::initializer_list<const char*> keys, int64_t min, int64_t max,
                          const std::string& bound = "") const {
    const Found f = Find(keys);
    if (f.value == nullptr) return Missing(keys);
    return CheckedInt(f.key, *f.value, min, max, bound);
  }
  absl::StatusOr<int> Int(std::initializer_list<const char*> keys, int fallback, int64_t min, int64_t max,
                          const std::string& bound = "") const {
    if (!Has(keys)) return fallback;
    return Int(keys, min, max, bound);
  }

  // A finite number in (0, max], also finite and above zero once narrowed to float (the forward
  // computes in fp32). `min_inclusive` replaces the open lower bound 0 where set.
  absl::StatusOr<float> Positive(std::initializer_list<const char*> keys, double fallback, double max,
                                 double min_inclusive = 0) const {
    const Found f = Find(keys);
    double v = fallback;
    std::string key = *keys.begin();
    if (f.value != nullptr) {
      if (!f.value->is_number()) return WrongType(f.key, "a number", *f.value);
      v = f.value->get<double>();
      key = f.key;
    }
    const float narrowed = static_cast<float>(v);
    const bool above = min_inclusive > 0 ? v >= min_inclusive : (v > 0 && narrowed > 0);
    if (!std::isfinite(v) || !std::isfinite(narrowed) || !above || v > max) {
      const std::string low = min_inclusive > 0 ? absl::StrCat("[", min_inclusive) : std::string("(0");
      return Error(absl::StrCat(key, "=", Number(f.value, v), " is out of range: must be a finite number in ", low,
                                ", ", max, "]"));
    }
    return narrowed;
  }

  absl::StatusOr<bool> Bool(std::initializer_list<const char*> keys, bool fallback) const {
    const Found f = Find(keys);
    if (f.value == nullptr) return fallback;
    if (!f.value->is_boolean()) return WrongType(f.key, "true or false", *f.value);
    return f.value->get<bool>();
  }

  // An integer or a list of integers, each in [min, max].
  absl::StatusOr<std::vector<int>> IntList(const char* key, int64_t min, int64_t max,
                                           const std::string& bound = "") const {
    std::vector<int> out;
    const Found f = Find({key});
    if (f.value == nullptr) return out;
    if (f.value->is_number_integer()) {
      MOE_ASSIGN_OR_RETURN(int v, CheckedInt(f.key, *f.value, min, max, bound));
      return std::vector<int>{v};
    }
    if (!f.value->is_array()) return WrongType(f.key, "a list of integers", *f.value);
    for (size_t i = 0; i < f.value->size(); ++i) {
      const Json& e = (*f.value)[i];
      if (!e.is_number_integer()) return WrongType(absl::StrCat(f.key, "[", i, "]"), "an integer", e);
      MOE_ASSIGN_OR_RETURN(int v, CheckedInt(absl::StrCat(f.key, "[", i, "]"), e, min, max, bound));
      out.push_back(v);
    }
    return out;
  }

  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", what));
  }
  absl::Status WrongType(const std::string& key, const char* want, const Json& v) const {
    return Error(absl::StrCat(key, " must be ", want, ", found ", DescribeJson(v)));
  }

 private:
  absl::StatusOr<int> CheckedInt(const std::string& key, const Json& v, int64_t min, int64_t max,
                                 const std::string& bound) const {
    if (!v.is_number_integer()) return WrongType(key, "an integer", v);
    // Unsigned values past int64 are out of range whatever the limits; compare before narrowing.
    const bool huge = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(max);
    const int64_t n = huge ? max : v.get<int64_t>();
    if (huge || n < min || n > max) {
      return Error(absl::StrCat(key, "=", DescribeJson(v), " is out of range: must be between ", min, " and ",
                                bound.empty() ? absl::StrCat(max) : bound));
    }
    return static_cast<int>(n);
  }
  static std::string Number(const Json* v, double fallback) {
    return v != nullptr ? DescribeJson(*v) : absl::StrCat(fallback);
  }
  absl::Status Missing(std::initializer_list<const char*> keys) const {
    return Error(absl::StrCat("missing ", absl::StrJoin(keys, " or ")));
  }

  const Json& j_;
  std::string source_;
};

absl::StatusOr<Architecture> ArchitectureFromType(const std::string& model_type, const std::string& source) {
  if (model_type == "qwen3_moe") return Architecture::kQwen3Moe;
  if (model_type == "qwen2_moe") return Architecture::kQwen2Moe;
  if (model_type == "mixtral") return Architecture::kMixtral;
  if (model_type == "glm4_moe") return Architecture::kGlm4Moe;
  if (model_type == "deepseek_v3" || model_type == "kimi_k2") return Architecture::kDeepseekV3;
  const std::string shown = model_type.size() > 60 ? absl::StrCat(model_type.substr(0, 60), "...") : model_type;
  return absl::InvalidArgumentError(absl::StrCat(
      source, ": model_type '", shown, "' is not supported; supported: ", absl::StrJoin(SupportedModelTypes(), ", ")));
}

// transformers' per-architecture default for rope_theta when the config omits it.
double DefaultRopeTheta(Architecture arch) { return arch == Architecture::kMixtral ? 1e6 : 1e4; }

// rope_scaling / rope_parameters: "default" (or none), or "yarn" with its factor and corrections.
// Any other type is refused naming the key it was found under.
absl::Status ReadRopeScaling(const ConfigReader& c, ModelSpec& s) {
  const Found type = c.Find({"rope_type", "type"});
  if (type.value == nullptr) return absl::OkStatus();
  if (!type.value->is_string()) return c.WrongType(type.key, "a string", *type.value);
  const std::string name = type.value->get<std::string>();
  if (name == "default") return absl::OkStatus();
  if (name != "yarn") {
    return c.Error(absl::StrCat(type.key, " '", name.size() > 40 ? name.substr(0, 40) + "..." : name,
                                "' is not supported (supported: 'default', 'yarn')"));
  }
  if (s.arch != Architecture::kDeepseekV3) {
    return c.Error(absl::StrCat(type.key, " 'yarn' is supported for deepseek_v3 only; ",
                                std::string(ArchitectureName(s.arch)), " takes 'default'"));
  }
  RopeScaling& r = s.rope_scaling;
  r.type = RopeType::kYarn;
  if (!c.Has({"factor"})) return c.Error(absl::StrCat(type.key, " 'yarn' needs a factor"));
  MOE_ASSIGN_OR_RETURN(r.factor, c.Positive({"factor"}, 1.0, 1e4));
  MOE_ASSIGN_OR_RETURN(r.original_max_position_embeddings,
                       c.Int({"original_max_position_embeddings"}, 0, 0, kMaxPositions));
  MOE_ASSIGN_OR_RETURN(r.beta_fast, c.Positive({"beta_fast"}, 32.0, 1e4));
  MOE_ASSIGN_OR_RETURN(r.beta_slow, c.Positive({"beta_slow"}, 1.0, 1e4));
  if (c.Has({"mscale"})) {
    MOE_ASSIGN_OR_RETURN(r.mscale, c.Positive({"mscale"}, 1.0, 1e3));
  }
  if (c.Has({"mscale_all_dim"})) {
    MOE_ASSIGN_OR_RETURN(r.mscale_all_dim, c.Positive({"mscale_all_dim"}, 1.0, 1e3));
  }
  MOE_ASSIGN_OR_RETURN(r.truncate, c.Bool({"truncate"}, true));
  if (c.Has({"attention_factor"})) {
    MOE_ASSIGN_OR_RETURN(r.attention_factor, c.Positive({"attention_factor"}, 1.0, 1e3));
  } else if (r.mscale != 0.0f && r.mscale_all_dim != 0.0f) {
    r.attention_factor = YarnMscale(r.factor, r.mscale) / YarnMscale(r.factor, r.mscale_all_dim);
  } else {
    r.attention_factor = YarnMscale(r.factor, 1.0f);
  }
  return absl::OkStatus();
}

// deepseek_v3's attention: every MLA width, q_lora_rank null or absent for a plain q_proj.
absl::Status ReadMla(const ConfigReader& c, ModelSpec& s) {
  MlaSpec& m = s.mla;
  if (const Found q = c.Find({"q_lora_rank"}); q.value != nullptr) {
    MOE_ASSIGN_OR_RETURN(m.q_lora_rank, c.Int({"q_lora_rank"}, 1, kMaxHidden));
  }
  MOE_ASSIGN_OR_RETURN(m.kv_lora_rank, c.Int({"kv_lora_rank"}, 1, kMaxHidden));
  MOE_ASSIGN_OR_RETURN(m.qk_nope_head_dim, c.Int({"qk_nope_head_dim"}, 1, kMaxHeadDim));
  MOE_ASSIGN_OR_RETURN(m.qk_rope_head_dim, c.Int({"qk_rope_head_dim"}, 2, kMaxHeadDim));
  MOE_ASSIGN_OR_RETURN(m.v_head_dim, c.Int({"v_head_dim"}, 1, kMaxHeadDim));
  MOE_ASSIGN_OR_RETURN(m.rope_interleave, c.Bool({"rope_interleave"}, true));
  if (m.qk_rope_head_dim % 2 != 0) {
    return c.Error(absl::StrCat("qk_rope_head_dim=", m.qk_rope_head_dim, " must be even (RoPE rotates pairs)"));
  }
  // One KV head in the cache; the heads' K and V come from it.
  s.num_kv_heads = s.num_heads;
  s.head_dim = m.qk_head_dim();
  s.rotary_dim = m.qk_rope_head_dim;
  MOE_ASSIGN_OR_RETURN(s.rms_norm_eps, c.Positive({"rms_norm_eps"}, 1e-6, 1.0));
  MOE_ASSIGN_OR_RETURN(s.max_position_embeddings, c.Int({"max_position_embeddings"}, 4096, 1, kMaxPositions));
  MOE_ASSIGN_OR_RETURN(s.tie_word_embeddings, c.Bool({"tie_word_embeddings"}, false));
  MOE_ASSIGN_OR_RETURN(const bool bias, c.Bool({"attention_bias"}, false));
  if (bias) return c.Error("attention_bias=true is not supported for deepseek_v3 (its projections carry no bias)");
  return absl::OkStatus();
}

absl::Status ReadAttention(const ConfigReader& c, ModelSpec& s) {
  MOE_ASSIGN_OR_RETURN(s.vocab_size, c.Int({"vocab_size"}, 1, kMaxVocab));
  MOE_ASSIGN_OR_RETURN(s.hidden_size, c.Int({"hidden_size"}, 1, kMaxHidden));
  MOE_ASSIGN_OR_RETURN(s.num_layers, c.Int({"num_hidden_layers"}, 1, kMaxLayers));
  MOE_ASSIGN_OR_RETURN(s.num_heads, c.Int({"num_attention_heads"}, 1, kMaxHeads));
  MOE_ASSIGN_OR_RETURN(s.num_kv_heads, c.Int({"num_key_value_heads"}, s.num_heads, 1, kMaxHeads));
  if (s.num_heads % s.num_kv_heads != 0) {
    return c.Error(absl::StrCat("num_attention_heads=", s.num_heads,
                                " is not a multiple of num_key_value_heads=", s.num_kv_heads));
  }
  if (s.arch == Architecture::kDeepseekV3) {
    s.head_dim = 2;  // ReadMla sets it from the MLA widths (transformers' head_dim is the rope half)
  } else if (c.Has({"head_dim"})) {
    MOE_ASSIGN_OR_RETURN(s.head_dim, c.Int({"head_dim"}, 2, kMaxHeadDim));
  } else {
    if (s.hidden_size % s.num_heads != 0) {
      return c.Error(absl::StrCat("num_attention_heads=", s.num_heads, " does not divide hidden_size=", s.hidden_size,
                                  " (and no head_dim is given)"));
    }
    s.head_dim = s.hidden_size / s.num_heads;
  }
  if (s.head_dim % 2 != 0) {
    return c.Error(absl::StrCat("head_dim=", s.head_dim, " must be positive and even (RoPE rotates pairs)"));
  }
  // Above 1, every RoPE frequency 1/theta^(2i/d) lies in (1/theta, 1]; below it they grow
  // without bound and positions times them overflow fp32.
  MOE_ASSIGN_OR_RETURN(s.rope_theta, c.Positive({"rope_theta"}, DefaultRopeTheta(s.arch), 1e12, /*min_inclusive=*/1));
  MOE_RETURN_IF_ERROR(ReadRopeScaling(c, s));
  if (s.arch == Architecture::kDeepseekV3) return ReadMla(c, s);
  const double default_partial = s.arch == Architecture::kGlm4Moe ? 0.5 : 1.0;
  MOE_ASSIGN_OR_RETURN(float partial, c.Positive({"partial_rotary_factor"}, default_partial, 1.0));
  s.rotary_dim = static_cast<int>(s.head_dim * static_cast<double>(partial));
  if (s.rotary_dim <= 0 || s.rotary_dim % 2 != 0) {
    return c.Error(absl::StrCat("partial_rotary_factor=", partial, " gives a rotary dimension of ", s.rotary_dim,
                                " of head_dim=", s.head_dim, "; it must be positive and even"));
  }
  MOE_ASSIGN_OR_RETURN(s.rms_norm_eps, c.Positive({"rms_norm_eps"}, 1e-6, 1.0));
  MOE_ASSIGN_OR_RETURN(s.max_position_embeddings, c.Int({"max_position_embeddings"}, 4096, 1, kMaxPositions));
  MOE_ASSIGN_OR_RETURN(s.tie_word_embeddings, c.Bool({"tie_word_embeddings"}, false));

  switch (s.arch) {
    case Architecture::kQwen3Moe: {
      MOE_ASSIGN_OR_RETURN(s.qkv_bias, c.Bool({"attention_bias"}, false));
      s.qk_norm = true;
      break;
    }
    case Architecture::kQwen2Moe: {
      MOE_ASSIGN_OR_RETURN(s.qkv_bias, c.Bool({"qkv_bias"}, true));
      break;
    }
    case Architecture::kMixtral:
      break;
    case Architecture::kGlm4Moe: {
      MOE_ASSIGN_OR_RETURN(s.qkv_bias, c.Bool({"attention_bias"}, false));
      MOE_ASSIGN_OR_RETURN(s.qk_norm, c.Bool({"use_qk_norm"}, false));
      break;
    }
    case Architecture::kDeepseekV3:
      break;
  }
  return absl::OkStatus();
}

absl::Status ReadExperts(const ConfigReader& c, ModelSpec& s) {
  RoutingSpec& r = s.routing;
  MOE_ASSIGN_OR_RETURN(r.num_experts, c.Int({"num_experts", "num_local_experts", "n_routed_experts"}, 1, kMaxExperts));
  MOE_ASSIGN_OR_RETURN(r.top_k, c.Int({"num_experts_per_tok"}, 1, r.num_experts,
                                      absl::StrCat("the number of experts (", r.num_experts, ")")));
  MOE_ASSIGN_OR_RETURN(s.intermediate_size, c.Int({"intermediate_size"}, 1, kMaxIntermediate));
  MOE_ASSIGN_OR_RETURN(s.moe_intermediate_size,
                       c.Int({"moe_intermediate_size"}, s.intermediate_size, 1, kMaxIntermediate));
  s.layer_is_moe.assign(s.num_layers, true);
  const std::string layers = absl::StrCat("num_hidden_layers (", s.num_layers, ")");

  switch (s.arch) {
    case Architecture::kQwen3Moe:
    case Architecture::kQwen2Moe: {
      MOE_ASSIGN_OR_RETURN(int step, c.Int({"decoder_sparse_step"}, 1, 1, s.num_layers, layers));
      MOE_ASSIGN_OR_RETURN(std::vector<int> mlp_only,
                           c.IntList("mlp_only_layers", 0, s.num_layers - 1,
                                     absl::StrCat(s.num_layers - 1, " (num_hidden_layers=", s.num_layers, ")")));
      for (int l = 0; l < s.num_layers; ++l) {
        bool dense = std::find(mlp_only.begin(), mlp_only.end(), l) != mlp_only.end();
        s.layer_is_moe[l] = !dense && (l + 1) % step == 0;
      }
      MOE_ASSIGN_OR_RETURN(r.normalize_top_k, c.Bool({"norm_topk_prob"}, false));
      if (s.arch == Architecture::kQwen2Moe) {
        MOE_ASSIGN_OR_RETURN(s.shared_expert_intermediate_size,
                             c.Int({"shared_expert_intermediate_size"}, 0, 0, kMaxIntermediate));
        s.shared_expert_gate = s.shared_expert_intermediate_size > 0;
      }
      break;
    }
    case Architecture::kMixtral:
      s.moe_intermediate_size = s.intermediate_size;  // Mixtral's experts use intermediate_size
      r.normalize_top_k = true;
      break;
    case Architecture::kGlm4Moe:
    case Architecture::kDeepseekV3: {
      MOE_ASSIGN_OR_RETURN(int first_dense, c.Int({"first_k_dense_replace"}, 1, 0, s.num_layers, layers));
      for (int l = 0; l < s.num_layers; ++l) s.layer_is_moe[l] = l >= first_dense;
      r.scoring = ScoringFunction::kSigmoid;
      r.has_correction_bias = true;
      MOE_ASSIGN_OR_RETURN(r.normalize_top_k, c.Bool({"norm_topk_prob"}, true));
      MOE_ASSIGN_OR_RETURN(r.n_group, c.Int({"n_group"}, 1, 1, r.num_experts,
                                            absl::StrCat("the number of experts (", r.num_experts, ")")));
      MOE_ASSIGN_OR_RETURN(r.topk_group, c.Int({"topk_group"}, 1, 1, r.n_group, absl::StrCat("n_group=", r.n_group)));
      MOE_ASSIGN_OR_RETURN(r.routed_scaling_factor, c.Positive({"routed_scaling_factor"}, 1.0, 1e3));
      MOE_ASSIGN_OR_RETURN(int n_shared, c.Int({"n_shared_experts"}, 1, 0, kMaxSharedExperts));
      const int64_t shared = int64_t{n_shared} * s.moe_intermediate_size;
      if (shared > kMaxIntermediate) {
        return c.Error(absl::StrCat("n_shared_experts=", n_shared, " x moe_intermediate_size=", s.moe_intermediate_size,
                                    " is more than ", kMaxIntermediate, " columns of shared experts"));
      }
      s.shared_expert_intermediate_size = static_cast<int>(shared);
      // GLM-4.5's and DeepSeek-V3's MTP layers follow the model's own; each has routed experts.
      MOE_ASSIGN_OR_RETURN(s.num_nextn_layers, c.Int({"num_nextn_predict_layers"}, 0, 0, kMaxNextnLayers));
      s.nextn_is_moe = true;
      break;
    }
  }
  if (r.num_experts % r.n_group != 0) {
    return c.Error(absl::StrCat("n_group=", r.n_group, " does not divide the number of experts (", r.num_experts, ")"));
  }
  if (r.top_k > r.topk_group * (r.num_experts / r.n_group)) {
    return c.Error(absl::StrCat("num_experts_per_tok=", r.top_k, " is more than the ",
                                r.topk_group * (r.num_experts / r.n_group), " experts in topk_group=", r.topk_group,
                                " groups"));
  }
  return absl::OkStatus();
}

// Special token ids: each must name a row of the embedding.
absl::Status ReadTokenIds(const ConfigReader& c, ModelSpec& s) {
  const std::string vocab = absl::StrCat(s.vocab_size - 1, " (vocab_size=", s.vocab_size, ")");
  MOE_ASSIGN_OR_RETURN(s.eos_token_ids, c.IntList("eos_token_id", 0, s.vocab_size - 1, vocab));
  for (const char* key : {"bos_token_id", "pad_token_id"}) {
    if (c.Has({key})) MOE_RETURN_IF_ERROR(c.Int({key}, 0, s.vocab_size - 1, vocab).status());
  }
  return absl::OkStatus();
}

}  // namespace

const std::vector<std::string>& SupportedModelTypes() {
  static const std::vector<std::string> types = {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"};
  return types;
}

std::string_view ArchitectureName(Architecture arch) {
  switch (arch) {
    case Architecture::kQwen3Moe:
      return "qwen3_moe";
    case Architecture::kQwen2Moe:
      return "qwen2_moe";
    case Architecture::kMixtral:
      return "mixtral";
    case Architecture::kGlm4Moe:
      return "glm4_moe";
    case Architecture::kDeepseekV3:
      return "deepseek_v3";
  }
  return "?";
}

std::string_view AttentionKindName(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kGqa:
      return "gqa";
    case AttentionKind::kMla:
      return "mla";
    case AttentionKind::kGatedDeltaNet:
      return "gated_deltanet";
  }
  return "?";
}

float YarnMscale(float scale, float mscale) {
  if (scale <= 1.0f) return 1.0f;
  return 0.1f * mscale * std::log(scale) + 1.0f;
}

bool ModelSpec::uses_mla() const {
  return std::find(layer_attention.begin(), layer_attention.end(), AttentionKind::kMla) != layer_attention.end();
}

float ModelSpec::attention_scale() const {
  float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (uses_mla() && rope_scaling.type == RopeType::kYarn && rope_scaling.mscale_all_dim != 0.0f) {
    const float m = YarnMscale(rope_scaling.factor, rope_scaling.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

int ModelSpec::num_moe_layers() const {
  return static_cast<int>(std::count(layer_is_moe.begin(), layer_is_moe.end(), true));
}

std::string ModelSpec::Summary() const {
  std::string s =
      absl::StrCat(model_type, ": ", num_layers, " layers (", num_moe_layers(), " MoE), hidden ", hidden_size,
                   ", heads ", num_heads, "/", num_kv_heads, " x ", head_dim, ", ", routing.num_experts,
                   " experts top-", routing.top_k, " x ", moe_intermediate_size, ", vocab ", vocab_size);
  if (shared_expert_intermediate_size > 0) absl::StrAppend(&s, ", shared expert ", shared_expert_intermediate_size);
  if (uses_mla()) {
    absl::StrAppend(&s, ", MLA q_lora ", mla.q_lora_rank, " kv_lora ", mla.kv_lora_rank, " nope/rope/v ",
                    mla.qk_nope_head_dim, "/", mla.qk_rope_head_dim, "/", mla.v_head_dim);
  }
  if (rope_scaling.type == RopeType::kYarn) absl::StrAppend(&s, ", YaRN x", rope_scaling.factor);
  return s;
}

absl::StatusOr<ModelSpec> ParseModelSpec(std::string_view config_json, std::string_view source_name) {
  const std::string source(source_name);
  MOE_ASSIGN_OR_RETURN(const Json j, core::ParseJsonObject(config_json, source));
  const std::string supported = absl::StrCat("supported: ", absl::StrJoin(SupportedModelTypes(), ", "));
  auto type = j.find("model_type");
  if (type == j.end() || type->is_null()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": missing model_type; ", supported));
  }
  if (!type->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": model_type must be a string, found ", DescribeJson(*type), "; ", supported));
  }
  ModelSpec s;
  s.model_type = type->get<std::string>();
  MOE_ASSIGN_OR_RETURN(s.arch, ArchitectureFromType(s.model_type, source));
  ConfigReader c(j, source);
  MOE_RETURN_IF_ERROR(ReadAttention(c, s));
  MOE_RETURN_IF_ERROR(ReadExperts(c, s));
  MOE_RETURN_IF_ERROR(ReadTokenIds(c, s));
  s.layer_attention.assign(s.num_all_layers(),
                           s.arch == Architecture::kDeepseekV3 ? AttentionKind::kMla : AttentionKind::kGqa);
  return s;
}

absl::StatusOr<ModelSpec> LoadModelSpec(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  auto text = core::ReadBoundedFile(path, kMaxConfigBytes, "config.json");
  if (text.status().code() == absl::StatusCode::kNotFound) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot read (is ", model_dir, " a model directory?)"));
  }
  if (!text.ok()) return text.status();
  MOE_ASSIGN_OR_RETURN(ModelSpec spec, ParseModelSpec(*text, path));
  MOE_ASSIGN_OR_RETURN(spec.eos_token_ids, internal::StopTokenIds(model_dir, spec.vocab_size, spec.eos_token_ids));
  return spec;
}

}  // namespace moe::runtime

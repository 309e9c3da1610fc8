#include "moe/runtime/model_spec.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moe/core/status.h"
#include "nlohmann/json.hpp"

namespace moe::runtime {
namespace {

using Json = nlohmann::json;

// Reads config keys, accepting several spellings, and remembers the file for messages.
class ConfigReader {
 public:
  ConfigReader(const Json& j, std::string source) : j_(j), source_(std::move(source)) {}

  // The first of `keys` present and not null, looked up at the top level and then inside
  // `rope_parameters` / `rope_scaling` (newer transformers move RoPE keys there).
  const Json* Find(std::initializer_list<const char*> keys) const {
    for (const char* key : keys) {
      auto it = j_.find(key);
      if (it != j_.end() && !it->is_null()) return &*it;
    }
    for (const char* nest : {"rope_parameters", "rope_scaling"}) {
      auto n = j_.find(nest);
      if (n == j_.end() || !n->is_object()) continue;
      for (const char* key : keys) {
        auto it = n->find(key);
        if (it != n->end() && !it->is_null()) return &*it;
      }
    }
    return nullptr;
  }

  absl::StatusOr<int> Int(std::initializer_list<const char*> keys) const {
    const Json* v = Find(keys);
    if (v == nullptr) return Missing(keys);
    if (!v->is_number_integer()) return WrongType(keys, "an integer", *v);
    return v->get<int>();
  }
  absl::StatusOr<int> Int(std::initializer_list<const char*> keys, int fallback) const {
    return Find(keys) == nullptr ? absl::StatusOr<int>(fallback) : Int(keys);
  }
  absl::StatusOr<double> Number(std::initializer_list<const char*> keys, double fallback) const {
    const Json* v = Find(keys);
    if (v == nullptr) return fallback;
    if (!v->is_number()) return WrongType(keys, "a number", *v);
    return v->get<double>();
  }
  absl::StatusOr<bool> Bool(std::initializer_list<const char*> keys, bool fallback) const {
    const Json* v = Find(keys);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) return WrongType(keys, "true or false", *v);
    return v->get<bool>();
  }
  absl::StatusOr<std::vector<int>> IntList(const char* key) const {
    std::vector<int> out;
    const Json* v = Find({key});
    if (v == nullptr) return out;
    if (v->is_number_integer()) return std::vector<int>{v->get<int>()};
    if (!v->is_array()) return WrongType({key}, "a list of integers", *v);
    for (const Json& e : *v) {
      if (!e.is_number_integer()) return WrongType({key}, "a list of integers", *v);
      out.push_back(e.get<int>());
    }
    return out;
  }

  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", what));
  }

 private:
  absl::Status Missing(std::initializer_list<const char*> keys) const {
    return Error(absl::StrCat("missing ", absl::StrJoin(keys, " or ")));
  }
  absl::Status WrongType(std::initializer_list<const char*> keys, const char* want, const Json& v) const {
    return Error(absl::StrCat(*keys.begin(), " must be ", want, ", found ", v.dump()));
  }

  const Json& j_;
  std::string source_;
};

absl::StatusOr<Architecture> ArchitectureFromType(const std::string& model_type, const std::string& source) {
  if (model_type == "qwen3_moe") return Architecture::kQwen3Moe;
  if (model_type == "qwen2_moe") return Architecture::kQwen2Moe;
  if (model_type == "mixtral") return Architecture::kMixtral;
  if (model_type == "glm4_moe") return Architecture::kGlm4Moe;
  return absl::InvalidArgumentError(absl::StrCat(source, ": model_type '", model_type,
                                                 "' is not supported; supported: ",
                                                 absl::StrJoin(SupportedModelTypes(), ", ")));
}

// transformers' per-architecture default for rope_theta when the config omits it.
double DefaultRopeTheta(Architecture arch) { return arch == Architecture::kMixtral ? 1e6 : 1e4; }

absl::Status ReadAttention(const ConfigReader& c, ModelSpec& s) {
  MOE_ASSIGN_OR_RETURN(s.vocab_size, c.Int({"vocab_size"}));
  MOE_ASSIGN_OR_RETURN(s.hidden_size, c.Int({"hidden_size"}));
  MOE_ASSIGN_OR_RETURN(s.num_layers, c.Int({"num_hidden_layers"}));
  MOE_ASSIGN_OR_RETURN(s.num_heads, c.Int({"num_attention_heads"}));
  MOE_ASSIGN_OR_RETURN(s.num_kv_heads, c.Int({"num_key_value_heads"}, s.num_heads));
  if (s.vocab_size <= 0) return c.Error(absl::StrCat("vocab_size=", s.vocab_size, " must be positive"));
  if (s.hidden_size <= 0) return c.Error(absl::StrCat("hidden_size=", s.hidden_size, " must be positive"));
  if (s.num_layers <= 0) return c.Error(absl::StrCat("num_hidden_layers=", s.num_layers, " must be positive"));
  if (s.num_heads <= 0 || s.num_kv_heads <= 0) {
    return c.Error(absl::StrCat("num_attention_heads=", s.num_heads, " and num_key_value_heads=",
                                s.num_kv_heads, " must be positive"));
  }
  if (s.num_heads % s.num_kv_heads != 0) {
    return c.Error(absl::StrCat("num_attention_heads=", s.num_heads,
                                " is not a multiple of num_key_value_heads=", s.num_kv_heads));
  }
  MOE_ASSIGN_OR_RETURN(s.head_dim, c.Int({"head_dim"}, 0));
  if (s.head_dim == 0) {
    if (s.hidden_size % s.num_heads != 0) {
      return c.Error(absl::StrCat("num_attention_heads=", s.num_heads, " does not divide hidden_size=",
                                  s.hidden_size, " (and no head_dim is given)"));
    }
    s.head_dim = s.hidden_size / s.num_heads;
  }
  if (s.head_dim <= 0 || s.head_dim % 2 != 0) {
    return c.Error(absl::StrCat("head_dim=", s.head_dim, " must be positive and even"));
  }
  MOE_ASSIGN_OR_RETURN(double theta, c.Number({"rope_theta"}, DefaultRopeTheta(s.arch)));
  s.rope_theta = static_cast<float>(theta);
  if (const auto* type = c.Find({"rope_type", "type"}); type != nullptr && type->is_string() &&
                                                       type->get<std::string>() != "default") {
    return c.Error(absl::StrCat("rope_type '", type->get<std::string>(),
                                "' is not supported yet (only 'default')"));
  }
  const double default_partial = s.arch == Architecture::kGlm4Moe ? 0.5 : 1.0;
  MOE_ASSIGN_OR_RETURN(double partial, c.Number({"partial_rotary_factor"}, default_partial));
  if (!(partial > 0 && partial <= 1)) {
    return c.Error(absl::StrCat("partial_rotary_factor=", partial, " must be in (0, 1]"));
  }
  s.rotary_dim = static_cast<int>(s.head_dim * partial);
  if (s.rotary_dim % 2 != 0) {
    return c.Error(absl::StrCat("partial_rotary_factor=", partial, " gives an odd rotary dimension ",
                                s.rotary_dim, " of head_dim=", s.head_dim));
  }
  MOE_ASSIGN_OR_RETURN(double eps, c.Number({"rms_norm_eps"}, 1e-6));
  s.rms_norm_eps = static_cast<float>(eps);
  MOE_ASSIGN_OR_RETURN(s.max_position_embeddings, c.Int({"max_position_embeddings"}, 4096));
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
  }
  return absl::OkStatus();
}

absl::Status ReadExperts(const ConfigReader& c, ModelSpec& s) {
  RoutingSpec& r = s.routing;
  MOE_ASSIGN_OR_RETURN(r.num_experts, c.Int({"num_experts", "num_local_experts", "n_routed_experts"}));
  MOE_ASSIGN_OR_RETURN(r.top_k, c.Int({"num_experts_per_tok"}));
  if (r.num_experts <= 0) return c.Error(absl::StrCat("num_experts=", r.num_experts, " must be positive"));
  if (r.top_k <= 0 || r.top_k > r.num_experts) {
    return c.Error(absl::StrCat("num_experts_per_tok=", r.top_k, " must be between 1 and the number of experts (",
                                r.num_experts, ")"));
  }
  MOE_ASSIGN_OR_RETURN(s.intermediate_size, c.Int({"intermediate_size"}));
  MOE_ASSIGN_OR_RETURN(s.moe_intermediate_size, c.Int({"moe_intermediate_size"}, s.intermediate_size));
  s.layer_is_moe.assign(s.num_layers, true);

  switch (s.arch) {
    case Architecture::kQwen3Moe:
    case Architecture::kQwen2Moe: {
      MOE_ASSIGN_OR_RETURN(int step, c.Int({"decoder_sparse_step"}, 1));
      MOE_ASSIGN_OR_RETURN(std::vector<int> mlp_only, c.IntList("mlp_only_layers"));
      if (step <= 0) return c.Error(absl::StrCat("decoder_sparse_step=", step, " must be positive"));
      for (int l = 0; l < s.num_layers; ++l) {
        bool dense = std::find(mlp_only.begin(), mlp_only.end(), l) != mlp_only.end();
        s.layer_is_moe[l] = !dense && (l + 1) % step == 0;
      }
      MOE_ASSIGN_OR_RETURN(r.normalize_top_k, c.Bool({"norm_topk_prob"}, false));
      if (s.arch == Architecture::kQwen2Moe) {
        MOE_ASSIGN_OR_RETURN(s.shared_expert_intermediate_size, c.Int({"shared_expert_intermediate_size"}, 0));
        s.shared_expert_gate = s.shared_expert_intermediate_size > 0;
      }
      break;
    }
    case Architecture::kMixtral:
      s.moe_intermediate_size = s.intermediate_size;  // Mixtral's experts use intermediate_size
      r.normalize_top_k = true;
      break;
    case Architecture::kGlm4Moe: {
      MOE_ASSIGN_OR_RETURN(int first_dense, c.Int({"first_k_dense_replace"}, 1));
      for (int l = 0; l < s.num_layers; ++l) s.layer_is_moe[l] = l >= first_dense;
      r.scoring = ScoringFunction::kSigmoid;
      r.has_correction_bias = true;
      MOE_ASSIGN_OR_RETURN(r.normalize_top_k, c.Bool({"norm_topk_prob"}, true));
      MOE_ASSIGN_OR_RETURN(r.n_group, c.Int({"n_group"}, 1));
      MOE_ASSIGN_OR_RETURN(r.topk_group, c.Int({"topk_group"}, 1));
      MOE_ASSIGN_OR_RETURN(double scale, c.Number({"routed_scaling_factor"}, 1.0));
      r.routed_scaling_factor = static_cast<float>(scale);
      MOE_ASSIGN_OR_RETURN(int n_shared, c.Int({"n_shared_experts"}, 1));
      if (n_shared < 0) return c.Error(absl::StrCat("n_shared_experts=", n_shared, " must not be negative"));
      s.shared_expert_intermediate_size = n_shared * s.moe_intermediate_size;
      break;
    }
  }
  if (s.intermediate_size <= 0 || s.moe_intermediate_size <= 0) {
    return c.Error(absl::StrCat("intermediate_size=", s.intermediate_size, " and moe_intermediate_size=",
                                s.moe_intermediate_size, " must be positive"));
  }
  if (r.n_group <= 0 || r.num_experts % r.n_group != 0) {
    return c.Error(absl::StrCat("n_group=", r.n_group, " does not divide the number of experts (",
                                r.num_experts, ")"));
  }
  if (r.topk_group <= 0 || r.topk_group > r.n_group) {
    return c.Error(absl::StrCat("topk_group=", r.topk_group, " must be between 1 and n_group=", r.n_group));
  }
  if (r.top_k > r.topk_group * (r.num_experts / r.n_group)) {
    return c.Error(absl::StrCat("num_experts_per_tok=", r.top_k, " is more than the ",
                                r.topk_group * (r.num_experts / r.n_group), " experts in topk_group=",
                                r.topk_group, " groups"));
  }
  return absl::OkStatus();
}

}  // namespace

const std::vector<std::string>& SupportedModelTypes() {
  static const std::vector<std::string> types = {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"};
  return types;
}

std::string_view ArchitectureName(Architecture arch) {
  switch (arch) {
    case Architecture::kQwen3Moe: return "qwen3_moe";
    case Architecture::kQwen2Moe: return "qwen2_moe";
    case Architecture::kMixtral: return "mixtral";
    case Architecture::kGlm4Moe: return "glm4_moe";
  }
  return "?";
}

int ModelSpec::num_moe_layers() const {
  return static_cast<int>(std::count(layer_is_moe.begin(), layer_is_moe.end(), true));
}

std::string ModelSpec::Summary() const {
  std::string s = absl::StrCat(model_type, ": ", num_layers, " layers (", num_moe_layers(), " MoE), hidden ",
                               hidden_size, ", heads ", num_heads, "/", num_kv_heads, " x ", head_dim, ", ",
                               routing.num_experts, " experts top-", routing.top_k, " x ", moe_intermediate_size,
                               ", vocab ", vocab_size);
  if (shared_expert_intermediate_size > 0) absl::StrAppend(&s, ", shared expert ", shared_expert_intermediate_size);
  return s;
}

absl::StatusOr<ModelSpec> ParseModelSpec(std::string_view config_json, std::string_view source_name) {
  const std::string source(source_name);
  Json j = Json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  auto type = j.find("model_type");
  if (type == j.end() || !type->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": missing model_type; supported: ",
                                                   absl::StrJoin(SupportedModelTypes(), ", ")));
  }
  ModelSpec s;
  s.model_type = type->get<std::string>();
  MOE_ASSIGN_OR_RETURN(s.arch, ArchitectureFromType(s.model_type, source));
  ConfigReader c(j, source);
  MOE_RETURN_IF_ERROR(ReadAttention(c, s));
  MOE_RETURN_IF_ERROR(ReadExperts(c, s));
  MOE_ASSIGN_OR_RETURN(s.eos_token_ids, c.IntList("eos_token_id"));
  return s;
}

absl::StatusOr<ModelSpec> LoadModelSpec(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read (is ", model_dir, " a model directory?)"));
  std::stringstream text;
  text << in.rdbuf();
  return ParseModelSpec(text.str(), path);
}

}  // namespace moe::runtime

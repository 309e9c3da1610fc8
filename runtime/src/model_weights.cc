#include "model_weights.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moe/core/logging.h"
#include "moe/core/status.h"

namespace moe::runtime::internal {
namespace {

using core::Shape;

// Fetches tensors by name, checks them and hands them to the backend; remembers what it used.
class WeightLoader {
 public:
  WeightLoader(const WeightSource& source, Backend& backend) : source_(source), backend_(backend) {}

  // `why` names the config keys behind the expected shape, for the error message.
  absl::StatusOr<std::unique_ptr<DeviceWeight>> Load(const std::string& name, const Shape& want,
                                                     const std::string& why) {
    MOE_ASSIGN_OR_RETURN(core::TensorView view, Check(name, want, why));
    auto weight = backend_.PrepareWeight(view);
    if (!weight.ok()) return core::Annotate(weight.status(), name);
    return weight;
  }

  // A small vector kept on the host as floats (routing parameters).
  absl::Status LoadHost(const std::string& name, int64_t n, const std::string& why, std::vector<float>* out) {
    MOE_ASSIGN_OR_RETURN(core::TensorView view, Check(name, {n}, why));
    out->resize(n);
    core::ConvertToFloat(view.data, view.dtype, out->data(), n);
    return absl::OkStatus();
  }

  // Loads an FFN's three matrices; with out == null only checks them.
  absl::Status LoadFfn(const std::string& prefix, const char* gate, const char* up, const char* down, int64_t hidden,
                       int64_t width, const std::string& why, FfnWeights* out) {
    const std::string names[3] = {prefix + gate + ".weight", prefix + up + ".weight", prefix + down + ".weight"};
    const Shape shapes[3] = {{width, hidden}, {width, hidden}, {hidden, width}};
    if (out == nullptr) {
      for (int i = 0; i < 3; ++i) MOE_RETURN_IF_ERROR(Check(names[i], shapes[i], why).status());
      return absl::OkStatus();
    }
    MOE_ASSIGN_OR_RETURN(out->gate, Load(names[0], shapes[0], why));
    MOE_ASSIGN_OR_RETURN(out->up, Load(names[1], shapes[1], why));
    MOE_ASSIGN_OR_RETURN(out->down, Load(names[2], shapes[2], why));
    return absl::OkStatus();
  }

  void WarnUnused() const {
    std::vector<std::string> unused;
    for (const std::string& name : source_.Names()) {
      if (!used_.count(name)) unused.push_back(name);
    }
    if (unused.empty()) return;
    const size_t shown = std::min<size_t>(unused.size(), 4);
    MOE_LOG(kWarning) << unused.size() << " tensors in the checkpoint are not used by this model ("
                      << absl::StrJoin(unused.begin(), unused.begin() + shown, ", ")
                      << (unused.size() > shown ? ", ..." : "") << ")";
  }

 private:
  absl::StatusOr<core::TensorView> Check(const std::string& name, const Shape& want, const std::string& why) {
    used_.insert(name);
    auto view = source_.Get(name);
    if (!view.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(view.status().message(), " (config expects ",
                                                     core::ShapeString(want), ": ", why, ")"));
    }
    const std::string file = source_.FileOf(name);
    if (view->shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": shape ", core::ShapeString(view->shape), " in ", file,
                                                     ", config expects ", core::ShapeString(want), " (", why, ")"));
    }
    if (view->dtype != core::DType::kBF16 && view->dtype != core::DType::kF16 && view->dtype != core::DType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", core::DTypeName(view->dtype), " in ", file,
                                                     ", expected BF16, F16 or F32"));
    }
    return *view;
  }

  const WeightSource& source_;
  Backend& backend_;
  std::set<std::string> used_;
};

absl::Status LoadAttention(const ModelSpec& s, const std::string& p, WeightLoader& w, LayerWeights& l) {
  const int64_t h = s.hidden_size, qw = int64_t{s.num_heads} * s.head_dim, kvw = int64_t{s.num_kv_heads} * s.head_dim;
  const std::string heads = absl::StrCat("num_attention_heads=", s.num_heads, " x head_dim=", s.head_dim);
  const std::string kv_heads = absl::StrCat("num_key_value_heads=", s.num_kv_heads, " x head_dim=", s.head_dim);
  MOE_ASSIGN_OR_RETURN(l.q, w.Load(p + "self_attn.q_proj.weight", {qw, h}, heads));
  MOE_ASSIGN_OR_RETURN(l.k, w.Load(p + "self_attn.k_proj.weight", {kvw, h}, kv_heads));
  MOE_ASSIGN_OR_RETURN(l.v, w.Load(p + "self_attn.v_proj.weight", {kvw, h}, kv_heads));
  MOE_ASSIGN_OR_RETURN(l.o, w.Load(p + "self_attn.o_proj.weight", {h, qw}, heads));
  if (s.qkv_bias) {
    MOE_ASSIGN_OR_RETURN(l.q_bias, w.Load(p + "self_attn.q_proj.bias", {qw}, heads));
    MOE_ASSIGN_OR_RETURN(l.k_bias, w.Load(p + "self_attn.k_proj.bias", {kvw}, kv_heads));
    MOE_ASSIGN_OR_RETURN(l.v_bias, w.Load(p + "self_attn.v_proj.bias", {kvw}, kv_heads));
  }
  if (s.qk_norm) {
    const std::string d = absl::StrCat("head_dim=", s.head_dim);
    MOE_ASSIGN_OR_RETURN(l.q_norm, w.Load(p + "self_attn.q_norm.weight", {s.head_dim}, d));
    MOE_ASSIGN_OR_RETURN(l.k_norm, w.Load(p + "self_attn.k_norm.weight", {s.head_dim}, d));
  }
  const std::string hs = absl::StrCat("hidden_size=", h);
  MOE_ASSIGN_OR_RETURN(l.input_norm, w.Load(p + "input_layernorm.weight", {h}, hs));
  MOE_ASSIGN_OR_RETURN(l.post_attention_norm, w.Load(p + "post_attention_layernorm.weight", {h}, hs));
  return absl::OkStatus();
}

absl::Status LoadMoe(const ModelSpec& s, const std::string& p, WeightLoader& w, bool prepare_experts, LayerWeights& l) {
  const int64_t h = s.hidden_size;
  const int e = s.routing.num_experts;
  const bool mixtral = s.arch == Architecture::kMixtral;
  const std::string block = p + (mixtral ? "block_sparse_moe." : "mlp.");
  const std::string experts_key = absl::StrCat("num_experts=", e);
  MOE_ASSIGN_OR_RETURN(l.router, w.Load(block + "gate.weight", {e, h}, experts_key));
  if (s.routing.has_correction_bias) {
    MOE_RETURN_IF_ERROR(w.LoadHost(block + "gate.e_score_correction_bias", e, experts_key, &l.correction_bias));
  }
  const std::string width = mixtral ? absl::StrCat("intermediate_size=", s.moe_intermediate_size)
                                    : absl::StrCat("moe_intermediate_size=", s.moe_intermediate_size);
  if (prepare_experts) l.experts.resize(e);
  for (int i = 0; i < e; ++i) {
    const std::string ep = absl::StrCat(block, "experts.", i, ".");
    FfnWeights* out = prepare_experts ? &l.experts[i] : nullptr;
    if (mixtral) {
      MOE_RETURN_IF_ERROR(w.LoadFfn(ep, "w1", "w3", "w2", h, s.moe_intermediate_size, width, out));
    } else {
      MOE_RETURN_IF_ERROR(w.LoadFfn(ep, "gate_proj", "up_proj", "down_proj", h, s.moe_intermediate_size, width, out));
    }
  }
  if (s.shared_expert_intermediate_size > 0) {
    const bool qwen2 = s.arch == Architecture::kQwen2Moe;
    const std::string sp = block + (qwen2 ? "shared_expert." : "shared_experts.");
    const std::string why = qwen2 ? absl::StrCat("shared_expert_intermediate_size=", s.shared_expert_intermediate_size)
                                  : absl::StrCat("n_shared_experts x moe_intermediate_size=",
                                                 s.shared_expert_intermediate_size);
    MOE_RETURN_IF_ERROR(
        w.LoadFfn(sp, "gate_proj", "up_proj", "down_proj", h, s.shared_expert_intermediate_size, why, &l.shared));
    if (s.shared_expert_gate) {
      MOE_ASSIGN_OR_RETURN(l.shared_gate, w.Load(block + "shared_expert_gate.weight", {1, h}, "shared expert gate"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model::Weights>> LoadWeights(const ModelSpec& s, const WeightSource& source,
                                                            Backend& backend, bool prepare_routed_experts) {
  WeightLoader w(source, backend);
  auto weights = std::make_unique<Model::Weights>();
  const int64_t h = s.hidden_size, vocab = s.vocab_size;
  const std::string vh = absl::StrCat("vocab_size=", vocab, ", hidden_size=", h);
  MOE_ASSIGN_OR_RETURN(weights->embed, w.Load("model.embed_tokens.weight", {vocab, h}, vh));
  MOE_ASSIGN_OR_RETURN(weights->final_norm, w.Load("model.norm.weight", {h}, absl::StrCat("hidden_size=", h)));
  if (s.tie_word_embeddings && !source.Has("lm_head.weight")) {
    MOE_ASSIGN_OR_RETURN(weights->lm_head, w.Load("model.embed_tokens.weight", {vocab, h}, vh));
  } else {
    MOE_ASSIGN_OR_RETURN(weights->lm_head, w.Load("lm_head.weight", {vocab, h}, vh));
  }
  weights->layers.resize(s.num_layers);
  for (int layer = 0; layer < s.num_layers; ++layer) {
    const std::string p = absl::StrCat("model.layers.", layer, ".");
    LayerWeights& l = weights->layers[layer];
    MOE_RETURN_IF_ERROR(LoadAttention(s, p, w, l));
    if (s.IsMoeLayer(layer)) {
      MOE_RETURN_IF_ERROR(LoadMoe(s, p, w, prepare_routed_experts, l));
    } else {
      MOE_RETURN_IF_ERROR(w.LoadFfn(p + "mlp.", "gate_proj", "up_proj", "down_proj", h, s.intermediate_size,
                                    absl::StrCat("intermediate_size=", s.intermediate_size, " (dense layer)"),
                                    &l.dense));
    }
  }
  w.WarnUnused();
  return weights;
}

}  // namespace moe::runtime::internal

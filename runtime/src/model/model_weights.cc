#include "model/model_weights.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moe/core/logging.h"
#include "moe/core/progress.h"
#include "moe/core/status.h"
#include "moe/runtime/placement.h"

namespace moe::runtime::internal {
namespace {

using core::Shape;

// Rows [r.begin, r.end) of a 2-D view (or elements of a 1-D one): a view into the same memory.
core::TensorView RowSlice(const core::TensorView& v, Range r) {
  core::TensorView out = v;
  const int64_t row = v.shape.size() > 1 ? v.shape[1] : 1;
  out.data = static_cast<const char*>(v.data) + r.begin * row * core::DTypeSize(v.dtype);
  out.shape[0] = r.size();
  return out;
}

// A tensor's share in a split: rows or columns of a range, or the whole tensor.
struct Slice {
  enum class Kind { kWhole, kRows, kColumns } kind = Kind::kWhole;
  Range range;
  static Slice Rows(Range r) { return {Kind::kRows, r}; }
  static Slice Columns(Range r) { return {Kind::kColumns, r}; }
  // The shape the share has, of a tensor of shape `whole`.
  core::Shape Of(core::Shape whole) const {
    if (kind == Kind::kRows) whole[0] = range.size();
    if (kind == Kind::kColumns) whole[1] = range.size();
    return whole;
  }
};

// Fetches tensors by name, checks them and hands them (or a split's share of them) to the
// backend; remembers what it used and counts the bytes it handed over. Column shares are copied
// into `slices`, which must outlive the weights.
class WeightLoader {
 public:
  WeightLoader(const WeightSource& source, Backend& backend, core::ProgressReporter* progress,
               std::vector<std::vector<uint8_t>>* slices)
      : source_(source), backend_(backend), progress_(progress), slices_(slices) {}

  // `why` names the config keys behind the expected shape, for the error message.
  absl::StatusOr<std::unique_ptr<DeviceWeight>> Load(const std::string& name, const Shape& want, const std::string& why,
                                                     WeightUse use = WeightUse::kMatrix, Slice slice = {}) {
    MOE_ASSIGN_OR_RETURN(core::TensorView whole, Check(name, want, why));
    const core::TensorView view = Share(whole, slice);
    auto weight = backend_.PrepareWeight(view, use);
    if (!weight.ok()) return core::Annotate(weight.status(), name);
    Count(view.bytes(), **weight);
    return weight;
  }

  // Several tensors stacked by rows into one weight (the fused QKV and gate+up projections).
  absl::StatusOr<std::unique_ptr<DeviceWeight>> LoadFused(const std::vector<std::string>& names,
                                                          const std::vector<Shape>& shapes, const std::string& why,
                                                          WeightUse use = WeightUse::kMatrix,
                                                          const std::vector<Slice>& slices = {}) {
    std::vector<core::TensorView> views;
    int64_t bytes = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      MOE_ASSIGN_OR_RETURN(core::TensorView whole, Check(names[i], shapes[i], why));
      const core::TensorView view = Share(whole, i < slices.size() ? slices[i] : Slice{});
      bytes += view.bytes();
      views.push_back(view);
    }
    auto weight = backend_.PrepareFusedWeight(views, use);
    if (!weight.ok()) return core::Annotate(weight.status(), names[0]);
    Count(bytes, **weight);
    return weight;
  }

  // Loads an FFN's three matrices, gate and up fused; with out == null only checks them. `share`
  // (a tensor split's): the intermediate units this rank holds, gate's and up's rows and down's
  // columns.
  absl::Status LoadFfn(const std::string& prefix, const char* gate, const char* up, const char* down, int64_t hidden,
                       int64_t width, const std::string& why, FfnWeights* out,
                       std::optional<Range> share = std::nullopt) {
    const std::string names[3] = {prefix + gate + ".weight", prefix + up + ".weight", prefix + down + ".weight"};
    const Shape shapes[3] = {{width, hidden}, {width, hidden}, {hidden, width}};
    if (out == nullptr) {
      for (int i = 0; i < 3; ++i) MOE_RETURN_IF_ERROR(Check(names[i], shapes[i], why).status());
      return absl::OkStatus();
    }
    const Slice rows = share ? Slice::Rows(*share) : Slice{}, columns = share ? Slice::Columns(*share) : Slice{};
    MOE_ASSIGN_OR_RETURN(
        out->gate_up, LoadFused({names[0], names[1]}, {shapes[0], shapes[1]}, why, WeightUse::kMatrix, {rows, rows}));
    MOE_ASSIGN_OR_RETURN(out->down, Load(names[2], shapes[2], why, WeightUse::kMatrix, columns));
    return absl::OkStatus();
  }

  // One layer's routed experts, handed to the backend together.
  absl::StatusOr<std::unique_ptr<DeviceExperts>> LoadExperts(const std::vector<std::string>& gate,
                                                             const std::vector<std::string>& up,
                                                             const std::vector<std::string>& down, int64_t hidden,
                                                             int64_t width, const std::string& why) {
    std::vector<core::TensorView> g, u, d;
    int64_t bytes = 0;
    for (size_t e = 0; e < gate.size(); ++e) {
      MOE_ASSIGN_OR_RETURN(core::TensorView gv, Check(gate[e], {width, hidden}, why));
      MOE_ASSIGN_OR_RETURN(core::TensorView uv, Check(up[e], {width, hidden}, why));
      MOE_ASSIGN_OR_RETURN(core::TensorView dv, Check(down[e], {hidden, width}, why));
      bytes += gv.bytes() + uv.bytes() + dv.bytes();
      g.push_back(gv);
      u.push_back(uv);
      d.push_back(dv);
    }
    auto experts = backend_.PrepareExperts(g, u, d);
    if (!experts.ok()) return core::Annotate(experts.status(), gate[0]);
    if (progress_ != nullptr) progress_->Add(bytes);
    device_bytes_ += (*experts)->bytes();
    return experts;
  }

  int64_t device_bytes() const { return device_bytes_; }
  absl::Status CheckOnly(const std::string& name, const Shape& want, const std::string& why) {
    return Check(name, want, why).status();
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
      return absl::InvalidArgumentError(
          absl::StrCat(view.status().message(), " (config expects ", core::ShapeString(want), ": ", why, ")"));
    }
    const std::string file = source_.FileOf(name);
    if (view->shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": shape ", core::ShapeString(view->shape), " in ", file,
                                                     ", config expects ", core::ShapeString(want), " (", why, ")"));
    }
    if (view->dtype != core::DType::kBF16 && view->dtype != core::DType::kF16 && view->dtype != core::DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": dtype ", core::DTypeName(view->dtype), " in ", file, ", expected BF16, F16 or F32"));
    }
    return *view;
  }

  // The share of `whole` a slice names: a view for rows, a copy for columns (kept in slices_).
  core::TensorView Share(const core::TensorView& whole, const Slice& slice) {
    switch (slice.kind) {
      case Slice::Kind::kWhole:
        return whole;
      case Slice::Kind::kRows:
        return RowSlice(whole, slice.range);
      case Slice::Kind::kColumns: {
        const int64_t rows = whole.shape[0], cols = whole.shape[1], elem = core::DTypeSize(whole.dtype);
        std::vector<uint8_t>& copy = slices_->emplace_back(rows * slice.range.size() * elem);
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(copy.data() + r * slice.range.size() * elem,
                      static_cast<const uint8_t*>(whole.data) + (r * cols + slice.range.begin) * elem,
                      slice.range.size() * elem);
        }
        return core::TensorView{copy.data(), whole.dtype, slice.Of(whole.shape)};
      }
    }
    return whole;
  }

  void Count(int64_t source_bytes, const DeviceWeight& weight) {
    if (progress_ != nullptr) progress_->Add(source_bytes);
    device_bytes_ += weight.bytes();
  }

  const WeightSource& source_;
  Backend& backend_;
  core::ProgressReporter* progress_;
  std::vector<std::vector<uint8_t>>* slices_;
  std::set<std::string> used_;
  int64_t device_bytes_ = 0;
};

// `shard`: a tensor split's query and KV heads (rows of q, k, v and their biases; columns of o).
absl::Status LoadAttention(const ModelSpec& s, const std::string& p, WeightLoader& w, LayerWeights& l,
                           const std::optional<TensorShard>& shard) {
  const int64_t h = s.hidden_size, qw = int64_t{s.num_heads} * s.head_dim, kvw = int64_t{s.num_kv_heads} * s.head_dim;
  std::vector<Slice> qkv_slices;
  Slice o_slice;
  if (shard) {
    const int64_t d = s.head_dim;
    const Range q{shard->q_heads.begin * d, shard->q_heads.end * d};
    const Range kv{shard->kv_heads.begin * d, shard->kv_heads.end * d};
    qkv_slices = {Slice::Rows(q), Slice::Rows(kv), Slice::Rows(kv)};
    o_slice = Slice::Columns(q);
  }
  const std::string heads = absl::StrCat("num_attention_heads=", s.num_heads, " x head_dim=", s.head_dim);
  const std::string kv_heads = absl::StrCat("num_key_value_heads=", s.num_kv_heads, " x head_dim=", s.head_dim);
  const std::string a = p + "self_attn.";
  const std::string qkv_why = heads + ", " + kv_heads;
  MOE_ASSIGN_OR_RETURN(l.qkv, w.LoadFused({a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
                                          {{qw, h}, {kvw, h}, {kvw, h}}, qkv_why, WeightUse::kMatrix, qkv_slices));
  MOE_ASSIGN_OR_RETURN(l.o, w.Load(a + "o_proj.weight", {h, qw}, heads, WeightUse::kMatrix, o_slice));
  if (s.qkv_bias) {
    MOE_ASSIGN_OR_RETURN(l.qkv_bias, w.LoadFused({a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"},
                                                 {{qw}, {kvw}, {kvw}}, qkv_why, WeightUse::kVector, qkv_slices));
  }
  if (s.qk_norm) {
    const std::string d = absl::StrCat("head_dim=", s.head_dim);
    MOE_ASSIGN_OR_RETURN(l.q_norm, w.Load(a + "q_norm.weight", {s.head_dim}, d, WeightUse::kVector));
    MOE_ASSIGN_OR_RETURN(l.k_norm, w.Load(a + "k_norm.weight", {s.head_dim}, d, WeightUse::kVector));
  }
  const std::string hs = absl::StrCat("hidden_size=", h);
  MOE_ASSIGN_OR_RETURN(l.input_norm, w.Load(p + "input_layernorm.weight", {h}, hs, WeightUse::kVector));
  MOE_ASSIGN_OR_RETURN(l.post_attention_norm,
                       w.Load(p + "post_attention_layernorm.weight", {h}, hs, WeightUse::kVector));
  return absl::OkStatus();
}

// Layer `layer`'s routed experts that the backend holds (`on_backend`, or every one), with the
// index SplitRouting reads when it holds only some. `shard`: a tensor split's; when the backend
// runs every expert, the rank holds those it owns.
absl::Status LoadBackendExperts(const ModelSpec& s, int layer, WeightLoader& w, const std::vector<int>& on_backend,
                                Backend& backend, LayerWeights& l, const std::optional<TensorShard>& shard) {
  const int64_t h = s.hidden_size;
  const int e = s.routing.num_experts;
  const std::string width = s.arch == Architecture::kMixtral
                                ? absl::StrCat("intermediate_size=", s.moe_intermediate_size)
                                : absl::StrCat("moe_intermediate_size=", s.moe_intermediate_size);
  std::vector<ExpertTensorNames> names(e);
  for (int i = 0; i < e; ++i) {
    names[i] = ExpertNames(s, layer, i);
    MOE_RETURN_IF_ERROR(w.CheckOnly(names[i].gate, {s.moe_intermediate_size, h}, width));
    MOE_RETURN_IF_ERROR(w.CheckOnly(names[i].up, {s.moe_intermediate_size, h}, width));
    MOE_RETURN_IF_ERROR(w.CheckOnly(names[i].down, {h, s.moe_intermediate_size}, width));
  }
  // The experts the backend holds, in the order it numbers them.
  const bool every = static_cast<int>(on_backend.size()) == e;
  std::vector<int> held;
  if (every && shard) {
    for (int i = 0; i < e; ++i) {
      if (shard->OwnsExpert(i)) held.push_back(i);
    }
  } else {
    held = on_backend;
  }
  if (held.empty()) return absl::OkStatus();
  std::vector<std::string> g, u, d;
  for (int i : held) {
    g.push_back(names[i].gate);
    u.push_back(names[i].up);
    d.push_back(names[i].down);
  }
  MOE_ASSIGN_OR_RETURN(l.experts, w.LoadExperts(g, u, d, h, s.moe_intermediate_size, width));
  if (every && !shard) return absl::OkStatus();  // every pick goes to the backend: no index
  // Each expert's index among those held, or -1.
  std::vector<int32_t> index(e, -1);
  for (size_t i = 0; i < held.size(); ++i) index[held[i]] = static_cast<int32_t>(i);
  if (shard) {
    MOE_ASSIGN_OR_RETURN(l.owner_index, backend.Allocate(core::DType::kI32, 1, e));
    backend.CopyFromHost(index.data(), l.owner_index->tensor());
    return backend.Synchronize();  // `index` goes away
  }
  // Kept on the host too: the held experts chosen while serving are swapped through it.
  l.backend_index_host = std::move(index);
  MOE_ASSIGN_OR_RETURN(l.backend_index, backend.Allocate(core::DType::kI32, 1, e));
  backend.CopyFromHost(l.backend_index_host.data(), l.backend_index->tensor());
  return absl::OkStatus();
}

// A MoE layer: its router, the routed experts the backend holds, and its shared experts (a tensor
// split's rank holds their columns).
absl::Status LoadMoe(const ModelSpec& s, int layer, WeightLoader& w, const std::vector<int>& on_backend,
                     Backend& backend, LayerWeights& l, const std::optional<TensorShard>& shard) {
  const int64_t h = s.hidden_size;
  const int e = s.routing.num_experts;
  const std::string block =
      absl::StrCat("model.layers.", layer, s.arch == Architecture::kMixtral ? ".block_sparse_moe." : ".mlp.");
  const std::string experts_key = absl::StrCat("num_experts=", e);
  MOE_ASSIGN_OR_RETURN(l.router, w.Load(block + "gate.weight", {e, h}, experts_key, WeightUse::kRouter));
  if (s.routing.has_correction_bias) {
    MOE_ASSIGN_OR_RETURN(l.correction_bias,
                         w.Load(block + "gate.e_score_correction_bias", {e}, experts_key, WeightUse::kVector));
  }
  MOE_RETURN_IF_ERROR(LoadBackendExperts(s, layer, w, on_backend, backend, l, shard));
  if (s.shared_expert_intermediate_size > 0) {
    const bool qwen2 = s.arch == Architecture::kQwen2Moe;
    const std::string sp = block + (qwen2 ? "shared_expert." : "shared_experts.");
    const std::string why =
        qwen2 ? absl::StrCat("shared_expert_intermediate_size=", s.shared_expert_intermediate_size)
              : absl::StrCat("n_shared_experts x moe_intermediate_size=", s.shared_expert_intermediate_size);
    MOE_RETURN_IF_ERROR(w.LoadFfn(sp, "gate_proj", "up_proj", "down_proj", h, s.shared_expert_intermediate_size, why,
                                  &l.shared, shard ? std::optional<Range>(shard->shared) : std::nullopt));
    if (s.shared_expert_gate) {
      MOE_ASSIGN_OR_RETURN(l.shared_gate, w.Load(block + "shared_expert_gate.weight", {1, h}, "shared expert gate"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

ExpertTensorNames ExpertNames(const ModelSpec& spec, int layer, int expert) {
  const bool mixtral = spec.arch == Architecture::kMixtral;
  const std::string p =
      absl::StrCat("model.layers.", layer, mixtral ? ".block_sparse_moe" : ".mlp", ".experts.", expert, ".");
  if (mixtral) return {p + "w1.weight", p + "w3.weight", p + "w2.weight"};
  return {p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"};
}

absl::StatusOr<std::unique_ptr<Model::Weights>> LoadWeights(const ModelSpec& s, const WeightSource& source,
                                                            Backend& backend,
                                                            const std::vector<std::vector<int>>& backend_experts,
                                                            bool progress, const WeightShare& share) {
  // What goes to the backend: every tensor but the routed experts of the layers the pool holds.
  int64_t total = 0;
  for (const std::string& name : source.Names()) {
    const TensorKind kind = ClassifyTensor(name);
    if (kind.role == TensorRole::kRoutedExpert && kind.layer >= 0 &&
        kind.layer < static_cast<int>(backend_experts.size()) &&
        std::find(backend_experts[kind.layer].begin(), backend_experts[kind.layer].end(), kind.expert) ==
            backend_experts[kind.layer].end()) {
      continue;
    }
    auto view = source.Get(name);
    if (view.ok()) total += view->bytes();
  }
  std::optional<core::ProgressReporter> reporter;
  if (progress) reporter.emplace(absl::StrCat("loading weights onto ", backend.name()), total);
  auto weights = std::make_unique<Model::Weights>();
  WeightLoader w(source, backend, reporter ? &*reporter : nullptr, &weights->slices);
  const int64_t h = s.hidden_size, vocab = s.vocab_size;
  const std::string vh = absl::StrCat("vocab_size=", vocab, ", hidden_size=", h);
  // A layer split: the first stage embeds; the last holds the final norm and the LM head.
  const bool first = share.layers.begin == 0, last = share.layers.end == s.num_layers;
  const bool tied = s.tie_word_embeddings && !source.Has("lm_head.weight");
  const std::optional<TensorShard>& shard = share.tensor;
  const Slice vocab_rows = shard && shard->vocab.size() < vocab ? Slice::Rows(shard->vocab) : Slice{};
  if (first) {
    MOE_ASSIGN_OR_RETURN(weights->embed, w.Load("model.embed_tokens.weight", {vocab, h}, vh, WeightUse::kEmbedding));
  }
  if (last) {
    MOE_ASSIGN_OR_RETURN(weights->final_norm,
                         w.Load("model.norm.weight", {h}, absl::StrCat("hidden_size=", h), WeightUse::kVector));
    if (tied && first && vocab_rows.kind == Slice::Kind::kWhole) {
      weights->lm_head = weights->embed.get();
    } else {
      MOE_ASSIGN_OR_RETURN(weights->lm_head_owned, w.Load(tied ? "model.embed_tokens.weight" : "lm_head.weight",
                                                          {vocab, h}, vh, WeightUse::kMatrix, vocab_rows));
      weights->lm_head = weights->lm_head_owned.get();
    }
  }
  weights->layers.resize(s.num_layers);
  for (int layer = static_cast<int>(share.layers.begin); layer < share.layers.end; ++layer) {
    const std::string p = absl::StrCat("model.layers.", layer, ".");
    LayerWeights& l = weights->layers[layer];
    MOE_RETURN_IF_ERROR(LoadAttention(s, p, w, l, shard));
    if (s.IsMoeLayer(layer)) {
      MOE_RETURN_IF_ERROR(LoadMoe(s, layer, w, backend_experts[layer], backend, l, shard));
    } else {
      MOE_RETURN_IF_ERROR(w.LoadFfn(p + "mlp.", "gate_proj", "up_proj", "down_proj", h, s.intermediate_size,
                                    absl::StrCat("intermediate_size=", s.intermediate_size, " (dense layer)"), &l.dense,
                                    shard ? std::optional<Range>(shard->dense) : std::nullopt));
    }
  }
  MOE_RETURN_IF_ERROR(backend.Synchronize());
  if (reporter) reporter->Finish();
  weights->bytes = w.device_bytes();
  // A rank of a split leaves the other ranks' tensors unused on purpose.
  if (first && last && !shard) w.WarnUnused();
  return weights;
}

}  // namespace moe::runtime::internal

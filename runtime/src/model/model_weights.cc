#include "model/model_weights.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moe/core/logging.h"
#include "moe/core/progress.h"
#include "moe/core/status.h"
#include "moe/experts/gguf_types.h"
#include "moe/runtime/checkpoint.h"

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

// Fetches tensors by key, checks them and hands them (or a split's share of them) to the
// backend; remembers what it used and counts the bytes it handed over. Column shares are copied
// into `slices`, which must outlive the weights.
class WeightLoader {
 public:
  WeightLoader(const Checkpoint& checkpoint, Backend& backend, core::ProgressReporter* progress,
               std::vector<std::vector<uint8_t>>* slices, std::vector<std::vector<float>>* expanded)
      : checkpoint_(checkpoint), backend_(backend), progress_(progress), slices_(slices), kept_(expanded) {}

  // `why` names the config keys behind the expected shape, for the error message.
  absl::StatusOr<std::unique_ptr<DeviceWeight>> Load(const TensorKey& key, const Shape& want, const std::string& why,
                                                     WeightUse use = WeightUse::kMatrix, Slice slice = {}) {
    MOE_ASSIGN_OR_RETURN(std::optional<std::vector<WeightView>> stored, StoredParts({key}, {want}, why, use, {slice}));
    if (stored) return LoadStored(*stored, use, key);
    MOE_ASSIGN_OR_RETURN(core::TensorView whole, Check(key, want, why));
    const core::TensorView view = Share(whole, slice);
    auto weight = backend_.PrepareWeight(view, use, RoleOf(key.id));
    if (!weight.ok()) return core::Annotate(weight.status(), checkpoint_.names().Name(key));
    Count(view.bytes(), **weight);
    MOE_RETURN_IF_ERROR(ReleaseExpanded());
    return weight;
  }

  // Several tensors stacked by rows into one weight (the fused QKV and gate+up projections).
  absl::StatusOr<std::unique_ptr<DeviceWeight>> LoadFused(const std::vector<TensorKey>& keys,
                                                          const std::vector<Shape>& shapes, const std::string& why,
                                                          WeightUse use = WeightUse::kMatrix,
                                                          const std::vector<Slice>& slices = {}) {
    MOE_ASSIGN_OR_RETURN(std::optional<std::vector<WeightView>> stored, StoredParts(keys, shapes, why, use, slices));
    if (stored) return LoadStored(*stored, use, keys[0]);
    std::vector<core::TensorView> views;
    int64_t bytes = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      MOE_ASSIGN_OR_RETURN(core::TensorView whole, Check(keys[i], shapes[i], why));
      const core::TensorView view = Share(whole, i < slices.size() ? slices[i] : Slice{});
      bytes += view.bytes();
      views.push_back(view);
    }
    auto weight = backend_.PrepareFusedWeight(views, use, RoleOf(keys[0].id));
    if (!weight.ok()) return core::Annotate(weight.status(), checkpoint_.names().Name(keys[0]));
    Count(bytes, **weight);
    MOE_RETURN_IF_ERROR(ReleaseExpanded());
    return weight;
  }

  // Loads an FFN's three matrices (`ids`: gate, up, down), gate and up fused; with out == null only
  // checks them. `share` (a tensor split's): the intermediate units this rank holds, gate's and
  // up's rows and down's columns.
  absl::Status LoadFfn(int layer, const std::array<TensorId, 3>& ids, int64_t hidden, int64_t width,
                       const std::string& why, FfnWeights* out, std::optional<Range> share = std::nullopt) {
    const TensorKey keys[3] = {{ids[0], layer}, {ids[1], layer}, {ids[2], layer}};
    const Shape shapes[3] = {{width, hidden}, {width, hidden}, {hidden, width}};
    if (out == nullptr) {
      for (int i = 0; i < 3; ++i) MOE_RETURN_IF_ERROR(Stored(keys[i], shapes[i], why).status());
      return absl::OkStatus();
    }
    const Slice rows = share ? Slice::Rows(*share) : Slice{}, columns = share ? Slice::Columns(*share) : Slice{};
    MOE_ASSIGN_OR_RETURN(out->gate_up,
                         LoadFused({keys[0], keys[1]}, {shapes[0], shapes[1]}, why, WeightUse::kMatrix, {rows, rows}));
    MOE_ASSIGN_OR_RETURN(out->down, Load(keys[2], shapes[2], why, WeightUse::kMatrix, columns));
    return absl::OkStatus();
  }

  // Routed experts `experts` of `layer`, handed to the backend together.
  absl::StatusOr<std::unique_ptr<BackendExpertWeights>> LoadExperts(int layer, const std::vector<int>& experts,
                                                                    int64_t hidden, int64_t width,
                                                                    const std::string& why) {
    std::vector<core::TensorView> g, u, d;
    int64_t bytes = 0;
    for (int e : experts) {
      MOE_ASSIGN_OR_RETURN(core::TensorView gv, Check({TensorId::kExpertGate, layer, e}, {width, hidden}, why));
      MOE_ASSIGN_OR_RETURN(core::TensorView uv, Check({TensorId::kExpertUp, layer, e}, {width, hidden}, why));
      MOE_ASSIGN_OR_RETURN(core::TensorView dv, Check({TensorId::kExpertDown, layer, e}, {hidden, width}, why));
      bytes += gv.bytes() + uv.bytes() + dv.bytes();
      g.push_back(gv);
      u.push_back(uv);
      d.push_back(dv);
    }
    auto prepared = backend_.PrepareExperts(g, u, d);
    if (!prepared.ok()) {
      return core::Annotate(prepared.status(), checkpoint_.names().Name({TensorId::kExpertGate, layer, experts[0]}));
    }
    if (progress_ != nullptr) progress_->Add(bytes);
    device_bytes_ += (*prepared)->bytes();
    MOE_RETURN_IF_ERROR(ReleaseExpanded());
    return prepared;
  }

  int64_t device_bytes() const { return device_bytes_; }
  // Checks a tensor's shape and type without expanding it.
  absl::Status CheckOnly(const TensorKey& key, const Shape& want, const std::string& why) {
    return Stored(key, want, why).status();
  }

  // The checkpoint's tensors that no key loaded named, but for the nextn layers (kept for
  // speculative decoding, not run by the forward).
  void WarnUnused(const ModelSpec& spec) const {
    std::vector<std::string> unused;
    for (const std::string& name : checkpoint_.source().Names()) {
      if (used_.count(name)) continue;
      const std::optional<TensorKey> key = checkpoint_.names().Parse(name);
      if (key && key->layer >= spec.num_layers && key->layer < spec.num_all_layers()) continue;
      unused.push_back(name);
    }
    if (unused.empty()) return;
    const size_t shown = std::min<size_t>(unused.size(), 4);
    MOE_LOG(kWarning) << unused.size() << " tensors in the checkpoint are not used by this model ("
                      << absl::StrJoin(unused.begin(), unused.begin() + shown, ", ")
                      << (unused.size() > shown ? ", ..." : "") << ")";
  }

 private:
  // The tensor `key` names as stored, its shape checked against `want`.
  absl::StatusOr<WeightView> Stored(const TensorKey& key, const Shape& want, const std::string& why) {
    const std::string name = checkpoint_.names().Name(key);
    used_.insert(name);
    auto view = checkpoint_.Get(key);
    if (!view.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(view.status().message(), " (config expects ", core::ShapeString(want), ": ", why, ")"));
    }
    if (view->shape != want) {
      std::string what = name;
      if (checkpoint_.names().Stacked(key.id)) absl::StrAppend(&what, " (expert ", key.expert, ")");
      return absl::InvalidArgumentError(absl::StrCat(what, ": shape ", core::ShapeString(view->shape), " in ",
                                                     checkpoint_.source().FileOf(name), ", config expects ",
                                                     core::ShapeString(want), " (", why, ")"));
    }
    if (const WeightFormat& f = view->format; f.plain() && f.element != core::DType::kBF16 &&
                                              f.element != core::DType::kF16 && f.element != core::DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": dtype ", f.Name(), " in ", checkpoint_.source().FileOf(name),
                       f.element == core::DType::kF8E4M3
                           ? ", without scales (config.json has no quantization_config with quant_method fp8)"
                           : ", expected BF16, F16 or F32"));
    }
    if (const WeightFormat& f = view->format; f.kind == WeightFormat::Kind::kBlocks && experts::FindGgufType(f.type_id) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(name, " in ", checkpoint_.source().FileOf(name), " is ", f.Name(),
                                                     ", a type moeserve does not read (types read: ",
                                                     experts::SupportedGgufTypeNames(), ")"));
    }
    return view;
  }

  // The tensor as plain values for the backend: as stored, or dequantized (kept until the backend
  // has it: see ReleaseExpanded).
  absl::StatusOr<core::TensorView> Check(const TensorKey& key, const Shape& want, const std::string& why) {
    MOE_ASSIGN_OR_RETURN(const WeightView view, Stored(key, want, why));
    if (view.format.plain()) return view.AsTensor();
    std::vector<float>& storage = expanded_.emplace_back();
    auto plain = ExpandToFloats(view, &storage);
    if (!plain.ok()) {
      const std::string name = checkpoint_.names().Name(key);
      return absl::InvalidArgumentError(
          absl::StrCat(name, " in ", checkpoint_.source().FileOf(name), ": ", plain.status().message()));
    }
    return *plain;
  }

  // The parts as stored when the backend keeps them so (GGUF blocks of one type, on the CPU
  // backend; whole or by rows), else nullopt: they go through Check, as plain values.
  absl::StatusOr<std::optional<std::vector<WeightView>>> StoredParts(const std::vector<TensorKey>& keys,
                                                                     const std::vector<Shape>& shapes,
                                                                     const std::string& why, WeightUse use,
                                                                     const std::vector<Slice>& slices) {
    std::vector<WeightView> parts;
    for (size_t i = 0; i < keys.size(); ++i) {
      MOE_ASSIGN_OR_RETURN(WeightView v, Stored(keys[i], shapes[i], why));
      const Slice slice = i < slices.size() ? slices[i] : Slice{};
      if (v.format.plain() || !backend_.SupportsWeight(v.format, use) || slice.kind == Slice::Kind::kColumns ||
          (!parts.empty() && !(v.format == parts[0].format))) {
        return std::optional<std::vector<WeightView>>();
      }
      if (slice.kind == Slice::Kind::kRows) {
        v.data = static_cast<const uint8_t*>(v.data) + slice.range.begin * v.format.RowBytes(v.shape[1]);
        v.shape[0] = slice.range.size();
      }
      parts.push_back(v);
    }
    return std::optional<std::vector<WeightView>>(std::move(parts));
  }

  absl::StatusOr<std::unique_ptr<DeviceWeight>> LoadStored(const std::vector<WeightView>& parts, WeightUse use,
                                                           const TensorKey& key) {
    auto weight = backend_.PrepareStoredWeight(parts, use, RoleOf(key.id));
    if (!weight.ok()) return core::Annotate(weight.status(), checkpoint_.names().Name(key));
    int64_t bytes = 0;
    for (const WeightView& p : parts) bytes += p.bytes();
    Count(bytes, **weight);
    return weight;
  }

  // Dequantized copies: a GPU backend has uploaded them once it synchronizes; a host backend keeps
  // pointers into them, so they live with the weights.
  absl::Status ReleaseExpanded() {
    if (expanded_.empty()) return absl::OkStatus();
    if (backend_.weight_home() == WeightHome::kGpu) {
      MOE_RETURN_IF_ERROR(backend_.Synchronize());
    } else {
      for (std::vector<float>& e : expanded_) kept_->push_back(std::move(e));
    }
    expanded_.clear();
    return absl::OkStatus();
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

  const Checkpoint& checkpoint_;
  Backend& backend_;
  core::ProgressReporter* progress_;
  std::vector<std::vector<uint8_t>>* slices_;
  std::vector<std::vector<float>>* kept_;
  std::vector<std::vector<float>> expanded_;
  std::set<std::string> used_;
  int64_t device_bytes_ = 0;
};

// An MLA layer's projections. `shard`: a tensor split's heads (rows of q_b or q, and of kv_b;
// columns of o); the compressed projections and their norms are every rank's.
absl::Status LoadMla(const ModelSpec& s, int layer, WeightLoader& w, LayerWeights& l,
                     const std::optional<TensorShard>& shard) {
  using I = TensorId;
  const MlaSpec& m = s.mla;
  const int64_t h = s.hidden_size, heads = s.num_heads, qk = m.qk_head_dim(), kv_b = m.qk_nope_head_dim + m.v_head_dim;
  Slice q_rows, kv_b_rows, o_columns;
  if (shard) {
    const Range r = shard->q_heads;
    q_rows = Slice::Rows({r.begin * qk, r.end * qk});
    kv_b_rows = Slice::Rows({r.begin * kv_b, r.end * kv_b});
    o_columns = Slice::Columns({r.begin * m.v_head_dim, r.end * m.v_head_dim});
  }
  const std::string q_why = absl::StrCat("num_attention_heads=", heads, " x (qk_nope_head_dim=", m.qk_nope_head_dim,
                                         " + qk_rope_head_dim=", m.qk_rope_head_dim, ")");
  if (m.q_lora_rank > 0) {
    const std::string rank = absl::StrCat("q_lora_rank=", m.q_lora_rank);
    MOE_ASSIGN_OR_RETURN(l.mla_q_a, w.Load({I::kMlaQA, layer}, {m.q_lora_rank, h}, rank));
    MOE_ASSIGN_OR_RETURN(l.mla_q_a_norm, w.Load({I::kMlaQANorm, layer}, {m.q_lora_rank}, rank, WeightUse::kVector));
    MOE_ASSIGN_OR_RETURN(l.mla_q, w.Load({I::kMlaQB, layer}, {heads * qk, m.q_lora_rank}, q_why + ", " + rank,
                                         WeightUse::kMatrix, q_rows));
  } else {
    MOE_ASSIGN_OR_RETURN(l.mla_q, w.Load({I::kAttnQ, layer}, {heads * qk, h}, q_why + " (q_lora_rank null)",
                                         WeightUse::kMatrix, q_rows));
  }
  const std::string latent = absl::StrCat("kv_lora_rank=", m.kv_lora_rank, " + qk_rope_head_dim=", m.qk_rope_head_dim);
  MOE_ASSIGN_OR_RETURN(l.mla_kv_a, w.Load({I::kMlaKvA, layer}, {m.latent_width(), h}, latent));
  const std::string rank = absl::StrCat("kv_lora_rank=", m.kv_lora_rank);
  MOE_ASSIGN_OR_RETURN(l.mla_kv_a_norm, w.Load({I::kMlaKvANorm, layer}, {m.kv_lora_rank}, rank, WeightUse::kVector));
  MOE_ASSIGN_OR_RETURN(l.mla_kv_b, w.Load({I::kMlaKvB, layer}, {heads * kv_b, m.kv_lora_rank},
                                          absl::StrCat("num_attention_heads=", heads, " x (qk_nope_head_dim=",
                                                       m.qk_nope_head_dim, " + v_head_dim=", m.v_head_dim, "), ", rank),
                                          WeightUse::kVector, kv_b_rows));
  MOE_ASSIGN_OR_RETURN(l.o, w.Load({I::kAttnO, layer}, {h, heads * m.v_head_dim},
                                   absl::StrCat("num_attention_heads=", heads, " x v_head_dim=", m.v_head_dim),
                                   WeightUse::kMatrix, o_columns));
  const std::string hs = absl::StrCat("hidden_size=", h);
  MOE_ASSIGN_OR_RETURN(l.input_norm, w.Load({I::kAttnNorm, layer}, {h}, hs, WeightUse::kVector));
  MOE_ASSIGN_OR_RETURN(l.post_attention_norm, w.Load({I::kFfnNorm, layer}, {h}, hs, WeightUse::kVector));
  return absl::OkStatus();
}

// `shard`: a tensor split's query and KV heads (rows of q, k, v and their biases; columns of o).
absl::Status LoadAttention(const ModelSpec& s, int layer, WeightLoader& w, LayerWeights& l,
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
  using I = TensorId;
  const std::string heads = absl::StrCat("num_attention_heads=", s.num_heads, " x head_dim=", s.head_dim);
  const std::string kv_heads = absl::StrCat("num_key_value_heads=", s.num_kv_heads, " x head_dim=", s.head_dim);
  const std::string qkv_why = heads + ", " + kv_heads;
  MOE_ASSIGN_OR_RETURN(l.qkv, w.LoadFused({{I::kAttnQ, layer}, {I::kAttnK, layer}, {I::kAttnV, layer}},
                                          {{qw, h}, {kvw, h}, {kvw, h}}, qkv_why, WeightUse::kMatrix, qkv_slices));
  MOE_ASSIGN_OR_RETURN(l.o, w.Load({I::kAttnO, layer}, {h, qw}, heads, WeightUse::kMatrix, o_slice));
  if (s.qkv_bias) {
    MOE_ASSIGN_OR_RETURN(l.qkv_bias,
                         w.LoadFused({{I::kAttnQBias, layer}, {I::kAttnKBias, layer}, {I::kAttnVBias, layer}},
                                     {{qw}, {kvw}, {kvw}}, qkv_why, WeightUse::kVector, qkv_slices));
  }
  if (s.qk_norm) {
    const std::string d = absl::StrCat("head_dim=", s.head_dim);
    MOE_ASSIGN_OR_RETURN(l.q_norm, w.Load({I::kAttnQNorm, layer}, {s.head_dim}, d, WeightUse::kVector));
    MOE_ASSIGN_OR_RETURN(l.k_norm, w.Load({I::kAttnKNorm, layer}, {s.head_dim}, d, WeightUse::kVector));
  }
  const std::string hs = absl::StrCat("hidden_size=", h);
  MOE_ASSIGN_OR_RETURN(l.input_norm, w.Load({I::kAttnNorm, layer}, {h}, hs, WeightUse::kVector));
  MOE_ASSIGN_OR_RETURN(l.post_attention_norm, w.Load({I::kFfnNorm, layer}, {h}, hs, WeightUse::kVector));
  return absl::OkStatus();
}

// Layer `layer`'s routed experts that the backend holds (`on_backend`, or every one), with the
// index SplitRouting reads when it holds only some. `shard`: a tensor split's; when the backend
// runs every expert, the rank holds those it owns.
absl::Status LoadBackendExperts(const ModelSpec& s, int layer, WeightLoader& w, const std::vector<int>& on_backend,
                                Backend& backend, LayerWeights& l, const std::optional<TensorShard>& shard) {
  const int64_t h = s.hidden_size, width = s.moe_intermediate_size;
  const int e = s.routing.num_experts;
  const std::string why = s.arch == Architecture::kMixtral ? absl::StrCat("intermediate_size=", width)
                                                           : absl::StrCat("moe_intermediate_size=", width);
  for (int i = 0; i < e; ++i) {
    MOE_RETURN_IF_ERROR(w.CheckOnly({TensorId::kExpertGate, layer, i}, {width, h}, why));
    MOE_RETURN_IF_ERROR(w.CheckOnly({TensorId::kExpertUp, layer, i}, {width, h}, why));
    MOE_RETURN_IF_ERROR(w.CheckOnly({TensorId::kExpertDown, layer, i}, {h, width}, why));
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
  MOE_ASSIGN_OR_RETURN(l.experts, w.LoadExperts(layer, held, h, width, why));
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
  using I = TensorId;
  const int64_t h = s.hidden_size;
  const int e = s.routing.num_experts;
  const std::string experts_key = absl::StrCat("num_experts=", e);
  MOE_ASSIGN_OR_RETURN(l.router, w.Load({I::kRouter, layer}, {e, h}, experts_key, WeightUse::kRouter));
  if (s.routing.has_correction_bias) {
    MOE_ASSIGN_OR_RETURN(l.correction_bias, w.Load({I::kRouterBias, layer}, {e}, experts_key, WeightUse::kVector));
  }
  MOE_RETURN_IF_ERROR(LoadBackendExperts(s, layer, w, on_backend, backend, l, shard));
  if (s.shared_expert_intermediate_size > 0) {
    const std::string why =
        s.arch == Architecture::kQwen2Moe
            ? absl::StrCat("shared_expert_intermediate_size=", s.shared_expert_intermediate_size)
            : absl::StrCat("n_shared_experts x moe_intermediate_size=", s.shared_expert_intermediate_size);
    MOE_RETURN_IF_ERROR(w.LoadFfn(layer, {I::kSharedGate, I::kSharedUp, I::kSharedDown}, h,
                                  s.shared_expert_intermediate_size, why, &l.shared,
                                  shard ? std::optional<Range>(shard->shared) : std::nullopt));
    if (s.shared_expert_gate) {
      MOE_ASSIGN_OR_RETURN(l.shared_gate, w.Load({I::kSharedExpertGate, layer}, {1, h}, "shared expert gate"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model::Weights>> LoadWeights(const Checkpoint& checkpoint, Backend& backend,
                                                            const std::vector<std::vector<int>>& backend_experts,
                                                            bool progress, const WeightShare& share) {
  using I = TensorId;
  const ModelSpec& s = checkpoint.spec();
  // What goes to the backend: every tensor but the routed experts of the layers the pool holds.
  int64_t total = 0;
  for (const std::string& name : checkpoint.source().Names()) {
    const std::optional<TensorKey> key = checkpoint.names().Parse(name);
    if (key && RoleOf(key->id) == TensorRole::kRoutedExpert && key->layer >= 0 &&
        key->layer < static_cast<int>(backend_experts.size()) &&
        std::find(backend_experts[key->layer].begin(), backend_experts[key->layer].end(), key->expert) ==
            backend_experts[key->layer].end()) {
      continue;
    }
    auto view = checkpoint.source().GetStored(name);
    if (view.ok()) total += view->bytes();
  }
  std::optional<core::ProgressReporter> reporter;
  if (progress) reporter.emplace(absl::StrCat("loading weights onto ", backend.name()), total);
  auto weights = std::make_unique<Model::Weights>();
  WeightLoader w(checkpoint, backend, reporter ? &*reporter : nullptr, &weights->slices, &weights->expanded);
  const int64_t h = s.hidden_size, vocab = s.vocab_size;
  const std::string vh = absl::StrCat("vocab_size=", vocab, ", hidden_size=", h);
  // A layer split: the first stage embeds; the last holds the final norm and the LM head.
  const bool first = share.layers.begin == 0, last = share.layers.end == s.num_layers;
  const bool tied = s.tie_word_embeddings && !checkpoint.Has({I::kLmHead});
  const std::optional<TensorShard>& shard = share.tensor;
  const Slice vocab_rows = shard && shard->vocab.size() < vocab ? Slice::Rows(shard->vocab) : Slice{};
  if (first) {
    MOE_ASSIGN_OR_RETURN(weights->embed, w.Load({I::kEmbedding}, {vocab, h}, vh, WeightUse::kEmbedding));
  }
  if (last) {
    MOE_ASSIGN_OR_RETURN(weights->final_norm,
                         w.Load({I::kFinalNorm}, {h}, absl::StrCat("hidden_size=", h), WeightUse::kVector));
    // A GGUF embedding kept as stored rows is gathered, not multiplied: the tied head is its own
    // Linear then.
    const bool embedding_rows = first && checkpoint.Get({I::kEmbedding}).ok() &&
                                !checkpoint.Get({I::kEmbedding})->format.plain() &&
                                backend.SupportsWeight(checkpoint.Get({I::kEmbedding})->format, WeightUse::kEmbedding);
    if (tied && first && vocab_rows.kind == Slice::Kind::kWhole && !embedding_rows) {
      weights->lm_head = weights->embed.get();
    } else {
      MOE_ASSIGN_OR_RETURN(weights->lm_head_owned,
                           w.Load({tied ? I::kEmbedding : I::kLmHead}, {vocab, h}, vh, WeightUse::kMatrix, vocab_rows));
      weights->lm_head = weights->lm_head_owned.get();
    }
  }
  // An MTP head: the share is its layer; it embeds, and its shared_head ends it.
  const bool head = share.layers.begin >= s.num_layers;
  if (head) {
    const int n = static_cast<int>(share.layers.begin);
    const std::string hs = absl::StrCat("hidden_size=", h);
    const I embedding = checkpoint.Has({I::kNextnEmbedding, n}) ? I::kNextnEmbedding : I::kEmbedding;
    const int embedding_layer = embedding == I::kNextnEmbedding ? n : -1;
    MOE_ASSIGN_OR_RETURN(weights->embed, w.Load({embedding, embedding_layer}, {vocab, h}, vh, WeightUse::kEmbedding));
    MOE_ASSIGN_OR_RETURN(weights->nextn_enorm, w.Load({I::kNextnEmbedNorm, n}, {h}, hs, WeightUse::kVector));
    MOE_ASSIGN_OR_RETURN(weights->nextn_hnorm, w.Load({I::kNextnHiddenNorm, n}, {h}, hs, WeightUse::kVector));
    const std::string proj = absl::StrCat("eh_proj: [hidden_size x 2 hidden_size], hidden_size=", h);
    MOE_ASSIGN_OR_RETURN(weights->nextn_proj_embed, w.Load({I::kNextnProj, n}, {h, 2 * h}, proj, WeightUse::kMatrix,
                                                           Slice::Columns(Range{0, h})));
    MOE_ASSIGN_OR_RETURN(weights->nextn_proj_hidden, w.Load({I::kNextnProj, n}, {h, 2 * h}, proj, WeightUse::kMatrix,
                                                            Slice::Columns(Range{h, 2 * h})));
    MOE_ASSIGN_OR_RETURN(weights->final_norm, w.Load({I::kNextnHeadNorm, n}, {h}, hs, WeightUse::kVector));
    if (checkpoint.Has({I::kNextnHead, n})) {
      MOE_ASSIGN_OR_RETURN(weights->lm_head_owned, w.Load({I::kNextnHead, n}, {vocab, h}, vh));
    } else {
      MOE_ASSIGN_OR_RETURN(weights->lm_head_owned, w.Load({tied ? I::kEmbedding : I::kLmHead}, {vocab, h}, vh));
    }
    weights->lm_head = weights->lm_head_owned.get();
  }
  weights->layers.resize(s.num_all_layers());
  for (int layer = static_cast<int>(share.layers.begin); layer < share.layers.end; ++layer) {
    LayerWeights& l = weights->layers[layer];
    if (s.attention(layer) == AttentionKind::kMla) {
      MOE_RETURN_IF_ERROR(LoadMla(s, layer, w, l, shard));
    } else {
      MOE_RETURN_IF_ERROR(LoadAttention(s, layer, w, l, shard));
    }
    if (s.IsMoeLayer(layer)) {
      MOE_RETURN_IF_ERROR(LoadMoe(s, layer, w, backend_experts[layer], backend, l, shard));
    } else {
      MOE_RETURN_IF_ERROR(w.LoadFfn(layer, {I::kDenseGate, I::kDenseUp, I::kDenseDown}, h, s.intermediate_size,
                                    absl::StrCat("intermediate_size=", s.intermediate_size, " (dense layer)"), &l.dense,
                                    shard ? std::optional<Range>(shard->dense) : std::nullopt));
    }
  }
  MOE_RETURN_IF_ERROR(backend.Synchronize());
  if (reporter) reporter->Finish();
  weights->bytes = w.device_bytes();
  // A rank of a split leaves the other ranks' tensors unused on purpose.
  if (first && last && !shard && !head) w.WarnUnused(s);
  return weights;
}

}  // namespace moe::runtime::internal

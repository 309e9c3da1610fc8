#include "moe/runtime/checkpoint.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "checkpoint/fp8_source.h"
#include "checkpoint/gguf_checkpoint.h"
#include "moe/experts/gguf_types.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "moe/core/file.h"
#include "moe/core/files_fingerprint.h"
#include "moe/core/status.h"

namespace moe::runtime {
namespace {

namespace fs = std::filesystem;

constexpr int kIds = static_cast<int>(TensorId::kCount);

// Reads a decimal number at the start of `s`, advancing it; -1 when there is none.
int ReadNumber(std::string_view* s) {
  int value = -1;
  const auto [end, ec] = std::from_chars(s->data(), s->data() + s->size(), value);
  if (ec != std::errc() || end == s->data()) return -1;
  s->remove_prefix(static_cast<size_t>(end - s->data()));
  return value;
}

// Matches `name` against a template with {L} and {E}; fills in what they stand for.
bool MatchTemplate(std::string_view tmpl, std::string_view name, int* layer, int* expert) {
  *layer = -1;
  *expert = -1;
  while (!tmpl.empty()) {
    if (tmpl.starts_with("{L}") || tmpl.starts_with("{E}")) {
      int* slot = tmpl[1] == 'L' ? layer : expert;
      if ((*slot = ReadNumber(&name)) < 0) return false;
      tmpl.remove_prefix(3);
      continue;
    }
    const size_t literal = std::min(tmpl.find('{'), tmpl.size());
    if (!name.starts_with(tmpl.substr(0, literal))) return false;
    name.remove_prefix(literal);
    tmpl.remove_prefix(literal);
  }
  return name.empty();
}

// config.json's quantization_config (LoadModelSpec has read the file once already).
absl::StatusOr<internal::WeightQuantization> ReadQuantization(const fs::path& dir) {
  const std::string path = (dir / "config.json").string();
  MOE_ASSIGN_OR_RETURN(const std::string text, core::ReadBoundedFile(path, kMaxConfigBytes, "config.json"));
  return internal::ReadQuantizationConfig(text, path);
}

class HuggingFaceCheckpoint final : public Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const fs::path& dir, const std::string& opened);
};

}  // namespace

// ---- WeightFormat ----

WeightFormat WeightFormat::Plain(core::DType element) {
  WeightFormat f;
  f.element = element;
  f.block_bytes = static_cast<int>(core::DTypeSize(element));
  return f;
}

WeightFormat WeightFormat::BlockScaled(core::DType element, int scale_rows, int scale_cols, core::DType scale_dtype) {
  WeightFormat f = Plain(element);
  f.kind = Kind::kBlockScaled;
  f.scale_rows = scale_rows;
  f.scale_cols = scale_cols;
  f.scale_dtype = scale_dtype;
  return f;
}

WeightFormat WeightFormat::Blocks(int type_id, std::string type_name, int block_elements, int block_bytes) {
  WeightFormat f;
  f.kind = Kind::kBlocks;
  f.type_id = type_id;
  f.type_name = std::move(type_name);
  f.block_elements = block_elements;
  f.block_bytes = block_bytes;
  return f;
}

int64_t WeightFormat::RowBytes(int64_t cols) const {
  if (kind == Kind::kBlocks) return (cols + block_elements - 1) / block_elements * block_bytes;
  return cols * core::DTypeSize(element);
}

int64_t WeightFormat::Bytes(const core::Shape& shape) const {
  if (shape.empty()) return RowBytes(1);
  for (int64_t d : shape) {
    if (d == 0) return 0;  // no values, whatever the other dimensions (a row's bytes are not formed)
  }
  const int64_t cols = shape.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return rows * RowBytes(cols);
}

std::string WeightFormat::Name() const {
  switch (kind) {
    case Kind::kPlain:
      return core::DTypeName(element);
    case Kind::kBlockScaled:
      return absl::StrCat(core::DTypeName(element), " (", core::DTypeName(scale_dtype), " scale per ", scale_rows, "x",
                          scale_cols, ")");
    case Kind::kBlocks:
      return type_name.empty() ? absl::StrCat("type ", type_id) : type_name;
  }
  return "?";
}

bool WeightFormat::operator==(const WeightFormat& o) const {
  if (kind != o.kind) return false;
  switch (kind) {
    case Kind::kPlain:
      return element == o.element;
    case Kind::kBlockScaled:
      return element == o.element && scale_rows == o.scale_rows && scale_cols == o.scale_cols &&
             scale_dtype == o.scale_dtype;
    case Kind::kBlocks:
      return type_id == o.type_id && block_elements == o.block_elements && block_bytes == o.block_bytes;
  }
  return false;
}

absl::StatusOr<WeightView> WeightSource::GetStored(const std::string& name) const {
  MOE_ASSIGN_OR_RETURN(const core::TensorView view, Get(name));
  return WeightView::Of(view);
}

WeightView WeightView::Of(const core::TensorView& t) {
  WeightView v;
  v.data = t.data;
  v.shape = t.shape;
  v.format = WeightFormat::Plain(t.dtype);
  return v;
}

float WeightView::Scale(int64_t i) const {
  if (format.scale_dtype == core::DType::kBF16) return core::Bf16ToFloat(static_cast<const uint16_t*>(scales)[i]);
  return static_cast<const float*>(scales)[i];
}

absl::StatusOr<core::TensorView> ExpandToFloats(const WeightView& stored, std::vector<float>* storage) {
  const WeightFormat& f = stored.format;
  if (f.plain()) {
    if (f.element == core::DType::kBF16 || f.element == core::DType::kF16 || f.element == core::DType::kF32) {
      return stored.AsTensor();
    }
    if (f.element == core::DType::kF8E4M3) {
      return absl::InvalidArgumentError(
          "an F8_E4M3 weight without scales (its config.json has no quantization_config with quant_method fp8)");
    }
    return absl::InvalidArgumentError(absl::StrCat("dtype ", f.Name(), " is not a weight type (BF16, F16 or F32 are)"));
  }
  if (f.kind == WeightFormat::Kind::kBlockScaled && f.element == core::DType::kF8E4M3 && stored.rank() == 2) {
    const int64_t rows = stored.shape[0], cols = stored.shape[1];
    const int64_t scale_cols = stored.scale_shape.size() == 2 ? stored.scale_shape[1] : 1;
    storage->resize(static_cast<size_t>(rows * cols));
    const auto* codes = static_cast<const uint8_t*>(stored.data);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t s = (r / f.scale_rows) * scale_cols + c / f.scale_cols;
        (*storage)[r * cols + c] = core::F8E4M3ToFloat(codes[r * cols + c]) * stored.Scale(s);
      }
    }
    return core::TensorView{storage->data(), core::DType::kF32, stored.shape};
  }
  const experts::GgufType* type = f.kind == WeightFormat::Kind::kBlocks ? experts::FindGgufType(f.type_id) : nullptr;
  if (type == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("stored as ", f.Name(), ", a type moeserve does not read (types read: ",
                                                   experts::SupportedGgufTypeNames(), ")"));
  }
  const int64_t cols = stored.shape.empty() ? 1 : stored.shape.back();
  const int64_t rows = cols == 0 ? 0 : stored.numel() / cols;
  storage->resize(static_cast<size_t>(stored.numel()));
  const auto* src = static_cast<const uint8_t*>(stored.data);
  const int64_t row_bytes = f.RowBytes(cols);
  for (int64_t r = 0; r < rows; ++r) experts::DequantizeRow(type->id, src + r * row_bytes, cols, storage->data() + r * cols);
  return core::TensorView{storage->data(), core::DType::kF32, stored.shape};
}

// ---- Keys and roles ----

std::string_view TensorIdName(TensorId id) {
  static constexpr std::array<std::string_view, kIds> kNames = {
      "embedding",
      "final_norm",
      "lm_head",
      "attn_norm",
      "ffn_norm",
      "attn_q",
      "attn_k",
      "attn_v",
      "attn_o",
      "attn_q_bias",
      "attn_k_bias",
      "attn_v_bias",
      "attn_q_norm",
      "attn_k_norm",
      "router",
      "router_bias",
      "expert_gate",
      "expert_up",
      "expert_down",
      "shared_gate",
      "shared_up",
      "shared_down",
      "shared_expert_gate",
      "dense_gate",
      "dense_up",
      "dense_down",
      "mla_q_a",
      "mla_q_a_norm",
      "mla_q_b",
      "mla_kv_a",
      "mla_kv_a_norm",
      "mla_kv_b",
      "mla_k_b",
      "mla_v_b",
      "gdn_in_proj_qkvz",
      "gdn_in_proj_ba",
      "gdn_conv",
      "gdn_dt_bias",
      "gdn_a_log",
      "gdn_norm",
      "gdn_out",
      "nextn_embed_norm",
      "nextn_hidden_norm",
      "nextn_proj",
      "nextn_embedding",
      "nextn_head_norm",
      "nextn_head",
  };
  const int i = static_cast<int>(id);
  return i >= 0 && i < kIds ? kNames[i] : "?";
}

std::string KeyString(const TensorKey& key) {
  std::string s;
  if (key.layer >= 0) absl::StrAppend(&s, "layer ", key.layer, " ");
  if (key.expert >= 0) absl::StrAppend(&s, "expert ", key.expert, " ");
  absl::StrAppend(&s, std::string(TensorIdName(key.id)));
  return s;
}

std::string_view TensorRoleName(TensorRole role) {
  switch (role) {
    case TensorRole::kEmbedding:
      return "embedding";
    case TensorRole::kNorm:
      return "norm";
    case TensorRole::kAttention:
      return "attention";
    case TensorRole::kRouter:
      return "router";
    case TensorRole::kSharedExpert:
      return "shared expert";
    case TensorRole::kRoutedExpert:
      return "routed expert";
    case TensorRole::kDenseFfn:
      return "dense FFN";
    case TensorRole::kLmHead:
      return "LM head";
    case TensorRole::kNextn:
      return "nextn";
    case TensorRole::kOther:
      return "other";
  }
  return "other";
}

TensorRole RoleOf(TensorId id) {
  switch (id) {
    case TensorId::kEmbedding:
      return TensorRole::kEmbedding;
    case TensorId::kLmHead:
      return TensorRole::kLmHead;
    case TensorId::kFinalNorm:
    case TensorId::kAttnNorm:
    case TensorId::kFfnNorm:
    case TensorId::kAttnQNorm:
    case TensorId::kAttnKNorm:
    case TensorId::kMlaQANorm:
    case TensorId::kMlaKvANorm:
      return TensorRole::kNorm;
    case TensorId::kRouter:
    case TensorId::kRouterBias:
      return TensorRole::kRouter;
    case TensorId::kExpertGate:
    case TensorId::kExpertUp:
    case TensorId::kExpertDown:
      return TensorRole::kRoutedExpert;
    case TensorId::kSharedGate:
    case TensorId::kSharedUp:
    case TensorId::kSharedDown:
    case TensorId::kSharedExpertGate:
      return TensorRole::kSharedExpert;
    case TensorId::kDenseGate:
    case TensorId::kDenseUp:
    case TensorId::kDenseDown:
      return TensorRole::kDenseFfn;
    case TensorId::kNextnEmbedNorm:
    case TensorId::kNextnHiddenNorm:
    case TensorId::kNextnProj:
    case TensorId::kNextnEmbedding:
    case TensorId::kNextnHeadNorm:
    case TensorId::kNextnHead:
      return TensorRole::kNextn;
    case TensorId::kCount:
      return TensorRole::kOther;
    default:
      return TensorRole::kAttention;  // q/k/v/o and their biases, MLA's and Gated DeltaNet's projections
  }
}

std::string_view ContainerName(Container c) { return c == Container::kGguf ? "GGUF" : "safetensors"; }

// ---- Name tables ----

TensorNames::TensorNames(Architecture arch, Container container) : arch_(arch), container_(container) {
  using I = TensorId;
  if (container == Container::kSafetensors) {
    const std::string l = "model.layers.{L}.";
    const std::string a = l + "self_attn.";
    const bool mixtral = arch == Architecture::kMixtral;
    const std::string block = l + (mixtral ? "block_sparse_moe." : "mlp.");
    Set(I::kEmbedding, "model.embed_tokens.weight");
    Set(I::kFinalNorm, "model.norm.weight");
    Set(I::kLmHead, "lm_head.weight");
    Set(I::kAttnNorm, l + "input_layernorm.weight");
    Set(I::kFfnNorm, l + "post_attention_layernorm.weight");
    Set(I::kAttnQ, a + "q_proj.weight");
    Set(I::kAttnK, a + "k_proj.weight");
    Set(I::kAttnV, a + "v_proj.weight");
    Set(I::kAttnO, a + "o_proj.weight");
    Set(I::kAttnQBias, a + "q_proj.bias");
    Set(I::kAttnKBias, a + "k_proj.bias");
    Set(I::kAttnVBias, a + "v_proj.bias");
    Set(I::kAttnQNorm, a + "q_norm.weight");
    Set(I::kAttnKNorm, a + "k_norm.weight");
    Set(I::kRouter, block + "gate.weight");
    Set(I::kRouterBias, block + "gate.e_score_correction_bias");
    const std::string e = block + "experts.{E}.";
    Set(I::kExpertGate, e + (mixtral ? "w1.weight" : "gate_proj.weight"));
    Set(I::kExpertUp, e + (mixtral ? "w3.weight" : "up_proj.weight"));
    Set(I::kExpertDown, e + (mixtral ? "w2.weight" : "down_proj.weight"));
    if (!mixtral) {
      const std::string s = block + (arch == Architecture::kQwen2Moe ? "shared_expert." : "shared_experts.");
      Set(I::kSharedGate, s + "gate_proj.weight");
      Set(I::kSharedUp, s + "up_proj.weight");
      Set(I::kSharedDown, s + "down_proj.weight");
      Set(I::kSharedExpertGate, block + "shared_expert_gate.weight");
      Set(I::kDenseGate, l + "mlp.gate_proj.weight");
      Set(I::kDenseUp, l + "mlp.up_proj.weight");
      Set(I::kDenseDown, l + "mlp.down_proj.weight");
    }
    if (arch == Architecture::kDeepseekV3) {  // MLA in place of q/k/v
      Set(I::kMlaQA, a + "q_a_proj.weight");
      Set(I::kMlaQANorm, a + "q_a_layernorm.weight");
      Set(I::kMlaQB, a + "q_b_proj.weight");
      Set(I::kMlaKvA, a + "kv_a_proj_with_mqa.weight");
      Set(I::kMlaKvANorm, a + "kv_a_layernorm.weight");
      Set(I::kMlaKvB, a + "kv_b_proj.weight");
    }
    if (arch == Architecture::kGlm4Moe || arch == Architecture::kDeepseekV3) {  // the MTP layers after the model's own
      Set(I::kNextnEmbedNorm, l + "enorm.weight");
      Set(I::kNextnHiddenNorm, l + "hnorm.weight");
      Set(I::kNextnProj, l + "eh_proj.weight");
      Set(I::kNextnEmbedding, l + "embed_tokens.weight");
      Set(I::kNextnHeadNorm, l + "shared_head.norm.weight");
      Set(I::kNextnHead, l + "shared_head.head.weight");
    }
    return;
  }
  // GGUF, as llama.cpp's converter names tensors: routed experts stacked per layer.
  const std::string l = "blk.{L}.";
  Set(I::kEmbedding, "token_embd.weight");
  Set(I::kFinalNorm, "output_norm.weight");
  Set(I::kLmHead, "output.weight");
  Set(I::kAttnNorm, l + "attn_norm.weight");
  Set(I::kFfnNorm, l + (arch == Architecture::kGlm4Moe ? "post_attention_norm.weight" : "ffn_norm.weight"));
  Set(I::kAttnQ, l + "attn_q.weight");
  Set(I::kAttnK, l + "attn_k.weight");
  Set(I::kAttnV, l + "attn_v.weight");
  Set(I::kAttnO, l + "attn_output.weight");
  Set(I::kAttnQBias, l + "attn_q.bias");
  Set(I::kAttnKBias, l + "attn_k.bias");
  Set(I::kAttnVBias, l + "attn_v.bias");
  Set(I::kAttnQNorm, l + "attn_q_norm.weight");
  Set(I::kAttnKNorm, l + "attn_k_norm.weight");
  Set(I::kRouter, l + "ffn_gate_inp.weight");
  Set(I::kRouterBias, l + "exp_probs_b.bias");
  Set(I::kExpertGate, l + "ffn_gate_exps.weight", /*stacked=*/true);
  Set(I::kExpertUp, l + "ffn_up_exps.weight", /*stacked=*/true);
  Set(I::kExpertDown, l + "ffn_down_exps.weight", /*stacked=*/true);
  Set(I::kSharedGate, l + "ffn_gate_shexp.weight");
  Set(I::kSharedUp, l + "ffn_up_shexp.weight");
  Set(I::kSharedDown, l + "ffn_down_shexp.weight");
  Set(I::kSharedExpertGate, l + "ffn_gate_inp_shexp.weight");
  Set(I::kDenseGate, l + "ffn_gate.weight");
  Set(I::kDenseUp, l + "ffn_up.weight");
  Set(I::kDenseDown, l + "ffn_down.weight");
  if (arch == Architecture::kDeepseekV3) {  // llama.cpp's deepseek2: kv_b split into per-head K (transposed) and V
    Set(I::kMlaQA, l + "attn_q_a.weight");
    Set(I::kMlaQANorm, l + "attn_q_a_norm.weight");
    Set(I::kMlaQB, l + "attn_q_b.weight");
    Set(I::kMlaKvA, l + "attn_kv_a_mqa.weight");
    Set(I::kMlaKvANorm, l + "attn_kv_a_norm.weight");
    Set(I::kMlaKvB, l + "attn_kv_b.weight");
    Set(I::kMlaKB, l + "attn_k_b.weight");
    Set(I::kMlaVB, l + "attn_v_b.weight");
  }
  if (arch == Architecture::kGlm4Moe || arch == Architecture::kDeepseekV3) {
    Set(I::kNextnEmbedNorm, l + "nextn.enorm.weight");
    Set(I::kNextnHiddenNorm, l + "nextn.hnorm.weight");
    Set(I::kNextnProj, l + "nextn.eh_proj.weight");
    Set(I::kNextnEmbedding, l + "nextn.embed_tokens.weight");
    Set(I::kNextnHeadNorm, l + "nextn.shared_head_norm.weight");
    Set(I::kNextnHead, l + "nextn.shared_head_head.weight");
  }
}

void TensorNames::Set(TensorId id, std::string name_template, bool stacked) {
  templates_[static_cast<int>(id)] = std::move(name_template);
  stacked_[static_cast<int>(id)] = stacked;
}

const TensorNames& TensorNames::For(Architecture arch, Container container) {
  static const auto* tables = [] {
    auto* t = new std::vector<TensorNames>();
    for (Architecture a : {Architecture::kQwen3Moe, Architecture::kQwen2Moe, Architecture::kMixtral,
                           Architecture::kGlm4Moe, Architecture::kDeepseekV3}) {
      for (Container c : {Container::kSafetensors, Container::kGguf}) t->push_back(TensorNames(a, c));
    }
    return t;
  }();
  for (const TensorNames& t : *tables) {
    if (t.arch_ == arch && t.container_ == container) return t;
  }
  return tables->front();  // unreachable: every architecture has its tables
}

std::string TensorNames::Name(const TensorKey& key) const {
  const std::string& tmpl = templates_[static_cast<int>(key.id)];
  if (tmpl.empty()) return "";
  return absl::StrReplaceAll(tmpl, {{"{L}", absl::StrCat(key.layer)}, {"{E}", absl::StrCat(key.expert)}});
}

std::optional<TensorKey> TensorNames::Parse(std::string_view name) const {
  for (int i = 0; i < kIds; ++i) {
    if (templates_[i].empty()) continue;
    int layer = -1, expert = -1;
    if (MatchTemplate(templates_[i], name, &layer, &expert)) return TensorKey{static_cast<TensorId>(i), layer, expert};
  }
  return std::nullopt;
}

TensorKind ClassifyTensor(std::string_view name) {
  // The GLM table first: it names everything the others do (shared experts as DeepSeek spells
  // them, the correction bias, the nextn tensors); qwen2's shared_expert and Mixtral's
  // block_sparse_moe come after, and DeepSeek-V3's MLA projections last.
  for (Architecture arch : {Architecture::kGlm4Moe, Architecture::kQwen2Moe, Architecture::kMixtral,
                            Architecture::kQwen3Moe, Architecture::kDeepseekV3}) {
    for (Container c : {Container::kSafetensors, Container::kGguf}) {
      if (const std::optional<TensorKey> key = TensorNames::For(arch, c).Parse(name)) {
        return TensorKind{RoleOf(key->id), key->layer, key->expert};
      }
    }
  }
  return TensorKind{};
}

// ---- Checkpoint ----

absl::StatusOr<WeightView> Checkpoint::Get(const TensorKey& key) const {
  const std::string name = names_->Name(key);
  if (name.empty()) {
    return absl::NotFoundError(absl::StrCat(std::string(ArchitectureName(spec_.arch)), " has no ", KeyString(key),
                                            " tensor in ", std::string(ContainerName(container()))));
  }
  MOE_ASSIGN_OR_RETURN(WeightView w, source_->GetStored(name));
  if (!names_->Stacked(key.id) || key.expert < 0) return w;
  // One expert's slice of [experts x rows x cols].
  if (w.rank() != 3 || key.expert >= w.shape[0]) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": shape ", core::ShapeString(w.shape), " in ",
                                                   source_->FileOf(name), " holds no expert ", key.expert,
                                                   " (a stacked expert tensor is [experts x rows x cols])"));
  }
  const core::Shape one = {w.shape[1], w.shape[2]};
  w.data = static_cast<const char*>(w.data) + key.expert * w.format.Bytes(one);
  w.shape = one;
  return w;
}

bool Checkpoint::Has(const TensorKey& key) const {
  const std::string name = names_->Name(key);
  return !name.empty() && source_->Has(name);
}

std::string Checkpoint::Describe(const TensorKey& key) const {
  const std::string name = names_->Name(key);
  if (name.empty()) return KeyString(key);
  std::string s = name;
  if (names_->Stacked(key.id) && key.expert >= 0) absl::StrAppend(&s, "[expert ", key.expert, "]");
  const std::string file = source_->FileOf(name);
  if (!file.empty()) absl::StrAppend(&s, " in ", file);
  return s;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> HuggingFaceCheckpoint::Open(const fs::path& dir,
                                                                        const std::string& opened) {
  auto c = std::unique_ptr<HuggingFaceCheckpoint>(new HuggingFaceCheckpoint());
  MOE_ASSIGN_OR_RETURN(c->spec_, LoadModelSpec(dir.string()));
  MOE_ASSIGN_OR_RETURN(c->source_, OpenSafetensors(dir.string()));
  MOE_ASSIGN_OR_RETURN(const internal::WeightQuantization q, ReadQuantization(dir));
  if (q.method == internal::WeightQuantization::Method::kFp8) {
    MOE_ASSIGN_OR_RETURN(c->source_, internal::WrapFp8Source(std::move(c->source_), q));
  }
  c->quantization_ = q.Describe();
  c->path_ = opened;
  c->names_ = &TensorNames::For(c->spec_.arch, Container::kSafetensors);
  c->id_ = core::WeightFilesFingerprint(dir.string());
  c->tokenizer_.dir = dir.string();
  return std::unique_ptr<Checkpoint>(std::move(c));
}

namespace {

// What `path` is: the folder of a Hugging Face checkpoint (a folder, or a .safetensors file in one),
// or a refusal that says what it found. GGUF paths are taken before this (IsGgufCheckpoint).
absl::StatusOr<fs::path> HuggingFaceFolder(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  // A path that is not there reads as a folder, so the message names the config.json it lacks.
  if (ec || !fs::exists(st)) return fs::path(path);
  if (fs::is_regular_file(st)) {
    const fs::path p(path);
    if (p.extension() != ".safetensors") {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": not a checkpoint (a Hugging Face folder, a .safetensors file beside its config.json, or a GGUF "
                "file)"));
    }
    return p.has_parent_path() ? p.parent_path() : fs::path(".");
  }
  if (!fs::is_directory(st)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file or a directory"));
  }
  return fs::path(path);
}

}  // namespace

bool ExpertsAreBlockQuantized(const Checkpoint& checkpoint) {
  const ModelSpec& s = checkpoint.spec();
  for (int l = 0; l < s.num_layers; ++l) {
    if (!s.IsMoeLayer(l)) continue;
    auto gate = checkpoint.Get({TensorId::kExpertGate, l, 0});
    return gate.ok() && gate->format.kind == WeightFormat::Kind::kBlocks;
  }
  return false;
}

int Fp8ExpertGroup(const Checkpoint& checkpoint) {
  const ModelSpec& s = checkpoint.spec();
  for (int l = 0; l < s.num_layers; ++l) {
    if (!s.IsMoeLayer(l)) continue;
    int group = 0;
    for (TensorId id : {TensorId::kExpertGate, TensorId::kExpertUp, TensorId::kExpertDown}) {
      auto w = checkpoint.Get({id, l, 0});
      if (!w.ok() || w->format.kind != WeightFormat::Kind::kBlockScaled || w->format.element != core::DType::kF8E4M3) {
        return 0;
      }
      // The largest group of the pool's (32, 64, 128) inside one scale block of every matrix.
      int g = 128;
      while (g >= 32 && w->format.scale_cols % g != 0) g /= 2;
      if (g < 32) return 0;
      group = group == 0 ? g : std::min(group, g);
    }
    return group;
  }
  return 0;
}

experts::ExpertFormat AutoPoolFormat(const Checkpoint& checkpoint) {
  if (ExpertsAreBlockQuantized(checkpoint)) return experts::ExpertFormat::kNative;
  return Fp8ExpertGroup(checkpoint) > 0 ? experts::ExpertFormat::kFp8 : experts::ExpertFormat::kBF16;
}

bool IsGgufCheckpoint(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return fs::path(path).extension() == ".gguf";
  if (fs::is_regular_file(st)) {
    if (fs::path(path).extension() == ".gguf") return true;
    // A GGUF file by its magic, whatever its name.
    char magic[4] = {};
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) return false;
    const size_t n = std::fread(magic, 1, 4, f);
    std::fclose(f);
    return n == 4 && std::memcmp(magic, "GGUF", 4) == 0;
  }
  if (!fs::is_directory(st) || fs::exists(fs::path(path) / "config.json", ec)) return false;
  for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
    if (e.path().extension() == ".gguf") return true;
  }
  return false;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> OpenCheckpoint(const std::string& path) {
  if (IsGgufCheckpoint(path)) return internal::OpenGgufCheckpoint(path);
  MOE_ASSIGN_OR_RETURN(const fs::path dir, HuggingFaceFolder(path));
  return HuggingFaceCheckpoint::Open(dir, path);
}

absl::StatusOr<ModelSpec> ReadCheckpointSpec(const std::string& path) {
  if (IsGgufCheckpoint(path)) return internal::ReadGgufSpec(path);
  MOE_ASSIGN_OR_RETURN(const fs::path dir, HuggingFaceFolder(path));
  MOE_ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(dir.string()));
  MOE_RETURN_IF_ERROR(ReadQuantization(dir).status());
  return spec;
}

}  // namespace moe::runtime

#include "checkpoint/gguf_checkpoint.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <regex>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/gguf.h"
#include "moe/core/dtype.h"
#include "moe/core/file.h"
#include "moe/core/files_fingerprint.h"
#include "moe/core/logging.h"
#include "moe/core/status.h"
#include "nlohmann/json.hpp"

namespace moe::runtime {
namespace internal {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// ---- Which files ----

// NAME-00001-of-00003.gguf: the split set's stem, this part's number and the count.
struct SplitName {
  std::string stem;
  int part = 0, count = 0;
};
std::optional<SplitName> ParseSplitName(const std::string& filename) {
  static const std::regex kSplit(R"((.*)-(\d{5})-of-(\d{5})\.gguf)");
  std::smatch m;
  if (!std::regex_match(filename, m, kSplit)) return std::nullopt;
  return SplitName{m[1].str(), std::stoi(m[2].str()), std::stoi(m[3].str())};
}
std::string SplitFileName(const std::string& stem, int part, int count) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "-%05d-of-%05d.gguf", part, count);
  return stem + buf;
}

bool IsProjector(const std::string& filename) { return filename.rfind("mmproj", 0) == 0; }

// The parts of the split set `first` starts (itself alone when it is not split).
absl::StatusOr<std::vector<std::string>> SplitParts(const fs::path& file) {
  const std::string filename = file.filename().string();
  const std::optional<SplitName> split = ParseSplitName(filename);
  if (!split) return std::vector<std::string>{file.string()};
  if (split->part != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.string(), " is part ", split->part, " of ", split->count, " of a split GGUF model; give the first part, ",
        (file.parent_path() / SplitFileName(split->stem, 1, split->count)).string()));
  }
  std::vector<std::string> parts;
  for (int p = 1; p <= split->count; ++p) {
    const fs::path part = file.parent_path() / SplitFileName(split->stem, p, split->count);
    MOE_ASSIGN_OR_RETURN(const core::PathKind kind, core::StatPath(part.string()));
    if (kind != core::PathKind::kRegular) {
      return absl::InvalidArgumentError(absl::StrCat(file.string(), ": part ", p, " of ", split->count, " (",
                                                     part.filename().string(), ") is missing"));
    }
    parts.push_back(part.string());
  }
  return parts;
}

// ---- Tensors ----

// The tensors of every part, by name, with their stored form. Llama-architecture files (Mixtral)
// hold q and k with the rows of each head interleaved for ggml's RoPE (the converter's permute);
// those two come back in Hugging Face order, copied once on first use.
class GgufSource final : public WeightSource {
 public:
  struct Entry {
    const gguf::TensorInfo* info = nullptr;
    int file = 0;
    WeightView view;
  };

  explicit GgufSource(std::vector<gguf::GgufFile> files) : files_(std::move(files)) {}

  absl::Status Index() {
    for (size_t f = 0; f < files_.size(); ++f) {
      for (const gguf::TensorInfo& t : files_[f].tensors()) {
        Entry e;
        e.info = &t;
        e.file = static_cast<int>(f);
        e.view.data = t.data;
        for (auto it = t.ne.rbegin(); it != t.ne.rend(); ++it) e.view.shape.push_back(*it);
        e.view.format = FormatOf(*t.type);
        if (!entries_.emplace(t.name, e).second) {
          return absl::InvalidArgumentError(
              absl::StrCat(files_[f].path(), ": tensor ", t.name, " is also in ", FileOf(t.name),
                           " (two parts of one split model hold it: parts of different models?)"));
        }
      }
    }
    return absl::OkStatus();
  }

  static WeightFormat FormatOf(const gguf::GgmlType& t) {
    switch (t.id) {
      case 0:
        return WeightFormat::Plain(core::DType::kF32);
      case 1:
        return WeightFormat::Plain(core::DType::kF16);
      case 30:
        return WeightFormat::Plain(core::DType::kBF16);
      case 24:
        return WeightFormat::Plain(core::DType::kI8);
      case 26:
        return WeightFormat::Plain(core::DType::kI32);
      case 27:
        return WeightFormat::Plain(core::DType::kI64);
      default:
        return WeightFormat::Blocks(t.id, t.name, t.block_elements, t.block_bytes);
    }
  }

  // Rows of attn_q / attn_k to put back in Hugging Face order (heads of head_dim rows each).
  void UnpermuteQk(int q_heads, int kv_heads) {
    q_heads_ = q_heads;
    kv_heads_ = kv_heads;
  }
  // A 1-D tensor the loader reads as one row (qwen2_moe's shared expert gate).
  void AsRow(const std::string& name_suffix) { as_row_suffix_ = name_suffix; }
  // deepseek2 files written with llama.cpp's split of kv_b_proj (attn_k_b [H][kv_lora][nope], the
  // K half transposed, and attn_v_b [H][v][kv_lora]) show one attn_kv_b in Hugging Face's layout,
  // [H * (nope + v) x kv_lora] in f32, made once on first use; the halves are not listed.
  void JoinKvB() {
    for (const auto& [name, e] : entries_) {
      if (!name.ends_with(".attn_k_b.weight")) continue;
      const std::string stem = name.substr(0, name.size() - std::string(".attn_k_b.weight").size());
      if (entries_.count(stem + ".attn_v_b.weight") && !entries_.count(stem + ".attn_kv_b.weight")) {
        joined_.insert(stem + ".attn_kv_b.weight");
      }
    }
  }

  absl::StatusOr<WeightView> GetStored(const std::string& name) const override {
    if (joined_.count(name)) return JoinedKvB(name);
    auto it = entries_.find(name);
    if (it == entries_.end()) return absl::NotFoundError(absl::StrCat("tensor ", name, " is missing from ", Where()));
    WeightView v = it->second.view;
    if (!as_row_suffix_.empty() && v.rank() == 1 && name.ends_with(as_row_suffix_)) v.shape = {1, v.shape[0]};
    if (q_heads_ > 0 && v.rank() == 2 && (name.ends_with(".attn_q.weight") || name.ends_with(".attn_k.weight"))) {
      return Unpermuted(name, v, name.ends_with(".attn_q.weight") ? q_heads_ : kv_heads_);
    }
    return v;
  }
  absl::StatusOr<core::TensorView> Get(const std::string& name) const override {
    MOE_ASSIGN_OR_RETURN(const WeightView v, GetStored(name));
    if (!v.format.plain()) {
      return absl::InvalidArgumentError(absl::StrCat(name, " in ", FileOf(name), " is stored as ", v.format.Name(),
                                                     ", not as plain values"));
    }
    return v.AsTensor();
  }
  bool Has(const std::string& name) const override { return entries_.count(name) > 0 || joined_.count(name) > 0; }
  std::string FileOf(const std::string& name) const override {
    auto it = entries_.find(joined_.count(name) ? KvBHalf(name, "k") : name);
    return it == entries_.end() ? "" : fs::path(files_[it->second.file].path()).filename().string();
  }
  std::vector<std::string> Names() const override {
    std::vector<std::string> names;
    for (const auto& [name, e] : entries_) {
      const bool half = name.ends_with(".attn_k_b.weight") || name.ends_with(".attn_v_b.weight");
      if (half &&
          joined_.count(name.substr(0, name.size() - std::string(".attn_k_b.weight").size()) + ".attn_kv_b.weight")) {
        continue;
      }
      names.push_back(name);
    }
    for (const std::string& name : joined_) names.push_back(name);
    return names;
  }
  const std::vector<gguf::GgufFile>& files() const { return files_; }

 private:
  std::string Where() const {
    if (files_.size() == 1) return files_[0].path();
    return absl::StrCat(files_.size(), " parts of ", files_[0].path());
  }

  // blk.N.attn_k_b.weight (half "k") or attn_v_b (half "v") of a joined blk.N.attn_kv_b.weight.
  static std::string KvBHalf(const std::string& kv_b, const char* half) {
    return kv_b.substr(0, kv_b.size() - std::string(".attn_kv_b.weight").size()) + ".attn_" + half + "_b.weight";
  }

  absl::StatusOr<WeightView> JoinedKvB(const std::string& name) const {
    const std::string k_name = KvBHalf(name, "k"), v_name = KvBHalf(name, "v");
    const WeightView k = entries_.at(k_name).view, v = entries_.at(v_name).view;
    // k: [H][lora][nope], v: [H][v][lora] (their GGUF dimensions reversed).
    if (k.rank() != 3 || v.rank() != 3 || k.shape[0] != v.shape[0] || k.shape[1] != v.shape[2]) {
      return absl::InvalidArgumentError(absl::StrCat(k_name, " ", core::ShapeString(k.shape), " and ", v_name, " ",
                                                     core::ShapeString(v.shape), " in ", FileOf(k_name),
                                                     " are not [heads, kv_lora, nope] and [heads, v, kv_lora]"));
    }
    const int64_t heads = k.shape[0], lora = k.shape[1], nope = k.shape[2], v_dim = v.shape[1];
    if (heads < 1 || lora < 1 || nope < 1 || v_dim < 1) {
      return absl::InvalidArgumentError(absl::StrCat(k_name, " ", core::ShapeString(k.shape), " and ", v_name, " ",
                                                     core::ShapeString(v.shape), " in ", FileOf(k_name),
                                                     " hold no values (every dimension must be at least 1)"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = unpermuted_.find(name);
    if (it == unpermuted_.end()) {
      std::vector<float> k_values, v_values;
      MOE_ASSIGN_OR_RETURN(const core::TensorView kf, ExpandToFloats(k, &k_values));
      MOE_ASSIGN_OR_RETURN(const core::TensorView vf, ExpandToFloats(v, &v_values));
      std::vector<float> kvals(kf.numel()), vvals(vf.numel());
      core::ConvertToFloat(kf.data, kf.dtype, kvals.data(), kf.numel());
      core::ConvertToFloat(vf.data, vf.dtype, vvals.data(), vf.numel());
      std::vector<uint8_t> out(static_cast<size_t>(heads * (nope + v_dim) * lora) * sizeof(float));
      float* kv_b = reinterpret_cast<float*>(out.data());
      for (int64_t h = 0; h < heads; ++h) {
        float* rows = kv_b + h * (nope + v_dim) * lora;
        for (int64_t i = 0; i < nope; ++i) {
          for (int64_t c = 0; c < lora; ++c) rows[i * lora + c] = kvals[(h * lora + c) * nope + i];
        }
        std::memcpy(rows + nope * lora, vvals.data() + h * v_dim * lora, sizeof(float) * v_dim * lora);
      }
      it = unpermuted_.emplace(name, std::move(out)).first;
    }
    WeightView joined;
    joined.data = it->second.data();
    joined.shape = {heads * (nope + v_dim), lora};
    joined.format = WeightFormat::Plain(core::DType::kF32);
    return joined;
  }

  absl::StatusOr<WeightView> Unpermuted(const std::string& name, WeightView v, int heads) const {
    const int64_t rows = v.shape[0];
    if (heads <= 0 || rows % heads != 0 || (rows / heads) % 2 != 0) return v;  // the loader's shape check says why
    std::lock_guard<std::mutex> lock(mu_);
    auto it = unpermuted_.find(name);
    if (it == unpermuted_.end()) {
      const int64_t row_bytes = v.format.RowBytes(v.shape[1]), head_dim = rows / heads, half = head_dim / 2;
      std::vector<uint8_t> out(static_cast<size_t>(rows * row_bytes));
      const auto* in = static_cast<const uint8_t*>(v.data);
      // The file's row h*d + 2j + s holds Hugging Face's row h*d + s*d/2 + j.
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t s = 0; s < 2; ++s) {
          for (int64_t j = 0; j < half; ++j) {
            std::memcpy(out.data() + (h * head_dim + s * half + j) * row_bytes,
                        in + (h * head_dim + 2 * j + s) * row_bytes, row_bytes);
          }
        }
      }
      it = unpermuted_.emplace(name, std::move(out)).first;
    }
    v.data = it->second.data();
    return v;
  }

  std::vector<gguf::GgufFile> files_;
  std::map<std::string, Entry> entries_;
  int q_heads_ = 0, kv_heads_ = 0;
  std::set<std::string> joined_;  // attn_kv_b names made from attn_k_b and attn_v_b
  std::string as_row_suffix_;
  mutable std::mutex mu_;
  mutable std::map<std::string, std::vector<uint8_t>> unpermuted_;
};

// ---- The spec ----

struct ArchInfo {
  Architecture arch;
  const char* model_type;
};

absl::StatusOr<ArchInfo> ArchOf(const gguf::GgufFile& f) {
  MOE_ASSIGN_OR_RETURN(const std::optional<std::string> a, f.String("general.architecture"));
  if (!a) return absl::InvalidArgumentError(absl::StrCat(f.path(), ": no general.architecture in its metadata"));
  if (*a == "qwen3moe") return ArchInfo{Architecture::kQwen3Moe, "qwen3_moe"};
  if (*a == "qwen2moe") return ArchInfo{Architecture::kQwen2Moe, "qwen2_moe"};
  if (*a == "glm4moe") return ArchInfo{Architecture::kGlm4Moe, "glm4_moe"};
  if (*a == "deepseek2") return ArchInfo{Architecture::kDeepseekV3, "deepseek_v3"};
  if (*a == "llama" || *a == "mixtral") {
    MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> experts, f.Int(*a + ".expert_count"));
    if (!experts || *experts == 0) {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": general.architecture '", *a,
                                                     "' without experts is a dense model; moeserve serves "
                                                     "Mixture-of-Experts models (qwen3moe, qwen2moe, llama with "
                                                     "experts as Mixtral, glm4moe, deepseek2)"));
    }
    return ArchInfo{Architecture::kMixtral, "mixtral"};
  }
  const std::string shown = a->size() > 60 ? a->substr(0, 60) + "..." : *a;
  return absl::InvalidArgumentError(absl::StrCat(f.path(), ": general.architecture '", shown,
                                                 "' is not supported; supported: qwen3moe, qwen2moe, llama (with "
                                                 "experts: Mixtral), glm4moe, deepseek2"));
}

// Replaces whole words (config keys) in `text`.
std::string ReplaceWords(const std::string& text, const std::vector<std::pair<std::string, std::string>>& words) {
  std::string out;
  size_t i = 0;
  const auto word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  while (i < text.size()) {
    if (!word_char(text[i])) {
      out += text[i++];
      continue;
    }
    size_t j = i;
    while (j < text.size() && word_char(text[j])) ++j;
    const std::string w = text.substr(i, j - i);
    auto it = std::find_if(words.begin(), words.end(), [&](const auto& p) { return p.first == w; });
    out += it == words.end() ? w : it->second;
    i = j;
  }
  return out;
}

// deepseek2's MLA widths and YaRN as config.json keys. llama.cpp writes the MLA-converted head
// widths as key_length_mla / value_length_mla (key_length and value_length are then the latent's),
// older files as key_length / value_length; YaRN's mscale_all_dim as 0.1 x it (yarn_log_multiplier).
absl::Status MlaFromMetadata(const gguf::GgufFile& f, const std::string& a, const std::optional<std::string>& scaling,
                             Json& c, std::vector<std::pair<std::string, std::string>>& keys) {
  const auto int_of = [&](const std::string& key,
                          const std::string& config_key) -> absl::StatusOr<std::optional<int64_t>> {
    MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> v, f.Int(a + key));
    keys.emplace_back(config_key, a + key);
    return v;
  };
  MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> q_lora, int_of("attention.q_lora_rank", "q_lora_rank"));
  if (q_lora) c["q_lora_rank"] = *q_lora;
  MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> kv_lora, int_of("attention.kv_lora_rank", "kv_lora_rank"));
  if (kv_lora) c["kv_lora_rank"] = *kv_lora;
  MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> rope, int_of("rope.dimension_count", "qk_rope_head_dim"));
  if (rope) c["qk_rope_head_dim"] = *rope;
  MOE_ASSIGN_OR_RETURN(std::optional<int64_t> key, int_of("attention.key_length_mla", "qk_nope_head_dim"));
  if (!key) {
    MOE_ASSIGN_OR_RETURN(key, int_of("attention.key_length", "qk_nope_head_dim"));
  }
  if (key && rope) c["qk_nope_head_dim"] = *key - *rope;
  MOE_ASSIGN_OR_RETURN(std::optional<int64_t> value, int_of("attention.value_length_mla", "v_head_dim"));
  if (!value) {
    MOE_ASSIGN_OR_RETURN(value, int_of("attention.value_length", "v_head_dim"));
  }
  if (value) c["v_head_dim"] = *value;
  c["rope_interleave"] = true;  // llama.cpp's deepseek2 rotates neighbouring pairs
  c.erase("head_dim");
  c.erase("partial_rotary_factor");
  if (!scaling || *scaling != "yarn") return absl::OkStatus();
  Json y = {{"type", "yarn"}};
  MOE_ASSIGN_OR_RETURN(const std::optional<double> factor, f.Float(a + "rope.scaling.factor"));
  if (factor) y["factor"] = *factor;
  keys.emplace_back("factor", a + "rope.scaling.factor");
  MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> original, f.Int(a + "rope.scaling.original_context_length"));
  if (original) y["original_max_position_embeddings"] = *original;
  keys.emplace_back("original_max_position_embeddings", a + "rope.scaling.original_context_length");
  MOE_ASSIGN_OR_RETURN(const std::optional<double> log_mul, f.Float(a + "rope.scaling.yarn_log_multiplier"));
  if (log_mul && *log_mul > 0) y["mscale"] = y["mscale_all_dim"] = *log_mul / 0.1;
  c["rope_scaling"] = y;
  return absl::OkStatus();
}

// The spec through the same checks as a config.json: the metadata is written as the config keys it
// stands for, and an error names the metadata key again.
absl::StatusOr<ModelSpec> SpecFromMetadata(const gguf::GgufFile& f, const GgufSource& source) {
  MOE_ASSIGN_OR_RETURN(const ArchInfo ai, ArchOf(f));
  MOE_ASSIGN_OR_RETURN(const std::optional<std::string> arch_key, f.String("general.architecture"));
  const std::string a = *arch_key + ".";
  Json c;
  std::vector<std::pair<std::string, std::string>> keys;  // config key -> metadata key, for messages
  c["model_type"] = ai.model_type;
  const auto take_int = [&](const std::string& gguf_key, const std::string& config_key) -> absl::Status {
    MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> v, f.Int(a + gguf_key));
    if (v) c[config_key] = *v;
    keys.emplace_back(config_key, a + gguf_key);
    return absl::OkStatus();
  };
  const auto take_float = [&](const std::string& gguf_key, const std::string& config_key) -> absl::Status {
    MOE_ASSIGN_OR_RETURN(const std::optional<double> v, f.Float(a + gguf_key));
    if (v) c[config_key] = *v;
    keys.emplace_back(config_key, a + gguf_key);
    return absl::OkStatus();
  };
  // Required keys say so with their GGUF names.
  for (const char* required : {"block_count", "embedding_length", "attention.head_count", "expert_count",
                               "expert_used_count"}) {
    if (f.Find(a + required) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": metadata ", a, required, " is missing"));
    }
  }
  // Per-layer head counts (an array) must agree: moeserve runs one shape for every layer.
  for (const char* heads : {"attention.head_count", "attention.head_count_kv"}) {
    const gguf::Value* v = f.Find(a + heads);
    if (v != nullptr && v->type == gguf::ValueType::kArray) {
      if (v->ints.empty() || std::adjacent_find(v->ints.begin(), v->ints.end(), std::not_equal_to<>()) != v->ints.end()) {
        return f.KeyError(a + heads, "differs between layers; moeserve runs one attention shape for every layer");
      }
      c[std::string(heads) == "attention.head_count" ? "num_attention_heads" : "num_key_value_heads"] = v->ints[0];
      keys.emplace_back(std::string(heads) == "attention.head_count" ? "num_attention_heads" : "num_key_value_heads",
                        a + heads);
    } else {
      MOE_RETURN_IF_ERROR(
          take_int(heads, std::string(heads) == "attention.head_count" ? "num_attention_heads" : "num_key_value_heads"));
    }
  }
  MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> blocks, f.Int(a + "block_count"));
  // Checked before anything loops over the layers.
  if (*blocks < 1 || *blocks > kMaxLayers) {
    return f.KeyError(a + "block_count", absl::StrCat("is ", *blocks, ": must be between 1 and ", kMaxLayers));
  }
  MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> nextn, f.Int(a + "nextn_predict_layers"));
  const int64_t n_nextn = nextn.value_or(0);
  if (n_nextn < 0 || n_nextn >= *blocks) {
    return f.KeyError(a + "nextn_predict_layers", absl::StrCat("is ", n_nextn, " of ", *blocks, " blocks"));
  }
  const int64_t layers = *blocks - n_nextn;
  c["num_hidden_layers"] = layers;
  keys.emplace_back("num_hidden_layers", a + "block_count");
  MOE_RETURN_IF_ERROR(take_int("embedding_length", "hidden_size"));
  MOE_RETURN_IF_ERROR(take_int("attention.key_length", "head_dim"));
  MOE_RETURN_IF_ERROR(take_float("rope.freq_base", "rope_theta"));
  MOE_RETURN_IF_ERROR(take_float("attention.layer_norm_rms_epsilon", "rms_norm_eps"));
  MOE_RETURN_IF_ERROR(take_int("context_length", "max_position_embeddings"));
  MOE_RETURN_IF_ERROR(take_int("expert_used_count", "num_experts_per_tok"));
  const bool glm_like = ai.arch == Architecture::kGlm4Moe || ai.arch == Architecture::kDeepseekV3;
  const char* experts_key = ai.arch == Architecture::kMixtral ? "num_local_experts"
                            : glm_like                        ? "n_routed_experts"
                                                              : "num_experts";
  MOE_RETURN_IF_ERROR(take_int("expert_count", experts_key));
  // Dense layers' width, and the experts' (Mixtral's experts use feed_forward_length).
  MOE_RETURN_IF_ERROR(take_int("feed_forward_length", "intermediate_size"));
  if (f.Find(a + "expert_feed_forward_length") != nullptr) {
    MOE_RETURN_IF_ERROR(take_int("expert_feed_forward_length",
                                 ai.arch == Architecture::kMixtral ? "intermediate_size" : "moe_intermediate_size"));
  }
  if (!c.contains("intermediate_size") && c.contains("moe_intermediate_size")) {
    c["intermediate_size"] = c["moe_intermediate_size"];
  }
  if (const gguf::Value* ffn = f.Find(a + "feed_forward_length"); ffn != nullptr && ffn->type == gguf::ValueType::kArray) {
    return f.KeyError(a + "feed_forward_length", "is per layer; moeserve reads one width");
  }
  // RoPE: the rotated part of each head; scaling is not read yet.
  MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> rope_dims, f.Int(a + "rope.dimension_count"));
  const int64_t head_dim = c.contains("head_dim") ? c["head_dim"].get<int64_t>() : 0;
  if (rope_dims && head_dim > 0) c["partial_rotary_factor"] = static_cast<double>(*rope_dims) / head_dim;
  if (rope_dims && head_dim == 0 && c.contains("hidden_size") && c.contains("num_attention_heads") &&
      c["num_attention_heads"].get<int64_t>() > 0) {
    const int64_t d = c["hidden_size"].get<int64_t>() / c["num_attention_heads"].get<int64_t>();
    if (d > 0) c["partial_rotary_factor"] = static_cast<double>(*rope_dims) / d;
  }
  keys.emplace_back("partial_rotary_factor", a + "rope.dimension_count");
  MOE_ASSIGN_OR_RETURN(const std::optional<std::string> scaling, f.String(a + "rope.scaling.type"));
  if (scaling && *scaling != "none" && !(ai.arch == Architecture::kDeepseekV3 && *scaling == "yarn")) {
    return f.KeyError(a + "rope.scaling.type", absl::StrCat("is '", *scaling, "': RoPE scaling is not supported yet"));
  }
  if (ai.arch == Architecture::kDeepseekV3) MOE_RETURN_IF_ERROR(MlaFromMetadata(f, a, scaling, c, keys));
  // What the tensors say: biases, q/k norms, tied embeddings, dense layers.
  const auto has = [&](const std::string& name) { return source.Has(name); };
  c["tie_word_embeddings"] = !has("output.weight");
  if (ai.arch == Architecture::kQwen2Moe) {
    c["qkv_bias"] = has("blk.0.attn_q.bias");
    MOE_RETURN_IF_ERROR(take_int("expert_shared_feed_forward_length", "shared_expert_intermediate_size"));
    c["norm_topk_prob"] = false;
  }
  if (ai.arch == Architecture::kQwen3Moe || ai.arch == Architecture::kGlm4Moe) {
    c["attention_bias"] = has("blk.0.attn_q.bias");
  }
  if (ai.arch == Architecture::kDeepseekV3) c["q_lora_rank"] = c.value("q_lora_rank", Json(nullptr));
  if (ai.arch == Architecture::kQwen3Moe || ai.arch == Architecture::kQwen2Moe) {
    // Layers without a router are dense (Qwen's mlp_only_layers).
    Json dense = Json::array();
    for (int64_t l = 0; l < layers; ++l) {
      if (!has(absl::StrCat("blk.", l, ".ffn_gate_inp.weight"))) dense.push_back(l);
    }
    c["mlp_only_layers"] = dense;
    if (ai.arch == Architecture::kQwen3Moe) c["norm_topk_prob"] = true;  // llama.cpp's qwen3moe normalizes
  }
  if (glm_like) {
    if (ai.arch == Architecture::kGlm4Moe) c["use_qk_norm"] = has("blk.0.attn_q_norm.weight");
    MOE_RETURN_IF_ERROR(take_int("leading_dense_block_count", "first_k_dense_replace"));
    MOE_RETURN_IF_ERROR(take_int("expert_shared_count", "n_shared_experts"));
    MOE_RETURN_IF_ERROR(take_int("expert_group_count", "n_group"));
    MOE_RETURN_IF_ERROR(take_int("expert_group_used_count", "topk_group"));
    MOE_RETURN_IF_ERROR(take_float("expert_weights_scale", "routed_scaling_factor"));
    c["num_nextn_predict_layers"] = n_nextn;
    keys.emplace_back("num_nextn_predict_layers", a + "nextn_predict_layers");
    if (const gguf::Value* fn = f.Find(a + "expert_gating_func"); fn != nullptr && fn->is_integer() && fn->i != 2) {
      return f.KeyError(
          a + "expert_gating_func",
          absl::StrCat("is ", fn->i, "; ", *arch_key, " is read with sigmoid routing (2) only",
                       ai.arch == Architecture::kDeepseekV3 ? " (DeepSeek-V3; V2's softmax is not)" : ""));
    }
  }
  if (ai.arch != Architecture::kMixtral) {
    MOE_ASSIGN_OR_RETURN(const std::optional<bool> norm, f.Bool(a + "expert_weights_norm"));
    if (norm) c["norm_topk_prob"] = *norm;
    keys.emplace_back("norm_topk_prob", a + "expert_weights_norm");
  }
  // The vocabulary is the embedding's rows (the token list may be shorter, or padded to it).
  if (const gguf::TensorInfo* embd = f.FindTensor("token_embd.weight"); embd != nullptr && embd->ne.size() == 2) {
    c["vocab_size"] = embd->ne[1];
  } else if (const gguf::Value* tokens = f.Find("tokenizer.ggml.tokens"); tokens != nullptr) {
    c["vocab_size"] = tokens->size();
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": no token_embd.weight tensor and no tokenizer.ggml.tokens to size the vocabulary"));
  }
  keys.emplace_back("vocab_size", "the rows of token_embd.weight");
  // Stop tokens: eos and end-of-turn.
  Json eos = Json::array();
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
    MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> id, f.Int(key));
    if (id && std::find(eos.begin(), eos.end(), Json(*id)) == eos.end()) eos.push_back(*id);
    keys.emplace_back("eos_token_id", key);
  }
  if (!eos.empty()) c["eos_token_id"] = eos;
  auto spec = ParseModelSpec(c.dump(), f.path());
  if (!spec.ok()) {
    return absl::Status(spec.status().code(), ReplaceWords(std::string(spec.status().message()), keys));
  }
  return spec;
}

// ---- The tokenizer ----

absl::StatusOr<TokenizerSource> TokenizerFromMetadata(const gguf::GgufFile& f) {
  TokenizerSource t;
  MOE_ASSIGN_OR_RETURN(const std::optional<std::string> model, f.String("tokenizer.ggml.model"));
  if (!model) return t;  // no vocabulary: token ids only, or --tokenizer
  t.model = *model;
  MOE_ASSIGN_OR_RETURN(const std::optional<std::string> pre, f.String("tokenizer.ggml.pre"));
  t.pre = pre.value_or("default");
  MOE_ASSIGN_OR_RETURN(const std::vector<std::string>* tokens, f.Strings("tokenizer.ggml.tokens"));
  if (tokens == nullptr || tokens->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": tokenizer.ggml.model is set but tokenizer.ggml.tokens "
                                                   "is missing or empty"));
  }
  t.tokens = *tokens;
  MOE_ASSIGN_OR_RETURN(const std::vector<int64_t>* types, f.Ints("tokenizer.ggml.token_type"));
  if (types != nullptr) {
    if (types->size() != tokens->size()) {
      return f.KeyError("tokenizer.ggml.token_type", absl::StrCat("has ", types->size(), " entries for ",
                                                                  tokens->size(), " tokens"));
    }
    t.token_types.assign(types->begin(), types->end());
  }
  MOE_ASSIGN_OR_RETURN(const std::vector<std::string>* merges, f.Strings("tokenizer.ggml.merges"));
  if (merges != nullptr) t.merges = *merges;
  const auto id = [&](const char* key, std::optional<int32_t>* out) -> absl::Status {
    MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> v, f.Int(key));
    if (!v) return absl::OkStatus();
    if (*v < 0 || *v >= static_cast<int64_t>(tokens->size())) {
      // llama.cpp writes -1 (as u32: 4294967295) for "none".
      if (*v == -1 || *v == 0xFFFFFFFFll) return absl::OkStatus();
      return f.KeyError(key, absl::StrCat("is ", *v, ", not one of the ", tokens->size(), " tokens"));
    }
    *out = static_cast<int32_t>(*v);
    return absl::OkStatus();
  };
  MOE_RETURN_IF_ERROR(id("tokenizer.ggml.bos_token_id", &t.bos_id));
  MOE_RETURN_IF_ERROR(id("tokenizer.ggml.eos_token_id", &t.eos_id));
  MOE_RETURN_IF_ERROR(id("tokenizer.ggml.eot_token_id", &t.eot_id));
  MOE_RETURN_IF_ERROR(id("tokenizer.ggml.padding_token_id", &t.pad_id));
  MOE_ASSIGN_OR_RETURN(const std::optional<bool> add_bos, f.Bool("tokenizer.ggml.add_bos_token"));
  t.add_bos = add_bos.value_or(false);
  MOE_ASSIGN_OR_RETURN(const std::optional<std::string> tmpl, f.String("tokenizer.chat_template"));
  t.chat_template = tmpl.value_or("");
  return t;
}

// ---- Split sets ----

// Every part must belong to the set the first part starts: the same count, its own number, the
// same architecture; together they hold split.tensors.count tensors.
absl::Status CheckSplit(const std::vector<gguf::GgufFile>& parts) {
  const gguf::GgufFile& first = parts[0];
  MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> count, first.Int("split.count"));
  if (!count) {
    if (parts.size() > 1) {
      return absl::InvalidArgumentError(absl::StrCat(first.path(), ": named as part 1 of ", parts.size(),
                                                     " but has no split.count in its metadata"));
    }
    return absl::OkStatus();
  }
  if (*count != static_cast<int64_t>(parts.size())) {
    return first.KeyError("split.count", absl::StrCat("is ", *count, " but the file names say ", parts.size(), " parts"));
  }
  MOE_ASSIGN_OR_RETURN(const std::optional<std::string> arch, first.String("general.architecture"));
  int64_t tensors = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const gguf::GgufFile& part = parts[p];
    MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> no, part.Int("split.no"));
    MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> c, part.Int("split.count"));
    if (!no || *no != static_cast<int64_t>(p) || !c || *c != *count) {
      return absl::InvalidArgumentError(absl::StrCat(
          part.path(), ": split.no ", no ? absl::StrCat(*no) : "missing", " of split.count ",
          c ? absl::StrCat(*c) : "missing", ", but it is part ", p + 1, " of ", *count,
          " beside ", fs::path(first.path()).filename().string(), ": a part of another model?"));
    }
    if (p > 0) {
      MOE_ASSIGN_OR_RETURN(const std::optional<std::string> a, part.String("general.architecture"));
      if (a && arch && *a != *arch) {
        return absl::InvalidArgumentError(absl::StrCat(part.path(), ": general.architecture '", *a, "' but part 1 is '",
                                                       *arch, "': a part of another model"));
      }
    }
    tensors += static_cast<int64_t>(part.tensors().size());
  }
  MOE_ASSIGN_OR_RETURN(const std::optional<int64_t> total, first.Int("split.tensors.count"));
  if (total && *total != tensors) {
    return first.KeyError("split.tensors.count",
                          absl::StrCat("is ", *total, " but the ", parts.size(), " parts hold ", tensors, " tensors"));
  }
  return absl::OkStatus();
}

class GgufCheckpoint final : public Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& path) {
    MOE_ASSIGN_OR_RETURN(const std::vector<std::string> files, GgufModelFiles(path));
    std::vector<gguf::GgufFile> parsed;
    for (const std::string& file : files) {
      MOE_ASSIGN_OR_RETURN(gguf::GgufFile f, gguf::GgufFile::Open(file));
      parsed.push_back(std::move(f));
    }
    MOE_RETURN_IF_ERROR(CheckSplit(parsed));
    auto source = std::make_unique<GgufSource>(std::move(parsed));
    MOE_RETURN_IF_ERROR(source->Index());
    const gguf::GgufFile& first = source->files()[0];
    auto c = std::unique_ptr<GgufCheckpoint>(new GgufCheckpoint());
    MOE_ASSIGN_OR_RETURN(c->spec_, SpecFromMetadata(first, *source));
    MOE_ASSIGN_OR_RETURN(c->tokenizer_, TokenizerFromMetadata(first));
    if (c->spec_.arch == Architecture::kMixtral) source->UnpermuteQk(c->spec_.num_heads, c->spec_.num_kv_heads);
    if (c->spec_.arch == Architecture::kQwen2Moe) source->AsRow(".ffn_gate_inp_shexp.weight");
    if (c->spec_.arch == Architecture::kDeepseekV3) source->JoinKvB();
    c->names_ = &TensorNames::For(c->spec_.arch, Container::kGguf);
    c->path_ = path;
    c->id_ = absl::StrCat(core::WeightFilesFingerprint(fs::path(files[0]).parent_path().string()), "-",
                          fs::path(files[0]).filename().string());
    c->source_ = std::move(source);
    return std::unique_ptr<Checkpoint>(std::move(c));
  }
};

}  // namespace

absl::StatusOr<std::vector<std::string>> GgufModelFiles(const std::string& path) {
  MOE_ASSIGN_OR_RETURN(const core::PathKind kind, core::StatPath(path));
  if (kind == core::PathKind::kMissing) return absl::NotFoundError(absl::StrCat(path, ": no such file or folder"));
  if (kind == core::PathKind::kRegular) return SplitParts(fs::path(path));
  if (kind != core::PathKind::kDirectory) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file or a directory"));
  }
  // A folder: the models in it, by split stem (or file name), projectors apart.
  std::map<std::string, std::vector<std::string>> models;
  std::vector<std::string> projectors;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() != ".gguf") continue;
    if (IsProjector(name)) {
      projectors.push_back(name);
      continue;
    }
    const std::optional<SplitName> split = ParseSplitName(name);
    models[split ? split->stem : name].push_back(name);
  }
  for (const std::string& p : projectors) {
    MOE_LOG(kInfo) << path << ": " << p << " is a multimodal projector; it is not read";
  }
  if (models.empty()) return absl::NotFoundError(absl::StrCat(path, ": no GGUF model file in this folder"));
  if (models.size() > 1) {
    std::vector<std::string> names;
    for (const auto& [stem, files] : models) names.push_back(files.size() > 1 ? stem + "-*.gguf" : files[0]);
    return absl::InvalidArgumentError(absl::StrCat(path, " holds ", models.size(), " GGUF models (",
                                                   absl::StrJoin(names, ", "), "); give the file of one"));
  }
  std::vector<std::string>& files = models.begin()->second;
  std::sort(files.begin(), files.end());
  return SplitParts(fs::path(path) / files[0]);
}

absl::StatusOr<std::unique_ptr<Checkpoint>> OpenGgufCheckpoint(const std::string& path) {
  return GgufCheckpoint::Open(path);
}

absl::StatusOr<ModelSpec> ReadGgufSpec(const std::string& path) {
  MOE_ASSIGN_OR_RETURN(auto checkpoint, GgufCheckpoint::Open(path));
  return checkpoint->spec();
}

}  // namespace internal
}  // namespace moe::runtime

#include "make_model.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "moe/core/dtype.h"
#include "moe/core/progress.h"
#include "moe/core/status.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/placement.h"
#include "moe/runtime/safetensors_writer.h"
#include "nlohmann/json.hpp"
#include "oneapi/tbb/parallel_for.h"

namespace moe::deploy {
namespace {

namespace fs = std::filesystem;
using runtime::Architecture;
using runtime::TensorEntry;
using Json = nlohmann::ordered_json;

// A model's shape, with the fields of every architecture; those an architecture does not use
// keep their defaults.
struct Shape {
  Architecture arch = Architecture::kQwen3Moe;
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t experts = 0, top_k = 0;
  int64_t moe_inter = 0;     // routed expert width (Mixtral: intermediate_size)
  int64_t inter = 0;         // dense MLP width
  int64_t shared_inter = 0;  // qwen2_moe: shared_expert_intermediate_size (with a gate)
  int64_t n_shared = 0;      // glm4_moe: n_shared_experts, each moe_inter wide
  int64_t first_dense = 0;   // glm4_moe: first_k_dense_replace
  int64_t n_group = 1, topk_group = 1;
  double routed_scaling = 1.0;
  bool norm_topk = true;
  bool qkv_bias = false, qk_norm = false;
  double partial_rotary = 1.0;
  int64_t vocab = 0, max_pos = 4096;
  double rope_theta = 1e6, rms_eps = 1e-6;
  // deepseek_v3: MLA's widths (q_lora 0: a plain q_proj) and YaRN (factor 0: none).
  int64_t q_lora = 0, kv_lora = 0, qk_nope = 0, qk_rope = 0, v_head = 0;
  double yarn_factor = 0, yarn_beta_fast = 32, yarn_beta_slow = 1;
  int64_t yarn_original = 0;
};

struct Preset {
  std::string_view name;
  Shape shape;
};

// The tiny presets have the fixtures' shapes (testdata/fixtures/<arch>); the others the
// published configs of the checkpoints they are named after.
const std::vector<Preset>& Presets() {
  static const std::vector<Preset> presets = {
      {"tiny",
       {.arch = Architecture::kQwen3Moe,
        .hidden = 128,
        .layers = 4,
        .heads = 4,
        .kv_heads = 2,
        .head_dim = 32,
        .experts = 16,
        .top_k = 4,
        .moe_inter = 64,
        .inter = 256,
        .qk_norm = true,
        .vocab = 512}},
      {"qwen3-30b-a3b",
       {.arch = Architecture::kQwen3Moe,
        .hidden = 2048,
        .layers = 48,
        .heads = 32,
        .kv_heads = 4,
        .head_dim = 128,
        .experts = 128,
        .top_k = 8,
        .moe_inter = 768,
        .inter = 6144,
        .qk_norm = true,
        .vocab = 151936,
        .max_pos = 40960}},
      {"qwen3-235b-a22b",
       {.arch = Architecture::kQwen3Moe,
        .hidden = 4096,
        .layers = 94,
        .heads = 64,
        .kv_heads = 4,
        .head_dim = 128,
        .experts = 128,
        .top_k = 8,
        .moe_inter = 1536,
        .inter = 12288,
        .qk_norm = true,
        .vocab = 151936,
        .max_pos = 40960}},
      {"tiny",
       {.arch = Architecture::kQwen2Moe,
        .hidden = 128,
        .layers = 4,
        .heads = 4,
        .kv_heads = 2,
        .head_dim = 32,
        .experts = 8,
        .top_k = 2,
        .moe_inter = 64,
        .inter = 256,
        .shared_inter = 128,
        .norm_topk = false,
        .qkv_bias = true,
        .vocab = 512}},
      {"qwen1.5-moe-a2.7b",
       {.arch = Architecture::kQwen2Moe,
        .hidden = 2048,
        .layers = 24,
        .heads = 16,
        .kv_heads = 16,
        .head_dim = 128,
        .experts = 60,
        .top_k = 4,
        .moe_inter = 1408,
        .inter = 5632,
        .shared_inter = 5632,
        .norm_topk = false,
        .qkv_bias = true,
        .vocab = 151936,
        .max_pos = 8192}},
      {"qwen2-57b-a14b",
       {.arch = Architecture::kQwen2Moe,
        .hidden = 3584,
        .layers = 28,
        .heads = 28,
        .kv_heads = 4,
        .head_dim = 128,
        .experts = 64,
        .top_k = 8,
        .moe_inter = 2560,
        .inter = 18944,
        .shared_inter = 20480,
        .norm_topk = false,
        .qkv_bias = true,
        .vocab = 151936,
        .max_pos = 32768}},
      {"tiny",
       {.arch = Architecture::kMixtral,
        .hidden = 128,
        .layers = 4,
        .heads = 4,
        .kv_heads = 2,
        .head_dim = 32,
        .experts = 8,
        .top_k = 2,
        .moe_inter = 128,
        .inter = 128,
        .vocab = 512}},
      {"mixtral-8x7b",
       {.arch = Architecture::kMixtral,
        .hidden = 4096,
        .layers = 32,
        .heads = 32,
        .kv_heads = 8,
        .head_dim = 128,
        .experts = 8,
        .top_k = 2,
        .moe_inter = 14336,
        .inter = 14336,
        .vocab = 32000,
        .max_pos = 32768,
        .rms_eps = 1e-5}},
      {"mixtral-8x22b",
       {.arch = Architecture::kMixtral,
        .hidden = 6144,
        .layers = 56,
        .heads = 48,
        .kv_heads = 8,
        .head_dim = 128,
        .experts = 8,
        .top_k = 2,
        .moe_inter = 16384,
        .inter = 16384,
        .vocab = 32768,
        .max_pos = 65536,
        .rms_eps = 1e-5}},
      {"tiny",
       {.arch = Architecture::kGlm4Moe,
        .hidden = 128,
        .layers = 4,
        .heads = 4,
        .kv_heads = 2,
        .head_dim = 32,
        .experts = 16,
        .top_k = 4,
        .moe_inter = 64,
        .inter = 256,
        .n_shared = 1,
        .first_dense = 1,
        .n_group = 4,
        .topk_group = 2,
        .routed_scaling = 2.5,
        .qkv_bias = true,
        .partial_rotary = 0.5,
        .vocab = 512}},
      {"glm-4.5-air",
       {.arch = Architecture::kGlm4Moe,
        .hidden = 4096,
        .layers = 46,
        .heads = 96,
        .kv_heads = 8,
        .head_dim = 128,
        .experts = 128,
        .top_k = 8,
        .moe_inter = 1408,
        .inter = 10944,
        .n_shared = 1,
        .first_dense = 1,
        .qkv_bias = true,
        .partial_rotary = 0.5,
        .vocab = 151552,
        .max_pos = 131072,
        .rms_eps = 1e-5}},
      {"glm-4.5",
       {.arch = Architecture::kGlm4Moe,
        .hidden = 5120,
        .layers = 92,
        .heads = 96,
        .kv_heads = 8,
        .head_dim = 128,
        .experts = 160,
        .top_k = 8,
        .moe_inter = 1536,
        .inter = 12288,
        .n_shared = 1,
        .first_dense = 3,
        .routed_scaling = 2.5,
        .qkv_bias = true,
        .qk_norm = true,
        .partial_rotary = 0.5,
        .vocab = 151552,
        .max_pos = 131072,
        .rms_eps = 1e-5}},
      {"tiny",
       {.arch = Architecture::kDeepseekV3,
        .hidden = 128,
        .layers = 4,
        .heads = 4,
        .kv_heads = 4,
        .experts = 16,
        .top_k = 4,
        .moe_inter = 64,
        .inter = 256,
        .n_shared = 1,
        .first_dense = 1,
        .n_group = 4,
        .topk_group = 2,
        .routed_scaling = 2.5,
        .vocab = 512,
        .max_pos = 2048,
        .rope_theta = 1e4,
        .q_lora = 64,
        .kv_lora = 32,
        .qk_nope = 32,
        .qk_rope = 16,
        .v_head = 32}},
      {"deepseek-v3",  // DeepSeek-V3 and R1 (671B, 37B active)
       {.arch = Architecture::kDeepseekV3,
        .hidden = 7168,
        .layers = 61,
        .heads = 128,
        .kv_heads = 128,
        .experts = 256,
        .top_k = 8,
        .moe_inter = 2048,
        .inter = 18432,
        .n_shared = 1,
        .first_dense = 3,
        .n_group = 8,
        .topk_group = 4,
        .routed_scaling = 2.5,
        .vocab = 129280,
        .max_pos = 163840,
        .rope_theta = 1e4,
        .q_lora = 1536,
        .kv_lora = 512,
        .qk_nope = 128,
        .qk_rope = 64,
        .v_head = 128,
        .yarn_factor = 40,
        .yarn_original = 4096}},
      {"kimi-k2",  // Kimi-K2 (1T, 32B active): DeepSeek-V3's layers, 384 experts, 64 heads
       {.arch = Architecture::kDeepseekV3,
        .hidden = 7168,
        .layers = 61,
        .heads = 64,
        .kv_heads = 64,
        .experts = 384,
        .top_k = 8,
        .moe_inter = 2048,
        .inter = 18432,
        .n_shared = 1,
        .first_dense = 1,
        .routed_scaling = 2.827,
        .vocab = 163840,
        .max_pos = 131072,
        .rope_theta = 5e4,
        .q_lora = 1536,
        .kv_lora = 512,
        .qk_nope = 128,
        .qk_rope = 64,
        .v_head = 128,
        .yarn_factor = 32,
        .yarn_beta_fast = 1,
        .yarn_beta_slow = 1,
        .yarn_original = 4096}},
  };
  return presets;
}

absl::StatusOr<Architecture> ParseArch(const std::string& arch) {
  const std::vector<std::string>& types = runtime::SupportedModelTypes();
  for (Architecture a : {Architecture::kQwen3Moe, Architecture::kQwen2Moe, Architecture::kMixtral,
                         Architecture::kGlm4Moe, Architecture::kDeepseekV3}) {
    if (runtime::ArchitectureName(a) == arch) return a;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("make-model: --arch '", arch, "' is not supported; supported: ", absl::StrJoin(types, ", ")));
}

absl::Status CheckRange(const char* flag, int64_t value, int64_t lo, int64_t hi, const char* what) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("make-model: ", flag, " ", value, " is out of range; ", what, " from ", lo, " to ", hi));
}

// The shape the options ask for, after every range check.
absl::StatusOr<Shape> ResolveShape(const MakeModelOptions& o) {
  MOE_ASSIGN_OR_RETURN(Architecture arch, ParseArch(o.arch));
  const Preset* found = nullptr;
  const Preset* other_arch = nullptr;
  for (const Preset& p : Presets()) {
    if (p.name != o.preset) continue;
    if (p.shape.arch == arch) {
      found = &p;
    } else if (other_arch == nullptr) {
      other_arch = &p;
    }
  }
  if (found == nullptr) {
    const std::string fitting = absl::StrJoin(MakeModelPresets(o.arch), ", ");
    if (other_arch != nullptr) {
      const std::string other(runtime::ArchitectureName(other_arch->shape.arch));
      return absl::InvalidArgumentError(absl::StrCat("make-model: preset '", o.preset, "' is a ", other, " shape, not ",
                                                     o.arch, "; pass --arch ", other, ", or a preset for ", o.arch,
                                                     ": ", fitting));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("make-model: unknown preset '", o.preset, "'; presets: ", fitting, " (for --arch ", o.arch, ")"));
  }
  Shape s = found->shape;
  if (o.layers != 0) {
    MOE_RETURN_IF_ERROR(CheckRange("--layers", o.layers, 1, kMakeModelMaxLayers, "give a layer count"));
    s.layers = o.layers;
  }
  s.first_dense = std::min(s.first_dense, s.layers);  // a preset cut to fewer layers than its dense ones
  if (o.vocab != 0) {
    MOE_RETURN_IF_ERROR(CheckRange("--vocab", o.vocab, 1, kMakeModelMaxVocab, "give a vocabulary size"));
    s.vocab = o.vocab;
  }
  if (o.max_shard_bytes < kMakeModelMinShardBytes || o.max_shard_bytes > kMakeModelMaxShardBytes) {
    return absl::InvalidArgumentError(absl::StrCat("make-model: --max-shard-mb gives ", o.max_shard_bytes,
                                                   " bytes per shard; give 1 to ", kMakeModelMaxShardBytes >> 20,
                                                   " MB"));
  }
  return s;
}

// The config.json of a checkpoint of this architecture, with the key spellings its published
// checkpoints use (num_experts / num_local_experts / n_routed_experts, ...).
Json ModelConfig(const Shape& s) {
  Json c;
  switch (s.arch) {
    case Architecture::kQwen3Moe:
      c = {{"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"}};
      break;
    case Architecture::kQwen2Moe:
      c = {{"architectures", {"Qwen2MoeForCausalLM"}}, {"model_type", "qwen2_moe"}};
      break;
    case Architecture::kMixtral:
      c = {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"}};
      break;
    case Architecture::kGlm4Moe:
      c = {{"architectures", {"Glm4MoeForCausalLM"}}, {"model_type", "glm4_moe"}};
      break;
    case Architecture::kDeepseekV3:
      c = {{"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"}};
      break;
  }
  c["hidden_size"] = s.hidden;
  c["num_hidden_layers"] = s.layers;
  c["num_attention_heads"] = s.heads;
  c["num_key_value_heads"] = s.kv_heads;
  if (s.arch == Architecture::kDeepseekV3) {
    c["q_lora_rank"] = s.q_lora > 0 ? Json(s.q_lora) : Json(nullptr);
    c["kv_lora_rank"] = s.kv_lora;
    c["qk_nope_head_dim"] = s.qk_nope;
    c["qk_rope_head_dim"] = s.qk_rope;
    c["v_head_dim"] = s.v_head;
    c["rope_interleave"] = true;
    if (s.yarn_factor > 0) {
      c["rope_scaling"] = {{"type", "yarn"},
                           {"factor", s.yarn_factor},
                           {"original_max_position_embeddings", s.yarn_original},
                           {"beta_fast", s.yarn_beta_fast},
                           {"beta_slow", s.yarn_beta_slow},
                           {"mscale", 1.0},
                           {"mscale_all_dim", 1.0}};
    }
  } else {
    c["head_dim"] = s.head_dim;
  }
  c["num_experts_per_tok"] = s.top_k;
  c["intermediate_size"] = s.inter;
  switch (s.arch) {
    case Architecture::kQwen3Moe:
    case Architecture::kQwen2Moe:
      c["num_experts"] = s.experts;
      c["moe_intermediate_size"] = s.moe_inter;
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = Json::array();
      c["norm_topk_prob"] = s.norm_topk;
      if (s.arch == Architecture::kQwen2Moe) {
        c["shared_expert_intermediate_size"] = s.shared_inter;
        c["qkv_bias"] = s.qkv_bias;
      } else {
        c["attention_bias"] = s.qkv_bias;
      }
      break;
    case Architecture::kMixtral:
      c["num_local_experts"] = s.experts;
      c["sliding_window"] = nullptr;
      break;
    case Architecture::kGlm4Moe:
    case Architecture::kDeepseekV3:
      c["n_routed_experts"] = s.experts;
      c["n_shared_experts"] = s.n_shared;
      c["moe_intermediate_size"] = s.moe_inter;
      c["first_k_dense_replace"] = s.first_dense;
      c["n_group"] = s.n_group;
      c["topk_group"] = s.topk_group;
      c["routed_scaling_factor"] = s.routed_scaling;
      c["norm_topk_prob"] = s.norm_topk;
      if (s.arch == Architecture::kGlm4Moe) {
        c["partial_rotary_factor"] = s.partial_rotary;
        c["use_qk_norm"] = s.qk_norm;
      }
      c["attention_bias"] = s.qkv_bias;
      c["num_nextn_predict_layers"] = 0;  // no multi-token-prediction layer is written
      break;
  }
  c["vocab_size"] = s.vocab;
  c["max_position_embeddings"] = s.max_pos;
  c["rope_theta"] = s.rope_theta;
  c["rms_norm_eps"] = s.rms_eps;
  c["tie_word_embeddings"] = false;
  c["torch_dtype"] = "bfloat16";
  // Random weights have no end-of-sequence token: generation runs to its length.
  c["bos_token_id"] = nullptr;
  c["eos_token_id"] = nullptr;
  c["moeserve_random_weights"] = true;
  return c;
}

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// FP8 checkpoints (--fp8): the scale block, and the tensors an FP8 release quantizes (the
// projections and experts; not the embedding, head, norms or router).
constexpr int64_t kFp8Block = 128;
constexpr std::string_view kScaleSuffix = "_scale_inv";

bool Fp8Quantized(const std::string& name, const core::Shape& shape) {
  if (shape.size() != 2) return false;
  for (std::string_view kept : {"embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_expert_gate"}) {
    if (name.find(kept) != std::string::npos) return false;
  }
  return true;
}

// Every tensor the loader reads for `spec`, in the order of a Hugging Face checkpoint: the
// loader's own list (ExpectedTensors), so that what is written is what is read; with `fp8`, the
// quantized ones in F8_E4M3 followed by their scales.
std::vector<TensorEntry> ModelTensors(const runtime::ModelSpec& spec, bool fp8) {
  std::vector<TensorEntry> t;
  for (const runtime::TensorInfo& info : runtime::ExpectedTensors(spec)) {
    core::Shape shape = info.rank == 1 ? core::Shape{info.rows} : core::Shape{info.rows, info.elements / info.rows};
    if (fp8 && Fp8Quantized(info.name, shape)) {
      const core::Shape scales = {(shape[0] + kFp8Block - 1) / kFp8Block, (shape[1] + kFp8Block - 1) / kFp8Block};
      t.push_back({info.name, core::DType::kF8E4M3, std::move(shape)});
      t.push_back({info.name + std::string(kScaleSuffix), core::DType::kF32, scales});
      continue;
    }
    t.push_back({info.name, core::DType::kBF16, std::move(shape)});
  }
  return t;
}

// What will be written: the config, the shards with their tensors, and the index.
struct CheckpointPlan {
  std::string config;
  std::vector<std::string> shard_names;
  std::vector<std::vector<TensorEntry>> shards;
  int64_t tensor_bytes = 0;
  int64_t disk_bytes = 0;  // an upper bound on what the files take
};

// A safetensors header entry is `"name":{"dtype":"BF16","shape":[a,b],"data_offsets":[x,y]},`;
// 96 bytes past the name covers the longest numbers. Each file may also take one more block.
constexpr int64_t kHeaderBytesPerTensor = 96;
constexpr int64_t kBytesPerFile = 64 * 1024;

absl::StatusOr<CheckpointPlan> PlanCheckpoint(const MakeModelOptions& o) {
  MOE_ASSIGN_OR_RETURN(Shape shape, ResolveShape(o));
  CheckpointPlan plan;
  nlohmann::json config = ModelConfig(shape);
  if (o.fp8) {
    config["quantization_config"] = {{"activation_scheme", "dynamic"},
                                     {"fmt", "e4m3"},
                                     {"quant_method", "fp8"},
                                     {"weight_block_size", {kFp8Block, kFp8Block}}};
  }
  plan.config = config.dump(2) + "\n";
  // The loader's own checks on what would be written: a config it refuses is never written.
  const absl::StatusOr<runtime::ModelSpec> spec = runtime::ParseModelSpec(plan.config, "config.json");
  if (!spec.ok()) {
    return absl::InternalError(absl::StrCat("make-model: the config.json of preset '", o.preset,
                                            "' would not load: ", spec.status().message()));
  }
  // Split into shards of at most max_shard_bytes of tensors (a tensor is never split), as
  // Hugging Face's max_shard_size does.
  plan.shards.emplace_back();
  int64_t in_shard = 0, headers = 0;
  for (TensorEntry& t : ModelTensors(*spec, o.fp8)) {
    // An fp8 matrix's scales stay in its shard (FillChunk reads the matrix's width there).
    if (in_shard > 0 && in_shard + t.bytes() > o.max_shard_bytes && !EndsWith(t.name, kScaleSuffix)) {
      plan.shards.emplace_back();
      in_shard = 0;
    }
    in_shard += t.bytes();
    plan.tensor_bytes += t.bytes();
    headers += static_cast<int64_t>(t.name.size()) + kHeaderBytesPerTensor;
    plan.shards.back().push_back(std::move(t));
  }
  const size_t n = plan.shards.size();
  for (size_t i = 0; i < n; ++i) {
    plan.shard_names.push_back(n == 1 ? "model.safetensors"
                                      : absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, n));
  }
  int64_t index_bytes = 0;
  if (n > 1) {
    // `"name": "model-00001-of-00002.safetensors",` on a line of its own, and the metadata.
    for (size_t i = 0; i < n; ++i) {
      for (const TensorEntry& t : plan.shards[i]) {
        index_bytes += static_cast<int64_t>(t.name.size() + plan.shard_names[i].size()) + 16;
      }
    }
    index_bytes += 256;
  }
  const int64_t files = static_cast<int64_t>(n) + 2;
  plan.disk_bytes =
      plan.tensor_bytes + headers + static_cast<int64_t>(plan.config.size()) + index_bytes + files * kBytesPerFile;
  return plan;
}

std::string HumanBytes(int64_t bytes) {
  return absl::StrFormat("%.1f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
}

// An errno from writing, as a status: lack of space or a file size limit is kResourceExhausted.
absl::Status FileError(const std::string& what, int err) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return absl::ResourceExhaustedError(message);
    case ENOTDIR:
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return FileError(absl::StrCat(path, ": cannot create"), errno);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return FileError(absl::StrCat(path, ": cannot write"), err);
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) return FileError(absl::StrCat(path, ": cannot write"), errno);
  return absl::OkStatus();
}

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Norm weights are 1 and biases 0 (as a fresh model starts); matrices are uniform with variance
// 1/fan_in, so activations keep their scale through the layers and the logits are not
// degenerate. An fp8 matrix holds the codes of such values with one scale (bound / 448) in every
// block, which its scale tensor holds; the scale tensor knows its matrix's width from `fan_in`.
void FillChunk(const TensorEntry& t, void* data, int64_t begin, int64_t end, uint64_t seed, int64_t fan_in) {
  if (t.dtype == core::DType::kF32) {  // an fp8 matrix's scales
    const float scale = std::sqrt(3.0f / static_cast<float>(fan_in)) / core::kF8E4M3Max;
    std::fill(static_cast<float*>(data) + begin, static_cast<float*>(data) + end, scale);
    return;
  }
  auto* bf16 = static_cast<uint16_t*>(data);
  if (t.shape.size() == 1) {
    const float value = EndsWith(t.name, "norm.weight") ? 1.0f : 0.0f;
    std::fill(bf16 + begin, bf16 + end, core::FloatToBf16(value));
    return;
  }
  const float bound = std::sqrt(3.0f / static_cast<float>(t.shape[1]));
  uint64_t state = seed;
  for (int64_t i = begin; i < end; ++i) {
    const float v = (2.0f * (static_cast<float>(SplitMix(state) >> 40) * (1.0f / 16777216.0f)) - 1.0f) * bound;
    if (t.dtype == core::DType::kF8E4M3) {
      static_cast<uint8_t*>(data)[i] = core::FloatToF8E4M3(v / bound * core::kF8E4M3Max);
    } else {
      bf16[i] = core::FloatToBf16(v);
    }
  }
}

absl::Status WriteShard(const std::string& path, std::vector<TensorEntry> tensors, uint64_t seed, size_t first_index,
                        core::ProgressReporter& progress) {
  MOE_ASSIGN_OR_RETURN(auto writer, runtime::SafetensorsWriter::Create(path, std::move(tensors)));
  constexpr int64_t kChunk = 1 << 20;  // elements
  struct Work {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Work> work;
  for (size_t i = 0; i < writer.tensors().size(); ++i) {
    const int64_t n = core::NumElements(writer.tensors()[i].shape);
    for (int64_t b = 0; b < n; b += kChunk) work.push_back({i, b, std::min(n, b + kChunk)});
  }
  tbb::parallel_for(size_t{0}, work.size(), [&](size_t w) {
    const Work& job = work[w];
    const TensorEntry& t = writer.tensors()[job.tensor];
    uint64_t chunk_seed = seed ^ ((first_index + job.tensor) * 0x100000001b3ull) ^ (job.begin * 0x9e3779b1ull);
    // A scale tensor follows its matrix (ModelTensors): the matrix's width sets the scale.
    const int64_t fan_in =
        t.dtype == core::DType::kF32 && job.tensor > 0 ? writer.tensors()[job.tensor - 1].shape.back() : 1;
    FillChunk(t, writer.data(job.tensor), job.begin, job.end, chunk_seed, fan_in);
    progress.Add((job.end - job.begin) * core::DTypeSize(t.dtype));
  });
  return writer.Finish();
}

// Removes a directory tree on destruction unless released: what a failed make-model wrote.
class RemoveOnFailure {
 public:
  RemoveOnFailure() = default;
  explicit RemoveOnFailure(fs::path path) : path_(std::move(path)) {}
  RemoveOnFailure(const RemoveOnFailure&) = delete;
  RemoveOnFailure& operator=(const RemoveOnFailure&) = delete;
  RemoveOnFailure& operator=(RemoveOnFailure&& other) noexcept {
    Remove();
    path_ = std::exchange(other.path_, fs::path());
    return *this;
  }
  ~RemoveOnFailure() { Remove(); }
  void Release() { path_.clear(); }

 private:
  void Remove() noexcept {
    if (path_.empty()) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
    path_.clear();
  }
  fs::path path_;
};

// The destination as an absolute path without "." or ".." or a trailing separator.
absl::StatusOr<fs::path> ResolveDestination(const std::string& out) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(out, ec);  // its error is kept, not overwritten below
  fs::path p = ec ? fs::path() : fs::weakly_canonical(absolute, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("make-model: --out ", out, ": ", ec.message()));
  if (p.filename().empty()) p = p.parent_path();
  if (p.filename().empty() || p == p.root_path()) {
    return absl::InvalidArgumentError(absl::StrCat("make-model: --out ", out, " cannot be a model directory"));
  }
  return p;
}

// The nearest directory of `p` (itself or an ancestor) that exists.
fs::path ExistingAncestor(fs::path p) {
  std::error_code ec;
  while (!fs::exists(p, ec) && p.has_parent_path() && p != p.root_path()) p = p.parent_path();
  return p;
}

absl::Status CheckFreeSpace(const std::string& out, const fs::path& dir, int64_t needed) {
  struct statvfs st;
  if (::statvfs(dir.c_str(), &st) != 0) {
    return FileError(absl::StrCat("make-model: --out ", out, ": cannot read the free space of ", dir.string()), errno);
  }
  const int64_t free_bytes =
      static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(st.f_bavail) * st.f_frsize, uint64_t{INT64_MAX}));
  if (needed <= free_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("make-model: the checkpoint needs ", needed, " bytes (", HumanBytes(needed), ") but ", dir.string(),
                   " has ", free_bytes, " bytes (", HumanBytes(free_bytes),
                   ") free; nothing was written (use --layers or --vocab for a smaller model, or another --out)"));
}

// Creates `dir` and its missing parents; `created` removes the topmost one made here.
absl::Status CreateParents(const std::string& out, const fs::path& dir, RemoveOnFailure& created) {
  const fs::path existing = ExistingAncestor(dir);
  if (existing == dir) return absl::OkStatus();
  const fs::path top = existing / *dir.lexically_relative(existing).begin();
  created = RemoveOnFailure(top);  // also what a failure part way leaves
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return FileError(absl::StrCat("make-model: --out ", out, ": cannot create ", dir.string()), ec.value());
  return absl::OkStatus();
}

// A fresh directory beside `dest` (same filesystem, so a rename moves it into place).
absl::StatusOr<fs::path> MakeSiblingDir(const std::string& out, const fs::path& dest, const std::string& kind) {
  std::string templ = (dest.parent_path() / absl::StrCat(".", dest.filename().string(), ".", kind, "-XXXXXX")).string();
  if (::mkdtemp(templ.data()) == nullptr) {
    return FileError(
        absl::StrCat("make-model: --out ", out, ": cannot create a directory in ", dest.parent_path().string()), errno);
  }
  std::error_code ec;
  fs::permissions(templ,
                  fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec | fs::perms::others_read |
                      fs::perms::others_exec,
                  ec);
  return fs::path(templ);
}

// model.safetensors.index.json. The weight map is sorted by name, as Hugging Face writes it
// (and a sorted map keeps building it fast for hundreds of thousands of tensors).
std::string IndexJson(const CheckpointPlan& plan) {
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < plan.shards.size(); ++i) {
    for (const TensorEntry& t : plan.shards[i]) weight_map[t.name] = plan.shard_names[i];
  }
  nlohmann::json index = {{"metadata", {{"total_size", plan.tensor_bytes}}}};
  index["weight_map"] = std::move(weight_map);
  return index.dump(1) + "\n";
}

absl::Status WriteCheckpoint(const MakeModelOptions& o, const CheckpointPlan& plan, const fs::path& dir) {
  MOE_RETURN_IF_ERROR(WriteTextFile((dir / "config.json").string(), plan.config));
  core::ProgressReporter progress("make-model: written", plan.tensor_bytes, o.progress);
  size_t index = 0;
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    const size_t count = plan.shards[s].size();
    MOE_RETURN_IF_ERROR(WriteShard((dir / plan.shard_names[s]).string(), plan.shards[s], o.seed, index, progress));
    index += count;
  }
  progress.Finish();
  if (plan.shards.size() > 1) {
    MOE_RETURN_IF_ERROR(WriteTextFile((dir / "model.safetensors.index.json").string(), IndexJson(plan)));
  }
  return absl::OkStatus();
}

// Moves the finished checkpoint `tmp` to `dest`; an existing `dest` is moved aside first and
// removed only once the new one is in place (put back if that fails).
absl::Status MoveIntoPlace(const std::string& out, const fs::path& tmp, const fs::path& dest, bool replace) {
  if (!replace) {
    if (::rename(tmp.c_str(), dest.c_str()) != 0) {
      return FileError(absl::StrCat("make-model: --out ", out, ": cannot move the new checkpoint into place"), errno);
    }
    return absl::OkStatus();
  }
  MOE_ASSIGN_OR_RETURN(fs::path old, MakeSiblingDir(out, dest, "old"));
  RemoveOnFailure old_guard(old);
  if (::rename(dest.c_str(), old.c_str()) != 0) {
    return FileError(absl::StrCat("make-model: --out ", out, ": cannot move the old checkpoint aside"), errno);
  }
  if (::rename(tmp.c_str(), dest.c_str()) != 0) {
    const int err = errno;
    // Whether or not the old checkpoint goes back, it is never removed here: when it cannot be
    // put back, the message says where it is.
    old_guard.Release();
    if (::rename(old.c_str(), dest.c_str()) != 0) {
      return FileError(absl::StrCat("make-model: --out ", out,
                                    ": cannot move the new checkpoint into place, nor the "
                                    "old one back; the old one is in ",
                                    old.string()),
                       err);
    }
    return FileError(absl::StrCat("make-model: --out ", out, ": cannot move the new checkpoint into place"), err);
  }
  return absl::OkStatus();  // old_guard removes the old checkpoint
}

}  // namespace

std::vector<std::string> MakeModelPresets(std::string_view arch) {
  std::vector<std::string> names;
  for (const Preset& p : Presets()) {
    if (runtime::ArchitectureName(p.shape.arch) == arch) names.emplace_back(p.name);
  }
  return names;
}

absl::Status ValidateMakeModelOptions(const MakeModelOptions& o) {
  MOE_RETURN_IF_ERROR(ResolveShape(o).status());
  if (o.out.empty()) return absl::InvalidArgumentError("make-model: --out is required");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> MakeModelCheckpointBytes(const MakeModelOptions& o) {
  MOE_ASSIGN_OR_RETURN(CheckpointPlan plan, PlanCheckpoint(o));
  return plan.disk_bytes;
}

absl::Status MakeModel(const MakeModelOptions& o) {
  MOE_RETURN_IF_ERROR(ValidateMakeModelOptions(o));
  MOE_ASSIGN_OR_RETURN(CheckpointPlan plan, PlanCheckpoint(o));
  MOE_ASSIGN_OR_RETURN(fs::path dest, ResolveDestination(o.out));

  // The destination: absent, an empty directory, or (with overwrite) a directory to replace.
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(dest, ec);
  bool replace = false;
  if (fs::exists(status)) {
    if (!fs::is_directory(status)) {
      return absl::InvalidArgumentError(
          absl::StrCat("make-model: --out ", o.out, " exists and is not a directory; choose another --out"));
    }
    const bool empty = fs::is_empty(dest, ec);
    if (ec) return FileError(absl::StrCat("make-model: --out ", o.out, ": cannot list it"), ec.value());
    if (!empty && !o.overwrite) {
      return absl::AlreadyExistsError(absl::StrCat("make-model: --out ", o.out,
                                                   " already exists and is not empty; choose a new directory or "
                                                   "pass --overwrite to replace it"));
    }
    replace = !empty;
  }

  // Everything is checked before the first byte is written.
  MOE_RETURN_IF_ERROR(CheckFreeSpace(o.out, ExistingAncestor(dest.parent_path()), plan.disk_bytes));
  RemoveOnFailure created_parents;
  MOE_RETURN_IF_ERROR(CreateParents(o.out, dest.parent_path(), created_parents));
  MOE_ASSIGN_OR_RETURN(fs::path tmp, MakeSiblingDir(o.out, dest, "partial"));
  RemoveOnFailure partial(tmp);
  if (absl::Status s = WriteCheckpoint(o, plan, tmp); !s.ok()) {
    return core::Annotate(s, absl::StrCat("make-model: writing ", o.out, " (nothing was left behind)"));
  }
  MOE_RETURN_IF_ERROR(MoveIntoPlace(o.out, tmp, dest, replace));
  partial.Release();
  created_parents.Release();
  return absl::OkStatus();
}

}  // namespace moe::deploy

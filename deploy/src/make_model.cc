#include "make_model.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "moe/core/dtype.h"
#include "moe/core/progress.h"
#include "moe/core/status.h"
#include "moe/runtime/safetensors_writer.h"
#include "nlohmann/json.hpp"
#include "oneapi/tbb/parallel_for.h"

namespace moe::deploy {
namespace {

namespace fs = std::filesystem;
using runtime::TensorEntry;

struct Shape {
  int hidden, layers, heads, kv_heads, head_dim, experts, top_k, moe_inter, inter, vocab, max_pos;
  double rope_theta;
};

absl::StatusOr<Shape> PresetShape(const std::string& preset) {
  if (preset == "tiny") return Shape{128, 4, 4, 2, 32, 16, 4, 64, 256, 512, 4096, 1e6};
  if (preset == "qwen3-30b-a3b") return Shape{2048, 48, 32, 4, 128, 128, 8, 768, 6144, 151936, 40960, 1e6};
  return absl::InvalidArgumentError(
      absl::StrCat("unknown preset '", preset, "'; presets: ", absl::StrJoin(MakeModelPresets(), ", ")));
}

// The config.json of a Qwen3-MoE checkpoint, with the key spellings real checkpoints use.
nlohmann::ordered_json Qwen3Config(const Shape& s) {
  return {{"architectures", {"Qwen3MoeForCausalLM"}},
          {"model_type", "qwen3_moe"},
          {"hidden_size", s.hidden},
          {"num_hidden_layers", s.layers},
          {"num_attention_heads", s.heads},
          {"num_key_value_heads", s.kv_heads},
          {"head_dim", s.head_dim},
          {"num_experts", s.experts},
          {"num_experts_per_tok", s.top_k},
          {"moe_intermediate_size", s.moe_inter},
          {"intermediate_size", s.inter},
          {"decoder_sparse_step", 1},
          {"mlp_only_layers", nlohmann::ordered_json::array()},
          {"norm_topk_prob", true},
          {"vocab_size", s.vocab},
          {"max_position_embeddings", s.max_pos},
          {"rope_theta", s.rope_theta},
          {"rms_norm_eps", 1e-6},
          {"attention_bias", false},
          {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"},
          {"eos_token_id", nullptr},
          {"moeserve_random_weights", true}};
}

std::vector<TensorEntry> Qwen3Tensors(const Shape& s) {
  using core::DType;
  const int64_t h = s.hidden, q = int64_t{s.heads} * s.head_dim, kv = int64_t{s.kv_heads} * s.head_dim;
  std::vector<TensorEntry> t;
  t.push_back({"model.embed_tokens.weight", DType::kBF16, {s.vocab, h}});
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    t.push_back({p + "input_layernorm.weight", DType::kBF16, {h}});
    t.push_back({p + "post_attention_layernorm.weight", DType::kBF16, {h}});
    t.push_back({p + "self_attn.q_proj.weight", DType::kBF16, {q, h}});
    t.push_back({p + "self_attn.k_proj.weight", DType::kBF16, {kv, h}});
    t.push_back({p + "self_attn.v_proj.weight", DType::kBF16, {kv, h}});
    t.push_back({p + "self_attn.o_proj.weight", DType::kBF16, {h, q}});
    t.push_back({p + "self_attn.q_norm.weight", DType::kBF16, {s.head_dim}});
    t.push_back({p + "self_attn.k_norm.weight", DType::kBF16, {s.head_dim}});
    t.push_back({p + "mlp.gate.weight", DType::kBF16, {s.experts, h}});
    for (int e = 0; e < s.experts; ++e) {
      const std::string ep = absl::StrCat(p, "mlp.experts.", e, ".");
      t.push_back({ep + "gate_proj.weight", DType::kBF16, {s.moe_inter, h}});
      t.push_back({ep + "up_proj.weight", DType::kBF16, {s.moe_inter, h}});
      t.push_back({ep + "down_proj.weight", DType::kBF16, {h, s.moe_inter}});
    }
  }
  t.push_back({"model.norm.weight", DType::kBF16, {h}});
  t.push_back({"lm_head.weight", DType::kBF16, {s.vocab, h}});
  return t;
}

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Norm weights are 1; matrices are uniform with variance 1/fan_in, so activations keep their
// scale through the layers and the logits are not degenerate.
void FillChunk(const TensorEntry& t, uint16_t* data, int64_t begin, int64_t end, uint64_t seed) {
  if (t.shape.size() == 1) {
    std::fill(data + begin, data + end, core::FloatToBf16(1.0f));
    return;
  }
  const float bound = std::sqrt(3.0f / static_cast<float>(t.shape[1]));
  uint64_t state = seed;
  for (int64_t i = begin; i < end; ++i) {
    const float u = static_cast<float>(SplitMix(state) >> 40) * (1.0f / 16777216.0f);
    data[i] = core::FloatToBf16((2.0f * u - 1.0f) * bound);
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
    FillChunk(t, static_cast<uint16_t*>(writer.data(job.tensor)), job.begin, job.end, chunk_seed);
    progress.Add((job.end - job.begin) * 2);
  });
  return writer.Finish();
}

}  // namespace

const std::vector<std::string>& MakeModelPresets() {
  static const std::vector<std::string> presets = {"tiny", "qwen3-30b-a3b"};
  return presets;
}

absl::Status MakeModel(const MakeModelOptions& o) {
  if (o.arch != "qwen3_moe") {
    return absl::InvalidArgumentError(
        absl::StrCat("make-model: --arch ", o.arch, " is not supported; supported: qwen3_moe"));
  }
  if (o.out.empty()) return absl::InvalidArgumentError("make-model: --out is required");
  MOE_ASSIGN_OR_RETURN(Shape shape, PresetShape(o.preset));
  if (o.layers < 0 || o.vocab < 0 || o.max_shard_bytes <= 0) {
    return absl::InvalidArgumentError("make-model: --layers, --vocab and --max-shard-mb must be positive");
  }
  if (o.layers > 0) shape.layers = o.layers;
  if (o.vocab > 0) shape.vocab = o.vocab;

  std::error_code ec;
  fs::create_directories(o.out, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat(o.out, ": cannot create: ", ec.message()));
  {
    std::ofstream config(o.out + "/config.json");
    config << Qwen3Config(shape).dump(2) << "\n";
    if (!config) return absl::InvalidArgumentError(absl::StrCat(o.out, "/config.json: cannot write"));
  }

  // Split into shards of at most max_shard_bytes (a tensor is never split).
  std::vector<TensorEntry> all = Qwen3Tensors(shape);
  std::vector<std::vector<TensorEntry>> shards(1);
  int64_t total = 0, in_shard = 0;
  for (TensorEntry& t : all) {
    if (in_shard > 0 && in_shard + t.bytes() > o.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    in_shard += t.bytes();
    total += t.bytes();
    shards.back().push_back(std::move(t));
  }
  for (const char* stale : {"/model.safetensors", "/model.safetensors.index.json"}) fs::remove(o.out + stale, ec);

  core::ProgressReporter progress("make-model: written", total, o.progress);
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  size_t index = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shards.size() == 1
                                 ? "model.safetensors"
                                 : absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size());
    for (const TensorEntry& t : shards[s]) weight_map[t.name] = name;
    const size_t count = shards[s].size();
    MOE_RETURN_IF_ERROR(WriteShard(o.out + "/" + name, std::move(shards[s]), o.seed, index, progress));
    index += count;
  }
  progress.Finish();
  if (shards.size() > 1) {
    nlohmann::ordered_json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream out(o.out + "/model.safetensors.index.json");
    out << idx.dump(1) << "\n";
    if (!out) return absl::InvalidArgumentError(absl::StrCat(o.out, "/model.safetensors.index.json: cannot write"));
  }
  return absl::OkStatus();
}

}  // namespace moe::deploy

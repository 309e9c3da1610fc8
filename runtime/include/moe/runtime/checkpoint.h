// A checkpoint as the runtime sees it, whatever its container: the model's spec, its tensors by a
// typed key (which tensor, which layer, which expert) rather than by name, how each tensor is
// stored, and where its tokenizer and chat template come from.
//
// Names live in one table per (architecture, container), the way llama.cpp's llama-arch.cpp keeps
// them: the loader, the expected-tensor lists of the memory plan, the held-expert swaps and
// make-model all read the same table, so a new container (GGUF) or architecture adds a table, not a
// fifth copy of the names.
//
// Storage is a WeightFormat: a plain element type (bf16, f16, f32, fp8) or a block-quantized one
// (bytes per block of n elements, as GGUF's Q8_0 or Q4_K; or fp8 with one scale per 128x128 block,
// as FP8 releases carry `weight_scale_inv`). A backend says which formats it takes for which use
// (backend.h, weight_policy.h); the loader converts on the host what it does not take.
//
// Thread-safety: a Checkpoint is immutable once opened; any thread may read it. Views stay valid
// for its life.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/dtype.h"
#include "moe/core/tensor.h"
#include "moe/experts/packed.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/weight_source.h"

namespace moe::runtime {

// ---- Which tensor ----

// Every tensor a supported architecture has, and those the coming ones (MLA, Gated DeltaNet, MTP)
// will; a table that lacks one gives no name for it.
enum class TensorId : uint8_t {
  kEmbedding,
  kFinalNorm,
  kLmHead,
  kAttnNorm,  // input_layernorm
  kFfnNorm,   // post_attention_layernorm
  kAttnQ,
  kAttnK,
  kAttnV,
  kAttnO,
  kAttnQBias,
  kAttnKBias,
  kAttnVBias,
  kAttnQNorm,  // per-head RMSNorm of q and k
  kAttnKNorm,
  kRouter,      // the gate's [experts x hidden] weight
  kRouterBias,  // e_score_correction_bias (sigmoid routers)
  kExpertGate,  // routed expert `expert` (a stacked container holds every expert in one tensor)
  kExpertUp,
  kExpertDown,
  kSharedGate,  // the shared expert(s)
  kSharedUp,
  kSharedDown,
  kSharedExpertGate,  // qwen2_moe's sigmoid gate of the shared expert [1 x hidden]
  kDenseGate,         // a layer without experts
  kDenseUp,
  kDenseDown,
  // MLA (deepseek_v3): q LoRA and its norm, or a plain q; the compressed KV with its norm; its
  // up-projection, whole or split into K and V halves as llama.cpp writes it.
  kMlaQA,
  kMlaQANorm,
  kMlaQB,
  kMlaKvA,
  kMlaKvANorm,
  kMlaKvB,
  kMlaKB,
  kMlaVB,
  // Gated DeltaNet (qwen3_next's linear-attention layers).
  kGdnInProjQkvz,
  kGdnInProjBa,
  kGdnConv,
  kGdnDtBias,
  kGdnALog,
  kGdnNorm,
  kGdnOut,
  // MTP / nextn layers (GLM-4.5, DeepSeek-V3): norms of the embedding and of the hidden state, the
  // projection of both, and the layer's own embedding and head where it carries them.
  kNextnEmbedNorm,
  kNextnHiddenNorm,
  kNextnProj,
  kNextnEmbedding,
  kNextnHeadNorm,
  kNextnHead,
  kCount,
};
std::string_view TensorIdName(TensorId id);

struct TensorKey {
  TensorId id = TensorId::kEmbedding;
  int layer = -1;   // -1 outside the layers; nextn layers follow the model's (num_layers + i)
  int expert = -1;  // routed experts only
  bool operator==(const TensorKey&) const = default;
};
// "layer 3 expert 7 expert_up"
std::string KeyString(const TensorKey& key);

// What a tensor is for, which placement rules and the memory plan reason about.
enum class TensorRole {
  kEmbedding,
  kNorm,
  kAttention,
  kRouter,        // the gate's weight and its correction bias
  kSharedExpert,  // the shared expert(s) and their sigmoid gate
  kRoutedExpert,
  kDenseFfn,  // the FFN of a layer without experts
  kLmHead,
  kNextn,  // a nextn/MTP layer's own tensors (its attention and experts keep their roles)
  kOther,
};
std::string_view TensorRoleName(TensorRole role);
TensorRole RoleOf(TensorId id);

struct TensorKind {
  TensorRole role = TensorRole::kOther;
  int layer = -1;   // -1 outside the layers
  int expert = -1;  // routed experts only
};

// ---- Names ----

enum class Container { kSafetensors, kGguf };
std::string_view ContainerName(Container c);

// The names of one architecture's tensors in one container. A template holds {L} for the layer and
// {E} for the expert; a stacked tensor (GGUF's ffn_*_exps) holds every expert of a layer, expert
// first: [experts x rows x cols].
class TensorNames {
 public:
  static const TensorNames& For(Architecture arch, Container container);

  Architecture arch() const { return arch_; }
  Container container() const { return container_; }
  // The name of `key`'s tensor (of the stacked tensor for a stacked id), or "" when this
  // architecture has no such tensor in this container.
  std::string Name(const TensorKey& key) const;
  bool Has(TensorId id) const { return !templates_[static_cast<int>(id)].empty(); }
  bool Stacked(TensorId id) const { return stacked_[static_cast<int>(id)]; }
  // The key a name stands for (expert -1 for a stacked tensor), or nullopt for a name the table
  // does not hold.
  std::optional<TensorKey> Parse(std::string_view name) const;

 private:
  TensorNames(Architecture arch, Container container);
  void Set(TensorId id, std::string name_template, bool stacked = false);

  Architecture arch_;
  Container container_;
  std::string templates_[static_cast<int>(TensorId::kCount)];
  bool stacked_[static_cast<int>(TensorId::kCount)] = {};
};

// The role of a tensor of any supported architecture and container, from its name alone (placement
// rules run before a spec is trusted): the first table that parses it, kOther when none does.
TensorKind ClassifyTensor(std::string_view name);

// ---- Tokenizer and chat template ----

// Where the checkpoint's tokenizer and chat template come from: a Hugging Face folder's files, or a
// vocabulary carried in the checkpoint itself (GGUF's tokenizer.ggml.* keys and
// tokenizer.chat_template), which the text module builds a tokenizer from.
struct TokenizerSource {
  std::string dir;  // tokenizer.json, tokenizer_config.json, generation_config.json; "" when embedded
  // Embedded (empty `tokens` when the folder's files are the source):
  std::string model;  // "gpt2" (byte-level BPE), ...
  std::string pre;    // the pre-tokenizer's name: "qwen2", "llama-bpe", "glm4", ...
  std::vector<std::string> tokens;
  std::vector<int32_t> token_types;
  std::vector<std::string> merges;
  std::optional<int32_t> bos_id, eos_id, eot_id, pad_id;
  bool add_bos = false;
  std::string chat_template;  // the checkpoint's own template, "" when none (or in `dir`)
  bool embedded() const { return !tokens.empty(); }
};

// ---- The checkpoint ----

class Checkpoint {
 public:
  virtual ~Checkpoint() = default;

  const ModelSpec& spec() const { return spec_; }
  // What was opened, and the folder or file holding it.
  const std::string& path() const { return path_; }
  Container container() const { return names_->container(); }
  const TensorNames& names() const { return *names_; }
  // What identifies the contents (core::WeightFilesFingerprint: the weight and JSON files' names,
  // sizes and modification times): two opens of unchanged files give the same id, a changed file
  // another. Keys shared state built
  // from the weights (the expert pool's shared arena).
  const std::string& id() const { return id_; }
  const TokenizerSource& tokenizer() const { return tokenizer_; }
  // How a quantized Hugging Face checkpoint stores its weights ("fp8 e4m3, scale per 128x128
  // block"), or "" (plain safetensors; a GGUF file's types are per tensor).
  const std::string& quantization() const { return quantization_; }

  // The tensor `key` names, as stored; for a stacked tensor, the expert's slice. kNotFound naming
  // the tensor and where it was looked for; kInvalidArgument for a tensor whose stacked shape does
  // not hold the expert.
  absl::StatusOr<WeightView> Get(const TensorKey& key) const;
  bool Has(const TensorKey& key) const;
  // "model.layers.3.mlp.experts.7.up_proj.weight in model-00002.safetensors", for messages.
  std::string Describe(const TensorKey& key) const;
  // The tensors by name (placement's regex rules, inspect, the unused-tensor warning).
  const WeightSource& source() const { return *source_; }

 protected:
  Checkpoint() = default;
  // Every member set by the opener.
  ModelSpec spec_;
  std::string path_, id_, quantization_;
  const TensorNames* names_ = nullptr;
  std::unique_ptr<WeightSource> source_;
  TokenizerSource tokenizer_;
};

// A stored weight as plain values the backends read: bf16, f16 and f32 as they are (a view of the
// same bytes); a GGUF block type dequantized to f32 into `storage` (bit-identical to llama.cpp's
// dequantization), or fp8 codes times their block's scale in fp32, which must outlive the view. kInvalidArgument for a type moeserve does not read,
// naming it and the types it reads; the caller adds the tensor's name.
absl::StatusOr<core::TensorView> ExpandToFloats(const WeightView& stored, std::vector<float>* storage);

// Whether the checkpoint's routed experts are stored block-quantized (a GGUF file's types), read
// from its first MoE layer's expert 0.
bool ExpertsAreBlockQuantized(const Checkpoint& checkpoint);
// The expert pool's format for --expert-format auto: native (the file's types) for block-quantized
// experts, fp8 for an FP8 checkpoint's experts (kept as stored: Fp8ExpertGroup), bf16 otherwise.
experts::ExpertFormat AutoPoolFormat(const Checkpoint& checkpoint);
// For an FP8 checkpoint whose experts the pool keeps as stored, the pool's fp8 group (128 for
// 128 x 128 blocks: the largest of 32, 64, 128 that divides the scale blocks' columns); else 0.
int Fp8ExpertGroup(const Checkpoint& checkpoint);

// Whether `path` names a GGUF model: a .gguf file (or a file starting with GGUF's magic), or a
// folder without config.json that holds .gguf files.
bool IsGgufCheckpoint(const std::string& path);

// Opens a checkpoint: a Hugging Face folder (config.json and safetensors, one file or shards with
// an index), a single .safetensors file whose folder holds config.json, or a GGUF model (a file;
// the first part of a split set; a folder of one model's GGUF files). Every header is checked
// before anything is handed out (weight_source.h); a GGUF file's data is mapped, not read. kNotFound
// for a path that does not exist or a folder with neither config.json nor weights;
// kInvalidArgument for a bad file, naming it (and for GGUF the offset and what is wrong).
absl::StatusOr<std::unique_ptr<Checkpoint>> OpenCheckpoint(const std::string& path);

// The tokenizer.json text (Hugging Face's format, which the text module reads) for a vocabulary
// carried in the checkpoint: byte-level BPE ("gpt2") with the split pattern its pre-tokenizer name
// stands for (qwen2, llama-bpe, glm4, deepseek-v3, gpt-2, ...). kInvalidArgument naming an
// unknown pre-tokenizer or tokenizer model, and saying to give --tokenizer DIR instead.
absl::StatusOr<std::string> EmbeddedTokenizerJson(const TokenizerSource& source);

// The spec alone, for planning without mapping the weights (inspect, the cluster file's checks):
// the same as OpenCheckpoint(path)->spec(), reading only the configuration.
absl::StatusOr<ModelSpec> ReadCheckpointSpec(const std::string& path);

}  // namespace moe::runtime

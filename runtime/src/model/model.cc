#include "moe/runtime/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/held_experts.h"
#include "model/load_plan.h"
#include "model/model_weights.h"
#include "model/moe_block.h"
#include "model/prefill_probe.h"
#include "moe/comm/communicator.h"
#include "moe/core/logging.h"
#include "moe/core/status.h"
#include "moe/runtime/backend_cpu.h"
#include "moe/runtime/routing_profile.h"

namespace moe::runtime {
namespace {

using core::DType;
using internal::FfnBuffers;
using internal::LayerWeights;

// Decode steps are padded to one of these batch sizes, so that each has one CUDA graph.
constexpr int kGraphBatchBuckets[] = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256};
// ...and their KV lengths rounded up to a power of two from this one.
constexpr int kMinKvBucket = 256;
// The step's input staging is sized for this many sequences at the full context in blocks of
// this size; a larger step is refused at BeginStep.
constexpr int kMaxStagedSequences = 1024;
constexpr int kStagedBlockSize = 16;

int GraphBatchBucket(int rows, int most) {
  for (int b : kGraphBatchBuckets) {
    if (b >= rows && b <= most) return b;
  }
  return 0;
}

}  // namespace

// Every activation of a step, carved from the arena before the first operation is queued: the
// same step shape gets the same addresses, which a replayed CUDA graph relies on.
struct Model::StepBuffers {
  Tensor x;      // [T x hidden] fp32: the residual stream
  Tensor h;      // [T x hidden] activation dtype: the normed input of a block
  Tensor qkv;    // [T x (H + 2 KV) d]
  Tensor q;      // [T x H d]
  Tensor attn;   // [T x H d] (MLA: its first T x H v_head_dim values)
  Tensor mla_q_a;  // MLA with a q LoRA: [T x q_lora_rank]
  Tensor mla_kv;   // MLA: [T x (kv_lora_rank + qk_rope_head_dim)]
  Tensor delta;  // [T x hidden] fp32: a block's output, added to x by the next norm
  FfnBuffers ffn;
  Tensor last_h;  // [L x hidden] activation dtype
  Tensor logits;  // [L x vocab] fp32
  // A tensor split's LM-head shard: this rank's [L x vocab / parts], and every rank's stacked
  // [parts * L x vocab / parts] (no rows without a split LM head).
  Tensor logits_shard, logits_shards;
  // [L x hidden] fp32 when the step wants hidden states: the first rows of `delta`, which the
  // final norm has consumed by then (so asking costs no arena). Else empty.
  Tensor hidden;
};

namespace {

// Every tensor of a step's StepBuffers with its dtype and shape, for `t` tokens and `l` logit
// rows, in the order they are taken: one list for sizing the arena at load and for carving it.
template <typename Take>
absl::Status ForEachStepBuffer(const ModelSpec& s, DType act, int64_t t, int64_t l, int vocab_parts,
                               Model::StepBuffers* buf, Take&& take) {
  const int64_t shard_rows = vocab_parts > 1 ? l : 0, shard_vocab = s.vocab_size / std::max(vocab_parts, 1);
  const int64_t hidden = s.hidden_size, q_width = int64_t{s.num_heads} * s.head_dim;
  const int64_t qkv_width = q_width + 2 * int64_t{s.num_kv_heads} * s.head_dim;
  const bool mla = s.uses_mla();
  const int64_t attn_width = std::max<int64_t>(q_width, mla ? int64_t{s.num_heads} * s.mla.v_head_dim : 0);
  const int64_t width = std::max<int64_t>({s.intermediate_size, s.shared_expert_intermediate_size, 1});
  const int64_t experts = std::max(s.routing.num_experts, 1), top_k = std::max(s.routing.top_k, 1);
  const struct {
    Tensor* out;
    DType dtype;
    int64_t rows, cols;
  } list[] = {
      {&buf->x, DType::kF32, t, hidden},
      {&buf->h, act, t, hidden},
      {&buf->qkv, act, t, qkv_width},
      {&buf->q, act, t, q_width},
      {&buf->attn, act, t, attn_width},
      {&buf->mla_q_a, act, mla && s.mla.q_lora_rank > 0 ? t : 0, std::max(s.mla.q_lora_rank, 1)},
      {&buf->mla_kv, act, mla ? t : 0, std::max(s.mla.latent_width(), 1)},
      {&buf->delta, DType::kF32, t, hidden},
      {&buf->ffn.gate_up, act, t, 2 * width},
      {&buf->ffn.act, act, t, width},
      {&buf->ffn.router_logits, DType::kF32, t, experts},
      {&buf->ffn.ids, DType::kI32, t, top_k},
      {&buf->ffn.weights, DType::kF32, t, top_k},
      {&buf->ffn.shared, DType::kF32, t, hidden},
      {&buf->ffn.shared_gate, DType::kF32, t, 1},
      {&buf->ffn.split_host_ids, DType::kI32, t, top_k},
      {&buf->ffn.split_host_weights, DType::kF32, t, top_k},
      {&buf->ffn.split_backend_ids, DType::kI32, t, top_k},
      {&buf->ffn.split_backend_weights, DType::kF32, t, top_k},
      {&buf->ffn.split_out, DType::kF32, t, hidden},
      {&buf->last_h, act, l, hidden},
      {&buf->logits, DType::kF32, l, s.vocab_size},
      {&buf->logits_shard, DType::kF32, shard_rows, shard_vocab},
      {&buf->logits_shards, DType::kF32, shard_rows * vocab_parts, shard_vocab},
  };
  for (const auto& e : list) MOE_RETURN_IF_ERROR(take(e.out, e.dtype, e.rows, e.cols));
  return absl::OkStatus();
}

}  // namespace

std::vector<int> Model::held_experts(int layer) const {
  if (layer < 0 || layer >= spec_.num_layers) return {};
  const LayerWeights& lw = weights_->layers[layer];
  if (lw.backend_index == nullptr) return {};
  std::vector<int> held;
  for (int slot = 0;; ++slot) {
    auto it = std::find(lw.backend_index_host.begin(), lw.backend_index_host.end(), slot);
    if (it == lw.backend_index_host.end()) break;
    held.push_back(static_cast<int>(it - lw.backend_index_host.begin()));
  }
  return held;
}

Model::HeldExpertsStats Model::held_experts_stats() const { return held_ ? held_->stats() : HeldExpertsStats{}; }

Model::~Model() {
  // The backend outlives the pool (it may be shared, and is destroyed last): nothing of its may
  // still reach the pool's memory, threads or this model's routed experts.
  if (backend_ != nullptr && pool_ != nullptr && backend_->host_threads() == &pool_->host_threads()) {
    backend_->UseHostThreads(nullptr);
  }
  if (backend_ != nullptr && pool_ != nullptr && !backend_->HostAddressable()) {
    (void)backend_->Synchronize();
    backend_->ClearGraphs();
    backend_->ReleaseHostExperts();
  }
}

Model::StepArena Model::StepArenaBytes(const ModelSpec& s, DType activation, int64_t max_tokens, int64_t max_logit_rows,
                                       int max_context, int vocab_parts) {
  auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  StepArena arena;
  int64_t per_step = 0;
  StepBuffers sizing;
  (void)ForEachStepBuffer(s, activation, max_tokens, max_logit_rows, vocab_parts, &sizing,
                          [&](Tensor*, DType dtype, int64_t rows, int64_t cols) {
                            per_step += aligned(rows * cols * core::DTypeSize(dtype));
                            return absl::OkStatus();
                          });
  // Inputs: ids, positions, row_seq, seq_start, seq_len, logit rows, and the block tables of as
  // many sequences as tokens, each long enough for the whole context.
  const int64_t max_blocks = BlocksFor(max_context, kStagedBlockSize) + 1;
  arena.inputs = 7 * 256 + 4 * (5 * max_tokens + 1 + max_logit_rows) +
                 4 * std::min<int64_t>(max_tokens, kMaxStagedSequences) * max_blocks;
  arena.total = per_step + aligned(arena.inputs);
  return arena;
}

std::vector<float> RopeInverseFrequencies(const ModelSpec& spec) {
  const int half = spec.rotary_dim / 2;
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(spec.rotary_dim);
    inv_freq[i] = 1.0f / std::pow(spec.rope_theta, exponent);
  }
  const RopeScaling& y = spec.rope_scaling;
  if (y.type != RopeType::kYarn) return inv_freq;
  // YaRN: dimensions that turn fewer than beta_slow times over the original context are
  // interpolated (divided by the factor), those that turn more than beta_fast times are kept, and a
  // linear ramp blends the ones between (transformers' _compute_yarn_parameters).
  const double dim = spec.rotary_dim, base = spec.rope_theta;
  const double original =
      y.original_max_position_embeddings > 0 ? y.original_max_position_embeddings : spec.max_position_embeddings;
  auto correction_dim = [&](double rotations) {
    return dim * std::log(original / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
  if (y.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;
  for (int i = 0; i < half; ++i) {
    const float ramp =
        std::clamp((static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low), 0.0f, 1.0f);
    const float keep = 1.0f - ramp;  // the share of the original (extrapolated) frequency
    const float interpolated = inv_freq[i] / y.factor;
    inv_freq[i] = interpolated * (1.0f - keep) + inv_freq[i] * keep;
  }
  return inv_freq;
}

int64_t Model::weight_bytes() const { return weights_->bytes; }

absl::Status Model::PlanShare() {
  const ParallelConfig& p = options_.parallel;
  local_ = spec_;
  layers_ = Range{0, spec_.num_layers};
  if (!p.split()) return absl::OkStatus();
  if (p.comm == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("a ", ParallelModeName(p.mode), " split of ", p.size, " needs a communicator joining its ranks"));
  }
  switch (p.mode) {
    case ParallelMode::kTensor: {
      MOE_ASSIGN_OR_RETURN(shard_, PlanTensorShard(spec_, p.rank, p.size));
      local_.num_heads = static_cast<int>(shard_.q_heads.size());
      local_.num_kv_heads = static_cast<int>(shard_.kv_heads.size());
      local_.intermediate_size = static_cast<int>(shard_.dense.size());
      local_.shared_expert_intermediate_size = static_cast<int>(shard_.shared.size());
      return absl::OkStatus();
    }
    case ParallelMode::kLayer: {
      MOE_ASSIGN_OR_RETURN(layers_, PlanLayerStage(spec_, p.rank, p.size));
      return absl::OkStatus();
    }
    case ParallelMode::kNone:
      break;
  }
  return absl::OkStatus();
}

bool Model::holds_logits() const {
  const ParallelConfig& p = options_.parallel;
  return !(p.split() && p.mode == ParallelMode::kLayer && p.rank != p.size - 1);
}

int Model::VocabParts() const {
  const ParallelConfig& p = options_.parallel;
  const bool split_head = p.split() && p.mode == ParallelMode::kTensor && shard_.vocab.size() < spec_.vocab_size;
  return split_head ? p.size : 1;
}

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& path, const ModelOptions& options,
                                                   std::shared_ptr<Backend> backend) {
  MOE_RETURN_IF_ERROR(internal::CheckStepLimits(options));
  std::unique_ptr<Model> model(new Model());
  model->options_ = options;
  MOE_ASSIGN_OR_RETURN(model->checkpoint_, OpenCheckpoint(path));
  model->spec_ = model->checkpoint_->spec();
  const ModelSpec& spec = model->spec_;
  model->options_.max_logit_rows = std::min(options.max_logit_rows, options.max_step_tokens);
  if (model->options_.max_context <= 0 || model->options_.max_context > spec.max_position_embeddings) {
    model->options_.max_context = spec.max_position_embeddings;
  }
  MOE_RETURN_IF_ERROR(model->PlanShare());
  if (options.nextn_head) {
    if (spec.num_nextn_layers == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " has no MTP (nextn) layer: its config.json's num_nextn_predict_layers is 0 (", spec.model_type, ")"));
    }
    if (options.parallel.split()) {
      return absl::FailedPreconditionError("an MTP head runs in one process: a split does not hold it");
    }
    model->layers_ = Range{spec.num_layers, spec.num_layers + 1};
    model->options_.experts = RoutedExpertsMode::kBackend;
    model->options_.pool_layers.reset();
    model->options_.backend_experts.clear();
    model->options_.held_experts_per_layer = 0;
    model->options_.defer_experts = 0;
  }
  model->backend_ = backend != nullptr ? std::move(backend)
                                       : std::shared_ptr<Backend>(CreateCpuBackend(options.threads, options.weights));
  Backend& b = *model->backend_;
  if (spec.uses_mla() && !b.SupportsAttention(AttentionKind::kMla)) {
    return absl::FailedPreconditionError(absl::StrCat(
        spec.model_type, "'s multi-head latent attention (MLA) runs on the CPU backend in this build: ", b.name(),
        " has no MLA kernels yet; use --device cpu"));
  }
  if (options.nextn_head && !b.HostAddressable()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the MTP (nextn) head runs on the CPU backend in this build, not on ", b.name()));
  }
  MOE_ASSIGN_OR_RETURN(internal::LoadPlan plan, internal::PlanLoad(spec, model->options_, model->layers_, b));
  if (options.nextn_head) {  // the head's routed experts run on the backend, every one
    std::vector<int>& all = plan.backend_experts.emplace_back(spec.routing.num_experts);
    std::iota(all.begin(), all.end(), 0);
    plan.backend_experts.resize(spec.num_all_layers(), all);
  }
  model->pool_layers_ = plan.pool_layers;
  const std::vector<int>& pool_layers = model->pool_layers_;
  const bool pool = !pool_layers.empty();
  const bool tensor = options.parallel.mode == ParallelMode::kTensor && options.parallel.split();
  internal::WeightShare share;
  share.layers = model->layers_;
  if (tensor) share.tensor = model->shard_;
  MOE_ASSIGN_OR_RETURN(model->weights_,
                       internal::LoadWeights(*model->checkpoint_, b, plan.backend_experts, options.progress, share));
  if (model->options_.held_experts_per_layer > 0) {
    MOE_ASSIGN_OR_RETURN(model->held_,
                         internal::HeldExpertsPolicy::Start(b, *model->checkpoint_, *model->weights_, pool_layers,
                                                            options.held_experts_refresh_steps));
  }
  if (pool) {
    experts::ExpertPoolOptions pool_options = options.pool;
    if (options.pool_format_auto) pool_options.format = AutoPoolFormat(*model->checkpoint_);
    // fp8 experts keep the checkpoint's scale groups (an explicit --expert-format fp8 of another
    // checkpoint quantizes with --int4-group's).
    if (pool_options.format == experts::ExpertFormat::kFp8 && Fp8ExpertGroup(*model->checkpoint_) > 0) {
      pool_options.group = Fp8ExpertGroup(*model->checkpoint_);
    }
    pool_options.linger_us = options.expert_linger_us.value_or(b.ComputesOnHostCores() ? 0 : pool_options.linger_us);
    MOE_ASSIGN_OR_RETURN(model->pool_, internal::CreatePool(*model->checkpoint_, pool_options, pool_layers));
    if (b.ComputesOnHostCores() && options.share_host_threads) b.UseHostThreads(&model->pool_->host_threads());
  }
  model->routed_experts_ = internal::MakeRoutedExperts(b, *model->weights_, spec, model->pool_.get(), pool_layers,
                                                       model->options_.defer_experts, tensor ? &model->shard_ : nullptr);
  MOE_RETURN_IF_ERROR(model->ReserveStep());
  if (pool && !b.HostAddressable() && options.prefill_offload_tokens != 0) {
    MOE_RETURN_IF_ERROR(model->SetUpStreamedExperts());
  }
  MOE_LOG(kDebug) << "loaded " << spec.Summary() << " on " << b.name();
  return model;
}

absl::Status Model::SetUpStreamedExperts() {
  Backend& b = *backend_;
  const ModelSpec& s = spec_;
  const experts::ExpertPool::ArenaLayout a = pool_->arena_layout();
  // The GPU unpacks bf16, int8 and int4 layers of one layout; the pool's GGUF formats stay on the
  // CPU for prefill too.
  const auto unpacks = [](const experts::MatrixLayout& m) {
    return m.format == experts::ExpertFormat::kBF16 || m.format == experts::ExpertFormat::kInt8 ||
           m.format == experts::ExpertFormat::kInt4;
  };
  if (!a.uniform || !unpacks(a.gate_up) || !unpacks(a.down)) {
    prefill_offload_note_ = absl::StrCat("prefill keeps the routed experts on the CPU: the GPU does not unpack the ",
                                         experts::FormatName(a.gate_up.format), " experts the pool holds");
    return absl::OkStatus();
  }
  Backend::StreamedExpertArena e;
  e.data = a.data;
  e.num_layers = static_cast<int>(pool_layers_.size());
  e.num_experts = s.routing.num_experts;
  e.expert_bytes = a.expert_bytes;
  e.bytes = int64_t{e.num_layers} * e.num_experts * a.expert_bytes;
  e.gate_up = a.gate_up;
  e.down = a.down;
  e.intermediate = s.moe_intermediate_size;
  e.min_tokens = options_.prefill_offload_tokens;
  absl::Status set = b.SetStreamedExperts(e);
  if (absl::IsUnimplemented(set) || absl::IsFailedPrecondition(set)) {
    prefill_offload_note_ = absl::StrCat("prefill keeps the routed experts on the CPU: ", set.message());
    return absl::OkStatus();
  }
  MOE_RETURN_IF_ERROR(set);
  prefill_offload_tokens_ = options_.prefill_offload_tokens;
  if (prefill_offload_tokens_ > 0) return absl::OkStatus();
  auto* host = dynamic_cast<HostExpertCompute*>(routed_experts_.get());
  if (host == nullptr) return absl::InternalError("the routed experts cannot run on the host");
  MOE_ASSIGN_OR_RETURN(const internal::PrefillOffload measured,
                       internal::MeasurePrefillOffload(b, *pool_, *host, s, pool_layers_, options_.max_step_tokens));
  prefill_offload_tokens_ = measured.tokens;
  prefill_offload_note_ = measured.note;
  b.SetStreamTokens(prefill_offload_tokens_);
  return absl::OkStatus();
}

absl::Status Model::ReserveStep() {
  Backend& b = *backend_;
  context_ = b.CreateContext();  // this model's arena and graphs, whatever else shares the backend
  b.UseContext(context_.get());
  const ModelSpec& s = local_;
  const std::vector<float> inv_freq = RopeInverseFrequencies(s);
  MOE_ASSIGN_OR_RETURN(rope_inv_freq_, b.Allocate(DType::kF32, 1, static_cast<int64_t>(inv_freq.size())));
  b.CopyFromHost(inv_freq.data(), rope_inv_freq_->tensor());

  const int64_t t = options_.max_step_tokens, l = options_.max_logit_rows;
  const int64_t qkv_width = int64_t{s.num_heads + 2 * s.num_kv_heads} * s.head_dim;
  const StepArena arena = StepArenaBytes(s, b.activation_dtype(), t, l, options_.max_context, VocabParts());
  MOE_RETURN_IF_ERROR(b.ReserveArena(arena.total, arena.inputs));
  Backend::StepLimits limits;
  limits.max_tokens = static_cast<int>(t);
  limits.max_logit_rows = static_cast<int>(l);
  limits.max_context = options_.max_context;
  limits.num_heads = s.num_heads;
  limits.head_dim = s.head_dim;
  limits.vocab = s.vocab_size;
  limits.hidden = s.hidden_size;
  limits.num_experts = s.routing.num_experts;
  limits.top_k = s.routing.top_k;
  limits.moe_intermediate = s.moe_intermediate_size;
  limits.max_bias_width = s.qkv_bias ? static_cast<int>(qkv_width) : 0;
  limits.host_experts = !pool_layers_.empty() && !b.HostAddressable();
  MOE_RETURN_IF_ERROR(b.ReserveScratch(limits));
  MOE_ASSIGN_OR_RETURN(host_logits_, b.AllocateHost(l * s.vocab_size * 4));
  return b.Synchronize();
}

CachePlan Model::CachePlanFor(int block_size) const {
  return PlanCache(local_, layers_, CacheOptions{block_size, kv_dtype()});
}

absl::StatusOr<std::unique_ptr<KvCache>> Model::NewKvCache(int num_blocks, int block_size) {
  return backend_->CreateKvCache(CachePlanFor(block_size), num_blocks);
}

absl::Status Model::CheckBatch(const ForwardBatch& batch, const KvCache& cache) const {
  const int64_t rows = static_cast<int64_t>(batch.token_ids.size());
  if (rows == 0) return absl::InvalidArgumentError("empty batch: no tokens");
  if (rows > options_.max_step_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("a step of ", rows, " tokens exceeds the ", options_.max_step_tokens,
                                                   " the model was loaded for"));
  }
  if (static_cast<int64_t>(batch.logit_rows.size()) > options_.max_logit_rows) {
    return absl::InvalidArgumentError(absl::StrCat("a step asking for ", batch.logit_rows.size(),
                                                   " rows of logits exceeds the ", options_.max_logit_rows,
                                                   " the model was loaded for"));
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int32_t id = batch.token_ids[i];
    if (id < 0 || id >= spec_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " at batch row ", i, " is outside the vocabulary [0, ", spec_.vocab_size, ")"));
    }
  }
  int64_t covered = 0;
  const int bs = cache.shape().block_size;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceChunk& c = batch.sequences[s];
    if (c.num_tokens <= 0 || c.first_position < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", s, ": chunk of ", c.num_tokens, " tokens at position ", c.first_position));
    }
    if (c.first_position + c.num_tokens > options_.max_context) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s, ": positions up to ",
                                                     c.first_position + c.num_tokens, " exceed the context of ",
                                                     options_.max_context));
    }
    if (c.state_slot != -1) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", s, ": state slot ", c.state_slot, " for a cache without recurrent groups"));
    }
    if (!c.more_block_tables.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s, ": ", c.more_block_tables.size() + 1,
                                                     " block tables for a cache of one paged group"));
    }
    const int need = BlocksFor(c.first_position + c.num_tokens, bs);
    if (static_cast<int>(c.block_table.size()) < need) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s, ": positions up to ",
                                                     c.first_position + c.num_tokens, " need ", need,
                                                     " KV blocks, its block table has ", c.block_table.size()));
    }
    for (int i = 0; i < need; ++i) {
      if (c.block_table[i] < 0 || c.block_table[i] >= cache.shape().num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", s, ": KV block id ", c.block_table[i],
                                                       " outside [0, ", cache.shape().num_blocks, ")"));
      }
    }
    covered += c.num_tokens;
  }
  if (covered != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("the sequences cover ", covered, " tokens but the batch has ", rows));
  }
  for (int32_t r : batch.logit_rows) {
    if (r < 0 || r >= rows)
      return absl::InvalidArgumentError(absl::StrCat("logit row ", r, " outside [0, ", rows, ")"));
  }
  if (options_.nextn_head && batch.head_hidden == nullptr) {
    return absl::InvalidArgumentError("a step of an MTP head needs each row's hidden state (head_hidden), got none");
  }
  if (batch.want_hidden && static_cast<int64_t>(batch.logit_rows.size()) > rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden states of ", batch.logit_rows.size(), " logit rows asked of a step of ", rows, " tokens"));
  }
  return absl::OkStatus();
}

StepInputs Model::BuildInputs(const ForwardBatch& batch, const KvCache& cache, int pad_to, int kv_bucket) const {
  const int bs = cache.shape().block_size;
  StepInputs in;
  in.token_ids = batch.token_ids;
  in.logit_rows = batch.logit_rows;
  int max_kv = 0;
  for (const SequenceChunk& c : batch.sequences) {
    in.max_q_len = std::max(in.max_q_len, c.num_tokens);
    max_kv = std::max<int>(max_kv, static_cast<int>(c.first_position + c.num_tokens));
  }
  in.max_kv_len = kv_bucket > 0 ? kv_bucket : max_kv;
  in.max_blocks = BlocksFor(in.max_kv_len, bs);
  const int seqs = static_cast<int>(batch.sequences.size());
  const int padded_seqs = std::max(seqs, pad_to);
  in.seq_start.reserve(padded_seqs + 1);
  in.block_table.assign(static_cast<size_t>(padded_seqs) * in.max_blocks, cache.scratch_block());
  for (int s = 0; s < seqs; ++s) {
    const SequenceChunk& c = batch.sequences[s];
    in.seq_start.push_back(static_cast<int32_t>(in.positions.size()));
    in.seq_len.push_back(static_cast<int32_t>(c.first_position + c.num_tokens));
    for (int i = 0; i < c.num_tokens; ++i) {
      in.positions.push_back(static_cast<int32_t>(c.first_position + i));
      in.row_seq.push_back(s);
    }
    const int need = BlocksFor(c.first_position + c.num_tokens, bs);
    std::copy(c.block_table.begin(), c.block_table.begin() + need, in.block_table.begin() + int64_t{s} * in.max_blocks);
  }
  // Padding rows: one token at position 0 in a sequence of its own, writing the scratch block.
  for (int s = seqs; s < padded_seqs; ++s) {
    in.seq_start.push_back(static_cast<int32_t>(in.positions.size()));
    in.seq_len.push_back(1);
    in.positions.push_back(0);
    in.row_seq.push_back(s);
    in.token_ids.push_back(0);
    in.logit_rows.push_back(s);
  }
  in.seq_start.push_back(static_cast<int32_t>(in.positions.size()));
  return in;
}

absl::StatusOr<Model::StepBuffers> Model::TakeBuffers(int64_t t, int64_t l) {
  Backend& b = *backend_;
  StepBuffers buf;
  MOE_RETURN_IF_ERROR(ForEachStepBuffer(local_, b.activation_dtype(), t, l, VocabParts(), &buf,
                                        [&](Tensor* out, DType dtype, int64_t rows, int64_t cols) -> absl::Status {
                                          MOE_ASSIGN_OR_RETURN(*out, b.Take(dtype, rows, cols));
                                          return absl::OkStatus();
                                        }));
  return buf;
}

void Model::RunGqa(const StepTensors& step, const StepBuffers& buf, const internal::LayerWeights& lw,
                   const Tensor& inv_freq, KvCache& cache, int layer) {
  const ModelSpec& s = spec_;
  Backend& b = *backend_;
  b.Linear(buf.h, *lw.qkv, lw.qkv_bias.get(), buf.qkv);
  if (tap_) tap_("qkv", layer, buf.qkv);
  AttentionArgs args;
  args.qkv = buf.qkv;
  args.q = buf.q;
  args.out = buf.attn;
  args.num_heads = local_.num_heads;
  args.num_kv_heads = local_.num_kv_heads;
  args.head_dim = s.head_dim;
  args.rotary_dim = s.rotary_dim;
  args.scale = s.attention_scale();
  args.eps = s.rms_norm_eps;
  args.q_norm = lw.q_norm.get();
  args.k_norm = lw.k_norm.get();
  args.inv_freq = &inv_freq;
  args.cache = &cache;
  args.layer = layer - static_cast<int>(layers_.begin);  // the cache holds this stage's layers
  b.Attention(args, step);
}

Tensor Model::RunMla(const StepTensors& step, const StepBuffers& buf, const internal::LayerWeights& lw,
                     const Tensor& inv_freq, KvCache& cache, int layer) {
  const ModelSpec& s = spec_;
  const MlaSpec& m = s.mla;
  Backend& b = *backend_;
  const int64_t rows = buf.h.rows;
  const int heads = local_.num_heads;
  const Tensor q{buf.q.data, buf.q.dtype, rows, int64_t{heads} * m.qk_head_dim()};
  if (lw.mla_q_a != nullptr) {  // q LoRA: down, normed, up
    b.Linear(buf.h, *lw.mla_q_a, nullptr, buf.mla_q_a);
    b.AddRmsNorm(buf.mla_q_a, nullptr, *lw.mla_q_a_norm, s.rms_norm_eps, buf.mla_q_a);
    b.Linear(buf.mla_q_a, *lw.mla_q, nullptr, q);
  } else {
    b.Linear(buf.h, *lw.mla_q, nullptr, q);
  }
  b.Linear(buf.h, *lw.mla_kv_a, nullptr, buf.mla_kv);
  if (tap_) {
    tap_("mla_q", layer, q);
    tap_("mla_kv", layer, buf.mla_kv);
  }
  MlaAttentionArgs args;
  args.q = q;
  args.kv = buf.mla_kv;
  args.out = Tensor{buf.attn.data, buf.attn.dtype, rows, int64_t{heads} * m.v_head_dim};
  args.num_heads = heads;
  args.mla = m;
  args.scale = s.attention_scale();
  args.rope_attention_factor = s.rope_scaling.type == RopeType::kYarn ? s.rope_scaling.attention_factor : 1.0f;
  args.eps = s.rms_norm_eps;
  args.kv_norm = lw.mla_kv_a_norm.get();
  args.kv_b = lw.mla_kv_b.get();
  args.inv_freq = &inv_freq;
  args.cache = &cache;
  args.layer = layer - static_cast<int>(layers_.begin);
  args.form = options_.mla_form;
  b.AttentionMla(args, step);
  return args.out;
}

absl::Status Model::RunLayers(const StepTensors& step, const StepBuffers& buf, KvCache& cache) {
  const ModelSpec& s = spec_;
  Backend& b = *backend_;
  const Weights& w = *weights_;
  const Tensor inv_freq = rope_inv_freq_->tensor();
  auto tap = [&](std::string_view what, int layer, const Tensor& t) {
    if (tap_) tap_(what, layer, t);
  };
  // A split: the shares are summed after each block (tensor), or the hidden states come from the
  // stage before and go on to the next (layer).
  const ParallelConfig& par = options_.parallel;
  comm::Communicator* comm = par.split() ? par.comm : nullptr;
  const bool tensor = comm != nullptr && par.mode == ParallelMode::kTensor;
  const Tensor* pending = nullptr;  // the last block's output, not yet added to the residual
  if (layers_.begin == 0) {
    b.Embed(*w.embed, step, buf.x);
  } else if (options_.nextn_head) {
    // z = eh_proj [enorm(embed(token)); hnorm(hidden)]: the two halves of eh_proj, summed as the
    // first block's pending output.
    b.Embed(*w.embed, step, buf.x);
    b.AddRmsNorm(buf.x, nullptr, *w.nextn_enorm, s.rms_norm_eps, buf.h);
    const Tensor given{const_cast<float*>(head_hidden_), DType::kF32, buf.x.rows, buf.x.cols};
    const Tensor normed = buf.ffn.split_out.Rows(0, buf.x.rows);
    b.AddRmsNorm(given, nullptr, *w.nextn_hnorm, s.rms_norm_eps, normed);
    b.Linear(buf.h, *w.nextn_proj_embed, nullptr, buf.x);
    b.Linear(normed, *w.nextn_proj_hidden, nullptr, buf.delta);
    pending = &buf.delta;
    tap("nextn_input", -1, buf.delta);
  } else {
    b.RecvTensor(buf.x, par.rank - 1, *comm);
  }
  tap("embed", -1, buf.x);
  for (int layer = static_cast<int>(layers_.begin); layer < layers_.end; ++layer) {
    const LayerWeights& lw = w.layers[layer];
    // Attention block.
    b.AddRmsNorm(buf.x, pending, *lw.input_norm, s.rms_norm_eps, buf.h);
    tap("residual", layer, buf.x);
    tap("input_norm", layer, buf.h);
    if (s.attention(layer) == AttentionKind::kMla) {
      const Tensor out = RunMla(step, buf, lw, inv_freq, cache, layer);
      tap("attention", layer, out);
      b.Linear(out, *lw.o, nullptr, buf.delta);
    } else {
      RunGqa(step, buf, lw, inv_freq, cache, layer);
      tap("attention", layer, buf.attn);
      b.Linear(buf.attn, *lw.o, nullptr, buf.delta);
    }
    if (tensor) b.AllReduceSum(buf.delta, *comm);
    tap("o_proj", layer, buf.delta);
    // FFN block: routed experts (plus shared ones) or a dense SwiGLU.
    b.AddRmsNorm(buf.x, &buf.delta, *lw.post_attention_norm, s.rms_norm_eps, buf.h);
    tap("post_attention_norm", layer, buf.h);
    if (s.IsMoeLayer(layer)) {
      internal::PickCounter counter;
      if (held_ != nullptr && lw.backend_index != nullptr) {
        counter = {&step, cache.scratch_block(), held_->counts(layer)};
      }
      MOE_RETURN_IF_ERROR(
          core::Annotate(internal::RunMoe(b, s, lw, *routed_experts_, layer, buf.h, buf.ffn, buf.delta, counter),
                         absl::StrCat("layer ", layer)));
      const int64_t rows = buf.h.rows;
      tap("router_logits", layer, buf.ffn.router_logits.Rows(0, rows));
      tap("expert_ids", layer, buf.ffn.ids.Rows(0, rows));
      tap("expert_weights", layer, buf.ffn.weights.Rows(0, rows));
      if (s.shared_expert_intermediate_size > 0) tap("shared_expert", layer, buf.ffn.shared.Rows(0, rows));
      tap("moe", layer, buf.delta);
    } else {
      internal::RunFfn(b, lw.dense, buf.h, buf.ffn, buf.delta);
      tap("ffn", layer, buf.delta);
    }
    if (tensor) b.AllReduceSum(buf.delta, *comm);
    pending = &buf.delta;
  }
  if (layers_.end < s.num_layers) {                                       // a layer split's stage before the last
    if (pending != nullptr) b.AddSharedExpert(buf.x, *pending, nullptr);  // x += the last block's output
    b.SendTensor(buf.x, par.rank + 1, *comm);
    return absl::OkStatus();
  }
  // Only the rows that want logits go through the final norm and the LM head.
  if (buf.logits.rows == 0) {
    if (all_hidden_ && pending != nullptr) b.AddSharedExpert(buf.x, *pending, nullptr);  // x: every row's
    return absl::OkStatus();
  }
  b.AddRmsNorm(buf.x, pending, *w.final_norm, s.rms_norm_eps, buf.h);
  tap("final_norm", -1, buf.h);
  if (buf.hidden) b.GatherRows(buf.x, step.logit_rows, buf.hidden);
  b.GatherRows(buf.h, step.logit_rows, buf.last_h);
  if (const int parts = VocabParts(); parts > 1) {
    // Each rank's rows of the LM head, gathered into whole rows of logits on every rank.
    const int64_t rows = buf.logits.rows;
    const Tensor shard = buf.logits_shard.Rows(0, rows);
    const Tensor shards = buf.logits_shards.Rows(0, rows * parts);
    b.Linear(buf.last_h, *w.lm_head, nullptr, shard);
    b.AllGather(shard, *comm, shards);
    b.ConcatColumns(shards, parts, buf.logits);
  } else {
    b.Linear(buf.last_h, *w.lm_head, nullptr, buf.logits);
  }
  tap("logits", -1, buf.logits);
  return absl::OkStatus();
}

absl::StatusOr<StepOutputs> Model::ForwardOnDevice(const ForwardBatch& batch, KvCache& cache) {
  MOE_RETURN_IF_ERROR(CheckBatch(batch, cache));
  Backend& b = *backend_;
  b.UseContext(context_.get());
  if (held_ != nullptr) MOE_RETURN_IF_ERROR(held_->BeforeStep());
  const int rows = static_cast<int>(batch.token_ids.size());
  // A decode step (one token per sequence, each wanting logits) is replayed from a graph.
  if (batch.want_all_hidden && !b.HostAddressable()) {
    return absl::UnimplementedError(absl::StrCat("every row's hidden state is gathered on a host backend, not ", b.name()));
  }
  head_hidden_ = batch.head_hidden;
  all_hidden_ = batch.want_all_hidden && holds_logits();
  bool decode = options_.graphs && !tap_ && b.SupportsGraphs() && !all_hidden_ &&
                batch.logit_rows.size() == batch.token_ids.size();
  for (size_t i = 0; decode && i < batch.sequences.size(); ++i) {
    decode = batch.sequences[i].num_tokens == 1 && batch.logit_rows[i] == static_cast<int32_t>(i);
  }
  const int bucket = decode ? GraphBatchBucket(rows, options_.max_logit_rows) : 0;
  int kv_bucket = 0;
  if (bucket > 0) {
    int max_kv = 0;
    for (const SequenceChunk& c : batch.sequences) max_kv = std::max<int>(max_kv, c.first_position + 1);
    kv_bucket = kMinKvBucket;
    while (kv_bucket < max_kv) kv_bucket *= 2;
    kv_bucket = std::min(kv_bucket, std::max(options_.max_context, max_kv));
  }
  inputs_ = BuildInputs(batch, cache, bucket, kv_bucket);
  MOE_ASSIGN_OR_RETURN(StepTensors step, b.BeginStep(inputs_));
  MOE_ASSIGN_OR_RETURN(StepBuffers buf, TakeBuffers(step.num_tokens, static_cast<int64_t>(inputs_.logit_rows.size())));
  const bool want_hidden = batch.want_hidden && holds_logits() && !all_hidden_;
  if (want_hidden) buf.hidden = buf.delta.Rows(0, buf.logits.rows);
  if (bucket > 0) {
    const GraphCache target{cache.k(0), cache.v(0), cache.shape().num_blocks, cache.shape().block_size};
    if (!(target == graph_cache_)) {
      b.ClearContextGraphs(context_->id());  // this model's graphs only: another's stay recorded
      graph_cache_ = target;
    }
    // A step that gathers the hidden states queues one more operation: a graph of its own.
    const uint64_t key = (static_cast<uint64_t>(bucket) << 32) | static_cast<uint64_t>(kv_bucket) |
                         (want_hidden ? uint64_t{1} << 63 : 0);
    MOE_RETURN_IF_ERROR(b.RunGraph(key, [&] { return RunLayers(step, buf, cache); }));
  } else {
    MOE_RETURN_IF_ERROR(RunLayers(step, buf, cache));
  }
  StepOutputs out;
  if (!holds_logits()) {
    out.logits = buf.logits.Rows(0, 0);
    return out;
  }
  const int64_t rows_out = static_cast<int64_t>(batch.logit_rows.size());
  out.logits = buf.logits.Rows(0, rows_out);
  if (want_hidden) out.hidden = buf.hidden.Rows(0, rows_out);
  if (all_hidden_) out.hidden = buf.x.Rows(0, rows);
  return out;
}

absl::Status Model::Forward(const ForwardBatch& batch, KvCache& cache, std::vector<float>* logits) {
  MOE_ASSIGN_OR_RETURN(StepOutputs outputs, ForwardOnDevice(batch, cache));
  const Tensor& out = outputs.logits;
  if (out.rows > 0) backend_->CopyToHost(out, host_logits_->data());
  MOE_RETURN_IF_ERROR(backend_->Synchronize());
  logits->assign(host_logits_->as<float>(), host_logits_->as<float>() + out.numel());
  return absl::OkStatus();
}

}  // namespace moe::runtime

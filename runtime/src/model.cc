#include "moe/runtime/model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "model_weights.h"
#include "moe/core/dtype.h"
#include "moe/core/logging.h"
#include "moe/core/status.h"
#include "moe/runtime/backend_cpu.h"
#include "moe/runtime/routing.h"

namespace moe::runtime {
namespace {

using internal::FfnWeights;
using internal::LayerWeights;

// Backend memory for one step's activations, released when the step ends.
class Workspace {
 public:
  explicit Workspace(Backend& backend) : backend_(backend) {}
  absl::StatusOr<float*> Get(int64_t floats) {
    MOE_ASSIGN_OR_RETURN(auto buffer, backend_.Allocate(floats));
    buffers_.push_back(std::move(buffer));
    return buffers_.back()->data();
  }

 private:
  Backend& backend_;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers_;
};

// out[rows x hidden] = down(silu(gate(x)) * up(x)).
absl::Status RunFfn(Backend& b, const FfnWeights& w, const float* x, int64_t rows, float* out) {
  Workspace ws(b);
  const int64_t width = w.width();
  MOE_ASSIGN_OR_RETURN(float* gate, ws.Get(rows * width));
  MOE_ASSIGN_OR_RETURN(float* up, ws.Get(rows * width));
  b.Linear(x, rows, *w.gate, nullptr, gate);
  b.Linear(x, rows, *w.up, nullptr, up);
  b.SiluMul(gate, up, rows * width, gate);
  b.Linear(gate, rows, *w.down, nullptr, out);
  return absl::OkStatus();
}

// out = shared expert FFN of x, scaled per row by sigmoid(x . gate) where the model has the gate.
absl::Status RunSharedExpert(Backend& b, const LayerWeights& lw, const float* x, int64_t rows, float* out) {
  MOE_RETURN_IF_ERROR(RunFfn(b, lw.shared, x, rows, out));
  if (lw.shared_gate == nullptr) return absl::OkStatus();
  Workspace ws(b);
  MOE_ASSIGN_OR_RETURN(float* gate, ws.Get(rows));
  b.Linear(x, rows, *lw.shared_gate, nullptr, gate);
  b.ScaleRowsBySigmoid(out, rows, lw.shared.down->rows(), gate);
  return absl::OkStatus();
}

// The plain routed-expert path: tokens grouped by expert, each expert's FFN run on its rows
// through the backend, outputs scattered back with their routing weights.
class ReferenceRoutedExperts : public RoutedExperts {
 public:
  ReferenceRoutedExperts(const ModelSpec& spec, const Model::Weights& weights, Backend& backend)
      : spec_(spec), weights_(weights), backend_(backend) {}

  absl::Status Finish() override { return absl::OkStatus(); }

  absl::Status Start(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                     const float* topk_weights, float* out) override {
    const int k = spec_.routing.top_k;
    const int64_t h = spec_.hidden_size;
    std::vector<std::vector<int32_t>> rows(spec_.routing.num_experts);
    std::vector<std::vector<float>> scales(spec_.routing.num_experts);
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int j = 0; j < k; ++j) {
        rows[topk_ids[t * k + j]].push_back(static_cast<int32_t>(t));
        scales[topk_ids[t * k + j]].push_back(topk_weights[t * k + j]);
      }
    }
    size_t most = 0;
    for (const auto& r : rows) most = std::max(most, r.size());
    Workspace ws(backend_);
    MOE_ASSIGN_OR_RETURN(float* x, ws.Get(most * h));
    MOE_ASSIGN_OR_RETURN(float* y, ws.Get(most * h));
    const std::vector<float> zeros(num_tokens * h, 0.0f);
    backend_.CopyFromHost(zeros.data(), out, num_tokens * h);
    const LayerWeights& lw = weights_.layers[layer];
    for (int e = 0; e < spec_.routing.num_experts; ++e) {
      const int64_t n = static_cast<int64_t>(rows[e].size());
      if (n == 0) continue;
      backend_.GatherRows(hidden, h, rows[e].data(), n, x);
      MOE_RETURN_IF_ERROR(RunFfn(backend_, lw.experts[e], x, n, y));
      backend_.ScatterAddRows(y, h, rows[e].data(), scales[e].data(), n, out);
    }
    return absl::OkStatus();
  }

 private:
  const ModelSpec& spec_;
  const Model::Weights& weights_;
  Backend& backend_;
};

// Routed experts through the CPU expert pool, which numbers MoE layers consecutively.
class PoolRoutedExperts : public RoutedExperts {
 public:
  PoolRoutedExperts(experts::ExpertPool& pool, const ModelSpec& spec) : pool_(pool) {
    for (int l = 0, moe = 0; l < spec.num_layers; ++l) moe_index_.push_back(spec.IsMoeLayer(l) ? moe++ : -1);
  }
  absl::Status Start(int layer, const float* hidden, int64_t num_tokens, const int32_t* topk_ids,
                     const float* topk_weights, float* out) override {
    MOE_ASSIGN_OR_RETURN(ticket_, pool_.Submit(moe_index_[layer], hidden, num_tokens, topk_ids, topk_weights, out));
    return absl::OkStatus();
  }
  absl::Status Finish() override { return pool_.Wait(ticket_); }

 private:
  experts::ExpertPool& pool_;
  std::vector<int> moe_index_;
  experts::ExpertPool::Ticket ticket_;
};

// Names of one routed expert's tensors in the checkpoint.
struct ExpertTensorNames {
  std::string gate, up, down;
};
ExpertTensorNames ExpertNames(const ModelSpec& spec, int layer, int expert) {
  const bool mixtral = spec.arch == Architecture::kMixtral;
  const std::string p = absl::StrCat("model.layers.", layer, mixtral ? ".block_sparse_moe" : ".mlp", ".experts.",
                                     expert, ".");
  if (mixtral) return {p + "w1.weight", p + "w3.weight", p + "w2.weight"};
  return {p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"};
}

absl::StatusOr<std::unique_ptr<experts::ExpertPool>> CreatePool(const ModelSpec& spec, const WeightSource& source,
                                                                experts::ExpertPoolOptions options,
                                                                const std::string& model_dir) {
  std::vector<int> moe_layers;
  for (int l = 0; l < spec.num_layers; ++l) {
    if (spec.IsMoeLayer(l)) moe_layers.push_back(l);
  }
  experts::ExpertShape shape;
  shape.num_layers = static_cast<int>(moe_layers.size());
  shape.num_experts = spec.routing.num_experts;
  shape.top_k = spec.routing.top_k;
  shape.hidden = spec.hidden_size;
  shape.intermediate = spec.moe_intermediate_size;
  std::error_code ec;
  const auto canonical = std::filesystem::weakly_canonical(model_dir, ec);
  options.model_id = ec ? model_dir : canonical.string();
  return experts::ExpertPool::Create(
      shape, options, [&](int moe_layer, int expert) -> absl::StatusOr<experts::ExpertWeights> {
        const ExpertTensorNames names = ExpertNames(spec, moe_layers[moe_layer], expert);
        MOE_ASSIGN_OR_RETURN(core::TensorView gate, source.Get(names.gate));
        MOE_ASSIGN_OR_RETURN(core::TensorView up, source.Get(names.up));
        MOE_ASSIGN_OR_RETURN(core::TensorView down, source.Get(names.down));
        return experts::ExpertWeights{gate, up, down};
      });
}

}  // namespace

Model::~Model() = default;

std::vector<float> RopeInverseFrequencies(const ModelSpec& spec, RopeFrequencies precision) {
  const int half = spec.rotary_dim / 2;
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(spec.rotary_dim);
    inv_freq[i] = 1.0f / std::pow(spec.rope_theta, exponent);
    if (precision == RopeFrequencies::kBFloat16) inv_freq[i] = core::Bf16ToFloat(core::FloatToBf16(inv_freq[i]));
  }
  return inv_freq;
}

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& model_dir, const ModelOptions& options,
                                                   std::shared_ptr<Backend> backend) {
  std::unique_ptr<Model> model(new Model());
  MOE_ASSIGN_OR_RETURN(model->spec_, LoadModelSpec(model_dir));
  model->rope_inv_freq_ = RopeInverseFrequencies(model->spec_, options.rope_frequencies);
  model->backend_ = backend != nullptr ? std::move(backend) : std::shared_ptr<Backend>(CreateCpuBackend(options.threads));
  MOE_ASSIGN_OR_RETURN(model->source_, OpenSafetensors(model_dir));
  const bool pool = options.experts == RoutedExpertsMode::kPool;
  MOE_ASSIGN_OR_RETURN(model->weights_, internal::LoadWeights(model->spec_, *model->source_, *model->backend_,
                                                              /*prepare_routed_experts=*/!pool));
  if (pool && model->spec_.num_moe_layers() > 0) {
    experts::ExpertPoolOptions pool_options = options.pool;
    pool_options.linger_us =
        options.expert_linger_us.value_or(model->backend_->ComputesOnHostCores() ? 0 : pool_options.linger_us);
    MOE_ASSIGN_OR_RETURN(model->pool_, CreatePool(model->spec_, *model->source_, pool_options, model_dir));
    model->routed_experts_ = std::make_unique<PoolRoutedExperts>(*model->pool_, model->spec_);
  } else {
    model->routed_experts_ =
        std::make_unique<ReferenceRoutedExperts>(model->spec_, *model->weights_, *model->backend_);
  }
  MOE_LOG(kDebug) << "loaded " << model->spec_.Summary() << " on " << model->backend_->name();
  return model;
}

absl::StatusOr<std::unique_ptr<KvCache>> Model::NewKvCache(int num_blocks, int block_size) {
  KvCacheShape shape;
  shape.num_layers = spec_.num_layers;
  shape.num_blocks = num_blocks;
  shape.block_size = block_size;
  shape.num_kv_heads = spec_.num_kv_heads;
  shape.head_dim = spec_.head_dim;
  return KvCache::Create(*backend_, shape);
}

absl::Status Model::CheckBatch(const ForwardBatch& batch, const KvCache& cache) const {
  const int64_t rows = static_cast<int64_t>(batch.token_ids.size());
  if (rows == 0) return absl::InvalidArgumentError("empty batch: no tokens");
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
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s, ": chunk of ", c.num_tokens,
                                                     " tokens at position ", c.first_position));
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
    if (r < 0 || r >= rows) return absl::InvalidArgumentError(absl::StrCat("logit row ", r, " outside [0, ", rows, ")"));
  }
  return absl::OkStatus();
}

absl::Status Model::RunMoe(int layer, const float* h, int64_t rows, float* out) {
  Backend& b = *backend_;
  const LayerWeights& lw = weights_->layers[layer];
  const RoutingSpec& r = spec_.routing;
  Workspace ws(b);
  // Router (small, replicated): logits to the host, top-k there.
  MOE_ASSIGN_OR_RETURN(float* router_logits, ws.Get(rows * r.num_experts));
  b.Linear(h, rows, *lw.router, nullptr, router_logits);
  std::vector<float> host_logits(rows * r.num_experts);
  b.CopyToHost(router_logits, host_logits.data(), host_logits.size());
  std::vector<int32_t> topk_ids(rows * r.top_k);
  std::vector<float> topk_weights(rows * r.top_k);
  RouteTokens(r, host_logits.data(), rows, lw.correction_bias.empty() ? nullptr : lw.correction_bias.data(),
              topk_ids.data(), topk_weights.data());
  // The routed experts start; the shared expert runs meanwhile, into its own buffer.
  const int64_t hidden = spec_.hidden_size;
  float* shared = nullptr;
  if (spec_.shared_expert_intermediate_size > 0) {
    MOE_ASSIGN_OR_RETURN(shared, ws.Get(rows * hidden));
  }
  MOE_RETURN_IF_ERROR(routed_experts_->Start(layer, h, rows, topk_ids.data(), topk_weights.data(), out));
  const absl::Status shared_status = shared != nullptr ? RunSharedExpert(b, lw, h, rows, shared) : absl::OkStatus();
  MOE_RETURN_IF_ERROR(routed_experts_->Finish());
  MOE_RETURN_IF_ERROR(shared_status);
  if (shared != nullptr) b.Add(out, shared, rows * hidden);
  return absl::OkStatus();
}

absl::Status Model::Forward(const ForwardBatch& batch, KvCache& cache, std::vector<float>* logits) {
  MOE_RETURN_IF_ERROR(CheckBatch(batch, cache));
  const ModelSpec& s = spec_;
  Backend& b = *backend_;
  const int64_t rows = static_cast<int64_t>(batch.token_ids.size());
  const int64_t hidden = s.hidden_size;
  const int64_t q_width = int64_t{s.num_heads} * s.head_dim;
  const int64_t kv_width = int64_t{s.num_kv_heads} * s.head_dim;

  std::vector<int32_t> positions;
  positions.reserve(rows);
  for (const SequenceChunk& c : batch.sequences) {
    for (int i = 0; i < c.num_tokens; ++i) positions.push_back(static_cast<int32_t>(c.first_position + i));
  }

  Workspace ws(b);
  MOE_ASSIGN_OR_RETURN(float* x, ws.Get(rows * hidden));  // the residual stream
  MOE_ASSIGN_OR_RETURN(float* h, ws.Get(rows * hidden));
  MOE_ASSIGN_OR_RETURN(float* q, ws.Get(rows * q_width));
  MOE_ASSIGN_OR_RETURN(float* k, ws.Get(rows * kv_width));
  MOE_ASSIGN_OR_RETURN(float* v, ws.Get(rows * kv_width));
  MOE_ASSIGN_OR_RETURN(float* attn, ws.Get(rows * q_width));
  MOE_ASSIGN_OR_RETURN(float* block_out, ws.Get(rows * hidden));

  b.Embed(*weights_->embed, batch.token_ids.data(), rows, x);
  for (int layer = 0; layer < s.num_layers; ++layer) {
    const LayerWeights& lw = weights_->layers[layer];
    // Attention block.
    b.RmsNorm(x, *lw.input_norm, s.rms_norm_eps, rows, hidden, h);
    b.Linear(h, rows, *lw.q, lw.q_bias.get(), q);
    b.Linear(h, rows, *lw.k, lw.k_bias.get(), k);
    b.Linear(h, rows, *lw.v, lw.v_bias.get(), v);
    if (s.qk_norm) {
      b.RmsNorm(q, *lw.q_norm, s.rms_norm_eps, rows * s.num_heads, s.head_dim, q);
      b.RmsNorm(k, *lw.k_norm, s.rms_norm_eps, rows * s.num_kv_heads, s.head_dim, k);
    }
    b.Rope(q, rows, s.num_heads, s.head_dim, s.rotary_dim, rope_inv_freq_.data(), positions.data());
    b.Rope(k, rows, s.num_kv_heads, s.head_dim, s.rotary_dim, rope_inv_freq_.data(), positions.data());
    AttentionArgs args;
    args.q = q;
    args.k = k;
    args.v = v;
    args.out = attn;
    args.num_tokens = rows;
    args.num_heads = s.num_heads;
    args.num_kv_heads = s.num_kv_heads;
    args.head_dim = s.head_dim;
    args.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    args.seqs = batch.sequences.data();
    args.num_seqs = static_cast<int>(batch.sequences.size());
    args.cache = &cache;
    args.layer = layer;
    b.Attention(args);
    b.Linear(attn, rows, *lw.o, nullptr, block_out);
    b.Add(x, block_out, rows * hidden);
    // FFN block: routed experts (plus shared ones) or a dense SwiGLU.
    b.RmsNorm(x, *lw.post_attention_norm, s.rms_norm_eps, rows, hidden, h);
    if (s.IsMoeLayer(layer)) {
      MOE_RETURN_IF_ERROR(core::Annotate(RunMoe(layer, h, rows, block_out), absl::StrCat("layer ", layer)));
    } else {
      MOE_RETURN_IF_ERROR(RunFfn(b, lw.dense, h, rows, block_out));
    }
    b.Add(x, block_out, rows * hidden);
  }

  // Only the rows that want logits go through the final norm and the LM head.
  const int64_t out_rows = static_cast<int64_t>(batch.logit_rows.size());
  logits->assign(out_rows * s.vocab_size, 0.0f);
  if (out_rows == 0) return absl::OkStatus();
  MOE_ASSIGN_OR_RETURN(float* last, ws.Get(out_rows * hidden));
  MOE_ASSIGN_OR_RETURN(float* out, ws.Get(out_rows * s.vocab_size));
  b.GatherRows(x, hidden, batch.logit_rows.data(), out_rows, last);
  b.RmsNorm(last, *weights_->final_norm, s.rms_norm_eps, out_rows, hidden, last);
  b.Linear(last, out_rows, *weights_->lm_head, nullptr, out);
  b.CopyToHost(out, logits->data(), logits->size());
  return absl::OkStatus();
}

}  // namespace moe::runtime

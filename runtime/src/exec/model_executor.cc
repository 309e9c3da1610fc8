#include "moe/runtime/model_executor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"
#include "moe/runtime/sampler.h"

namespace moe::runtime {
namespace {

// What Forward does not check: the sampling half of the plan, which a worker receives from
// another process.
absl::Status CheckSampleRows(const StepPlan& plan) {
  if (plan.samples.size() != plan.batch.logit_rows.size()) {
    return absl::InvalidArgumentError(absl::StrCat("step plan: ", plan.samples.size(), " sample rows for ",
                                                   plan.batch.logit_rows.size(), " logit rows"));
  }
  for (size_t i = 0; i < plan.samples.size(); ++i) {
    const SampleRow& row = plan.samples[i];
    if (row.logprobs < 0) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: sample row ", i, ": logprobs ", row.logprobs));
    }
    if (row.sampling.penalized() && (row.history.size() != row.position || row.prompt_len < 0 ||
                                     static_cast<size_t>(row.prompt_len) > row.history.size())) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: sample row ", i, " is penalized but its history has ",
                                                     row.history.size(), " tokens for position ", row.position,
                                                     " (prompt_len ", row.prompt_len, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

ModelInfo ModelInfoFor(const ModelSpec& spec) {
  ModelInfo info;
  info.architecture = spec.model_type;
  info.vocab_size = spec.vocab_size;
  info.max_position_embeddings = spec.max_position_embeddings;
  info.eos_token_ids = spec.eos_token_ids;
  info.num_experts = spec.routing.num_experts;
  info.experts_per_token = spec.routing.top_k;
  return info;
}

absl::StatusOr<std::unique_ptr<ModelExecutor>> ModelExecutor::Create(Model& model, int num_blocks, int block_size) {
  MOE_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, model.NewKvCache(num_blocks, block_size));
  return std::unique_ptr<ModelExecutor>(new ModelExecutor(model, std::move(cache)));
}

ModelExecutor::ModelExecutor(Model& model, std::unique_ptr<KvCache> cache)
    : model_(model),
      cache_(std::move(cache)),
      info_(ModelInfoFor(model.spec())),
      // Built once: Describe may be called while another thread runs a step on the model.
      description_(absl::StrCat(
          model.spec().model_type, " in this process on ", model.backend().name(), "; ",
          model.expert_pool() != nullptr ? model.expert_pool()->Describe() : "routed experts on the reference path",
          "; KV cache ", cache_->shape().num_blocks, " blocks of ", cache_->shape().block_size, " positions")) {}

KvCapacity ModelExecutor::kv_capacity() const {
  return KvCapacity{cache_->shape().num_blocks, cache_->shape().block_size};
}

int32_t ModelExecutor::Sample(const SampleRow& row, const float* logits, int vocab) {
  // Counter-based: the token depends on the row's key, not on what was drawn before.
  const SampleKey key{row.seed, row.sequence, row.position};
  if (!row.sampling.penalized()) return SampleToken(logits, vocab, row.sampling, key);
  penalized_.assign(logits, logits + vocab);
  const int32_t* history = row.history.data();
  ApplyPenalties(row.sampling, history, row.prompt_len, history + row.prompt_len,
                 static_cast<int>(row.history.size()) - row.prompt_len, penalized_.data(), vocab);
  return SampleToken(penalized_.data(), vocab, row.sampling, key);
}

absl::StatusOr<StepResult> ModelExecutor::Execute(const StepPlan& plan) { return Run(plan, nullptr); }

absl::StatusOr<StepResult> ModelExecutor::ExecuteOnHost(const StepPlan& plan, std::vector<float>* logits) {
  return Run(plan, logits);
}

absl::StatusOr<StepResult> ModelExecutor::Run(const StepPlan& plan, std::vector<float>* host_logits) {
  MOE_RETURN_IF_ERROR(CheckSampleRows(plan));
  MOE_RETURN_IF_ERROR(CheckDrafts(plan));
  const ForwardBatch* batch = &plan.batch;
  ForwardBatch with_hidden;
  if (keep_hidden_) {
    with_hidden = plan.batch;
    with_hidden.want_all_hidden = true;
    batch = &with_hidden;
  }
  MOE_ASSIGN_OR_RETURN(StepOutputs out, model_.ForwardOnDevice(*batch, *cache_));
  if (keep_hidden_) {
    hidden_.resize(static_cast<size_t>(out.hidden.numel()));
    if (out.hidden) model_.backend().CopyToHost(out.hidden, hidden_.data());
    MOE_RETURN_IF_ERROR(model_.backend().Synchronize());
  }
  if (!model_.parallel().answers()) {
    // A layer split's stage before the last, or a tensor split's rank above 0: its share of the
    // step is done once it is queued; the answering rank samples.
    MOE_RETURN_IF_ERROR(model_.backend().Synchronize());
    if (host_logits != nullptr) host_logits->clear();
    return StepResult{};
  }
  MOE_ASSIGN_OR_RETURN(std::vector<SampledToken> sampled, SampleLogitRows(plan, out.logits, host_logits != nullptr));
  if (host_logits != nullptr) host_logits->swap(logits_);
  return AcceptDrafts(plan, std::move(sampled));
}

absl::StatusOr<std::vector<SampledToken>> ModelExecutor::SampleLogitRows(const StepPlan& plan,
                                                                         const Tensor& device_logits, bool on_host) {
  const int vocab = info_.vocab_size;
  std::vector<SampledToken> tokens(plan.samples.size());
  // Masked rows (structured outputs) are sampled on the host.
  for (const SampleRow& row : plan.samples) on_host = on_host || row.allowed.valid();
  // On a backend that samples (a GPU), the logits never leave it: only the tokens come back.
  std::vector<SampleInput> inputs(plan.samples.size());
  for (size_t i = 0; i < plan.samples.size(); ++i) {
    const SampleRow& row = plan.samples[i];
    inputs[i] = SampleInput{&row.sampling, SampleKey{row.seed, row.sequence, row.position}, &row.history,
                            row.prompt_len, row.logprobs};
  }
  std::vector<SampleOutput> outputs;
  const absl::Status on_device = on_host ? absl::UnimplementedError("sampled on the host")
                                         : model_.backend().SampleRows(device_logits, inputs, &outputs);
  if (on_device.ok()) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].non_finite_at >= 0) {
        std::vector<float> row(vocab);
        model_.backend().CopyToHost(device_logits.Rows(static_cast<int64_t>(i), 1), row.data());
        MOE_RETURN_IF_ERROR(model_.backend().Synchronize());
        tokens[i].error = CheckLogitsFinite(row.data(), 1, vocab);
        continue;
      }
      tokens[i].token = outputs[i].token;
      if (plan.samples[i].logprobs > 0) tokens[i].logprobs = TokenLogprobs{outputs[i].logprob, outputs[i].top};
    }
    return tokens;
  }
  if (on_device.code() != absl::StatusCode::kUnimplemented &&
      on_device.code() != absl::StatusCode::kResourceExhausted) {
    return on_device;
  }
  // The host samples: the CPU backend, or a step with more penalty history than the GPU keeps.
  logits_.resize(static_cast<size_t>(device_logits.numel()));
  if (device_logits.rows > 0) model_.backend().CopyToHost(device_logits, logits_.data());
  MOE_RETURN_IF_ERROR(model_.backend().Synchronize());
  for (size_t i = 0; i < plan.samples.size(); ++i) {
    const SampleRow& row = plan.samples[i];
    const float* logits = logits_.data() + i * vocab;
    if (absl::Status finite = CheckLogitsFinite(logits, 1, vocab); !finite.ok()) {
      tokens[i].error = std::move(finite);
      continue;
    }
    if (row.allowed.valid()) {
      const std::shared_ptr<const TokenMask> mask = row.allowed.get();
      masked_.assign(logits, logits + vocab);
      if (mask != nullptr) mask->Apply(masked_.data(), vocab);
      if (mask != nullptr && mask->Count(vocab) == 0) {
        tokens[i].error = absl::InternalError("structured output: the grammar allows no token here");
        continue;
      }
      tokens[i].token = Sample(row, masked_.data(), vocab);
    } else {
      tokens[i].token = Sample(row, logits, vocab);
    }
    // Log-probabilities of the model's own distribution, before penalties and sampling filters.
    if (row.logprobs > 0) tokens[i].logprobs = ComputeLogprobs(logits, vocab, tokens[i].token, row.logprobs);
  }
  return tokens;
}

}  // namespace moe::runtime

#include "moe_block.h"

#include <chrono>
#include <filesystem>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moe/core/status.h"

namespace moe::runtime::internal {
namespace {

// Each MoE layer's routed experts where the load put them: in the pool (the layers of
// `pool_layers`, which the pool numbers consecutively) or on the backend (MoeExperts). A pool
// layer runs on the caller's thread and the pool's when the backend's tensors are host memory (the
// CPU backend), and through the backend's host calls otherwise (a GPU: hybrid execution).
class LayerExperts : public RoutedExperts, public HostExperts {
 public:
  LayerExperts(Backend& backend, const Model::Weights& weights, const ModelSpec& spec, experts::ExpertPool* pool,
               const std::vector<int>& pool_layers)
      : backend_(backend), weights_(weights), pool_(pool), pool_index_(spec.num_layers, -1) {
    for (size_t i = 0; i < pool_layers.size(); ++i) pool_index_[pool_layers[i]] = static_cast<int>(i);
  }

  absl::Status Start(int layer, const Tensor& hidden, const Tensor& ids, const Tensor& weights,
                     const Tensor& out) override {
    mode_ = pool_index_[layer] < 0 ? Mode::kBackend : backend_.HostAddressable() ? Mode::kPool : Mode::kHost;
    switch (mode_) {
      case Mode::kBackend:
        backend_.MoeExperts(hidden, ids, weights, *weights_.layers[layer].experts, out);
        return absl::OkStatus();
      case Mode::kPool: {
        MOE_ASSIGN_OR_RETURN(ticket_, pool_->Submit(pool_index_[layer], hidden.as<float>(), hidden.rows,
                                                    ids.as<int32_t>(), weights.as<float>(), out.as<float>()));
        return absl::OkStatus();
      }
      case Mode::kHost:
        return backend_.StartHostExperts(*this, layer, pool_index_[layer], hidden, ids, weights, out);
    }
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    switch (mode_) {
      case Mode::kBackend:
        return absl::OkStatus();
      case Mode::kPool:
        return pool_->Wait(ticket_);
      case Mode::kHost:
        return backend_.FinishHostExperts();
    }
    return absl::OkStatus();
  }

  // On the backend's host thread, in stream order.
  absl::Status Compute(int layer, const float* hidden, int64_t rows, const int32_t* ids, const float* weights,
                       float* out) override {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = pool_->Compute(pool_index_[layer], hidden, rows, ids, weights, out);
    const auto end = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(timing_mu_);
    ++timing_.calls;
    timing_.compute_seconds += std::chrono::duration<double>(end - start).count();
    if (layer > last_layer_ && last_end_) {
      timing_.between_seconds += std::chrono::duration<double>(start - *last_end_).count();
      ++timing_.betweens;
    }
    last_layer_ = layer;
    last_end_ = end;
    return s;
  }

  HostExpertsTiming timing() const override {
    std::lock_guard<std::mutex> lock(timing_mu_);
    return timing_;
  }
  void ResetTiming() override {
    std::lock_guard<std::mutex> lock(timing_mu_);
    timing_ = HostExpertsTiming{};
    last_layer_ = -1;
    last_end_.reset();
  }

 private:
  enum class Mode { kBackend, kPool, kHost };
  Backend& backend_;
  const Model::Weights& weights_;
  experts::ExpertPool* pool_;
  std::vector<int> pool_index_;  // per model layer: its index in the pool, or -1
  Mode mode_ = Mode::kBackend;
  experts::ExpertPool::Ticket ticket_;
  mutable std::mutex timing_mu_;
  HostExpertsTiming timing_;
  int last_layer_ = -1;
  std::optional<std::chrono::steady_clock::time_point> last_end_;
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

}  // namespace

void RunFfn(Backend& b, const FfnWeights& w, const Tensor& x, const FfnBuffers& buf, const Tensor& out) {
  const int64_t rows = x.rows, width = w.width();
  const Tensor gate_up = buf.gate_up.Rows(0, rows).Reshaped(rows, 2 * width);
  const Tensor act = buf.act.Rows(0, rows).Reshaped(rows, width);
  b.Linear(x, *w.gate_up, nullptr, gate_up);
  b.SiluMul(gate_up, act);
  b.Linear(act, *w.down, nullptr, out);
}

absl::Status RunMoe(Backend& b, const ModelSpec& spec, const LayerWeights& lw, RoutedExperts& routed, int layer,
                    const Tensor& x, const FfnBuffers& buf, const Tensor& out) {
  const int64_t rows = x.rows;
  const Tensor logits = buf.router_logits.Rows(0, rows);
  const Tensor ids = buf.ids.Rows(0, rows);
  const Tensor weights = buf.weights.Rows(0, rows);
  b.Linear(x, *lw.router, nullptr, logits);
  b.Route(logits, spec.routing, lw.correction_bias.get(), ids, weights);
  // The routed experts start; the shared expert runs meanwhile, into its own buffer. A pool layer
  // whose most used experts the backend holds too sends each pick to one side, both at once.
  const bool split = lw.backend_index != nullptr;
  const Tensor split_out = buf.split_out.Rows(0, rows);
  if (split) {
    const Tensor host_ids = buf.split_host_ids.Rows(0, rows), host_weights = buf.split_host_weights.Rows(0, rows);
    const Tensor backend_ids = buf.split_backend_ids.Rows(0, rows);
    const Tensor backend_weights = buf.split_backend_weights.Rows(0, rows);
    b.SplitRouting(ids, weights, lw.backend_index->tensor(), host_ids, host_weights, backend_ids, backend_weights);
    MOE_RETURN_IF_ERROR(routed.Start(layer, x, host_ids, host_weights, out));
    b.MoeExperts(x, backend_ids, backend_weights, *lw.experts, split_out);
  } else {
    MOE_RETURN_IF_ERROR(routed.Start(layer, x, ids, weights, out));
  }
  const bool shared = spec.shared_expert_intermediate_size > 0;
  const Tensor shared_out = buf.shared.Rows(0, rows);
  if (shared) {
    RunFfn(b, lw.shared, x, buf, shared_out);
    if (lw.shared_gate != nullptr) b.Linear(x, *lw.shared_gate, nullptr, buf.shared_gate.Rows(0, rows));
  }
  MOE_RETURN_IF_ERROR(routed.Finish());
  if (split) b.AddSharedExpert(out, split_out, nullptr);
  if (shared) {
    const Tensor gate = buf.shared_gate.Rows(0, rows);
    b.AddSharedExpert(out, shared_out, lw.shared_gate != nullptr ? &gate : nullptr);
  }
  return absl::OkStatus();
}

std::unique_ptr<RoutedExperts> MakeRoutedExperts(Backend& backend, const Model::Weights& weights, const ModelSpec& spec,
                                                 experts::ExpertPool* pool, const std::vector<int>& pool_layers) {
  return std::make_unique<LayerExperts>(backend, weights, spec, pool, pool_layers);
}

absl::StatusOr<std::unique_ptr<experts::ExpertPool>> CreatePool(const ModelSpec& spec, const WeightSource& source,
                                                                experts::ExpertPoolOptions options,
                                                                const std::string& model_dir,
                                                                const std::vector<int>& moe_layers) {
  experts::ExpertShape shape;
  shape.num_layers = static_cast<int>(moe_layers.size());
  shape.num_experts = spec.routing.num_experts;
  shape.top_k = spec.routing.top_k;
  shape.hidden = spec.hidden_size;
  shape.intermediate = spec.moe_intermediate_size;
  std::error_code ec;
  const auto canonical = std::filesystem::weakly_canonical(model_dir, ec);
  options.model_id = ec ? model_dir : canonical.string();
  // A pool of some layers only is another segment than the whole model's.
  if (static_cast<int>(moe_layers.size()) != spec.num_moe_layers()) {
    options.model_id += " layers " + absl::StrJoin(moe_layers, ",");
  }
  return experts::ExpertPool::Create(
      shape, options, [&](int moe_layer, int expert) -> absl::StatusOr<experts::ExpertWeights> {
        const ExpertTensorNames names = ExpertNames(spec, moe_layers[moe_layer], expert);
        MOE_ASSIGN_OR_RETURN(core::TensorView gate, source.Get(names.gate));
        MOE_ASSIGN_OR_RETURN(core::TensorView up, source.Get(names.up));
        MOE_ASSIGN_OR_RETURN(core::TensorView down, source.Get(names.down));
        return experts::ExpertWeights{gate, up, down};
      });
}

}  // namespace moe::runtime::internal

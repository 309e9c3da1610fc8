#include "moe_block.h"

#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"

namespace moe::runtime::internal {
namespace {

class BackendExperts : public RoutedExperts {
 public:
  BackendExperts(Backend& backend, const Model::Weights& weights) : backend_(backend), weights_(weights) {}
  absl::Status Start(int layer, const Tensor& hidden, const Tensor& ids, const Tensor& weights,
                     const Tensor& out) override {
    backend_.MoeExperts(hidden, ids, weights, *weights_.layers[layer].experts, out);
    return absl::OkStatus();
  }
  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  Backend& backend_;
  const Model::Weights& weights_;
};

// The pool numbers MoE layers consecutively.
class PoolExperts : public RoutedExperts {
 public:
  PoolExperts(experts::ExpertPool& pool, const ModelSpec& spec) : pool_(pool) {
    for (int l = 0, moe = 0; l < spec.num_layers; ++l) moe_index_.push_back(spec.IsMoeLayer(l) ? moe++ : -1);
  }
  absl::Status Start(int layer, const Tensor& hidden, const Tensor& ids, const Tensor& weights,
                     const Tensor& out) override {
    MOE_ASSIGN_OR_RETURN(ticket_, pool_.Submit(moe_index_[layer], hidden.as<float>(), hidden.rows,
                                               ids.as<int32_t>(), weights.as<float>(), out.as<float>()));
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
  // The routed experts start; the shared expert runs meanwhile, into its own buffer.
  MOE_RETURN_IF_ERROR(routed.Start(layer, x, ids, weights, out));
  const bool shared = spec.shared_expert_intermediate_size > 0;
  const Tensor shared_out = buf.shared.Rows(0, rows);
  if (shared) {
    RunFfn(b, lw.shared, x, buf, shared_out);
    if (lw.shared_gate != nullptr) b.Linear(x, *lw.shared_gate, nullptr, buf.shared_gate.Rows(0, rows));
  }
  MOE_RETURN_IF_ERROR(routed.Finish());
  if (shared) {
    const Tensor gate = buf.shared_gate.Rows(0, rows);
    b.AddSharedExpert(out, shared_out, lw.shared_gate != nullptr ? &gate : nullptr);
  }
  return absl::OkStatus();
}

std::unique_ptr<RoutedExperts> BackendRoutedExperts(Backend& backend, const Model::Weights& weights) {
  return std::make_unique<BackendExperts>(backend, weights);
}

std::unique_ptr<RoutedExperts> PoolRoutedExperts(experts::ExpertPool& pool, const ModelSpec& spec) {
  return std::make_unique<PoolExperts>(pool, spec);
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

}  // namespace moe::runtime::internal

#include "model/moe_block.h"

#include <chrono>
#include <filesystem>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cpu/kernels.h"
#include "moe/core/files_fingerprint.h"
#include "moe/core/status.h"
#include "moe/experts/gguf_types.h"
#include "moe/runtime/routing.h"

namespace moe::runtime::internal {
namespace {

// Each MoE layer's routed experts where the load put them: in the pool (the layers of
// `pool_layers`, which the pool numbers consecutively) or on the backend (MoeExperts). A pool
// layer runs on the caller's thread and the pool's when the backend's tensors are host memory (the
// CPU backend), and through the backend's host calls otherwise (a GPU: hybrid execution).
class RoutedExpertsDispatch : public RoutedExperts, public HostExpertCompute {
 public:
  RoutedExpertsDispatch(Backend& backend, const Model::Weights& weights, const ModelSpec& spec,
                        experts::ExpertPool* pool, const std::vector<int>& pool_layers, int defer,
                        const TensorShard* shard)
      : backend_(backend),
        weights_(weights),
        pool_(pool),
        pool_index_(spec.num_all_layers(), -1),  // an MTP head's layer follows the model's
        top_k_(spec.routing.top_k),
        hidden_(spec.hidden_size),
        defer_(defer),
        shard_(shard) {
    for (size_t i = 0; i < pool_layers.size(); ++i) pool_index_[pool_layers[i]] = static_cast<int>(i);
  }
  ~RoutedExpertsDispatch() override { DropDeferred(); }

  absl::Status Start(int layer, const Tensor& hidden, const Tensor& ids, const Tensor& weights,
                     const Tensor& out) override {
    mode_ = pool_index_[layer] < 0 ? Mode::kBackend : backend_.HostAddressable() ? Mode::kPool : Mode::kHost;
    switch (mode_) {
      case Mode::kBackend:
        backend_.MoeExperts(hidden, ids, weights, *weights_.layers[layer].experts, out);
        return absl::OkStatus();
      case Mode::kPool: {
        // The previous layer's deferred picks finish first (the pool runs one call at a time).
        MOE_RETURN_IF_ERROR(AwaitDeferred(layer));
        const int32_t* now_ids = ids.as<int32_t>();
        const float* now_weights = weights.as<float>();
        KeepOwned(&now_ids, &now_weights, hidden.rows);
        if (Defers(layer)) {
          SplitDeferred(now_ids, now_weights, hidden.rows);
          now_ids = now_ids_.data();
          now_weights = now_weights_.data();
        }
        layer_ = layer;
        call_ = {hidden.as<float>(), hidden.rows, out.as<float>()};
        MOE_ASSIGN_OR_RETURN(ticket_, pool_->Submit(pool_index_[layer], hidden.as<float>(), hidden.rows, now_ids,
                                                    now_weights, out.as<float>()));
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
        MOE_RETURN_IF_ERROR(pool_->Wait(ticket_));
        return AddAndDefer(layer_, call_.hidden, call_.rows, call_.out);
      case Mode::kHost:
        return backend_.FinishHostExperts();
    }
    return absl::OkStatus();
  }

  // On the backend's host thread, in stream order.
  absl::Status Compute(int layer, const float* hidden, int64_t rows, const int32_t* ids, const float* weights,
                       float* out) override {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = AwaitDeferred(layer);
    KeepOwned(&ids, &weights, rows);
    if (s.ok() && Defers(layer)) {
      SplitDeferred(ids, weights, rows);
      ids = now_ids_.data();
      weights = now_weights_.data();
    }
    if (s.ok()) s = pool_->Compute(pool_index_[layer], hidden, rows, ids, weights, out);
    if (s.ok()) s = AddAndDefer(layer, hidden, rows, out);
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

  HostExpertComputeTiming timing() const override {
    std::lock_guard<std::mutex> lock(timing_mu_);
    return timing_;
  }
  void ResetTiming() override {
    std::lock_guard<std::mutex> lock(timing_mu_);
    timing_ = HostExpertComputeTiming{};
    last_layer_ = -1;
    last_end_.reset();
  }

 private:
  enum class Mode { kBackend, kPool, kHost };

  // A tensor split's rank computes the experts it owns: the others' slots are skipped.
  void KeepOwned(const int32_t** ids, const float** weights, int64_t rows) {
    if (shard_ == nullptr) return;
    const size_t slots = static_cast<size_t>(rows) * top_k_;
    owned_ids_.assign(*ids, *ids + slots);
    owned_weights_.assign(*weights, *weights + slots);
    for (size_t i = 0; i < slots; ++i) {
      if (owned_ids_[i] >= 0 && !shard_->OwnsExpert(owned_ids_[i])) {
        owned_ids_[i] = experts::kSkippedSlot;
        owned_weights_[i] = 0.0f;
      }
    }
    *ids = owned_ids_.data();
    *weights = owned_weights_.data();
  }

  // Expert deferral: a pool layer followed by another defers each token's `defer_` lowest-weighted
  // picks; they run in the pool while the next layer's attention runs, and their sum is added to
  // that layer's routed experts' output. The last pool layer of a run of them defers nothing, so
  // nothing is left over at the end of a step.
  bool Defers(int layer) const {
    return defer_ > 0 && layer + 1 < static_cast<int>(pool_index_.size()) && pool_index_[layer + 1] >= 0;
  }
  void SplitDeferred(const int32_t* ids, const float* weights, int64_t rows) {
    const size_t slots = static_cast<size_t>(rows) * top_k_;
    now_ids_.resize(slots);
    now_weights_.resize(slots);
    later_ids_.resize(slots);
    later_weights_.resize(slots);
    for (int64_t r = 0; r < rows; ++r) {
      SplitDeferredPicks(ids + r * top_k_, weights + r * top_k_, top_k_, defer_, now_ids_.data() + r * top_k_,
                         now_weights_.data() + r * top_k_, later_ids_.data() + r * top_k_,
                         later_weights_.data() + r * top_k_);
    }
  }
  // Before layer `layer`'s call: waits for the deferred picks in flight. They belong to this
  // layer only if they came from the one before it in the same step; anything else (a step that
  // failed half way) is dropped.
  absl::Status AwaitDeferred(int layer) {
    deferred_.ready = false;
    if (!deferred_.in_flight) return absl::OkStatus();
    deferred_.in_flight = false;
    absl::Status s = pool_->Wait(deferred_.ticket);
    deferred_.ready = s.ok() && deferred_.layer + 1 == layer;
    return s;
  }
  // After layer `layer`'s call wrote `out`: adds the previous layer's deferred sum, then starts this
  // layer's deferred picks (their input copied: the caller's buffers are reused).
  absl::Status AddAndDefer(int layer, const float* hidden, int64_t rows, float* out) {
    if (deferred_.ready) {
      deferred_.ready = false;
      Axpy(1.0f, deferred_out_.data(), rows * hidden_, out);
    }
    if (!Defers(layer)) return absl::OkStatus();
    deferred_hidden_.assign(hidden, hidden + rows * hidden_);
    deferred_out_.resize(static_cast<size_t>(rows) * hidden_);
    MOE_ASSIGN_OR_RETURN(deferred_.ticket,
                         pool_->Submit(pool_index_[layer], deferred_hidden_.data(), rows, later_ids_.data(),
                                       later_weights_.data(), deferred_out_.data()));
    deferred_.in_flight = true;
    deferred_.layer = layer;
    return absl::OkStatus();
  }
  void DropDeferred() {
    if (deferred_.in_flight) (void)pool_->Wait(deferred_.ticket);
    deferred_ = Deferred{};
  }

  Backend& backend_;
  const Model::Weights& weights_;
  experts::ExpertPool* pool_;
  std::vector<int> pool_index_;  // per model layer: its index in the pool, or -1
  const int top_k_;
  const int64_t hidden_;
  const int defer_;
  const TensorShard* shard_;  // a tensor split's: the experts of this rank (null: every expert)
  Mode mode_ = Mode::kBackend;
  experts::ExpertPool::Ticket ticket_;
  // The pool call of the layer in flight (kPool: between Start and Finish).
  struct Call {
    const float* hidden = nullptr;
    int64_t rows = 0;
    float* out = nullptr;
  };
  Call call_;
  int layer_ = -1;
  // Expert deferral's state: touched by the thread that drives the pool (the model's thread with
  // kPool, the backend's host thread with kHost), never both in one model.
  struct Deferred {
    bool in_flight = false;  // a pool call of deferred picks was submitted and not waited for
    bool ready = false;      // waited for, and its sum is the next call's to add
    int layer = -1;
    experts::ExpertPool::Ticket ticket;
  };
  Deferred deferred_;
  std::vector<int32_t> now_ids_, later_ids_;
  std::vector<float> now_weights_, later_weights_;
  std::vector<int32_t> owned_ids_;
  std::vector<float> owned_weights_;
  std::vector<float> deferred_hidden_, deferred_out_;
  mutable std::mutex timing_mu_;
  HostExpertComputeTiming timing_;
  int last_layer_ = -1;
  std::optional<std::chrono::steady_clock::time_point> last_end_;
};

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
                    const Tensor& x, const FfnBuffers& buf, const Tensor& out, const PickCounter& counter) {
  const int64_t rows = x.rows;
  const Tensor logits = buf.router_logits.Rows(0, rows);
  const Tensor ids = buf.ids.Rows(0, rows);
  const Tensor weights = buf.weights.Rows(0, rows);
  b.Linear(x, *lw.router, nullptr, logits);
  b.Route(logits, spec.routing, lw.correction_bias.get(), ids, weights);
  if (counter.step != nullptr) b.CountPicks(ids, *counter.step, counter.scratch_block, counter.counts);
  // The routed experts start; the shared expert runs meanwhile, into its own buffer. A pool layer
  // whose most used experts the backend holds too sends each pick to one side, both at once.
  // A tensor split's share of the experts on the backend is routed the same way, its other picks
  // skipped (other ranks compute them).
  const bool split = lw.backend_index != nullptr;
  const bool owned = lw.owner_index != nullptr;
  const Tensor split_out = buf.split_out.Rows(0, rows);
  if (split || owned) {
    const Tensor host_ids = buf.split_host_ids.Rows(0, rows), host_weights = buf.split_host_weights.Rows(0, rows);
    const Tensor backend_ids = buf.split_backend_ids.Rows(0, rows);
    const Tensor backend_weights = buf.split_backend_weights.Rows(0, rows);
    const Tensor& index = (owned ? lw.owner_index : lw.backend_index)->tensor();
    b.SplitRouting(ids, weights, index, host_ids, host_weights, backend_ids, backend_weights);
    if (split) MOE_RETURN_IF_ERROR(routed.Start(layer, x, host_ids, host_weights, out));
    b.MoeExperts(x, backend_ids, backend_weights, *lw.experts, owned ? out : split_out);
  } else {
    MOE_RETURN_IF_ERROR(routed.Start(layer, x, ids, weights, out));
  }
  const bool shared = spec.shared_expert_intermediate_size > 0;
  const Tensor shared_out = buf.shared.Rows(0, rows);
  if (shared) {
    RunFfn(b, lw.shared, x, buf, shared_out);
    if (lw.shared_gate != nullptr) b.Linear(x, *lw.shared_gate, nullptr, buf.shared_gate.Rows(0, rows));
  }
  if (!owned) MOE_RETURN_IF_ERROR(routed.Finish());
  if (split) b.AddSharedExpert(out, split_out, nullptr);
  if (shared) {
    const Tensor gate = buf.shared_gate.Rows(0, rows);
    b.AddSharedExpert(out, shared_out, lw.shared_gate != nullptr ? &gate : nullptr);
  }
  return absl::OkStatus();
}

std::unique_ptr<RoutedExperts> MakeRoutedExperts(Backend& backend, const Model::Weights& weights, const ModelSpec& spec,
                                                 experts::ExpertPool* pool, const std::vector<int>& pool_layers,
                                                 int defer_experts, const TensorShard* shard) {
  return std::make_unique<RoutedExpertsDispatch>(backend, weights, spec, pool, pool_layers, defer_experts, shard);
}

absl::StatusOr<std::unique_ptr<experts::ExpertPool>> CreatePool(const Checkpoint& checkpoint,
                                                                experts::ExpertPoolOptions options,
                                                                const std::vector<int>& moe_layers) {
  const ModelSpec& spec = checkpoint.spec();
  experts::ExpertShape shape;
  shape.num_layers = static_cast<int>(moe_layers.size());
  shape.num_experts = spec.routing.num_experts;
  shape.top_k = spec.routing.top_k;
  shape.hidden = spec.hidden_size;
  shape.intermediate = spec.moe_intermediate_size;
  std::error_code ec;
  const auto canonical = std::filesystem::weakly_canonical(checkpoint.path(), ec);
  // The files' sizes and times too (the checkpoint's id): a folder whose weights were replaced is
  // another segment.
  options.model_id = absl::StrCat(ec ? checkpoint.path() : canonical.string(), " files ", checkpoint.id());
  // A pool of some layers only is another segment than the whole model's.
  if (static_cast<int>(moe_layers.size()) != spec.num_moe_layers()) {
    options.model_id += " layers " + absl::StrJoin(moe_layers, ",");
  }
  return experts::ExpertPool::Create(
      shape, options, [&](int moe_layer, int expert) -> absl::StatusOr<experts::ExpertWeights> {
        const int layer = moe_layers[moe_layer];
        // GGUF blocks and fp8 codes go to the pool as stored: it keeps them (native, a GGUF
        // format, fp8) or dequantizes them itself (bf16, int8, int4).
        experts::ExpertMatrix m[3];
        const TensorId ids[3] = {TensorId::kExpertGate, TensorId::kExpertUp, TensorId::kExpertDown};
        for (int i = 0; i < 3; ++i) {
          MOE_ASSIGN_OR_RETURN(const WeightView stored, checkpoint.Get({ids[i], layer, expert}));
          if (stored.format.plain()) {
            m[i] = stored.AsTensor();
          } else if (stored.format.kind == WeightFormat::Kind::kBlocks &&
                     experts::FindGgufType(stored.format.type_id) != nullptr && stored.rank() == 2) {
            m[i] = experts::ExpertMatrix::Gguf(stored.data, stored.shape[0], stored.shape[1], stored.format.type_id);
          } else if (stored.format.kind == WeightFormat::Kind::kBlockScaled &&
                     stored.format.element == core::DType::kF8E4M3 && stored.rank() == 2) {
            m[i] = experts::ExpertMatrix::Fp8(stored.data, stored.shape[0], stored.shape[1], stored.scales,
                                              stored.format.scale_dtype, stored.format.scale_rows,
                                              stored.format.scale_cols);
          } else {
            return absl::InvalidArgumentError(absl::StrCat(checkpoint.Describe({ids[i], layer, expert}), " is ",
                                                           stored.format.Name(), ", a type moeserve does not read"));
          }
        }
        return experts::ExpertWeights{m[0], m[1], m[2]};
      });
}

}  // namespace moe::runtime::internal

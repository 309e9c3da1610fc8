#include "model/prefill_probe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/strings/str_format.h"
#include "moe/core/dtype.h"
#include "moe/core/status.h"

namespace moe::runtime::internal {

using core::DType;

absl::StatusOr<PrefillOffload> MeasurePrefillOffload(Backend& b, experts::ExpertPool& pool, HostExpertCompute& host,
                                                     const ModelSpec& spec, const std::vector<int>& pool_layers,
                                                     int max_step_tokens) {
  // Measured: one layer of `t` random tokens on the pool, then streamed to the GPU and computed
  // there (its copy not overlapped: the first layer of a step). The CPU's time grows with the
  // tokens, the stream's hardly: the threshold is where they cross.
  const int t = std::min(512, max_step_tokens);
  const ModelSpec& s = spec;
  const int k = s.routing.top_k, h = s.hidden_size;
  const int num_layers = static_cast<int>(pool_layers.size());
  std::mt19937 rng(5);
  std::vector<float> x(int64_t{t} * h), weights(int64_t{t} * k, 1.0f / k), out(int64_t{t} * h);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  std::vector<int32_t> ids(int64_t{t} * k), all(s.routing.num_experts);
  std::iota(all.begin(), all.end(), 0);
  for (int r = 0; r < t; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + k, ids.begin() + int64_t{r} * k);
  }
  auto seconds = [](auto&& f) {
    const auto start = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // The pool's best of three calls (the first wakes its threads and faults its scratch in).
  absl::Status cpu_status;
  double cpu = 1e30;
  for (int run = 0; run < 3 && cpu_status.ok(); ++run) {
    cpu = std::min(cpu, seconds([&] {
                     cpu_status = pool.Compute(run % num_layers, x.data(), t, ids.data(), weights.data(), out.data());
                   }));
  }
  MOE_RETURN_IF_ERROR(cpu_status);
  std::vector<uint16_t> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = core::FloatToBf16(x[i]);
  MOE_ASSIGN_OR_RETURN(auto dx, b.Allocate(DType::kBF16, t, h));
  MOE_ASSIGN_OR_RETURN(auto dids, b.Allocate(DType::kI32, t, k));
  MOE_ASSIGN_OR_RETURN(auto dw, b.Allocate(DType::kF32, t, k));
  MOE_ASSIGN_OR_RETURN(auto dout, b.Allocate(DType::kF32, t, h));
  b.CopyFromHost(xb.data(), dx->tensor());
  b.CopyFromHost(ids.data(), dids->tensor());
  b.CopyFromHost(weights.data(), dw->tensor());
  MOE_RETURN_IF_ERROR(b.Synchronize());
  b.SetStreamTokens(1);
  // The last pool layer, twice (the first run loads the kernels): nothing after it is prefetched.
  const int last = num_layers - 1;
  absl::Status gpu_status;
  double gpu = 0;
  for (int run = 0; run < 2 && gpu_status.ok(); ++run) {
    gpu = seconds([&] {
      gpu_status =
          b.StartHostExperts(host, pool_layers[last], last, dx->tensor(), dids->tensor(), dw->tensor(), dout->tensor());
      if (gpu_status.ok()) gpu_status = b.FinishHostExperts();
      if (gpu_status.ok()) gpu_status = b.Synchronize();
    });
  }
  MOE_RETURN_IF_ERROR(gpu_status);
  PrefillOffload r;
  r.tokens = std::max(32, static_cast<int>(std::ceil(t * gpu / std::max(cpu, 1e-9))));
  r.note = absl::StrFormat(
      "prefill: a CPU layer's experts stream to the GPU and run there in %.1f ms, the CPU pool takes %.1f ms for %d "
      "tokens: steps of at least %d tokens stream them (--prefill-offload-tokens)",
      gpu * 1e3, cpu * 1e3, t, r.tokens);
  return r;
}

}  // namespace moe::runtime::internal

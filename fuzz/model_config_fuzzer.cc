// Fuzz target: config.json text to ParseModelSpec and to the FP8 reader's quantization_config. An
// error is a fine answer if it names the file; a crash, a hang or an unbounded allocation is a
// finding, and so is an accepted spec that the forward pass could not run (a shape that is not
// positive, heads that do not group, a top-k beyond the experts, a layer list of the wrong
// length), or an fp8 scale block outside [1, 4096].
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "checkpoint/fp8_source.h"
#include "fuzz_util.h"
#include "moe/runtime/model_spec.h"

namespace {

constexpr std::string_view kSource = "fuzz/config.json";

void CheckAccepted(const moe::runtime::ModelSpec& s) {
  MOE_FUZZ_CHECK(s.vocab_size > 0 && s.hidden_size > 0 && s.num_layers > 0, "vocab %d, hidden %d, layers %d",
                 s.vocab_size, s.hidden_size, s.num_layers);
  MOE_FUZZ_CHECK(s.num_heads > 0 && s.num_kv_heads > 0 && s.num_heads % s.num_kv_heads == 0, "heads %d / kv heads %d",
                 s.num_heads, s.num_kv_heads);
  MOE_FUZZ_CHECK(s.head_dim > 0 && s.head_dim % 2 == 0, "head_dim %d", s.head_dim);
  MOE_FUZZ_CHECK(s.rotary_dim >= 0 && s.rotary_dim <= s.head_dim && s.rotary_dim % 2 == 0,
                 "rotary_dim %d of head_dim %d", s.rotary_dim, s.head_dim);
  MOE_FUZZ_CHECK(static_cast<int>(s.layer_is_moe.size()) == s.num_layers, "%zu layer flags for %d layers",
                 s.layer_is_moe.size(), s.num_layers);
  MOE_FUZZ_CHECK(s.intermediate_size > 0 && s.moe_intermediate_size > 0, "intermediate %d, moe intermediate %d",
                 s.intermediate_size, s.moe_intermediate_size);
  MOE_FUZZ_CHECK(s.shared_expert_intermediate_size >= 0, "shared expert width %d", s.shared_expert_intermediate_size);
  const moe::runtime::RoutingSpec& r = s.routing;
  MOE_FUZZ_CHECK(r.num_experts > 0 && r.top_k > 0 && r.top_k <= r.num_experts, "top-%d of %d experts", r.top_k,
                 r.num_experts);
  MOE_FUZZ_CHECK(r.n_group > 0 && r.num_experts % r.n_group == 0 && r.topk_group > 0 && r.topk_group <= r.n_group,
                 "groups: %d experts, n_group %d, topk_group %d", r.num_experts, r.n_group, r.topk_group);
  MOE_FUZZ_CHECK(s.model_type == moe::runtime::ArchitectureName(s.arch), "model_type %s for architecture %s",
                 s.model_type.c_str(), std::string(moe::runtime::ArchitectureName(s.arch)).c_str());
  MOE_FUZZ_CHECK(s.num_moe_layers() >= 0 && s.num_moe_layers() <= s.num_layers, "%d MoE layers of %d",
                 s.num_moe_layers(), s.num_layers);
  MOE_FUZZ_CHECK(!s.Summary().empty(), "empty summary");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto spec = moe::runtime::ParseModelSpec(text, kSource);
  if (spec.ok()) {
    CheckAccepted(*spec);
  } else {
    const std::string message(spec.status().message());
    MOE_FUZZ_CHECK(message.find(kSource) != std::string::npos, "the error does not name the file: %s", message.c_str());
  }
  auto q = moe::runtime::internal::ReadQuantizationConfig(text, std::string(kSource));
  if (q.ok()) {
    const bool none = q->method == moe::runtime::internal::WeightQuantization::Method::kNone;
    MOE_FUZZ_CHECK(none ? q->block_rows == 0 && q->block_cols == 0
                        : (q->block_rows == 0 && q->block_cols == 0) ||
                              (q->block_rows >= 1 && q->block_rows <= 4096 && q->block_cols >= 1 && q->block_cols <= 4096),
                   "scale block %d x %d", q->block_rows, q->block_cols);
  } else {
    const std::string message(q.status().message());
    MOE_FUZZ_CHECK(message.find(kSource) != std::string::npos, "the error does not name the file: %s", message.c_str());
  }
  return 0;
}

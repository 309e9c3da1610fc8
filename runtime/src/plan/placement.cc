#include "moe/runtime/placement.h"

#include <cctype>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe::runtime {
namespace {

// Read whole for every token (an embedding lookup reads one row, a routed expert only when chosen).
bool PerToken(TensorRole role) {
  return role != TensorRole::kRoutedExpert && role != TensorRole::kOther && role != TensorRole::kEmbedding;
}

std::string MiB(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

}  // namespace

absl::StatusOr<OverrideRule> ParseOverrideRule(std::string_view view) {
  const std::string text(view);
  const size_t eq = text.rfind('=');
  if (eq == std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--override-tensor '", text, "': expected REGEX=DEVICE, e.g. 'experts=cpu' or 'layers\\.1\\.=cuda:0'"));
  }
  OverrideRule rule;
  rule.text = text;
  const std::string regex = text.substr(0, eq);
  std::string device = text.substr(eq + 1);
  for (char& c : device) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));  // llama.cpp's CPU
  if (regex.empty())
    return absl::InvalidArgumentError(absl::StrCat("--override-tensor '", text, "': the regex is empty"));
  try {
    rule.pattern = std::regex(regex, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("--override-tensor '", text, "': '", regex, "' is not a valid regex (", e.what(), ")"));
  }
  absl::StatusOr<Device> d = ParseDevice(device);
  if (!d.ok() || d->kind == Device::Kind::kAuto) {
    return absl::InvalidArgumentError(
        absl::StrCat("--override-tensor '", text, "': the device '", device, "' is not cpu, cuda or cuda:N"));
  }
  rule.device = *d;
  return rule;
}

int64_t Placement::BytesOn(Device::Kind kind) const {
  int64_t total = 0;
  for (const TensorPlace& t : tensors) total += t.device.kind == kind ? t.bytes : 0;
  return total;
}

absl::StatusOr<Placement> PlaceTensors(const ModelSpec& spec, const std::vector<TensorInfo>& tensors,
                                       const PlacementOptions& options) {
  // MoE layers in order: --n-cpu-moe counts them, not the dense ones before.
  std::vector<int> moe_index(spec.num_layers, -1);
  int moe_layers = 0;
  for (int l = 0; l < spec.num_layers; ++l) {
    if (spec.IsMoeLayer(l)) moe_index[l] = moe_layers++;
  }
  if (options.n_cpu_moe < 0 || options.n_cpu_moe > moe_layers) {
    return absl::InvalidArgumentError(absl::StrCat("--n-cpu-moe ", options.n_cpu_moe, ": the model has ", moe_layers,
                                                   " MoE layers, so it takes 0 to ", moe_layers));
  }
  for (const OverrideRule& r : options.overrides) {
    if (r.device.kind == Device::Kind::kCuda && r.device.index != options.gpu.index) {
      return absl::InvalidArgumentError(absl::StrCat("--override-tensor '", r.text, "': the model runs on ",
                                                     options.gpu.ToString(), "; one process uses one GPU"));
    }
  }
  const Device cpu{Device::Kind::kCpu, 0};
  Placement plan;
  // Per-token tensors a rule put on the CPU: (rule, role) -> bytes and count.
  std::map<std::pair<std::string, TensorRole>, std::pair<int64_t, int>> moved;
  std::vector<int> matched(options.overrides.size(), 0);
  for (const TensorInfo& t : tensors) {
    TensorPlace p;
    p.name = t.name;
    p.bytes = t.bytes;
    p.elements = t.elements > 0 ? t.elements : t.bytes / 2;
    p.rank = t.rank;
    p.rows = t.rows;
    p.kind = ClassifyTensor(t.name);
    p.device = options.gpu;
    p.rule = "default";
    bool decided = false;
    for (size_t i = 0; i < options.overrides.size(); ++i) {
      const OverrideRule& r = options.overrides[i];
      if (std::regex_search(t.name, r.pattern)) {
        ++matched[i];
        p.device = r.device;
        p.rule = absl::StrCat("--override-tensor ", r.text);
        decided = true;
        break;
      }
    }
    if (!decided && p.kind.role == TensorRole::kRoutedExpert) {
      if (options.cpu_moe) {
        p.device = cpu;
        p.rule = "--cpu-moe";
      } else if (p.kind.layer < spec.num_layers && moe_index[p.kind.layer] >= 0 &&
                 moe_index[p.kind.layer] < options.n_cpu_moe) {
        p.device = cpu;
        p.rule = absl::StrCat("--n-cpu-moe ", options.n_cpu_moe);
      }
    }
    if (p.device.kind == Device::Kind::kCpu && PerToken(p.kind.role)) {
      auto& [bytes, count] = moved[{p.rule, p.kind.role}];
      bytes += p.bytes;
      ++count;
    }
    plan.tensors.push_back(std::move(p));
  }
  for (const auto& [key, value] : moved) {
    plan.warnings.push_back(absl::StrCat(
        key.first, " puts ", value.second, " ", std::string(TensorRoleName(key.second)), " tensor",
        value.second == 1 ? "" : "s", " on the CPU: every token then reads their ", MiB(value.first),
        " from host memory and the GPU waits for it; keep shared experts, the router, norms and attention on the GPU"));
  }
  std::string example = tensors.empty() ? std::string("(none)") : tensors.front().name;
  for (const TensorPlace& t : plan.tensors) {
    if (t.kind.role == TensorRole::kRoutedExpert) {
      example = t.name;
      break;
    }
  }
  for (size_t i = 0; i < options.overrides.size(); ++i) {
    if (matched[i] > 0) continue;
    plan.warnings.push_back(absl::StrCat("--override-tensor ", options.overrides[i].text,
                                         " matches no tensor of the checkpoint, whose names read like ", example,
                                         " (Hugging Face names, where GGUF's read blk.N.ffn_up_exps)"));
  }
  return plan;
}

absl::StatusOr<std::vector<TensorInfo>> CheckpointTensors(const WeightSource& source) {
  std::vector<TensorInfo> out;
  for (const std::string& name : source.Names()) {
    absl::StatusOr<WeightView> view = source.GetStored(name);
    if (!view.ok()) return view.status();
    out.push_back(
        {name, view->bytes(), view->numel(), static_cast<int>(view->rank()), view->rank() > 0 ? view->shape[0] : 1});
  }
  return out;
}

std::vector<TensorInfo> ExpectedTensors(const ModelSpec& s, Container container) {
  using I = TensorId;
  const TensorNames& names = TensorNames::For(s.arch, container);
  std::vector<TensorInfo> out;
  auto add = [&](TensorKey key, int64_t rows, int64_t cols = 0) {
    const int64_t elements = cols > 0 ? rows * cols : rows;
    out.push_back({names.Name(key), 2 * elements, elements, cols > 0 ? 2 : 1, rows});
  };
  const int64_t h = s.hidden_size, qw = int64_t{s.num_heads} * s.head_dim, kvw = int64_t{s.num_kv_heads} * s.head_dim;
  add({I::kEmbedding}, s.vocab_size, h);
  for (int l = 0; l < s.num_layers; ++l) {
    add({I::kAttnNorm, l}, h);
    add({I::kFfnNorm, l}, h);
    if (s.attention(l) == AttentionKind::kMla) {
      const MlaSpec& m = s.mla;
      const int64_t heads = s.num_heads;
      if (m.q_lora_rank > 0) {
        add({I::kMlaQA, l}, m.q_lora_rank, h);
        add({I::kMlaQANorm, l}, m.q_lora_rank);
        add({I::kMlaQB, l}, heads * m.qk_head_dim(), m.q_lora_rank);
      } else {
        add({I::kAttnQ, l}, heads * m.qk_head_dim(), h);
      }
      add({I::kMlaKvA, l}, m.latent_width(), h);
      add({I::kMlaKvANorm, l}, m.kv_lora_rank);
      add({I::kMlaKvB, l}, heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank);
      add({I::kAttnO, l}, h, heads * m.v_head_dim);
    } else {
      add({I::kAttnQ, l}, qw, h);
      add({I::kAttnK, l}, kvw, h);
      add({I::kAttnV, l}, kvw, h);
      add({I::kAttnO, l}, h, qw);
    }
    if (s.qkv_bias) {
      add({I::kAttnQBias, l}, qw);
      add({I::kAttnKBias, l}, kvw);
      add({I::kAttnVBias, l}, kvw);
    }
    if (s.qk_norm) {
      add({I::kAttnQNorm, l}, s.head_dim);
      add({I::kAttnKNorm, l}, s.head_dim);
    }
    if (!s.IsMoeLayer(l)) {
      add({I::kDenseGate, l}, s.intermediate_size, h);
      add({I::kDenseUp, l}, s.intermediate_size, h);
      add({I::kDenseDown, l}, h, s.intermediate_size);
      continue;
    }
    const int e = s.routing.num_experts;
    const int64_t w = s.moe_intermediate_size;
    add({I::kRouter, l}, e, h);
    if (s.routing.has_correction_bias) add({I::kRouterBias, l}, e);
    if (names.Stacked(I::kExpertGate)) {  // one tensor of every expert
      add({I::kExpertGate, l}, e * w, h);
      add({I::kExpertUp, l}, e * w, h);
      add({I::kExpertDown, l}, e * h, w);
    } else {
      for (int i = 0; i < e; ++i) {
        add({I::kExpertGate, l, i}, w, h);
        add({I::kExpertUp, l, i}, w, h);
        add({I::kExpertDown, l, i}, h, w);
      }
    }
    if (s.shared_expert_intermediate_size > 0) {
      add({I::kSharedGate, l}, s.shared_expert_intermediate_size, h);
      add({I::kSharedUp, l}, s.shared_expert_intermediate_size, h);
      add({I::kSharedDown, l}, h, s.shared_expert_intermediate_size);
      if (s.shared_expert_gate) add({I::kSharedExpertGate, l}, 1, h);
    }
  }
  add({I::kFinalNorm}, h);
  if (!s.tie_word_embeddings) add({I::kLmHead}, s.vocab_size, h);
  return out;
}

absl::StatusOr<std::vector<int>> CpuExpertLayers(const Placement& placement) {
  std::map<int, std::pair<const TensorPlace*, const TensorPlace*>> layers;  // a tensor on the CPU, one on the GPU
  for (const TensorPlace& t : placement.tensors) {
    const bool cpu = t.device.kind == Device::Kind::kCpu;
    if (t.kind.role != TensorRole::kRoutedExpert) {
      if (cpu) {
        return absl::InvalidArgumentError(
            absl::StrCat(t.rule, " puts ", t.name, " (", std::string(TensorRoleName(t.kind.role)),
                         ") on the CPU: only routed experts run on the CPU beside a GPU; leave the rest on the GPU"));
      }
      continue;
    }
    auto& [on_cpu, on_gpu] = layers[t.kind.layer];
    (cpu ? on_cpu : on_gpu) = &t;
  }
  std::vector<int> out;
  for (const auto& [layer, where] : layers) {
    const auto [on_cpu, on_gpu] = where;
    if (on_cpu != nullptr && on_gpu != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", layer, "'s routed experts are split: ", on_cpu->name, " on the CPU (", on_cpu->rule, "), ",
          on_gpu->name, " on the GPU (", on_gpu->rule, "); a layer's routed experts run in one place"));
    }
    if (on_cpu != nullptr) out.push_back(layer);
  }
  return out;
}

}  // namespace moe::runtime

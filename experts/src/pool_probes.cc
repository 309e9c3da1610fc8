#include "pool_probes.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "expert_schedules.h"
#include "moe/core/cpu_features.h"
#include "moe/core/memory.h"
#include "target_clones.h"

namespace moe::experts::internal {
namespace {

MOE_CLONES float SumFloats(const float* p, size_t n) {
  float acc[16] = {};
  for (size_t i = 0; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += p[i + j];
  }
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

}  // namespace

double MeasureReadBandwidth(WorkerThreads& workers, int threads, size_t bytes, int repeats) {
  const size_t n = bytes / sizeof(float);
  // Large, so on huge pages like the arena (AlignedBuffer from 4 MiB): the same kind of reads.
  auto buffer = core::AlignedBuffer::Allocate(n * sizeof(float));
  if (!buffer.ok()) return 0.0;
  float* data = buffer->as<float>();
  const size_t chunk = (n / threads + 15) / 16 * 16;
  auto each_chunk = [&](auto&& f) {
    workers.OnEachThread(threads, [&](int t) {
      const size_t b = std::min(n, static_cast<size_t>(t) * chunk), e = std::min(n, b + chunk);
      f(data + b, e - b);
    });
  };
  each_chunk([](float* p, size_t len) { std::fill(p, p + len, 1.0f); });  // fault the pages in first
  // The same loads and prefetch streams as the kernels, so the bound is at least as strong.
  const bool avx512 = core::GetCpuFeatures().avx512f;
  double best = 0;
  std::atomic<float> sink{0};
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    each_chunk([&](float* p, size_t len) {
      const float v = avx512 ? SumAvx512(p, static_cast<int64_t>(len)) : SumFloats(p, len);
      sink.store(sink.load() + v);
    });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(n * sizeof(float)) / secs / 1e9);
  }
  return best;
}

ExpertPool::KernelStream MeasureKernelStream(WorkerThreads& workers, int threads, const ExpertShape& shape,
                                             const PackedExperts& experts, ExpertFormat format, KernelKind kind,
                                             int64_t tokens, int repeats) {
  ExpertPool::KernelStream best;
  const MatrixLayout &gate_up_layout = experts.gate_up, &down_layout = experts.down;
  const int64_t h = shape.hidden, inter = shape.intermediate;
  const int64_t matrices = static_cast<int64_t>(shape.num_layers) * shape.num_experts;
  const int64_t gu_item = BatchItemBlocks(shape.num_experts, gate_up_layout.blocks(), threads);
  const int64_t down_item =
      std::min(kDownItemBlocks, BatchItemBlocks(shape.num_experts, down_layout.blocks(), threads));
  // Native GGUF types: each layer's matrices have their own formats (and kernels); all take the
  // same int8 activations.
  if (format == ExpertFormat::kNative) format = gate_up_layout.format;
  const MatmulKernel matmul = GetKernel(kind, format);
  const SwiGluKernel swiglu = GetSwiGluKernel(kind, format);
  // Each thread's own activations (the same values on every thread) and result rows.
  struct Scratch {
    Activations in, mid;
    std::vector<float> y_gate_up, y_down;
  };
  std::vector<Scratch> scratch(threads);
  std::vector<float> x(static_cast<size_t>(tokens) * std::max(h, inter));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001) - 1000) / 1000;
  }
  const int64_t ld_gate_up = swiglu != nullptr ? inter : gate_up_layout.n_pad + 16, ld_down = h + 16;
  std::atomic<bool> failed{false};
  workers.OnEachThread(threads, [&](int t) {
    Scratch& s = scratch[t];
    absl::Status st = PrepareThreadForKernel(kind);
    if (st.ok()) st = s.in.Prepare(x.data(), tokens, h, gate_up_layout.k_pad, kind, format, SumGroup(gate_up_layout));
    if (st.ok()) st = s.mid.Prepare(x.data(), tokens, inter, down_layout.k_pad, kind, format, SumGroup(down_layout));
    if (!st.ok()) failed = true;
    s.y_gate_up.assign(static_cast<size_t>(tokens) * ld_gate_up, 0.0f);
    s.y_down.assign(static_cast<size_t>(tokens) * ld_down, 0.0f);
  });
  if (failed) return best;
  auto run = [&](int t, bool gate_up, bool down) {
    Scratch& s = scratch[t];
    for (int64_t i = t; i < matrices; i += threads) {
      const int layer = static_cast<int>(i / shape.num_experts), e = static_cast<int>(i % shape.num_experts);
      if (gate_up) {
        const PackedMatrix w = experts.GateUp(layer, e);
        const MatmulKernel mm = experts.layers != nullptr ? GetKernel(kind, w.layout.format) : matmul;
        for (int64_t b0 = 0; b0 < gate_up_layout.blocks(); b0 += gu_item) {
          const int64_t b1 = std::min(gate_up_layout.blocks(), b0 + gu_item);
          if (swiglu != nullptr) {
            swiglu(w, s.in, b0, b1, inter, s.y_gate_up.data() + b0 / 2 * 16, ld_gate_up);
          } else {
            mm(w, s.in, b0, b1, s.y_gate_up.data() + b0 * 16, ld_gate_up);
          }
        }
      }
      if (down) {
        const PackedMatrix w = experts.Down(layer, e);
        const MatmulKernel mm = experts.layers != nullptr ? GetKernel(kind, w.layout.format) : matmul;
        for (int64_t b0 = 0; b0 < down_layout.blocks(); b0 += down_item) {
          mm(w, s.mid, b0, std::min(down_layout.blocks(), b0 + down_item), s.y_down.data() + b0 * 16, ld_down);
        }
      }
    }
  };
  for (int r = 0; r < repeats; ++r) {
    for (auto [gate_up, down, gbps] :
         {std::tuple{true, false, &best.gate_up_gbps}, std::tuple{false, true, &best.down_gbps},
          std::tuple{true, true, &best.all_gbps}}) {
      double bytes = 0;
      for (int l = 0; l < shape.num_layers; ++l) {
        const PackedExperts p = experts.ForLayer(l);
        bytes += static_cast<double>(shape.num_experts) * ((gate_up ? p.gate_up.bytes() : 0) + (down ? p.down.bytes() : 0));
      }
      const auto t0 = std::chrono::steady_clock::now();
      workers.OnEachThread(threads, [&, gate_up = gate_up, down = down](int t) { run(t, gate_up, down); });
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      *gbps = std::max(*gbps, bytes / secs / 1e9);
    }
  }
  return best;
}

}  // namespace moe::experts::internal

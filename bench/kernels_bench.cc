// BM_Kernel: one kernel over a packed matrix much larger than the caches, one thread, M tokens.
// Reports bytes/s of weights streamed; compare with one core's read bandwidth (BM_Read).
#include <benchmark/benchmark.h>

#include <random>

#include "moe/core/dtype.h"
#include "moe/core/memory.h"
#include "moe/experts/kernels.h"

namespace moe::experts {
namespace {

constexpr int64_t kRows = 16384, kCols = 2048;  // 32-64 MB packed

struct Packed {
  MatrixLayout layout;
  core::AlignedBuffer storage;
};

Packed& PackedFor(ExpertFormat f) {
  static Packed packed[3];
  Packed& p = packed[static_cast<int>(f)];
  if (p.storage.data() == nullptr) {
    p.layout = *MakeLayout(f, kRows, kCols, 32);
    p.storage = std::move(*core::AlignedBuffer::Allocate(p.layout.bytes(), 2 << 20));
    std::vector<float> w(kRows * kCols);
    std::mt19937 rng(1);
    std::normal_distribution<float> d;
    for (float& v : w) v = d(rng);
    (void)PackMatrix({w.data(), core::DType::kF32, {kRows, kCols}}, p.layout, p.storage.as<uint8_t>());
  }
  return p;
}

void BM_Kernel(benchmark::State& state, ExpertFormat format, KernelKind kind) {
  const std::string why = KernelUnsupportedReason(kind, format, core::GetCpuFeatures());
  if (!why.empty()) {
    state.SkipWithError(why.c_str());
    return;
  }
  (void)PrepareThreadForKernel(kind);
  Packed& p = PackedFor(format);
  const PackedMatrix m{p.layout, p.storage.as<uint8_t>()};
  const int64_t tokens = state.range(0);
  std::vector<float> x(tokens * kCols, 0.5f), y(tokens * p.layout.n_pad);
  Activations a;
  (void)a.Prepare(x.data(), tokens, kCols, p.layout.k_pad, kind, format, format == ExpertFormat::kInt4 ? 32 : p.layout.k_pad);
  const MatmulKernel kernel = GetKernel(kind, format);
  for (auto _ : state) {
    kernel(m, a, 0, p.layout.blocks(), y.data(), p.layout.n_pad);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(state.iterations() * p.layout.weight_bytes());
}

void BM_Read(benchmark::State& state) {
  Packed& p = PackedFor(ExpertFormat::kBF16);
  const float* data = p.storage.as<float>();
  const size_t n = p.layout.weight_bytes() / 4;
  for (auto _ : state) {
    float acc[16] = {};
    for (size_t i = 0; i + 16 <= n; i += 16) {
      for (int j = 0; j < 16; ++j) acc[j] += data[i + j];
    }
    benchmark::DoNotOptimize(acc);
  }
  state.SetBytesProcessed(state.iterations() * p.layout.weight_bytes());
}

// Compute throughput with the weights in cache: an expert's gate+up (1536 x K) at M tokens;
// Args: {tokens, K}, and for int4 the group.
void BM_KernelCached(benchmark::State& state, ExpertFormat format, KernelKind kind) {
  const std::string why = KernelUnsupportedReason(kind, format, core::GetCpuFeatures());
  if (!why.empty()) {
    state.SkipWithError(why.c_str());
    return;
  }
  (void)PrepareThreadForKernel(kind);
  const int64_t rows = 1536, cols = state.range(1), tokens = state.range(0);
  const int group = format == ExpertFormat::kInt4 ? static_cast<int>(state.range(2)) : 32;
  const MatrixLayout layout = *MakeLayout(format, rows, cols, group);
  auto storage = *core::AlignedBuffer::Allocate(layout.bytes(), 64);
  std::vector<float> w(rows * cols, 0.01f), x(tokens * cols, 0.5f), y(tokens * layout.n_pad);
  (void)PackMatrix({w.data(), core::DType::kF32, {rows, cols}}, layout, storage.as<uint8_t>());
  const PackedMatrix m{layout, storage.as<uint8_t>()};
  Activations a;
  (void)a.Prepare(x.data(), tokens, cols, layout.k_pad, kind, format,
                  format == ExpertFormat::kInt4 ? group : static_cast<int>(layout.k_pad));
  const MatmulKernel kernel = GetKernel(kind, format);
  for (auto _ : state) {
    kernel(m, a, 0, layout.blocks(), y.data(), layout.n_pad);  // one call, as the pool makes per item
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GOPS"] = benchmark::Counter(2.0 * tokens * rows * cols * state.iterations(),
                                              benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}
BENCHMARK_CAPTURE(BM_KernelCached, int8_vnni, ExpertFormat::kInt8, KernelKind::kVnni)->Args({64, 2048})->Args({64, 8192});
BENCHMARK_CAPTURE(BM_KernelCached, int8_amx, ExpertFormat::kInt8, KernelKind::kAmx)
    ->Args({64, 768})->Args({64, 2048})->Args({64, 8192})->Args({57, 2048});
BENCHMARK_CAPTURE(BM_KernelCached, bf16_amx, ExpertFormat::kBF16, KernelKind::kAmx)->Args({64, 2048})->Args({64, 8192});
BENCHMARK_CAPTURE(BM_KernelCached, int4_vnni, ExpertFormat::kInt4, KernelKind::kVnni)->Args({64, 2048, 32});
BENCHMARK_CAPTURE(BM_KernelCached, int4_amx, ExpertFormat::kInt4, KernelKind::kAmx)
    ->Args({64, 2048, 32})->Args({64, 2048, 64})->Args({64, 2048, 128})->Args({57, 2048, 32});

BENCHMARK(BM_Read);
BENCHMARK_CAPTURE(BM_Kernel, bf16_avx512, ExpertFormat::kBF16, KernelKind::kAvx512)->Arg(1)->Arg(4);
BENCHMARK_CAPTURE(BM_Kernel, bf16_avx512bf16, ExpertFormat::kBF16, KernelKind::kAvx512Bf16)->Arg(1)->Arg(4);
BENCHMARK_CAPTURE(BM_Kernel, bf16_amx, ExpertFormat::kBF16, KernelKind::kAmx)->Arg(16)->Arg(64);
BENCHMARK_CAPTURE(BM_Kernel, int8_vnni, ExpertFormat::kInt8, KernelKind::kVnni)->Arg(1)->Arg(4);
BENCHMARK_CAPTURE(BM_Kernel, int8_amx, ExpertFormat::kInt8, KernelKind::kAmx)->Arg(16)->Arg(64);
BENCHMARK_CAPTURE(BM_Kernel, int4_vnni, ExpertFormat::kInt4, KernelKind::kVnni)->Arg(1)->Arg(4);
BENCHMARK_CAPTURE(BM_Kernel, int4_amx, ExpertFormat::kInt4, KernelKind::kAmx)->Arg(16)->Arg(64);

}  // namespace
}  // namespace moe::experts

BENCHMARK_MAIN();

#include "expert_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <set>

#include "absl/strings/str_format.h"
#include "moe/core/dtype.h"
#include "moe/core/status.h"
#include "moe/experts/expert_pool.h"
#include "moe/experts/gguf_types.h"
#include "nlohmann/json.hpp"

namespace moe::bench {
namespace {

// Distinct random bf16 experts; expert e of every layer reuses variant e % kVariants (the
// arena still holds a separate copy of each, so every expert is its own memory).
constexpr int kVariants = 16;

struct RandomExperts {
  RandomExperts(int64_t h, int64_t inter) : h(h), inter(inter) {
    std::mt19937 rng(1);
    std::normal_distribution<float> dist(0.0f, 1.0f / std::sqrt(static_cast<float>(h)));
    data.resize(static_cast<size_t>(kVariants) * 3 * h * inter);
    for (auto& v : data) v = core::FloatToBf16(dist(rng));
  }
  experts::ExpertWeightSource Source() const {
    return [this](int, int e) -> absl::StatusOr<experts::ExpertWeights> {
      const uint16_t* base = data.data() + static_cast<size_t>(e % kVariants) * 3 * h * inter;
      return experts::ExpertWeights{{base, core::DType::kBF16, {inter, h}},
                                    {base + h * inter, core::DType::kBF16, {inter, h}},
                                    {base + 2 * h * inter, core::DType::kBF16, {h, inter}}};
    };
  }
  int64_t h, inter;
  std::vector<uint16_t> data;
};

// Random experts of one GGUF type, as a GGUF file would hold them (random codes and scales: the
// kernels' speed does not depend on the values), kVariants of them as above.
struct RandomGgufExperts {
  RandomGgufExperts(int64_t h, int64_t inter, int type_id) : h(h), inter(inter), type_id(type_id) {
    const experts::GgufType& t = *experts::FindGgufType(type_id);
    gate_up_bytes = inter * experts::GgufRowBytes(t, h);
    down_bytes = h * experts::GgufRowBytes(t, inter);
    data.resize(static_cast<size_t>(kVariants) * (2 * gate_up_bytes + down_bytes));
    uint64_t x = 88172645463325252ull;
    for (auto& b : data) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      b = static_cast<uint8_t>(x >> 32);
    }
  }
  experts::ExpertWeightSource Source() const {
    return [this](int, int e) -> absl::StatusOr<experts::ExpertWeights> {
      const uint8_t* base = data.data() + static_cast<size_t>(e % kVariants) * (2 * gate_up_bytes + down_bytes);
      return experts::ExpertWeights{experts::ExpertMatrix::Gguf(base, inter, h, type_id),
                                    experts::ExpertMatrix::Gguf(base + gate_up_bytes, inter, h, type_id),
                                    experts::ExpertMatrix::Gguf(base + 2 * gate_up_bytes, h, inter, type_id)};
    };
  }
  int64_t h, inter;
  int type_id;
  int64_t gate_up_bytes = 0, down_bytes = 0;
  std::vector<uint8_t> data;
};

// Spins for `us` microseconds: the caller's own work between two layer calls.
void SpinFor(double us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
  while (std::chrono::steady_clock::now() < end) {
  }
}

struct Call {
  int layer;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  int distinct;
};

std::vector<Call> MakeCalls(const ExpertBenchOptions& o, int batch, int count, std::mt19937& rng) {
  std::vector<Call> calls(count);
  std::vector<int32_t> all(o.num_experts);
  for (int c = 0; c < count; ++c) {
    Call& call = calls[c];
    call.layer = c % o.layers;
    std::set<int32_t> used;
    for (int t = 0; t < batch; ++t) {
      for (int e = 0; e < o.num_experts; ++e) all[e] = e;
      for (int j = 0; j < o.top_k; ++j) {
        std::swap(all[j], all[j + rng() % (o.num_experts - j)]);
        call.ids.push_back(all[j]);
        call.weights.push_back(1.0f / o.top_k);
        used.insert(all[j]);
      }
    }
    call.distinct = static_cast<int>(used.size());
  }
  return calls;
}

}  // namespace

absl::StatusOr<std::vector<ExpertBenchRow>> RunExpertBench(const ExpertBenchOptions& o, std::ostream& log) {
  const RandomExperts source(o.hidden, o.intermediate);
  experts::ExpertShape shape{o.layers, o.num_experts, o.top_k, o.hidden, o.intermediate};
  std::vector<ExpertBenchRow> rows;
  std::mt19937 rng(7);
  const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  std::vector<float> hidden(static_cast<size_t>(max_batch) * o.hidden), out(hidden.size());
  for (auto& v : hidden) v = std::normal_distribution<float>()(rng);

  for (const std::string& format_name : o.formats) {
    experts::ExpertPoolOptions po;
    MOE_ASSIGN_OR_RETURN(po.format, experts::ParseFormat(format_name));
    po.threads = o.threads;
    po.progress = false;
    po.decode_max_tokens = o.decode_max_tokens;
    po.decode_units_per_thread = o.decode_units;
    po.linger_us = o.linger_us;
    // GGUF formats (q8_0, q4_k, iq3_xxs, ...): experts of that type, kept as they are.
    std::unique_ptr<RandomGgufExperts> gguf;
    if (experts::IsGgufFormat(po.format)) {
      gguf = std::make_unique<RandomGgufExperts>(o.hidden, o.intermediate, experts::Describe(po.format).gguf_type);
    }
    MOE_ASSIGN_OR_RETURN(auto pool,
                         experts::ExpertPool::Create(shape, po, gguf != nullptr ? gguf->Source() : source.Source()));
    double read_gbps = pool->MeasureReadBandwidth(static_cast<size_t>(o.read_bytes));
    log << absl::StrFormat("%s | read bandwidth %.1f GB/s (%d threads, %.1f GB buffer)\n", pool->Describe(), read_gbps,
                           pool->threads(), o.read_bytes / 1e9);
    for (experts::KernelKind kind : experts::KernelsFor(po.format)) {
      const std::string kernel_name = experts::KernelName(kind);
      if (!o.kernels.empty() && std::find(o.kernels.begin(), o.kernels.end(), kernel_name) == o.kernels.end()) continue;
      const std::string why = experts::KernelUnsupportedReason(kind, po.format, core::GetCpuFeatures());
      if (!why.empty()) {
        log << absl::StrFormat("  %s %s: skipped, %s\n", format_name, kernel_name, why);
        continue;
      }
      MOE_RETURN_IF_ERROR(pool->SetKernel(kind));
      for (int batch : o.batches) {
        if (kind == experts::KernelKind::kPortable && batch > o.portable_max_batch) continue;
        // Warm up, then as many calls as fit in the time per point (at least 3).
        std::vector<Call> calls = MakeCalls(o, batch, 2, rng);
        for (const Call& c : calls) {
          MOE_RETURN_IF_ERROR(pool->Compute(c.layer, hidden.data(), batch, c.ids.data(), c.weights.data(), out.data()));
        }
        const auto probe_start = std::chrono::steady_clock::now();
        MOE_RETURN_IF_ERROR(
            pool->Compute(calls[0].layer, hidden.data(), batch, calls[0].ids.data(), calls[0].weights.data(), out.data()));
        const double probe = std::chrono::duration<double>(std::chrono::steady_clock::now() - probe_start).count();
        const int count = std::clamp(static_cast<int>(o.seconds_per_point / std::max(probe, 1e-6)), 3, 200);
        // Best of three trials, each after a fresh measurement of the read bandwidth (the
        // roofline is the best of all those readings; see the end).
        double best_secs = 0, best_bytes = 0, point_read = 0;
        std::string trials;
        for (int trial = 0; trial < 3; ++trial) {
          const double read = pool->MeasureReadBandwidth(static_cast<size_t>(o.read_bytes), 2);
          calls = MakeCalls(o, batch, count, rng);
          double bytes = 0;
          pool->ResetPhases();
          double secs = 0;  // in the calls only
          for (const Call& c : calls) {
            if (o.gap_us > 0) SpinFor(o.gap_us);
            const auto start = std::chrono::steady_clock::now();
            MOE_RETURN_IF_ERROR(
                pool->Compute(c.layer, hidden.data(), batch, c.ids.data(), c.weights.data(), out.data()));
            secs += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            bytes += static_cast<double>(c.distinct) * pool->expert_bytes();
          }
          trials += absl::StrFormat(" %.3f", secs / count * 1e3);
          if (trial == 0 || bytes / secs > best_bytes / best_secs) {
            best_secs = secs;
            best_bytes = bytes;
            point_read = read;
          }
        }
        const double secs = best_secs, bytes = best_bytes;
        ExpertBenchRow row;
        row.format = format_name;
        row.kernel = kernel_name;
        row.batch = batch;
        row.ms_per_call = secs / count * 1e3;
        row.weight_gbps = bytes / secs / 1e9;
        row.read_gbps = point_read;
        row.ratio = row.weight_gbps / read_gbps;
        row.tflops = 2.0 * batch * o.top_k * 3 * o.hidden * o.intermediate * count / secs / 1e12;
        read_gbps = point_read;
        log << absl::StrFormat(
            "  %-5s %-10s batch %5d: %8.3f ms/call  %6.1f GB/s of weights (%4.0f%% of %.0f GB/s read)  %6.2f TFLOP/s\n",
            row.format, row.kernel, row.batch, row.ms_per_call, row.weight_gbps, 100 * row.ratio, row.read_gbps,
            row.tflops);
        if (o.phases) log << "      trials" << trials << " ms/call; last: " << pool->PhaseReport() << "\n";
        rows.push_back(row);
      }
      // The kernel alone, without a call's sorting, gathering and sums: what its streaming of the
      // weights leaves of the read bandwidth (the portable reference is not a contender).
      if (o.stream_tokens > 0 && kind != experts::KernelKind::kPortable) {
        const experts::ExpertPool::KernelStream ks = pool->MeasureKernelStream(o.stream_tokens);
        const double read = pool->MeasureReadBandwidth(static_cast<size_t>(o.read_bytes), 2);
        log << absl::StrFormat(
            "  %-5s %-10s alone over the arena, %d tokens per expert: gate+up %.1f, down %.1f, both %.1f GB/s "
            "(%.0f%%, %.0f%%, %.0f%% of %.0f GB/s read)\n",
            format_name, kernel_name, o.stream_tokens, ks.gate_up_gbps, ks.down_gbps, ks.all_gbps,
            100 * ks.gate_up_gbps / read, 100 * ks.down_gbps / read, 100 * ks.all_gbps / read, read);
      }
    }
  }
  // The roofline is the best read bandwidth measured anywhere in the run: on a shared host the
  // bandwidth drifts, and the best reading is the conservative bound for every point.
  double best_read = 0;
  for (const ExpertBenchRow& r : rows) best_read = std::max(best_read, r.read_gbps);
  log << absl::StrFormat("\nagainst the best read bandwidth of the run, %.1f GB/s:\n", best_read);
  for (ExpertBenchRow& r : rows) {
    r.read_gbps = best_read;
    r.ratio = r.weight_gbps / best_read;
    log << absl::StrFormat("  %-5s %-10s batch %5d: %8.3f ms/call  %6.1f GB/s  %4.0f%%  %6.2f TFLOP/s\n", r.format,
                           r.kernel, r.batch, r.ms_per_call, r.weight_gbps, 100 * r.ratio, r.tflops);
  }
  // Where the batches are large enough for the arithmetic to matter: each kernel's speed against
  // the AVX-512 path of its format (avx512 for bf16, vnni for int8 and int4), same run. Beside it,
  // the most any kernel could reach: every call reads its experts' weights at least once, so no
  // call is shorter than reading them at the best read bandwidth of the run.
  bool header = false;
  for (const ExpertBenchRow& base : rows) {
    const std::string avx512 = base.format == "bf16" ? "avx512" : "vnni";
    if (base.batch < 64 || base.kernel != avx512) continue;
    for (const ExpertBenchRow& r : rows) {
      if (r.format != base.format || r.batch != base.batch || r.kernel == avx512 || r.kernel == "portable") {
        continue;
      }
      if (!header) log << "\nagainst the AVX-512 path of each format:\n";
      header = true;
      const double read_ms = r.weight_gbps * r.ms_per_call / r.read_gbps;
      log << absl::StrFormat("  %-5s %-10s batch %5d: %.2fx %s (its weights take %.3f ms to read: at most %.2fx)\n",
                             r.format, r.kernel, r.batch, base.ms_per_call / r.ms_per_call, avx512, read_ms,
                             base.ms_per_call / read_ms);
    }
  }
  return rows;
}

void PrintExpertBenchJson(const std::vector<ExpertBenchRow>& rows, std::ostream& out) {
  nlohmann::ordered_json json = nlohmann::ordered_json::array();
  for (const ExpertBenchRow& r : rows) {
    json.push_back({{"format", r.format},
                    {"kernel", r.kernel},
                    {"batch", r.batch},
                    {"ms_per_call", r.ms_per_call},
                    {"weight_gbps", r.weight_gbps},
                    {"read_gbps", r.read_gbps},
                    {"ratio", r.ratio},
                    {"tflops", r.tflops}});
  }
  out << json.dump() << std::endl;
}

}  // namespace moe::bench

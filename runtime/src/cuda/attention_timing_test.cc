// Prints how long the attention kernels take at the shape of the 16-layer Qwen3-30B-A3B model
// (32 heads, 4 kv heads, head_dim 128, KV blocks of 16), beside the device-to-device copy
// bandwidth measured in the same run. Decode is bound by HBM bandwidth, so it reports the bytes
// of K and V read and the ratio to the copy bandwidth; prefill is bound by tensor-core
// throughput, so it reports TFLOP/s. Timing never decides pass or fail here.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "cuda/attention_test_util.h"
#include "cuda/cuda_status.h"
#include "cuda/ops.h"
#include "gtest/gtest.h"

namespace moe::runtime::cuda {
namespace {

using attention_test_util::DecodeRows;
using attention_test_util::DeviceArray;
using attention_test_util::DeviceStep;
using attention_test_util::ExpectNoCudaError;
using attention_test_util::HostStep;
using attention_test_util::MakeStep;
using attention_test_util::Shape;

constexpr Shape kShape{32, 4, 128, 16};
constexpr int kLayers = 16;

class EventTimer {
 public:
  explicit EventTimer(cudaStream_t stream) : stream_(stream) {
    EXPECT_EQ(cudaEventCreate(&start_), cudaSuccess);
    EXPECT_EQ(cudaEventCreate(&stop_), cudaSuccess);
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Milliseconds of `work` enqueued on the stream, measured by events around it.
  float Time(const std::function<void()>& work) {
    EXPECT_EQ(cudaEventRecord(start_, stream_), cudaSuccess);
    work();
    EXPECT_EQ(cudaEventRecord(stop_, stream_), cudaSuccess);
    EXPECT_EQ(cudaEventSynchronize(stop_), cudaSuccess);
    float ms = 0.0f;
    EXPECT_EQ(cudaEventElapsedTime(&ms, start_, stop_), cudaSuccess);
    return ms;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

// A cache and queries of small finite values (0x3c3c as bf16 is about 0.0115); timing does not
// depend on them.
void FillForTiming(void* p, size_t bytes) { EXPECT_EQ(cudaMemset(p, 0x3c, bytes), cudaSuccess); }

// Launches `launch` kIters times inside one graph and times a replay, the way the backend runs
// decode steps: per-launch time without the host's launch overhead.
float GraphTimePerLaunchMs(cudaStream_t stream, EventTimer& timer, const std::function<void()>& launch) {
  constexpr int kIters = 50;
  launch();  // eager first: picks up one-time setup outside the capture
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  for (int i = 0; i < kIters; ++i) launch();
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);  // warm up
  const float ms = timer.Time([&] { EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return ms / kIters;
}

TEST(AttentionTimingTest, PrintsDecodeAndPrefillTimes) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  EventTimer timer(stream);
  const int d = kShape.head_dim;

  // The roofline: a device-to-device copy reads and writes every byte once.
  double copy_gbps = 0.0;
  {
    const size_t bytes = size_t{1} << 30;
    DeviceArray<char> a(bytes), b(bytes);
    FillForTiming(a.get(), bytes);
    EXPECT_EQ(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
    const int reps = 10;
    const float ms = timer.Time([&] {
      for (int i = 0; i < reps; ++i) {
        EXPECT_EQ(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
      }
    });
    copy_gbps = 2.0 * bytes * reps / (ms * 1e-3) / 1e9;
    std::printf("device copy: %.0f GB/s (read + write)\n", copy_gbps);
  }

  std::mt19937 rng(1);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int batch : {1, 8, 32}) {
    const int kv_len = 2048;
    const HostStep h = MakeStep(DecodeRows(std::vector<int>(batch, kv_len)), kShape.block_size, false, rng);
    DeviceStep step(h);
    const size_t cache = static_cast<size_t>(h.num_blocks) * kShape.kv_heads * kShape.block_size * d;
    DeviceArray<uint16_t> k(cache), v(cache), q(static_cast<size_t>(batch) * kShape.num_heads * d),
        out(static_cast<size_t>(batch) * kShape.num_heads * d);
    DeviceArray<float> workspace(AttentionWorkspaceFloats(batch, kv_len, kShape.num_heads, d));
    FillForTiming(k.get(), k.bytes());
    FillForTiming(v.get(), v.bytes());
    FillForTiming(q.get(), q.bytes());
    const KvLayer kv{k.get(), v.get(), kShape.block_size, kShape.kv_heads, d};
    const float ms = GraphTimePerLaunchMs(stream, timer, [&] {
      PagedAttention(q.get(), step.meta, kShape.num_heads, kv, scale, workspace.get(), out.get(), stream);
    });
    ExpectNoCudaError("decode timing");
    const double bytes_read = 2.0 * batch * kShape.kv_heads * kv_len * d * sizeof(uint16_t);
    const double gbps = bytes_read / (ms * 1e-3) / 1e9;
    std::printf("decode batch %2d, kv %d: %7.2f us a layer, %6.1f MB of K/V, %5.0f GB/s (%.0f%% of copy)\n", batch,
                kv_len, ms * 1e3, bytes_read / 1e6, gbps, 100.0 * gbps / copy_gbps);
  }

  {
    const int tokens = 2048;
    const HostStep h = MakeStep({{0, tokens}}, kShape.block_size, false, rng);
    DeviceStep step(h);
    const size_t cache = static_cast<size_t>(h.num_blocks) * kShape.kv_heads * kShape.block_size * d;
    const int total_heads = kShape.num_heads + 2 * kShape.kv_heads;
    DeviceArray<uint16_t> k(cache), v(cache), qkv(static_cast<size_t>(tokens) * total_heads * d),
        q(static_cast<size_t>(tokens) * kShape.num_heads * d), out(static_cast<size_t>(tokens) * kShape.num_heads * d);
    DeviceArray<float> workspace(AttentionWorkspaceFloats(tokens, tokens, kShape.num_heads, d));
    DeviceArray<float> norm(d), inv_freq(d / 2);
    const std::vector<float> ones(d, 1.0f), freqs(d / 2, 1e-3f);
    norm.Upload(ones);
    inv_freq.Upload(freqs);
    FillForTiming(k.get(), k.bytes());
    FillForTiming(v.get(), v.bytes());
    FillForTiming(qkv.get(), qkv.bytes());
    const KvLayer kv{k.get(), v.get(), kShape.block_size, kShape.kv_heads, d};
    auto store = [&] {
      QkNormRopeStoreKv(qkv.get(), step.meta, kShape.num_heads, kv, norm.get(), norm.get(), 1e-6f, d, inv_freq.get(),
                        q.get(), stream);
    };
    auto attend = [&] {
      PagedAttention(q.get(), step.meta, kShape.num_heads, kv, scale, workspace.get(), out.get(), stream);
    };
    store();
    attend();
    ExpectNoCudaError("prefill warm-up");
    const int reps = 10;
    const float store_ms = timer.Time([&] {
      for (int i = 0; i < reps; ++i) store();
    }) / reps;
    const float attend_ms = timer.Time([&] {
      for (int i = 0; i < reps; ++i) attend();
    }) / reps;
    ExpectNoCudaError("prefill timing");
    // Causal: row i attends to i + 1 keys; QK^T and PV are 2 * d flops a key each.
    const double flops = 4.0 * d * kShape.num_heads * (static_cast<double>(tokens) * (tokens + 1) / 2);
    std::printf(
        "prefill %d tokens: attention %.3f ms a layer (%.0f TFLOP/s), %.2f ms for %d layers; "
        "qk-norm+rope+store %.1f us a layer\n",
        tokens, attend_ms, flops / (attend_ms * 1e-3) / 1e12, attend_ms * kLayers, kLayers, store_ms * 1e3);
  }

  {
    // One decode row through the store kernel: its latency, not bandwidth, is what a step pays.
    const HostStep h = MakeStep(DecodeRows({2048}), kShape.block_size, false, rng);
    DeviceStep step(h);
    const size_t cache = static_cast<size_t>(h.num_blocks) * kShape.kv_heads * kShape.block_size * d;
    const int total_heads = kShape.num_heads + 2 * kShape.kv_heads;
    DeviceArray<uint16_t> k(cache), v(cache), qkv(static_cast<size_t>(total_heads) * d),
        q(static_cast<size_t>(kShape.num_heads) * d);
    DeviceArray<float> norm(d), inv_freq(d / 2);
    FillForTiming(qkv.get(), qkv.bytes());
    FillForTiming(norm.get(), norm.bytes());
    FillForTiming(inv_freq.get(), inv_freq.bytes());
    const KvLayer kv{k.get(), v.get(), kShape.block_size, kShape.kv_heads, d};
    const float ms = GraphTimePerLaunchMs(stream, timer, [&] {
      QkNormRopeStoreKv(qkv.get(), step.meta, kShape.num_heads, kv, norm.get(), norm.get(), 1e-6f, d, inv_freq.get(),
                        q.get(), stream);
    });
    ExpectNoCudaError("store timing");
    std::printf("qk-norm+rope+store, 1 row: %.2f us a layer\n", ms * 1e3);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace moe::runtime::cuda

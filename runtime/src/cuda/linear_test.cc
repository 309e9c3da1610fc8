// Linear (linear.h) against a double-precision reference, on every path it has: the GEMV for
// small M, cuBLASLt (with the fp32 bias in its epilogue where it takes it) and cuBLASLt with the
// bias kernel after it; its argument checks; capture into a CUDA graph and replay with new data;
// and a timing case that prints rooflines and never fails on time.
#include "cuda/linear.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_status.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"

namespace moe::runtime::cuda {
namespace {

#define ASSERT_CUDA(call)                                                                    \
  do {                                                                                       \
    const cudaError_t cuda_error_ = (call);                                                  \
    ASSERT_EQ(cuda_error_, cudaSuccess) << #call << ": " << cudaGetErrorString(cuda_error_); \
  } while (0)
#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;
constexpr size_t kTailBytes = 256;  // poisoned bytes after every output, which must stay so

struct CudaFree {
  void operator()(void* p) const noexcept { (void)cudaFree(p); }
};
using DevicePtr = std::unique_ptr<void, CudaFree>;

DevicePtr DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  return DevicePtr(p);
}

struct LinearDelete {
  void operator()(Linear* l) const noexcept { delete l; }
};
using LinearPtr = std::unique_ptr<Linear, LinearDelete>;

LinearPtr MakeLinear(void* workspace, const Linear::Options& options) {
  Linear* raw = nullptr;
  const absl::Status status = Linear::Create(workspace, kWorkspaceBytes, options, &raw);
  EXPECT_TRUE(status.ok()) << status;
  return LinearPtr(raw);
}

// Uniform magnitudes in [0.25, 1] with random signs: never zero, and every term matters.
std::vector<uint16_t> RandomBf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> magnitude(0.25f, 1.0f);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = core::FloatToBf16((rng() & 1) ? magnitude(rng) : -magnitude(rng));
  return v;
}

std::vector<float> ToFloat(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = core::Bf16ToFloat(v[i]);
  return f;
}

// The products' natural scale: sqrt(k) * E|x|^2, about the spread of one output.
double OutputScale(int k) { return std::sqrt(double(k)) * 0.44; }

// Operands on the host (as floats, for the reference) and on the device.
struct Operands {
  int max_m = 0, max_n = 0, max_k = 0;
  std::vector<uint16_t> x, w;
  std::vector<float> xf, wf, bias;  // bias before scaling by OutputScale(k)
  DevicePtr d_x, d_w, d_bias, d_out;

  bool Init(int m, int n, int k, uint32_t seed) {
    max_m = m, max_n = n, max_k = k;
    x = RandomBf16(size_t{1} * m * k, seed);
    w = RandomBf16(size_t{1} * n * k, seed + 1);
    xf = ToFloat(x);
    wf = ToFloat(w);
    std::mt19937 rng(seed + 2);
    std::uniform_real_distribution<float> magnitude(1.0f, 2.0f);
    bias.resize(n);
    for (float& b : bias) b = (rng() & 1) ? magnitude(rng) : -magnitude(rng);
    d_x = DeviceAlloc(x.size() * 2);
    d_w = DeviceAlloc(w.size() * 2);
    d_bias = DeviceAlloc(size_t{1} * n * 4);
    d_out = DeviceAlloc(size_t{1} * m * n * 4 + kTailBytes);
    return d_x && d_w && d_bias && d_out &&
           cudaMemcpy(d_x.get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
           cudaMemcpy(d_w.get(), w.data(), w.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  // The bias for a product over k, large enough that a lost or misread bias cannot pass.
  std::vector<float> BiasFor(int n, int k) const {
    std::vector<float> b(bias.begin(), bias.begin() + n);
    for (float& v : b) v *= static_cast<float>(OutputScale(k));
    return b;
  }
};

// out [m x n] from x = the first m*k of `xf` as [m x k], w = the first n*k of `wf` as [n x k].
// The worst error of the checked outputs relative to max(|want|, the dot's natural scale
// sqrt(sum (x_i w_i)^2)), and the count of non-finite outputs (a NaN never compares worse).
struct Checked {
  double worst = 0;
  int64_t non_finite = 0;
  int64_t count = 0;
  std::string where;
};

Checked CheckProduct(const std::vector<float>& xf, const std::vector<float>& wf, const std::vector<float>* bias, int m,
                     int n, int k, const std::vector<float>& got) {
  std::vector<std::pair<int, int>> cells;
  if (int64_t{m} * n <= (int64_t{1} << 16)) {
    for (int r = 0; r < m; ++r) {
      for (int c = 0; c < n; ++c) cells.emplace_back(r, c);
    }
  } else {
    for (int c = 0; c < n; ++c) cells.emplace_back(0, c), cells.emplace_back(m - 1, c);
    for (int r = 0; r < m; ++r) cells.emplace_back(r, 0), cells.emplace_back(r, n - 1);
    std::mt19937 rng(m * 31 + n * 7 + k);
    for (int i = 0; i < 8192; ++i) cells.emplace_back(rng() % m, rng() % n);
  }
  Checked result;
  for (const auto& [r, c] : cells) {
    const float* xr = &xf[size_t{1} * r * k];
    const float* wr = &wf[size_t{1} * c * k];
    double dot = 0, sq = 0;
    for (int i = 0; i < k; ++i) {
      const double p = double(xr[i]) * wr[i];
      dot += p;
      sq += p * p;
    }
    // The product is rounded to bf16 before the bias is added when cuBLASLt keeps the bias in
    // the output's type, so the error scales with the product as well as with the sum.
    const double product = dot;
    if (bias != nullptr) dot += (*bias)[c];
    const float g = got[size_t{1} * r * n + c];
    ++result.count;
    if (!std::isfinite(g)) {
      ++result.non_finite;
      continue;
    }
    const double err = std::abs(g - dot) / std::max({std::abs(dot), std::abs(product), std::sqrt(sq)});
    if (err > result.worst) {
      result.worst = err;
      result.where = "out[" + std::to_string(r) + "][" + std::to_string(c) + "] = " + std::to_string(g) + ", want " +
                     std::to_string(dot);
    }
  }
  return result;
}

// Runs one product into the poisoned output and checks it, the tail and the launch.
void RunAndCheck(Linear& linear, const Operands& ops, int m, int n, int k, bool with_bias, bool out_f32,
                 const char* path) {
  SCOPED_TRACE(std::string(path) + " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
               (with_bias ? " bias" : "") + (out_f32 ? " fp32 out" : " bf16 out"));
  const std::vector<float> bias = ops.BiasFor(n, k);
  ASSERT_CUDA(cudaMemcpy(ops.d_bias.get(), bias.data(), bias.size() * 4, cudaMemcpyHostToDevice));
  const size_t out_bytes = size_t{1} * m * n * (out_f32 ? 4 : 2);
  ASSERT_CUDA(cudaMemset(ops.d_out.get(), 0xff, out_bytes + kTailBytes));
  ASSERT_OK(linear.Run(static_cast<const uint16_t*>(ops.d_x.get()), m, static_cast<const uint16_t*>(ops.d_w.get()), n,
                       k, with_bias ? static_cast<const float*>(ops.d_bias.get()) : nullptr, ops.d_out.get(), out_f32,
                       nullptr));
  ASSERT_CUDA(cudaGetLastError());
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> bytes(out_bytes + kTailBytes);
  ASSERT_CUDA(cudaMemcpy(bytes.data(), ops.d_out.get(), bytes.size(), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::all_of(bytes.begin() + out_bytes, bytes.end(), [](uint8_t b) { return b == 0xff; }))
      << "wrote past the end of out";
  std::vector<float> got(size_t{1} * m * n);
  if (out_f32) {
    std::memcpy(got.data(), bytes.data(), out_bytes);
  } else {
    for (size_t i = 0; i < got.size(); ++i) {
      uint16_t v;
      std::memcpy(&v, &bytes[2 * i], 2);
      got[i] = core::Bf16ToFloat(v);
    }
  }
  const Checked c = CheckProduct(ops.xf, ops.wf, with_bias ? &bias : nullptr, m, n, k, got);
  EXPECT_EQ(c.non_finite, 0) << "of " << c.count << " checked outputs";
  EXPECT_LT(c.worst, 1e-2) << c.where;
}

constexpr int kMs[] = {1, 3, 32, 300, 2048};
constexpr int kNs[] = {64, 1536, 2048, 4096, 4104};
constexpr int kKs[] = {64, 1544, 2048, 4096};

class LinearSweepTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(LinearSweepTest, MatchesTheDoubleReferenceOnEveryPath) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const auto [m, n] = GetParam();
  const int max_k = *std::max_element(std::begin(kKs), std::end(kKs));
  Operands ops;
  ASSERT_TRUE(ops.Init(m, n, max_k, m * 1000 + n));
  DevicePtr workspace = DeviceAlloc(kWorkspaceBytes);
  ASSERT_TRUE(workspace);
  LinearPtr standard = MakeLinear(workspace.get(), Linear::Options());
  Linear::Options no_gemv;
  no_gemv.gemv_for_small_m = false;
  LinearPtr cublaslt = MakeLinear(workspace.get(), no_gemv);
  Linear::Options bias_kernel = no_gemv;
  bias_kernel.f32_bias_in_bf16_epilogue = false;
  LinearPtr with_bias_kernel = MakeLinear(workspace.get(), bias_kernel);
  ASSERT_TRUE(standard && cublaslt && with_bias_kernel);
  for (int k : kKs) {
    for (bool with_bias : {false, true}) {
      for (bool out_f32 : {false, true}) {
        RunAndCheck(*standard, ops, m, n, k, with_bias, out_f32, "default");
        if (m <= Linear::kMaxGemvRows) RunAndCheck(*cublaslt, ops, m, n, k, with_bias, out_f32, "cublaslt");
        if (with_bias && !out_f32) RunAndCheck(*with_bias_kernel, ops, m, n, k, with_bias, out_f32, "bias kernel");
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearSweepTest,
                         ::testing::Combine(::testing::ValuesIn(kMs), ::testing::ValuesIn(kNs)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return absl::StrCat("m", std::get<0>(info.param), "_n", std::get<1>(info.param));
                         });

TEST(LinearTest, EveryGemvBatchSizeAndSplit) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  // Every M of the GEMV, with n from one block to many and k from below one chunk per lane to
  // several unrolled rounds with a remainder.
  Operands ops;
  ASSERT_TRUE(ops.Init(8, 8200, 4104, 77));
  DevicePtr workspace = DeviceAlloc(kWorkspaceBytes);
  ASSERT_TRUE(workspace);
  LinearPtr linear = MakeLinear(workspace.get(), Linear::Options());
  ASSERT_TRUE(linear);
  for (int m = 1; m <= Linear::kMaxGemvRows; ++m) {
    for (int n : {8, 24, 136, 8200}) {
      for (int k : {8, 40, 256, 2056, 4104}) RunAndCheck(*linear, ops, m, n, k, m % 2 == 1, m % 3 == 0, "gemv");
    }
  }
}

TEST(LinearTest, SixteenByteAlignedOperandsGetTheirOwnPlan) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  constexpr int m = 64, n = 512, k = 256;
  Operands ops;
  ASSERT_TRUE(ops.Init(m + 1, n + 8, k, 5));
  DevicePtr workspace = DeviceAlloc(kWorkspaceBytes);
  ASSERT_TRUE(workspace);
  LinearPtr linear = MakeLinear(workspace.get(), Linear::Options());
  ASSERT_TRUE(linear);
  // First at 256-byte alignment, then x, w, bias and out each 16 bytes past it.
  RunAndCheck(*linear, ops, m, n, k, true, false, "aligned");
  const uint16_t* x = static_cast<const uint16_t*>(ops.d_x.get()) + 8;
  const uint16_t* w = static_cast<const uint16_t*>(ops.d_w.get()) + 8;
  const float* bias = static_cast<const float*>(ops.d_bias.get()) + 4;
  uint16_t* out = static_cast<uint16_t*>(ops.d_out.get()) + 8;
  const std::vector<float> full_bias = ops.BiasFor(n + 8, k);
  ASSERT_CUDA(cudaMemcpy(ops.d_bias.get(), full_bias.data(), full_bias.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemset(ops.d_out.get(), 0xff, size_t{2} * m * n + 64));
  ASSERT_OK(linear->Run(x, m, w, n, k, bias, out, false, nullptr));
  ASSERT_CUDA(cudaGetLastError());
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> raw(size_t{1} * m * n);
  ASSERT_CUDA(cudaMemcpy(raw.data(), out, raw.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> got = ToFloat(raw);
  // The shifted operands are the pools read from element 8 (x, w) and 4 (bias).
  std::vector<float> xf(ops.xf.begin() + 8, ops.xf.end()), wf(ops.wf.begin() + 8, ops.wf.end());
  std::vector<float> b(full_bias.begin() + 4, full_bias.begin() + 4 + n);
  const Checked c = CheckProduct(xf, wf, &b, m, n, k, got);
  EXPECT_EQ(c.non_finite, 0);
  EXPECT_LT(c.worst, 1e-2) << c.where;
}

TEST(LinearTest, RejectsShapesAndPointersCublasLtCannotTake) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  DevicePtr workspace = DeviceAlloc(kWorkspaceBytes);
  DevicePtr x = DeviceAlloc(1 << 20), w = DeviceAlloc(1 << 20), bias = DeviceAlloc(1 << 16), out = DeviceAlloc(1 << 20);
  ASSERT_TRUE(workspace && x && w && bias && out);
  LinearPtr linear = MakeLinear(workspace.get(), Linear::Options());
  ASSERT_TRUE(linear);
  const auto* xp = static_cast<const uint16_t*>(x.get());
  const auto* wp = static_cast<const uint16_t*>(w.get());
  const auto* bp = static_cast<const float*>(bias.get());
  auto code = [&](const uint16_t* xx, int m, const uint16_t* ww, int n, int k, const float* b, void* o) {
    return linear->Run(xx, m, ww, n, k, b, o, false, nullptr).code();
  };
  EXPECT_EQ(code(xp, 4, wp, 4100, 64, nullptr, out.get()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp, 4, wp, 64, 12, nullptr, out.get()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp, 0, wp, 64, 64, nullptr, out.get()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp, 4, wp, -8, 64, nullptr, out.get()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp + 1, 64, wp, 64, 64, nullptr, out.get()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp, 64, wp + 4, 64, 64, nullptr, out.get()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp, 64, wp, 64, 64, bp + 1, out.get()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp, 64, wp, 64, 64, nullptr, static_cast<uint16_t*>(out.get()) + 1),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(nullptr, 64, wp, 64, 64, nullptr, out.get()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp, 64, nullptr, 64, 64, nullptr, out.get()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp, 64, wp, 64, 64, nullptr, nullptr), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(xp, 1, wp, 64, 12, nullptr, out.get()), absl::StatusCode::kInvalidArgument);  // the GEMV too
  ASSERT_CUDA(cudaGetLastError());
  ASSERT_CUDA(cudaDeviceSynchronize());
}

TEST(LinearTest, PlansEachShapeOnce) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  Operands ops;
  ASSERT_TRUE(ops.Init(64, 1024, 512, 9));
  DevicePtr workspace = DeviceAlloc(kWorkspaceBytes);
  ASSERT_TRUE(workspace);
  LinearPtr linear = MakeLinear(workspace.get(), Linear::Options());
  ASSERT_TRUE(linear);
  EXPECT_EQ(linear->PlanName(64, 1024, 512, true, false), "not planned");
  RunAndCheck(*linear, ops, 64, 1024, 512, true, false, "bf16 out");
  RunAndCheck(*linear, ops, 64, 1024, 512, true, true, "fp32 out");
  RunAndCheck(*linear, ops, 64, 1024, 512, false, false, "no bias");
  RunAndCheck(*linear, ops, 1, 1024, 512, true, false, "decode");
  const std::string bf16_bias = linear->PlanName(64, 1024, 512, true, false);
  EXPECT_TRUE(bf16_bias == "cublaslt+f32 bias epilogue" || bf16_bias == "cublaslt+bias kernel") << bf16_bias;
  EXPECT_EQ(linear->PlanName(64, 1024, 512, true, true), "cublaslt+f32 bias epilogue");
  EXPECT_EQ(linear->PlanName(64, 1024, 512, false, false), "cublaslt");
  EXPECT_EQ(linear->PlanName(1, 1024, 512, true, false), "gemv");
  std::printf("cuBLASLt, bf16 output with an fp32 bias: %s\n", bf16_bias.c_str());
}

// ---- CUDA graphs ----

struct StreamDestroy {
  void operator()(cudaStream_t s) const noexcept { (void)cudaStreamDestroy(s); }
};
struct GraphDestroy {
  void operator()(cudaGraph_t g) const noexcept { (void)cudaGraphDestroy(g); }
};
struct GraphExecDestroy {
  void operator()(cudaGraphExec_t g) const noexcept { (void)cudaGraphExecDestroy(g); }
};
using Stream = std::unique_ptr<CUstream_st, StreamDestroy>;
using Graph = std::unique_ptr<CUgraph_st, GraphDestroy>;
using GraphExec = std::unique_ptr<CUgraphExec_st, GraphExecDestroy>;

// New data in the captured buffers, a replay, and the new product checked.
void ReplayWithNewData(cudaGraphExec_t exec, cudaStream_t stream, const Operands& buffers, int m, int n, int k,
                       bool out_f32, uint32_t seed) {
  SCOPED_TRACE("replay with seed " + std::to_string(seed));
  const std::vector<uint16_t> x = RandomBf16(size_t{1} * m * k, seed);
  const std::vector<uint16_t> w = RandomBf16(size_t{1} * n * k, seed + 1);
  std::vector<float> bias = buffers.BiasFor(n, k);
  for (float& b : bias) b = -0.5f * b + static_cast<float>(seed % 7);
  ASSERT_CUDA(cudaMemcpy(buffers.d_x.get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(buffers.d_w.get(), w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(buffers.d_bias.get(), bias.data(), bias.size() * 4, cudaMemcpyHostToDevice));
  const size_t out_bytes = size_t{1} * m * n * (out_f32 ? 4 : 2);
  ASSERT_CUDA(cudaMemset(buffers.d_out.get(), 0xff, out_bytes));
  ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> got(size_t{1} * m * n);
  if (out_f32) {
    ASSERT_CUDA(cudaMemcpy(got.data(), buffers.d_out.get(), out_bytes, cudaMemcpyDeviceToHost));
  } else {
    std::vector<uint16_t> raw(got.size());
    ASSERT_CUDA(cudaMemcpy(raw.data(), buffers.d_out.get(), out_bytes, cudaMemcpyDeviceToHost));
    got = ToFloat(raw);
  }
  const Checked c = CheckProduct(ToFloat(x), ToFloat(w), &bias, m, n, k, got);
  EXPECT_EQ(c.non_finite, 0);
  EXPECT_LT(c.worst, 1e-2) << c.where;
}

// A fresh Linear each time, so that "first seen in capture" means it.
void CaptureAndReplay(void* workspace, const Linear::Options& options, int m, int n, int k, bool out_f32,
                      bool run_eagerly_first) {
  SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
               (run_eagerly_first ? " seen before capture" : " first seen in capture"));
  LinearPtr owned = MakeLinear(workspace, options);
  ASSERT_TRUE(owned);
  Linear& linear = *owned;
  Operands buffers;
  ASSERT_TRUE(buffers.Init(m, n, k, 1234));
  cudaStream_t raw_stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking));
  Stream stream(raw_stream);
  const auto* x = static_cast<const uint16_t*>(buffers.d_x.get());
  const auto* w = static_cast<const uint16_t*>(buffers.d_w.get());
  const auto* bias = static_cast<const float*>(buffers.d_bias.get());
  if (run_eagerly_first) {
    ASSERT_OK(linear.Run(x, m, w, n, k, bias, buffers.d_out.get(), out_f32, stream.get()));
    ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
  }
  // Global mode: any call that is not allowed during a capture, from any thread, fails it.
  ASSERT_CUDA(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  const absl::Status run = linear.Run(x, m, w, n, k, bias, buffers.d_out.get(), out_f32, stream.get());
  cudaGraph_t raw_graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream.get(), &raw_graph);
  Graph graph(raw_graph);
  ASSERT_TRUE(run.ok()) << run;
  ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
  // Only kernels (cuBLASLt may add a memset for a split-k reduction): no copies, host nodes or
  // events, which would mean work beyond the matmul.
  size_t count = 0;
  ASSERT_CUDA(cudaGraphGetNodes(graph.get(), nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  ASSERT_CUDA(cudaGraphGetNodes(graph.get(), nodes.data(), &count));
  ASSERT_GE(count, 1u);
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    ASSERT_CUDA(cudaGraphNodeGetType(node, &type));
    EXPECT_TRUE(type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemset) << "node type " << type;
  }
  cudaGraphExec_t raw_exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&raw_exec, graph.get(), 0));
  GraphExec exec(raw_exec);
  ReplayWithNewData(exec.get(), stream.get(), buffers, m, n, k, out_f32, 11);
  ReplayWithNewData(exec.get(), stream.get(), buffers, m, n, k, out_f32, 12);
}

TEST(LinearGraphTest, ReplaysWithNewDataInTheSameBuffers) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  DevicePtr workspace = DeviceAlloc(kWorkspaceBytes);
  ASSERT_TRUE(workspace);
  const Linear::Options standard;
  Linear::Options bias_kernel;
  bias_kernel.f32_bias_in_bf16_epilogue = false;
  for (bool eager_first : {true, false}) {
    CaptureAndReplay(workspace.get(), standard, 1, 2048, 1024, false, eager_first);     // GEMV
    CaptureAndReplay(workspace.get(), standard, 5, 1536, 2048, true, eager_first);      // GEMV, fp32 out
    CaptureAndReplay(workspace.get(), standard, 96, 2048, 1024, false, eager_first);    // cuBLASLt, bf16 out
    CaptureAndReplay(workspace.get(), standard, 300, 1032, 2056, true, eager_first);    // cuBLASLt, fp32 out
    CaptureAndReplay(workspace.get(), bias_kernel, 64, 1024, 512, false, eager_first);  // cuBLASLt + bias kernel
  }
}

// ---- Timing (prints only) ----

struct EventDestroy {
  void operator()(cudaEvent_t e) const noexcept { (void)cudaEventDestroy(e); }
};
using Event = std::unique_ptr<CUevent_st, EventDestroy>;

// Milliseconds per repetition of `enqueue`, timed with events over `reps` after a warm-up.
template <typename F>
double TimeMs(cudaStream_t stream, int reps, F&& enqueue) {
  cudaEvent_t a = nullptr, b = nullptr;
  if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) return NAN;
  Event start(a), stop(b);
  enqueue();
  (void)cudaStreamSynchronize(stream);
  (void)cudaEventRecord(start.get(), stream);
  for (int i = 0; i < reps; ++i) enqueue();
  (void)cudaEventRecord(stop.get(), stream);
  if (cudaEventSynchronize(stop.get()) != cudaSuccess) return NAN;
  float ms = 0;
  (void)cudaEventElapsedTime(&ms, start.get(), stop.get());
  return ms / reps;
}

// M=1 products over `copies` weight copies (more bytes than L2 holds, so every read is from
// HBM), captured as one graph so that launch gaps do not count.
void TimeDecode(Linear& linear, const char* path, int m, int n, int k, double copy_gbps, cudaStream_t stream) {
  const size_t weight_bytes = size_t{2} * n * k;
  const int copies = static_cast<int>(std::max<size_t>(2, (size_t{512} << 20) / weight_bytes));
  DevicePtr w = DeviceAlloc(weight_bytes * copies), x = DeviceAlloc(size_t{2} * m * k),
            out = DeviceAlloc(size_t{2} * m * n);
  ASSERT_TRUE(w && x && out);
  ASSERT_CUDA(cudaMemset(w.get(), 0x3c, weight_bytes * copies));  // bf16 ~0.0115: finite, non-zero
  ASSERT_CUDA(cudaMemset(x.get(), 0x3c, size_t{2} * m * k));
  auto run_all = [&]() -> absl::Status {
    for (int c = 0; c < copies; ++c) {
      const auto* wc = reinterpret_cast<const uint16_t*>(static_cast<const char*>(w.get()) + c * weight_bytes);
      absl::Status s =
          linear.Run(static_cast<const uint16_t*>(x.get()), m, wc, n, k, nullptr, out.get(), false, stream);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  };
  ASSERT_OK(run_all());  // plans every call before the capture
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const absl::Status captured = run_all();
  cudaGraph_t raw_graph = nullptr;
  ASSERT_CUDA(cudaStreamEndCapture(stream, &raw_graph));
  Graph graph(raw_graph);
  ASSERT_OK(captured);
  cudaGraphExec_t raw_exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&raw_exec, graph.get(), 0));
  GraphExec exec(raw_exec);
  const double ms = TimeMs(stream, 10, [&] { (void)cudaGraphLaunch(exec.get(), stream); }) / copies;
  ASSERT_CUDA(cudaGetLastError());
  const double bytes = double(weight_bytes) + 2.0 * m * k + 2.0 * m * n;
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  std::printf("Linear m=%d [%d x %d] %-8s (%s): %7.2f us, %7.0f GB/s = %3.0f%% of the device copy\n", m, n, k, path,
              linear.PlanName(m, n, k, false, false).c_str(), ms * 1e3, gbps, 100.0 * gbps / copy_gbps);
}

TEST(LinearTimingTest, PrintsRooflinesNeverFails) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  cudaStream_t raw_stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking));
  Stream stream(raw_stream);

  // The roofline: a device-to-device copy, bytes read plus bytes written.
  double copy_gbps = 0;
  {
    const size_t bytes = size_t{1} << 30;
    DevicePtr src = DeviceAlloc(bytes), dst = DeviceAlloc(bytes);
    ASSERT_TRUE(src && dst);
    ASSERT_CUDA(cudaMemset(src.get(), 1, bytes));
    const double ms = TimeMs(stream.get(), 10, [&] {
      (void)cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream.get());
    });
    copy_gbps = 2.0 * bytes / (ms * 1e-3) / 1e9;
    std::printf("device copy: %.0f GB/s (read + write, 1 GiB)\n", copy_gbps);
  }

  DevicePtr workspace = DeviceAlloc(kWorkspaceBytes);
  ASSERT_TRUE(workspace);
  LinearPtr linear = MakeLinear(workspace.get(), Linear::Options());
  Linear::Options no_gemv;
  no_gemv.gemv_for_small_m = false;
  LinearPtr cublaslt = MakeLinear(workspace.get(), no_gemv);
  ASSERT_TRUE(linear && cublaslt);

  // The bf16 GEMM rate at 8192^3.
  {
    constexpr int kSize = 8192;
    const size_t bytes = size_t{2} * kSize * kSize;
    DevicePtr x = DeviceAlloc(bytes), w = DeviceAlloc(bytes), out = DeviceAlloc(bytes);
    ASSERT_TRUE(x && w && out);
    ASSERT_CUDA(cudaMemset(x.get(), 0x3c, bytes));
    ASSERT_CUDA(cudaMemset(w.get(), 0x3c, bytes));
    absl::Status status;
    const double ms = TimeMs(stream.get(), 10, [&] {
      status.Update(linear->Run(static_cast<const uint16_t*>(x.get()), kSize, static_cast<const uint16_t*>(w.get()),
                                kSize, kSize, nullptr, out.get(), false, stream.get()));
    });
    ASSERT_OK(status);
    ASSERT_CUDA(cudaGetLastError());
    std::printf("Linear bf16 GEMM %d^3: %.3f ms, %.0f TFLOP/s\n", kSize, ms,
                2.0 * kSize * kSize * kSize / (ms * 1e-3) / 1e12);
  }

  // Decode: M=1 (and a batch of 8) is a GEMV bound by reading the weight once.
  for (auto [n, k] : {std::pair{4096, 2048}, std::pair{32768, 2048}}) {
    for (int m : {1, 8}) {
      TimeDecode(*linear, "default", m, n, k, copy_gbps, stream.get());
      TimeDecode(*cublaslt, "cublaslt", m, n, k, copy_gbps, stream.get());
    }
  }
}

}  // namespace
}  // namespace moe::runtime::cuda

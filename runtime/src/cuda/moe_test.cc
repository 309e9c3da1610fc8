// Routed experts on the GPU against a double-precision reference on the CPU: both paths (decode
// GEMV, grouped GEMM) on the same inputs, odd shapes that exercise every tail, routings with a hot
// expert, idle experts and invalid ids, graph replays with new routing, determinism, and guard
// bytes around the output and the workspace. A last case prints bandwidth and throughput.
#include "cuda/moe.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_status.h"
#include "cuda/ops.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"

namespace moe::runtime::cuda {
namespace {

::testing::AssertionResult CudaOk(cudaError_t err) {
  if (err == cudaSuccess) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << cudaGetErrorName(err) << ": " << cudaGetErrorString(err);
}

// Device memory owned by the test; empty when cudaMalloc fails (ok() says so).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)) != cudaSuccess) {
      (void)cudaGetLastError();
      ptr_ = nullptr;
    }
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) { other.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  bool ok() const { return ptr_ != nullptr; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

struct StreamOwner {
  StreamOwner() {
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) stream = nullptr;
  }
  ~StreamOwner() {
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
  cudaStream_t stream = nullptr;
};

template <typename F>
void ParallelFor(int64_t n, F f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), n));
  std::vector<std::thread> pool;
  for (int64_t i = 0; i < threads; ++i) {
    pool.emplace_back([&, i] {
      for (int64_t j = i * n / threads; j < (i + 1) * n / threads; ++j) f(j);
    });
  }
  for (std::thread& t : pool) t.join();
}

// A counter-based generator, so that large arrays fill in parallel and every value depends only
// on (seed, index).
uint64_t SplitMix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
float Uniform(uint64_t seed, uint64_t i) {  // in [-1, 1)
  return static_cast<float>(SplitMix(seed * 0x632be59bd9b4e019ull + i) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

std::vector<uint16_t> RandomBf16(int64_t n, uint64_t seed, float scale) {
  std::vector<uint16_t> v(n);
  const int64_t block = 1 << 20;
  ParallelFor((n + block - 1) / block, [&](int64_t b) {
    for (int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i)
      v[i] = core::FloatToBf16(scale * Uniform(seed, i));
  });
  return v;
}

struct Shape {
  int experts, top_k, hidden, inter;
};
constexpr Shape kSmall{16, 4, 128, 96};
constexpr Shape kReal{128, 8, 2048, 768};  // Qwen3-30B-A3B

ExpertWeights Weights(const Shape& s, const DeviceBuffer& gate_up, const DeviceBuffer& down) {
  ExpertWeights w;
  w.gate_up = gate_up.as<uint16_t>();
  w.down = down.as<uint16_t>();
  w.num_experts = s.experts;
  w.hidden = s.hidden;
  w.intermediate = s.inter;
  return w;
}

// One layer's expert weights, on the host and on the device. Scaled so that gate and up outputs
// have unit variance and SiLU works on both sides of zero.
struct Layer {
  Shape shape;
  std::vector<uint16_t> gate_up, down;
  DeviceBuffer d_gate_up, d_down;

  static std::unique_ptr<Layer> Make(const Shape& s, uint64_t seed) {
    auto l = std::make_unique<Layer>();
    l->shape = s;
    l->gate_up = RandomBf16(int64_t{s.experts} * 2 * s.inter * s.hidden, seed, 3.0f / std::sqrt(float(s.hidden)));
    l->down = RandomBf16(int64_t{s.experts} * s.hidden * s.inter, seed + 1, 3.0f / std::sqrt(float(s.inter)));
    l->d_gate_up = DeviceBuffer(l->gate_up.size() * 2);
    l->d_down = DeviceBuffer(l->down.size() * 2);
    if (!l->d_gate_up.ok() || !l->d_down.ok()) return nullptr;
    if (cudaMemcpy(l->d_gate_up.as<void>(), l->gate_up.data(), l->gate_up.size() * 2, cudaMemcpyHostToDevice) !=
            cudaSuccess ||
        cudaMemcpy(l->d_down.as<void>(), l->down.data(), l->down.size() * 2, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {  // a pageable copy may return before its DMA lands
      return nullptr;
    }
    return l;
  }
  ExpertWeights weights() const { return Weights(shape, d_gate_up, d_down); }
};

enum class Routing {
  kRandom,     // k distinct experts per token, uniform
  kHotExpert,  // every token's first slot is expert 3: one expert has all T tokens
  kEvenOnly,   // only even experts: the odd ones never get a token
  kInvalid,    // about one slot in five holds an id outside [0, E): it must add nothing
};

// The inputs of one call: x [T x H] bf16, ids and weights [T x k].
struct Inputs {
  int tokens = 0;
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Inputs MakeInputs(const Shape& s, int tokens, Routing routing, uint64_t seed) {
  Inputs in;
  in.tokens = tokens;
  in.x = RandomBf16(int64_t{tokens} * s.hidden, seed, 1.0f);
  in.ids.resize(int64_t{tokens} * s.top_k);
  in.weights.resize(in.ids.size());
  std::vector<int32_t> pool;
  for (int e = 0; e < s.experts; ++e) {
    if (routing != Routing::kEvenOnly || e % 2 == 0) pool.push_back(e);
  }
  uint64_t draw = 0;
  auto next = [&](uint64_t bound) { return SplitMix(seed * 7919 + 1000003 + draw++) % bound; };
  const int32_t kInvalidIds[] = {-1, s.experts, s.experts + 7, INT_MAX, INT_MIN, -s.experts};
  for (int t = 0; t < tokens; ++t) {
    std::vector<int32_t> p = pool;
    int first = 0;
    if (routing == Routing::kHotExpert) {
      std::swap(p[0], p[3]);  // expert 3 first, the others drawn from the rest: still distinct
      first = 1;
    }
    for (int j = first; j < s.top_k; ++j) std::swap(p[j], p[j + next(p.size() - j)]);  // partial shuffle
    for (int j = 0; j < s.top_k; ++j) {
      int32_t id = p[j];
      if (routing == Routing::kInvalid && next(5) == 0) id = kInvalidIds[next(std::size(kInvalidIds))];
      in.ids[int64_t{t} * s.top_k + j] = id;
      in.weights[int64_t{t} * s.top_k + j] = 0.05f + 0.95f * (0.5f + 0.5f * Uniform(seed + 99, t * s.top_k + j));
    }
  }
  return in;
}

// out[t] = sum_j w * down_e(silu(gate_e x) * up_e x) in double from the exact bf16 values.
std::vector<double> Reference(const Layer& layer, const Inputs& in) {
  const Shape& s = layer.shape;
  const int64_t H = s.hidden, I = s.inter;
  std::vector<double> out(in.tokens * H, 0.0);
  ParallelFor(in.tokens, [&](int64_t t) {
    std::vector<double> x(H), act(I);
    for (int64_t h = 0; h < H; ++h) x[h] = core::Bf16ToFloat(in.x[t * H + h]);
    for (int j = 0; j < s.top_k; ++j) {
      const int32_t e = in.ids[t * s.top_k + j];
      if (e < 0 || e >= s.experts) continue;
      auto dot = [](const uint16_t* row, const double* v, int64_t n) {
        double a[4] = {0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
          for (int u = 0; u < 4; ++u) a[u] += core::Bf16ToFloat(row[i + u]) * v[i + u];
        }
        for (; i < n; ++i) a[0] += core::Bf16ToFloat(row[i]) * v[i];
        return (a[0] + a[1]) + (a[2] + a[3]);
      };
      const uint16_t* gu = layer.gate_up.data() + e * 2 * I * H;
      for (int64_t i = 0; i < I; ++i) {
        const double g = dot(gu + i * H, x.data(), H), u = dot(gu + (I + i) * H, x.data(), H);
        act[i] = g / (1.0 + std::exp(-g)) * u;
      }
      const uint16_t* dn = layer.down.data() + e * H * I;
      const double w = in.weights[t * s.top_k + j];
      for (int64_t h = 0; h < H; ++h) out[t * H + h] += w * dot(dn + h * I, act.data(), I);
    }
  });
  return out;
}

// Relative L2 error over the whole output and the worst over token rows; a row whose reference is
// zero (every slot invalid) must come out exactly zero.
struct Errors {
  double total = 0, worst_row = 0;
  int worst_row_index = -1;
  int64_t non_finite = 0;
  int zero_rows_not_zero = 0;
};
Errors Compare(const std::vector<float>& got, const std::vector<double>& want, int tokens, int hidden) {
  Errors r;
  double diff_all = 0, ref_all = 0;
  for (int t = 0; t < tokens; ++t) {
    double diff = 0, ref = 0;
    for (int h = 0; h < hidden; ++h) {
      const double g = got[int64_t{t} * hidden + h], w = want[int64_t{t} * hidden + h];
      if (!std::isfinite(g)) ++r.non_finite;
      diff += (g - w) * (g - w);
      ref += w * w;
    }
    diff_all += diff;
    ref_all += ref;
    if (ref == 0) {
      if (diff != 0) ++r.zero_rows_not_zero;
      continue;
    }
    const double rel = std::sqrt(diff / ref);
    if (!(rel <= r.worst_row)) {  // NaN counts as worst
      r.worst_row = rel;
      r.worst_row_index = t;
    }
  }
  r.total = ref_all > 0 ? std::sqrt(diff_all / ref_all) : std::sqrt(diff_all);
  return r;
}

constexpr size_t kGuardBytes = 1 << 16;
constexpr uint8_t kGuardByte = 0xa5;

bool GuardIntact(const DeviceBuffer& buf, size_t from, cudaStream_t stream) {
  std::vector<uint8_t> host(buf.bytes() - from);
  if (cudaMemcpyAsync(host.data(), buf.as<uint8_t>() + from, host.size(), cudaMemcpyDeviceToHost, stream) !=
          cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess) {
    return false;
  }
  return std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == kGuardByte; });
}

// Device copies of one call's inputs, the output (NaN-poisoned before each run) and the
// workspace (sized for max_tokens, poisoned before each run), each followed by guard bytes that
// must survive the call. Every copy and memset goes on the runner's stream, the one the kernels
// run on: the legacy default stream is not ordered with a non-blocking stream.
class Runner {
 public:
  Runner(const Shape& s, int max_tokens)
      : shape_(s),
        max_tokens_(max_tokens),
        ws_bytes_(MoeWorkspaceBytes(max_tokens, s.top_k, s.experts, s.hidden, s.inter)),
        x_(size_t(max_tokens) * s.hidden * 2),
        ids_(size_t(max_tokens) * s.top_k * 4),
        weights_(size_t(max_tokens) * s.top_k * 4),
        out_(size_t(max_tokens) * s.hidden * 4 + kGuardBytes),
        workspace_(ws_bytes_ + kGuardBytes) {}

  ::testing::AssertionResult Upload(const Inputs& in) {
    if (!x_.ok() || !ids_.ok() || !weights_.ok() || !out_.ok() || !workspace_.ok() || stream_.stream == nullptr) {
      return ::testing::AssertionFailure() << "device allocation failed";
    }
    if (in.tokens > max_tokens_) return ::testing::AssertionFailure() << "more tokens than the runner holds";
    tokens_ = in.tokens;
    const cudaStream_t st = stream_.stream;
    for (cudaError_t err :
         {cudaMemcpyAsync(x_.as<void>(), in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice, st),
          cudaMemcpyAsync(ids_.as<void>(), in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice, st),
          cudaMemcpyAsync(weights_.as<void>(), in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice, st),
          cudaStreamSynchronize(st)}) {
      if (err != cudaSuccess) return CudaOk(err);
    }
    return ::testing::AssertionSuccess();
  }

  // Poisons out (NaN) and the workspace (`poison` bytes), sets the guards.
  ::testing::AssertionResult Poison(uint8_t poison = 0xff) {
    const size_t out_bytes = size_t(tokens_) * shape_.hidden * 4;
    const cudaStream_t st = stream_.stream;
    for (cudaError_t err : {cudaMemsetAsync(out_.as<void>(), 0xff, out_bytes, st),
                            cudaMemsetAsync(out_.as<uint8_t>() + out_bytes, kGuardByte, out_.bytes() - out_bytes, st),
                            cudaMemsetAsync(workspace_.as<void>(), poison, ws_bytes_, st),
                            cudaMemsetAsync(workspace_.as<uint8_t>() + ws_bytes_, kGuardByte, kGuardBytes, st)}) {
      if (err != cudaSuccess) return CudaOk(err);
    }
    return ::testing::AssertionSuccess();
  }

  void Enqueue(MoePath path, const ExpertWeights& w) {
    MoeExpertsOnPath(path, x_.as<uint16_t>(), tokens_, ids_.as<int32_t>(), weights_.as<float>(), shape_.top_k, w,
                     workspace_.as<void>(), out_.as<float>(), stream_.stream);
  }

  // Runs one call on poisoned buffers and copies out back.
  ::testing::AssertionResult Run(MoePath path, const ExpertWeights& w, std::vector<float>* out, uint8_t poison = 0xff) {
    if (auto r = Poison(poison); !r) return r;
    Enqueue(path, w);
    if (auto r = CudaOk(cudaGetLastError()); !r) return r << " (launch)";
    if (auto r = CudaOk(cudaStreamSynchronize(stream_.stream)); !r) return r << " (run)";
    return Download(out);
  }

  ::testing::AssertionResult Download(std::vector<float>* out) {
    out->resize(size_t(tokens_) * shape_.hidden);
    const cudaStream_t st = stream_.stream;
    for (cudaError_t err : {cudaMemcpyAsync(out->data(), out_.as<void>(), out->size() * 4, cudaMemcpyDeviceToHost, st),
                            cudaStreamSynchronize(st)}) {
      if (err != cudaSuccess) return CudaOk(err);
    }
    if (!GuardIntact(out_, out->size() * 4, st)) return ::testing::AssertionFailure() << "wrote past the output";
    if (!GuardIntact(workspace_, ws_bytes_, st)) return ::testing::AssertionFailure() << "wrote past the workspace";
    return ::testing::AssertionSuccess();
  }

  cudaStream_t stream() const { return stream_.stream; }

 private:
  Shape shape_;
  int max_tokens_;
  int tokens_ = 0;
  size_t ws_bytes_;
  DeviceBuffer x_, ids_, weights_, out_, workspace_;
  StreamOwner stream_;
};

const char* PathName(MoePath p) {
  switch (p) {
    case MoePath::kAuto:
      return "auto";
    case MoePath::kDecode:
      return "decode";
    case MoePath::kGrouped:
      return "grouped";
  }
  return "?";
}

// Both paths and the automatic choice on one input: each within tolerance of the reference, and
// the automatic one bit-identical to the path it picks.
void ExpectBothPathsMatch(const Layer& layer, const Inputs& in, Runner& runner) {
  const std::vector<double> want = Reference(layer, in);
  ASSERT_TRUE(runner.Upload(in));
  std::vector<float> got[2];
  const MoePath paths[2] = {MoePath::kDecode, MoePath::kGrouped};
  for (int p = 0; p < 2; ++p) {
    SCOPED_TRACE(PathName(paths[p]));
    ASSERT_TRUE(runner.Run(paths[p], layer.weights(), &got[p]));
    const Errors err = Compare(got[p], want, in.tokens, layer.shape.hidden);
    EXPECT_EQ(err.non_finite, 0);
    EXPECT_EQ(err.zero_rows_not_zero, 0);
    EXPECT_LT(err.total, 1e-2);
    EXPECT_LT(err.worst_row, 2e-2) << "token " << err.worst_row_index;
  }
  std::vector<float> automatic;
  ASSERT_TRUE(runner.Run(MoePath::kAuto, layer.weights(), &automatic, 0x00));
  const int picked = MoeAutoPath(in.tokens, layer.shape.top_k) == MoePath::kDecode ? 0 : 1;
  EXPECT_EQ(0, std::memcmp(automatic.data(), got[picked].data(), automatic.size() * 4))
      << "auto differs from " << PathName(paths[picked]) << " on a differently poisoned workspace";
}

struct Case {
  std::string name;
  Shape shape;
  int tokens;
  Routing routing;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::vector<Case> SmallCases() {
  std::vector<Case> cases;
  for (int t : {1, 2, 7, 32, 64, 300, 2048}) {
    cases.push_back({absl::StrCat("T", t), kSmall, t, Routing::kRandom});
  }
  cases.push_back({"InvalidIdsT1", kSmall, 1, Routing::kInvalid});
  cases.push_back({"RealShapeT1", kReal, 1, Routing::kRandom});
  for (int t : {5, 64, 2048}) {
    cases.push_back({absl::StrCat("HotExpertT", t), kSmall, t, Routing::kHotExpert});
    cases.push_back({absl::StrCat("EvenExpertsOnlyT", t), kSmall, t, Routing::kEvenOnly});
    cases.push_back({absl::StrCat("InvalidIdsT", t), kSmall, t, Routing::kInvalid});
  }
  // H = 72, I = 40: partial K slices in both GEMMs, partial row blocks, partial column tiles.
  for (int t : {1, 5, 200}) cases.push_back({absl::StrCat("OddShapeT", t), Shape{8, 2, 72, 40}, t, Routing::kRandom});
  // 256 experts: a grouping table of up to 16 warps; one expert: every token in one group.
  cases.push_back({"ManyExpertsT64", Shape{256, 8, 64, 32}, 64, Routing::kRandom});
  cases.push_back({"ManyExpertsT700", Shape{256, 8, 64, 32}, 700, Routing::kInvalid});
  cases.push_back({"OneExpertT300", Shape{1, 1, 64, 64}, 300, Routing::kRandom});
  return cases;
}

class MoeSmallTest : public ::testing::TestWithParam<Case> {};

TEST_P(MoeSmallTest, BothPathsMatchTheReference) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const Case& c = GetParam();
  std::unique_ptr<Layer> layer = Layer::Make(c.shape, 1234 + c.shape.experts + c.shape.hidden);
  ASSERT_NE(layer, nullptr);
  Runner runner(c.shape, c.tokens + 3);  // a workspace for more tokens than the call has
  ExpectBothPathsMatch(*layer, MakeInputs(c.shape, c.tokens, c.routing, 77 + c.tokens), runner);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MoeSmallTest, ::testing::ValuesIn(SmallCases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(MoeExpertsTest, SameInputsGiveTheSameBitsOnBothPaths) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  std::unique_ptr<Layer> layer = Layer::Make(kSmall, 5);
  ASSERT_NE(layer, nullptr);
  Runner runner(kSmall, 300);
  ASSERT_TRUE(runner.Upload(MakeInputs(kSmall, 300, Routing::kHotExpert, 6)));
  for (MoePath path : {MoePath::kDecode, MoePath::kGrouped}) {
    SCOPED_TRACE(PathName(path));
    std::vector<float> a, b;
    ASSERT_TRUE(runner.Run(path, layer->weights(), &a, 0xff));
    ASSERT_TRUE(runner.Run(path, layer->weights(), &b, 0x3c));
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
  }
}

TEST(MoeExpertsTest, UnsupportedShapeFillsTheOutputWithNaN) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const Shape s{4, 2, 100, 64};  // H not a multiple of 8
  DeviceBuffer out(3 * 100 * 4), workspace(MoeWorkspaceBytes(3, 2, 4, 100, 64)), ids(3 * 2 * 4), w(3 * 2 * 4);
  DeviceBuffer x(3 * 100 * 2), gate_up(4 * 128 * 100 * 2), down(4 * 100 * 64 * 2);
  ASSERT_TRUE(out.ok() && workspace.ok() && ids.ok() && w.ok() && x.ok() && gate_up.ok() && down.ok());
  ASSERT_TRUE(CudaOk(cudaMemset(out.as<void>(), 0, out.bytes())));
  MoeExperts(x.as<uint16_t>(), 3, ids.as<int32_t>(), w.as<float>(), 2, Weights(s, gate_up, down), workspace.as<void>(),
             out.as<float>(), nullptr);
  ASSERT_TRUE(CudaOk(cudaGetLastError()));
  ASSERT_TRUE(CudaOk(cudaDeviceSynchronize()));
  std::vector<float> host(3 * 100);
  ASSERT_TRUE(CudaOk(cudaMemcpy(host.data(), out.as<void>(), out.bytes(), cudaMemcpyDeviceToHost)));
  EXPECT_TRUE(std::all_of(host.begin(), host.end(), [](float v) { return std::isnan(v); }));
}

TEST(MoeExpertsTest, WorkspaceGrowsWithTokens) {
  int64_t last = 0;
  for (int t : {0, 1, 2, 31, 32, 33, 64, 255, 256, 257, 2048, 4096}) {
    const int64_t bytes = MoeWorkspaceBytes(t, 8, 128, 2048, 768);
    EXPECT_GE(bytes, last) << t;
    // At least act (bf16) and the per-slot outputs (fp32).
    EXPECT_GE(bytes, int64_t{t} * 8 * (768 * 2 + 2048 * 4)) << t;
    last = bytes;
  }
}

// Captures one call into a graph, then replays it on new x, ids and weights written into the same
// buffers: the new routing's experts, counts and tiles must all be picked up on the device.
void ExpectGraphReplaysMatch(const Layer& layer, int tokens, int rounds) {
  const Shape& s = layer.shape;
  Runner runner(s, tokens);
  ASSERT_TRUE(runner.Upload(MakeInputs(s, tokens, Routing::kRandom, 1)));
  ASSERT_TRUE(runner.Poison());
  cudaGraph_t graph = nullptr;
  ASSERT_TRUE(CudaOk(cudaStreamBeginCapture(runner.stream(), cudaStreamCaptureModeGlobal)));
  runner.Enqueue(MoePath::kAuto, layer.weights());
  ASSERT_TRUE(CudaOk(cudaStreamEndCapture(runner.stream(), &graph)));
  cudaGraphExec_t exec = nullptr;
  ASSERT_TRUE(CudaOk(cudaGraphInstantiate(&exec, graph, 0)));
  const Routing routings[] = {Routing::kRandom, Routing::kHotExpert, Routing::kEvenOnly, Routing::kInvalid};
  for (int r = 0; r < rounds; ++r) {
    SCOPED_TRACE(absl::StrCat("replay ", r));
    const Inputs in = MakeInputs(s, tokens, routings[r % 4], 1000 + r);
    ASSERT_TRUE(runner.Upload(in));
    ASSERT_TRUE(runner.Poison(r % 2 ? 0x00 : 0xff));
    ASSERT_TRUE(CudaOk(cudaGraphLaunch(exec, runner.stream())));
    ASSERT_TRUE(CudaOk(cudaStreamSynchronize(runner.stream())));
    std::vector<float> got;
    ASSERT_TRUE(runner.Download(&got));
    const Errors err = Compare(got, Reference(layer, in), tokens, s.hidden);
    EXPECT_EQ(err.non_finite, 0);
    EXPECT_EQ(err.zero_rows_not_zero, 0);
    EXPECT_LT(err.total, 1e-2);
    EXPECT_LT(err.worst_row, 2e-2) << "token " << err.worst_row_index;
  }
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
}

TEST(MoeExpertsTest, GraphReplaysWithNewRoutingMatchTheReference) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  std::unique_ptr<Layer> layer = Layer::Make(kSmall, 9);
  ASSERT_NE(layer, nullptr);
  for (int tokens : {1, 7, 32, 300}) {  // the decode path, then the grouped one
    SCOPED_TRACE(absl::StrCat("T=", tokens, " ", PathName(MoeAutoPath(tokens, kSmall.top_k))));
    ExpectGraphReplaysMatch(*layer, tokens, 4);
  }
}

// The real shape: one layer of 128 experts (1.2 GB of weights) made once for these tests.
class MoeRealShapeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (VisibleDeviceCount() == 0) return;
    layer_ = Layer::Make(kReal, 2024).release();
  }
  static void TearDownTestSuite() {
    delete layer_;
    layer_ = nullptr;
  }
  void SetUp() override {
    if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
    ASSERT_NE(layer_, nullptr) << "could not make the real-shape layer";
  }
  static Layer* layer_;
};
Layer* MoeRealShapeTest::layer_ = nullptr;

TEST_F(MoeRealShapeTest, BothPathsMatchTheReference) {
  for (int tokens : {1, 32, 512}) {
    SCOPED_TRACE(absl::StrCat("T=", tokens));
    Runner runner(kReal, tokens);
    ExpectBothPathsMatch(*layer_, MakeInputs(kReal, tokens, Routing::kRandom, 31 + tokens), runner);
  }
}

TEST_F(MoeRealShapeTest, GraphReplaysWithNewRoutingMatchTheReference) {
  for (int tokens : {1, 8}) {
    SCOPED_TRACE(absl::StrCat("T=", tokens));
    ExpectGraphReplaysMatch(*layer_, tokens, 3);
  }
}

// Prints, never asserts on time. Each timed graph holds kRounds calls with different routings
// (at T = 1 they cycle through all 128 experts), so a call finds its experts' weights in HBM, not
// in the 50 MB L2, as a real step that moves from layer to layer does.
TEST_F(MoeRealShapeTest, PrintsBandwidthAndThroughput) {
  const Shape& s = kReal;
  StreamOwner stream;
  ASSERT_NE(stream.stream, nullptr);
  cudaEvent_t start, stop;
  ASSERT_TRUE(CudaOk(cudaEventCreate(&start)));
  ASSERT_TRUE(CudaOk(cudaEventCreate(&stop)));
  auto elapsed_ms = [&]() {
    float ms = 0;
    EXPECT_TRUE(CudaOk(cudaEventElapsedTime(&ms, start, stop)));
    return double(ms);
  };

  // The roofline: a device-to-device copy, read + write.
  double copy_gbs = 0;
  {
    const size_t bytes = size_t{1} << 30;
    DeviceBuffer a(bytes), b(bytes);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_TRUE(CudaOk(cudaMemcpyAsync(b.as<void>(), a.as<void>(), bytes, cudaMemcpyDeviceToDevice, stream.stream)));
    const int reps = 10;
    ASSERT_TRUE(CudaOk(cudaEventRecord(start, stream.stream)));
    for (int i = 0; i < reps; ++i) {
      ASSERT_TRUE(CudaOk(cudaMemcpyAsync(b.as<void>(), a.as<void>(), bytes, cudaMemcpyDeviceToDevice, stream.stream)));
    }
    ASSERT_TRUE(CudaOk(cudaEventRecord(stop, stream.stream)));
    ASSERT_TRUE(CudaOk(cudaEventSynchronize(stop)));
    copy_gbs = 2.0 * bytes * reps / (elapsed_ms() * 1e-3) / 1e9;
    std::printf("[moe timing] device copy: %.0f GB/s (read + write)\n", copy_gbs);
  }

  constexpr int kRounds = 16;
  const int max_tokens = 2048;
  DeviceBuffer workspace(MoeWorkspaceBytes(max_tokens, s.top_k, s.experts, s.hidden, s.inter));
  DeviceBuffer x(size_t(max_tokens) * s.hidden * 2), out(size_t(max_tokens) * s.hidden * 4);
  DeviceBuffer ids(size_t(kRounds) * max_tokens * s.top_k * 4), weights(size_t(kRounds) * max_tokens * s.top_k * 4);
  ASSERT_TRUE(workspace.ok() && x.ok() && out.ok() && ids.ok() && weights.ok());
  const int64_t expert_bytes = int64_t{3} * s.hidden * s.inter * 2;
  const double flops_per_pair = 2.0 * 3 * s.hidden * s.inter;

  for (int tokens : {1, 8, 32, 64, 128, 512, 2048}) {
    // kRounds routings; at T = 1 round r takes experts 8r .. 8r + 7.
    std::vector<int32_t> all_ids;
    std::vector<float> all_weights;
    double experts_touched = 0;
    for (int r = 0; r < kRounds; ++r) {
      Inputs in = MakeInputs(s, tokens, Routing::kRandom, 500 + r);
      if (tokens == 1) {
        for (int j = 0; j < s.top_k; ++j) in.ids[j] = (r * s.top_k + j) % s.experts;
      }
      std::vector<bool> seen(s.experts);
      for (int32_t e : in.ids) seen[e] = true;
      experts_touched += std::count(seen.begin(), seen.end(), true);
      all_ids.insert(all_ids.end(), in.ids.begin(), in.ids.end());
      all_weights.insert(all_weights.end(), in.weights.begin(), in.weights.end());
      if (r == 0) {
        ASSERT_TRUE(CudaOk(cudaMemcpy(x.as<void>(), in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice)));
      }
    }
    ASSERT_TRUE(CudaOk(cudaMemcpy(ids.as<void>(), all_ids.data(), all_ids.size() * 4, cudaMemcpyHostToDevice)));
    ASSERT_TRUE(
        CudaOk(cudaMemcpy(weights.as<void>(), all_weights.data(), all_weights.size() * 4, cudaMemcpyHostToDevice)));
    ASSERT_TRUE(CudaOk(cudaDeviceSynchronize()));  // the uploads above ran on the legacy stream
    const double bytes_per_call = experts_touched / kRounds * expert_bytes;

    for (MoePath path : {MoePath::kDecode, MoePath::kGrouped}) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      ASSERT_TRUE(CudaOk(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeGlobal)));
      for (int r = 0; r < kRounds; ++r) {
        const int64_t at = int64_t{r} * tokens * s.top_k;
        MoeExpertsOnPath(path, x.as<uint16_t>(), tokens, ids.as<int32_t>() + at, weights.as<float>() + at, s.top_k,
                         layer_->weights(), workspace.as<void>(), out.as<float>(), stream.stream);
      }
      ASSERT_TRUE(CudaOk(cudaStreamEndCapture(stream.stream, &graph)));
      ASSERT_TRUE(CudaOk(cudaGraphInstantiate(&exec, graph, 0)));
      ASSERT_TRUE(CudaOk(cudaGraphLaunch(exec, stream.stream)));  // warm-up
      const int reps = tokens >= 512 ? 3 : 10;
      ASSERT_TRUE(CudaOk(cudaEventRecord(start, stream.stream)));
      for (int i = 0; i < reps; ++i) ASSERT_TRUE(CudaOk(cudaGraphLaunch(exec, stream.stream)));
      ASSERT_TRUE(CudaOk(cudaEventRecord(stop, stream.stream)));
      ASSERT_TRUE(CudaOk(cudaEventSynchronize(stop)));
      ASSERT_TRUE(CudaOk(cudaGetLastError()));
      const double us = elapsed_ms() * 1e3 / (reps * kRounds);
      const double gbs = bytes_per_call / (us * 1e-6) / 1e9;
      const double tflops = flops_per_pair * tokens * s.top_k / (us * 1e-6) / 1e12;
      std::printf(
          "[moe timing] T=%4d %-7s%s: %8.1f us/layer, experts read %6.1f MB -> %5.0f GB/s = %.2f of copy, "
          "%6.1f TFLOP/s\n",
          tokens, PathName(path), MoeAutoPath(tokens, s.top_k) == path ? " (auto)" : "       ", us,
          bytes_per_call / 1e6, gbs, gbs / copy_gbs, tflops);
      (void)cudaGraphExecDestroy(exec);
      (void)cudaGraphDestroy(graph);
    }
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
}

}  // namespace
}  // namespace moe::runtime::cuda

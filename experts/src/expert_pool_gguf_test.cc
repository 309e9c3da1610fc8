// An ExpertPool of GGUF-typed experts: kept as the file's blocks (native, per-layer types), and
// computing what the dequantized weights compute.
#include <cmath>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "gguf_test_blocks.h"
#include "moe/experts/expert_pool.h"
#include "moe/experts/gguf_types.h"

namespace moe::experts {
namespace {

using ::testing::HasSubstr;

// Every layer's {gate and up, down} GGUF types, as a Q4_K_M or i-quant file mixes them.
struct LayerTypes {
  int gate, up, down;
};

// Random GGUF experts and the plain MoE of their dequantized values (double sums).
class GgufExperts {
 public:
  GgufExperts(const ExpertShape& s, const std::vector<LayerTypes>& types, uint32_t seed) : shape_(s), types_(types) {
    std::mt19937 rng(seed);
    for (int l = 0; l < s.num_layers; ++l) {
      for (int e = 0; e < s.num_experts; ++e) {
        const int ids[3] = {types[l].gate, types[l].up, types[l].down};
        for (int which = 0; which < 3; ++which) {
          const int64_t rows = which < 2 ? s.intermediate : s.hidden, cols = which < 2 ? s.hidden : s.intermediate;
          const GgufType& t = *FindGgufType(ids[which]);
          Matrix m;
          m.type = ids[which];
          m.rows = rows;
          m.cols = cols;
          for (int64_t r = 0; r < rows; ++r) {
            const std::vector<uint8_t> row = RandomRow(t, cols, rng);
            m.blocks.insert(m.blocks.end(), row.begin(), row.end());
          }
          m.values.resize(rows * cols);
          for (int64_t r = 0; r < rows; ++r) {
            DequantizeRow(m.type, m.blocks.data() + r * GgufRowBytes(t, cols), cols, &m.values[r * cols]);
          }
          matrices_.push_back(std::move(m));
        }
      }
    }
  }
  ExpertWeightSource Source() const {
    return [this](int layer, int e) -> absl::StatusOr<ExpertWeights> {
      auto m = [&](int which) {
        const Matrix& x = Get(layer, e, which);
        return ExpertMatrix::Gguf(x.blocks.data(), x.rows, x.cols, x.type);
      };
      return ExpertWeights{m(0), m(1), m(2)};
    };
  }
  int64_t SourceBytes() const {
    int64_t bytes = 0;
    for (const Matrix& m : matrices_) bytes += m.blocks.size();
    return bytes;
  }
  std::vector<double> Reference(int layer, const std::vector<float>& x, const std::vector<int32_t>& ids,
                                const std::vector<float>& w) const {
    const int64_t h = shape_.hidden, inter = shape_.intermediate, k = shape_.top_k, tokens = x.size() / h;
    std::vector<double> out(x.size(), 0.0), mid(inter);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int e = ids[t * k + j];
        const Matrix &g = Get(layer, e, 0), &u = Get(layer, e, 1), &d = Get(layer, e, 2);
        for (int64_t i = 0; i < inter; ++i) {
          double gs = 0, us = 0;
          for (int64_t c = 0; c < h; ++c) {
            gs += g.values[i * h + c] * double(x[t * h + c]);
            us += u.values[i * h + c] * double(x[t * h + c]);
          }
          mid[i] = gs / (1 + std::exp(-gs)) * us;
        }
        for (int64_t c = 0; c < h; ++c) {
          double acc = 0;
          for (int64_t i = 0; i < inter; ++i) acc += d.values[c * inter + i] * mid[i];
          out[t * h + c] += w[t * k + j] * acc;
        }
      }
    }
    return out;
  }

 private:
  struct Matrix {
    int type = 0;
    int64_t rows = 0, cols = 0;
    std::vector<uint8_t> blocks;
    std::vector<float> values;
  };
  const Matrix& Get(int layer, int e, int which) const {
    return matrices_[(static_cast<size_t>(layer) * shape_.num_experts + e) * 3 + which];
  }
  ExpertShape shape_;
  std::vector<LayerTypes> types_;
  std::vector<Matrix> matrices_;
};

// Hidden and intermediate multiples of 256 (the K-quants' blocks); intermediate not a multiple
// of 512, 6 experts, top-2.
ExpertShape GgufShape() { return ExpertShape{3, 6, 2, 512, 256}; }

std::vector<LayerTypes> MixedTypes() {
  return {{kGgufQ4_K, kGgufQ4_K, kGgufQ6_K}, {kGgufIQ3_XXS, kGgufIQ3_XXS, kGgufQ8_0}, {kGgufQ8_0, kGgufQ8_0, kGgufIQ4_XS}};
}

double RelativeRmsError(const std::vector<float>& out, const std::vector<double>& want) {
  double signal = 0, noise = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    signal += want[i] * want[i];
    noise += (out[i] - want[i]) * (out[i] - want[i]);
  }
  return std::sqrt(noise / signal);
}

void ExpectMatchesReference(ExpertPool& pool, const GgufExperts& experts, const ExpertShape& shape, double tolerance) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (int64_t tokens : {1, 3, 40}) {
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      std::vector<float> x(tokens * shape.hidden), w;
      std::vector<int32_t> ids;
      for (float& v : x) v = normal(rng);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int j = 0; j < shape.top_k; ++j) {
          ids.push_back(static_cast<int32_t>((t * 5 + j * 2 + layer) % shape.num_experts));
          w.push_back(0.3f + 0.1f * j);
        }
      }
      std::vector<float> out(x.size(), -1.0f);
      ASSERT_TRUE(pool.Compute(layer, x.data(), tokens, ids.data(), w.data(), out.data()).ok());
      EXPECT_LT(RelativeRmsError(out, experts.Reference(layer, x, ids, w)), tolerance)
          << "tokens=" << tokens << " layer=" << layer;
    }
  }
}

ExpertPoolOptions Options(ExpertFormat format) {
  ExpertPoolOptions o;
  o.format = format;
  o.threads = 2;
  o.progress = false;
  return o;
}

TEST(ExpertPoolGgufTest, NativeKeepsEachLayersTypesAndMatchesTheDequantizedMoe) {
  const ExpertShape shape = GgufShape();
  GgufExperts experts(shape, MixedTypes(), 3);
  for (std::optional<KernelKind> kernel : {std::optional<KernelKind>(), std::optional(KernelKind::kPortable)}) {
    ExpertPoolOptions options = Options(ExpertFormat::kNative);
    options.kernel = kernel;
    auto pool = ExpertPool::Create(shape, options, experts.Source());
    ASSERT_TRUE(pool.ok()) << pool.status();
    // The arena holds the file's blocks (and the padding to 64 bytes per 16 rows): at most 1.1x.
    EXPECT_LE(static_cast<double>((*pool)->arena().size()), 1.1 * experts.SourceBytes());
    const ExpertPool::ArenaLayout a = (*pool)->arena_layout();
    ASSERT_EQ(a.layers.size(), 3u);
    EXPECT_FALSE(a.uniform);
    EXPECT_EQ(a.layers[0].gate_up.format, ExpertFormat::kQ4_K);
    EXPECT_EQ(a.layers[0].down.format, ExpertFormat::kQ6_K);
    EXPECT_EQ(a.layers[1].gate_up.format, ExpertFormat::kIQ3_XXS);
    EXPECT_EQ(a.layers[2].down.gguf_type, kGgufIQ4_XS);
    EXPECT_EQ(a.layers[1].offset, a.layers[0].expert_bytes * shape.num_experts);
    EXPECT_THAT((*pool)->Describe(), HasSubstr("native (q4_k/q6_k in layer 0)"));
    ExpectMatchesReference(**pool, experts, shape, 0.03);
  }
}

TEST(ExpertPoolGgufTest, OneGgufFormatOrDequantizedToInt8) {
  const ExpertShape shape = GgufShape();
  const std::vector<LayerTypes> q8(3, LayerTypes{kGgufQ8_0, kGgufQ8_0, kGgufQ8_0});
  GgufExperts experts(shape, q8, 4);
  auto pool = ExpertPool::Create(shape, Options(ExpertFormat::kQ8_0), experts.Source());
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_TRUE((*pool)->arena_layout().uniform);
  EXPECT_EQ((*pool)->arena().size(), experts.SourceBytes());
  ExpectMatchesReference(**pool, experts, shape, 0.03);
  // The same experts dequantized (bit-identical to llama.cpp) and packed as int8.
  auto int8 = ExpertPool::Create(shape, Options(ExpertFormat::kInt8), experts.Source());
  ASSERT_TRUE(int8.ok()) << int8.status();
  ExpectMatchesReference(**int8, experts, shape, 0.03);
  // A GGUF format takes its own type only.
  auto wrong = ExpertPool::Create(shape, Options(ExpertFormat::kQ4_K), experts.Source());
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("gate is Q8_0, but the expert pool keeps q4_k there (the format asked)"));
}

TEST(ExpertPoolGgufTest, NativeRefusesWhatItCannotKeep) {
  const ExpertShape shape = GgufShape();
  std::vector<LayerTypes> types = MixedTypes();
  types[1].up = kGgufQ8_0;
  GgufExperts experts(shape, types, 6);
  auto pool = ExpertPool::Create(shape, Options(ExpertFormat::kNative), experts.Source());
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(pool.status().message()), HasSubstr("MoE layer 1: gate is IQ3_XXS and up Q8_0"));
  // Dequantized instead, they load.
  EXPECT_TRUE(ExpertPool::Create(shape, Options(ExpertFormat::kInt4), experts.Source()).ok());

  std::vector<uint16_t> bf16(shape.hidden * shape.intermediate, 0);
  auto tensors = [&](int, int) -> absl::StatusOr<ExpertWeights> {
    const core::Shape io = {shape.intermediate, shape.hidden}, oi = {shape.hidden, shape.intermediate};
    return ExpertWeights{{bf16.data(), core::DType::kBF16, io}, {bf16.data(), core::DType::kBF16, io},
                         {bf16.data(), core::DType::kBF16, oi}};
  };
  auto native = ExpertPool::Create(shape, Options(ExpertFormat::kNative), tensors);
  ASSERT_FALSE(native.ok());
  EXPECT_THAT(std::string(native.status().message()), HasSubstr("keeps quantized GGUF types only"));
}

}  // namespace
}  // namespace moe::experts

// FP8 checkpoints end to end: a fixture written as DeepSeek-V3 / Qwen3-FP8 lay theirs out (each
// projection F8_E4M3 with a `_scale_inv` sibling of one scale per block, quantization_config in
// config.json; norms, router and embedding left bf16), opened and run on the CPU backend: the
// logits are those of the same values written as f32 (code times scale), with the experts in the
// pool converted or kept as fp8; and each broken file or config refused, naming what.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"
#include "moe/experts/expert_pool.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/model.h"
#include "moe/runtime/safetensors_writer.h"
#include "moe/runtime/weight_source.h"
#include "fp8_fixture.h"
#include "test_util.h"

namespace moe {
namespace {

using ::testing::HasSubstr;
using testing::Fp8Layout;
using testing::WriteFp8Fixture;

runtime::ModelOptions CpuOptions() {
  runtime::ModelOptions o;
  o.pool.progress = false;
  return o;
}

// The logits of `a` against those of `b` (same values, f32): within `tolerance` of their range, the
// same top token at `agreement` of the positions. (The CPU backend runs an FP8 checkpoint's
// Linears by the pool's fp8 kernels, activations in two bf16 terms; the f32 model's in fp32: 1e-3
// and all of them.)
void ExpectCloseLogits(runtime::Model& a, runtime::Model& b, const std::string& arch, float tolerance = 1e-3f,
                       double agreement = 1.0) {
  const nlohmann::json golden = testing::LoadGolden(arch);
  float worst = 0, range = 0;
  int positions = 0, agree = 0;
  for (const auto& gc : golden["cases"]) {
    const std::vector<int32_t> ids = gc["prompt_ids"];
    const auto x = testing::FullForward(a, ids), y = testing::FullForward(b, ids);
    ASSERT_EQ(x.size(), y.size());
    for (size_t r = 0; r < x.size(); ++r) {
      worst = std::max(worst, testing::MaxAbsDiff(x[r], y[r]));
      range = std::max(range, *std::max_element(y[r].begin(), y[r].end()) - *std::min_element(y[r].begin(), y[r].end()));
      ++positions;
      agree += std::max_element(x[r].begin(), x[r].end()) - x[r].begin() ==
               std::max_element(y[r].begin(), y[r].end()) - y[r].begin();
    }
  }
  EXPECT_LT(worst, range * tolerance) << arch << ": " << worst << " of a range of " << range;
  EXPECT_GE(agree, positions * agreement) << arch << ": the top token agrees at " << agree << " of " << positions;
}

TEST(Fp8WeightTest, ExpandsCodesTimesTheirBlocksScaleWithPartialEdgeBlocks) {
  // A [3 x 5] weight in blocks of 2 x 4: scales [2 x 2], edge blocks partial.
  std::vector<uint8_t> codes(15);
  for (int i = 0; i < 15; ++i) codes[i] = core::FloatToF8E4M3(static_cast<float>(i % 7) - 3.0f);
  const float scales[4] = {0.5f, 2.0f, -1.0f, 0.25f};
  runtime::WeightView v;
  v.data = codes.data();
  v.shape = {3, 5};
  v.format = runtime::WeightFormat::BlockScaled(core::DType::kF8E4M3, 2, 4, core::DType::kF32);
  v.scales = scales;
  v.scale_shape = {2, 2};
  std::vector<float> storage;
  auto t = runtime::ExpandToFloats(v, &storage);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->dtype, core::DType::kF32);
  const float* f = static_cast<const float*>(t->data);
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 5; ++c) {
      EXPECT_EQ(f[r * 5 + c], (static_cast<float>((r * 5 + c) % 7) - 3.0f) * scales[(r / 2) * 2 + c / 4])
          << r << "," << c;
    }
  }
  // bf16 scales read as bf16.
  const uint16_t bf16_scales[4] = {core::FloatToBf16(0.5f), core::FloatToBf16(2.0f), core::FloatToBf16(-1.0f),
                                   core::FloatToBf16(0.25f)};
  v.format.scale_dtype = core::DType::kBF16;
  v.scales = bf16_scales;
  auto b = runtime::ExpandToFloats(v, &storage);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(static_cast<const float*>(b->data)[14], (14 % 7 - 3.0f) * 0.25f);
}

class Fp8FixtureTest : public ::testing::TestWithParam<std::string> {};

// Every architecture: the FP8 checkpoint computes what its values written as f32 compute, through
// the backend's Linears (kept fp8) and the pool's bf16 experts; the backend keeps the Linears in
// fewer bytes than the f32 model's.
TEST_P(Fp8FixtureTest, LogitsAreThoseOfItsValuesAsF32) {
  testing::ScratchDir dir;
  WriteFp8Fixture(GetParam(), Fp8Layout{32, 64, core::DType::kF32}, dir / "fp8", dir / "f32");
  auto c = runtime::OpenCheckpoint(dir / "fp8");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->quantization(), "fp8 e4m3, scale per 32x64 block");
  for (const std::string& name : (*c)->source().Names()) EXPECT_THAT(name, ::testing::Not(HasSubstr("_scale_inv")));
  auto fp8 = runtime::Model::Load(dir / "fp8", CpuOptions());
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  auto f32 = runtime::Model::Load(dir / "f32", CpuOptions());
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_LT((*fp8)->weight_bytes(), (*f32)->weight_bytes() / 2) << (*fp8)->weight_bytes() << " against "
                                                                << (*f32)->weight_bytes();
  ExpectCloseLogits(**fp8, **f32, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Archs, Fp8FixtureTest, ::testing::Values("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"));

// DeepSeek's 128 x 128 blocks (larger than the fixture's matrices: one scale each) with bf16
// scales, as some Qwen3 FP8 releases store them, and the experts in the pool in every format.
TEST(Fp8PoolTest, Bf16ScalesAndEveryPoolFormat) {
  testing::ScratchDir dir;
  WriteFp8Fixture("qwen3_moe", Fp8Layout{128, 128, core::DType::kBF16}, dir / "fp8", dir / "f32");
  for (experts::ExpertFormat f : {experts::ExpertFormat::kBF16, experts::ExpertFormat::kInt8}) {
    runtime::ModelOptions o = CpuOptions();
    o.pool.format = f;
    auto fp8 = runtime::Model::Load(dir / "fp8", o);
    ASSERT_TRUE(fp8.ok()) << fp8.status();
    auto f32 = runtime::Model::Load(dir / "f32", o);
    ASSERT_TRUE(f32.ok()) << f32.status();
    // int8 experts quantize their activations per token: the Linears' small differences move
    // them by whole steps (the bounds of the int8 goldens checks: 85% agreement, under 3).
    if (f == experts::ExpertFormat::kInt8) {
      ExpectCloseLogits(**fp8, **f32, "qwen3_moe", 3.0f / 7.6f, 0.85);
    } else {
      ExpectCloseLogits(**fp8, **f32, "qwen3_moe");
    }
  }
}

// --expert-format auto keeps an FP8 checkpoint's experts as stored: the arena holds their codes
// and scales (one byte a value and 1/32 more), the values the pool computes with are the
// checkpoint's, and the logits are those of the same values in fp32 but for the activations'
// bf16 rounding in the kernel (where the CPU has AVX-512 BF16).
TEST(Fp8PoolTest, AutoKeepsTheExpertsCodesAndScales) {
  testing::ScratchDir dir;
  WriteFp8Fixture("qwen3_moe", Fp8Layout{128, 128, core::DType::kF32}, dir / "fp8", dir / "f32");
  auto c = runtime::OpenCheckpoint(dir / "fp8");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(runtime::AutoPoolFormat(**c), experts::ExpertFormat::kFp8);
  EXPECT_EQ(runtime::Fp8ExpertGroup(**c), 128);
  const runtime::ModelSpec& s = (*c)->spec();
  const int64_t expert_codes = int64_t{s.num_moe_layers()} * s.routing.num_experts * 3 * s.hidden_size *
                               s.moe_intermediate_size;
  runtime::ModelOptions exact = CpuOptions();
  exact.experts = runtime::RoutedExpertsMode::kBackend;
  auto f32 = runtime::Model::Load(dir / "f32", exact);
  ASSERT_TRUE(f32.ok()) << f32.status();
  const nlohmann::json golden = testing::LoadGolden("qwen3_moe");
  // The portable kernel (fp32 activations) and the one chosen for this CPU (avx512bf16 where it
  // runs: activations rounded to bf16).
  for (const std::optional<experts::KernelKind> kernel : {std::optional(experts::KernelKind::kPortable),
                                                          std::optional<experts::KernelKind>()}) {
    runtime::ModelOptions native = CpuOptions();
    native.pool_format_auto = true;
    native.pool.kernel = kernel;
    auto fp8 = runtime::Model::Load(dir / "fp8", native);
    ASSERT_TRUE(fp8.ok()) << fp8.status();
    ASSERT_NE((*fp8)->expert_pool(), nullptr);
    EXPECT_EQ((*fp8)->expert_pool()->options().format, experts::ExpertFormat::kFp8);
    // gate+up rows padded to their 128-column group: the fixture's 64-wide down matrices are
    // padded to 128 columns, so at most 2x there; real shapes (multiples of 128) take 1 + 1/32.
    EXPECT_GE((*fp8)->expert_pool()->arena().size(), expert_codes);
    EXPECT_LE((*fp8)->expert_pool()->arena().size(), expert_codes * 2 * 33 / 32 + (1 << 16));
    const bool fp32 = (*fp8)->expert_pool()->KernelFor(1) == experts::KernelKind::kPortable;
    float worst = 0, range = 0;
    int positions = 0, agree = 0;
    for (const auto& gc : golden["cases"]) {
      const std::vector<int32_t> ids = gc["prompt_ids"];
      const auto p = testing::FullForward(**fp8, ids), a = testing::FullForward(**f32, ids);
      for (size_t r = 0; r < a.size(); ++r) {
        worst = std::max(worst, testing::MaxAbsDiff(p[r], a[r]));
        range = std::max(range, *std::max_element(a[r].begin(), a[r].end()) - *std::min_element(a[r].begin(), a[r].end()));
        ++positions;
        agree += std::max_element(p[r].begin(), p[r].end()) - p[r].begin() ==
                 std::max_element(a[r].begin(), a[r].end()) - a[r].begin();
      }
    }
    std::printf("fp8 pool, %s kernel: worst logit error %.3g of a range of %.3g; top-1 agrees at %d of %d\n",
                fp32 ? "portable" : "avx512bf16", worst, range, agree, positions);
    // The portable kernel: the same products in another order, fp32 rounding only. avx512bf16:
    // activations in two bf16 terms (about 16 bits), through four layers of the fixture's
    // far-from-default weights.
    EXPECT_LT(worst, range * (fp32 ? 1e-5f : 1e-3f)) << worst << " of a range of " << range;
    EXPECT_EQ(agree, positions);
  }
}

TEST(Fp8RefusalTest, MissingOrMisshapenScalesAndOtherMethods) {
  const std::string down = "model.layers.1.mlp.experts.3.down_proj.weight";
  {
    testing::ScratchDir dir;
    WriteFp8Fixture("qwen3_moe", Fp8Layout{}, dir / "m", "",
                    [&](runtime::TensorEntry& e) { return e.name != down + "_scale_inv"; });
    auto c = runtime::OpenCheckpoint(dir / "m");
    ASSERT_FALSE(c.ok());
    EXPECT_THAT(c.status().message(), HasSubstr(down + " in "));
    EXPECT_THAT(c.status().message(), HasSubstr(down + "_scale_inv is missing"));
  }
  {
    testing::ScratchDir dir;
    WriteFp8Fixture("qwen3_moe", Fp8Layout{}, dir / "m", "", [&](runtime::TensorEntry& e) {
      if (e.name == down + "_scale_inv") e.shape = {2, 2};
      return true;
    });
    auto c = runtime::OpenCheckpoint(dir / "m");
    ASSERT_FALSE(c.ok());
    EXPECT_THAT(c.status().message(), HasSubstr(down + "_scale_inv in "));
    EXPECT_THAT(c.status().message(), HasSubstr("shape [2, 2]"));
    EXPECT_THAT(c.status().message(), HasSubstr("needs [1, 1]"));
  }
  {
    // F8_E4M3 weights in a checkpoint whose config says nothing of them.
    testing::ScratchDir dir;
    WriteFp8Fixture("qwen3_moe", Fp8Layout{}, dir / "m", "");
    testing::EditConfig(dir / "m", [](nlohmann::json& c) { c.erase("quantization_config"); });
    auto m = runtime::Model::Load(dir / "m", CpuOptions());
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(m.status().message(), HasSubstr("F8_E4M3"));
    EXPECT_THAT(m.status().message(), HasSubstr("quantization_config"));
  }
  struct Case {
    nlohmann::json config;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{{"quant_method", "gptq"}, {"bits", 4}}, "quantization_config.quant_method \"gptq\" is a quantization moeserve does not read"},
      {{{"quant_method", "awq"}}, "\"awq\""},
      {{{"quant_method", "compressed-tensors"}}, "\"compressed-tensors\""},
      {{{"quant_method", "bitsandbytes"}}, "\"bitsandbytes\""},
      {{{"quant_method", "fp8"}, {"fmt", "e5m2"}}, "quantization_config.fmt is \"e5m2\""},
      {{{"quant_method", "fp8"}, {"activation_scheme", "static"}}, "quantization_config.activation_scheme"},
      {{{"quant_method", "fp8"}, {"weight_block_size", {128}}}, "want two integers in [1, 4096], rows then columns"},
      {{{"bits", 4}}, "quantization_config.quant_method is missing"},
  };
  for (const Case& k : cases) {
    testing::ScratchDir dir;
    testing::CopyFixture("qwen3_moe", dir / "m");
    testing::EditConfig(dir / "m", [&](nlohmann::json& c) { c["quantization_config"] = k.config; });
    auto c = runtime::OpenCheckpoint(dir / "m");
    ASSERT_FALSE(c.ok()) << k.config.dump();
    EXPECT_THAT(c.status().message(), HasSubstr(k.want));
    EXPECT_THAT(c.status().message(), HasSubstr("config.json"));
    auto spec = runtime::ReadCheckpointSpec(dir / "m");  // inspect's path refuses it too
    ASSERT_FALSE(spec.ok());
    EXPECT_THAT(spec.status().message(), HasSubstr(k.want));
  }
}

// make-model --fp8 writes an FP8 release (for benchmarks at real shapes): every projection and
// expert F8_E4M3 with its scales in the same shard, quantization_config in config.json; it opens,
// keeps its experts fp8 and generates.
TEST(Fp8MakeModelTest, WritesAnFp8ReleaseThatServes) {
  testing::ScratchDir dir;
  const testing::CommandResult made =
      testing::RunMoeserve({"make-model", "--arch", "glm4_moe", "--preset", "tiny", "--fp8", "--max-shard-mb", "1",
                            "--quiet", "--out", dir / "m"});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  EXPECT_TRUE(std::filesystem::exists(dir / "m/model.safetensors.index.json"));  // several shards
  auto c = runtime::OpenCheckpoint(dir / "m");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->quantization(), "fp8 e4m3, scale per 128x128 block");
  auto down = (*c)->Get({runtime::TensorId::kExpertDown, 1, 3});
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_EQ(down->format.kind, runtime::WeightFormat::Kind::kBlockScaled);
  auto norm = (*c)->Get({runtime::TensorId::kAttnNorm, 1});
  ASSERT_TRUE(norm.ok());
  EXPECT_TRUE(norm->format.plain());
  EXPECT_EQ(runtime::AutoPoolFormat(**c), experts::ExpertFormat::kFp8);
  const testing::CommandResult gen = testing::RunMoeserve(
      {"generate", "--model", dir / "m", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--device", "cpu"});
  ASSERT_EQ(gen.exit_code, 0) << gen.err;
  EXPECT_THAT(gen.out, HasSubstr("fp8 experts"));
  EXPECT_THAT(gen.out, HasSubstr("generated 4 tokens"));
}

// The command line: generate and inspect take an FP8 folder.
TEST(Fp8CommandTest, GenerateAndInspect) {
  testing::ScratchDir dir;
  WriteFp8Fixture("qwen3_moe", Fp8Layout{}, dir / "fp8", dir / "f32");
  const testing::CommandResult inspect = testing::RunMoeserve({"inspect", "--model", dir / "fp8"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_THAT(inspect.out, HasSubstr("fp8 e4m3, scale per 128x128 block"));
  const std::vector<std::string> args = {"--prompt-ids", "1,2,3,4", "--max-new-tokens", "8", "--device", "cpu"};
  auto gen = [&](const std::string& model) {
    std::vector<std::string> a = {"generate", "--model", model};
    a.insert(a.end(), args.begin(), args.end());
    return testing::RunMoeserve(a);
  };
  const testing::CommandResult a = gen(dir / "fp8"), b = gen(dir / "f32");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const auto generated = [](const std::string& out) {
    const size_t at = out.find("generated 8 tokens:");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  EXPECT_FALSE(generated(a.out).empty()) << a.out;
  EXPECT_EQ(generated(a.out), generated(b.out));
}

}  // namespace
}  // namespace moe

// Placement rules over the fixtures' real tensor names and sizes.
#include "moe/runtime/placement.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "moe/runtime/model_spec.h"
#include "moe/runtime/weight_source.h"

namespace moe::runtime {
namespace {

std::string Fixture(const std::string& arch) {
  const char* env = std::getenv("MOE_TESTDATA_DIR");  // set when the tests run from a bundle
  return std::string(env != nullptr ? env : MOE_TESTDATA_DIR) + "/fixtures/" + arch;
}

struct Checkpoint {
  ModelSpec spec;
  std::vector<TensorInfo> tensors;
};

Checkpoint Load(const std::string& arch) {
  Checkpoint c;
  auto spec = LoadModelSpec(Fixture(arch));
  EXPECT_TRUE(spec.ok()) << spec.status();
  c.spec = *spec;
  auto source = OpenSafetensors(Fixture(arch));
  EXPECT_TRUE(source.ok()) << source.status();
  for (const std::string& name : (*source)->Names()) {
    auto view = (*source)->Get(name);
    EXPECT_TRUE(view.ok());
    c.tensors.push_back({name, view->bytes(), view->numel(), static_cast<int>(view->rank())});
  }
  return c;
}

const TensorPlace& Find(const Placement& p, const std::string& name) {
  auto it = std::find_if(p.tensors.begin(), p.tensors.end(), [&](const TensorPlace& t) { return t.name == name; });
  EXPECT_NE(it, p.tensors.end()) << name;
  return *it;
}

PlacementOptions Options() {
  PlacementOptions o;
  o.gpu = Device{Device::Kind::kCuda, 0};
  return o;
}

TEST(PlacementTest, ClassifiesEveryFixtureTensor) {
  EXPECT_EQ(ClassifyTensor("model.embed_tokens.weight").role, TensorRole::kEmbedding);
  EXPECT_EQ(ClassifyTensor("lm_head.weight").role, TensorRole::kLmHead);
  EXPECT_EQ(ClassifyTensor("model.norm.weight").role, TensorRole::kNorm);
  const TensorKind e = ClassifyTensor("model.layers.3.block_sparse_moe.experts.5.w2.weight");
  EXPECT_EQ(e.role, TensorRole::kRoutedExpert);
  EXPECT_EQ(e.layer, 3);
  EXPECT_EQ(e.expert, 5);
  EXPECT_EQ(ClassifyTensor("model.layers.1.mlp.shared_experts.up_proj.weight").role, TensorRole::kSharedExpert);
  EXPECT_EQ(ClassifyTensor("model.layers.1.mlp.shared_expert_gate.weight").role, TensorRole::kSharedExpert);
  EXPECT_EQ(ClassifyTensor("model.layers.1.mlp.gate.e_score_correction_bias").role, TensorRole::kRouter);
  EXPECT_EQ(ClassifyTensor("model.layers.0.mlp.down_proj.weight").role, TensorRole::kDenseFfn);
  EXPECT_EQ(ClassifyTensor("model.layers.2.self_attn.q_norm.weight").role, TensorRole::kNorm);
  EXPECT_EQ(ClassifyTensor("model.layers.2.self_attn.k_proj.bias").role, TensorRole::kAttention);
  for (const char* arch : {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"}) {
    const Checkpoint c = Load(arch);
    for (const TensorInfo& t : c.tensors) {
      EXPECT_NE(ClassifyTensor(t.name).role, TensorRole::kOther) << arch << ": " << t.name;
    }
  }
}

TEST(PlacementTest, DefaultsPutEverythingOnTheGpu) {
  const Checkpoint c = Load("qwen2_moe");
  auto p = PlaceTensors(c.spec, c.tensors, Options());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->BytesOn(Device::Kind::kCpu), 0);
  EXPECT_GT(p->BytesOn(Device::Kind::kCuda), 0);
  EXPECT_TRUE(p->warnings.empty());
}

TEST(PlacementTest, CpuMoeMovesEveryRoutedExpertAndNothingElse) {
  const Checkpoint c = Load("glm4_moe");
  PlacementOptions o = Options();
  o.cpu_moe = true;
  auto p = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_TRUE(p.ok()) << p.status();
  for (const TensorPlace& t : p->tensors) {
    EXPECT_EQ(t.device.kind == Device::Kind::kCpu, t.kind.role == TensorRole::kRoutedExpert) << t.name;
  }
  EXPECT_EQ(Find(*p, "model.layers.2.mlp.experts.3.down_proj.weight").rule, "--cpu-moe");
  EXPECT_EQ(Find(*p, "model.layers.2.mlp.shared_experts.down_proj.weight").device.kind, Device::Kind::kCuda);
  EXPECT_TRUE(p->warnings.empty());
}

TEST(PlacementTest, NCpuMoeCountsMoeLayersNotDenseOnes) {
  // glm4_moe: layer 0 is dense (first_k_dense_replace = 1), so the first 2 MoE layers are 1 and 2.
  const Checkpoint c = Load("glm4_moe");
  PlacementOptions o = Options();
  o.n_cpu_moe = 2;
  auto p = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(Find(*p, "model.layers.1.mlp.experts.0.gate_proj.weight").device.kind, Device::Kind::kCpu);
  EXPECT_EQ(Find(*p, "model.layers.2.mlp.experts.15.up_proj.weight").device.kind, Device::Kind::kCpu);
  EXPECT_EQ(Find(*p, "model.layers.3.mlp.experts.0.gate_proj.weight").device.kind, Device::Kind::kCuda);
  EXPECT_EQ(Find(*p, "model.layers.0.mlp.gate_proj.weight").device.kind, Device::Kind::kCuda);
  o.n_cpu_moe = 4;  // three MoE layers
  auto bad = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("the model has 3 MoE layers"), std::string::npos) << bad.status();
}

TEST(PlacementTest, TheFirstMatchingOverrideWinsOverTheOtherRules) {
  const Checkpoint c = Load("mixtral");
  PlacementOptions o = Options();
  o.cpu_moe = true;
  for (const char* rule : {"layers\\.3\\..*experts=cuda", "experts=cpu"}) {
    auto r = ParseOverrideRule(rule);
    ASSERT_TRUE(r.ok()) << r.status();
    o.overrides.push_back(*r);
  }
  auto p = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_TRUE(p.ok()) << p.status();
  const TensorPlace& kept = Find(*p, "model.layers.3.block_sparse_moe.experts.2.w1.weight");
  EXPECT_EQ(kept.device.kind, Device::Kind::kCuda);
  EXPECT_EQ(kept.rule, "--override-tensor layers\\.3\\..*experts=cuda");
  EXPECT_EQ(Find(*p, "model.layers.0.block_sparse_moe.experts.2.w1.weight").rule, "--override-tensor experts=cpu");
}

TEST(PlacementTest, PerTokenTensorsOnTheCpuGetAWarningWithTheirBytes) {
  const Checkpoint c = Load("qwen2_moe");
  PlacementOptions o = Options();
  auto r = ParseOverrideRule("shared_expert=cpu");
  ASSERT_TRUE(r.ok()) << r.status();
  o.overrides.push_back(*r);
  auto p = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_TRUE(p.ok()) << p.status();
  int64_t shared = 0;
  for (const TensorPlace& t : p->tensors) {
    if (t.kind.role == TensorRole::kSharedExpert) {
      EXPECT_EQ(t.device.kind, Device::Kind::kCpu) << t.name;
      shared += t.bytes;
    }
  }
  ASSERT_EQ(p->warnings.size(), 1u);
  // 4 layers x (3 matrices 128 x 128 + the gate's 128) bf16 = 0.4 MiB.
  EXPECT_EQ(shared, 4 * (3 * 128 * 128 + 128) * 2);
  EXPECT_NE(p->warnings[0].find("16 shared expert tensors on the CPU"), std::string::npos) << p->warnings[0];
  EXPECT_NE(p->warnings[0].find("0.4 MiB"), std::string::npos) << p->warnings[0];
}

TEST(PlacementTest, BadRulesSayWhatIsWrong) {
  for (const auto& [rule, says] :
       std::vector<std::pair<std::string, std::string>>{{"experts", "expected REGEX=DEVICE"},
                                                        {"=cpu", "the regex is empty"},
                                                        {"exp(erts=cpu", "is not a valid regex"},
                                                        {"experts=gpu", "is not cpu, cuda or cuda:N"},
                                                        {"experts=auto", "is not cpu, cuda or cuda:N"}}) {
    auto r = ParseOverrideRule(rule);
    ASSERT_FALSE(r.ok()) << rule;
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status();
  }
  auto other_gpu = ParseOverrideRule("experts=cuda:1");
  ASSERT_TRUE(other_gpu.ok());
  const Checkpoint c = Load("mixtral");
  PlacementOptions o = Options();
  o.overrides.push_back(*other_gpu);
  auto p = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("one process uses one GPU"), std::string::npos) << p.status();
}

}  // namespace
}  // namespace moe::runtime

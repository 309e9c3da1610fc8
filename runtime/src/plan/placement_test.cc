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

struct FixtureTensors {
  ModelSpec spec;
  std::vector<TensorInfo> tensors;
};

FixtureTensors Load(const std::string& arch) {
  FixtureTensors c;
  auto spec = LoadModelSpec(Fixture(arch));
  EXPECT_TRUE(spec.ok()) << spec.status();
  c.spec = *spec;
  auto source = OpenSafetensors(Fixture(arch));
  EXPECT_TRUE(source.ok()) << source.status();
  auto tensors = CheckpointTensors(**source);
  EXPECT_TRUE(tensors.ok()) << tensors.status();
  c.tensors = std::move(*tensors);
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
  for (const char* arch : {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"}) {
    const FixtureTensors c = Load(arch);
    for (const TensorInfo& t : c.tensors) {
      EXPECT_NE(ClassifyTensor(t.name).role, TensorRole::kOther) << arch << ": " << t.name;
    }
  }
}

TEST(PlacementTest, DefaultsPutEverythingOnTheGpu) {
  const FixtureTensors c = Load("qwen2_moe");
  auto p = PlaceTensors(c.spec, c.tensors, Options());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->BytesOn(Device::Kind::kCpu), 0);
  EXPECT_GT(p->BytesOn(Device::Kind::kCuda), 0);
  EXPECT_TRUE(p->warnings.empty());
}

TEST(PlacementTest, CpuMoeMovesEveryRoutedExpertAndNothingElse) {
  const FixtureTensors c = Load("glm4_moe");
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
  const FixtureTensors c = Load("glm4_moe");
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
  const FixtureTensors c = Load("mixtral");
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
  const FixtureTensors c = Load("qwen2_moe");
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
  const FixtureTensors c = Load("mixtral");
  PlacementOptions o = Options();
  o.overrides.push_back(*other_gpu);
  auto p = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("one process uses one GPU"), std::string::npos) << p.status();
  PlacementOptions too_many = Options();
  too_many.n_cpu_moe = 99;
  auto q = PlaceTensors(c.spec, c.tensors, too_many);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("--n-cpu-moe 99: the model has 4 MoE layers, so it takes 0 to 4"),
            std::string::npos)
      << q.status();
}

}  // namespace
}  // namespace moe::runtime

namespace moe::runtime {
namespace {

// What runs of a placement: the layers whose experts are all on the CPU; a split layer or another
// tensor on the CPU is an error naming the tensor and the rule.
TEST(PlacementTest, CpuExpertLayersAreWhatThePoolHolds) {
  const FixtureTensors c = Load("qwen3_moe");
  PlacementOptions o = Options();
  o.n_cpu_moe = 2;
  auto p = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_TRUE(p.ok()) << p.status();
  auto layers = CpuExpertLayers(*p);
  ASSERT_TRUE(layers.ok()) << layers.status();
  EXPECT_EQ(*layers, (std::vector<int>{0, 1}));
  o.n_cpu_moe = 0;
  auto none = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(CpuExpertLayers(*none)->empty());

  o.overrides = {*ParseOverrideRule(R"(layers\.3\.mlp\.experts\.5\.=cpu)")};
  auto split = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_TRUE(split.ok());
  auto refused = CpuExpertLayers(*split);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("layer 3's routed experts are split"), std::string::npos)
      << refused.status();

  o.overrides = {*ParseOverrideRule("exps=CPU")};  // a GGUF name: nothing matches, and a warning says so
  auto gguf = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_TRUE(gguf.ok());
  ASSERT_EQ(gguf->warnings.size(), 1u);
  EXPECT_NE(gguf->warnings[0].find("--override-tensor exps=CPU matches no tensor of the checkpoint, whose names read "
                                   "like model.layers."),
            std::string::npos)
      << gguf->warnings[0];
  EXPECT_TRUE(CpuExpertLayers(*gguf)->empty());

  o.overrides = {*ParseOverrideRule("self_attn=cpu")};
  auto attention = PlaceTensors(c.spec, c.tensors, o);
  ASSERT_TRUE(attention.ok());
  auto no = CpuExpertLayers(*attention);
  ASSERT_FALSE(no.ok());
  EXPECT_NE(no.status().message().find("--override-tensor self_attn=cpu puts model.layers."), std::string::npos)
      << no.status();
}

}  // namespace
}  // namespace moe::runtime

namespace moe::runtime {
namespace {

// Planning from config.json alone lists the tensors the checkpoint holds, with their sizes.
TEST(PlacementTest, ExpectedTensorsAreTheCheckpointsOwn) {
  for (const std::string arch : {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"}) {
    const FixtureTensors c = Load(arch);
    const std::vector<TensorInfo> expected = ExpectedTensors(c.spec);
    EXPECT_EQ(expected.size(), c.tensors.size()) << arch;
    for (const TensorInfo& e : expected) {
      auto it = std::find_if(c.tensors.begin(), c.tensors.end(), [&](const TensorInfo& t) { return t.name == e.name; });
      ASSERT_NE(it, c.tensors.end()) << arch << ": " << e.name << " is not in the checkpoint";
      EXPECT_EQ(e.elements, it->elements) << arch << ": " << e.name;
      EXPECT_EQ(e.rank, it->rank) << arch << ": " << e.name;
      EXPECT_EQ(e.rows, it->rows) << arch << ": " << e.name;
    }
  }
}

}  // namespace
}  // namespace moe::runtime

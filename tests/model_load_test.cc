// A broken model directory gets one clear error naming what is wrong and where.
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/model.h"
#include "test_util.h"

namespace moe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

absl::Status LoadStatus(const std::string& dir) { return runtime::Model::Load(dir).status(); }

TEST(ModelLoadTest, EveryFixtureLoads) {
  for (const char* arch : {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"}) {
    EXPECT_TRUE(LoadStatus(testing::FixtureDir(arch)).ok()) << arch;
  }
}

TEST(ModelLoadTest, MissingTensorIsNamed) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("qwen3_moe", model);
  testing::RewriteWeights(model, [](runtime::TensorEntry& e) {
    return e.name != "model.layers.2.mlp.experts.5.down_proj.weight";
  });
  absl::Status s = LoadStatus(model);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor model.layers.2.mlp.experts.5.down_proj.weight is missing"),
                                 HasSubstr("model.safetensors"), HasSubstr("[128, 64]")));
}

TEST(ModelLoadTest, WrongShapeNamesTensorFileExpectedFoundAndKey) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("qwen3_moe", model);
  testing::RewriteWeights(model, [](runtime::TensorEntry& e) {
    if (e.name == "model.layers.3.mlp.experts.7.up_proj.weight") e.shape = {96, 128};
    return true;
  });
  absl::Status s = LoadStatus(model);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("model.layers.3.mlp.experts.7.up_proj.weight: shape [96, 128] in model.safetensors"),
                    HasSubstr("config expects [64, 128]"), HasSubstr("moe_intermediate_size=64")));
}

TEST(ModelLoadTest, WrongDtypeIsNamed) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("mixtral", model);
  testing::RewriteWeights(model, [](runtime::TensorEntry& e) {
    if (e.name == "model.norm.weight") e.dtype = core::DType::kI32;
    return true;
  });
  EXPECT_THAT(LoadStatus(model).message(), HasSubstr("model.norm.weight: dtype I32 in model.safetensors, expected BF16"));
}

TEST(ModelLoadTest, TruncatedWeightsFileIsAnError) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("glm4_moe", model);
  std::filesystem::resize_file(model + "/model.safetensors", std::filesystem::file_size(model + "/model.safetensors") / 2);
  absl::Status s = LoadStatus(model);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("model.safetensors"), HasSubstr("truncated file?"), HasSubstr("tensor ")));
}

TEST(ModelLoadTest, ConfigProblemsAreReportedBeforeTheWeightsAreRead) {
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& j) { j["model_type"] = "gpt_oss"; }, "model_type 'gpt_oss' is not supported"},
      {[](nlohmann::json& j) { j["num_experts_per_tok"] = 17; }, "num_experts_per_tok=17"},
      {[](nlohmann::json& j) {
         j.erase("head_dim");
         j["num_attention_heads"] = 3;
         j["num_key_value_heads"] = 1;
       },
       "num_attention_heads=3 does not divide hidden_size=128"},
  };
  for (const Case& c : cases) {
    testing::ScratchDir dir;
    const std::string model = dir / "m";
    testing::CopyFixture("qwen3_moe", model);
    testing::EditConfig(model, c.edit);
    absl::Status s = LoadStatus(model);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), AllOf(HasSubstr(c.message), HasSubstr("config.json"))) << s;
  }
}

TEST(ModelLoadTest, UnusedTensorsWarnButLoad) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("qwen3_moe", model);
  testing::EditConfig(model, [](nlohmann::json& j) { j["num_hidden_layers"] = 3; });  // layer 3 left over
  ::testing::internal::CaptureStderr();
  absl::Status s = LoadStatus(model);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_THAT(err, HasSubstr("tensors in the checkpoint are not used"));
  EXPECT_THAT(err, HasSubstr("model.layers.3."));
}

}  // namespace
}  // namespace moe

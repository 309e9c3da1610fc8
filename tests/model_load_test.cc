// A broken model directory gets one clear error naming what is wrong and where.
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/model.h"
#include "moe/runtime/weight_source.h"
#include "test_util.h"

namespace moe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

absl::Status LoadStatus(const std::string& dir) { return runtime::Model::Load(dir).status(); }

TEST(ModelLoadTest, EveryFixtureLoads) {
  for (const char* arch : {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"}) {
    EXPECT_TRUE(LoadStatus(testing::FixtureDir(arch)).ok()) << arch;
  }
}

TEST(ModelLoadTest, MissingTensorIsNamed) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("qwen3_moe", model);
  testing::RewriteWeights(
      model, [](runtime::TensorEntry& e) { return e.name != "model.layers.2.mlp.experts.5.down_proj.weight"; });
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
  EXPECT_THAT(LoadStatus(model).message(),
              HasSubstr("model.norm.weight: dtype I32 in model.safetensors, expected BF16"));
}

TEST(ModelLoadTest, TruncatedWeightsFileIsAnError) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("glm4_moe", model);
  std::filesystem::resize_file(model + "/model.safetensors",
                               std::filesystem::file_size(model + "/model.safetensors") / 2);
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

// Config values that used to wrap, abort or load into NaN logits are errors from Model::Load,
// reported before any weight is read.
TEST(ModelLoadTest, OutOfRangeConfigValuesAreErrorsNotCrashes) {
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& j) { j["num_hidden_layers"] = 1099511627776; },
       "num_hidden_layers=1099511627776 is out of range: must be between 1 and 1024"},
      {[](nlohmann::json& j) { j["num_hidden_layers"] = 1000000000; }, "num_hidden_layers=1000000000 is out of range"},
      {[](nlohmann::json& j) { j["rope_parameters"]["rope_theta"] = -1; },
       "rope_parameters.rope_theta=-1 is out of range: must be a finite number in [1, 1e+12]"},
      {[](nlohmann::json& j) { j["rms_norm_eps"] = -1e-6; }, "rms_norm_eps=-1e-06 is out of range"},
      {[](nlohmann::json& j) { j["model_type"] = 5; }, "model_type must be a string, found 5"},
      {[](nlohmann::json& j) { j["mlp_only_layers"] = {9}; }, "mlp_only_layers[0]=9 is out of range"},
      {[](nlohmann::json& j) { j["eos_token_id"] = 512; }, "eos_token_id=512 is out of range"},
  };
  for (const Case& c : cases) {
    testing::ScratchDir dir;
    const std::string model = dir / "m";
    testing::CopyFixture("qwen3_moe", model);
    testing::EditConfig(model, c.edit);
    absl::Status s = LoadStatus(model);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), AllOf(HasSubstr(c.message), HasSubstr(model + "/config.json"))) << s;
  }
}

TEST(ModelLoadTest, ConfigSyntaxErrorNamesLineAndColumn) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("qwen3_moe", model);
  std::ofstream(model + "/config.json", std::ios::trunc) << "{\n  \"model_type\": \"qwen3_moe\",\n  x\n}\n";
  absl::Status s = LoadStatus(model);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(model + "/config.json:3:3: invalid JSON: "));
}

TEST(ModelLoadTest, ConfigLinkedToADeviceIsRefused) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("qwen3_moe", model);
  std::filesystem::remove(model + "/config.json");
  std::filesystem::create_symlink("/dev/zero", model + "/config.json");
  absl::Status s = LoadStatus(model);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(model + "/config.json is a character device, not a regular file"));
}

TEST(ModelLoadTest, WeightsLinkedToThemselvesAreAnErrorNotAnAbort) {
  testing::ScratchDir dir;
  const std::string model = dir / "m";
  testing::CopyFixture("qwen3_moe", model);
  std::filesystem::remove(model + "/model.safetensors");
  std::filesystem::create_symlink("model.safetensors", model + "/model.safetensors");
  absl::Status s = LoadStatus(model);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(model + "/model.safetensors is a symbolic link loop"));
}

TEST(ModelLoadTest, IndexMayNotReachOutsideTheModelFolder) {
  testing::ScratchDir dir;
  const std::string model = dir / "snap/m";
  testing::CopyFixture("qwen3_moe", dir / "other");
  testing::CopyFixture("qwen3_moe", model);
  std::filesystem::remove(model + "/model.safetensors");
  nlohmann::json map;
  auto source = runtime::OpenSafetensorsFile(dir / "other/model.safetensors");
  ASSERT_TRUE(source.ok()) << source.status();
  for (const std::string& name : (*source)->Names()) map[name] = "../../other/model.safetensors";
  std::ofstream(model + "/model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
  absl::Status s = LoadStatus(model);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr(model + "/model.safetensors.index.json: weight_map entry for tensor "),
                                 HasSubstr(" is \"../../other/model.safetensors\", which has a '..' component")));
}

// The Hugging Face cache layout: snapshots/REV/* are links to ../../blobs/HASH.
TEST(ModelLoadTest, HuggingFaceCacheLayoutLoads) {
  testing::ScratchDir dir;
  testing::CopyFixture("mixtral", dir / "blobs");
  const std::string snapshot = dir / "snapshots/0123abc";
  std::filesystem::create_directories(snapshot);
  for (const char* f : {"config.json", "model.safetensors"}) {
    std::filesystem::rename(dir / (std::string("blobs/") + f), dir / (std::string("blobs/") + f + ".blob"));
    std::filesystem::create_symlink(std::string("../../blobs/") + f + ".blob", snapshot + "/" + f);
  }
  auto model = runtime::Model::Load(snapshot);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->spec().model_type, "mixtral");
}

}  // namespace
}  // namespace moe

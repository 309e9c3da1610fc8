#include "moe/runtime/model_spec.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::runtime {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

std::string Fixture(const std::string& arch) {
  const char* env = std::getenv("MOE_TESTDATA_DIR");  // set when the tests run from a bundle
  return std::string(env != nullptr ? env : MOE_TESTDATA_DIR) + "/fixtures/" + arch;
}

// A minimal valid qwen3_moe config in the older key spellings of real checkpoints.
Json Qwen3Config() {
  return Json::parse(R"({
    "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16,
    "num_experts_per_tok": 4, "moe_intermediate_size": 32, "intermediate_size": 512,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "norm_topk_prob": true,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "eos_token_id": 7})");
}

absl::StatusOr<ModelSpec> Parse(const Json& j) { return ParseModelSpec(j.dump(), "test/config.json"); }

TEST(ModelSpecTest, ReadsQwen3MoeFixture) {
  auto s = LoadModelSpec(Fixture("qwen3_moe"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->arch, Architecture::kQwen3Moe);
  EXPECT_EQ(s->hidden_size, 128);
  EXPECT_EQ(s->head_dim, 32);
  EXPECT_EQ(s->rotary_dim, 32);
  EXPECT_TRUE(s->qk_norm);
  EXPECT_FALSE(s->qkv_bias);
  EXPECT_EQ(s->routing.num_experts, 16);  // spelled num_local_experts in this file
  EXPECT_EQ(s->routing.top_k, 4);
  EXPECT_TRUE(s->routing.normalize_top_k);
  EXPECT_EQ(s->routing.scoring, ScoringFunction::kSoftmax);
  EXPECT_FLOAT_EQ(s->rope_theta, 1e6f);  // from rope_parameters.rope_theta
  EXPECT_EQ(s->num_moe_layers(), 4);
}

TEST(ModelSpecTest, ReadsQwen2MoeSharedExpertWithGate) {
  auto s = LoadModelSpec(Fixture("qwen2_moe"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->shared_expert_intermediate_size, 128);
  EXPECT_TRUE(s->shared_expert_gate);
  EXPECT_TRUE(s->qkv_bias);
  EXPECT_FALSE(s->qk_norm);
  EXPECT_FALSE(s->routing.normalize_top_k);
}

TEST(ModelSpecTest, ReadsMixtralExpertsAtIntermediateSize) {
  auto s = LoadModelSpec(Fixture("mixtral"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->moe_intermediate_size, 128);
  EXPECT_TRUE(s->routing.normalize_top_k);
  EXPECT_EQ(s->shared_expert_intermediate_size, 0);
  EXPECT_EQ(s->eos_token_ids, std::vector<int>({2}));
}

TEST(ModelSpecTest, ReadsGlm4MoeSigmoidGroupRoutingAndPartialRotary) {
  auto s = LoadModelSpec(Fixture("glm4_moe"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->routing.scoring, ScoringFunction::kSigmoid);
  EXPECT_TRUE(s->routing.has_correction_bias);
  EXPECT_EQ(s->routing.n_group, 4);
  EXPECT_EQ(s->routing.topk_group, 2);
  EXPECT_FLOAT_EQ(s->routing.routed_scaling_factor, 2.5f);
  EXPECT_EQ(s->rotary_dim, 16);
  EXPECT_TRUE(s->qkv_bias);
  EXPECT_FALSE(s->IsMoeLayer(0));  // first_k_dense_replace = 1
  EXPECT_TRUE(s->IsMoeLayer(1));
  EXPECT_EQ(s->shared_expert_intermediate_size, 64);
}

TEST(ModelSpecTest, AcceptsOlderAndNewerKeySpellings) {
  Json old_style = Qwen3Config();
  auto a = Parse(old_style);
  ASSERT_TRUE(a.ok()) << a.status();
  Json new_style = Qwen3Config();
  new_style.erase("num_experts");
  new_style["num_local_experts"] = 16;
  new_style.erase("rope_theta");
  new_style["rope_parameters"] = {{"rope_theta", 1000000.0}, {"rope_type", "default"}};
  auto b = Parse(new_style);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->routing.num_experts, b->routing.num_experts);
  EXPECT_EQ(a->rope_theta, b->rope_theta);
  EXPECT_FALSE(a->IsMoeLayer(1));  // mlp_only_layers
  EXPECT_TRUE(a->IsMoeLayer(2));
  EXPECT_EQ(a->eos_token_ids, std::vector<int>({7}));
}

TEST(ModelSpecTest, DerivesHeadDimFromHiddenSize) {
  Json j = Qwen3Config();
  j.erase("head_dim");
  auto s = Parse(j);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->head_dim, 32);
}

TEST(ModelSpecTest, UnknownModelTypeListsTheSupportedOnes) {
  Json j = Qwen3Config();
  j["model_type"] = "llama4";
  auto s = Parse(j);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("model_type 'llama4' is not supported"));
  EXPECT_THAT(s.status().message(), HasSubstr("qwen3_moe, qwen2_moe, mixtral, glm4_moe"));
  EXPECT_THAT(s.status().message(), HasSubstr("test/config.json"));
}

TEST(ModelSpecTest, RejectsTopKLargerThanTheExperts) {
  Json j = Qwen3Config();
  j["num_experts_per_tok"] = 20;
  auto s = Parse(j);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("num_experts_per_tok=20"));
  EXPECT_THAT(s.status().message(), HasSubstr("(16)"));
}

TEST(ModelSpecTest, RejectsHeadsThatDoNotDivideTheHiddenSize) {
  Json j = Qwen3Config();
  j.erase("head_dim");
  j["num_attention_heads"] = 6;
  auto s = Parse(j);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("num_attention_heads=6 does not divide hidden_size=256"));
}

TEST(ModelSpecTest, RejectsOtherImpossibleValues) {
  struct Case {
    const char* key;
    Json value;
    const char* message;
  };
  for (const Case& c : {Case{"num_key_value_heads", 3, "not a multiple of num_key_value_heads=3"},
                        Case{"num_hidden_layers", 0, "num_hidden_layers=0"},
                        Case{"num_experts_per_tok", 0, "num_experts_per_tok=0"},
                        Case{"vocab_size", "big", "vocab_size must be an integer"},
                        Case{"head_dim", 33, "head_dim=33"},
                        Case{"decoder_sparse_step", 0, "decoder_sparse_step=0"}}) {
    Json j = Qwen3Config();
    j[c.key] = c.value;
    auto s = Parse(j);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.key;
    EXPECT_THAT(s.status().message(), HasSubstr(c.message)) << c.key;
  }
}

TEST(ModelSpecTest, RejectsImpossibleGroupRouting) {
  Json j = Json::parse(std::string(R"({"model_type": "glm4_moe", "vocab_size": 100, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "moe_intermediate_size": 16, "intermediate_size": 64, "n_group": 5,
    "topk_group": 2})"));
  auto s = Parse(j);
  EXPECT_THAT(s.status().message(), HasSubstr("n_group=5 does not divide the number of experts (16)"));
  j["n_group"] = 4;
  j["topk_group"] = 1;
  j["num_experts_per_tok"] = 6;
  s = Parse(j);
  EXPECT_THAT(s.status().message(), HasSubstr("num_experts_per_tok=6 is more than the 4 experts"));
}

TEST(ModelSpecTest, RejectsUnsupportedRopeScaling) {
  Json j = Qwen3Config();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  auto s = Parse(j);
  EXPECT_THAT(s.status().message(), HasSubstr("rope_type 'yarn' is not supported yet"));
}

TEST(ModelSpecTest, ReportsMalformedAndMissingFiles) {
  auto s = ParseModelSpec("{not json", "dir/config.json");
  EXPECT_THAT(s.status().message(), HasSubstr("dir/config.json: not a JSON object"));
  auto missing = LoadModelSpec("/nonexistent/model");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/model/config.json"));
}

}  // namespace
}  // namespace moe::runtime

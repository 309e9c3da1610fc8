#include "moe/runtime/model_spec.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/model.h"
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
  for (const Case& c :
       {Case{"num_key_value_heads", 3, "not a multiple of num_key_value_heads=3"},
        Case{"num_hidden_layers", 0, "num_hidden_layers=0"}, Case{"num_experts_per_tok", 0, "num_experts_per_tok=0"},
        Case{"vocab_size", "big", "vocab_size must be an integer"}, Case{"head_dim", 33, "head_dim=33"},
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
  EXPECT_THAT(s.status().message(),
              HasSubstr("rope_scaling.rope_type 'yarn' is supported for deepseek_v3 only; qwen3_moe takes 'default'"));
  j["rope_scaling"] = {{"type", "longrope"}, {"factor", 4.0}};
  EXPECT_THAT(Parse(j).status().message(),
              HasSubstr("test/config.json: rope_scaling.type 'longrope' is not supported (supported: 'default', "
                        "'yarn')"));
}

// DeepSeek-V3's published config.json (the 671B model): MLA, YaRN x40, 3 dense layers, 8 groups.
Json DeepseekV3Config() {
  return Json::parse(R"({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": true,
    "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": false})");
}

TEST(ModelSpecTest, ReadsDeepseekV3MlaYarnAndGroupRouting) {
  auto s = Parse(DeepseekV3Config());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->arch, Architecture::kDeepseekV3);
  EXPECT_EQ(s->mla.q_lora_rank, 1536);
  EXPECT_EQ(s->mla.kv_lora_rank, 512);
  EXPECT_EQ(s->mla.latent_width(), 576);
  EXPECT_EQ(s->head_dim, 192);  // qk_nope + qk_rope
  EXPECT_EQ(s->rotary_dim, 64);
  EXPECT_TRUE(s->mla.rope_interleave);  // transformers' default when the config says nothing
  EXPECT_TRUE(s->uses_mla());
  EXPECT_EQ(s->attention(0), AttentionKind::kMla);
  EXPECT_EQ(s->attention(61), AttentionKind::kMla);  // the MTP layer
  EXPECT_EQ(s->num_nextn_layers, 1);
  EXPECT_EQ(s->rope_scaling.type, RopeType::kYarn);
  EXPECT_FLOAT_EQ(s->rope_scaling.factor, 40.0f);
  EXPECT_EQ(s->rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_FLOAT_EQ(s->rope_scaling.attention_factor, 1.0f);  // mscale / mscale_all_dim
  // 192^-0.5 x (0.1 ln 40 + 1)^2
  EXPECT_NEAR(s->attention_scale(), 0.1352337788608801, 1e-6);
  EXPECT_EQ(s->routing.scoring, ScoringFunction::kSigmoid);
  EXPECT_TRUE(s->routing.has_correction_bias);
  EXPECT_EQ(s->routing.n_group, 8);
  EXPECT_EQ(s->routing.topk_group, 4);
  EXPECT_FLOAT_EQ(s->routing.routed_scaling_factor, 2.5f);
  EXPECT_EQ(s->num_moe_layers(), 58);
  EXPECT_FALSE(s->IsMoeLayer(2));
  EXPECT_TRUE(s->IsMoeLayer(3));
  EXPECT_EQ(s->shared_expert_intermediate_size, 2048);
  Json kimi = DeepseekV3Config();  // Kimi-K2's checkpoints name their type kimi_k2: the same layers
  kimi["model_type"] = "kimi_k2";
  auto k = Parse(kimi);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->arch, Architecture::kDeepseekV3);
  EXPECT_EQ(k->model_type, "kimi_k2");
}

// YaRN's frequencies for DeepSeek-V3 (rope 64, theta 1e4, x40 over 4096 positions), as transformers
// computes them in fp32: the correction range is dimensions [10, 23]; below it the frequencies are
// kept, above it divided by 40, and blended between.
TEST(ModelSpecTest, YarnFrequenciesFollowTransformers) {
  auto s = Parse(DeepseekV3Config());
  ASSERT_TRUE(s.ok()) << s.status();
  const std::vector<float> inv_freq = RopeInverseFrequencies(*s);
  ASSERT_EQ(inv_freq.size(), 32u);
  const std::pair<int, double> want[] = {{0, 1.0},
                                         {10, 0.05623412877321243},
                                         {11, 0.039006926119327545},
                                         {15, 0.0083345090970397},
                                         {20, 0.0007905694073997438},
                                         {25, 1.8747354260995053e-05},
                                         {31, 3.3338035336782923e-06}};
  for (const auto& [i, f] : want) EXPECT_NEAR(inv_freq[i], f, 2e-7 * f) << "dimension pair " << i;
}

TEST(ModelSpecTest, ReadsTheDeepseekV3Fixture) {
  auto s = LoadModelSpec(Fixture("deepseek_v3"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->mla.q_lora_rank, 64);
  EXPECT_EQ(s->mla.kv_lora_rank, 32);
  EXPECT_EQ(s->mla.qk_nope_head_dim, 32);
  EXPECT_EQ(s->mla.qk_rope_head_dim, 16);
  EXPECT_EQ(s->mla.v_head_dim, 32);
  EXPECT_TRUE(s->mla.rope_interleave);
  EXPECT_EQ(s->head_dim, 48);  // not config.json's head_dim (16), which is transformers' rope half
  EXPECT_EQ(s->rope_scaling.type, RopeType::kDefault);
  EXPECT_NEAR(s->attention_scale(), 1.0 / std::sqrt(48.0), 1e-7);
}

TEST(ModelSpecTest, DeepseekV3WithoutAQLoraUsesAPlainQProjection) {
  Json j = DeepseekV3Config();
  j["q_lora_rank"] = nullptr;  // DeepSeek-V2-Lite's way
  auto s = Parse(j);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->mla.q_lora_rank, 0);
  j.erase("q_lora_rank");
  ASSERT_TRUE(Parse(j).ok());
}

TEST(ModelSpecTest, DeepseekV3MissingAnMlaWidthNamesIt) {
  for (const char* key : {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}) {
    Json j = DeepseekV3Config();
    j.erase(key);
    auto s = Parse(j);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr(std::string("test/config.json: missing ") + key));
  }
  Json odd = DeepseekV3Config();
  odd["qk_rope_head_dim"] = 63;
  EXPECT_THAT(Parse(odd).status().message(), HasSubstr("qk_rope_head_dim=63 must be even"));
  Json yarn = DeepseekV3Config();
  yarn["rope_scaling"].erase("factor");
  EXPECT_THAT(Parse(yarn).status().message(), HasSubstr("rope_scaling.type 'yarn' needs a factor"));
}

TEST(ModelSpecTest, ReportsMalformedAndMissingFiles) {
  auto s = ParseModelSpec("{not json", "dir/config.json");
  EXPECT_THAT(s.status().message(), HasSubstr("dir/config.json:1:3: invalid JSON: "));
  auto missing = LoadModelSpec("/nonexistent/model");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/model/config.json"));
}

// A large real config (GLM-4.5's shape, Qwen3-235B-A22B's and DeepSeek-V3's sizes) is inside
// every limit.
TEST(ModelSpecTest, AcceptsTheShapesOfTheLargestPublishedModels) {
  Json glm = Json::parse(R"({"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120,
    "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "n_routed_experts": 160, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
    "intermediate_size": 12288, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 3,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5,
    "rope_theta": 1000000, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
    "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329})");
  auto s = Parse(glm);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->num_moe_layers(), 89);
  EXPECT_EQ(s->rotary_dim, 64);
  Json deepseek_sized = Qwen3Config();
  deepseek_sized.update(Json::parse(R"({"vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "head_dim": 128, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "intermediate_size": 18432,
    "max_position_embeddings": 163840, "mlp_only_layers": [0, 1, 2], "eos_token_id": 1, "bos_token_id": 0})"));
  auto d = Parse(deepseek_sized);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->num_moe_layers(), 58);
}

TEST(ModelSpecTest, IntegersThatDoNotFitAreOutOfRangeNotWrapped) {
  struct Case {
    const char* key;
    Json value;
    const char* message;
  };
  for (const Case& c : {
           Case{"num_hidden_layers", 1099511627776,
                "num_hidden_layers=1099511627776 is out of range: must be "
                "between 1 and 1024"},
           Case{"num_hidden_layers", 1000000000, "num_hidden_layers=1000000000 is out of range"},
           Case{"num_hidden_layers", -3, "num_hidden_layers=-3 is out of range"},
           Case{"vocab_size", Json(uint64_t{18446744073709551615u}),
                "vocab_size=18446744073709551615 is out of range: must be between 1 and 16777216"},
           Case{"vocab_size", 4294967296 + 1000, "vocab_size=4294968296 is out of range"},
           Case{"hidden_size", 65537, "hidden_size=65537 is out of range: must be between 1 and 65536"},
           Case{"num_attention_heads", 4294967304, "num_attention_heads=4294967304 is out of range"},
           Case{"num_key_value_heads", 0, "num_key_value_heads=0 is out of range"},
           Case{"head_dim", 4096, "head_dim=4096 is out of range: must be between 2 and 1024"},
           Case{"num_experts", 1 << 20, "num_experts=1048576 is out of range: must be between 1 and 4096"},
           Case{"num_experts_per_tok", -1, "num_experts_per_tok=-1 is out of range"},
           Case{"intermediate_size", int64_t{1} << 33, "intermediate_size=8589934592 is out of range"},
           Case{"moe_intermediate_size", 0, "moe_intermediate_size=0 is out of range"},
           Case{"max_position_embeddings", int64_t{1} << 40, "max_position_embeddings=1099511627776 is out of range"},
       }) {
    Json j = Qwen3Config();
    j[c.key] = c.value;
    auto s = Parse(j);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.key;
    EXPECT_THAT(s.status().message(), HasSubstr(c.message)) << c.key;
    EXPECT_THAT(s.status().message(), HasSubstr("test/config.json")) << c.key;
  }
}

TEST(ModelSpecTest, NonIntegersAreRefusedWhereAnIntegerIsNeeded) {
  for (const auto& [value, found] : std::vector<std::pair<Json, std::string>>{
           {Json(4.0), "4.0"}, {Json("4"), "\"4\""}, {Json(true), "true"}, {Json::array({4}), "a list of 1 value"}}) {
    Json j = Qwen3Config();
    j["num_hidden_layers"] = value;
    auto s = Parse(j);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << found;
    EXPECT_THAT(s.status().message(), HasSubstr("num_hidden_layers must be an integer, found " + found));
  }
  Json j = Qwen3Config();
  j["mlp_only_layers"] = Json::array({1, 2.5});
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("mlp_only_layers[1] must be an integer, found 2.5"));
}

TEST(ModelSpecTest, FloatsMustBeFiniteAndInRange) {
  struct Case {
    const char* key;
    Json value;
    const char* message;
  };
  for (const Case& c : {
           Case{"rope_theta", -1, "rope_theta=-1 is out of range: must be a finite number in [1, 1e+12]"},
           Case{"rope_theta", 0, "rope_theta=0 is out of range"},
           Case{"rope_theta", 0.5, "rope_theta=0.5 is out of range"},
           Case{"rope_theta", 1e39, "rope_theta=1e+39 is out of range"},
           Case{"rope_theta", "big", "rope_theta must be a number, found \"big\""},
           Case{"rms_norm_eps", 0, "rms_norm_eps=0 is out of range: must be a finite number in (0, 1]"},
           Case{"rms_norm_eps", -1e-6, "rms_norm_eps=-1e-06 is out of range"},
           Case{"rms_norm_eps", 1e-50, "rms_norm_eps=1e-50 is out of range"},  // 0 in fp32
           Case{"rms_norm_eps", 2, "rms_norm_eps=2 is out of range"},
           Case{"partial_rotary_factor", 0,
                "partial_rotary_factor=0 is out of range: must be a finite number in (0, 1]"},
           Case{"partial_rotary_factor", 1.5, "partial_rotary_factor=1.5 is out of range"},
           Case{"partial_rotary_factor", 0.01, "gives a rotary dimension of 0 of head_dim=64"},
       }) {
    Json j = Qwen3Config();
    j[c.key] = c.value;
    auto s = Parse(j);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.key << "=" << c.value;
    EXPECT_THAT(s.status().message(), HasSubstr(c.message)) << c.key << "=" << c.value;
  }
  // The nested spelling is named as it is written.
  Json j = Qwen3Config();
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_theta", -1}, {"rope_type", "default"}};
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("rope_parameters.rope_theta=-1 is out of range"));
  j["rope_parameters"] = {{"rope_theta", 1e6}, {"rope_type", 3}};
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("rope_parameters.rope_type must be a string, found 3"));
}

Json Glm4Config() {
  return Json::parse(R"({"model_type": "glm4_moe", "vocab_size": 100, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "moe_intermediate_size": 16, "intermediate_size": 64, "n_group": 4,
    "topk_group": 2})");
}

TEST(ModelSpecTest, GroupRoutingAndSharedExpertValuesAreRangeChecked) {
  struct Case {
    const char* key;
    Json value;
    const char* message;
  };
  for (const Case& c : {
           Case{"routed_scaling_factor", -1,
                "routed_scaling_factor=-1 is out of range: must be a finite number in (0, 1000]"},
           Case{"routed_scaling_factor", 0, "routed_scaling_factor=0 is out of range"},
           Case{"routed_scaling_factor", 1e300, "routed_scaling_factor=1e+300 is out of range"},
           Case{"n_group", 0, "n_group=0 is out of range: must be between 1 and the number of experts (16)"},
           Case{"n_group", 4294967300, "n_group=4294967300 is out of range"},
           Case{"topk_group", 5, "topk_group=5 is out of range: must be between 1 and n_group=4"},
           Case{"n_shared_experts", -1, "n_shared_experts=-1 is out of range: must be between 0 and 64"},
           Case{"first_k_dense_replace", 3,
                "first_k_dense_replace=3 is out of range: must be between 0 and "
                "num_hidden_layers (2)"},
           Case{"first_k_dense_replace", -1, "first_k_dense_replace=-1 is out of range"},
       }) {
    Json j = Glm4Config();
    j[c.key] = c.value;
    auto s = Parse(j);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.key << "=" << c.value;
    EXPECT_THAT(s.status().message(), HasSubstr(c.message)) << c.key << "=" << c.value;
  }
  Json qwen2 = Qwen3Config();
  qwen2["model_type"] = "qwen2_moe";
  qwen2["shared_expert_intermediate_size"] = -5;
  EXPECT_THAT(Parse(qwen2).status().message(), HasSubstr("shared_expert_intermediate_size=-5 is out of range"));
}

TEST(ModelSpecTest, LayerListsMustNameExistingLayers) {
  Json j = Qwen3Config();  // 3 layers
  j["mlp_only_layers"] = Json::array({0, 3});
  EXPECT_THAT(Parse(j).status().message(),
              HasSubstr("mlp_only_layers[1]=3 is out of range: must be between 0 and 2 (num_hidden_layers=3)"));
  j["mlp_only_layers"] = Json::array({-1});
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("mlp_only_layers[0]=-1 is out of range"));
  j["mlp_only_layers"] = Json::array();
  j["decoder_sparse_step"] = 4;
  EXPECT_THAT(Parse(j).status().message(),
              HasSubstr("decoder_sparse_step=4 is out of range: must be between 1 and num_hidden_layers (3)"));
}

TEST(ModelSpecTest, TokenIdsMustBeInTheVocabulary) {
  struct Case {
    const char* key;
    Json value;
    const char* message;
  };
  for (const Case& c : {
           Case{"eos_token_id", 1000, "eos_token_id=1000 is out of range: must be between 0 and 999 (vocab_size=1000)"},
           Case{"eos_token_id", Json::array({7, -1}), "eos_token_id[1]=-1 is out of range"},
           Case{"eos_token_id", "x", "eos_token_id must be a list of integers, found \"x\""},
           Case{"bos_token_id", 5000, "bos_token_id=5000 is out of range"},
           Case{"pad_token_id", Json(uint64_t{1} << 63), "pad_token_id=9223372036854775808 is out of range"},
           Case{"pad_token_id", 1.5, "pad_token_id must be an integer, found 1.5"},
       }) {
    Json j = Qwen3Config();
    j[c.key] = c.value;
    auto s = Parse(j);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.key << "=" << c.value;
    EXPECT_THAT(s.status().message(), HasSubstr(c.message)) << c.key << "=" << c.value;
  }
  Json j = Qwen3Config();
  j["bos_token_id"] = nullptr;  // as transformers writes an unset id
  j["pad_token_id"] = 999;
  EXPECT_TRUE(Parse(j).ok()) << Parse(j).status();
}

TEST(ModelSpecTest, ModelTypeOfTheWrongTypeSaysSo) {
  Json j = Qwen3Config();
  j["model_type"] = 5;
  auto s = Parse(j);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("test/config.json: model_type must be a string, found 5; supported: "
                                              "qwen3_moe, qwen2_moe, mixtral, glm4_moe"));
  j.erase("model_type");
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("test/config.json: missing model_type; supported: "));
  EXPECT_THAT(ParseModelSpec("[1, 2]", "c.json").status().message(),
              HasSubstr("c.json: expected a JSON object at the top level, found a list of 2 values"));
}

// config.json on disk: read with a size limit, only as a regular file, errors naming the file.
class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("moe_config_" + std::to_string(::getpid()) + "_" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / "config.json").string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
  std::string path_;
};

TEST_F(ConfigFileTest, ParseErrorNamesTheLineAndColumn) {
  std::ofstream(path_) << "{\n  \"model_type\": \"qwen3_moe\",\n  \"vocab_size\": 10,,\n}\n";
  auto s = LoadModelSpec(dir_.string());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr(path_ + ":3:20: invalid JSON: syntax error"));
}

TEST_F(ConfigFileTest, DeviceIsRefusedInsteadOfReadForever) {
  std::filesystem::create_symlink("/dev/zero", path_);
  auto s = LoadModelSpec(dir_.string());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr(path_ + " is a character device, not a regular file"));
}

TEST_F(ConfigFileTest, FifoAndDirectoryAreRefused) {
  ASSERT_EQ(::mkfifo(path_.c_str(), 0600), 0);
  EXPECT_THAT(LoadModelSpec(dir_.string()).status().message(), HasSubstr(path_ + " is a fifo, not a regular file"));
  std::filesystem::remove(path_);
  std::filesystem::create_directory(path_);
  EXPECT_THAT(LoadModelSpec(dir_.string()).status().message(),
              HasSubstr(path_ + " is a directory, not a regular file"));
}

TEST_F(ConfigFileTest, OversizedConfigIsRefusedNamingTheLimit) {
  Json j = Qwen3Config();
  j["padding"] = std::string(kMaxConfigBytes, ' ');
  std::ofstream(path_) << j.dump();
  auto s = LoadModelSpec(dir_.string());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr(path_ + " is "));
  EXPECT_THAT(s.status().message(), HasSubstr("more than the 4 MiB allowed for config.json"));
}

TEST_F(ConfigFileTest, SymbolicLinkLoopIsNamed) {
  std::filesystem::create_symlink("config.json", path_);
  auto s = LoadModelSpec(dir_.string());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr(path_ + " is a symbolic link loop"));
}

TEST_F(ConfigFileTest, LinkToARealConfigLoads) {
  const std::string blob = (dir_ / "blob").string();
  std::ofstream(blob) << Qwen3Config().dump();
  std::filesystem::create_symlink("blob", path_);
  auto s = LoadModelSpec(dir_.string());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->num_layers, 3);
}

}  // namespace
}  // namespace moe::runtime

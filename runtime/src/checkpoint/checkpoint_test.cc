#include "moe/runtime/checkpoint.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/placement.h"

namespace moe::runtime {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string Fixture(const std::string& arch) {
  const char* env = std::getenv("MOE_TESTDATA_DIR");  // set when the tests run from a bundle
  return std::string(env != nullptr ? env : MOE_TESTDATA_DIR) + "/fixtures/" + arch;
}

const Architecture kArchs[] = {Architecture::kQwen3Moe, Architecture::kQwen2Moe, Architecture::kMixtral,
                               Architecture::kGlm4Moe};

TEST(WeightFormatTest, CountsBytesOfPlainBlockAndScaledTensors) {
  EXPECT_EQ(WeightFormat::Plain(core::DType::kBF16).Bytes({64, 128}), 64 * 128 * 2);
  EXPECT_EQ(WeightFormat::Plain(core::DType::kF32).Bytes({7}), 28);
  // GGUF's Q4_K: 144 bytes per 256 values; Q8_0: 34 per 32.
  const WeightFormat q4k = WeightFormat::Blocks(12, "Q4_K", 256, 144);
  EXPECT_EQ(q4k.RowBytes(2048), 8 * 144);
  EXPECT_EQ(q4k.Bytes({128, 8, 2048}), 128 * 8 * 8 * 144);  // a stacked expert tensor
  EXPECT_TRUE(q4k.Fits(2048));
  EXPECT_FALSE(q4k.Fits(2000));
  EXPECT_EQ(q4k.Name(), "Q4_K");
  EXPECT_EQ(WeightFormat::Blocks(8, "Q8_0", 32, 34).Bytes({4096, 4096}), 4096 * 128 * 34);
  // FP8 with weight_scale_inv: the values' bytes; the scales are a tensor of their own.
  const WeightFormat fp8 = WeightFormat::BlockScaled(core::DType::kF8E4M3, 128, 128, core::DType::kF32);
  EXPECT_EQ(fp8.Bytes({7168, 2048}), 7168 * 2048);
  EXPECT_THAT(fp8.Name(), HasSubstr("128x128"));
  EXPECT_FALSE(fp8 == WeightFormat::Plain(core::DType::kF8E4M3));
  EXPECT_TRUE(q4k == WeightFormat::Blocks(12, "Q4_K", 256, 144));
}

// Every name a table gives parses back to its key, and no two keys share a name.
TEST(TensorNamesTest, EveryNameParsesBackToItsKey) {
  for (Architecture arch : kArchs) {
    for (Container c : {Container::kSafetensors, Container::kGguf}) {
      const TensorNames& t = TensorNames::For(arch, c);
      EXPECT_EQ(t.arch(), arch);
      std::set<std::string> seen;
      for (int i = 0; i < static_cast<int>(TensorId::kCount); ++i) {
        const TensorId id = static_cast<TensorId>(i);
        if (!t.Has(id)) continue;
        const bool global = id == TensorId::kEmbedding || id == TensorId::kFinalNorm || id == TensorId::kLmHead;
        const bool expert = RoleOf(id) == TensorRole::kRoutedExpert && !t.Stacked(id);
        const TensorKey key{id, global ? -1 : 17, expert ? 5 : -1};
        const std::string name = t.Name(key);
        ASSERT_FALSE(name.empty());
        EXPECT_TRUE(seen.insert(name).second) << name << " named twice";
        const std::optional<TensorKey> back = t.Parse(name);
        ASSERT_TRUE(back.has_value()) << name;
        EXPECT_EQ(*back, key) << name << " parsed as " << KeyString(*back);
      }
    }
  }
}

TEST(TensorNamesTest, SpellsEachArchitectureAndContainer) {
  const TensorKey up{TensorId::kExpertUp, 3, 7};
  EXPECT_EQ(TensorNames::For(Architecture::kQwen3Moe, Container::kSafetensors).Name(up),
            "model.layers.3.mlp.experts.7.up_proj.weight");
  EXPECT_EQ(TensorNames::For(Architecture::kMixtral, Container::kSafetensors).Name(up),
            "model.layers.3.block_sparse_moe.experts.7.w3.weight");
  EXPECT_EQ(TensorNames::For(Architecture::kQwen2Moe, Container::kSafetensors).Name({TensorId::kSharedDown, 1}),
            "model.layers.1.mlp.shared_expert.down_proj.weight");
  EXPECT_EQ(TensorNames::For(Architecture::kGlm4Moe, Container::kSafetensors).Name({TensorId::kSharedDown, 1}),
            "model.layers.1.mlp.shared_experts.down_proj.weight");
  EXPECT_FALSE(TensorNames::For(Architecture::kMixtral, Container::kSafetensors).Has(TensorId::kSharedGate));
  // GGUF stacks a layer's experts in one tensor.
  const TensorNames& gguf = TensorNames::For(Architecture::kQwen3Moe, Container::kGguf);
  EXPECT_TRUE(gguf.Stacked(TensorId::kExpertUp));
  EXPECT_EQ(gguf.Name(up), "blk.3.ffn_up_exps.weight");
  EXPECT_EQ(gguf.Name({TensorId::kRouterBias, 2}), "blk.2.exp_probs_b.bias");
  EXPECT_EQ(TensorNames::For(Architecture::kGlm4Moe, Container::kGguf).Name({TensorId::kFfnNorm, 0}),
            "blk.0.post_attention_norm.weight");
  EXPECT_EQ(TensorNames::For(Architecture::kGlm4Moe, Container::kGguf).Name({TensorId::kNextnProj, 46}),
            "blk.46.nextn.eh_proj.weight");
  EXPECT_EQ(TensorNames::For(Architecture::kGlm4Moe, Container::kSafetensors).Name({TensorId::kNextnHead, 46}),
            "model.layers.46.shared_head.head.weight");
  EXPECT_FALSE(gguf.Parse("blk.3.ffn_up_exps.weightx").has_value());
  EXPECT_FALSE(gguf.Parse("blk..ffn_up_exps.weight").has_value());
}

TEST(TensorNamesTest, ClassifiesTensorsOfEitherContainer) {
  EXPECT_EQ(ClassifyTensor("blk.4.ffn_down_exps.weight").role, TensorRole::kRoutedExpert);
  EXPECT_EQ(ClassifyTensor("blk.4.ffn_down_exps.weight").layer, 4);
  EXPECT_EQ(ClassifyTensor("blk.4.ffn_gate_inp.weight").role, TensorRole::kRouter);
  EXPECT_EQ(ClassifyTensor("token_embd.weight").role, TensorRole::kEmbedding);
  EXPECT_EQ(ClassifyTensor("model.layers.46.eh_proj.weight").role, TensorRole::kNextn);
  EXPECT_EQ(ClassifyTensor("something.else").role, TensorRole::kOther);
}

// The loader's list and the GGUF one name the same tensors, with the experts stacked.
TEST(TensorNamesTest, ExpectedTensorsStackExpertsInGguf) {
  auto spec = ReadCheckpointSpec(Fixture("qwen3_moe"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  const std::vector<TensorInfo> hf = ExpectedTensors(*spec);
  const std::vector<TensorInfo> gguf = ExpectedTensors(*spec, Container::kGguf);
  int64_t hf_elements = 0, gguf_elements = 0;
  for (const TensorInfo& t : hf) hf_elements += t.elements;
  for (const TensorInfo& t : gguf) gguf_elements += t.elements;
  EXPECT_EQ(hf_elements, gguf_elements);
  const int per_layer_experts = 3 * spec->routing.num_experts;
  EXPECT_EQ(hf.size() - gguf.size(), static_cast<size_t>(spec->num_moe_layers() * (per_layer_experts - 3)));
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_ckpt_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // A copy of a fixture's config and weights.
  std::string CopyFixture(const std::string& arch) {
    const fs::path to = dir_ / arch;
    fs::create_directories(to);
    for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(fs::path(Fixture(arch)) / f, to / f);
    return to.string();
  }
  fs::path dir_;
};

TEST_F(CheckpointTest, OpensAFolderAndHandsOutTensorsByKey) {
  auto c = OpenCheckpoint(Fixture("mixtral"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->spec().arch, Architecture::kMixtral);
  EXPECT_EQ((*c)->container(), Container::kSafetensors);
  EXPECT_EQ((*c)->tokenizer().dir, Fixture("mixtral"));
  EXPECT_FALSE((*c)->tokenizer().embedded());
  const TensorKey down{TensorId::kExpertDown, 1, 2};
  ASSERT_TRUE((*c)->Has(down));
  auto v = (*c)->Get(down);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->shape, (core::Shape{(*c)->spec().hidden_size, (*c)->spec().moe_intermediate_size}));
  EXPECT_EQ(v->format, WeightFormat::Plain(core::DType::kBF16));
  auto by_name = (*c)->source().Get("model.layers.1.block_sparse_moe.experts.2.w2.weight");
  ASSERT_TRUE(by_name.ok());
  EXPECT_EQ(v->data, by_name->data);
  EXPECT_THAT((*c)->Describe(down), HasSubstr("experts.2.w2.weight in model.safetensors"));
  // A tensor this architecture has none of.
  auto none = (*c)->Get({TensorId::kSharedGate, 0});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("mixtral has no layer 0 shared_gate tensor"));
}

TEST_F(CheckpointTest, ReadsNextnLayersAndAttentionKindsIntoTheSpec) {
  auto c = OpenCheckpoint(Fixture("glm4_moe"));
  ASSERT_TRUE(c.ok()) << c.status();
  const ModelSpec& s = (*c)->spec();
  EXPECT_EQ(s.num_nextn_layers, 1);  // config.json's num_nextn_predict_layers
  EXPECT_EQ(s.num_all_layers(), s.num_layers + 1);
  EXPECT_TRUE(s.IsMoeLayer(s.num_layers));
  EXPECT_TRUE(s.IsNextnLayer(s.num_layers));
  ASSERT_EQ(static_cast<int>(s.layer_attention.size()), s.num_all_layers());
  for (int l = 0; l < s.num_all_layers(); ++l) EXPECT_EQ(s.attention(l), AttentionKind::kGqa);
  // transformers leaves the MTP layer out when it saves: the spec says it exists, the file has none.
  EXPECT_FALSE((*c)->Has({TensorId::kNextnProj, s.num_layers}));
  auto qwen = ReadCheckpointSpec(Fixture("qwen3_moe"));
  ASSERT_TRUE(qwen.ok());
  EXPECT_EQ(qwen->num_nextn_layers, 0);
}

TEST_F(CheckpointTest, ASafetensorsFileOpensItsFolder) {
  auto c = OpenCheckpoint(Fixture("qwen2_moe") + "/model.safetensors");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->spec().arch, Architecture::kQwen2Moe);
}

TEST_F(CheckpointTest, TheIdFollowsTheFilesContents) {
  const std::string path = CopyFixture("qwen3_moe");
  auto a = OpenCheckpoint(path);
  auto b = OpenCheckpoint(path);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->id(), (*b)->id());
  // Rewritten (a newer modification time): another id, so nothing built from the old weights is
  // taken for the new ones.
  const fs::path weights = fs::path(path) / "model.safetensors";
  fs::last_write_time(weights, fs::last_write_time(weights) + std::chrono::seconds(5));
  auto changed = OpenCheckpoint(path);
  ASSERT_TRUE(changed.ok());
  EXPECT_NE((*changed)->id(), (*a)->id());
}

TEST_F(CheckpointTest, RefusesWhatItCannotReadSayingWhat) {
  const fs::path gguf = dir_ / "model-Q4_K_M.gguf";
  std::ofstream(gguf) << "GGUF";
  // A GGUF file cut after its magic is read as GGUF and refused as truncated, by file and offset;
  // a folder of it likewise.
  auto file = OpenCheckpoint(gguf.string());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().message(), HasSubstr("model-Q4_K_M.gguf: at offset 4: the version"));
  EXPECT_THAT(file.status().message(), HasSubstr("truncated"));
  auto folder = OpenCheckpoint(dir_.string());
  EXPECT_EQ(folder.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(folder.status().message(), HasSubstr("model-Q4_K_M.gguf: at offset 4"));
  const fs::path text = dir_ / "notes.txt";
  std::ofstream(text) << "x";
  EXPECT_EQ(OpenCheckpoint(text.string()).status().code(), absl::StatusCode::kInvalidArgument);
  auto missing = OpenCheckpoint((dir_ / "nope").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("nope/config.json"));
}

}  // namespace
}  // namespace moe::runtime

// GGUF checkpoints end to end: each fixture written as a GGUF file the way llama.cpp's converter
// lays it out (names, stacked experts, Mixtral's permuted q/k rows, the metadata keys, the
// vocabulary), opened by OpenCheckpoint and run: the same spec, bit-identical logits to the
// safetensors model, the same token ids from the embedded vocabulary as from tokenizer.json; split
// files and folders; and every refusal of a broken file, naming the file and what.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <tuple>

#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <csignal>
#include <regex>

#include "gtest/gtest.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "moe/core/dtype.h"
#include "moe/experts/expert_pool.h"
#include "moe/experts/gguf_types.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/gguf_writer.h"
#include "moe/runtime/model.h"
#include "moe/scheduler/text_pipeline.h"
#include "test_util.h"

namespace moe {
namespace {

namespace pb = ::moeserve::v1;
using runtime::Architecture;
using runtime::Checkpoint;
using runtime::Container;
using runtime::GgufWriter;
using runtime::TensorId;
using runtime::TensorNames;

constexpr int kF32 = 0, kF16 = 1, kBF16 = 30;

int GgmlTypeOf(core::DType t) { return t == core::DType::kF32 ? kF32 : t == core::DType::kF16 ? kF16 : kBF16; }

std::string Bytes(const void* data, size_t n) { return std::string(static_cast<const char*>(data), n); }

const char* GgufArch(Architecture a) {
  switch (a) {
    case Architecture::kQwen3Moe:
      return "qwen3moe";
    case Architecture::kQwen2Moe:
      return "qwen2moe";
    case Architecture::kMixtral:
      return "llama";
    case Architecture::kGlm4Moe:
      return "glm4moe";
    case Architecture::kDeepseekV3:
      return "deepseek2";
  }
  return "?";
}

// The model's metadata as llama.cpp's converter writes it.
void WriteMetadata(const runtime::ModelSpec& s, GgufWriter& w, const std::string& arch = "", int gating_func = 2) {
  const std::string a = arch.empty() ? GgufArch(s.arch) : arch;
  w.String("general.architecture", a);
  w.String("general.name", "fixture");
  w.U32(a + ".block_count", s.num_all_layers());
  w.U32(a + ".context_length", s.max_position_embeddings);
  w.U32(a + ".embedding_length", s.hidden_size);
  w.U32(a + ".feed_forward_length", s.arch == Architecture::kMixtral ? s.moe_intermediate_size : s.intermediate_size);
  w.U32(a + ".attention.head_count", s.num_heads);
  w.F32(a + ".rope.freq_base", s.rope_theta);
  if (s.arch != Architecture::kDeepseekV3) {
    w.U32(a + ".attention.head_count_kv", s.num_kv_heads);
    w.U32(a + ".attention.key_length", s.head_dim);
    w.U32(a + ".attention.value_length", s.head_dim);
    w.U32(a + ".rope.dimension_count", s.rotary_dim);
  }
  w.F32(a + ".attention.layer_norm_rms_epsilon", s.rms_norm_eps);
  w.U32(a + ".expert_count", s.routing.num_experts);
  w.U32(a + ".expert_used_count", s.routing.top_k);
  if (s.arch != Architecture::kMixtral) w.U32(a + ".expert_feed_forward_length", s.moe_intermediate_size);
  if (s.arch == Architecture::kQwen2Moe) {
    w.U32(a + ".expert_shared_feed_forward_length", s.shared_expert_intermediate_size);
  }
  if (s.arch == Architecture::kDeepseekV3) {  // MLA as llama.cpp's converter writes it, kv_b split
    const runtime::MlaSpec& m = s.mla;
    w.U32(a + ".attention.head_count_kv", 1);
    w.U32(a + ".attention.q_lora_rank", m.q_lora_rank);
    w.U32(a + ".attention.kv_lora_rank", m.kv_lora_rank);
    w.U32(a + ".attention.key_length", m.kv_lora_rank + m.qk_rope_head_dim);
    w.U32(a + ".attention.value_length", m.kv_lora_rank);
    w.U32(a + ".attention.key_length_mla", m.qk_head_dim());
    w.U32(a + ".attention.value_length_mla", m.v_head_dim);
    w.U32(a + ".rope.dimension_count", m.qk_rope_head_dim);
  }
  if (s.arch == Architecture::kGlm4Moe || s.arch == Architecture::kDeepseekV3) {
    int dense = 0;
    while (dense < s.num_layers && !s.layer_is_moe[dense]) ++dense;
    w.U32(a + ".leading_dense_block_count", dense);
    w.U32(a + ".expert_shared_count", s.shared_expert_intermediate_size / s.moe_intermediate_size);
    w.U32(a + ".expert_group_count", s.routing.n_group);
    w.U32(a + ".expert_group_used_count", s.routing.topk_group);
    w.F32(a + ".expert_weights_scale", s.routing.routed_scaling_factor);
    w.Bool(a + ".expert_weights_norm", s.routing.normalize_top_k);
    w.U32(a + ".expert_gating_func", gating_func);
    w.U32(a + ".nextn_predict_layers", s.num_nextn_layers);
  }
}

// The fixture's tokenizer.json as tokenizer.ggml.* (ids in order; special added tokens are
// control tokens).
void WriteVocabulary(const std::string& dir, const std::string& pre, GgufWriter& w) {
  std::ifstream in(dir + "/tokenizer.json");
  const nlohmann::json t = nlohmann::json::parse(in);
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  const auto put = [&](const std::string& token, int64_t id, int32_t type) {
    if (static_cast<int64_t>(tokens.size()) <= id) {
      tokens.resize(id + 1);
      types.resize(id + 1, 1);
    }
    tokens[id] = token;
    types[id] = type;
  };
  for (const auto& [token, id] : t["model"]["vocab"].items()) put(token, id.get<int64_t>(), 1);
  for (const auto& added : t["added_tokens"]) put(added["content"], added["id"], added["special"].get<bool>() ? 3 : 4);
  std::vector<std::string> merges;
  for (const auto& m : t["model"]["merges"]) {
    merges.push_back(m.is_string() ? m.get<std::string>() : m[0].get<std::string>() + " " + m[1].get<std::string>());
  }
  w.String("tokenizer.ggml.model", "gpt2");
  w.String("tokenizer.ggml.pre", pre);
  w.Strings("tokenizer.ggml.tokens", tokens);
  w.I32s("tokenizer.ggml.token_type", types);
  w.Strings("tokenizer.ggml.merges", merges);
  const auto id_of = [&](const std::string& token) {
    return static_cast<uint32_t>(std::find(tokens.begin(), tokens.end(), token) - tokens.begin());
  };
  w.U32("tokenizer.ggml.eos_token_id", id_of("<|im_end|>"));
  w.U32("tokenizer.ggml.padding_token_id", id_of("<|endoftext|>"));
  w.Bool("tokenizer.ggml.add_bos_token", false);
  std::ifstream cfg_in(dir + "/tokenizer_config.json");
  const nlohmann::json cfg = nlohmann::json::parse(cfg_in);
  if (cfg.contains("chat_template")) w.String("tokenizer.chat_template", cfg["chat_template"]);
}

// May rename a tensor, change its dimensions, type or bytes, or drop it (false).
using TensorEdit = std::function<bool(std::string& name, std::vector<int64_t>& ne, int& type, std::string& bytes)>;

// The fixture's tensors under GGUF names: experts stacked per layer, Mixtral's q and k rows
// permuted as the converter permutes them, qwen2_moe's shared expert gate as a vector.
void WriteTensors(const Checkpoint& c, GgufWriter& w, const TensorEdit& edit = nullptr) {
  const auto put = [&](std::string name, std::vector<int64_t> ne, int type, std::string bytes) {
    if (edit && !edit(name, ne, type, bytes)) return;
    w.Tensor(name, ne, type, std::move(bytes));
  };
  const runtime::ModelSpec& s = c.spec();
  const TensorNames& hf = c.names();
  const TensorNames& gguf = TensorNames::For(s.arch, Container::kGguf);
  std::map<std::string, std::vector<std::pair<int, runtime::WeightView>>> stacked;
  for (const std::string& name : c.source().Names()) {
    const std::optional<runtime::TensorKey> key = hf.Parse(name);
    ASSERT_TRUE(key.has_value()) << name;
    const runtime::WeightView v = *c.source().GetStored(name);
    if (key->expert >= 0) {
      stacked[gguf.Name(*key)].emplace_back(key->expert, v);
      continue;
    }
    std::vector<int64_t> ne(v.shape.rbegin(), v.shape.rend());
    std::string bytes = Bytes(v.data, v.bytes());
    if (s.arch == Architecture::kMixtral && (key->id == TensorId::kAttnQ || key->id == TensorId::kAttnK)) {
      const int heads = key->id == TensorId::kAttnQ ? s.num_heads : s.num_kv_heads;
      const int64_t row = v.format.RowBytes(v.shape[1]), d = v.shape[0] / heads;
      std::string permuted(bytes.size(), '\0');
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < d / 2; ++j) {
          for (int64_t sh = 0; sh < 2; ++sh) {
            std::memcpy(&permuted[(h * d + 2 * j + sh) * row], &bytes[(h * d + sh * d / 2 + j) * row], row);
          }
        }
      }
      bytes = permuted;
    }
    if (key->id == TensorId::kSharedExpertGate) ne = {v.shape[1]};
    if (key->id == TensorId::kMlaKvB) {  // per head: K's nope rows transposed into attn_k_b, V's into attn_v_b
      const runtime::MlaSpec& m = s.mla;
      const int64_t heads = s.num_heads, lora = m.kv_lora_rank, nope = m.qk_nope_head_dim, vd = m.v_head_dim;
      const int64_t elem = core::DTypeSize(v.format.element);
      std::string k_b(heads * lora * nope * elem, '\0'), v_b(heads * vd * lora * elem, '\0');
      for (int64_t h = 0; h < heads; ++h) {
        const char* rows = bytes.data() + h * (nope + vd) * lora * elem;
        for (int64_t i = 0; i < nope; ++i) {
          for (int64_t c = 0; c < lora; ++c) {
            std::memcpy(&k_b[((h * lora + c) * nope + i) * elem], rows + (i * lora + c) * elem, elem);
          }
        }
        std::memcpy(&v_b[h * vd * lora * elem], rows + nope * lora * elem, vd * lora * elem);
      }
      put(gguf.Name({TensorId::kMlaKB, key->layer}), {nope, lora, heads}, GgmlTypeOf(v.format.element), k_b);
      put(gguf.Name({TensorId::kMlaVB, key->layer}), {lora, vd, heads}, GgmlTypeOf(v.format.element), v_b);
      continue;
    }
    put(gguf.Name(*key), ne, GgmlTypeOf(v.format.element), bytes);
  }
  for (auto& [name, experts] : stacked) {
    std::sort(experts.begin(), experts.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::string bytes;
    for (const auto& [e, v] : experts) bytes += Bytes(v.data, v.bytes());
    const runtime::WeightView& v = experts[0].second;
    put(name, {v.shape[1], v.shape[0], static_cast<int64_t>(experts.size())}, GgmlTypeOf(v.format.element), bytes);
  }
}

// Writes fixture `arch` as a GGUF file at `path`.
void WriteFixtureGguf(const std::string& arch, const std::string& path, const std::string& pre = "qwen2") {
  auto c = runtime::OpenCheckpoint(testing::FixtureDir(arch));
  ASSERT_TRUE(c.ok()) << c.status();
  GgufWriter w;
  WriteMetadata((*c)->spec(), w);
  WriteVocabulary(testing::FixtureDir(arch), pre, w);
  WriteTensors(**c, w);
  ASSERT_TRUE(w.Write(path).ok());
}

class GgufFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GgufFixtureTest, SameSpecAndBitIdenticalLogitsAsTheSafetensors) {
  testing::ScratchDir dir;
  const std::string path = dir / "model-BF16.gguf";
  WriteFixtureGguf(GetParam(), path);
  auto gguf = runtime::OpenCheckpoint(path);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  auto hf = runtime::OpenCheckpoint(testing::FixtureDir(GetParam()));
  ASSERT_TRUE(hf.ok());
  const runtime::ModelSpec &a = (*gguf)->spec(), &b = (*hf)->spec();
  EXPECT_EQ((*gguf)->container(), Container::kGguf);
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.Summary(), b.Summary());
  EXPECT_EQ(a.rotary_dim, b.rotary_dim);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.layer_is_moe, b.layer_is_moe);
  EXPECT_EQ(a.routing.normalize_top_k, b.routing.normalize_top_k);
  EXPECT_EQ(a.routing.n_group, b.routing.n_group);
  EXPECT_EQ(a.routing.topk_group, b.routing.topk_group);
  EXPECT_EQ(a.routing.routed_scaling_factor, b.routing.routed_scaling_factor);
  EXPECT_EQ(a.shared_expert_intermediate_size, b.shared_expert_intermediate_size);
  EXPECT_EQ(a.shared_expert_gate, b.shared_expert_gate);
  EXPECT_EQ(a.num_nextn_layers, b.num_nextn_layers);
  EXPECT_EQ(a.mla.latent_width(), b.mla.latent_width());
  EXPECT_EQ(a.mla.rope_interleave, b.mla.rope_interleave);
  EXPECT_EQ(a.uses_mla(), b.uses_mla());
  EXPECT_TRUE((*gguf)->tokenizer().embedded());

  runtime::ModelOptions options;
  options.pool.progress = false;
  auto from_gguf = runtime::Model::Load(path, options);
  ASSERT_TRUE(from_gguf.ok()) << from_gguf.status();
  auto from_hf = runtime::Model::Load(testing::FixtureDir(GetParam()), options);
  ASSERT_TRUE(from_hf.ok()) << from_hf.status();
  const nlohmann::json golden = testing::LoadGolden(GetParam());
  for (const auto& gc : golden["cases"]) {
    const std::vector<int32_t> ids = gc["prompt_ids"];
    const auto x = testing::FullForward(**from_gguf, ids), y = testing::FullForward(**from_hf, ids);
    ASSERT_EQ(x.size(), y.size());
    for (size_t r = 0; r < x.size(); ++r) ASSERT_EQ(x[r], y[r]) << "position " << r;
  }
}

TEST_P(GgufFixtureTest, EmbeddedVocabularyGivesTheTokenizerJsonIds) {
  testing::ScratchDir dir;
  const std::string path = dir / "model.gguf";
  WriteFixtureGguf(GetParam(), path);
  auto from_gguf = scheduler::LoadModelTokenizer(path);
  ASSERT_TRUE(from_gguf.ok()) << from_gguf.status();
  ASSERT_NE(from_gguf->tokenizer, nullptr) << from_gguf->none_reason;
  auto from_json = scheduler::LoadModelTokenizer(testing::FixtureDir(GetParam()));
  ASSERT_TRUE(from_json.ok());
  EXPECT_EQ(from_gguf->config.chat_template, from_json->config.chat_template);
  EXPECT_EQ(from_gguf->config.eos_token, "<|im_end|>");
  std::ifstream in(testing::TestdataDir() + "/tokenizer/golden_tokenize.json");
  const nlohmann::json golden = nlohmann::json::parse(in);
  ASSERT_FALSE(golden["cases"].empty());
  for (const auto& c : golden["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(from_gguf->tokenizer->Encode(text), c["ids"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(from_gguf->tokenizer->Encode(text), from_json->tokenizer->Encode(text)) << text;
  }
}

// deepseek2's YaRN as llama.cpp writes DeepSeek-V3's (factor 40 over 4096 positions, mscale_all_dim
// 1 as a log multiplier of 0.1): the spec config.json gives, and the softmax scale with mscale^2.
TEST(GgufDeepseek2Test, YarnMetadataBecomesTheConfigsRopeScalingAndSoftmaxRoutingIsRefused) {
  testing::ScratchDir dir;
  const std::string path = dir / "yarn.gguf";
  auto c = runtime::OpenCheckpoint(testing::FixtureDir("deepseek_v3"));
  ASSERT_TRUE(c.ok()) << c.status();
  GgufWriter w;
  WriteMetadata((*c)->spec(), w);
  w.String("deepseek2.rope.scaling.type", "yarn");
  w.F32("deepseek2.rope.scaling.factor", 40.0f);
  w.U32("deepseek2.rope.scaling.original_context_length", 4096);
  w.F32("deepseek2.rope.scaling.yarn_log_multiplier", 0.1f);
  WriteVocabulary(testing::FixtureDir("deepseek_v3"), "qwen2", w);
  WriteTensors(**c, w);
  ASSERT_TRUE(w.Write(path).ok());
  auto gguf = runtime::OpenCheckpoint(path);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  const runtime::ModelSpec& s = (*gguf)->spec();
  EXPECT_EQ(s.rope_scaling.type, runtime::RopeType::kYarn);
  EXPECT_FLOAT_EQ(s.rope_scaling.factor, 40.0f);
  EXPECT_EQ(s.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_NEAR(s.rope_scaling.mscale_all_dim, 1.0f, 1e-6);
  EXPECT_NEAR(s.rope_scaling.attention_factor, 1.0f, 1e-6);
  const double m = 0.1 * std::log(40.0) + 1;
  EXPECT_NEAR(s.attention_scale(), m * m / std::sqrt(48.0), 1e-6);
  EXPECT_EQ(s.mla.qk_nope_head_dim, 32);
  EXPECT_EQ(s.mla.v_head_dim, 32);

  // DeepSeek-V2's softmax routing (expert_gating_func 1) is refused naming the key.
  GgufWriter v2;
  WriteMetadata((*c)->spec(), v2, "", /*gating_func=*/1);
  WriteVocabulary(testing::FixtureDir("deepseek_v3"), "qwen2", v2);
  WriteTensors(**c, v2);
  ASSERT_TRUE(v2.Write(dir / "v2.gguf").ok());
  auto softmax = runtime::OpenCheckpoint(dir / "v2.gguf");
  ASSERT_FALSE(softmax.ok());
  EXPECT_NE(softmax.status().message().find("deepseek2.expert_gating_func"), std::string::npos) << softmax.status();
  EXPECT_NE(softmax.status().message().find("is 1; deepseek2 is read with sigmoid routing (2) only"), std::string::npos)
      << softmax.status();
}

INSTANTIATE_TEST_SUITE_P(Archs, GgufFixtureTest,
                         ::testing::Values("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"));

// Split parts: the model from its first part equals the model from one file; a folder of the
// parts (with a projector beside them) opens the same model.
TEST(GgufSplitTest, PartsOpenAsOneModelAndEveryBrokenSetIsRefused) {
  testing::ScratchDir dir;
  auto c = runtime::OpenCheckpoint(testing::FixtureDir("qwen3_moe"));
  ASSERT_TRUE(c.ok());
  // Two parts: the metadata and the global tensors in the first, the layers in the second.
  GgufWriter all;
  WriteMetadata((*c)->spec(), all);
  WriteVocabulary(testing::FixtureDir("qwen3_moe"), "qwen2", all);
  WriteTensors(**c, all);
  ASSERT_TRUE(all.Write(dir / "whole.gguf").ok());
  auto whole = runtime::OpenCheckpoint(dir / "whole.gguf");
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::vector<std::string> names = (*whole)->source().Names();

  std::filesystem::create_directories(dir / "split");
  const auto write_parts = [&](const std::string& folder, int count_in_part2, int tensors_total,
                               const std::string& arch2) {
    for (int part = 0; part < 2; ++part) {
      GgufWriter w;
      if (part == 0) {
        WriteMetadata((*c)->spec(), w);
        WriteVocabulary(testing::FixtureDir("qwen3_moe"), "qwen2", w);
      } else {
        w.String("general.architecture", arch2);
      }
      w.U16("split.no", static_cast<uint16_t>(part));
      w.U16("split.count", static_cast<uint16_t>(part == 0 ? 2 : count_in_part2));
      w.I32("split.tensors.count", tensors_total);
      for (const std::string& name : names) {
        if ((name.rfind("blk.", 0) == 0) != (part == 1)) continue;
        const runtime::WeightView v = *(*whole)->source().GetStored(name);
        std::vector<int64_t> ne(v.shape.rbegin(), v.shape.rend());
        w.Tensor(name, ne, GgmlTypeOf(v.format.element), Bytes(v.data, v.bytes()));
      }
      char file[64];
      std::snprintf(file, sizeof(file), "/m-%05d-of-00002.gguf", part + 1);
      ASSERT_TRUE(w.Write(folder + file).ok());
    }
  };
  const int total = static_cast<int>(names.size());
  write_parts(dir / "split", 2, total, "qwen3moe");
  std::ofstream(dir / "split/mmproj-fixture.gguf") << "not read";
  runtime::ModelOptions options;
  options.pool.progress = false;
  auto from_parts = runtime::Model::Load(dir / "split/m-00001-of-00002.gguf", options);
  ASSERT_TRUE(from_parts.ok()) << from_parts.status();
  auto from_folder = runtime::Model::Load(dir / "split", options);
  ASSERT_TRUE(from_folder.ok()) << from_folder.status();
  auto from_whole = runtime::Model::Load(dir / "whole.gguf", options);
  ASSERT_TRUE(from_whole.ok());
  const std::vector<int32_t> ids = {5, 17, 42, 99, 3};
  EXPECT_EQ(testing::FullForward(**from_parts, ids), testing::FullForward(**from_whole, ids));
  EXPECT_EQ(testing::FullForward(**from_folder, ids), testing::FullForward(**from_whole, ids));

  // The second part given alone.
  auto later = runtime::OpenCheckpoint(dir / "split/m-00002-of-00002.gguf");
  ASSERT_FALSE(later.ok());
  EXPECT_NE(later.status().message().find("give the first part"), std::string::npos) << later.status();
  // A part missing.
  std::filesystem::create_directories(dir / "missing");
  std::filesystem::copy(dir / "split/m-00001-of-00002.gguf", dir / "missing/m-00001-of-00002.gguf");
  auto missing = runtime::OpenCheckpoint(dir / "missing/m-00001-of-00002.gguf");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("part 2 of 2 (m-00002-of-00002.gguf) is missing"), std::string::npos)
      << missing.status();
  // A part of another model: its split.count disagrees, or its architecture, or the tensor count.
  for (const auto& [count, total_tensors, arch2, what] :
       std::vector<std::tuple<int, int, std::string, std::string>>{{3, total, "qwen3moe", "a part of another model"},
                                                                   {2, total, "llama", "a part of another model"},
                                                                   {2, total + 1, "qwen3moe", "split.tensors.count"}}) {
    testing::ScratchDir other;
    write_parts(other.path().string(), count, total_tensors, arch2);
    auto refused = runtime::OpenCheckpoint(other / "m-00001-of-00002.gguf");
    ASSERT_FALSE(refused.ok()) << what;
    EXPECT_NE(refused.status().message().find(what), std::string::npos) << refused.status();
  }
  // Two models in one folder.
  std::filesystem::copy(dir / "whole.gguf", dir / "split/other.gguf");
  auto two = runtime::OpenCheckpoint(dir / "split");
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.status().message().find("holds 2 GGUF models"), std::string::npos) << two.status();
}

// A model whose file lacks a tensor, or holds one of the wrong shape or a type moeserve does not
// read, an unknown architecture or a pre-tokenizer moeserve does not know: each refused naming what.
TEST(GgufRefusalTest, MissingTensorWrongShapeUnknownTypeArchitectureAndPreTokenizer) {
  testing::ScratchDir dir;
  auto c = runtime::OpenCheckpoint(testing::FixtureDir("qwen3_moe"));
  ASSERT_TRUE(c.ok());
  runtime::ModelOptions options;
  options.pool.progress = false;
  const auto load = [&](const TensorEdit& edit, const std::string& arch = "", const std::string& pre = "qwen2") {
    GgufWriter w;
    WriteMetadata((*c)->spec(), w, arch);
    WriteVocabulary(testing::FixtureDir("qwen3_moe"), pre, w);
    WriteTensors(**c, w, edit);
    const std::string path = dir / "m.gguf";
    EXPECT_TRUE(w.Write(path).ok());
    return runtime::Model::Load(path, options).status();
  };
  const absl::Status missing = load([](std::string& name, std::vector<int64_t>&, int&, std::string&) {
    return name != "blk.1.attn_q.weight";
  });
  EXPECT_NE(missing.message().find("blk.1.attn_q.weight"), std::string::npos) << missing;
  EXPECT_NE(missing.message().find("missing"), std::string::npos) << missing;

  const absl::Status shape = load([](std::string& name, std::vector<int64_t>& ne, int&, std::string&) {
    if (name == "blk.0.attn_k.weight") std::swap(ne[0], ne[1]);
    return true;
  });
  EXPECT_NE(shape.message().find("blk.0.attn_k.weight: shape [128, 64]"), std::string::npos) << shape;
  EXPECT_NE(shape.message().find("num_key_value_heads"), std::string::npos) << shape;

  // Q8_1 (36 bytes per 32 values) is a ggml type moeserve does not read; the F32 bytes hold it.
  const absl::Status type = load([](std::string& name, std::vector<int64_t>&, int& t, std::string&) {
    if (name == "blk.0.ffn_norm.weight") t = 9;
    return true;
  });
  EXPECT_NE(type.message().find("blk.0.ffn_norm.weight"), std::string::npos) << type;
  EXPECT_NE(type.message().find("is Q8_1, a type moeserve does not read (types read: F32, F16"), std::string::npos)
      << type;

  const absl::Status arch = load(nullptr, "gemma3");
  EXPECT_NE(arch.message().find("general.architecture 'gemma3' is not supported"), std::string::npos) << arch;

  // The tokenizer's pre-tokenizer is checked where the text is served.
  testing::ScratchDir tok;
  GgufWriter w;
  WriteMetadata((*c)->spec(), w);
  WriteVocabulary(testing::FixtureDir("qwen3_moe"), "made-up-pre", w);
  WriteTensors(**c, w);
  ASSERT_TRUE(w.Write(tok / "m.gguf").ok());
  auto text = scheduler::LoadModelTokenizer(tok / "m.gguf");
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().message().find("tokenizer.ggml.pre 'made-up-pre'"), std::string::npos) << text.status();
  EXPECT_NE(text.status().message().find("--tokenizer"), std::string::npos) << text.status();
  // --tokenizer DIR serves it.
  auto with_dir = scheduler::LoadModelTokenizer(tok / "m.gguf", testing::FixtureDir("qwen3_moe"));
  ASSERT_TRUE(with_dir.ok()) << with_dir.status();
  EXPECT_NE(with_dir->tokenizer, nullptr);
}

// Q8_0 blocks of bf16 rows (as ggml quantizes: d = max|x| / 127 in fp16, q = round(x / d)).
std::string QuantizeQ8_0(const std::string& bf16, int64_t cols) {
  const int64_t n = static_cast<int64_t>(bf16.size() / 2);
  std::string out;
  for (int64_t b = 0; b < n / 32; ++b) {
    float x[32], amax = 0;
    for (int i = 0; i < 32; ++i) {
      uint16_t v;
      std::memcpy(&v, &bf16[2 * (b * 32 + i)], 2);
      x[i] = core::Bf16ToFloat(v);
      amax = std::max(amax, std::fabs(x[i]));
    }
    const float d = amax / 127;
    const _Float16 h = static_cast<_Float16>(d);
    char block[34];
    std::memcpy(block, &h, 2);
    for (int i = 0; i < 32; ++i) {
      block[2 + i] = static_cast<char>(static_cast<int8_t>(d == 0 ? 0 : std::lround(x[i] / d)));
    }
    out.append(block, 34);
  }
  (void)cols;
  return out;
}

// The file's Q8_0 values as f32 (experts::DequantizeRow, llama.cpp's dequantization).
std::string DequantizeToF32(const std::string& blocks, int type, int64_t values) {
  std::string out(4 * values, '\0');
  experts::DequantizeRow(type, blocks.data(), values, reinterpret_cast<float*>(out.data()));
  return out;
}

// A GGUF file whose matrices (attention, experts, dense and LM head) are Q8_0 runs with its
// experts kept as Q8_0 in the pool (native) and its Linears kept as Q8_0 on the CPU backend: the
// backend's weights and the pool's arena hold the file's bytes, and the logits are those of the same
// values given as f32, within the int8 rounding of the activations the kernels multiply them with.
TEST(GgufQuantizedTest, Q8_0ExpertsStayInTheirTypeAndComputeTheFilesValues) {
  testing::ScratchDir dir;
  auto c = runtime::OpenCheckpoint(testing::FixtureDir("qwen3_moe"));
  ASSERT_TRUE(c.ok());
  const auto matrix = [](const std::string& name, const std::vector<int64_t>& ne) {
    return ne.size() >= 2 && name.find("norm") == std::string::npos && name.find("ffn_gate_inp") == std::string::npos &&
           ne[0] % 32 == 0;
  };
  int64_t expert_bytes = 0;
  const auto write = [&](const std::string& path, bool as_f32) {
    GgufWriter w;
    WriteMetadata((*c)->spec(), w);
    WriteVocabulary(testing::FixtureDir("qwen3_moe"), "qwen2", w);
    WriteTensors(**c, w, [&](std::string& name, std::vector<int64_t>& ne, int& type, std::string& bytes) {
      if (!matrix(name, ne) || type != kBF16) return true;
      int64_t values = 1;
      for (int64_t d : ne) values *= d;
      bytes = QuantizeQ8_0(bytes, ne[0]);
      type = 8;
      if (name.find("_exps") != std::string::npos && !as_f32) expert_bytes += static_cast<int64_t>(bytes.size());
      if (as_f32) {
        bytes = DequantizeToF32(bytes, 8, values);
        type = kF32;
      }
      return true;
    });
    ASSERT_TRUE(w.Write(path).ok());
  };
  write(dir / "q8_0.gguf", false);
  write(dir / "f32.gguf", true);
  runtime::ModelOptions native;
  native.pool.progress = false;
  native.pool_format_auto = true;
  auto pooled = runtime::Model::Load(dir / "q8_0.gguf", native);
  ASSERT_TRUE(pooled.ok()) << pooled.status();
  ASSERT_NE((*pooled)->expert_pool(), nullptr);
  EXPECT_LE((*pooled)->expert_pool()->arena().size(), expert_bytes * 11 / 10);
  EXPECT_GE((*pooled)->expert_pool()->arena().size(), expert_bytes);
  runtime::ModelOptions reference;
  reference.pool.progress = false;
  reference.experts = runtime::RoutedExpertsMode::kBackend;
  auto ref_f32 = runtime::Model::Load(dir / "f32.gguf", reference);
  ASSERT_TRUE(ref_f32.ok()) << ref_f32.status();
  // Q8_0 is 34 bytes per 32 values: with the experts in the pool, the backend's weights (the
  // Linears Q8_0; norms, router and the embedding, whose rows are gathered, f32) are under half
  // those of the f32 file.
  runtime::ModelOptions pooled_f32;
  pooled_f32.pool.progress = false;
  auto f32_pool = runtime::Model::Load(dir / "f32.gguf", pooled_f32);
  ASSERT_TRUE(f32_pool.ok()) << f32_pool.status();
  EXPECT_LT((*pooled)->weight_bytes(), (*f32_pool)->weight_bytes() / 2)
      << (*pooled)->weight_bytes() << " against " << (*f32_pool)->weight_bytes();
  const nlohmann::json golden = testing::LoadGolden("qwen3_moe");
  float worst = 0;
  int positions = 0, agree = 0;
  for (const auto& gc : golden["cases"]) {
    const std::vector<int32_t> ids = gc["prompt_ids"];
    const auto a = testing::FullForward(**ref_f32, ids), p = testing::FullForward(**pooled, ids);
    for (size_t r = 0; r < a.size(); ++r) {
      worst = std::max(worst, testing::MaxAbsDiff(p[r], a[r]));
      ++positions;
      agree += std::max_element(p[r].begin(), p[r].end()) - p[r].begin() ==
               std::max_element(a[r].begin(), a[r].end()) - a[r].begin();
    }
  }
  // The kernels quantize activations to int8 per token: the bounds of the int8 goldens tests
  // (goldens_test: 85% agreement, worst error under 3 on these fixtures).
  EXPECT_GT(agree, positions * 85 / 100) << agree << " of " << positions;
  EXPECT_LT(worst, 3.0f);
}

// A file without output.weight ties the head to a Q8_0 embedding kept as stored rows: the head is
// then a Q8_0 Linear of its own, and the logits are those of a file whose output.weight is a copy
// of token_embd.
TEST(GgufQuantizedTest, TiedHeadOfAQuantizedEmbedding) {
  testing::ScratchDir dir;
  auto c = runtime::OpenCheckpoint(testing::FixtureDir("qwen3_moe"));
  ASSERT_TRUE(c.ok());
  const auto write = [&](const std::string& path, bool tied) {
    GgufWriter w;
    WriteMetadata((*c)->spec(), w);
    WriteVocabulary(testing::FixtureDir("qwen3_moe"), "qwen2", w);
    std::string embd;
    std::vector<int64_t> embd_ne;
    WriteTensors(**c, w, [&](std::string& name, std::vector<int64_t>& ne, int& type, std::string& bytes) {
      if (name == "output.weight") return false;
      if (name == "token_embd.weight") {
        bytes = QuantizeQ8_0(bytes, ne[0]);
        type = 8;
        embd = bytes;
        embd_ne = ne;
      }
      return true;
    });
    if (!tied) w.Tensor("output.weight", embd_ne, 8, embd);
    ASSERT_TRUE(w.Write(path).ok());
  };
  write(dir / "tied.gguf", true);
  write(dir / "copy.gguf", false);
  runtime::ModelOptions options;
  options.pool.progress = false;
  auto tied = runtime::Model::Load(dir / "tied.gguf", options);
  ASSERT_TRUE(tied.ok()) << tied.status();
  EXPECT_TRUE(tied->get()->spec().tie_word_embeddings);
  auto copy = runtime::Model::Load(dir / "copy.gguf", options);
  ASSERT_TRUE(copy.ok()) << copy.status();
  const std::vector<int32_t> ids = {5, 17, 42, 99, 3};
  const auto a = testing::FullForward(**tied, ids), b = testing::FullForward(**copy, ids);
  EXPECT_EQ(a, b);
  for (float v : a.back()) ASSERT_TRUE(std::isfinite(v));
}

// `inspect` plans a GGUF model from its header: the types and bytes by role, the experts kept in
// the pool as the file stores them, the GPU's bf16 copies said.
TEST(GgufInspectTest, PlansFromTheHeaderWithTheFilesTypes) {
  const std::string model = testing::TestdataDir() + "/gguf/qwen3_moe/qwen3_moe-Q4_K_M.gguf";
  const testing::CommandResult r = testing::RunMoeserve({"inspect", "--model", model, "--cpu-moe"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("routed expert Q4_K"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("dequantized to bf16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("native experts on the CPU"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("prefill streaming"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("routed expert CPU (--cpu-moe)"), std::string::npos) << r.out;
}

// `moeserve serve --model FILE.gguf`: the OpenAI API's chat (the file's chat template and
// vocabulary) and gRPC's text prompt answer as the same model served from its safetensors folder.
TEST(GgufServeTest, ServesOpenAiChatAndGrpcTextWithTheFilesTokenizerAndTemplate) {
  testing::ScratchDir dir;
  const std::string path = dir / "qwen3_moe-BF16.gguf";
  WriteFixtureGguf("qwen3_moe", path);
  struct Answer {
    std::string chat, grpc_text;
    std::vector<int32_t> grpc_tokens;
  };
  const auto ask = [](const std::string& model, const std::string& name) {
    Answer a;
    testing::ServeProcess serve({"--model", model, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads",
                                 "2", "--max-seqs", "2", "--kv-cache-mb", "16"});
    EXPECT_NE(serve.port(), 0) << serve.err();
    if (serve.port() == 0) return a;
    std::smatch m;
    const std::string log = serve.err();
    EXPECT_TRUE(std::regex_search(log, m, std::regex("HTTP on port ([0-9]+)"))) << log;
    httplib::Client http("127.0.0.1", std::stoi(m[1]));
    const nlohmann::json body = {{"model", name},
                                 {"messages", {{{"role", "user"}, {"content", "Hello world"}}}},
                                 {"max_tokens", 8},
                                 {"temperature", 0}};
    auto r = http.Post("/v1/chat/completions", body.dump(), "application/json");
    EXPECT_TRUE(r) << serve.err();
    if (r) {
      EXPECT_EQ(r->status, 200) << r->body;
      a.chat = nlohmann::json::parse(r->body)["choices"][0]["message"]["content"];
    }
    auto stub = pb::Generation::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(serve.port()), grpc::InsecureChannelCredentials()));
    pb::GenerateRequest request;
    request.set_text("def f(x):");
    request.mutable_stopping()->set_max_new_tokens(8);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub->Generate(&ctx, request);
    pb::GenerateResponse msg;
    while (reader->Read(&msg)) {
      a.grpc_tokens.insert(a.grpc_tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
      a.grpc_text += msg.text();
    }
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(serve.Stop(SIGTERM), 0);
    return a;
  };
  // A GGUF file is served under its name without the extension.
  const Answer from_gguf = ask(path, "qwen3_moe-BF16"), from_hf = ask(testing::FixtureDir("qwen3_moe"), "qwen3_moe");
  EXPECT_FALSE(from_gguf.chat.empty());
  EXPECT_EQ(from_gguf.chat, from_hf.chat);
  EXPECT_EQ(from_gguf.grpc_tokens.size(), 8u);
  EXPECT_EQ(from_gguf.grpc_tokens, from_hf.grpc_tokens);
  EXPECT_EQ(from_gguf.grpc_text, from_hf.grpc_text);
}

}  // namespace
}  // namespace moe

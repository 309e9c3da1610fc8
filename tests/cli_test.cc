// The `moeserve` binary as a user runs it: generate, make-model, help, and its errors.
#include <filesystem>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "test_util.h"

namespace moe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

std::string Join(const std::vector<int>& ids) {
  std::string s;
  for (int id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

nlohmann::json LastJsonLine(const std::string& out) {
  const auto end = out.find_last_not_of('\n');
  const auto start = out.rfind('\n', end);
  return nlohmann::json::parse(out.substr(start == std::string::npos ? 0 : start + 1, end + 1));
}

TEST(CliTest, GenerateJsonAndLogitsMatchTheGoldens) {
  const auto golden = testing::LoadGolden("glm4_moe")["cases"][2];
  testing::ScratchDir dir;
  const std::vector<int> prompt = golden["prompt_ids"];
  const std::vector<int> want = golden["greedy_ids"];
  auto r = testing::RunMoeserve({"generate", "--model", testing::FixtureDir("glm4_moe"), "--prompt-ids", Join(prompt),
                                 "--max-new-tokens", std::to_string(want.size()), "--temperature", "0", "--json",
                                 "--dump-logits", dir / "logits.json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json out = LastJsonLine(r.out);
  EXPECT_EQ(out["generated_ids"].get<std::vector<int>>(), want);
  EXPECT_EQ(out["prompt_tokens"], prompt.size());
  EXPECT_GT(out["prefill_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(out["decode_tokens_per_s"].get<double>(), 0);
  std::ifstream in(dir / "logits.json");
  const nlohmann::json rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), prompt.size());
  float worst = 0;
  for (size_t i = 0; i < golden["logits"].size(); ++i) {
    for (size_t v = 0; v < rows[i].size(); ++v) {
      worst = std::max(worst, std::abs(rows[i][v].get<float>() - golden["logits"][i][v].get<float>()));
    }
  }
  EXPECT_LT(worst, 1e-3f);
}

// deepseek_v3 (MLA) through the command: --device auto takes the CPU backend (no GPU here, or MLA's
// CPU-only kernels), and the greedy tokens are transformers'. inspect counts its cache as the
// latent: 4 layers x (32 + 16) values x 2 bytes (the GPU plan's bf16) = 384 bytes a position.
TEST(CliTest, DeepseekV3GeneratesOnTheCpuAndInspectCountsItsLatentCache) {
  const auto golden = testing::LoadGolden("deepseek_v3")["cases"][2];
  const std::vector<int> prompt = golden["prompt_ids"];
  const std::vector<int> want = golden["greedy_ids"];
  auto r =
      testing::RunMoeserve({"generate", "--model", testing::FixtureDir("deepseek_v3"), "--prompt-ids", Join(prompt),
                            "--max-new-tokens", std::to_string(want.size()), "--temperature", "0", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("device cpu"), std::string::npos) << r.err;
  EXPECT_EQ(LastJsonLine(r.out)["generated_ids"].get<std::vector<int>>(), want);

  auto inspect = testing::RunMoeserve({"inspect", "--model", testing::FixtureDir("deepseek_v3"), "--gpu-memory-gb",
                                       "24", "--read-gbps", "100", "--json"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  const nlohmann::json j = nlohmann::json::parse(inspect.out);
  EXPECT_EQ(j["kv_bytes_per_token"], 4 * (32 + 16) * 2);
  EXPECT_NE(j["mla_note"].get<std::string>().find("MLA caches 48 values a position per layer"), std::string::npos);
}

TEST(CliTest, BrokenModelsExitNonZeroWithTheMessage) {
  struct Case {
    const char* what;
    std::function<void(const std::string&)> breakit;
    std::vector<const char*> messages;
  };
  const std::vector<Case> cases = {
      {"missing tensor",
       [](const std::string& m) {
         testing::RewriteWeights(m, [](runtime::TensorEntry& e) { return e.name != "lm_head.weight"; });
       },
       {"tensor lm_head.weight is missing"}},
      {"wrong shape",
       [](const std::string& m) {
         testing::RewriteWeights(m, [](runtime::TensorEntry& e) {
           if (e.name == "model.layers.0.self_attn.k_proj.weight") e.shape = {32, 128};
           return true;
         });
       },
       {"model.layers.0.self_attn.k_proj.weight: shape [32, 128]", "config expects [64, 128]"}},
      {"truncated",
       [](const std::string& m) { fs::resize_file(m + "/model.safetensors", 100000); },
       {"model.safetensors", "truncated"}},
      {"unknown model_type",
       [](const std::string& m) { testing::EditConfig(m, [](nlohmann::json& j) { j["model_type"] = "bert"; }); },
       {"model_type 'bert' is not supported", "qwen3_moe"}},
      {"top-k above experts",
       [](const std::string& m) { testing::EditConfig(m, [](nlohmann::json& j) { j["num_experts_per_tok"] = 99; }); },
       {"num_experts_per_tok=99"}},
      {"heads not dividing hidden",
       [](const std::string& m) {
         testing::EditConfig(m, [](nlohmann::json& j) {
           j.erase("head_dim");
           j["num_attention_heads"] = 5;
           j["num_key_value_heads"] = 1;
         });
       },
       {"num_attention_heads=5 does not divide hidden_size=128"}},
  };
  for (const Case& c : cases) {
    testing::ScratchDir dir;
    const std::string model = dir / "m";
    testing::CopyFixture("qwen3_moe", model);
    c.breakit(model);
    auto r = testing::RunMoeserve({"generate", "--model", model, "--prompt-ids", "1,2,3"});
    EXPECT_EQ(r.exit_code, 1) << c.what << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr("moeserve generate: error: ")) << c.what;
    for (const char* m : c.messages) EXPECT_THAT(r.err, HasSubstr(m)) << c.what;
    EXPECT_TRUE(r.out.empty()) << c.what;
  }
}

TEST(CliTest, BadRequestsAndFlagsAreExplained) {
  const std::string model = testing::FixtureDir("qwen3_moe");
  auto r = testing::RunMoeserve({"generate", "--model", model, "--prompt-ids", "1,2,x"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--prompt-ids: 'x' is not a token id"));
  r = testing::RunMoeserve({"generate", "--model", model, "--prompt-ids", "1,600"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("prompt token 1 is 600, outside the vocabulary [0, 512)"));
  r = testing::RunMoeserve({"generate", "--model", model, "--prompt-ids", "1", "--max-new-tokens", "5000"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("exceeds the context of 2048 positions"));
  r = testing::RunMoeserve({"generate", "--model", model, "--prompt-ids", "1", "--top-p", "0"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("top_p must be in (0, 1]"));
  r = testing::RunMoeserve({"generate", "--model", model, "--prompt-ids", "1", "--tempreature", "1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown flag --tempreature"));
  r = testing::RunMoeserve({"generate", "--model", model, "--prompt-ids", "1", "--expert-linger-us", "-5"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--expert-linger-us: -5 is not an integer in [0, 10000000]"));
  r = testing::RunMoeserve({"bench", "experts", "--gap-us", "-1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--gap-us: -1 is not a number in [0, 1e+07]"));
  r = testing::RunMoeserve({"generate", "--prompt-ids", "1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--model is required"));
  r = testing::RunMoeserve({"generate", "--model", "/nonexistent", "--prompt-ids", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("/nonexistent/config.json"));
  r = testing::RunMoeserve({"frobnicate"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown command 'frobnicate'"));
}

TEST(CliTest, TokenizePrintsIdsAndExplainsBrokenTokenizers) {
  const std::string model = testing::FixtureDir("qwen3_moe");
  auto r = testing::RunMoeserve({"tokenize", "--model", model, "--text", "Hello world"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "42 71 78 337 331 274 78 70\n");  // as golden_tokenize.json has it
  r = testing::RunMoeserve({"tokenize", "--model", model, "--text", "<|im_start|>hi", "--json", "--no-special"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json out = LastJsonLine(r.out);
  EXPECT_EQ(out["ids"].get<std::vector<int>>(), (std::vector<int>{1, 74, 75}));
  EXPECT_EQ(out["decoded"], "<|im_start|>hi");

  testing::ScratchDir dir;
  { std::ofstream(dir / "prompt.txt") << "Hello world"; }
  r = testing::RunMoeserve({"tokenize", "--model", model, "--text-file", dir / "prompt.txt"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "42 71 78 337 331 274 78 70\n");

  // Usage errors: 2.
  r = testing::RunMoeserve({"tokenize", "--model", model});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, ::testing::HasSubstr("give exactly one of --text and --text-file"));
  r = testing::RunMoeserve({"tokenize", "--model", model, "--text-file", dir / "missing.txt"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, ::testing::HasSubstr("--text-file"));

  // A model without a tokenizer, a broken one, an unknown component: 1, naming the problem.
  const std::string broken = dir / "model";
  fs::create_directories(broken);
  r = testing::RunMoeserve({"tokenize", "--model", broken, "--text", "x"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, ::testing::HasSubstr("has no tokenizer.json"));
  { std::ofstream(broken + "/tokenizer.json") << "{\n  \"model\": {\n"; }
  r = testing::RunMoeserve({"tokenize", "--model", broken, "--text", "x"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, ::testing::HasSubstr("tokenizer.json:3:"));
  std::ifstream in(model + "/tokenizer.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["pre_tokenizer"] = {{"type", "Foo"}};
  { std::ofstream(broken + "/tokenizer.json") << config.dump(); }
  r = testing::RunMoeserve({"tokenize", "--model", broken, "--text", "x"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, ::testing::HasSubstr("pre_tokenizer type 'Foo' is not supported"));
}

// bench model end to end on the CPU backend (the GPU run is the same code on another backend):
// every row is there, positive, and measured against its ceiling.
TEST(CliTest, BenchModelReportsDecodeAndPrefillAgainstTheirCeilings) {
  auto r = testing::RunMoeserve({"bench", "model", "--model", testing::FixtureDir("qwen3_moe"), "--device", "cpu",
                                 "--threads", "2", "--expert-threads", "2", "--batches", "1,3", "--prompts", "9",
                                 "--decode-context", "5", "--decode-steps", "2", "--max-step-tokens", "4", "--roofline-mb", "64",
                                 "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["bandwidth_gbps"].get<double>(), 0);
  EXPECT_GT(j["matmul_tflops"].get<double>(), 0);
  ASSERT_EQ(j["decode"].size(), 2u);
  for (const auto& row : j["decode"]) {
    EXPECT_GT(row["tokens_per_s"].get<double>(), 0);
    EXPECT_GT(row["weight_bytes_per_step"].get<double>(), 0);
    EXPECT_GT(row["ratio_to_bound"].get<double>(), 0);
    // The pool's routed experts are read from host memory, in its packed format.
    EXPECT_GT(row["host_expert_bytes_per_step"].get<double>(), 0);
    EXPECT_LT(row["host_expert_bytes_per_step"].get<double>(), row["weight_bytes_per_step"].get<double>());
  }
  EXPECT_GT(j["host_read_gbps"].get<double>(), 0);
  // Three routed experts of 16 touched at batch 3 read more than one of batch 1 does.
  EXPECT_GT(j["decode"][1]["weight_bytes_per_step"].get<double>(), j["decode"][0]["weight_bytes_per_step"].get<double>());
  ASSERT_EQ(j["prefill"].size(), 1u);
  EXPECT_EQ(j["prefill"][0]["tokens"], 9);
  EXPECT_GT(j["prefill"][0]["tflops"].get<double>(), 0);
  EXPECT_NE(j["prefill"][0]["experts_path"].get<std::string>().find("4 layers' routed experts on the CPU"),
            std::string::npos);
}

TEST(CliTest, HelpExplainsTheCommands) {
  auto r = testing::RunMoeserve({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, AllOf(HasSubstr("generate"), HasSubstr("make-model")));
  r = testing::RunMoeserve({"generate", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, AllOf(HasSubstr("--prompt-ids"), HasSubstr("--dump-logits"), HasSubstr("--seed")));
  r = testing::RunMoeserve({"make-model", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, AllOf(HasSubstr("qwen3-30b-a3b"), HasSubstr("--layers")));
}

TEST(CliTest, SameSeedSameTokens) {
  std::vector<std::string> args = {"generate", "--model", testing::FixtureDir("mixtral"), "--prompt-ids", "5,6,7",
                                   "--max-new-tokens", "12", "--temperature", "1.0", "--top-p", "0.9", "--seed", "11",
                                   "--ignore-eos", "--json"};
  auto a = testing::RunMoeserve(args), b = testing::RunMoeserve(args);
  ASSERT_EQ(a.exit_code, 0) << a.err;
  EXPECT_EQ(LastJsonLine(a.out)["generated_ids"], LastJsonLine(b.out)["generated_ids"]);
  EXPECT_EQ(LastJsonLine(a.out)["generated_ids"].size(), 12u);
}

TEST(CliTest, MakeModelTinyGeneratesWithSpeed) {
  testing::ScratchDir dir;
  auto r = testing::RunMoeserve({"make-model", "--arch", "qwen3_moe", "--preset", "tiny", "--out", dir / "tiny"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("make-model: written"));
  r = testing::RunMoeserve({"generate", "--model", dir / "tiny", "--prompt-ids", "1,2,3,4", "--max-new-tokens", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("generated 8 tokens"), HasSubstr("prefill: 4 tokens"), HasSubstr("tokens/s")));
}

TEST(CliTest, MakeModelShardsBigCheckpointsAndLoadsThemTheSame) {
  testing::ScratchDir dir;
  auto r = testing::RunMoeserve({"make-model", "--preset", "tiny", "--seed", "3", "--quiet", "--out", dir / "one"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = testing::RunMoeserve(
      {"make-model", "--preset", "tiny", "--seed", "3", "--quiet", "--max-shard-mb", "1", "--out", dir / "sharded"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir / "sharded/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "sharded/model.safetensors"));
  int shards = 0;
  for (const auto& entry : fs::directory_iterator(dir / "sharded")) {
    shards += entry.path().filename().string().rfind("model-0", 0) == 0;
    // The limit counts tensor bytes, as Hugging Face's max_shard_size does; the header comes on top.
    if (entry.path().extension() == ".safetensors") {
      EXPECT_LE(fs::file_size(entry.path()), (1u << 20) + 65536);
    }
  }
  EXPECT_GE(shards, 2);
  std::vector<std::string> ids;
  for (const char* m : {"one", "sharded"}) {
    r = testing::RunMoeserve({"generate", "--model", dir / m, "--prompt-ids", "9,8,7", "--max-new-tokens", "6", "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    ids.push_back(LastJsonLine(r.out)["generated_ids"].dump());
  }
  EXPECT_EQ(ids[0], ids[1]);
  r = testing::RunMoeserve({"make-model", "--preset", "huge", "--out", dir / "x"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown preset 'huge'"));
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

TEST(CliBenchTest, ExpertBenchPrintsRowsAgainstTheMeasuredBandwidth) {
  auto r = testing::RunMoeserve({"bench", "experts", "--hidden", "128", "--intermediate", "64", "--experts", "8",
                                 "--top-k", "2", "--layers", "2", "--batches", "1,5", "--formats", "bf16,int8",
                                 "--kernels", "portable", "--read-mb", "16", "--seconds", "0.01", "--threads", "2",
                                 "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json rows = LastJsonLine(r.out);
  ASSERT_EQ(rows.size(), 4u);  // 2 formats x 1 kernel x 2 batches
  for (const auto& row : rows) {
    EXPECT_EQ(row["kernel"], "portable");
    EXPECT_GT(row["ms_per_call"].get<double>(), 0);
    EXPECT_GT(row["read_gbps"].get<double>(), 0);
    EXPECT_NEAR(row["ratio"].get<double>(), row["weight_gbps"].get<double>() / row["read_gbps"].get<double>(), 1e-9);
  }
  EXPECT_THAT(r.err, HasSubstr("read bandwidth"));  // the human-readable log goes to stderr with --json
  r = testing::RunMoeserve({"bench", "experts", "--formats", "fp4"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("expert format 'fp4' is not one of bf16, int8, int4"));
  r = testing::RunMoeserve({"bench", "experts", "--batches", "0"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--batches: '0' is not an integer in [1, 65536]"));
  r = testing::RunMoeserve({"bench", "experts", "--stream-tokens", "-1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--stream-tokens: -1 is not an integer in [0, 65536]"));
}

TEST(CliBenchTest, ASecondProcessAttachesToTheSharedArena) {
  const std::string name = "moeserve_cli_test_" + std::to_string(::getpid());
  const std::string model = testing::FixtureDir("qwen3_moe");
  std::remove(("/dev/shm/" + name).c_str());
  auto first = testing::RunMoeserve(
      {"bench", "load", "--model", model, "--expert-format", "int8", "--expert-shm", name, "--json"});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const nlohmann::json a = LastJsonLine(first.out);
  EXPECT_FALSE(a["attached"].get<bool>());
  EXPECT_GT(a["checkpoint_bytes"].get<int64_t>(), 0);
  // Against the bound measured in the same run: the checkpoint files read with the same threads.
  EXPECT_GE(a["cached_before"].get<double>(), 0.0);
  EXPECT_LE(a["cached_before"].get<double>(), 1.0);
  EXPECT_GT(a["page_cache_gbps"].get<double>(), 0.0);
  EXPECT_GT(a["read_gbps"].get<double>(), 0.0);
  EXPECT_NEAR(a["ratio"].get<double>(), a["load_gbps"].get<double>() / a["read_gbps"].get<double>(), 1e-9);
  // And copying them into a fresh shared segment of the arena's cut, which is gone afterwards.
  EXPECT_GT(a["copy_gbps"].get<double>(), 0.0);
  EXPECT_GT(a["copy_bound_gbps"].get<double>(), 0.0);
  EXPECT_NEAR(a["copy_ratio"].get<double>(), a["load_gbps"].get<double>() / a["copy_bound_gbps"].get<double>(), 1e-9);
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + name + "-bound"));
  auto second = testing::RunMoeserve(
      {"bench", "load", "--model", model, "--expert-format", "int8", "--expert-shm", name, "--json", "--unlink"});
  ASSERT_EQ(second.exit_code, 0) << second.err;
  const nlohmann::json b = LastJsonLine(second.out);
  EXPECT_TRUE(b["attached"].get<bool>());
  EXPECT_EQ(b["checkpoint_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(b["read_gbps"].get<double>(), 0.0);  // nothing read, nothing to bound
  EXPECT_EQ(b["copy_bound_gbps"].get<double>(), 0.0);
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + name));
  // Generation through an attached arena gives the same tokens as a private one.
  auto third = testing::RunMoeserve({"bench", "load", "--model", model, "--expert-format", "int8", "--expert-shm", name});
  ASSERT_EQ(third.exit_code, 0) << third.err;
  std::vector<std::string> ids;
  for (const std::vector<std::string>& extra : {std::vector<std::string>{"--expert-shm", name}, {}}) {
    std::vector<std::string> args = {"generate", "--model", model, "--prompt-ids", "3,4,5", "--max-new-tokens", "6",
                                     "--expert-format", "int8", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto g = testing::RunMoeserve(args);
    ASSERT_EQ(g.exit_code, 0) << g.err;
    ids.push_back(LastJsonLine(g.out)["generated_ids"].dump());
  }
  EXPECT_EQ(ids[0], ids[1]);
  std::remove(("/dev/shm/" + name).c_str());
}

TEST(CliTest, ExpertFlagsChooseThePathAndReportBadValues) {
  const auto golden = testing::LoadGolden("qwen2_moe")["cases"][2];
  const std::vector<int> prompt = golden["prompt_ids"];
  const std::vector<int> want = golden["greedy_ids"];
  for (const char* experts : {"reference", "pool"}) {
    auto r = testing::RunMoeserve({"generate", "--model", testing::FixtureDir("qwen2_moe"), "--prompt-ids",
                                   Join(prompt), "--max-new-tokens", std::to_string(want.size()), "--experts", experts, "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(LastJsonLine(r.out)["generated_ids"].get<std::vector<int>>(), want) << experts;
  }
  auto r = testing::RunMoeserve({"generate", "--model", testing::FixtureDir("qwen2_moe"), "--prompt-ids", "1",
                                 "--expert-format", "int2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("expert format 'int2' is not one of bf16, int8, int4"));
  r = testing::RunMoeserve({"generate", "--model", testing::FixtureDir("qwen2_moe"), "--prompt-ids", "1",
                            "--expert-kernel", "avx512", "--expert-format", "int8"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("no avx512 kernel for int8"));
  r = testing::RunMoeserve({"generate", "--model", testing::FixtureDir("qwen2_moe"), "--prompt-ids", "1",
                            "--expert-group", "48", "--expert-format", "int4"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--expert-group: 48 not in {32,64,128}"));
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// `moeserve serve` as a real process, the Python example as the client, then SIGTERM.
TEST(CliServeTest, ServeStreamsToThePythonClientAndStopsOnSigterm) {
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::close(out[0]);
    const char* bin_dir = std::getenv("MOE_BINARY_DIR");
    const std::string bin = std::string(bin_dir != nullptr ? bin_dir : MOE_BINARY_DIR) + "/moeserve";
    const std::string model = testing::FixtureDir("qwen3_moe");
    ::execl(bin.c_str(), bin.c_str(), "serve", "--model", model.c_str(), "--listen", "127.0.0.1:0", "--http", "off",
            "--threads", "2", "--expert-threads", "2", static_cast<char*>(nullptr));
    _exit(127);
  }
  ::close(out[1]);
  std::string printed;
  char c;
  while (printed.find('\n') == std::string::npos && ::read(out[0], &c, 1) == 1) printed += c;
  ASSERT_THAT(printed, HasSubstr("serving on port "));
  const std::string port = printed.substr(printed.rfind(' ') + 1, printed.size() - printed.rfind(' ') - 2);

  const std::string script = std::string(MOE_SOURCE_DIR) + "/examples/stream_client.py";
  const std::string cmd = "PYTHONPATH=" + std::string(MOE_BINARY_DIR) + "/python /usr/bin/python3 " + script +
                          " --target 127.0.0.1:" + port + " --prompt-ids 5,6,7 --max-new-tokens 6 2>&1";
  std::string client;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof(buf), p) != nullptr) client += buf;
    EXPECT_EQ(::pclose(p), 0) << client;
  }
  EXPECT_THAT(client, HasSubstr("model: qwen3_moe"));
  EXPECT_THAT(client, HasSubstr("finished: FINISH_REASON_LENGTH, 6 tokens"));
  // The same tokens as `moeserve generate`.
  auto g = testing::RunMoeserve({"generate", "--model", testing::FixtureDir("qwen3_moe"), "--prompt-ids", "5,6,7",
                                 "--max-new-tokens", "6", "--ignore-eos", "--json"});
  std::string want = "tokens:";
  for (int id : LastJsonLine(g.out)["generated_ids"]) want += " " + std::to_string(id);
  EXPECT_THAT(client, HasSubstr(want));

  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ::close(out[0]);
}

TEST(CliBenchTest, ServingBenchReportsLatenciesPerConcurrency) {
  testing::ScratchDir dir;
  auto r = testing::RunMoeserve({"bench", "serve", "--model", testing::FixtureDir("qwen3_moe"), "--concurrency", "1,3",
                                 "--requests", "6", "--prompt-len", "8", "--output-len", "5", "--csv",
                                 dir / "serve.csv", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json rows = LastJsonLine(r.out);
  ASSERT_EQ(rows.size(), 2u);
  for (const auto& row : rows) {
    EXPECT_EQ(row["failed"], 0);
    EXPECT_GT(row["output_tokens_per_s"].get<double>(), 0);
    EXPECT_GT(row["ttft_ms"]["p50"].get<double>(), 0);
    EXPECT_LE(row["ttft_ms"]["p50"].get<double>(), row["ttft_ms"]["p99"].get<double>());
  }
  std::ifstream csv(dir / "serve.csv");
  int lines = 0;
  for (std::string line; std::getline(csv, line);) ++lines;
  EXPECT_EQ(lines, 1 + 12);  // header, then one row per request
  r = testing::RunMoeserve({"bench", "serve", "--target", "127.0.0.1:1", "--concurrency", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("no server answers at 127.0.0.1:1"));
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// inspect on a checkpoint: where each group goes under --cpu-moe, the plan for a 24 GB GPU that
// is not there, and the decode bound from the host memory the experts read.
TEST(InspectTest, PlansAFixtureForA24GbGpuWithItsExpertsOnTheCpu) {
  auto r = testing::RunMoeserve({"inspect", "--model", testing::FixtureDir("qwen3_moe"), "--gpu-memory-gb", "24",
                                 "--cpu-moe", "--expert-format", "int8", "--read-gbps", "100", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_NE(j["tensors"].get<std::string>().find("from the checkpoint's headers"), std::string::npos);
  ASSERT_EQ(j["layers"].size(), 1u);  // four layers placed alike
  EXPECT_EQ(j["layers"][0]["last"], 3);
  EXPECT_NE(j["layers"][0]["placed"].get<std::string>().find("routed expert CPU (--cpu-moe)"), std::string::npos);
  EXPECT_NE(j["layers"][0]["placed"].get<std::string>().find("router GPU"), std::string::npos);
  EXPECT_TRUE(j["gpu"]["fits"].get<bool>());
  EXPECT_EQ(j["gpu"]["free_bytes"].get<int64_t>(), int64_t{24} << 30);
  EXPECT_EQ(j["refusal"], "");
  // 4 of 16 experts in each of 4 layers, int8: at 100 GB/s the bound is 1e11 over those bytes.
  const double per_token = j["decode"]["host_bytes_per_token"].get<double>();
  EXPECT_GT(per_token, 4 * 4 * 3 * 128 * 64);  // int8 weights, plus their scales
  EXPECT_NEAR(j["decode"]["bound_tokens_per_s"].get<double>(), 100e9 / per_token, 1);
  EXPECT_EQ(j["decode"]["cpu_expert_layers"], 4);
}

// From config.json alone (the weights not downloaded), the same plan; and the bandwidth measured.
TEST(InspectTest, PlansFromConfigAloneAndMeasuresTheHostBandwidth) {
  testing::ScratchDir dir;
  std::filesystem::copy_file(testing::FixtureDir("qwen3_moe") + "/config.json", dir / "config.json");
  auto r = testing::RunMoeserve({"inspect", "--model", dir.path().string(), "--gpu-memory-gb", "24", "--n-cpu-moe", "2",
                                 "--expert-threads", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("231 tensors expected from config.json"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layers 0-1: attention GPU, norm GPU, routed expert CPU (--n-cpu-moe 2), router GPU"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("layers 2-3: attention GPU, norm GPU, routed expert GPU, router GPU"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("GB/s of host read bandwidth (measured now, 2 threads over 1 GiB)"), std::string::npos) << r.out;
}

// The seeds' trap: Qwen3-30B-A3B at its full 262144 context on a 24 GB GPU, experts on the CPU:
// refused before anything loads, with the context that fits.
TEST(InspectTest, TheFullContextOnA24GbGpuIsRefusedWithWhatFits) {
  testing::ScratchDir dir;
  std::ofstream(dir / "config.json") << R"({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "norm_topk_prob": true,
    "tie_word_embeddings": false})";
  auto r = testing::RunMoeserve(
      {"inspect", "--model", dir.path().string(), "--gpu-memory-gb", "24", "--cpu-moe", "--read-gbps", "100"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.out.find("does NOT fit"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("ctx 262,144 x 1 sequence needs 24.0 GiB of KV cache"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the largest context that fits is 16"), std::string::npos) << r.err;
  // A context that fits is then planned without complaint.
  auto ok = testing::RunMoeserve({"inspect", "--model", dir.path().string(), "--gpu-memory-gb", "24", "--cpu-moe",
                                  "--read-gbps", "100", "--ctx", "131072"});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// Placement the runtime cannot run is an error in inspect too, naming the tensor and the rule.
TEST(InspectTest, AttentionOnTheCpuIsRefusedNamingTheRule) {
  auto r = testing::RunMoeserve({"inspect", "--model", testing::FixtureDir("qwen3_moe"), "--gpu-memory-gb", "24",
                                 "--override-tensor", "self_attn=cpu", "--read-gbps", "100"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("warning: --override-tensor self_attn=cpu puts"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("only routed experts run on the CPU beside a GPU"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// profile-experts counts every pick of every prompt token; the profile ranks each layer's experts.
TEST(ProfileExpertsTest, CountsEveryPickOfEveryPromptToken) {
  testing::ScratchDir dir;
  std::ofstream(dir / "prompts.txt") << "The quick brown fox jumps over the lazy dog.\n\nHello world, how are you?\n";
  std::ofstream(dir / "ids.txt") << "1, 2, 3, 4\n5,6\n";
  for (const std::string flag : {"--prompt-file", "--prompt-ids-file"}) {
    const std::string file = flag == "--prompt-file" ? "prompts.txt" : "ids.txt";
    auto r = testing::RunMoeserve({"profile-experts", "--model", testing::FixtureDir("qwen3_moe"), flag, dir / file,
                                   "--out", dir / "profile.json", "--device", "cpu", "--top", "4"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("the 4 most used experts of a layer take"), std::string::npos) << r.out;
    std::ifstream in(dir / "profile.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    EXPECT_EQ(j["format"], "moeserve routing profile");
    const int64_t tokens = j["tokens"];
    if (flag == "--prompt-ids-file") {
      EXPECT_EQ(tokens, 6);
    }
    EXPECT_GT(tokens, 2);
    ASSERT_EQ(j["layers"].size(), 4u);
    for (const auto& layer : j["layers"]) {
      int64_t picks = 0;
      for (int64_t c : layer["counts"]) picks += c;
      EXPECT_EQ(picks, tokens * 4) << "layer " << layer["layer"];  // top-4 of 16
    }
  }
  auto neither = testing::RunMoeserve(
      {"profile-experts", "--model", testing::FixtureDir("qwen3_moe"), "--out", dir / "p.json", "--device", "cpu"});
  EXPECT_EQ(neither.exit_code, 2);
  EXPECT_NE(neither.err.find("give exactly one of --prompt-file and --prompt-ids-file"), std::string::npos);
  std::ofstream(dir / "bad.txt") << "1, 2, 99999\n";
  auto bad = testing::RunMoeserve({"profile-experts", "--model", testing::FixtureDir("qwen3_moe"), "--prompt-ids-file",
                                   dir / "bad.txt", "--out", dir / "p.json", "--device", "cpu"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("line 1: token id 99999 outside the vocabulary [0, 512)"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace moe

// make-model as a user relies on it: every architecture's checkpoint loads and generates, and
// bad options, a full disk, an existing destination or a failed write leave nothing behind.
#include "make_model.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/generate.h"
#include "moe/runtime/model.h"
#include "moe/runtime/model_spec.h"
#include "test_util.h"

namespace moe {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;
namespace fs = std::filesystem;

// The names in `dir`, hidden ones included (a leftover temporary directory is one).
std::vector<std::string> Entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

deploy::MakeModelOptions Tiny(const std::string& arch, const std::string& out) {
  deploy::MakeModelOptions o;
  o.arch = arch;
  o.preset = "tiny";
  o.out = out;
  o.progress = false;
  return o;
}

std::vector<int32_t> GenerateGreedy(const std::string& dir, int n) {
  auto model = runtime::Model::Load(dir);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  runtime::GenerateOptions g;
  g.max_new_tokens = n;
  g.sampling.temperature = 0;
  g.stop_at_eos = false;
  auto result = runtime::Generate(**model, {1, 2, 3, 4, 5}, g);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? result->generated_ids : std::vector<int32_t>{};
}

class MakeModelArchTest : public ::testing::TestWithParam<std::string> {};

TEST_P(MakeModelArchTest, TinyLoadsAndGeneratesAlsoWhenSharded) {
  const std::string arch = GetParam();
  testing::ScratchDir dir;
  ASSERT_TRUE(deploy::MakeModel(Tiny(arch, dir / "one")).ok());
  deploy::MakeModelOptions sharded = Tiny(arch, dir / "sharded");
  sharded.max_shard_bytes = deploy::kMakeModelMinShardBytes;
  ASSERT_TRUE(deploy::MakeModel(sharded).ok());
  EXPECT_THAT(Entries(dir.path()), ElementsAre("one", "sharded"));  // no temporary left over
  EXPECT_THAT(Entries(dir / "one"), ElementsAre("config.json", "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "sharded/model.safetensors.index.json"));

  auto model = runtime::Model::Load(dir / "one");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->spec().model_type, arch);
  EXPECT_EQ((*model)->spec().vocab_size, 512);
  const std::vector<int32_t> ids = GenerateGreedy(dir / "one", 8);
  ASSERT_EQ(ids.size(), 8u);
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 512) << id;
  // The same seed gives the same weights however they are split into files.
  EXPECT_EQ(GenerateGreedy(dir / "sharded", 8), ids);
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, MakeModelArchTest, ::testing::ValuesIn(runtime::SupportedModelTypes()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(MakeModelTest, EverySupportedArchitectureHasPresets) {
  for (const std::string& arch : runtime::SupportedModelTypes()) {
    const std::vector<std::string> presets = deploy::MakeModelPresets(arch);
    ASSERT_GE(presets.size(), 2u) << arch;
    EXPECT_EQ(presets[0], "tiny") << arch;
  }
}

// The real-shape presets hold their checkpoints' published parameter counts (bf16: 2 bytes
// each), so their dimensions are those of the real models. (GLM's counts include a
// multi-token-prediction layer that make-model does not write; it is under 1%.)
TEST(MakeModelTest, RealPresetsHaveThePublishedSizes) {
  struct Case {
    const char* arch;
    const char* preset;
    double billions;
  };
  for (const Case& c : {Case{"qwen3_moe", "qwen3-30b-a3b", 30.5}, Case{"qwen3_moe", "qwen3-235b-a22b", 235.1},
                        Case{"qwen2_moe", "qwen1.5-moe-a2.7b", 14.3}, Case{"qwen2_moe", "qwen2-57b-a14b", 57.4},
                        Case{"mixtral", "mixtral-8x7b", 46.7}, Case{"mixtral", "mixtral-8x22b", 140.6},
                        Case{"glm4_moe", "glm-4.5-air", 106}, Case{"glm4_moe", "glm-4.5", 355}}) {
    deploy::MakeModelOptions o;
    o.arch = c.arch;
    o.preset = c.preset;
    o.out = "unused";
    auto bytes = deploy::MakeModelCheckpointBytes(o);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_NEAR(*bytes / 2e9, c.billions, c.billions * 0.01) << c.preset;
  }
}

// DeepSeek-V3 (671B total, 37B active, its MTP layer aside) and Kimi-K2 (1.03T, 32B active), worked
// out by hand from their configs: per layer, MLA is q_a 7168x1536, q_b 1536 x heads*192, kv_a
// 7168x576, kv_b 512 x heads*256, o heads*128 x 7168 (DeepSeek-V3's 128 heads: 187.1M; Kimi's 64:
// 101.1M); a dense layer 3x7168x18432 = 396.4M; an expert (routed or shared) 3x7168x2048 = 44.04M;
// a router experts x 7168; embedding and head vocab x 7168 each. Active: every expert of a token's
// top-8 and the shared one, nothing of the other experts.
TEST(MakeModelTest, MlaPresetsHaveThePublishedSizes) {
  struct Case {
    const char* preset;
    int64_t experts, moe_layers;
    double total_billions, active_billions;
  };
  const int64_t expert = int64_t{3} * 7168 * 2048;
  for (const Case& c : {Case{"deepseek-v3", 256, 58, 671.0, 37.5}, Case{"kimi-k2", 384, 60, 1026.5, 32.9}}) {
    deploy::MakeModelOptions o;
    o.arch = "deepseek_v3";
    o.preset = c.preset;
    o.out = "unused";
    auto bytes = deploy::MakeModelCheckpointBytes(o);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    const double total = *bytes / 2e9;
    const double active = total - static_cast<double>((c.experts - 8) * expert * c.moe_layers) / 1e9;
    EXPECT_NEAR(total, c.total_billions, c.total_billions * 0.005) << c.preset;
    EXPECT_NEAR(active, c.active_billions, c.active_billions * 0.02) << c.preset;
  }
  // A --layers cut keeps the dense layers it can: 16 layers of DeepSeek-V3 are 3 dense and 13 MoE.
  deploy::MakeModelOptions cut;
  cut.arch = "deepseek_v3";
  cut.preset = "deepseek-v3";
  cut.layers = 16;
  cut.out = "unused";
  auto bytes = deploy::MakeModelCheckpointBytes(cut);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const double layer_attention = 7168.0 * 1536 + 1536.0 * 128 * 192 + 7168.0 * 576 + 512.0 * 128 * 256 +
                                 128.0 * 128 * 7168 + 1536 + 512 + 2 * 7168;
  const double moe_layer = 257.0 * expert + 256.0 * 7168 + 256;
  const double want = 16 * layer_attention + 3 * 3 * 7168.0 * 18432 + 13 * moe_layer + 2 * 129280.0 * 7168 + 7168;
  EXPECT_NEAR(*bytes / 2.0, want, want * 0.001);
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

int64_t FreeBytes(const fs::path& dir) {
  struct statvfs st;
  EXPECT_EQ(::statvfs(dir.c_str(), &st), 0);
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

TEST(MakeModelTest, CheckpointLargerThanTheFreeSpaceFailsBeforeWritingAnything) {
  testing::ScratchDir dir;
  deploy::MakeModelOptions o;
  o.preset = "qwen3-235b-a22b";
  o.layers = deploy::kMakeModelMaxLayers;
  o.out = dir / "parent/big";  // the parent is missing too: it must not be created
  o.progress = false;
  auto bytes = deploy::MakeModelCheckpointBytes(o);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_GT(*bytes, FreeBytes(dir.path()));
  const absl::Status s = deploy::MakeModel(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(StartsWith(absl::StrCat("make-model: the checkpoint needs ", *bytes, " bytes")),
                    HasSubstr(dir.path().string() + " has "), HasSubstr("bytes (")));
  EXPECT_THAT(Entries(dir.path()), IsEmpty());
}

TEST(MakeModelTest, OptionOutOfRangeNamesTheOption) {
  struct Case {
    std::function<void(deploy::MakeModelOptions&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](auto& o) { o.vocab = 99999999999; },
       "make-model: --vocab 99999999999 is out of range; give a vocabulary size from 1 to 16777216"},
      {[](auto& o) { o.vocab = -5; }, "make-model: --vocab -5 is out of range"},
      {[](auto& o) { o.layers = 1025; },
       "make-model: --layers 1025 is out of range; give a layer count from 1 to 1024"},
      {[](auto& o) { o.layers = -1; }, "make-model: --layers -1 is out of range"},
      {[](auto& o) { o.max_shard_bytes = 0; },
       "make-model: --max-shard-mb gives 0 bytes per shard; give 1 to 1048576 MB"},
      {[](auto& o) { o.max_shard_bytes = int64_t{1} << 50; }, "make-model: --max-shard-mb gives"},
      {[](auto& o) { o.arch = "qwen3_next"; },
       "make-model: --arch 'qwen3_next' is not supported; supported: qwen3_moe, qwen2_moe, mixtral, glm4_moe, "
       "deepseek_v3"},
      {[](auto& o) { o.preset = "huge"; },
       "make-model: unknown preset 'huge'; presets: tiny, qwen3-30b-a3b, qwen3-235b-a22b (for --arch qwen3_moe)"},
      {[](auto& o) {
         o.arch = "mixtral";
         o.preset = "glm-4.5-air";
       },
       "make-model: preset 'glm-4.5-air' is a glm4_moe shape, not mixtral; pass --arch glm4_moe, or a preset for "
       "mixtral: tiny, mixtral-8x7b, mixtral-8x22b"},
      {[](auto& o) { o.out.clear(); }, "make-model: --out is required"},
  };
  for (const Case& c : cases) {
    testing::ScratchDir dir;
    deploy::MakeModelOptions o = Tiny("qwen3_moe", dir / "m");
    c.edit(o);
    const absl::Status valid = deploy::ValidateMakeModelOptions(o);
    EXPECT_EQ(valid.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(valid.message()), StartsWith(c.message));
    const absl::Status made = deploy::MakeModel(o);
    EXPECT_EQ(made, valid);
    EXPECT_THAT(Entries(dir.path()), IsEmpty()) << c.message;
  }
}

TEST(MakeModelTest, CommandRejectsAHugeVocabularyAndWritesNothing) {
  testing::ScratchDir dir;
  auto r = testing::RunMoeserve({"make-model", "--vocab", "99999999999", "--quiet", "--out", dir / "m"});
  EXPECT_EQ(r.exit_code, 2) << r.err;  // a usage error: the flag's text is out of range
  EXPECT_THAT(r.err, HasSubstr("--vocab: 99999999999 is not an integer in [1, 16777216]"));
  EXPECT_THAT(Entries(dir.path()), IsEmpty());
}

TEST(MakeModelTest, ExistingNonEmptyDestinationIsRefusedAndLeftUntouched) {
  testing::ScratchDir dir;
  fs::create_directories(dir / "m");
  std::ofstream(dir / "m/notes.txt") << "mine";
  const absl::Status s = deploy::MakeModel(Tiny("mixtral", dir / "m"));
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_EQ(std::string(s.message()), absl::StrCat("make-model: --out ", dir / "m",
                                                   " already exists and is not empty; choose a new directory or pass "
                                                   "--overwrite to replace it"));
  EXPECT_THAT(Entries(dir / "m"), ElementsAre("notes.txt"));
  EXPECT_EQ(ReadFile(dir / "m/notes.txt"), "mine");
  EXPECT_THAT(Entries(dir.path()), ElementsAre("m"));

  // A file where the directory should be is refused too, and kept.
  std::ofstream(dir / "file") << "data";
  const absl::Status f = deploy::MakeModel(Tiny("mixtral", dir / "file"));
  EXPECT_EQ(f.code(), absl::StatusCode::kInvalidArgument) << f;
  EXPECT_THAT(std::string(f.message()), HasSubstr("exists and is not a directory"));
  EXPECT_EQ(ReadFile(dir / "file"), "data");
}

TEST(MakeModelTest, EmptyDestinationIsFilledAndOverwriteReplacesAFullOne) {
  testing::ScratchDir dir;
  fs::create_directories(dir / "empty");
  ASSERT_TRUE(deploy::MakeModel(Tiny("qwen2_moe", dir / "empty")).ok());
  EXPECT_THAT(Entries(dir / "empty"), ElementsAre("config.json", "model.safetensors"));

  fs::create_directories(dir / "m");
  std::ofstream(dir / "m/notes.txt") << "old";
  deploy::MakeModelOptions o = Tiny("glm4_moe", dir / "m");
  o.overwrite = true;
  ASSERT_TRUE(deploy::MakeModel(o).ok());
  EXPECT_THAT(Entries(dir / "m"), ElementsAre("config.json", "model.safetensors"));
  EXPECT_THAT(Entries(dir.path()), ElementsAre("empty", "m"));  // the old one is gone, no temporary left
  EXPECT_EQ(GenerateGreedy(dir / "m", 4).size(), 4u);
}

// Sets a soft limit on the size of files this process writes, for the life of the object, with
// SIGXFSZ ignored so that a write past it fails with EFBIG instead of killing the process.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    EXPECT_EQ(::getrlimit(RLIMIT_FSIZE, &saved_), 0);
    struct rlimit limit = saved_;
    limit.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
    saved_handler_ = ::signal(SIGXFSZ, SIG_IGN);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    ::signal(SIGXFSZ, saved_handler_);
  }

 private:
  struct rlimit saved_;
  sighandler_t saved_handler_;
};

TEST(MakeModelTest, WriteFailureMidwayLeavesNoPartialOutputAndKeepsTheOldModel) {
  testing::ScratchDir dir;
  fs::create_directories(dir / "m");
  std::ofstream(dir / "m/notes.txt") << "old";
  deploy::MakeModelOptions o = Tiny("qwen3_moe", dir / "m");
  o.overwrite = true;
  o.max_shard_bytes = deploy::kMakeModelMinShardBytes;
  absl::Status s;
  {
    // config.json (1 KB) is written, then the first shard (1 MB) cannot be sized.
    FileSizeLimit limit(256 << 10);
    s = deploy::MakeModel(o);
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(StartsWith(absl::StrCat("make-model: writing ", dir / "m", " (nothing was left behind): ")),
                    HasSubstr("model-00001-of-"), HasSubstr(std::strerror(EFBIG))));
  EXPECT_THAT(Entries(dir.path()), ElementsAre("m"));
  EXPECT_THAT(Entries(dir / "m"), ElementsAre("notes.txt"));
  EXPECT_EQ(ReadFile(dir / "m/notes.txt"), "old");
}

// The same through the binary, with the limit set in the child before exec, as `ulimit -f`
// would.
TEST(MakeModelTest, CommandUnderAFileSizeLimitFailsAndLeavesNothing) {
  testing::ScratchDir dir, logs;
  const std::string err_path = logs / "stderr";
  const char* bin_dir = std::getenv("MOE_BINARY_DIR");
  std::string binary = std::string(bin_dir != nullptr ? bin_dir : MOE_BINARY_DIR) + "/moeserve";
  std::vector<std::string> args = {binary, "make-model", "--preset", "tiny", "--quiet", "--out", dir / "m"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    struct rlimit limit = {256 << 10, 256 << 10};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0 || ::signal(SIGXFSZ, SIG_IGN) == SIG_ERR ||
        std::freopen(err_path.c_str(), "w", stderr) == nullptr) {
      _exit(126);
    }
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "signal " << WTERMSIG(status);
  const std::string err = ReadFile(err_path);
  EXPECT_EQ(WEXITSTATUS(status), 1) << err;
  EXPECT_THAT(err, AllOf(HasSubstr("make-model: writing "), HasSubstr("(nothing was left behind)"),
                         HasSubstr(std::strerror(EFBIG))));
  EXPECT_THAT(Entries(dir.path()), IsEmpty());
}

// Every preset, cut to one layer, makes a config the loader takes (a GLM-4.5 shape has three dense
// layers first: cut to one, it must say one).
TEST(MakeModelTest, EveryPresetCutToOneLayerMakesAConfigThatLoads) {
  for (const std::string& arch : runtime::SupportedModelTypes()) {
    for (const std::string& preset : deploy::MakeModelPresets(arch)) {
      deploy::MakeModelOptions o;
      o.arch = arch;
      o.preset = preset;
      o.layers = 1;
      o.vocab = 64;
      o.out = "unused";
      const auto bytes = deploy::MakeModelCheckpointBytes(o);
      EXPECT_TRUE(bytes.ok()) << arch << " " << preset << ": " << bytes.status();
    }
  }
}

}  // namespace
}  // namespace moe

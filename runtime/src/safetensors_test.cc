#include <cstring>
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"
#include "moe/runtime/safetensors_writer.h"
#include "moe/runtime/weight_source.h"

namespace moe::runtime {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_st_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes a file with a [2,3] bf16 tensor "a" (values 0..5) and a [4] f32 tensor "b".
  std::string WriteSample(const std::string& name) {
    const std::string path = (dir_ / name).string();
    auto w = SafetensorsWriter::Create(path, {{"a", core::DType::kBF16, {2, 3}}, {"b", core::DType::kF32, {4}}});
    EXPECT_TRUE(w.ok()) << w.status();
    auto* a = static_cast<uint16_t*>(w->data(0));
    for (int i = 0; i < 6; ++i) a[i] = core::FloatToBf16(static_cast<float>(i));
    auto* b = static_cast<float*>(w->data(1));
    for (int i = 0; i < 4; ++i) b[i] = 0.5f * i;
    EXPECT_TRUE(w->Finish().ok());
    return path;
  }

  // Replaces the JSON header of `path` (keeping the data section).
  void RewriteHeader(const std::string& path, const std::string& header) {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    uint64_t old_len;
    std::memcpy(&old_len, bytes.data(), 8);
    std::string data = bytes.substr(8 + old_len);
    uint64_t len = header.size();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << header << data;
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, ReadsBackWhatWasWritten) {
  auto source = OpenSafetensorsFile(WriteSample("model.safetensors"));
  ASSERT_TRUE(source.ok()) << source.status();
  auto a = (*source)->Get("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->shape, core::Shape({2, 3}));
  EXPECT_EQ(a->dtype, core::DType::kBF16);
  EXPECT_EQ(core::Bf16ToFloat(static_cast<const uint16_t*>(a->data)[5]), 5.0f);
  auto b = (*source)->Get("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(static_cast<const float*>(b->data)[3], 1.5f);
  EXPECT_EQ((*source)->FileOf("a"), "model.safetensors");
  auto missing = (*source)->Get("c");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("tensor c is missing from"));
}

TEST_F(SafetensorsTest, TruncatedFileNamesTheTensorAndTheFile) {
  const std::string path = WriteSample("model.safetensors");
  fs::resize_file(path, fs::file_size(path) - 4);  // cut into tensor "b"
  auto source = OpenSafetensorsFile(path);
  EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(source.status().message(), HasSubstr(path));
  EXPECT_THAT(source.status().message(), HasSubstr("tensor b"));
  EXPECT_THAT(source.status().message(), HasSubstr("truncated"));
}

TEST_F(SafetensorsTest, HeaderPastTheEndOfTheFileIsAnError) {
  const std::string path = WriteSample("model.safetensors");
  fs::resize_file(path, 20);
  auto source = OpenSafetensorsFile(path);
  EXPECT_THAT(source.status().message(), HasSubstr("runs past the end"));
  fs::resize_file(path, 3);
  source = OpenSafetensorsFile(path);
  EXPECT_THAT(source.status().message(), HasSubstr("too short"));
}

TEST_F(SafetensorsTest, BadHeadersAreErrors) {
  const std::string path = WriteSample("model.safetensors");
  RewriteHeader(path, "{\"a\": [1, 2");
  EXPECT_THAT(OpenSafetensorsFile(path).status().message(), HasSubstr("bad header: not a JSON object"));
  RewriteHeader(path, R"({"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})");
  EXPECT_THAT(OpenSafetensorsFile(path).status().message(), HasSubstr("hold 10 bytes but [2, 3] BF16 needs 12"));
  RewriteHeader(path, R"({"a": {"dtype": "F8_E4M3", "shape": [2, 3], "data_offsets": [0, 6]}})");
  EXPECT_THAT(OpenSafetensorsFile(path).status().message(), HasSubstr("dtype F8_E4M3 is not supported"));
  RewriteHeader(path, R"({"a": {"dtype": "BF16", "shape": [2, 3]}})");
  EXPECT_THAT(OpenSafetensorsFile(path).status().message(), HasSubstr("tensor a: bad header entry"));
}

TEST_F(SafetensorsTest, OpensShardsThroughTheIndex) {
  // Two shards, one tensor each, and an index that names them.
  for (int shard = 0; shard < 2; ++shard) {
    const std::string name = "t" + std::to_string(shard);
    auto w = SafetensorsWriter::Create((dir_ / ("shard" + std::to_string(shard) + ".safetensors")).string(),
                                       {{name, core::DType::kF32, {2}}});
    ASSERT_TRUE(w.ok());
    static_cast<float*>(w->data(0))[1] = 10.0f + shard;
    ASSERT_TRUE(w->Finish().ok());
  }
  {
    std::ofstream index(dir_ / "model.safetensors.index.json");
    index << R"({"weight_map": {"t0": "shard0.safetensors", "t1": "shard1.safetensors"}})";
  }
  auto source = OpenSafetensors(dir_.string());
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ(static_cast<const float*>((*source)->Get("t1")->data)[1], 11.0f);
  EXPECT_EQ((*source)->FileOf("t1"), "shard1.safetensors");
  EXPECT_EQ((*source)->Names().size(), 2u);

  {
    std::ofstream index(dir_ / "model.safetensors.index.json", std::ios::trunc);
    index << R"({"weight_map": {"t0": "shard0.safetensors", "t9": "shard1.safetensors"}})";
  }
  auto bad = OpenSafetensors(dir_.string());
  EXPECT_THAT(bad.status().message(), HasSubstr("lists tensor t9 in shard1.safetensors"));
}

TEST_F(SafetensorsTest, MissingCheckpointIsNotFound) {
  auto source = OpenSafetensors(dir_.string());
  EXPECT_EQ(source.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(source.status().message(), HasSubstr("no model.safetensors"));
}

}  // namespace
}  // namespace moe::runtime

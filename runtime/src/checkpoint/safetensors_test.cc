#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"
#include "moe/runtime/safetensors_writer.h"
#include "moe/runtime/weight_source.h"
#include "nlohmann/json.hpp"

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
  EXPECT_THAT(OpenSafetensorsFile(path).status().message(), HasSubstr(path + " header:1:12: invalid JSON: "));
  RewriteHeader(path, "[1]");
  EXPECT_THAT(OpenSafetensorsFile(path).status().message(),
              HasSubstr(path + " header: expected a JSON object at the top level, found a list of 1 value"));
  RewriteHeader(path, R"({"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})");
  EXPECT_THAT(OpenSafetensorsFile(path).status().message(), HasSubstr("hold 10 bytes but [2, 3] BF16 needs 12"));
  RewriteHeader(path, R"({"a": {"dtype": "F8_E5M2", "shape": [2, 3], "data_offsets": [0, 6]}})");
  EXPECT_THAT(OpenSafetensorsFile(path).status().message(), HasSubstr("dtype F8_E5M2 is not supported"));
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

// Offsets and shapes are checked with arithmetic that cannot wrap: a shape whose byte count
// overflows used to wrap to the size the offsets held ("hold 32768 bytes but needs 32768").
TEST_F(SafetensorsTest, OverflowingShapesAndOffsetsSayWhatIsWrong) {
  const std::string path = WriteSample("model.safetensors");
  struct Case {
    const char* header;
    const char* message;
  };
  for (
      const Case& c : {
          Case{R"({"a": {"dtype": "BF16", "shape": [4611686018427387904, 8192], "data_offsets": [0, 32768]}})",
               "tensor a: shape [4611686018427387904, 8192] BF16 is too large: its byte count does not fit in 63 bits"},
          Case{R"({"a": {"dtype": "F32", "shape": [9223372036854775807], "data_offsets": [0, 12]}})",
               "shape [9223372036854775807] F32 is too large"},
          Case{R"({"a": {"dtype": "BF16", "shape": [0, 18446744073709551615], "data_offsets": [0, 0]}})",
               "tensor a: bad shape [0, 18446744073709551615]: dimension 18446744073709551615 does not fit"},
          Case{R"({"a": {"dtype": "BF16", "shape": [-2, 3], "data_offsets": [0, 12]}})",
               "tensor a: bad shape: dimension 0 is -2, not a non-negative integer"},
          Case{R"({"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [12, 0]}})",
               "tensor a: data_offsets [12, 0) end before they begin"},
          Case{R"({"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 18446744073709551615]}})",
               "data_offsets [0, 18446744073709551615) hold 18446744073709551615 bytes but [2, 3] BF16 needs 12"},
          Case{
              R"({"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [18446744073709551600, 18446744073709551612]}})",
              "tensor a: data ends at byte 18446744073709551612 of the data section, but the file holds only 28"},
          Case{R"({"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0.5, 12]}})",
               "tensor a: data_offsets must be two non-negative integers [begin, end], found a list of 2 values"},
          Case{R"({"a": {"dtype": 7, "shape": [2, 3], "data_offsets": [0, 12]}})",
               "tensor a: dtype must be a string, found 7"},
      }) {
    RewriteHeader(path, c.header);
    auto source = OpenSafetensorsFile(path);
    EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument) << c.header;
    EXPECT_THAT(source.status().message(), HasSubstr(c.message)) << c.header;
  }
}

TEST_F(SafetensorsTest, HeaderLengthIsCheckedBeforeAnythingIsAllocated) {
  const std::string path = (dir_ / "model.safetensors").string();
  for (uint64_t len : {uint64_t{1} << 40, ~uint64_t{0}}) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << "{}";
    out.close();
    auto source = OpenSafetensorsFile(path);
    EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(source.status().message(),
                HasSubstr(absl::StrCat("bad header: its length field says ", len,
                                       " bytes, more than the 100 MiB the safetensors format allows")));
  }
}

TEST_F(SafetensorsTest, SymbolicLinkLoopIsAnErrorNamingTheFile) {
  const std::string path = (dir_ / "model.safetensors").string();
  fs::create_symlink("model.safetensors", path);
  auto source = OpenSafetensors(dir_.string());
  EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(source.status().message(), HasSubstr(path + " is a symbolic link loop"));
  fs::remove(path);
  const std::string index = (dir_ / "model.safetensors.index.json").string();
  fs::create_symlink("model.safetensors.index.json", index);
  source = OpenSafetensors(dir_.string());
  EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(source.status().message(), HasSubstr(index + " is a symbolic link loop"));
}

TEST_F(SafetensorsTest, WeightsThatAreNotRegularFilesAreRefused) {
  const std::string path = (dir_ / "model.safetensors").string();
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  EXPECT_THAT(OpenSafetensors(dir_.string()).status().message(), HasSubstr(path + " is a fifo, not a regular file"));
  fs::remove(path);
  fs::create_directory(path);
  EXPECT_THAT(OpenSafetensors(dir_.string()).status().message(),
              HasSubstr(path + " is a directory, not a regular file"));
  const std::string index = (dir_ / "model.safetensors.index.json").string();
  fs::create_symlink("/dev/zero", index);
  EXPECT_THAT(OpenSafetensors(dir_.string()).status().message(),
              HasSubstr(index + " is a character device, not a regular file"));
}

TEST_F(SafetensorsTest, OversizedIndexIsRefusedNamingTheLimit) {
  const std::string index = (dir_ / "model.safetensors.index.json").string();
  { std::ofstream(index) << "{}"; }
  fs::resize_file(index, std::uintmax_t{65} << 20);  // sparse: nothing is written
  auto source = OpenSafetensors(dir_.string());
  EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(source.status().message(),
              HasSubstr(index + " is 65 MiB, more than the 64 MiB allowed for model.safetensors.index.json"));
}

TEST_F(SafetensorsTest, MalformedIndexNamesLineAndColumn) {
  const std::string index = (dir_ / "model.safetensors.index.json").string();
  std::ofstream(index) << "{\n  \"weight_map\": {\n    \"t0\": \"a.safetensors\"\n    \"t1\": \"b\"}}";
  EXPECT_THAT(std::string(OpenSafetensors(dir_.string()).status().message()),
              HasSubstr(index + ":4:8: invalid JSON: syntax error"));
  std::ofstream(index, std::ios::trunc) << R"({"weight_map": {}})";
  EXPECT_THAT(OpenSafetensors(dir_.string()).status().message(), HasSubstr(index + ": weight_map lists no tensors"));
  std::ofstream(index, std::ios::trunc) << R"({"weight_map": []})";
  EXPECT_THAT(OpenSafetensors(dir_.string()).status().message(),
              HasSubstr("not a safetensors index (needs a weight_map object, found a list of 0 values)"));
}

// An index entry may not name a file outside the model folder.
TEST_F(SafetensorsTest, ShardNamesMustStayInsideTheFolder) {
  const fs::path model = dir_ / "snapshot";
  fs::create_directories(model);
  WriteSample("model.safetensors");  // outside the model folder
  struct Case {
    const char* entry;
    const char* message;
  };
  for (const Case& c : {Case{"../model.safetensors", "which has a '..' component"},
                        Case{"../../other/model.safetensors", "which has a '..' component"},
                        Case{"sub/../../model.safetensors", "which has a '..' component"},
                        Case{"/etc/passwd", "which is an absolute path"}, Case{"", "which is empty"}}) {
    std::ofstream(model / "model.safetensors.index.json", std::ios::trunc)
        << nlohmann::json{{"weight_map", {{"a", "model.safetensors"}, {"b", c.entry}}}}.dump();
    auto source = OpenSafetensors(model.string());
    EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument) << c.entry;
    EXPECT_THAT(source.status().message(),
                HasSubstr(absl::StrCat("weight_map entry for tensor b is \"", c.entry, "\", ", c.message)))
        << c.entry;
  }
  std::ofstream(model / "model.safetensors.index.json", std::ios::trunc) << R"({"weight_map": {"a": 5}})";
  EXPECT_THAT(OpenSafetensors(model.string()).status().message(),
              HasSubstr("weight_map entry for tensor a must be a file name, found 5"));
}

// The Hugging Face cache: snapshots/REV/<file> -> ../../blobs/<hash>. Links that leave the
// folder are how a cached checkpoint is laid out, and load.
TEST_F(SafetensorsTest, SymlinkedFilesOfTheHuggingFaceCacheLoad) {
  const fs::path blobs = dir_ / "blobs";
  const fs::path snapshot = dir_ / "snapshots" / "0123abc";
  fs::create_directories(blobs);
  fs::create_directories(snapshot);
  fs::rename(WriteSample("blob1"), blobs / "1f2e3d");
  fs::create_symlink("../../blobs/1f2e3d", snapshot / "model.safetensors");
  auto single = OpenSafetensors(snapshot.string());
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ((*single)->FileOf("a"), "model.safetensors");

  fs::remove(snapshot / "model.safetensors");
  fs::create_symlink("../../blobs/1f2e3d", snapshot / "model-00001-of-00001.safetensors");
  std::ofstream(blobs / "9a8b7c")
      << R"({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}})";
  fs::create_symlink("../../blobs/9a8b7c", snapshot / "model.safetensors.index.json");
  auto indexed = OpenSafetensors(snapshot.string());
  ASSERT_TRUE(indexed.ok()) << indexed.status();
  EXPECT_EQ(static_cast<const float*>((*indexed)->Get("b")->data)[3], 1.5f);
}

}  // namespace
}  // namespace moe::runtime

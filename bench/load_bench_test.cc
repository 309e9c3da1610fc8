#include "load_bench.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe::bench {
namespace {

namespace fs = std::filesystem;

class LoadBenchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_load_bench_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& name, size_t bytes) {
    const fs::path path = dir_ / name;
    std::ofstream out(path, std::ios::binary);
    std::string data(bytes, '\0');
    for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(i * 7);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    return path.string();
  }
  fs::path dir_;
};

TEST_F(LoadBenchTest, FindsTheCheckpointFilesInOrder) {
  EXPECT_EQ(CheckpointFiles(dir_.string()).status().code(), absl::StatusCode::kNotFound);
  const std::string b = Write("model-00002-of-00002.safetensors", 1000);
  const std::string a = Write("model-00001-of-00002.safetensors", 5000);
  Write("config.json", 10);
  auto files = CheckpointFiles(dir_.string());
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ(*files, (std::vector<std::string>{a, b}));
  EXPECT_EQ(CheckpointFiles((dir_ / "missing").string()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LoadBenchTest, AFileJustWrittenIsInThePageCacheAndReads) {
  // 3 MiB and an odd tail: several pieces per thread, the last one short.
  const std::vector<std::string> files = {Write("model.safetensors", (3 << 20) + 1234)};
  auto cached = CachedShare(files);
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_GT(*cached, 0.5);
  EXPECT_LE(*cached, 1.0);
  auto buffered = ReadFilesGbps(files, 3, /*direct=*/false);
  ASSERT_TRUE(buffered.ok()) << buffered.status();
  EXPECT_GT(*buffered, 0.0);
  // Past the page cache: measured, or refused by the filesystem (tmpfs does), never an error.
  auto direct = ReadFilesGbps(files, 2, /*direct=*/true);
  if (direct.ok()) {
    EXPECT_GT(*direct, 0.0);
  } else {
    EXPECT_EQ(direct.status().code(), absl::StatusCode::kUnimplemented) << direct.status();
  }
  EXPECT_EQ(ReadFilesGbps({(dir_ / "missing.safetensors").string()}, 1, false).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe::bench

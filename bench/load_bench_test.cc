#include "load_bench.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
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
    for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(i * 7 % 251);  // never 0xff
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

std::string Contents(const std::vector<std::string>& files) {
  std::string all;
  for (const std::string& f : files) {
    std::ifstream in(f, std::ios::binary);
    all.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return all;
}

TEST_F(LoadBenchTest, CopyingFillsEveryByteOfTheDestinationFromTheFiles) {
  // Two files, the first of several pieces and chunks with an odd tail.
  const std::vector<std::string> files = {Write("a.safetensors", (9 << 20) + 4321), Write("b.safetensors", 1000)};
  const std::string all = Contents(files);
  // As large as the files: a copy of them, in order.
  std::vector<uint8_t> same(all.size(), 0xff);
  auto gbps = CopyFilesGbps(files, 3, same.data(), same.size());
  ASSERT_TRUE(gbps.ok()) << gbps.status();
  EXPECT_GT(*gbps, 0.0);
  EXPECT_EQ(std::string(same.begin(), same.end()), all);
  // Half as large (an int8 arena from bf16 files): every byte written once, from the files (no
  // 0xff in them), the first ones from their start.
  std::vector<uint8_t> half(all.size() / 2 + 3, 0xff);
  gbps = CopyFilesGbps(files, 4, half.data(), half.size());
  ASSERT_TRUE(gbps.ok()) << gbps.status();
  EXPECT_EQ(std::count(half.begin(), half.end(), 0xff), 0);
  EXPECT_EQ(std::string(half.begin(), half.begin() + 1000), all.substr(0, 1000));
  EXPECT_EQ(CopyFilesGbps({(dir_ / "missing.safetensors").string()}, 1, half.data(), half.size()).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe::bench

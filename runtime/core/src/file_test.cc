#include "moe/core/file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/core/memory.h"

namespace moe::core {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class FileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_file_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  fs::path dir_;
};

TEST_F(FileTest, ReadsAFileWithinTheLimit) {
  const std::string path = Write("config.json", "{\"a\": 1}");
  auto text = ReadBoundedFile(path, 8, "config.json");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "{\"a\": 1}");
  auto empty = ReadBoundedFile(Write("empty", ""), 8, "config.json");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(*empty, "");
}

TEST_F(FileTest, RefusesAFileOverTheLimitNamingTheLimit) {
  const std::string path = Write("config.json", std::string(3 << 20, ' '));
  auto text = ReadBoundedFile(path, 2 << 20, "config.json");
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(text.status().message(), HasSubstr(path + " is 3 MiB, more than the 2 MiB allowed for config.json"));
}

TEST_F(FileTest, StopsReadingAnEndlessDeviceAtTheLimit) {
  const std::string link = (dir_ / "config.json").string();
  fs::create_symlink("/dev/zero", link);
  auto text = ReadBoundedFile(link, 1 << 20, "config.json");
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(text.status().message(), HasSubstr(link + " is a character device, not a regular file"));
}

TEST_F(FileTest, StopsReadingAProcFileThatReportsNoSize) {
  // /proc files report size 0 but hold more: the read stops one byte past the limit.
  auto text = ReadBoundedFile("/proc/self/maps", 16, "config.json");
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(text.status().message(), HasSubstr("more than the 16 bytes allowed for config.json"));
}

TEST_F(FileTest, RefusesAFifoWithoutWaitingForAWriter) {
  const std::string path = (dir_ / "config.json").string();
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  auto text = ReadBoundedFile(path, 1 << 20, "config.json");
  EXPECT_THAT(text.status().message(), HasSubstr(path + " is a fifo, not a regular file"));
  auto mapped = MappedFile::Open(path);
  EXPECT_THAT(mapped.status().message(), HasSubstr(path + " is a fifo, not a regular file"));
}

TEST_F(FileTest, RefusesADirectory) {
  auto text = ReadBoundedFile(dir_.string(), 1 << 20, "config.json");
  EXPECT_THAT(text.status().message(), HasSubstr(" is a directory, not a regular file"));
}

TEST_F(FileTest, SymbolicLinkLoopIsAnErrorNotAnException) {
  const std::string path = (dir_ / "model.safetensors").string();
  fs::create_symlink("model.safetensors", path);
  auto kind = StatPath(path);
  EXPECT_EQ(kind.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(kind.status().message(), HasSubstr(path + " is a symbolic link loop"));
  EXPECT_THAT(ReadBoundedFile(path, 16, "x").status().message(), HasSubstr(path + " is a symbolic link loop"));
  auto mapped = MappedFile::Open(path);
  EXPECT_EQ(mapped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mapped.status().message(), HasSubstr(path + " is a symbolic link loop"));
}

TEST_F(FileTest, StatPathFollowsLinksAndSaysWhatIsThere) {
  const std::string file = Write("blob", "x");
  const std::string link = (dir_ / "link").string();
  fs::create_symlink(file, link);
  EXPECT_EQ(*StatPath(link), PathKind::kRegular);
  EXPECT_EQ(*StatPath(dir_.string()), PathKind::kDirectory);
  EXPECT_EQ(*StatPath((dir_ / "none").string()), PathKind::kMissing);
  EXPECT_EQ(*StatPath(file + "/below"), PathKind::kMissing);
  EXPECT_EQ(*StatPath("/dev/null"), PathKind::kOther);
  fs::create_symlink("nowhere", dir_ / "dangling");
  EXPECT_EQ(*StatPath((dir_ / "dangling").string()), PathKind::kMissing);
  auto missing = ReadBoundedFile((dir_ / "none").string(), 16, "x");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe::core

#include "moe/core/memory.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace moe::core {
namespace {

TEST(AlignedBufferTest, IsAlignedAndMovable) {
  auto b = AlignedBuffer::Allocate(1000, 256);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 256, 0u);
  AlignedBuffer moved = std::move(*b);
  EXPECT_EQ(moved.size(), 1000u);
  EXPECT_EQ(b->data(), nullptr);
}

// The flags of the mapping that holds `p`, from /proc/self/smaps ("" if not found).
std::string MappingFlags(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find('-') < line.find(' ')) {
      inside = lo <= addr && addr < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

// A buffer of several huge pages starts on a huge page boundary and is advised for transparent
// huge pages.
TEST(AlignedBufferTest, LargeBuffersAskForHugePages) {
  auto big = AlignedBuffer::Allocate(5u << 20);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big->data()) % (2u << 20), 0u);
  EXPECT_EQ(big->size(), 5u << 20);
  std::memset(big->data(), 1, big->size());
  if (!std::filesystem::exists("/sys/kernel/mm/transparent_hugepage")) {
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  }
  const std::string flags = MappingFlags(big->data());
  ASSERT_FALSE(flags.empty()) << "no mapping holds the buffer in /proc/self/smaps";
  EXPECT_NE(flags.find(" hg"), std::string::npos) << flags;
}

TEST(MappedFileTest, MapsContentsAndReportsMissingFiles) {
  auto path = std::filesystem::temp_directory_path() / "moe_mapped_file_test.bin";
  {
    std::ofstream out(path, std::ios::binary);
    out << "hello";
  }
  auto f = MappedFile::Open(path.string());
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->size(), 5u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f->data()), 5), "hello");
  std::filesystem::remove(path);

  auto missing = MappedFile::Open("/nonexistent/model.safetensors");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/model.safetensors"), std::string::npos);
}

}  // namespace
}  // namespace moe::core

#include "moe/core/memory.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>

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

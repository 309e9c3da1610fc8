// Owners of memory: an aligned heap buffer and a read-only memory map of a file.
// Both are move-only; their destructors release the memory and never throw.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace moe::core {

// Heap memory aligned to `alignment` bytes (64 by default: one cache line, one AVX-512 vector).
// From 4 MiB on, a buffer starts on a 2 MiB boundary and is advised for transparent huge pages
// (MADV_HUGEPAGE), so that accesses spread over it (a kernel's output rows) stay within the TLB's
// reach; where the kernel grants none, it still works with small pages.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  static absl::StatusOr<AlignedBuffer> Allocate(size_t bytes, size_t alignment = 64);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// A whole file mapped read-only (MAP_PRIVATE). The mapping lives as long as this object.
class MappedFile {
 public:
  MappedFile() = default;
  // kNotFound if the file does not exist; kInvalidArgument if it is not a regular file (a fifo is
  // refused without waiting for a writer) or is a symbolic link loop.
  static absl::StatusOr<MappedFile> Open(const std::string& path);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return static_cast<const uint8_t*>(addr_); }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void Reset() noexcept;
  void* addr_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

}  // namespace moe::core

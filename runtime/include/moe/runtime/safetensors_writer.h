// Writes a safetensors file: the header first, then the tensors' bytes, which the caller fills
// in place through a writable memory map (so several threads can fill different tensors).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/tensor.h"

namespace moe::runtime {

struct TensorEntry {
  std::string name;
  core::DType dtype = core::DType::kBF16;
  core::Shape shape;
  int64_t bytes() const { return core::NumElements(shape) * core::DTypeSize(dtype); }
};

class SafetensorsWriter {
 public:
  // Creates (truncating) `path` sized for `tensors`, header written, data zeroed.
  static absl::StatusOr<SafetensorsWriter> Create(const std::string& path, std::vector<TensorEntry> tensors);
  SafetensorsWriter(SafetensorsWriter&& other) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) = delete;
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  // Writable bytes of tensor i; valid until Finish().
  void* data(size_t i) const;
  // Unmaps; the data reaches the disk through the page cache.
  absl::Status Finish();

 private:
  SafetensorsWriter() = default;
  std::string path_;
  std::vector<TensorEntry> tensors_;
  std::vector<int64_t> offsets_;
  void* map_ = nullptr;
  size_t size_ = 0;
  size_t data_start_ = 0;
};

}  // namespace moe::runtime

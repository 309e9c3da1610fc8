// A non-owning view of a dense row-major tensor in host memory (a weight in a mapped
// checkpoint, a buffer of activations). Whoever created the view owns the bytes.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "moe/core/dtype.h"

namespace moe::core {

using Shape = std::vector<int64_t>;

// "[64, 128]"
std::string ShapeString(const Shape& shape);
int64_t NumElements(const Shape& shape);

struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;

  int64_t numel() const { return NumElements(shape); }
  int64_t bytes() const { return numel() * DTypeSize(dtype); }
  int64_t dim(int i) const { return shape[i]; }
  int rank() const { return static_cast<int>(shape.size()); }
};

}  // namespace moe::core

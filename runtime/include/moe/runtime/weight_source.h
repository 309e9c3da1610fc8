// Where weights come from. A WeightSource maps tensor names to read-only host views; the
// safetensors implementation memory-maps every file of a checkpoint (one file, or shards listed
// by model.safetensors.index.json) and checks every header before any tensor is handed out.
// Views stay valid for the life of the source.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/dtype.h"
#include "moe/core/tensor.h"

namespace moe::runtime {

// ---- How a tensor is stored ----

struct WeightFormat {
  enum class Kind {
    kPlain,        // one `element` per value
    kBlockScaled,  // `element` values (fp8) with one `scale_dtype` scale per [scale_rows x scale_cols] block
    kBlocks,       // `block_bytes` bytes per block of `block_elements` values along a row (GGUF's types)
  };
  Kind kind = Kind::kPlain;
  core::DType element = core::DType::kBF16;
  // kBlocks: the container's type id (GGUF's ggml_type), its name ("Q4_K"), and the block.
  int type_id = -1;
  std::string type_name;
  int block_elements = 1;
  int block_bytes = 0;
  // kBlockScaled: the scales' block and element type.
  int scale_rows = 0, scale_cols = 0;
  core::DType scale_dtype = core::DType::kF32;

  static WeightFormat Plain(core::DType element);
  static WeightFormat BlockScaled(core::DType element, int scale_rows, int scale_cols, core::DType scale_dtype);
  static WeightFormat Blocks(int type_id, std::string type_name, int block_elements, int block_bytes);

  bool plain() const { return kind == Kind::kPlain; }
  // Bytes of one row of `cols` values (cols a multiple of block_elements for kBlocks), scales apart.
  int64_t RowBytes(int64_t cols) const;
  // Bytes of a tensor of `shape` (the last dimension is the row), scales apart.
  int64_t Bytes(const core::Shape& shape) const;
  // Whether a row of `cols` values is whole blocks (always true but for kBlocks).
  bool Fits(int64_t cols) const { return kind != Kind::kBlocks || cols % block_elements == 0; }
  // "BF16", "F8_E4M3 (scale per 128x128)", "Q4_K".
  std::string Name() const;
  bool operator==(const WeightFormat& o) const;
};

// A tensor as stored: its bytes in the mapped checkpoint, its logical shape (values, row last), its
// format, and for kBlockScaled its scales ([ceil(rows / scale_rows) x ceil(cols / scale_cols)]).
struct WeightView {
  const void* data = nullptr;
  core::Shape shape;
  WeightFormat format;
  const void* scales = nullptr;
  core::Shape scale_shape;

  int64_t bytes() const { return format.Bytes(shape); }
  // kBlockScaled: scale i of scale_shape, row-major, as a float.
  float Scale(int64_t i) const;
  int64_t numel() const { return core::NumElements(shape); }
  int rank() const { return static_cast<int>(shape.size()); }
  // The same bytes as a plain TensorView; only for a plain format.
  core::TensorView AsTensor() const { return core::TensorView{data, format.element, shape}; }
  static WeightView Of(const core::TensorView& t);
};

// ---- Where tensors come from ----

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // kNotFound (naming the tensor and where it was looked for) if absent.
  virtual absl::StatusOr<core::TensorView> Get(const std::string& name) const = 0;
  virtual bool Has(const std::string& name) const = 0;
  // The file that holds `name` (for messages), or "" if absent.
  virtual std::string FileOf(const std::string& name) const = 0;
  virtual std::vector<std::string> Names() const = 0;
  // The tensor as stored: plain, or block-quantized (GGUF's types), which Get cannot hand out as a
  // TensorView. The default wraps Get (every tensor plain).
  virtual absl::StatusOr<WeightView> GetStored(const std::string& name) const;
};

// Opens the safetensors checkpoint in `model_dir`. Errors (kInvalidArgument, or kNotFound when no
// weights file exists) name the file and, for a bad entry, the tensor: a header length over the
// format's 100 MiB cap or past the end of the file, a header that is not JSON (with line and
// column), an unknown dtype, a shape whose byte count overflows, offsets that end before they
// begin or do not match the shape, or a tensor whose bytes lie past the end of a truncated file.
// model.safetensors.index.json is read only as a regular file of at most 64 MiB, and each of its
// shard names must be a relative path without '..' components; the shard files themselves may be
// symbolic links to anywhere (the Hugging Face cache links snapshots to ../../blobs/). A symbolic
// link loop or a path that is not a regular file (fifo, device, directory) is kInvalidArgument
// naming the path; nothing here throws.
absl::StatusOr<std::unique_ptr<WeightSource>> OpenSafetensors(const std::string& model_dir);

// Checks one file's header and data layout; used by OpenSafetensors and by tools.
absl::StatusOr<std::unique_ptr<WeightSource>> OpenSafetensorsFile(const std::string& path);

}  // namespace moe::runtime

// Where weights come from. A WeightSource maps tensor names to read-only host views; the
// safetensors implementation memory-maps every file of a checkpoint (one file, or shards listed
// by model.safetensors.index.json) and checks every header before any tensor is handed out.
// Views stay valid for the life of the source.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/tensor.h"

namespace moe::runtime {

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // kNotFound (naming the tensor and where it was looked for) if absent.
  virtual absl::StatusOr<core::TensorView> Get(const std::string& name) const = 0;
  virtual bool Has(const std::string& name) const = 0;
  // The file that holds `name` (for messages), or "" if absent.
  virtual std::string FileOf(const std::string& name) const = 0;
  virtual std::vector<std::string> Names() const = 0;
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

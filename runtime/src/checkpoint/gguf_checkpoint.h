// The GGUF opener behind OpenCheckpoint: which files make the model (one file, split parts, or a
// folder of them), the spec from the `<arch>.*` metadata, the tensors by the GGUF name table, and
// the tokenizer from `tokenizer.ggml.*`.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/checkpoint.h"

namespace moe::runtime::internal {

// The GGUF files of the model at `path`, the first part first: a .gguf file (the first part of a
// split set brings its other parts), or a folder holding one model's GGUF files (a multimodal
// projector, mmproj*.gguf, is named in the log and left alone). kInvalidArgument for a later part
// given alone, a part missing, two models in one folder; kNotFound for a folder without any.
absl::StatusOr<std::vector<std::string>> GgufModelFiles(const std::string& path);

absl::StatusOr<std::unique_ptr<Checkpoint>> OpenGgufCheckpoint(const std::string& path);
// The spec alone (header and metadata; the data is not touched).
absl::StatusOr<ModelSpec> ReadGgufSpec(const std::string& path);

}  // namespace moe::runtime::internal

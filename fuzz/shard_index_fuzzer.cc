// Fuzz target: model.safetensors.index.json text, opened with OpenSafetensors beside two small
// valid shards (written once per process) whose tensors the seed indexes name. An error is a fine
// answer; a crash, a hang, an unbounded allocation, an empty error message or a tensor view
// outside its shard (every listed tensor is read in full) are findings.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "fuzz_util.h"
#include "moe/runtime/safetensors_writer.h"
#include "moe/runtime/weight_source.h"

namespace {

// Two shards as make-model --max-shard-mb writes them; the seed corpus's indexes list these.
void WriteShard(const std::string& path, std::vector<moe::runtime::TensorEntry> tensors) {
  auto writer = moe::runtime::SafetensorsWriter::Create(path, std::move(tensors));
  MOE_FUZZ_CHECK(writer.ok(), "cannot write the shard %s: %s", path.c_str(),
                 std::string(writer.status().message()).c_str());
  for (size_t i = 0; i < writer->tensors().size(); ++i) {
    auto* bytes = static_cast<uint8_t*>(writer->data(i));
    for (int64_t b = 0; b < writer->tensors()[i].bytes(); ++b) bytes[b] = static_cast<uint8_t>(i * 17 + b);
  }
  const absl::Status finished = writer->Finish();
  MOE_FUZZ_CHECK(finished.ok(), "cannot finish the shard %s: %s", path.c_str(),
                 std::string(finished.message()).c_str());
}

// The scratch directory with the two shards, made once per process, removed at exit.
struct ShardedModelDir {
  ShardedModelDir() {
    using moe::core::DType;
    WriteShard(dir.path() + "/model-00001-of-00002.safetensors",
               {{"model.embed_tokens.weight", DType::kBF16, {8, 4}},
                {"model.layers.0.input_layernorm.weight", DType::kF32, {4}}});
    WriteShard(dir.path() + "/model-00002-of-00002.safetensors",
               {{"model.norm.weight", DType::kF32, {4}},
                {"lm_head.weight", DType::kBF16, {8, 4}},
                {"model.layers.0.mlp.gate.weight", DType::kI8, {2, 4}}});
  }
  moe::fuzz::ScratchDir dir{"fuzz-index"};
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ShardedModelDir model;
  const std::string& dir = model.dir.path();
  const std::string index = dir + "/model.safetensors.index.json";
  moe::fuzz::WriteFileOrDie(index, data, size);
  {
    auto source = moe::runtime::OpenSafetensors(dir);
    if (source.ok()) {
      // Each shard is at most a few hundred bytes; nothing listed may be larger.
      volatile uint64_t sum = moe::fuzz::ReadEveryTensor(**source, 1 << 20);
      (void)sum;
    } else {
      // Every error names the index or the shard it comes from, both inside the directory.
      const std::string message(source.status().message());
      MOE_FUZZ_CHECK(message.find(dir) != std::string::npos, "the error does not name the file: %s", message.c_str());
    }
  }
  ::unlink(index.c_str());
  return 0;
}

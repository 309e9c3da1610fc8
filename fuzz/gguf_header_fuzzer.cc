// Fuzz target: a whole GGUF file (header, metadata, tensor infos, data) opened as a checkpoint
// with OpenCheckpoint, then its vocabulary made into a tokenizer.json. An error is a fine answer;
// a crash, a hang, an unbounded allocation, an error that does not name the file, or a tensor
// view that lies outside the file (every listed tensor is read in full) are findings.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "moe/runtime/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static moe::fuzz::ScratchDir dir("fuzz-gguf");
  const std::string path = dir.path() + "/model.gguf";
  moe::fuzz::WriteFileOrDie(path, data, size);
  {
    auto checkpoint = moe::runtime::OpenCheckpoint(path);
    if (checkpoint.ok()) {
      const moe::runtime::WeightSource& source = (*checkpoint)->source();
      volatile uint64_t sum = 0;
      for (const std::string& name : source.Names()) {
        auto view = source.GetStored(name);
        MOE_FUZZ_CHECK(view.ok(), "a listed tensor does not read: %s", name.c_str());
        const auto* bytes = static_cast<const uint8_t*>(view->data);
        // DeepSeek's kv_b is joined in memory from its two halves in the file, in fp32: at most 8
        // values a byte of the halves (IQ1_S, the smallest type, stores 0.2 bytes a value).
        if (name.ends_with(".attn_kv_b.weight")) {
          MOE_FUZZ_CHECK(view->numel() <= 8 * static_cast<int64_t>(size), "joined tensor %s is out of scale", name.c_str());
        } else {
          MOE_FUZZ_CHECK(view->bytes() <= static_cast<int64_t>(size), "tensor %s is larger than the file", name.c_str());
        }
        for (int64_t i = 0; i < view->bytes(); ++i) sum = sum + bytes[i];
      }
      (void)sum;
      if ((*checkpoint)->tokenizer().embedded()) {
        auto json = moe::runtime::EmbeddedTokenizerJson((*checkpoint)->tokenizer());
        (void)json;
      }
    } else {
      const std::string message(checkpoint.status().message());
      MOE_FUZZ_CHECK(message.find(path) != std::string::npos, "the error does not name the file: %s", message.c_str());
    }
  }  // the checkpoint unmaps the file before it is removed
  ::unlink(path.c_str());
  return 0;
}

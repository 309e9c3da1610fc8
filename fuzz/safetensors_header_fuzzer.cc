// Fuzz target: a whole .safetensors file (8-byte little-endian header length, JSON header,
// data) opened with OpenSafetensorsFile. An error is a fine answer; a crash, a hang, an
// unbounded allocation, an error that does not name the file, or a tensor view that lies outside
// the file (every listed tensor is read in full) are findings.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "moe/runtime/weight_source.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static moe::fuzz::ScratchDir dir("fuzz-safetensors");
  const std::string path = dir.path() + "/model.safetensors";
  moe::fuzz::WriteFileOrDie(path, data, size);
  {
    auto source = moe::runtime::OpenSafetensorsFile(path);
    if (source.ok()) {
      volatile uint64_t sum = moe::fuzz::ReadEveryTensor(**source, size);
      (void)sum;
    } else {
      const std::string message(source.status().message());
      MOE_FUZZ_CHECK(message.find(path) != std::string::npos, "the error does not name the file: %s", message.c_str());
    }
  }  // the source unmaps the file before it is removed
  ::unlink(path.c_str());
  return 0;
}

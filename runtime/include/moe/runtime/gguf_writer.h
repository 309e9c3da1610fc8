// Writes GGUF files (version 3): metadata of every value type, tensors of any ggml type given as
// their stored bytes. For tests, the fuzz target's seeds and tools that make small models; the
// files llama.cpp's tools make are read the same way.
//
// Thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace moe::runtime {

class GgufWriter {
 public:
  // Metadata, in the order added.
  void U8(const std::string& key, uint8_t v);
  void I8(const std::string& key, int8_t v);
  void U16(const std::string& key, uint16_t v);
  void I16(const std::string& key, int16_t v);
  void U32(const std::string& key, uint32_t v);
  void I32(const std::string& key, int32_t v);
  void U64(const std::string& key, uint64_t v);
  void I64(const std::string& key, int64_t v);
  void F32(const std::string& key, float v);
  void F64(const std::string& key, double v);
  void Bool(const std::string& key, bool v);
  void String(const std::string& key, const std::string& v);
  void Strings(const std::string& key, const std::vector<std::string>& v);
  void I32s(const std::string& key, const std::vector<int32_t>& v);
  void F32s(const std::string& key, const std::vector<float>& v);
  // A value written as is: its type id and the bytes that follow it (for arrays of arrays and
  // for malformed files in tests).
  void Raw(const std::string& key, uint32_t type, const std::string& bytes);

  // A tensor: `ne` in ggml's order (ne[0] the row), its ggml type id and stored bytes.
  void Tensor(const std::string& name, const std::vector<int64_t>& ne, int type, std::string bytes);

  void set_alignment(uint32_t alignment) { alignment_ = alignment; }

  // The file's bytes: header, metadata (general.alignment added when not 32), tensor infos,
  // padding, data.
  std::string Bytes() const;
  absl::Status Write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    std::vector<int64_t> ne;
    int type;
    std::string bytes;
  };
  void Key(const std::string& key, uint32_t type);
  std::string metadata_;
  uint64_t kv_count_ = 0;
  uint32_t alignment_ = 32;
  std::vector<Entry> tensors_;
};

}  // namespace moe::runtime

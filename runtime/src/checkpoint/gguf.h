// GGUF, llama.cpp's single-file checkpoint: a header, typed metadata (key -> value), tensor infos
// (name, dimensions, ggml type, offset), then the tensors' data, each at a multiple of
// `general.alignment` (32 when absent) from the start of the data section. Little-endian; versions
// 2 and 3 (the same layout; 1 had 32-bit counts and is refused).
//
// GgufFile maps the file and reads the header, the metadata and the tensor infos only: the data is
// touched when a tensor is read. Everything a header claims is checked before anything is sized or
// read from it, and each error names the file, the byte offset and what is wrong: the magic, the
// version, a header or string or array cut off by the end of the file, a length beyond it, an
// unknown value type, arrays nested past 4 levels, a tensor name over 63 bytes or seen twice, a
// dimension count outside 1..4, a zero or overflowing dimension, an unknown ggml type, a row that
// is not whole blocks, an offset that is not aligned, tensors that overlap or end past the file.
//
// Thread-safety: immutable once opened.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/memory.h"

namespace moe::runtime::gguf {

enum class ValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
std::string_view ValueTypeName(ValueType t);

// One metadata value. Scalars: integers (and bool) in `i` (unsigned ones up to 2^63-1; u64 values
// above read as the error "out of range" where a number is asked for), floats in `f`, strings in
// `str`. Arrays: `elem` and, by element type, `ints`, `floats`, `strings` or `arrays` (nested).
struct Value {
  ValueType type = ValueType::kU8;
  uint64_t offset = 0;  // where the value starts in the file
  int64_t i = 0;
  bool u64_overflow = false;  // a u64 above INT64_MAX
  double f = 0;
  std::string str;
  ValueType elem = ValueType::kU8;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;
  std::vector<Value> arrays;

  bool is_integer() const;
  bool is_float() const { return type == ValueType::kF32 || type == ValueType::kF64; }
  // "u32", "array of string (151936)"
  std::string Describe() const;
  size_t size() const;  // an array's element count
};

// What llama.cpp calls a ggml type: a tensor's storage. `block_elements` values take `block_bytes`
// bytes along a row (1 and the element size for F32, F16, BF16).
struct GgmlType {
  int id = 0;
  const char* name = "";
  int block_elements = 1;
  int block_bytes = 0;
};
// Every type ggml defines (supported for compute or not), by id; null for an id that names none.
const GgmlType* FindGgmlType(int id);

struct TensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // ggml's order: ne[0] is the row (contiguous) dimension
  const GgmlType* type = nullptr;
  uint64_t offset = 0;  // from the start of the data section
  uint64_t bytes = 0;
  uint64_t info_offset = 0;  // where the tensor info starts in the file
  const uint8_t* data = nullptr;
};

class GgufFile {
 public:
  // Maps and checks `path`. kNotFound when it does not exist; kInvalidArgument (file, offset and
  // what) for anything malformed.
  static absl::StatusOr<GgufFile> Open(const std::string& path);
  // The same over bytes already in memory (the fuzz target and the tests); `name` is used in
  // messages. The bytes must outlive the object.
  static absl::StatusOr<GgufFile> Parse(const uint8_t* data, size_t size, const std::string& name);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  size_t size() const { return size_; }

  const std::map<std::string, Value>& metadata() const { return metadata_; }
  const Value* Find(std::string_view key) const;
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* FindTensor(std::string_view name) const;

  // Typed metadata reads. nullopt when the key is absent; kInvalidArgument naming the key, its
  // offset and both types when present with another type (any integer type is taken where an
  // integer is asked for, if the value fits; f32 and f64 where a float is).
  absl::StatusOr<std::optional<int64_t>> Int(std::string_view key) const;
  absl::StatusOr<std::optional<double>> Float(std::string_view key) const;
  absl::StatusOr<std::optional<bool>> Bool(std::string_view key) const;
  absl::StatusOr<std::optional<std::string>> String(std::string_view key) const;
  // An array of `elem`-kind values (strings, or integers of any type); nullopt when absent.
  absl::StatusOr<const std::vector<std::string>*> Strings(std::string_view key) const;
  absl::StatusOr<const std::vector<int64_t>*> Ints(std::string_view key) const;

  // "FILE: KEY at offset N: what"
  absl::Status KeyError(std::string_view key, const std::string& what) const;

 private:
  std::optional<core::MappedFile> file_;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, Value> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;

  absl::Status ParseAll();
};

}  // namespace moe::runtime::gguf

#include "checkpoint/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"

namespace moe::runtime::gguf {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read little-endian
constexpr int kMaxDims = 4;
constexpr size_t kMaxNameBytes = 63;  // ggml keeps 64 bytes with the terminating zero
constexpr int kMaxArrayDepth = 4;

// ggml's types: id, name, values per block, bytes per block (ggml.h and ggml-common.h).
constexpr GgmlType kTypes[] = {
    {0, "F32", 1, 4},         {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},      {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},      {7, "Q5_1", 32, 24},      {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},    {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},   {15, "Q8_K", 256, 292},   {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},   {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},   {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},         {25, "I16", 1, 2},
    {26, "I32", 1, 4},        {27, "I64", 1, 8},        {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},       {34, "TQ1_0", 256, 54},   {35, "TQ2_0", 256, 66},   {39, "MXFP4", 32, 17},
};

// Reads little-endian values from [data, data + size), each read checked against the end.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& name) : data_(data), size_(size), name_(name) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }

  absl::Status Error(uint64_t at, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": at offset ", at, ": ", what));
  }

  template <typename T>
  absl::StatusOr<T> Read(const char* what) {
    if (left() < sizeof(T)) {
      return Error(pos_, absl::StrCat(what, " (", sizeof(T), " bytes) is cut off by the end of the file (", size_,
                                      " bytes): the file is truncated"));
    }
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  absl::StatusOr<std::string> String(const char* what, uint64_t max_bytes = std::numeric_limits<uint64_t>::max()) {
    const uint64_t at = pos_;
    MOE_ASSIGN_OR_RETURN(const uint64_t n, Read<uint64_t>(what));
    if (n > left()) {
      return Error(at, absl::StrCat(what, " claims ", n, " bytes, past the end of the file (", left(), " left)"));
    }
    if (n > max_bytes) return Error(at, absl::StrCat(what, " is ", n, " bytes; at most ", max_bytes, " are allowed"));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const std::string& name_;
};

// The bytes one value of a fixed-size type takes; 0 for strings and arrays.
uint64_t FixedSize(ValueType t) {
  switch (t) {
    case ValueType::kU8:
    case ValueType::kI8:
    case ValueType::kBool:
      return 1;
    case ValueType::kU16:
    case ValueType::kI16:
      return 2;
    case ValueType::kU32:
    case ValueType::kI32:
    case ValueType::kF32:
      return 4;
    case ValueType::kU64:
    case ValueType::kI64:
    case ValueType::kF64:
      return 8;
    case ValueType::kString:
    case ValueType::kArray:
      return 0;
  }
  return 0;
}

bool KnownType(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::kF64); }

// Reads a scalar of fixed-size type `t` into `v` (i or f).
absl::Status ReadScalar(Reader& r, ValueType t, Value& v) {
  switch (t) {
    case ValueType::kU8: {
      MOE_ASSIGN_OR_RETURN(uint8_t x, r.Read<uint8_t>("a u8 value"));
      v.i = x;
      break;
    }
    case ValueType::kI8: {
      MOE_ASSIGN_OR_RETURN(int8_t x, r.Read<int8_t>("an i8 value"));
      v.i = x;
      break;
    }
    case ValueType::kU16: {
      MOE_ASSIGN_OR_RETURN(uint16_t x, r.Read<uint16_t>("a u16 value"));
      v.i = x;
      break;
    }
    case ValueType::kI16: {
      MOE_ASSIGN_OR_RETURN(int16_t x, r.Read<int16_t>("an i16 value"));
      v.i = x;
      break;
    }
    case ValueType::kU32: {
      MOE_ASSIGN_OR_RETURN(uint32_t x, r.Read<uint32_t>("a u32 value"));
      v.i = x;
      break;
    }
    case ValueType::kI32: {
      MOE_ASSIGN_OR_RETURN(int32_t x, r.Read<int32_t>("an i32 value"));
      v.i = x;
      break;
    }
    case ValueType::kU64: {
      MOE_ASSIGN_OR_RETURN(uint64_t x, r.Read<uint64_t>("a u64 value"));
      v.u64_overflow = x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
      v.i = v.u64_overflow ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(x);
      break;
    }
    case ValueType::kI64: {
      MOE_ASSIGN_OR_RETURN(int64_t x, r.Read<int64_t>("an i64 value"));
      v.i = x;
      break;
    }
    case ValueType::kF32: {
      MOE_ASSIGN_OR_RETURN(float x, r.Read<float>("an f32 value"));
      v.f = x;
      break;
    }
    case ValueType::kF64: {
      MOE_ASSIGN_OR_RETURN(double x, r.Read<double>("an f64 value"));
      v.f = x;
      break;
    }
    case ValueType::kBool: {
      const uint64_t at = r.pos();
      MOE_ASSIGN_OR_RETURN(uint8_t x, r.Read<uint8_t>("a bool value"));
      if (x > 1) return r.Error(at, absl::StrCat("a bool value is ", int{x}, ", not 0 or 1"));
      v.i = x;
      break;
    }
    case ValueType::kString:
    case ValueType::kArray:
      break;
  }
  return absl::OkStatus();
}

absl::Status ReadValue(Reader& r, ValueType t, Value& v, int depth);

absl::Status ReadArray(Reader& r, Value& v, int depth) {
  const uint64_t at = r.pos();
  if (depth >= kMaxArrayDepth) return r.Error(at, absl::StrCat("arrays are nested deeper than ", kMaxArrayDepth));
  MOE_ASSIGN_OR_RETURN(const uint32_t elem, r.Read<uint32_t>("an array's element type"));
  if (!KnownType(elem)) {
    return r.Error(at, absl::StrCat("unknown array element type ", elem, " (known: 0..12)"));
  }
  v.elem = static_cast<ValueType>(elem);
  MOE_ASSIGN_OR_RETURN(const uint64_t n, r.Read<uint64_t>("an array's length"));
  // Every element takes at least this many bytes: a length the file cannot hold is refused before
  // anything is reserved for it.
  const uint64_t min_bytes = v.elem == ValueType::kString  ? 8
                             : v.elem == ValueType::kArray ? 12
                                                           : FixedSize(v.elem);
  if (n > r.left() / min_bytes) {
    return r.Error(at, absl::StrCat("an array of ", n, " ", std::string(ValueTypeName(v.elem)),
                                    " values cannot fit in the ", r.left(), " bytes left in the file"));
  }
  for (uint64_t k = 0; k < n; ++k) {
    if (v.elem == ValueType::kString) {
      MOE_ASSIGN_OR_RETURN(std::string s, r.String("a string in an array"));
      v.strings.push_back(std::move(s));
    } else if (v.elem == ValueType::kArray) {
      Value item;
      MOE_RETURN_IF_ERROR(ReadValue(r, ValueType::kArray, item, depth + 1));
      v.arrays.push_back(std::move(item));
    } else {
      Value item;
      MOE_RETURN_IF_ERROR(ReadScalar(r, v.elem, item));
      if (v.elem == ValueType::kF32 || v.elem == ValueType::kF64) {
        v.floats.push_back(item.f);
      } else {
        v.ints.push_back(item.i);
        v.u64_overflow |= item.u64_overflow;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ReadValue(Reader& r, ValueType t, Value& v, int depth) {
  v.type = t;
  v.offset = r.pos();
  if (t == ValueType::kString) {
    MOE_ASSIGN_OR_RETURN(v.str, r.String("a string value"));
    return absl::OkStatus();
  }
  if (t == ValueType::kArray) return ReadArray(r, v, depth);
  return ReadScalar(r, t, v);
}

}  // namespace

std::string_view ValueTypeName(ValueType t) {
  switch (t) {
    case ValueType::kU8:
      return "u8";
    case ValueType::kI8:
      return "i8";
    case ValueType::kU16:
      return "u16";
    case ValueType::kI16:
      return "i16";
    case ValueType::kU32:
      return "u32";
    case ValueType::kI32:
      return "i32";
    case ValueType::kF32:
      return "f32";
    case ValueType::kBool:
      return "bool";
    case ValueType::kString:
      return "string";
    case ValueType::kArray:
      return "array";
    case ValueType::kU64:
      return "u64";
    case ValueType::kI64:
      return "i64";
    case ValueType::kF64:
      return "f64";
  }
  return "?";
}

bool Value::is_integer() const {
  return type != ValueType::kF32 && type != ValueType::kF64 && type != ValueType::kString &&
         type != ValueType::kArray && type != ValueType::kBool;
}

size_t Value::size() const { return ints.size() + floats.size() + strings.size() + arrays.size(); }

std::string Value::Describe() const {
  if (type != ValueType::kArray) return std::string(ValueTypeName(type));
  return absl::StrCat("array of ", std::string(ValueTypeName(elem)), " (", size(), ")");
}

const GgmlType* FindGgmlType(int id) {
  for (const GgmlType& t : kTypes) {
    if (t.id == id) return &t;
  }
  return nullptr;
}

absl::StatusOr<GgufFile> GgufFile::Open(const std::string& path) {
  MOE_ASSIGN_OR_RETURN(core::MappedFile mapped, core::MappedFile::Open(path));
  GgufFile f;
  f.file_.emplace(std::move(mapped));
  f.path_ = path;
  f.data_ = f.file_->data();
  f.size_ = f.file_->size();
  MOE_RETURN_IF_ERROR(f.ParseAll());
  return f;
}

absl::StatusOr<GgufFile> GgufFile::Parse(const uint8_t* data, size_t size, const std::string& name) {
  GgufFile f;
  f.path_ = name;
  f.data_ = data;
  f.size_ = size;
  MOE_RETURN_IF_ERROR(f.ParseAll());
  return f;
}

absl::Status GgufFile::ParseAll() {
  Reader r(data_, size_, path_);
  MOE_ASSIGN_OR_RETURN(const uint32_t magic, r.Read<uint32_t>("the magic"));
  if (magic != kMagic) {
    return r.Error(0, "not a GGUF file: it does not start with the magic \"GGUF\"");
  }
  MOE_ASSIGN_OR_RETURN(version_, r.Read<uint32_t>("the version"));
  if (version_ == 0x03000000 || version_ == 0x02000000) {
    return r.Error(4, "a big-endian GGUF file; only little-endian files are read");
  }
  if (version_ != 2 && version_ != 3) {
    return r.Error(4, absl::StrCat("GGUF version ", version_, " is not supported (versions 2 and 3 are)"));
  }
  const uint64_t counts_at = r.pos();
  MOE_ASSIGN_OR_RETURN(const uint64_t n_tensors, r.Read<uint64_t>("the tensor count"));
  MOE_ASSIGN_OR_RETURN(const uint64_t n_kv, r.Read<uint64_t>("the metadata count"));
  // A metadata pair takes at least 8 + 4 + 1 bytes and a tensor info 8 + 4 + 8 + 4 + 8.
  if (n_kv > r.left() / 13 || n_tensors > r.left() / 32) {
    return r.Error(counts_at, absl::StrCat(n_tensors, " tensors and ", n_kv,
                                           " metadata pairs cannot fit in the file (", size_, " bytes)"));
  }
  for (uint64_t k = 0; k < n_kv; ++k) {
    const uint64_t at = r.pos();
    MOE_ASSIGN_OR_RETURN(std::string key, r.String("a metadata key"));
    const uint64_t type_at = r.pos();
    MOE_ASSIGN_OR_RETURN(const uint32_t type, r.Read<uint32_t>("a metadata value type"));
    if (!KnownType(type)) {
      return r.Error(type_at, absl::StrCat("metadata key ", key, " has unknown value type ", type, " (known: 0..12)"));
    }
    Value v;
    MOE_RETURN_IF_ERROR(ReadValue(r, static_cast<ValueType>(type), v, 0));
    if (!metadata_.emplace(key, std::move(v)).second) {
      return r.Error(at, absl::StrCat("metadata key ", key, " appears twice"));
    }
  }
  if (const Value* a = Find("general.alignment"); a != nullptr) {
    if (a->type != ValueType::kU32) {
      return KeyError("general.alignment", absl::StrCat("is ", a->Describe(), ", expected u32"));
    }
    if (a->i == 0 || (a->i & (a->i - 1)) != 0) {
      return KeyError("general.alignment", absl::StrCat("is ", a->i, ", not a power of two"));
    }
    alignment_ = static_cast<uint64_t>(a->i);
  }
  for (uint64_t k = 0; k < n_tensors; ++k) {
    TensorInfo t;
    t.info_offset = r.pos();
    MOE_ASSIGN_OR_RETURN(t.name, r.String("a tensor name", kMaxNameBytes));
    const uint64_t dims_at = r.pos();
    MOE_ASSIGN_OR_RETURN(const uint32_t n_dims, r.Read<uint32_t>("a tensor's dimension count"));
    if (n_dims < 1 || n_dims > kMaxDims) {
      return r.Error(dims_at, absl::StrCat("tensor ", t.name, " has ", n_dims, " dimensions (1 to 4 are allowed)"));
    }
    uint64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t at = r.pos();
      MOE_ASSIGN_OR_RETURN(const uint64_t ne, r.Read<uint64_t>("a tensor dimension"));
      if (ne == 0 || ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(elements, ne, &elements)) {
        return r.Error(at, absl::StrCat("tensor ", t.name, ": dimension ", d, " is ", ne,
                                        ne == 0 ? " (empty)" : " (the element count overflows)"));
      }
      t.ne.push_back(static_cast<int64_t>(ne));
    }
    const uint64_t type_at = r.pos();
    MOE_ASSIGN_OR_RETURN(const uint32_t type, r.Read<uint32_t>("a tensor's type"));
    t.type = FindGgmlType(static_cast<int>(type));
    if (t.type == nullptr) return r.Error(type_at, absl::StrCat("tensor ", t.name, " has unknown ggml type ", type));
    if (t.ne[0] % t.type->block_elements != 0) {
      return r.Error(dims_at, absl::StrCat("tensor ", t.name, ": its rows of ", t.ne[0], " values are not whole ",
                                           t.type->name, " blocks of ", t.type->block_elements));
    }
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(t.ne[0]) / t.type->block_elements,
                               static_cast<uint64_t>(t.type->block_bytes), &bytes)) {
      return r.Error(dims_at, absl::StrCat("tensor ", t.name, ": its byte count overflows"));
    }
    for (size_t d = 1; d < t.ne.size(); ++d) {
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(t.ne[d]), &bytes)) {
        return r.Error(dims_at, absl::StrCat("tensor ", t.name, ": its byte count overflows"));
      }
    }
    t.bytes = bytes;
    const uint64_t offset_at = r.pos();
    MOE_ASSIGN_OR_RETURN(t.offset, r.Read<uint64_t>("a tensor's offset"));
    if (t.offset % alignment_ != 0) {
      return r.Error(offset_at, absl::StrCat("tensor ", t.name, ": offset ", t.offset,
                                             " is not a multiple of the alignment ", alignment_));
    }
    if (!tensor_index_.emplace(t.name, tensors_.size()).second) {
      return r.Error(t.info_offset, absl::StrCat("tensor ", t.name, " appears twice"));
    }
    tensors_.push_back(std::move(t));
  }
  // The data section starts at the next multiple of the alignment.
  const uint64_t end_of_infos = r.pos();
  data_offset_ = (end_of_infos + alignment_ - 1) / alignment_ * alignment_;
  const uint64_t data_bytes = data_offset_ <= size_ ? size_ - data_offset_ : 0;
  if (!tensors_.empty() && data_offset_ > size_) {
    return r.Error(end_of_infos, "the file ends before its data section");
  }
  // In offset order, each tensor must end before the next begins and inside the file.
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t k = 0; k < by_offset.size(); ++k) {
    const TensorInfo& t = *by_offset[k];
    if (t.offset > data_bytes || t.bytes > data_bytes - t.offset) {
      return r.Error(t.info_offset,
                     absl::StrCat("tensor ", t.name, " (", t.bytes, " bytes at data offset ", t.offset,
                                  ") ends past the end of the file (", data_bytes, " bytes of data): truncated?"));
    }
    if (k + 1 < by_offset.size() && t.offset + t.bytes > by_offset[k + 1]->offset) {
      return r.Error(by_offset[k + 1]->info_offset,
                     absl::StrCat("tensor ", by_offset[k + 1]->name, " at data offset ", by_offset[k + 1]->offset,
                                  " overlaps tensor ", t.name, " (", t.bytes, " bytes at ", t.offset, ")"));
    }
  }
  for (TensorInfo& t : tensors_) t.data = data_ + data_offset_ + t.offset;
  return absl::OkStatus();
}

const Value* GgufFile::Find(std::string_view key) const {
  auto it = metadata_.find(std::string(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

const TensorInfo* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status GgufFile::KeyError(std::string_view key, const std::string& what) const {
  const Value* v = Find(key);
  return absl::InvalidArgumentError(absl::StrCat(path_, ": metadata ", std::string(key),
                                                 v != nullptr ? absl::StrCat(" at offset ", v->offset) : "", ": ",
                                                 what));
}

absl::StatusOr<std::optional<int64_t>> GgufFile::Int(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return std::optional<int64_t>();
  if (!v->is_integer()) return KeyError(key, absl::StrCat("is ", v->Describe(), ", expected an integer"));
  if (v->u64_overflow) return KeyError(key, "is a u64 beyond 2^63");
  return std::optional<int64_t>(v->i);
}

absl::StatusOr<std::optional<double>> GgufFile::Float(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return std::optional<double>();
  if (!v->is_float()) return KeyError(key, absl::StrCat("is ", v->Describe(), ", expected f32 or f64"));
  return std::optional<double>(v->f);
}

absl::StatusOr<std::optional<bool>> GgufFile::Bool(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return std::optional<bool>();
  if (v->type != ValueType::kBool) return KeyError(key, absl::StrCat("is ", v->Describe(), ", expected bool"));
  return std::optional<bool>(v->i != 0);
}

absl::StatusOr<std::optional<std::string>> GgufFile::String(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return std::optional<std::string>();
  if (v->type != ValueType::kString) return KeyError(key, absl::StrCat("is ", v->Describe(), ", expected string"));
  return std::optional<std::string>(v->str);
}

absl::StatusOr<const std::vector<std::string>*> GgufFile::Strings(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return nullptr;
  if (v->type != ValueType::kArray || v->elem != ValueType::kString) {
    return KeyError(key, absl::StrCat("is ", v->Describe(), ", expected an array of string"));
  }
  return &v->strings;
}

absl::StatusOr<const std::vector<int64_t>*> GgufFile::Ints(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return nullptr;
  Value probe;
  probe.type = v->elem;
  if (v->type != ValueType::kArray || !probe.is_integer()) {
    return KeyError(key, absl::StrCat("is ", v->Describe(), ", expected an array of integers"));
  }
  if (v->u64_overflow) return KeyError(key, "holds a u64 beyond 2^63");
  return &v->ints;
}

}  // namespace moe::runtime::gguf

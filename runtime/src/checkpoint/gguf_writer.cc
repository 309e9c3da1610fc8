#include "moe/runtime/gguf_writer.h"

#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace moe::runtime {
namespace {

template <typename T>
void Put(std::string& out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out.append(buf, sizeof(T));
}

void PutString(std::string& out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  out += s;
}

enum : uint32_t { kU8, kI8, kU16, kI16, kU32, kI32, kF32, kBool, kString, kArray, kU64, kI64, kF64 };

}  // namespace

void GgufWriter::Key(const std::string& key, uint32_t type) {
  PutString(metadata_, key);
  Put<uint32_t>(metadata_, type);
  ++kv_count_;
}

void GgufWriter::U8(const std::string& key, uint8_t v) { Key(key, kU8), Put(metadata_, v); }
void GgufWriter::I8(const std::string& key, int8_t v) { Key(key, kI8), Put(metadata_, v); }
void GgufWriter::U16(const std::string& key, uint16_t v) { Key(key, kU16), Put(metadata_, v); }
void GgufWriter::I16(const std::string& key, int16_t v) { Key(key, kI16), Put(metadata_, v); }
void GgufWriter::U32(const std::string& key, uint32_t v) { Key(key, kU32), Put(metadata_, v); }
void GgufWriter::I32(const std::string& key, int32_t v) { Key(key, kI32), Put(metadata_, v); }
void GgufWriter::U64(const std::string& key, uint64_t v) { Key(key, kU64), Put(metadata_, v); }
void GgufWriter::I64(const std::string& key, int64_t v) { Key(key, kI64), Put(metadata_, v); }
void GgufWriter::F32(const std::string& key, float v) { Key(key, kF32), Put(metadata_, v); }
void GgufWriter::F64(const std::string& key, double v) { Key(key, kF64), Put(metadata_, v); }
void GgufWriter::Bool(const std::string& key, bool v) { Key(key, kBool), Put<uint8_t>(metadata_, v ? 1 : 0); }
void GgufWriter::String(const std::string& key, const std::string& v) { Key(key, kString), PutString(metadata_, v); }

void GgufWriter::Strings(const std::string& key, const std::vector<std::string>& v) {
  Key(key, kArray);
  Put<uint32_t>(metadata_, kString);
  Put<uint64_t>(metadata_, v.size());
  for (const std::string& s : v) PutString(metadata_, s);
}

void GgufWriter::I32s(const std::string& key, const std::vector<int32_t>& v) {
  Key(key, kArray);
  Put<uint32_t>(metadata_, kI32);
  Put<uint64_t>(metadata_, v.size());
  for (int32_t x : v) Put(metadata_, x);
}

void GgufWriter::F32s(const std::string& key, const std::vector<float>& v) {
  Key(key, kArray);
  Put<uint32_t>(metadata_, kF32);
  Put<uint64_t>(metadata_, v.size());
  for (float x : v) Put(metadata_, x);
}

void GgufWriter::Raw(const std::string& key, uint32_t type, const std::string& bytes) {
  Key(key, type);
  metadata_ += bytes;
}

void GgufWriter::Tensor(const std::string& name, const std::vector<int64_t>& ne, int type, std::string bytes) {
  tensors_.push_back({name, ne, type, std::move(bytes)});
}

std::string GgufWriter::Bytes() const {
  std::string out;
  Put<uint32_t>(out, 0x46554747);  // "GGUF"
  Put<uint32_t>(out, 3);
  Put<uint64_t>(out, tensors_.size());
  std::string metadata = metadata_;
  uint64_t kv = kv_count_;
  if (alignment_ != 32) {
    PutString(metadata, "general.alignment");
    Put<uint32_t>(metadata, kU32);
    Put<uint32_t>(metadata, alignment_);
    ++kv;
  }
  Put<uint64_t>(out, kv);
  out += metadata;
  uint64_t offset = 0;
  const auto align = [&](uint64_t x) { return (x + alignment_ - 1) / alignment_ * alignment_; };
  for (const Entry& t : tensors_) {
    PutString(out, t.name);
    Put<uint32_t>(out, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) Put<uint64_t>(out, static_cast<uint64_t>(d));
    Put<uint32_t>(out, static_cast<uint32_t>(t.type));
    Put<uint64_t>(out, offset);
    offset = align(offset + t.bytes.size());
  }
  out.resize(align(out.size()), '\0');
  for (const Entry& t : tensors_) {
    out += t.bytes;
    out.resize(out.size() + (align(t.bytes.size()) - t.bytes.size()), '\0');
  }
  return out;
}

absl::Status GgufWriter::Write(const std::string& path) const {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot be written"));
  const std::string bytes = Bytes();
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) return absl::InternalError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace moe::runtime

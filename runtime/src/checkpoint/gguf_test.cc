// The GGUF reader: every value type and nested arrays read back as written; every malformed file
// refused with the file, the byte offset and what is wrong, never a crash; every cut of a valid
// file refused.
#include "checkpoint/gguf.h"

#include <algorithm>
#include <cstring>

#include "gtest/gtest.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/gguf_writer.h"

namespace moe::runtime {
namespace {

using gguf::GgufFile;
using gguf::ValueType;

std::string U32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }
std::string U64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
std::string Str(const std::string& s) { return U64(s.size()) + s; }

absl::StatusOr<GgufFile> ParseBytes(const std::string& bytes) {
  return GgufFile::Parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "t.gguf");
}

// A small valid file: every value type, an array of arrays, two tensors (F32 and Q8_0).
GgufWriter ValidWriter() {
  GgufWriter w;
  w.U8("u8", 200);
  w.I8("i8", -100);
  w.U16("u16", 60000);
  w.I16("i16", -30000);
  w.U32("u32", 4000000000u);
  w.I32("i32", -2000000000);
  w.U64("u64", 1ull << 40);
  w.I64("i64", -(1ll << 40));
  w.F32("f32", 0.5f);
  w.F64("f64", 0.25);
  w.Bool("bool", true);
  w.String("general.architecture", "qwen3moe");
  w.Strings("strings", {"a", "", "ccc"});
  w.I32s("ints", {1, -2, 3});
  w.F32s("floats", {1.5f, -2.5f});
  // [[1, 2], [3]] as arrays of u8.
  std::string nested = U32(9) + U64(2) + U32(0) + U64(2) + "\x01\x02" + U32(0) + U64(1) + "\x03";
  w.Raw("nested", 9, nested);
  std::string f32(4 * 8, '\0');
  for (int i = 0; i < 8; ++i) {
    const float v = static_cast<float>(i);
    std::memcpy(&f32[4 * i], &v, 4);
  }
  w.Tensor("a.weight", {4, 2}, 0, f32);
  w.Tensor("b.weight", {32, 2}, 8, std::string(68, '\x01'));
  return w;
}

TEST(GgufReaderTest, ReadsEveryValueTypeNestedArraysAndTensors) {
  const std::string bytes = ValidWriter().Bytes();
  auto f = ParseBytes(bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(**f->Int("u8"), 200);
  EXPECT_EQ(**f->Int("i8"), -100);
  EXPECT_EQ(**f->Int("u16"), 60000);
  EXPECT_EQ(**f->Int("i16"), -30000);
  EXPECT_EQ(**f->Int("u32"), 4000000000ll);
  EXPECT_EQ(**f->Int("i32"), -2000000000);
  EXPECT_EQ(**f->Int("u64"), 1ll << 40);
  EXPECT_EQ(**f->Int("i64"), -(1ll << 40));
  EXPECT_EQ(**f->Float("f32"), 0.5);
  EXPECT_EQ(**f->Float("f64"), 0.25);
  EXPECT_TRUE(**f->Bool("bool"));
  EXPECT_EQ(**f->String("general.architecture"), "qwen3moe");
  EXPECT_EQ(**f->Strings("strings"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(**f->Ints("ints"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(f->Find("floats")->floats, (std::vector<double>{1.5, -2.5}));
  const gguf::Value* nested = f->Find("nested");
  ASSERT_NE(nested, nullptr);
  ASSERT_EQ(nested->arrays.size(), 2u);
  EXPECT_EQ(nested->arrays[0].ints, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(nested->arrays[1].ints, (std::vector<int64_t>{3}));
  EXPECT_FALSE(*f->Int("absent"));
  ASSERT_EQ(f->tensors().size(), 2u);
  const gguf::TensorInfo* a = f->FindTensor("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->ne, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(a->bytes, 32u);
  float v;
  std::memcpy(&v, a->data + 4 * 5, 4);
  EXPECT_EQ(v, 5.0f);
  const gguf::TensorInfo* b = f->FindTensor("b.weight");
  ASSERT_NE(b, nullptr);
  EXPECT_STREQ(b->type->name, "Q8_0");
  EXPECT_EQ(b->bytes, 68u);
  EXPECT_EQ(b->offset % 32, 0u);
  // A metadata key of the wrong type says so, with where.
  auto wrong = f->String("u32");
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("t.gguf: metadata u32 at offset"), std::string::npos) << wrong.status();
  EXPECT_NE(wrong.status().message().find("is u32, expected string"), std::string::npos) << wrong.status();
}

TEST(GgufReaderTest, HonoursAnotherAlignment) {
  GgufWriter w = ValidWriter();
  w.set_alignment(64);
  auto f = ParseBytes(w.Bytes());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->alignment(), 64u);
  EXPECT_EQ(f->data_offset() % 64, 0u);
  EXPECT_EQ(f->FindTensor("b.weight")->offset % 64, 0u);
}

// Every prefix of a valid file that cuts its header or data is refused (nothing reads past the
// end); only the padding after the last tensor may go.
TEST(GgufReaderTest, EveryTruncationIsRefused) {
  const std::string bytes = ValidWriter().Bytes();
  auto whole = ParseBytes(bytes);
  ASSERT_TRUE(whole.ok());
  uint64_t end = 0;
  for (const gguf::TensorInfo& t : whole->tensors()) end = std::max(end, whole->data_offset() + t.offset + t.bytes);
  ASSERT_LT(end, bytes.size());
  EXPECT_TRUE(ParseBytes(bytes.substr(0, end)).ok());
  for (size_t n = 0; n < end; ++n) {
    auto f = ParseBytes(bytes.substr(0, n));
    ASSERT_FALSE(f.ok()) << "a file cut to " << n << " of " << bytes.size() << " bytes was read";
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(f.status().message().rfind("t.gguf: at offset ", 0), 0u) << f.status();
  }
}

struct BadCase {
  const char* what;
  std::string bytes;
  const char* message;
};

std::string Header(uint64_t tensors, uint64_t kv, uint32_t version = 3) {
  return "GGUF" + U32(version) + U64(tensors) + U64(kv);
}
// One tensor info: name, dims, type, offset.
std::string Info(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
  std::string s = Str(name) + U32(static_cast<uint32_t>(ne.size()));
  for (uint64_t d : ne) s += U64(d);
  return s + U32(type) + U64(offset);
}
std::string Pad(std::string s) {
  s.resize((s.size() + 31) / 32 * 32, '\0');
  return s;
}

TEST(GgufReaderTest, EveryMalformedFileIsRefusedNamingWhat) {
  const std::vector<BadCase> cases = {
      {"wrong magic", "GGML" + U32(3) + U64(0) + U64(0), "at offset 0: not a GGUF file"},
      {"version 1", Header(0, 0, 1), "at offset 4: GGUF version 1 is not supported"},
      {"unknown version", Header(0, 0, 7), "GGUF version 7 is not supported"},
      {"big-endian", "GGUF" + U32(0x03000000) + U64(0) + U64(0), "big-endian"},
      {"counts beyond the file", Header(1ull << 40, 1ull << 40), "cannot fit in the file"},
      {"string length 2^60", Header(0, 1) + U64(1ull << 60) + "key" + std::string(16, '\0'),
       "claims 1152921504606846976 bytes"},
      {"array length 2^60", Header(0, 1) + Str("k") + U32(9) + U32(4) + U64(1ull << 60),
       "an array of 1152921504606846976 u32 values cannot fit"},
      {"unknown value type", Header(0, 1) + Str("k") + U32(13) + U64(0), "metadata key k has unknown value type 13"},
      {"unknown array element type", Header(0, 1) + Str("k") + U32(9) + U32(77) + U64(1),
       "unknown array element type 77"},
      {"bool not 0 or 1", Header(0, 1) + Str("k") + U32(7) + "\x05", "a bool value is 5"},
      {"duplicate key", Header(0, 2) + Str("k") + U32(0) + "\x01" + Str("k") + U32(0) + "\x02",
       "metadata key k appears twice"},
      {"alignment of the wrong type", Header(0, 1) + Str("general.alignment") + U32(8) + Str("32"),
       "general.alignment at offset"},
      {"alignment not a power of two", Header(0, 1) + Str("general.alignment") + U32(4) + U32(48),
       "is 48, not a power of two"},
      {"arrays nested too deep",
       Header(0, 1) + Str("k") + U32(9) + U32(9) + U64(1) + U32(9) + U64(1) + U32(9) + U64(1) + U32(9) + U64(1) +
           U32(0) + U64(0) + std::string(64, '\0'),
       "nested deeper than 4"},
      {"a tensor name over 63 bytes", Header(1, 0) + Info(std::string(64, 'n'), {32}, 0, 0), "at most 63 are allowed"},
      {"no dimensions", Header(1, 0) + Info("t", {}, 0, 0) + std::string(16, '\0'), "tensor t has 0 dimensions"},
      {"five dimensions", Header(1, 0) + Info("t", {1, 1, 1, 1, 1}, 0, 0), "tensor t has 5 dimensions"},
      {"a zero dimension", Header(1, 0) + Info("t", {0}, 0, 0), "dimension 0 is 0 (empty)"},
      {"dimensions that overflow", Header(1, 0) + Info("t", {1ull << 40, 1ull << 40}, 0, 0), "element count overflows"},
      {"an unknown ggml type", Header(1, 0) + Info("t", {32}, 250, 0), "tensor t has unknown ggml type 250"},
      {"a row that is not whole blocks", Header(1, 0) + Info("t", {40}, 8, 0), "not whole Q8_0 blocks of 32"},
      {"a misaligned offset", Header(1, 0) + Info("t", {8}, 0, 4), "offset 4 is not a multiple of the alignment 32"},
      {"a tensor past the end", Pad(Header(1, 0) + Info("t", {8}, 0, 0)) + std::string(16, '\0'),
       "tensor t (32 bytes at data offset 0) ends past the end of the file"},
      {"overlapping tensors",
       Pad(Header(2, 0) + Info("a", {16}, 0, 0) + Info("b", {8}, 0, 32)) + std::string(128, '\0'),
       "tensor b at data offset 32 overlaps tensor a (64 bytes at 0)"},
      {"a tensor twice", Pad(Header(2, 0) + Info("a", {8}, 0, 0) + Info("a", {8}, 0, 32)) + std::string(64, '\0'),
       "tensor a appears twice"},
  };
  for (const BadCase& c : cases) {
    auto f = ParseBytes(c.bytes);
    ASSERT_FALSE(f.ok()) << c.what << " was read";
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(f.status().message().find("t.gguf"), std::string::npos) << c.what << ": " << f.status();
    EXPECT_NE(f.status().message().find(c.message), std::string::npos) << c.what << ": " << f.status();
  }
}

TEST(GgufReaderTest, KnowsEveryTypeItNamesWithTheirBlockSizes) {
  EXPECT_EQ(gguf::FindGgmlType(12)->block_bytes, 144);  // Q4_K
  EXPECT_EQ(gguf::FindGgmlType(18)->block_bytes, 98);   // IQ3_XXS
  EXPECT_EQ(gguf::FindGgmlType(21)->block_bytes, 110);  // IQ3_S
  EXPECT_EQ(gguf::FindGgmlType(22)->block_bytes, 82);   // IQ2_S
  EXPECT_EQ(gguf::FindGgmlType(23)->block_bytes, 136);  // IQ4_XS
  EXPECT_EQ(gguf::FindGgmlType(14)->block_bytes, 210);  // Q6_K
  EXPECT_EQ(gguf::FindGgmlType(4), nullptr);            // removed from ggml
}

// A vocabulary whose token or merge is not UTF-8 (a byte-level BPE vocabulary is text) is refused
// naming it; one of a pre-tokenizer moeserve does not know names that (and --tokenizer).
TEST(GgufTokenizerTest, RefusesBrokenVocabulariesNamingWhat) {
  TokenizerSource s;
  s.model = "gpt2";
  s.pre = "qwen2";
  s.tokens = {"a", "b", "ab"};
  s.merges = {"a b"};
  EXPECT_TRUE(EmbeddedTokenizerJson(s).ok());
  s.tokens[1] = "\x9e";
  auto token = EmbeddedTokenizerJson(s);
  ASSERT_FALSE(token.ok());
  EXPECT_NE(token.status().message().find("tokenizer.ggml.tokens[1] is not valid UTF-8"), std::string::npos);
  s.tokens[1] = "b";
  s.merges[0] = "a \xc0\xaf";  // an overlong '/'
  auto merge = EmbeddedTokenizerJson(s);
  ASSERT_FALSE(merge.ok());
  EXPECT_NE(merge.status().message().find("tokenizer.ggml.merges[0] is not valid UTF-8"), std::string::npos);
  s.merges[0] = "a b";
  s.pre = "nope";
  auto pre = EmbeddedTokenizerJson(s);
  ASSERT_FALSE(pre.ok());
  EXPECT_NE(pre.status().message().find("tokenizer.ggml.pre 'nope'"), std::string::npos);
  s.pre = "qwen2";
  s.model = "llama";
  auto model = EmbeddedTokenizerJson(s);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("tokenizer.ggml.model 'llama' is not read yet"), std::string::npos);
}

}  // namespace
}  // namespace moe::runtime

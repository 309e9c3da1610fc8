// DequantizeRow against hand-worked blocks (each expected value computed here from the format's
// definition in ggml-common.h) and, where they exist, against llama.cpp's own dequantized floats.
#include "moe/experts/gguf_types.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe::experts {
namespace {

// fp16 bits of a few exact values.
constexpr uint16_t kHalfQuarter = 0x3400, kHalfHalf = 0x3800, kHalfOne = 0x3C00, kHalfTwo = 0x4000,
                   kHalfMinusOne = 0xBC00;

struct Block {
  std::vector<uint8_t> bytes;
  explicit Block(int type_id) : bytes(FindGgufType(type_id)->block_bytes, 0) {}
  void Half(int offset, uint16_t bits) { std::memcpy(&bytes[offset], &bits, 2); }
};

std::vector<float> Dequantize(int type_id, const Block& b) {
  const GgufType* t = FindGgufType(type_id);
  std::vector<float> y(t->block_elements);
  DequantizeRow(type_id, b.bytes.data(), t->block_elements, y.data());
  return y;
}

TEST(GgufTypesTest, TableHasTheRequiredTypesWithGgmlSizes) {
  struct Want {
    int id;
    const char* name;
    int64_t elements, bytes;
  };
  for (const Want& w : {Want{0, "F32", 1, 4}, {1, "F16", 1, 2}, {2, "Q4_0", 32, 18}, {6, "Q5_0", 32, 22},
                        {8, "Q8_0", 32, 34}, {12, "Q4_K", 256, 144}, {13, "Q5_K", 256, 176}, {14, "Q6_K", 256, 210},
                        {18, "IQ3_XXS", 256, 98}, {21, "IQ3_S", 256, 110}, {22, "IQ2_S", 256, 82},
                        {23, "IQ4_XS", 256, 136}, {30, "BF16", 1, 2}, {3, "Q4_1", 32, 20}, {7, "Q5_1", 32, 24},
                        {10, "Q2_K", 256, 84}, {11, "Q3_K", 256, 110}, {16, "IQ2_XXS", 256, 66},
                        {17, "IQ2_XS", 256, 74}, {19, "IQ1_S", 256, 50}, {20, "IQ4_NL", 32, 18},
                        {29, "IQ1_M", 256, 56}}) {
    const GgufType* t = FindGgufType(w.id);
    ASSERT_NE(t, nullptr) << w.name;
    EXPECT_STREQ(t->name, w.name);
    EXPECT_EQ(t->block_elements, w.elements) << w.name;
    EXPECT_EQ(t->block_bytes, w.bytes) << w.name;
  }
  EXPECT_EQ(FindGgufType(15), nullptr);   // Q8_K: activations only
  EXPECT_EQ(FindGgufType(139), nullptr);  // ik_llama.cpp's IQ4_K
  EXPECT_NE(SupportedGgufTypeNames().find("Q4_K, Q5_K, Q6_K"), std::string::npos) << SupportedGgufTypeNames();
}

TEST(GgufTypesTest, BadInputFillsNaN) {
  std::vector<uint8_t> src(64, 0);
  std::vector<float> y(3, 0.0f);
  DequantizeRow(12, src.data(), 3, y.data());  // 3 is not a multiple of 256
  EXPECT_TRUE(std::isnan(y[0]));
  DequantizeRow(15, src.data(), 3, y.data());
  EXPECT_TRUE(std::isnan(y[2]));
}

TEST(GgufTypesTest, FloatTypes) {
  const float f[3] = {1.5f, -0.0f, 3e-41f};
  std::vector<float> y(3);
  DequantizeRow(kGgufF32, f, 3, y.data());
  EXPECT_EQ(std::memcmp(f, y.data(), sizeof f), 0);
  const uint16_t h[3] = {0x3E00, 0x8000, 0x0001};  // 1.5, -0, the smallest subnormal 2^-24
  DequantizeRow(kGgufF16, h, 3, y.data());
  EXPECT_EQ(y[0], 1.5f);
  EXPECT_TRUE(std::signbit(y[1]));
  EXPECT_EQ(y[2], std::ldexp(1.0f, -24));
  const uint16_t b[2] = {0x3FC0, 0xC040};  // 1.5, -3
  DequantizeRow(kGgufBF16, b, 2, y.data());
  EXPECT_EQ(y[0], 1.5f);
  EXPECT_EQ(y[1], -3.0f);
}

TEST(GgufTypesTest, Q8_0) {
  Block b(kGgufQ8_0);  // {half d; int8 qs[32]}
  b.Half(0, kHalfQuarter);
  b.bytes[2 + 0] = 0x80;  // -128
  b.bytes[2 + 1] = 127;
  b.bytes[2 + 5] = static_cast<uint8_t>(-3);
  const auto y = Dequantize(kGgufQ8_0, b);
  EXPECT_EQ(y[0], -32.0f);
  EXPECT_EQ(y[1], 31.75f);
  EXPECT_EQ(y[5], -0.75f);
  EXPECT_EQ(y[2], 0.0f);
}

TEST(GgufTypesTest, Q4_0AndQ4_1) {
  Block b(kGgufQ4_0);  // {half d; u8 qs[16]}: value j low nibble, j + 16 high nibble, minus 8
  b.Half(0, kHalfTwo);
  b.bytes[2 + 0] = 0x1F;
  b.bytes[2 + 3] = 0x80;
  auto y = Dequantize(kGgufQ4_0, b);
  EXPECT_EQ(y[0], 14.0f);
  EXPECT_EQ(y[16], -14.0f);
  EXPECT_EQ(y[3], -16.0f);
  EXPECT_EQ(y[19], 0.0f);
  EXPECT_EQ(y[1], -16.0f);

  Block c(kGgufQ4_1);  // {half d, m; u8 qs[16]}: d * q + m
  c.Half(0, kHalfHalf);
  c.Half(2, kHalfMinusOne);
  c.bytes[4] = 0x2F;
  y = Dequantize(kGgufQ4_1, c);
  EXPECT_EQ(y[0], 6.5f);
  EXPECT_EQ(y[16], 0.0f);
  EXPECT_EQ(y[1], -1.0f);
}

TEST(GgufTypesTest, Q5_0AndQ5_1) {
  Block b(kGgufQ5_0);  // {half d; u8 qh[4]; u8 qs[16]}: bit j of qh is value j's fifth bit
  b.Half(0, kHalfOne);
  b.bytes[2] = 0x01;  // value 0
  b.bytes[4] = 0x01;  // bit 16: value 16
  b.bytes[6 + 0] = 0x32;
  auto y = Dequantize(kGgufQ5_0, b);
  EXPECT_EQ(y[0], 2.0f);    // (2 | 16) - 16
  EXPECT_EQ(y[16], 3.0f);   // (3 | 16) - 16
  EXPECT_EQ(y[1], -16.0f);  // 0 - 16
  EXPECT_EQ(y[17], -16.0f);

  Block c(kGgufQ5_1);  // {half d, m; u8 qh[4]; u8 qs[16]}
  c.Half(0, kHalfHalf);
  c.Half(2, kHalfOne);
  c.bytes[6] = 0x01;  // bit 16
  c.bytes[8] = 0x10;
  y = Dequantize(kGgufQ5_1, c);
  EXPECT_EQ(y[0], 1.0f);   // 0 * 0.5 + 1
  EXPECT_EQ(y[16], 9.5f);  // 17 * 0.5 + 1
}

TEST(GgufTypesTest, Q4_K) {
  // {half d, dmin; u8 scales[12]; u8 qs[128]}; sub-block j < 4: scale s[j] & 63, min s[j+4] & 63;
  // j >= 4: scale (s[j+4] & 15) | (s[j-4] >> 6) << 4, min (s[j+4] >> 4) | (s[j] >> 6) << 4.
  Block b(kGgufQ4_K);
  b.Half(0, kHalfOne);
  b.Half(2, kHalfHalf);
  uint8_t* s = &b.bytes[4];
  s[0] = 3 | (1 << 6);  // scale 0 = 3; two high bits of scale 4 = 1
  s[4] = 2;             // min 0 = 2
  s[8] = 0x51;          // scale 4 = 1 | 16 = 17, min 4 = 5
  uint8_t* qs = &b.bytes[16];
  qs[0] = 0x7A;
  qs[64] = 0x03;
  const auto y = Dequantize(kGgufQ4_K, b);
  EXPECT_EQ(y[0], 29.0f);     // 1 * 3 * 10 - 0.5 * 2
  EXPECT_EQ(y[1], -1.0f);     // 3 * 0 - 1
  EXPECT_EQ(y[32], 0.0f);     // sub-block 1 (high nibbles of qs[0..31]): scale 0, min 0
  EXPECT_EQ(y[128], 48.5f);   // sub-block 4 (low nibbles of qs[64..95]): 17 * 3 - 0.5 * 5
  EXPECT_EQ(y[129], -2.5f);
}

TEST(GgufTypesTest, Q5_K) {
  // Q4_K plus 16 where bit 2c (low nibbles) or 2c + 1 (high nibbles) of qh[l] is set, chunk c.
  Block b(kGgufQ5_K);
  b.Half(0, kHalfOne);
  b.Half(2, kHalfOne);
  uint8_t* s = &b.bytes[4];
  s[0] = 4;  // scale 0
  s[4] = 1;  // min 0
  s[1] = 2;  // scale 1
  s[5] = 3;  // min 1
  uint8_t* qh = &b.bytes[16];
  uint8_t* qs = &b.bytes[48];
  qh[0] = 0x01;
  qh[2] = 0x02;
  qs[0] = 0x05;
  const auto y = Dequantize(kGgufQ5_K, b);
  EXPECT_EQ(y[0], 83.0f);   // 4 * (5 + 16) - 1
  EXPECT_EQ(y[1], -1.0f);   // 4 * 0 - 1
  EXPECT_EQ(y[34], 29.0f);  // 2 * (0 + 16) - 3
  EXPECT_EQ(y[33], -3.0f);
}

TEST(GgufTypesTest, Q6_K) {
  // {u8 ql[128]; u8 qh[64]; int8 scales[16]; half d}: value l (< 32) of quarter i of half 0 is
  // (nibble of ql[l + 32 (i % 2)], low for i < 2) | ((qh[l] >> 2i) & 3) << 4, minus 32; the scale
  // of value v is d * scales[v / 16].
  Block b(kGgufQ6_K);
  b.Half(208, kHalfHalf);
  int8_t* sc = reinterpret_cast<int8_t*>(&b.bytes[192]);
  sc[0] = 2;
  sc[1] = -3;
  sc[2] = 4;
  sc[4] = 1;
  b.bytes[0] = 0x21;
  b.bytes[128] = 0x0D;  // qh[0]: i = 0 -> 1, i = 1 -> 3
  const auto y = Dequantize(kGgufQ6_K, b);
  EXPECT_EQ(y[0], -15.0f);   // (1 | 1 << 4) - 32 = -15, scale 0.5 * 2
  EXPECT_EQ(y[32], 32.0f);   // (0 | 3 << 4) - 32 = 16, scale 0.5 * 4
  EXPECT_EQ(y[64], -15.0f);  // (2 | 0) - 32 = -30, scale 0.5 * 1
  EXPECT_EQ(y[16], 48.0f);   // -32, scale 0.5 * -3
  EXPECT_EQ(y[128], -0.0f);  // scale 0
}

TEST(GgufTypesTest, IQ4_XS) {
  // {half d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}; ls = low nibble | 2 high bits << 4;
  // value = d * (ls - 32) * kvalues_iq4nl[nibble].
  Block b(kGgufIQ4_XS);
  b.Half(0, kHalfOne);
  b.bytes[2] = 0x02;  // scales_h: sub-block 0 high bits 2
  b.bytes[4] = 0x35;  // scales_l[0]: sub-block 0 low 5, sub-block 1 low 3
  b.bytes[8 + 0] = 0xF0;
  b.bytes[8 + 16] = 0x08;
  const auto y = Dequantize(kGgufIQ4_XS, b);
  EXPECT_EQ(y[0], -635.0f);   // (37 - 32) * -127
  EXPECT_EQ(y[16], 565.0f);   // 5 * 113
  EXPECT_EQ(y[32], -29.0f);   // (3 - 32) * 1
  EXPECT_EQ(y[48], 3683.0f);  // -29 * -127
}

TEST(GgufTypesTest, IQ4_NL) {
  Block b(kGgufIQ4_NL);  // {half d; u8 qs[16]} through kvalues_iq4nl
  b.Half(0, kHalfHalf);
  b.bytes[2] = 0x9F;
  const auto y = Dequantize(kGgufIQ4_NL, b);
  EXPECT_EQ(y[0], 56.5f);    // 0.5 * 113
  EXPECT_EQ(y[16], 6.5f);    // 0.5 * 13
  EXPECT_EQ(y[1], -63.5f);   // 0.5 * -127
}

TEST(GgufTypesTest, IQ3_XXS) {
  // {half d; u8 qs[96]}: grid indices qs[0..63]; per 32 values a u32 at qs[64 + 4 ib]: scale in
  // bits 28-31 (db = d * (0.5 + s) * 0.5), 7-bit sign indices into ksigns_iq2xs per 8 values.
  Block b(kGgufIQ3_XXS);
  b.Half(0, kHalfOne);
  b.bytes[2 + 0] = 0;  // iq3xxs_grid[0] = 0x04040404
  b.bytes[2 + 1] = 1;  // iq3xxs_grid[1] = 0x04040414
  const uint32_t aux = (3u << 28) | 1u;  // db = 1.75; signs of the first 8: ksigns[1] = 129
  std::memcpy(&b.bytes[66], &aux, 4);
  const auto y = Dequantize(kGgufIQ3_XXS, b);
  EXPECT_EQ(y[0], -7.0f);   // -1.75 * 4
  EXPECT_EQ(y[1], 7.0f);
  EXPECT_EQ(y[4], 35.0f);   // 1.75 * 0x14
  EXPECT_EQ(y[7], -7.0f);   // sign bit 7
  EXPECT_EQ(y[32], 1.0f);   // next sub-block: scale 0 (db = 0.25), grid 4, no signs
}

TEST(GgufTypesTest, IQ3_S) {
  // {half d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]}: index qs | ninth bit from qh;
  // db = d * (1 + 2 * nibble).
  Block b(kGgufIQ3_S);
  b.Half(0, kHalfOne);
  b.bytes[106] = 0x21;  // db = 3 for sub-block 0, 5 for sub-block 1
  b.bytes[66] = 0x01;   // qh[0] bit 0: index of values 0-3 is 256 (iq3s_grid[256] = 0x05090507)
  b.bytes[74] = 0x01;   // sign of value 0
  const auto y = Dequantize(kGgufIQ3_S, b);
  EXPECT_EQ(y[0], -21.0f);  // -3 * 7
  EXPECT_EQ(y[1], 15.0f);   // 3 * 5
  EXPECT_EQ(y[2], 27.0f);   // 3 * 9
  EXPECT_EQ(y[4], 3.0f);    // index 0: 0x01010101
  EXPECT_EQ(y[32], 5.0f);   // sub-block 1
}

TEST(GgufTypesTest, IQ2_S) {
  // {half d; u8 qs[64]; u8 qh[8]; u8 scales[8]}: index qs[l] | (qh[ib] << (8 - 2l)) & 0x300, signs
  // qs[32 + 4 ib + l]; db = d * (0.5 + nibble) * 0.25 per 16 values.
  Block b(kGgufIQ2_S);
  b.Half(0, kHalfTwo);
  b.bytes[2 + 0] = 0x01;
  b.bytes[66] = 0x01;        // index 0x101 = 0x0819081919192b08
  b.bytes[2 + 32] = 0x02;    // sign of value 1
  b.bytes[74] = 0x13;        // db = 2 * 3.5 * 0.25 = 1.75 for values 0-15, 2 * 1.5 * 0.25 = 0.75 for 16-31
  const auto y = Dequantize(kGgufIQ2_S, b);
  EXPECT_EQ(y[0], 14.0f);      // 1.75 * 8
  EXPECT_EQ(y[1], -75.25f);    // -1.75 * 43
  EXPECT_EQ(y[2], 43.75f);     // 1.75 * 25
  EXPECT_EQ(y[16], 6.0f);      // 0.75 * 8
}

TEST(GgufTypesTest, Q2_KAndQ3_K) {
  // Q2_K {u8 scales[16]; u8 qs[64]; half d, dmin}: value l of group 0 is bits 0-1 of qs[l];
  // d * (scales & 15) * q - dmin * (scales >> 4).
  Block b(kGgufQ2_K);
  b.Half(80, kHalfOne);
  b.Half(82, kHalfHalf);
  b.bytes[0] = 0x23;   // group 0: scale 3, min 2
  b.bytes[16] = 0x0E;  // qs[0]: group 0 -> 2, group 2 (shift 2) -> 3
  b.bytes[2] = 0x01;   // group 2: scale 1, min 0
  auto y = Dequantize(kGgufQ2_K, b);
  EXPECT_EQ(y[0], 5.0f);   // 3 * 2 - 0.5 * 2
  EXPECT_EQ(y[1], -1.0f);
  EXPECT_EQ(y[32], 3.0f);  // group 2 = values 32-47: 1 * 3

  // Q3_K {u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d}: (2 bits) - (hmask bit ? 0 : 4), times
  // d * (6-bit scale - 32).
  Block c(kGgufQ3_K);
  c.Half(108, kHalfOne);
  c.bytes[96] = 0x01;    // scale 0 low nibble 1; high bits from scales[8] bits 0-1
  c.bytes[104] = 0x02;   // scale 0 = 1 | 2 << 4 = 33 -> 1
  c.bytes[32] = 0x03;    // qs[0]: value 0 bits 3
  c.bytes[0] = 0x01;     // hmask[0] bit 0: value 0 keeps its 4
  y = Dequantize(kGgufQ3_K, c);
  EXPECT_EQ(y[0], 3.0f);
  EXPECT_EQ(y[1], -4.0f);  // 0 - 4
}

TEST(GgufTypesTest, IQ2_XXSAndIQ2_XS) {
  Block b(kGgufIQ2_XXS);  // per 32 values: 4 grid index bytes, a u32 of signs and scale
  b.Half(0, kHalfOne);
  b.bytes[2] = 1;  // iq2xxs_grid[1] = 0x080808080808082b
  const uint32_t aux = (1u << 28) | 1u;  // db = 1.5 * 0.25 = 0.375; ksigns[1] = 129
  std::memcpy(&b.bytes[6], &aux, 4);
  auto y = Dequantize(kGgufIQ2_XXS, b);
  EXPECT_EQ(y[0], -16.125f);  // -0.375 * 43
  EXPECT_EQ(y[1], 3.0f);      // 0.375 * 8
  EXPECT_EQ(y[7], -3.0f);

  Block c(kGgufIQ2_XS);  // u16 = 9-bit index | 7-bit sign index << 9; scale nibble per 16
  c.Half(0, kHalfOne);
  const uint16_t v = 1 | (1 << 9);
  std::memcpy(&c.bytes[2], &v, 2);
  c.bytes[66] = 0x01;  // db = 1.5 * 0.25 = 0.375 for values 0-15
  y = Dequantize(kGgufIQ2_XS, c);
  EXPECT_EQ(y[0], -16.125f);
  EXPECT_EQ(y[16], 1.0f);  // values 16-31: scale nibble 0, db 0.125; index 0: grid 8
}

// llama.cpp's own floats, committed under testdata/gguf/dequant/ (README.md there):
//   <TYPE>.blocks / <TYPE>.f32: blocks of every type (random, all 0xFF, all zero) and the floats
//     mainline ggml's dequantize_row_<type> gave for them (scripts/gguf/make_dequant_goldens.sh);
//   <TYPE>.bin (GGDQ): rows of real values (gaussian, an outlier, tiny, constant, +-65504, scaled
//     blocks) quantized by llama.cpp's ggml_quantize_chunk and dequantized by its to_float
//     (scripts/gguf/dequant_goldens.cpp), for the types of llama.cpp's usual mixes.
class GgufGoldenTest : public ::testing::TestWithParam<int> {};

std::vector<char> ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return {};
  return std::vector<char>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Counts the values of DequantizeRow(blocks) whose bits differ from `want` (NaN equal to NaN).
int64_t Mismatches(const GgufType& t, const char* blocks, const float* want, int64_t n, const std::string& what) {
  std::vector<float> y(n);
  DequantizeRow(t.id, blocks, n, y.data());
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t a, b;
    std::memcpy(&a, &y[i], 4);
    std::memcpy(&b, &want[i], 4);
    if (a != b && !(std::isnan(y[i]) && std::isnan(want[i]))) {
      if (++mismatches <= 5) ADD_FAILURE() << what << " value " << i << ": " << y[i] << ", llama.cpp " << want[i];
    }
  }
  return mismatches;
}

std::string DequantDir() {
  const char* env = std::getenv("MOE_TESTDATA_DIR");  // set when the tests run from a bundle
  return std::string(env != nullptr ? env : MOE_TESTDATA_DIR) + "/gguf/dequant/";
}

TEST_P(GgufGoldenTest, BitIdenticalToLlamaCpp) {
  const GgufType* t = FindGgufType(GetParam());
  ASSERT_NE(t, nullptr);
  const std::string dir = DequantDir();
  // Mainline ggml's, for every quantized type (F16 and BF16 have the .bin below only).
  const std::string blocks_path = dir + t->name + ".blocks", floats_path = dir + t->name + ".f32";
  const std::vector<char> blocks = ReadAll(blocks_path), floats = ReadAll(floats_path);
  const bool plain = t->block_elements == 1;
  if (!plain) ASSERT_FALSE(blocks.empty() || floats.empty()) << "no golden " << blocks_path << " / " << floats_path;
  if (!plain) {
    ASSERT_EQ(blocks.size() % t->block_bytes, 0u) << blocks_path;
    const int64_t n = static_cast<int64_t>(blocks.size()) / t->block_bytes * t->block_elements;
    ASSERT_EQ(floats.size(), n * sizeof(float)) << floats_path;
    std::vector<float> want(n);
    std::memcpy(want.data(), floats.data(), floats.size());
    EXPECT_EQ(Mismatches(*t, blocks.data(), want.data(), n, blocks_path), 0) << t->name;
  }

  // llama.cpp's quantizer and dequantizer on real values, where made for this type.
  const std::string bin_path = dir + t->name + ".bin";
  const std::vector<char> bin = ReadAll(bin_path);
  if (plain) ASSERT_FALSE(bin.empty()) << "no golden " << bin_path;
  if (bin.empty()) return;
  ASSERT_GE(bin.size(), 64u);
  ASSERT_EQ(std::memcmp(bin.data(), "GGDQ", 4), 0) << bin_path;
  uint32_t header[8];
  std::memcpy(header, bin.data() + 4, sizeof(header));  // version, type, rows, cols, block, block bytes, row bytes
  ASSERT_EQ(header[1], static_cast<uint32_t>(t->id)) << bin_path;
  const int64_t rows = header[2], cols = header[3], row_bytes = header[6];
  ASSERT_EQ(row_bytes, cols / t->block_elements * t->block_bytes) << bin_path;
  ASSERT_GE(bin.size(), 64 + rows * row_bytes + rows * cols * 4) << bin_path;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> row(cols);
    std::memcpy(row.data(), bin.data() + 64 + rows * row_bytes + r * cols * 4, cols * 4);
    EXPECT_EQ(Mismatches(*t, bin.data() + 64 + r * row_bytes, row.data(), cols, bin_path + " row " + std::to_string(r)),
              0)
        << t->name << " row " << r;
  }
}

std::vector<int> AllTypeIds() {
  std::vector<int> ids;
  for (const GgufType& t : SupportedGgufTypes()) {
    if (t.id != kGgufF32) ids.push_back(t.id);  // nothing to dequantize
  }
  return ids;
}

INSTANTIATE_TEST_SUITE_P(AllTypes, GgufGoldenTest, ::testing::ValuesIn(AllTypeIds()),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(FindGgufType(info.param)->name);
                         });

}  // namespace
}  // namespace moe::experts

// GGUF (llama.cpp) tensor types: their block sizes, and their values as floats.
//
// A GGUF tensor of type T stores each row of n values as n / block_elements blocks of
// block_bytes bytes (ggml's block_q4_K and friends, ggml/src/ggml-common.h). DequantizeRow gives
// the floats llama.cpp's dequantize_row_* gives for those blocks, bit for bit: every type's
// value is one float product (and for the types with a min, one sum) of exactly representable
// terms, computed in the order ggml computes them.
//
// Thread-safety: everything here is a pure function or a constant table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::experts {

// ggml type ids (ggml.h: enum ggml_type), as a GGUF tensor info stores them.
inline constexpr int kGgufF32 = 0;
inline constexpr int kGgufF16 = 1;
inline constexpr int kGgufQ4_0 = 2;
inline constexpr int kGgufQ4_1 = 3;
inline constexpr int kGgufQ5_0 = 6;
inline constexpr int kGgufQ5_1 = 7;
inline constexpr int kGgufQ8_0 = 8;
inline constexpr int kGgufQ2_K = 10;
inline constexpr int kGgufQ3_K = 11;
inline constexpr int kGgufQ4_K = 12;
inline constexpr int kGgufQ5_K = 13;
inline constexpr int kGgufQ6_K = 14;
inline constexpr int kGgufIQ2_XXS = 16;
inline constexpr int kGgufIQ2_XS = 17;
inline constexpr int kGgufIQ3_XXS = 18;
inline constexpr int kGgufIQ1_S = 19;
inline constexpr int kGgufIQ4_NL = 20;
inline constexpr int kGgufIQ3_S = 21;
inline constexpr int kGgufIQ2_S = 22;
inline constexpr int kGgufIQ4_XS = 23;
inline constexpr int kGgufIQ1_M = 29;
inline constexpr int kGgufBF16 = 30;

// One GGUF tensor type: a row of n values takes n / block_elements * block_bytes bytes.
struct GgufType {
  int id = 0;
  const char* name = "";       // as llama.cpp names it: "Q4_K", "IQ3_XXS", "F16"
  int64_t block_elements = 1;  // values per block (1 for F32, F16, BF16)
  int64_t block_bytes = 4;     // bytes per block
};

// The type with ggml id `id`, or null if moeserve does not read that type (an unknown id, a
// type of ik_llama.cpp only, or one not implemented here: Q8_1, Q8_K, TQ1_0, MXFP4, ...).
const GgufType* FindGgufType(int id);
// Every type FindGgufType knows, by id.
const std::vector<GgufType>& SupportedGgufTypes();
// "F32, F16, Q4_0, ...": for errors that name what is read ("types supported: ...").
std::string SupportedGgufTypeNames();
// Bytes of a row of n values of `type` (n a multiple of type.block_elements).
inline int64_t GgufRowBytes(const GgufType& type, int64_t n) { return n / type.block_elements * type.block_bytes; }

// dst[0..n) = the values of the n / block_elements blocks at `src` (unaligned is fine), as
// llama.cpp's dequantize_row_<type> (ggml/src/ggml-quants.c) computes them, bit for bit; F32,
// F16 and BF16 converted exactly. Preconditions (the caller checks them, e.g. the loader with
// FindGgufType and the tensor's shape): FindGgufType(type_id) != null and n a multiple of its
// block_elements; otherwise dst is filled with NaN.
void DequantizeRow(int type_id, const void* src, int64_t n, float* dst);

}  // namespace moe::experts

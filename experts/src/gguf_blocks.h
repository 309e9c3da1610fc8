// The blocks of GGUF's quantized types as integers and per-group scales, for the dequantizer
// and the kernels.
//
// Every quantized GGUF type (gguf_types.h) is, per block, value[i] = scale[g] * q[i] (+ offset[g]
// for the types with a min: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K), with q a small integer (int8) and
// g = i / group. The products are exact in fp32 for every type but Q6_K and IQ4_XS, whose one
// rounding is the one ggml makes, so scale * q (+ offset) is ggml's value bit for bit.
// The kernels add `bias` to q so that it is unsigned (vpdpbusd multiplies unsigned weights by
// signed activations) and subtract bias times the activations' group sums.
#pragma once

#include <cstdint>

namespace moe::experts::internal {

// The integer form of one GGUF block type.
struct GgufBlockCode {
  int id = -1;               // ggml type id
  int elements = 0;          // values per block
  int bytes = 0;             // bytes per block
  int group = 0;             // values per scale (16 or 32)
  int bias = 0;              // q + bias is in [0, 255]
  bool has_offset = false;   // a per-group offset (the min) beside the scale
};

// Null for F32, F16, BF16 and types not read.
const GgufBlockCode* FindGgufBlockCode(int type_id);

// One block: q[elements], scale[elements / group], and offset[elements / group] where the type
// has offsets (offset may be null otherwise). Scalar; the reference for the vector decoders.
void DecodeGgufBlock(int type_id, const uint8_t* block, int8_t* q, float* scale, float* offset);

// The tables of gguf_grids.inc (generated from ggml-common.h).
extern const uint8_t kGgufKmaskIq2xs[8];
extern const uint8_t kGgufKsignsIq2xs[128];
extern const int8_t kGgufKvaluesIq4nl[16];
extern const uint64_t kGgufIq2xxsGrid[256];
extern const uint64_t kGgufIq2xsGrid[512];
extern const uint64_t kGgufIq2sGrid[1024];
extern const uint32_t kGgufIq3xxsGrid[256];
extern const uint32_t kGgufIq3sGrid[512];
extern const uint64_t kGgufIq1sGrid[2048];

}  // namespace moe::experts::internal

// Writes testdata/gguf/dequant/<TYPE>.blocks and <TYPE>.f32 (experts/src/gguf_types_test.cc): 64 blocks
// per quantized type (the first all 0xFF bytes, the second all zero, the rest random; NaN and inf
// scales included) and the floats ggml's own dequantize_row_<type> gives for them.
// Build and run: scripts/gguf/make_dequant_goldens.sh GGML_SOURCE_DIR OUT_DIR
#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include "ggml-quants.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
typedef void (*deq)(const void*, float*, int64_t);
struct T { const char* name; int qk; int bytes; deq f; };
static uint64_t s = 88172645463325252ull;
static uint64_t rnd(void){ s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; }
int main(int argc, char** argv) {
  struct T ts[] = {
    {"Q4_0",32,18,(deq)dequantize_row_q4_0},{"Q4_1",32,20,(deq)dequantize_row_q4_1},{"Q5_0",32,22,(deq)dequantize_row_q5_0},
    {"Q5_1",32,24,(deq)dequantize_row_q5_1},{"Q8_0",32,34,(deq)dequantize_row_q8_0},{"Q2_K",256,84,(deq)dequantize_row_q2_K},
    {"Q3_K",256,110,(deq)dequantize_row_q3_K},{"Q4_K",256,144,(deq)dequantize_row_q4_K},{"Q5_K",256,176,(deq)dequantize_row_q5_K},
    {"Q6_K",256,210,(deq)dequantize_row_q6_K},{"IQ2_XXS",256,66,(deq)dequantize_row_iq2_xxs},{"IQ2_XS",256,74,(deq)dequantize_row_iq2_xs},
    {"IQ3_XXS",256,98,(deq)dequantize_row_iq3_xxs},{"IQ1_S",256,50,(deq)dequantize_row_iq1_s},{"IQ4_NL",32,18,(deq)dequantize_row_iq4_nl},
    {"IQ3_S",256,110,(deq)dequantize_row_iq3_s},{"IQ2_S",256,82,(deq)dequantize_row_iq2_s},{"IQ4_XS",256,136,(deq)dequantize_row_iq4_xs},
    {"IQ1_M",256,56,(deq)dequantize_row_iq1_m}};
  const int nblocks = 64;
  for (unsigned t = 0; t < sizeof ts / sizeof ts[0]; ++t) {
    uint8_t* b = malloc(nblocks * ts[t].bytes);
    for (int i = 0; i < nblocks * ts[t].bytes; ++i) b[i] = (uint8_t)rnd();
    // extremes: all 0xFF, all 0x00, half scales that are large, negative, subnormal, inf
    memset(b, 0xFF, ts[t].bytes);
    memset(b + ts[t].bytes, 0x00, ts[t].bytes);
    float* y = malloc(sizeof(float) * nblocks * ts[t].qk);
    ts[t].f(b, y, nblocks * ts[t].qk);
    char path[256];
    snprintf(path, sizeof path, "%s/%s.blocks", argv[1], ts[t].name);
    FILE* f = fopen(path, "wb"); fwrite(b, 1, nblocks * ts[t].bytes, f); fclose(f);
    snprintf(path, sizeof path, "%s/%s.f32", argv[1], ts[t].name);
    f = fopen(path, "wb"); fwrite(y, sizeof(float), nblocks * ts[t].qk, f); fclose(f);
  }
  return 0;
}

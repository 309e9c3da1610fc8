// The few ggml functions ggml-quants.c links against that the dequantizers never call.
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
void ggml_abort(const char* f, int l, const char* fmt, ...) { abort(); }
size_t ggml_row_size(int t, int64_t n) { abort(); }
const char* ggml_type_name(int t) { return "?"; }
size_t ggml_type_size(int t) { abort(); }

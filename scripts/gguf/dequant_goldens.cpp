// Dequantization goldens made by ggml itself, for checking an independent GGUF reader.
//
// For each ggml type below, quantizes ROWS x COLS floats (random gaussian rows and extreme rows)
// with ggml's own quantizer (ggml_quantize_chunk, with an importance vector for the IQ types),
// dequantizes the result with ggml's own to_float, and writes OUTDIR/<TYPE>.bin:
//
//   offset  size                 what
//   0       4                    magic "GGDQ"
//   4       4   u32              format version (1)
//   8       4   u32              ggml type id (enum ggml_type: F16=1, Q4_0=2, ..., BF16=30)
//   12      4   u32              rows
//   16      4   u32              cols (values per row)
//   20      4   u32              block size in values (ggml_blck_size)
//   24      4   u32              block size in bytes (ggml_type_size)
//   28      4   u32              bytes per row (ggml_row_size(type, cols))
//   32      4   u32              1 if an importance vector was used, else 0
//   36      16  char[16]         type name in upper case (F16, Q4_K, IQ3_XXS...), NUL-padded
//   52      12                   zero
//   64      rows*row_bytes       the quantized rows, exactly as ggml laid them out (as in a GGUF)
//   ...     rows*cols*4  f32     ggml's to_float of those rows (the golden)
//   ...     rows*cols*4  f32     the float32 input that was quantized
//   ...     cols*4       f32     the importance vector (present only if the flag is 1)
// All little-endian. The row kinds are listed in README.md and in OUTDIR/dequant.json.
//
//   dequant-goldens OUTDIR
#include "ggml.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>
#include <string>
#include <vector>

namespace {

constexpr int kRows = 8;
constexpr int kCols = 512;

const char* const kRowKinds[kRows] = {
    "gaussian sigma 1",
    "gaussian sigma 0.02 (weight-like)",
    "all zeros",
    "gaussian sigma 1 with one outlier of 1000 at column 77",
    "tiny: gaussian sigma 1e-6",
    "constant 0.75",
    "alternating +65504, -65504 (the largest finite f16)",
    "gaussian with each 32-value block scaled by 10^(k%7-3), k the block index",
};

// xorshift64* + Box-Muller: deterministic, no library dependence.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed ? seed : 1) {}
  uint64_t next() {
    s ^= s >> 12; s ^= s << 25; s ^= s >> 27;
    return s * 2685821657736338717ULL;
  }
  double uniform() { return ((next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double gauss() {
    double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

std::vector<float> make_rows() {
  std::vector<float> x(kRows * kCols);
  Rng rng(20261204);
  for (int r = 0; r < kRows; ++r) {
    float* row = &x[r * kCols];
    for (int c = 0; c < kCols; ++c) {
      double g = rng.gauss();
      double v = 0;
      switch (r) {
        case 0: v = g; break;
        case 1: v = 0.02 * g; break;
        case 2: v = 0; break;
        case 3: v = (c == 77) ? 1000.0 : g; break;
        case 4: v = 1e-6 * g; break;
        case 5: v = 0.75; break;
        case 6: v = (c % 2 == 0) ? 65504.0 : -65504.0; break;
        case 7: v = g * std::pow(10.0, (c / 32) % 7 - 3); break;
      }
      row[c] = (float)v;
    }
  }
  return x;
}

std::vector<float> make_imatrix() {
  // Positive and uneven, like the column sums of squared activations that llama-imatrix collects.
  std::vector<float> w(kCols);
  for (int c = 0; c < kCols; ++c) w[c] = 0.25f + (float)((c * 37) % 17) / 4.0f;
  return w;
}

struct TypeSpec { ggml_type type; const char* name; bool imatrix; };

const TypeSpec kTypes[] = {
    {GGML_TYPE_F16, "F16", false},     {GGML_TYPE_BF16, "BF16", false},
    {GGML_TYPE_Q8_0, "Q8_0", false},   {GGML_TYPE_Q4_0, "Q4_0", false},
    {GGML_TYPE_Q5_0, "Q5_0", false},   {GGML_TYPE_Q4_K, "Q4_K", false},
    {GGML_TYPE_Q5_K, "Q5_K", false},   {GGML_TYPE_Q6_K, "Q6_K", false},
    {GGML_TYPE_IQ4_XS, "IQ4_XS", true}, {GGML_TYPE_IQ3_XXS, "IQ3_XXS", true},
    {GGML_TYPE_IQ3_S, "IQ3_S", true},   {GGML_TYPE_IQ2_S, "IQ2_S", true},
};

void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back((uint8_t)(v >> (8 * i)));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
    return 2;
  }
  const std::string out = argv[1];
  {
    // ggml_init fills ggml's fp16 -> fp32 tables, which the to_float functions use.
    ggml_init_params ip = {0, nullptr, true};
    ggml_free(ggml_init(ip));
  }
  const std::vector<float> x = make_rows();
  const std::vector<float> imat = make_imatrix();

  std::string js = "{\n \"format\": \"see README.md: GGDQ v1\",\n \"rows\": " + std::to_string(kRows) +
                   ",\n \"cols\": " + std::to_string(kCols) + ",\n \"row_kinds\": [";
  for (int r = 0; r < kRows; ++r) js += std::string(r ? ", " : "") + "\"" + kRowKinds[r] + "\"";
  js += "],\n \"types\": [\n";

  int failures = 0;
  bool first = true;
  for (const TypeSpec& t : kTypes) {
    if (strcasecmp(ggml_type_name(t.type), t.name) != 0) {
      std::fprintf(stderr, "type %d is named %s in this ggml, expected %s\n", (int)t.type,
                   ggml_type_name(t.type), t.name);
      ++failures;
      continue;
    }
    const size_t row_bytes = ggml_row_size(t.type, kCols);
    std::vector<uint8_t> q(row_bytes * kRows, 0);
    const size_t n = ggml_quantize_chunk(t.type, x.data(), q.data(), 0, kRows, kCols,
                                         t.imatrix ? imat.data() : nullptr, nullptr);
    if (n != q.size()) {
      std::fprintf(stderr, "%s: ggml_quantize_chunk wrote %zu bytes, expected %zu\n", t.name, n, q.size());
      ++failures;
      continue;
    }
    ggml_type_traits_t tr = ggml_internal_get_type_traits(t.type);
    if (!tr.to_float) {
      std::fprintf(stderr, "%s: no to_float\n", t.name);
      ++failures;
      continue;
    }
    std::vector<float> y(kRows * kCols);
    for (int r = 0; r < kRows; ++r) tr.to_float(q.data() + r * row_bytes, &y[r * kCols], kCols);

    std::vector<uint8_t> b;
    b.insert(b.end(), {'G', 'G', 'D', 'Q'});
    put_u32(b, 1);
    put_u32(b, (uint32_t)t.type);
    put_u32(b, kRows);
    put_u32(b, kCols);
    put_u32(b, (uint32_t)ggml_blck_size(t.type));
    put_u32(b, (uint32_t)ggml_type_size(t.type));
    put_u32(b, (uint32_t)row_bytes);
    put_u32(b, t.imatrix ? 1 : 0);
    char name[16] = {0};
    std::strncpy(name, t.name, sizeof(name) - 1);
    b.insert(b.end(), name, name + 16);
    b.resize(64, 0);
    b.insert(b.end(), q.begin(), q.end());
    auto put_floats = [&b](const std::vector<float>& v) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(v.data());
      b.insert(b.end(), p, p + v.size() * sizeof(float));
    };
    put_floats(y);
    put_floats(x);
    if (t.imatrix) put_floats(imat);

    const std::string path = out + "/" + t.name + ".bin";
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(b.data(), 1, b.size(), f) != b.size() || std::fclose(f) != 0) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }

    // Per-row error summary (relative RMS error, non-finite count), for the README and a sanity check.
    js += std::string(first ? "" : ",\n") + "  {\"type\": \"" + t.name + "\", \"id\": " +
          std::to_string((int)t.type) + ", \"row_bytes\": " + std::to_string(row_bytes) +
          ", \"imatrix\": " + (t.imatrix ? "true" : "false") + ", \"rel_rms_err\": [";
    first = false;
    std::printf("%-8s id=%-3d row_bytes=%-5zu rel_rms_err:", t.name, (int)t.type, row_bytes);
    for (int r = 0; r < kRows; ++r) {
      double e2 = 0, x2 = 0;
      int nonfinite = 0;
      for (int c = 0; c < kCols; ++c) {
        const double a = x[r * kCols + c], d = y[r * kCols + c];
        if (!std::isfinite(d)) { ++nonfinite; continue; }
        e2 += (a - d) * (a - d);
        x2 += a * a;
      }
      const double rel = x2 > 0 ? std::sqrt(e2 / x2) : std::sqrt(e2 / kCols);
      char buf[64];
      if (nonfinite) std::snprintf(buf, sizeof(buf), "\"%d non-finite\"", nonfinite);
      else std::snprintf(buf, sizeof(buf), "%.3g", rel);
      js += std::string(r ? ", " : "") + buf;
      std::printf(" %s", buf);
    }
    js += "]}";
    std::printf("\n");
  }
  js += "\n ]\n}\n";
  FILE* f = std::fopen((out + "/dequant.json").c_str(), "w");
  if (f) { std::fputs(js.c_str(), f); std::fclose(f); }
  ggml_quantize_free();
  return failures ? 1 : 0;
}

#include "moe/experts/packed.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "moe/core/cpu_features.h"
#include "transpose_avx512.h"
#include "absl/strings/ascii.h"
#include "fp8_lines.h"
#include "gguf_blocks.h"
#include "moe/core/dtype.h"
#include "moe/experts/gguf_types.h"
#include "moe/experts/kernels.h"

namespace moe::experts {
namespace {

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Index of (n % 16, k) inside a block's int8 lines: line k / 4, byte (n % 16) * 4 + k % 4.
int64_t QuadIndex(int64_t r, int64_t k) { return (k / 4) * 64 + r * 4 + k % 4; }

}  // namespace

// The ggml type of each GGUF format, in the order of ExpertFormat from kQ4_0.
constexpr int kGgufFormatTypes[] = {kGgufQ4_0,    kGgufQ4_1,   kGgufQ5_0,    kGgufQ5_1,   kGgufQ8_0,
                                    kGgufQ2_K,    kGgufQ3_K,   kGgufQ4_K,    kGgufQ5_K,   kGgufQ6_K,
                                    kGgufIQ2_XXS, kGgufIQ2_XS, kGgufIQ2_S,   kGgufIQ3_XXS, kGgufIQ3_S,
                                    kGgufIQ1_S,   kGgufIQ1_M,  kGgufIQ4_NL,  kGgufIQ4_XS};

const std::vector<FormatDescriptor>& PackedFormats() {
  using S = FormatDescriptor::Scales;
  static const std::vector<FormatDescriptor> formats = [] {
    std::vector<FormatDescriptor> f = {
        {ExpertFormat::kBF16, "bf16", 16, S::kNone, true, 0, nullptr},
        {ExpertFormat::kInt8, "int8", 8, S::kPerRow, true, 128, nullptr},
        {ExpertFormat::kInt4, "int4", 4, S::kPerGroup, true, 8, nullptr},
    };
    // GGUF formats: the lower-case ggml name ("q4_k"); 8 bits as the kernels compute; a scale per
    // group (in the blocks), a min beside it for the types that have one, q + bias unsigned.
    static std::vector<std::string> names;
    names.reserve(std::size(kGgufFormatTypes));
    for (size_t i = 0; i < std::size(kGgufFormatTypes); ++i) {
      const int id = kGgufFormatTypes[i];
      const internal::GgufBlockCode& code = *internal::FindGgufBlockCode(id);
      names.push_back(absl::AsciiStrToLower(FindGgufType(id)->name));
      FormatDescriptor d;
      d.format = static_cast<ExpertFormat>(static_cast<int>(ExpertFormat::kQ4_0) + static_cast<int>(i));
      d.name = names.back().c_str();
      d.bits = 8;
      d.scales = S::kPerGroup;
      d.symmetric = !code.has_offset;
      d.offset = code.bias;
      d.gguf_type = id;
      f.push_back(d);
    }
    f.push_back({ExpertFormat::kFp8, "fp8", 8, S::kPerGroup, true, 0, nullptr});
    f.push_back({ExpertFormat::kNative, "native", 8, S::kNone, true, 0, nullptr});
    return f;
  }();
  return formats;
}

absl::StatusOr<ExpertFormat> FormatForGgufType(int type_id) {
  for (size_t i = 0; i < std::size(kGgufFormatTypes); ++i) {
    if (kGgufFormatTypes[i] == type_id) {
      return static_cast<ExpertFormat>(static_cast<int>(ExpertFormat::kQ4_0) + static_cast<int>(i));
    }
  }
  std::string names;
  for (int id : kGgufFormatTypes) absl::StrAppend(&names, names.empty() ? "" : ", ", FindGgufType(id)->name);
  const GgufType* t = FindGgufType(type_id);
  return absl::InvalidArgumentError(absl::StrCat("GGUF type ", t != nullptr ? std::string(t->name) : "", " (id ",
                                                 type_id, ") is not one the expert pool keeps; types supported: ",
                                                 names));
}

const FormatDescriptor& Describe(ExpertFormat f) { return PackedFormats()[static_cast<size_t>(f)]; }

const char* FormatName(ExpertFormat f) { return Describe(f).name; }

absl::StatusOr<ExpertFormat> ParseFormat(const std::string& name) {
  std::string names;
  const std::string lower = absl::AsciiStrToLower(name);
  for (const FormatDescriptor& d : PackedFormats()) {
    if (lower == d.name) return d.format;
    absl::StrAppend(&names, names.empty() ? "" : ", ", d.name);
  }
  return absl::InvalidArgumentError(absl::StrCat("expert format '", name, "' is not one of ", names));
}

int64_t MatrixLayout::scale_bytes() const {
  if (gguf_type >= 0) return 0;  // in the blocks
  switch (Describe(format).scales) {
    case FormatDescriptor::Scales::kNone:
      return 0;
    case FormatDescriptor::Scales::kPerRow:
      return RoundUp(n_pad * 4, 64);
    case FormatDescriptor::Scales::kPerGroup:
      return RoundUp(n_pad * groups() * 4, 64);
  }
  return 0;
}

absl::StatusOr<MatrixLayout> MakeLayout(ExpertFormat format, int64_t n, int64_t k, int group) {
  if (format == ExpertFormat::kNative) {
    return absl::InvalidArgumentError("'native' is a pool option, not a matrix layout");
  }
  if (IsGgufFormat(format)) {
    const FormatDescriptor& d = Describe(format);
    const internal::GgufBlockCode& code = *internal::FindGgufBlockCode(d.gguf_type);
    if (n <= 0 || k <= 0 || k % code.elements != 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad matrix shape [", n, ", ", k, "] for ", d.name,
                                                     " (rows of whole blocks of ", code.elements, " values)"));
    }
    MatrixLayout l;
    l.format = format;
    l.n = n;
    l.k = k;
    l.n_pad = RoundUp(n, 16);
    l.k_pad = RoundUp(k, 64);  // the activations' padding; the blocks cover k
    l.group = code.group;
    l.gguf_type = d.gguf_type;
    l.gguf_block_elements = code.elements;
    l.gguf_block_bytes = code.bytes;
    l.gguf_row_block_bytes = RoundUp(16 * (k / code.elements) * code.bytes, 64);
    return l;
  }
  if (group != 32 && group != 64 && group != 128) {
    return absl::InvalidArgumentError(absl::StrCat(FormatName(format), " group size ", group, " is not 32, 64 or 128"));
  }
  if (n <= 0 || k <= 0) return absl::InvalidArgumentError(absl::StrCat("bad matrix shape [", n, ", ", k, "]"));
  MatrixLayout l;
  l.format = format;
  l.n = n;
  l.k = k;
  l.group = group;
  l.n_pad = RoundUp(n, 16);
  l.k_pad =
      RoundUp(k, Describe(format).scales == FormatDescriptor::Scales::kPerGroup ? std::max<int64_t>(64, group) : 64);
  return l;
}

absl::Status PackMatrix(const core::TensorView& w, const MatrixLayout& l, uint8_t* out) {
  if (w.rank() != 2 || w.dim(0) != l.n || w.dim(1) != l.k) {
    return absl::InvalidArgumentError(absl::StrCat("expert matrix has shape ", core::ShapeString(w.shape),
                                                   ", expected [", l.n, ", ", l.k, "]"));
  }
  if (l.gguf_type >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("a ", core::DTypeName(w.dtype), " matrix cannot be packed as ",
                                                   FormatName(l.format), " (GGUF blocks are kept, not made)"));
  }
  const int64_t row_bytes = l.k * core::DTypeSize(w.dtype);
  if (w.dtype == core::DType::kBF16) {
    PackRowsBf16(
        l, [&](int64_t n) { return reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(w.data) + n * row_bytes); },
        out);
    return absl::OkStatus();
  }
  PackRows(
      l,
      [&](int64_t n, float* dst) {
        core::ConvertToFloat(static_cast<const uint8_t*>(w.data) + n * row_bytes, w.dtype, dst, l.k);
      },
      out);
  return absl::OkStatus();
}

namespace {

// One block's rows as floats: 16 rows of k_pad, zero beyond the matrix (padding rows included).
// The block packers below read it; they write every byte of the block and its scales.

// The plain packer, value by value.
void PackBlockPlain(const MatrixLayout& l, const float* tile, int64_t b, uint8_t* out) {
  uint8_t* block = out + b * l.block_bytes();
  for (int64_t r = 0; r < 16; ++r) {
    const float* row = tile + r * l.k_pad;
    const int64_t n = b * 16 + r;
    switch (l.format) {
      case ExpertFormat::kBF16: {
        auto* b16 = reinterpret_cast<uint16_t*>(block);
        for (int64_t k = 0; k < l.k_pad; ++k) b16[(k / 2) * 32 + r * 2 + k % 2] = core::FloatToBf16(row[k]);
        break;
      }
      case ExpertFormat::kInt8: {
        float amax = 0;
        for (int64_t k = 0; k < l.k_pad; ++k) amax = std::max(amax, std::abs(row[k]));
        const float scale = amax > 0 ? amax / 127.0f : 1.0f;
        // Padding rows keep a zero scale.
        reinterpret_cast<float*>(out + l.weight_bytes())[n] = n < l.n ? scale : 0.0f;
        for (int64_t k = 0; k < l.k_pad; ++k) {
          const int q = static_cast<int>(std::lrint(std::clamp(row[k] / scale, -127.0f, 127.0f)));
          block[QuadIndex(r, k)] = static_cast<uint8_t>(q + 128);
        }
        break;
      }
      case ExpertFormat::kInt4: {
        float* scales = reinterpret_cast<float*>(out + l.weight_bytes());
        for (int64_t g = 0; g < l.groups(); ++g) {
          float amax = 0;
          for (int64_t k = g * l.group; k < (g + 1) * l.group; ++k) amax = std::max(amax, std::abs(row[k]));
          const float scale = amax > 0 ? amax / 7.0f : 1.0f;
          scales[(b * l.groups() + g) * 16 + r] = scale;
          for (int64_t k = g * l.group; k < (g + 1) * l.group; ++k) {
            const int q = static_cast<int>(std::lrint(std::clamp(row[k] / scale, -8.0f, 7.0f)));
            const int64_t i = QuadIndex(r, k);  // position among the 64 values of line k / 4
            uint8_t& byte = block[(i / 64) * 32 + (i % 64) % 32];
            const uint8_t nibble = static_cast<uint8_t>(q + 8);
            byte = (i % 64) < 32 ? static_cast<uint8_t>((byte & 0xF0) | nibble)
                                 : static_cast<uint8_t>((byte & 0x0F) | (nibble << 4));
          }
        }
        break;
      }
      case ExpertFormat::kFp8: {
        float* scales = reinterpret_cast<float*>(out + l.weight_bytes());
        for (int64_t g = 0; g < l.groups(); ++g) {
          float amax = 0;
          for (int64_t k = g * l.group; k < (g + 1) * l.group; ++k) amax = std::max(amax, std::abs(row[k]));
          const float scale = amax > 0 ? amax / core::kF8E4M3Max : 1.0f;
          scales[(b * l.groups() + g) * 16 + r] = scale;
          for (int64_t k = g * l.group; k < (g + 1) * l.group; ++k) {
            block[internal::Fp8Index(r, k)] = core::FloatToF8E4M3(row[k] / scale);
          }
        }
        break;
      }
      default:  // GGUF formats keep their blocks (PackGgufRows)
        break;
    }
  }
}

#define MOE_PACK_AVX512 __attribute__((target("avx512f,avx512bw")))

// GCC 12 warns about the undefined pass-through operand inside its own AVX-512 intrinsics.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif


// bf16 of 16 floats as FloatToBf16 rounds them (to nearest even; NaN kept quiet), in the low
// halves of 16 dwords.
MOE_PACK_AVX512 inline __m512i Bf16Bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_mov_epi32(rounded, nan, quiet);
}

// q = lrint(clamp(x / scale, lo, hi)) + offset, as the plain packer computes it.
MOE_PACK_AVX512 inline __m512i Quantize(__m512 x, __m512 scale, float lo, float hi, int offset) {
  const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x, scale), _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
  return _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(offset));  // to nearest even
}

// The rows of a block for PackBlockIntAvx512, 16 floats at a time: from a float tile (16 rows of
// k_pad, zero padded) ...
struct FloatTile {
  const float* tile;
  int64_t ld;
  MOE_PACK_AVX512 __m512 Load(int r, int64_t k) const { return _mm512_loadu_ps(tile + r * ld + k); }
  void Prefetch(int r, int64_t k) const {}
};

// ... or from bf16 rows as stored (row[r]: k values, or null for a row of zeros), converted in
// registers: the same floats, without a tile of them. Prefetch(r, k) brings the line of the next
// block's row r at k into L2 (next: that block's rows, or null): each row is read once, as the
// block's scales are found, and the L2's own prefetcher stops at the end of each 4 KB page.
struct Bf16Rows {
  const uint16_t* const* row;
  int64_t k;
  const uint16_t* const* next;
  void Prefetch(int r, int64_t k0) const {
    if (next != nullptr && next[r] != nullptr && k0 % 32 == 0 && k0 < k) _mm_prefetch(next[r] + k0, _MM_HINT_T1);
  }
  MOE_PACK_AVX512 __m512 Load(int r, int64_t k0) const {
    const int64_t left = k - k0;
    if (row[r] == nullptr || left <= 0) return _mm512_setzero_ps();
    const __mmask32 mask = left >= 16 ? __mmask32(0xFFFF) : static_cast<__mmask32>((1u << left) - 1);
    const __m512i bits = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(mask, row[r] + k0)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  }
};

// int8 and int4 block b from the rows of `src`: the same bytes as PackBlockPlain from the same
// floats. The absolute maxima are taken as AbsMaxAvx512 takes them (16 lanes, then reduced).
template <typename Src>
MOE_PACK_AVX512 void PackBlockIntAvx512(const MatrixLayout& l, const Src& src, int64_t b, uint8_t* out) {
  uint8_t* block = out + b * l.block_bytes();
  float* scales = reinterpret_cast<float*>(out + l.weight_bytes());
  __m512i v[16];
  // int8 and int4: the scales first (per row; per row and group).
  const bool int8 = l.format == ExpertFormat::kInt8;
  const int64_t groups = int8 ? 1 : l.groups(), group = int8 ? l.k_pad : l.group;
  alignas(64) float row_scale[16 * 64];  // [row][group], on the heap past 64 groups
  std::vector<float> many;
  float* rs = row_scale;
  if (16 * groups > 16 * 64) {
    many.resize(16 * groups);
    rs = many.data();
  }
  for (int r = 0; r < 16; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      __m512 m = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
        src.Prefetch(r, k);
        m = _mm512_max_ps(m, _mm512_abs_ps(src.Load(r, k)));
      }
      const float amax = _mm512_reduce_max_ps(m);
      const float scale = amax > 0 ? amax / (int8 ? 127.0f : 7.0f) : 1.0f;
      rs[r * groups + g] = scale;
      if (int8) {
        scales[b * 16 + r] = b * 16 + r < l.n ? scale : 0.0f;  // padding rows keep a zero scale
      } else {
        scales[(b * groups + g) * 16 + r] = scale;
      }
    }
  }
  const float lo = int8 ? -127.0f : -8.0f, hi = int8 ? 127.0f : 7.0f;
  const int offset = int8 ? 128 : 8;
  for (int64_t k0 = 0; k0 < l.k_pad; k0 += 64) {  // 16 lines of quads
    for (int r = 0; r < 16; ++r) {
      __m512i q[4];
      for (int c = 0; c < 4; ++c) {
        const __m512 scale = _mm512_set1_ps(rs[r * groups + (k0 + c * 16) / group]);
        q[c] = Quantize(src.Load(r, k0 + c * 16), scale, lo, hi, offset);
      }
      // 64 values 0..255 to bytes, in order: dword i = the quad k0 + 4i .. 4i + 3.
      const __m512i w01 = _mm512_packus_epi32(q[0], q[1]), w23 = _mm512_packus_epi32(q[2], q[3]);
      const __m512i bytes = _mm512_packus_epi16(w01, w23);
      // The packs work per 128-bit lane: lane l holds dwords (q0 l, q1 l, q2 l, q3 l) of 4 values
      // each; put them back in order.
      v[r] = _mm512_permutexvar_epi32(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), bytes);
    }
    internal::Transpose16x16(v);
    for (int j = 0; j < 16; ++j) {
      const int64_t line = k0 / 4 + j;
      if (int8) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(block + line * 64), v[j]);
      } else {
        // Value i in the low nibble of byte i, value i + 32 in the high nibble.
        const __m256i low = _mm512_castsi512_si256(v[j]), high = _mm512_extracti64x4_epi64(v[j], 1);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(block + line * 32),
                           _mm256_or_si256(low, _mm256_slli_epi16(high, 4)));
      }
    }
  }
}

// The same bytes as PackBlockPlain: each row's values become one dword per 64-byte line (a k
// pair in bf16, a k quad in int8 and int4), and a 16 x 16 transpose turns 16 rows' dwords into
// 16 lines. The lines go to memory with streaming stores: an arena is written once at load and
// read much later, and plain stores would first read every line in (on the 32-core machine a
// bf16 load from the page cache went from 33-38 to 39-41 GB/s, int8 from 36-41 to 41-43). The
// caller fences them.
MOE_PACK_AVX512 void PackBlockAvx512(const MatrixLayout& l, const float* tile, int64_t b, uint8_t* out) {
  if (l.format == ExpertFormat::kBF16) {
    uint8_t* block = out + b * l.block_bytes();
    __m512i v[16];
    for (int64_t k0 = 0; k0 < l.k_pad; k0 += 32) {  // 16 lines
      for (int r = 0; r < 16; ++r) {
        const float* x = tile + r * l.k_pad + k0;
        const __m512i even_odd_lo = Bf16Bits(_mm512_loadu_ps(x)), even_odd_hi = Bf16Bits(_mm512_loadu_ps(x + 16));
        // Dword i = bf16(x[2i]) | bf16(x[2i + 1]) << 16.
        v[r] =
            _mm512_permutex2var_epi16(even_odd_lo,
                                      _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                                       30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0),
                                      even_odd_hi);
      }
      internal::Transpose16x16(v);
      for (int j = 0; j < 16; ++j) _mm512_stream_si512(reinterpret_cast<__m512i*>(block + (k0 / 2 + j) * 64), v[j]);
    }
    return;
  }
  PackBlockIntAvx512(l, FloatTile{tile, l.k_pad}, b, out);
}

// bf16 rows as stored (row[r]: l.k values, or null for a zero row) into bf16 block b: the same
// bytes as PackBlockAvx512 from their float values, without the floats. A bf16 value is its own
// rounding, except that NaN comes out quiet, as FloatToBf16 makes it.
MOE_PACK_AVX512 void PackBlockBf16Bits(const MatrixLayout& l, const uint16_t* const row[16], int64_t b, uint8_t* out) {
  uint8_t* block = out + b * l.block_bytes();
  __m512i v[16];
  for (int64_t k0 = 0; k0 < l.k_pad; k0 += 32) {  // 16 lines
    const int64_t left = l.k - k0;
    const __mmask32 mask = left >= 32 ? ~__mmask32{0} : left <= 0 ? __mmask32{0} : (__mmask32{1} << left) - 1;
    for (int r = 0; r < 16; ++r) {
      if (row[r] == nullptr || mask == 0) {
        v[r] = _mm512_setzero_si512();
        continue;
      }
      const __m512i x = _mm512_maskz_loadu_epi16(mask, row[r] + k0);
      const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(x, _mm512_set1_epi16(0x7fff)),
                                                   _mm512_set1_epi16(0x7f80));
      v[r] = _mm512_or_si512(x, _mm512_maskz_mov_epi16(nan, _mm512_set1_epi16(0x40)));
    }
    internal::Transpose16x16(v);
    for (int j = 0; j < 16; ++j) _mm512_stream_si512(reinterpret_cast<__m512i*>(block + (k0 / 2 + j) * 64), v[j]);
  }
}

#pragma GCC diagnostic pop

}  // namespace

namespace internal {

void PackRowsWith(const MatrixLayout& l, const std::function<void(int64_t n, float* dst)>& source, uint8_t* out,
                  bool vector) {
  const core::CpuFeatures& cpu = core::GetCpuFeatures();
  vector = vector && cpu.avx512f && cpu.avx512bw && l.format != ExpertFormat::kFp8;  // fp8: the plain packer
  // Every weight byte is written below; the scales' tail (to 64 bytes) is not.
  std::memset(out + l.weight_bytes(), 0, l.scale_bytes());
  std::vector<float> tile(16 * l.k_pad, 0.0f);  // the padding columns stay zero
  for (int64_t b = 0; b < l.blocks(); ++b) {
    for (int64_t r = 0; r < 16; ++r) {
      float* row = tile.data() + r * l.k_pad;
      if (b * 16 + r < l.n) {
        source(b * 16 + r, row);
      } else {
        std::fill(row, row + l.k_pad, 0.0f);  // padding rows (the last block's)
      }
    }
    if (vector) {
      PackBlockAvx512(l, tile.data(), b, out);
    } else {
      PackBlockPlain(l, tile.data(), b, out);
    }
  }
  _mm_sfence();  // the streaming stores, before the matrix is handed on
}

}  // namespace internal

void PackRows(const MatrixLayout& l, const std::function<void(int64_t n, float* dst)>& source, uint8_t* out) {
  internal::PackRowsWith(l, source, out, /*vector=*/true);
}

void PackRowsBf16(const MatrixLayout& l, const std::function<const uint16_t*(int64_t n)>& source, uint8_t* out) {
  const core::CpuFeatures& cpu = core::GetCpuFeatures();
  if (!cpu.avx512f || !cpu.avx512bw || l.format == ExpertFormat::kFp8) {
    PackRows(
        l,
        [&](int64_t n, float* dst) {
          const uint16_t* bits = source(n);
          if (bits == nullptr) {
            std::fill(dst, dst + l.k, 0.0f);
          } else {
            core::ConvertToFloat(bits, core::DType::kBF16, dst, l.k);
          }
        },
        out);
    return;
  }
  // As PackRowsWith: every weight byte is written below; the scales' tail (to 64 bytes) is not.
  std::memset(out + l.weight_bytes(), 0, l.scale_bytes());
  const uint16_t* rows[2][16];  // this block's and the next one's
  auto block_rows = [&](int64_t b, const uint16_t** r) {
    for (int64_t i = 0; i < 16; ++i) r[i] = b * 16 + i < l.n ? source(b * 16 + i) : nullptr;
  };
  block_rows(0, rows[0]);
  for (int64_t b = 0; b < l.blocks(); ++b) {
    const uint16_t** cur = rows[b % 2];
    const uint16_t** next = b + 1 < l.blocks() ? rows[(b + 1) % 2] : nullptr;
    if (next != nullptr) block_rows(b + 1, next);
    if (l.format == ExpertFormat::kBF16) {
      PackBlockBf16Bits(l, cur, b, out);
    } else {
      PackBlockIntAvx512(l, Bf16Rows{cur, l.k, next}, b, out);
    }
  }
  _mm_sfence();  // as PackRowsWith
}

void PackFp8Rows(const MatrixLayout& l, const std::function<const uint8_t*(int64_t n)>& codes,
                 const std::function<float(int64_t n, int64_t g)>& scale, uint8_t* out) {
  std::memset(out, 0, l.bytes());
  float* scales = reinterpret_cast<float*>(out + l.weight_bytes());
  for (int64_t b = 0; b < l.blocks(); ++b) {
    uint8_t* block = out + b * l.block_bytes();
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t n = b * 16 + r;
      const uint8_t* src = n < l.n ? codes(n) : nullptr;
      if (src == nullptr) continue;  // zeros, with zero scales
      for (int64_t k = 0; k < l.k; ++k) block[internal::Fp8Index(r, k)] = src[k];
      for (int64_t g = 0; g < l.groups(); ++g) scales[(b * l.groups() + g) * 16 + r] = scale(n, g);
    }
  }
}

void PackGgufRows(const MatrixLayout& l, const std::function<const uint8_t*(int64_t n)>& row, uint8_t* out) {
  const int64_t chunks = l.k / l.gguf_block_elements, bb = l.gguf_block_bytes;
  for (int64_t b = 0; b < l.blocks(); ++b) {
    uint8_t* block = out + b * l.block_bytes();
    for (int64_t r = 0; r < 16; ++r) {
      const uint8_t* src = b * 16 + r < l.n ? row(b * 16 + r) : nullptr;
      for (int64_t c = 0; c < chunks; ++c) {
        uint8_t* dst = block + (c * 16 + r) * bb;
        if (src == nullptr) {
          std::memset(dst, 0, bb);
        } else {
          std::memcpy(dst, src + c * bb, bb);
        }
      }
    }
    const int64_t used = 16 * chunks * bb;
    std::memset(block + used, 0, l.block_bytes() - used);
  }
}

void PackBlockRows(const MatrixLayout& l, const void* rows, uint8_t* out) {
  const int64_t row_bytes = l.k / l.gguf_block_elements * l.gguf_block_bytes;
  PackGgufRows(l, [&](int64_t n) { return static_cast<const uint8_t*>(rows) + n * row_bytes; }, out);
}

float UnpackValue(const PackedMatrix& m, int64_t n, int64_t k) {
  const MatrixLayout& l = m.layout;
  if (l.gguf_type >= 0) {
    if (n >= l.n_pad || k >= l.k) return 0.0f;
    const int64_t c = k / l.gguf_block_elements;
    const uint8_t* blk = m.block(n / 16) + (c * 16 + n % 16) * l.gguf_block_bytes;
    float values[256];
    DequantizeRow(l.gguf_type, blk, l.gguf_block_elements, values);
    return values[k % l.gguf_block_elements];
  }
  if (n >= l.n_pad || k >= l.k_pad) return 0.0f;
  const uint8_t* block = m.block(n / 16);
  const int64_t r = n % 16;
  switch (l.format) {
    case ExpertFormat::kBF16:
      return core::Bf16ToFloat(reinterpret_cast<const uint16_t*>(block)[(k / 2) * 32 + r * 2 + k % 2]);
    case ExpertFormat::kInt8:
      return (static_cast<int>(block[QuadIndex(r, k)]) - 128) * m.scales()[n];
    case ExpertFormat::kInt4: {
      const int64_t i = QuadIndex(r, k);
      const uint8_t byte = block[(i / 64) * 32 + (i % 64) % 32];
      const int q = ((i % 64) < 32 ? (byte & 0x0F) : (byte >> 4)) - 8;
      return q * m.block_scales(n / 16, k / l.group)[r];
    }
    case ExpertFormat::kFp8:
      return core::F8E4M3ToFloat(block[internal::Fp8Index(r, k)]) * m.block_scales(n / 16, k / l.group)[r];
    default:
      return 0.0f;
  }
  return 0.0f;
}

}  // namespace moe::experts

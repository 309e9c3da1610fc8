// Packed expert weights: the one layout every CPU expert kernel reads.
//
// A matrix W [N x K] (N output rows, K inputs, as stored by Hugging Face) is padded to
// N_pad = round_up(N, 16) rows and K_pad = round_up(K, 64) columns (to a multiple of the int4 group
// too), zeros in the padding, and cut into blocks of 16 output rows. Within a block the K axis
// is interleaved so that one 64-byte line holds one k-step for all 16 rows:
//
//   bf16: line j = (W[n][2j], W[n][2j+1]) for n = 0..15                      (K_pad / 2 lines)
//   int8: line j = (W[n][4j .. 4j+3]) for n = 0..15, each stored as q + 128  (K_pad / 4 lines)
//   int4: half-line j (32 bytes) holds the 64 values of int8 line j as q + 8, value i in the low
//         nibble of byte i and value i + 32 in the high nibble                (K_pad / 4 half-lines)
//
// This is the B-tile layout of AMX (16 lines make one tile) and the operand layout of AVX-512
// VNNI (vpdpbusd) and BF16 (vdpbf16ps) with broadcast activations, so a one-token GEMV reads each
// weight byte once, sequentially, with no horizontal sums.
//
// Scales: int8 has one fp32 scale per output row (symmetric, q in [-127, 127]); int4 has one per
// row and group of `group` columns (q in [-8, 7]), stored [block][group][16 rows]. Unsigned
// storage (offset 128 or 8) pairs with signed int8 activations: the kernels subtract
// offset * sum(activations) once per token (per group for int4).
//
// A packed matrix is: blocks (block_bytes each), then scales. All offsets are 64-byte aligned.
//
// GGUF formats (kQ4_0 .. kIQ1_M, one per ggml block type, gguf_types.h) keep the file's blocks as
// they are, losslessly: a 16-row block holds, for each K-chunk c of the type's block_elements
// values, the 16 rows' GGUF blocks of that chunk one after the other (row 0's block, row 1's, ...),
// chunk after chunk; rows past n are zero blocks, and each 16-row block is padded to 64 bytes.
// So a matrix takes the file's bytes (plus at most 15 zero rows and 63 bytes per 16 rows), and a
// kernel streams it in order, decoding a chunk of 16 rows to int8 in registers (gguf_blocks.h).
// Their scales are inside the blocks: scale_bytes() is 0.
//
// fp8 (kFp8) keeps an FP8 checkpoint's e4m3 codes, one byte a value, in 64-byte lines of 16 rows
// x 4 k as int8 does, the bytes of a line in the order fp8_lines.h gives (so that the kernel
// widens them to bf16 pairs in registers); its scales are fp32, one per row and group of `group`
// columns, stored [block][group][16 rows] as int4's: the checkpoint's [128 x 128] block scales
// repeated over the block's rows, so a matrix takes its codes' bytes plus 1/32 (group 128).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/tensor.h"

namespace moe::experts {

enum class ExpertFormat {
  kBF16,
  kInt8,
  kInt4,
  // GGUF block types, kept as the file stores them (see above); the names are llama.cpp's.
  kQ4_0,
  kQ4_1,
  kQ5_0,
  kQ5_1,
  kQ8_0,
  kQ2_K,
  kQ3_K,
  kQ4_K,
  kQ5_K,
  kQ6_K,
  kIQ2_XXS,
  kIQ2_XS,
  kIQ2_S,
  kIQ3_XXS,
  kIQ3_S,
  kIQ1_S,
  kIQ1_M,
  kIQ4_NL,
  kIQ4_XS,
  // fp8 e4m3 codes with one fp32 scale per row and group of `group` columns (an FP8 checkpoint's
  // weights and block scales, kept as they are; see above).
  kFp8,
  // Not a packed format: an ExpertPoolOptions::format that keeps each matrix in its GGUF type
  // ("native"; expert_pool.h).
  kNative,
};

// What a packed format is, for the code that sizes, packs and picks kernels for it: the kernels
// register against formats (kernels.h: KernelTable), and everything else reads the descriptor, so
// that a new format is a descriptor and its kernels. GGUF's types map onto these fields: Q8_0 is
// 8 bits with a scale per group of 32, Q4_K and Q5_K carry a min beside each scale, the IQ types a
// codebook of the values their codes stand for.
struct FormatDescriptor {
  ExpertFormat format = ExpertFormat::kBF16;
  const char* name = "bf16";
  int bits = 16;  // stored bits per value
  enum class Scales { kNone, kPerRow, kPerGroup };
  Scales scales = Scales::kNone;    // int8: one per output row; int4: one per row and `group` columns
  bool symmetric = true;            // codes are q + offset around zero; false: a min beside each scale
  int offset = 0;                   // stored as q + offset (unsigned storage: 128 for int8, 8 for int4)
  const float* codebook = nullptr;  // the value of each code (non-linear types); null: linear codes
  int gguf_type = -1;               // GGUF formats: the ggml type id of their blocks; -1 otherwise
};
const FormatDescriptor& Describe(ExpertFormat f);
// Every format the pool packs, in the order of ExpertFormat (kNative last, with no kernels).
const std::vector<FormatDescriptor>& PackedFormats();
// Formats whose kernels take the activations as floats (bf16 and fp8), not as int8.
inline bool TakesFloatActivations(ExpertFormat f) { return f == ExpertFormat::kBF16 || f == ExpertFormat::kFp8; }
// GGUF formats: the ones that keep a ggml block type.
inline bool IsGgufFormat(ExpertFormat f) { return f >= ExpertFormat::kQ4_0 && f <= ExpertFormat::kIQ4_XS; }
// The GGUF format for ggml type `type_id`, or kInvalidArgument naming the ones there are.
absl::StatusOr<ExpertFormat> FormatForGgufType(int type_id);

const char* FormatName(ExpertFormat f);
// A format by its name ("bf16", "int8", "int4", "q4_k", ..., "native"; GGUF names in either
// case); kInvalidArgument naming the ones there are.
absl::StatusOr<ExpertFormat> ParseFormat(const std::string& name);
// Stored bits per value: the descriptor's `bits`, for the kernels' inline sizes.
// (GGUF formats: 8, the bits of the integers their kernels compute with.)
constexpr int FormatBits(ExpertFormat f) {
  return f == ExpertFormat::kBF16 ? 16 : f == ExpertFormat::kInt4 ? 4 : 8;
}

struct MatrixLayout {
  ExpertFormat format = ExpertFormat::kBF16;
  int64_t n = 0, k = 0;          // logical shape
  int64_t n_pad = 0, k_pad = 0;  // padded shape
  int group = 32;                // int4 group size along K (32, 64 or 128); GGUF: values per scale (16, 32)
  // GGUF formats: the ggml type, its block (values, bytes) and the bytes of one 16-row block.
  int gguf_type = -1;
  int gguf_block_elements = 0, gguf_block_bytes = 0;
  int64_t gguf_row_block_bytes = 0;

  int64_t blocks() const { return n_pad / 16; }
  // Weight bytes of one 16-row block. Inline: the kernels reach blocks and scales through it.
  int64_t block_bytes() const {
    return gguf_type >= 0 ? gguf_row_block_bytes : 2 * k_pad * FormatBits(format);  // 16 rows x k_pad x bits / 8
  }
  int64_t weight_bytes() const { return blocks() * block_bytes(); }
  int64_t scale_bytes() const;   // after the blocks
  int64_t bytes() const { return weight_bytes() + scale_bytes(); }
  int64_t groups() const { return k_pad / group; }
};

// kInvalidArgument for a group that is not 32, 64 or 128 (int4, fp8; other formats ignore it), or for a
// GGUF format whose block does not divide k, or kNative.
absl::StatusOr<MatrixLayout> MakeLayout(ExpertFormat format, int64_t n, int64_t k, int group = 32);

// A read-only view of one packed matrix: its bytes are not owned and are read from any thread.
struct PackedMatrix {
  MatrixLayout layout;
  const uint8_t* data = nullptr;  // layout.bytes() bytes, 64-byte aligned

  const uint8_t* block(int64_t b) const { return data + b * layout.block_bytes(); }
  const float* scales() const { return reinterpret_cast<const float*>(data + layout.weight_bytes()); }
  // int8: scale of row n. int4: the 16 scales of block b, group g.
  const float* block_scales(int64_t b, int64_t g) const {
    return scales() + (b * layout.groups() + g) * 16;
  }
};

// Packs `w` ([n x k], bf16, f16 or f32) into `out` (layout.bytes() bytes, 64-byte aligned).
// kInvalidArgument if the tensor does not have the layout's shape.
absl::Status PackMatrix(const core::TensorView& w, const MatrixLayout& layout, uint8_t* out);

// Packs rows produced by `row(n, dst)`, which writes the layout.k floats of row n < layout.n.
void PackRows(const MatrixLayout& layout, const std::function<void(int64_t n, float* dst)>& row, uint8_t* out);

// Packs bf16 rows as stored: `row(n)` gives the layout.k values of row n < layout.n, or null for a
// row of zeros. The same bytes as PackRows from their float values, without a row of floats in
// between (where the CPU has AVX-512: bf16 bits go as they are, int8 and int4 are quantized from
// floats in registers; otherwise through PackRows).
void PackRowsBf16(const MatrixLayout& layout, const std::function<const uint16_t*(int64_t n)>& row, uint8_t* out);

// fp8: packs e4m3 codes as they are: `codes(n)` gives the layout.k codes of row n < layout.n (or
// null for a row of zeros), `scale(n, g)` the scale of row n's group g (columns [g * group,
// (g + 1) * group)). A copy, re-ordered.
void PackFp8Rows(const MatrixLayout& layout, const std::function<const uint8_t*(int64_t n)>& codes,
                 const std::function<float(int64_t n, int64_t g)>& scale, uint8_t* out);

// GGUF formats: packs rows of GGUF blocks as the file stores them: `row(n)` gives the
// k / block_elements blocks of row n < layout.n, or null for a row of zeros. A copy, re-ordered.
void PackGgufRows(const MatrixLayout& layout, const std::function<const uint8_t*(int64_t n)>& row, uint8_t* out);
// The same from `rows`: layout.n rows of k values in the layout's GGUF type, row-major, as a GGUF
// tensor stores them.
void PackBlockRows(const MatrixLayout& layout, const void* rows, uint8_t* out);

// The value the kernels compute with, for tests and the portable kernel: W[n][k] after
// quantization (0 in the padding). GGUF formats: DequantizeRow's value, bit for bit.
float UnpackValue(const PackedMatrix& m, int64_t n, int64_t k);

namespace internal {
// PackRows with the AVX-512 packer (vector, where the CPU has AVX-512 F and BW) or the plain one,
// value by value; both write the same bytes (a test checks it).
void PackRowsWith(const MatrixLayout& layout, const std::function<void(int64_t n, float* dst)>& row, uint8_t* out,
                  bool vector);
}  // namespace internal

}  // namespace moe::experts

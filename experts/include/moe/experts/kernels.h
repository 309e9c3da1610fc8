// CPU expert kernels: y[m][n] = sum_k x[m][k] * W[n][k] over a range of 16-row blocks of a packed
// matrix (packed.h), for M tokens. Chosen at run time from the CPU's features.
//
// What each kernel computes with:
//   bf16  portable, avx512:     fp32 activations, fp32 FMA on the bf16 weights (exact products)
//   bf16  avx512bf16:           activations rounded to bf16 (vdpbf16ps), fp32 sums
//   bf16  amx:                  activations split in two bf16 terms, hi = bf16(x) and
//                               lo = bf16(x - hi), both through the tiles: about 16 mantissa bits,
//                               close to fp32 (products of bf16 values are exact in the tiles)
//   int8, int4 (every kernel):  activations quantized to int8 per token (symmetric, per-token
//                               scale); integer dot products; one fp32 scale per row (int8) or per
//                               row and group (int4)
//   int8, int4 (amx and vnni):  bitwise the same results
//   fp8  portable:              fp32 activations times the codes' values, per group times its scale
//   fp8  avx512bf16:            codes widened to bf16 in registers (exact), activations split in
//                               hi and lo bf16 terms as amx's (vdpbf16ps), fp32 sums per group
//                               times its scales
//   GGUF formats (portable, vnni): int8 activations as int8's, with group sums of 16 columns;
//                               each block decoded to int8 with its group scales and mins
//                               (kernels_gguf.cc); the weights exactly llama.cpp's values
// Speed bounds: at few tokens every kernel streams the weights once (memory bandwidth); at many
// tokens avx512/vnni are bound by vector FMA throughput and amx by tile throughput (int4 on amx:
// one tile step and one store of the sums per scale group).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/core/cpu_features.h"
#include "moe/core/memory.h"
#include "moe/experts/packed.h"

namespace moe::experts {

enum class KernelKind { kPortable, kAvx512, kAvx512Bf16, kVnni, kAmx };

const char* KernelName(KernelKind k);
absl::StatusOr<KernelKind> ParseKernel(const std::string& name);

// The kernels that exist for `format` (whatever the CPU), fastest-at-scale last.
std::vector<KernelKind> KernelsFor(ExpertFormat format);
// "" if `kind` runs on this CPU, else what is missing ("needs AMX-INT8").
std::string KernelUnsupportedReason(KernelKind kind, ExpertFormat format, const core::CpuFeatures& cpu);

// One call's activations, in the forms the kernel needs. Rows are padded to a multiple of 32
// and columns to k_pad with zeros.
//
// Thread-safety: not synchronized. Reset, Prepare and Gather on one thread; FillRows after Reset
// on any threads at once for disjoint row ranges; once filled, the accessors and the kernels read
// it from any thread. The caller orders those steps (the expert pool with its atomics).
class Activations {
 public:
  // Fills the forms `kind` needs from x [m x k] (row stride k). `sum_group`: columns per
  // quantized-sum group (the int4 group; k_pad for int8; 16 for the GGUF formats).
  absl::Status Prepare(const float* x, int64_t m, int64_t k, int64_t k_pad, KernelKind kind, ExpertFormat format,
                       int sum_group);
  // The same, with row r read from rows[r] (k floats each): gathers and prepares in one pass.
  absl::Status Prepare(const float* const* rows, int64_t m, int64_t k, int64_t k_pad, KernelKind kind,
                       ExpertFormat format, int sum_group);

  // The same in parts: Reset sizes the buffers for m rows (padding zeroed), FillRows prepares
  // rows [r0, r1) from x[r0..r1); threads may fill disjoint ranges.
  absl::Status Reset(int64_t m, int64_t k, int64_t k_pad, KernelKind kind, ExpertFormat format, int sum_group);
  void FillRows(const float* const* x, int64_t r0, int64_t r1);
  // Rows rows[0..m) of `src` (int8/int4 activations), laid out for `kind`: the same values as
  // preparing those rows from their floats, without quantizing them again.
  absl::Status Gather(const Activations& src, const int32_t* rows, int64_t m, KernelKind kind);

  int64_t m() const { return m_; }
  int64_t m_pad() const { return m_pad_; }
  int64_t k_pad() const { return k_pad_; }
  // Elements between rows: k_pad plus one cache line, so that the 16 rows of an AMX tile do not
  // all fall in the same few L1 sets (k_pad is a multiple of 64: a power-of-two-like stride).
  int64_t stride() const { return k_pad_ + 64; }
  // fp32 rows (bf16 format only).
  const float* f32(int64_t row) const { return f32_.as<float>() + row * stride(); }
  const uint16_t* bf16(int64_t row) const { return bf16_.as<uint16_t>() + row * stride(); }
  // bf16(x - bf16(x)): what bf16 rounding left out (amx only).
  const uint16_t* bf16_lo(int64_t row) const { return bf16_lo_.as<uint16_t>() + row * stride(); }
  const int8_t* i8(int64_t row) const { return i8_.as<int8_t>() + row * stride(); }
  float i8_scale(int64_t row) const { return i8_scale_[row]; }
  // GGUF formats quantize each token's activations with one scale per kScaleGroup columns (as
  // llama.cpp's Q8_0 activations; finer than its Q8_K), so that a GGUF file computes with no more
  // rounding than llama.cpp gives it; i8_scale() is then 1. The other formats: one per token.
  static constexpr int kScaleGroup = 32;
  bool group_scaled() const { return group_scaled_; }
  const float* i8_group_scales(int64_t row) const { return i8_gscale_.data() + row * gscale_groups_; }
  // Sum of the quantized values of `row` in group g (columns [g*sum_group, (g+1)*sum_group)).
  int32_t i8_sum(int64_t row, int64_t g) const { return i8_sum_[row * groups_ + g]; }
  // The sums of every group of `row`.
  const int32_t* i8_sums(int64_t row) const { return i8_sum_.data() + row * groups_; }

 private:
  absl::Status Grow(core::AlignedBuffer& buffer, size_t bytes);
  int64_t m_ = 0, m_pad_ = 0, k_ = 0, k_pad_ = 0, groups_ = 0;
  ExpertFormat format_ = ExpertFormat::kBF16;
  int sum_group_ = 0;
  bool with_bf16_ = false, with_lo_ = false;
  bool group_scaled_ = false;
  int64_t gscale_groups_ = 0;
  std::vector<float> i8_gscale_;
  core::AlignedBuffer f32_, bf16_, bf16_lo_, i8_;
  std::vector<float> i8_scale_;
  std::vector<int32_t> i8_sum_;
};

// dst[c] = the sum over i < count of weights[i] * rows[i][c], added in order of i, for c < n; every
// weighted sum of expert rows goes through it, so sums made in the same order are bitwise equal.
// All rows are read in one pass over the columns (a pass per row stalled on each row's first
// lines: at 1024 tokens on the 32-core machine the sums took 5.8% of the thread time, 4.5% so).
void SumScaledRows(const float* const* rows, const float* weights, int count, int64_t n, float* dst);

// out[i] = silu(gate[i]) * up[i] for n values, vectorized (exp to about 1e-7 relative).
void SiluMul(const float* gate, const float* up, int64_t n, float* out);

// Computes y[m * ldy + (n - block_begin*16)] for blocks [block_begin, block_end) and m < a.m().
using MatmulKernel = void (*)(const PackedMatrix& w, const Activations& a, int64_t block_begin, int64_t block_end,
                              float* y, int64_t ldy);

// The kernel for (kind, format), or null if that pair does not exist.
MatmulKernel GetKernel(KernelKind kind, ExpertFormat format);

// Gate+up and SwiGLU in one pass, for a fused gate+up matrix (block 2j: gate rows of units
// [16j, 16j + 16), block 2j + 1: the same up rows) over blocks [block_begin, block_end), both
// even: y[m * ldy + c] = silu(gate) * up for unit columns c from block_begin / 2 * 16 on, below
// n_cols. Bitwise the same as the kernel's products through SiluMul.
using SwiGluKernel = void (*)(const PackedMatrix& w, const Activations& a, int64_t block_begin, int64_t block_end,
                              int64_t n_cols, float* y, int64_t ldy);

// The fused form of (kind, format)'s kernel, or null where there is none (the caller then runs the
// kernel and SiluMul).
SwiGluKernel GetSwiGluKernel(KernelKind kind, ExpertFormat format);

// What exists: a kernel registers against a format (its descriptor, packed.h) with its fused
// SwiGLU form where it has one. KernelsFor, GetKernel and GetSwiGluKernel read this table, in its
// order (the portable kernel first for each format).
struct KernelEntry {
  KernelKind kind;
  ExpertFormat format;
  MatmulKernel matmul;
  SwiGluKernel swiglu;  // null: none
};
const std::vector<KernelEntry>& KernelTable();

// Per-thread CPU state a kernel needs before its first call on a thread (AMX: permission and tile
// configuration). kFailedPrecondition if the OS refuses AMX.
absl::Status PrepareThreadForKernel(KernelKind kind);

namespace internal {
// Implementations, one translation unit per instruction set.
void MatmulPortable(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void MatmulAvx512Bf16F32(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void MatmulAvx512Bf16Dp(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void MatmulVnniInt8(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void MatmulVnniInt4(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void MatmulAmxBf16(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void MatmulAmxInt8(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void SwiGluAmxInt8(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, int64_t n_cols, float* y,
                   int64_t ldy);
void MatmulAmxInt4(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void SwiGluAmxInt4(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, int64_t n_cols, float* y,
                   int64_t ldy);
// GGUF formats (kernels_gguf.cc): every type, through one decoder per type.
void MatmulGgufPortable(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void MatmulGgufVnni(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void MatmulFp8Portable(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
void MatmulFp8Avx512Bf16(const PackedMatrix& w, const Activations& a, int64_t b0, int64_t b1, float* y, int64_t ldy);
float AbsMaxAvx512(const float* x, int64_t n);
float SumAvx512(const float* x, int64_t n);
void SiluMulAvx512(const float* gate, const float* up, int64_t n, float* out);
void QuantizeRowAvx512(const float* x, int64_t n, float inv, int group, int8_t* q, int32_t* sums);
bool EnableAmxForProcess();
// Loads the tile shapes (once per thread and shape): accumulators 16 x 16 int32, activation tiles
// 16 rows of k_bytes, weight tiles k_bytes / 4 lines of 64 bytes. 64 everywhere but in the int4
// kernel with groups of 32, whose tiles span one group.
void ConfigureAmxTiles(int k_bytes = 64);
}  // namespace internal

}  // namespace moe::experts

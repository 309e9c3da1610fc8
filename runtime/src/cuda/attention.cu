// The attention kernels of the CUDA backend (launchers declared in cuda/ops.h):
// - QkNormRopeStoreKvKernel: per row, q/k RMSNorm and NeoX RoPE, q out, k and v into the paged cache
//   (bf16, or fp8 e4m3 with one scale per position and KV head: the head's largest magnitude / 448).
// - DecodeAttentionKernel + CombineSplitsKernel: one query per sequence, split over the KV length
//   (flash-decoding); each CTA reads its KV tiles once for all query heads of its GQA group.
// - PrefillAttentionKernel: flash-attention over the paged cache, causal, for chunks of queries.
// Both attention kernels run on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation) with an
// online softmax in fp32. The M rows of an MMA are (token, head) pairs of one GQA group, token-major,
// so a KV tile in shared memory serves every head that reads it; for decode the rows are the heads.
// Both read an fp8 cache by converting each tile to bf16 in shared memory (scale applied) before
// the warps read it, so the MMAs are the same for either cache.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "cuda/attention_warp.cuh"
#include "cuda/ops.h"

namespace moe::runtime::cuda {
namespace {

using internal::CpAsync16;
using internal::CpAsync4;
using internal::CpAsyncCommit;
using internal::CpAsyncWait;
using internal::DynamicSmem;
using internal::LdMatrixX4;
using internal::LdMatrixX4Trans;
using internal::MmaBf16;
using internal::PackBf16;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMmaRows = 16;                     // M of one MMA: the rows a warp owns
constexpr int kPrefillRows = kWarps * kMmaRows;  // (token, head) rows of a prefill CTA
constexpr int kWarpKeys = 16;                    // decode: keys of a tile each warp takes
constexpr int kDecodeTileKeys = kWarps * kWarpKeys;
constexpr int kDecodeWarpRows = kWarps * kMmaRows;  // the decode combine's (warp, row) pairs
constexpr int kMaxDecodeGroup = kMmaRows;           // larger groups go to the prefill kernel
// Shared-memory rows of K and V are padded by 16 bytes, so the 8 row addresses of one ldmatrix
// phase fall in distinct bank groups.
constexpr int kSmemPad = 8;
// Decode splits aim at this many CTAs per SM (a fraction of a wave is wasted bandwidth); the cap
// keeps the workspace bound independent of the device.
constexpr int kCtasPerSm = 2;
constexpr int kMaxTargetCtas = 512;
constexpr int kDefaultSmCount = 132;
constexpr int kMaxDevices = 64;
constexpr float kLog2e = 1.4426950408889634f;

template <int kD>
constexpr int kSmemStride = kD + kSmemPad;
// O (kD/2 fp32 registers a thread), Q and S must fit in registers: halve the KV tile at kD = 256.
template <int kD>
constexpr int kPrefillTileKeys = kD <= 128 ? 64 : 32;
// One pipeline stage: a K tile and a V tile of kKeys rows.
template <int kD, int kKeys>
constexpr int kKvStageElems = (kD + kSmemPad) * kKeys * 2;
// Per warp: O [16][kD + 4] (the +4 spreads the rows over banks), m [16], l [16]; then the
// per-warp factors [kWarps][16] and the merged max and sum [16] each.
template <int kD>
constexpr int kDecodeCombineFloats = (kD + 4 + 3) * kDecodeWarpRows + 2 * kMmaRows;
// An fp8 cache's stage: K and V rows of kD bytes padded to kD + 16, then the keys' K and V scales.
template <int kD>
constexpr int kFp8Stride = kD + 16;
template <int kD, int kKeys>
constexpr int kFp8StageBytes = 2 * kKeys* kFp8Stride<kD> + 2 * kKeys * 4;
// The KV tiles' shared memory: two bf16 stages; or for fp8, one bf16 stage that each fp8 stage
// is converted into, then two fp8 stages.
template <int kD, int kKeys, bool kFp8>
constexpr int kKvSmemBytes =
    kFp8 ? kKvStageElems<kD, kKeys> * 2 + 2 * kFp8StageBytes<kD, kKeys> : kKvStageElems<kD, kKeys> * 2 * 2;
template <int kD, bool kFp8>
constexpr int kDecodeSmemBytes = std::max(kKvSmemBytes<kD, kDecodeTileKeys, kFp8>, kDecodeCombineFloats<kD> * 4);
template <int kD, bool kFp8>
constexpr int kPrefillSmemBytes = kKvSmemBytes<kD, kPrefillTileKeys<kD>, kFp8>;

// ---- QkNormRopeStoreKv ----

struct QkvParams {
  const __nv_bfloat16* qkv;
  const int32_t* positions;
  const int32_t* row_seq;
  const int32_t* block_table;
  int max_blocks;
  int num_heads;
  int kv_heads;
  int block_size;
  void* k_cache;  // bf16, or fp8 with k_scale and v_scale
  void* v_cache;
  float* k_scale;
  float* v_scale;
  const float* q_norm;
  const float* k_norm;
  float eps;
  int rotary_dim;
  const float* inv_freq;
  __nv_bfloat16* q_out;
};

template <int kN>
struct alignas(2 * kN) Bf16Vec {
  __nv_bfloat16 v[kN];
};

template <int kN>
struct alignas(kN) Fp8Vec {
  __nv_fp8_storage_t v[kN];
};

// One head's kD values (kPerLane a lane, lane-major) into an fp8 cache slot: one scale for the
// head, its largest magnitude / 448, so that it maps to the largest fp8 value; each value / scale
// rounded to nearest even (core::FloatToF8E4M3 computes the same on the host).
template <int kPerLane>
__device__ __forceinline__ void StoreFp8Head(const float (&x)[kPerLane], __nv_fp8_storage_t* dst, float* scale_dst,
                                             int lane) {
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) amax = fmaxf(amax, fabsf(x[e]));
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
  Fp8Vec<kPerLane> q;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) q.v[e] = __nv_cvt_float_to_fp8(__fdiv_rn(x[e], scale), __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<Fp8Vec<kPerLane>*>(dst) = q;
  if (lane == 0) *scale_dst = scale;
}

// grid (rows, ceil(heads / kWarps)): one warp per head of a row (q heads, then k, then v), each
// lane kD/32 contiguous elements, so a head is one vector load. The CTA first computes the row's
// cos/sin table once for its heads. Bound by memory latency at decode, by bandwidth at prefill.
template <int kD, bool kFp8>
__global__ void __launch_bounds__(kThreads) QkNormRopeStoreKvKernel(const QkvParams p) {
  constexpr int kPerLane = kD / 32;
  using Vec = Bf16Vec<kPerLane>;
  __shared__ float cos_half[kD / 2];
  __shared__ float sin_half[kD / 2];
  __shared__ float head_buf[kWarps][kD];

  const int row = blockIdx.x;
  const int pos = p.positions[row];
  const int half = p.rotary_dim / 2;
  for (int i = threadIdx.x; i < half; i += kThreads) {
    // The angle is rounded to fp32 first, as the reference computes it (no FMA contraction into
    // it). Its sine and cosine come from the double-precision sincos: exact argument reduction
    // for positions of 100k and more, and unlike sincosf never swapped for the approximate
    // __sincosf by --use_fast_math. A few dozen per row: the cost does not show.
    const float angle = __fmul_rn(static_cast<float>(pos), p.inv_freq[i]);
    double s, c;
    sincos(static_cast<double>(angle), &s, &c);
    cos_half[i] = static_cast<float>(c);
    sin_half[i] = static_cast<float>(s);
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int head = blockIdx.y * kWarps + warp;
  const int total_heads = p.num_heads + 2 * p.kv_heads;
  if (head >= total_heads) return;
  const int i0 = lane * kPerLane;
  const Vec in = *reinterpret_cast<const Vec*>(p.qkv + (static_cast<int64_t>(row) * total_heads + head) * kD + i0);

  float x[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) x[e] = __bfloat162float(in.v[e]);
  __nv_bfloat16* dst;
  int64_t slot = -1;  // a k head's cache position (block, kv head, slot), for fp8
  const float* norm_w;
  if (head < p.num_heads) {
    dst = p.q_out + (static_cast<int64_t>(row) * p.num_heads + head) * kD;
    norm_w = p.q_norm;
  } else {
    const bool is_v = head >= p.num_heads + p.kv_heads;
    const int kv_head = head - p.num_heads - (is_v ? p.kv_heads : 0);
    const int64_t block = p.block_table[static_cast<int64_t>(p.row_seq[row]) * p.max_blocks + pos / p.block_size];
    slot = (block * p.kv_heads + kv_head) * p.block_size + pos % p.block_size;
    if (is_v) {
      if constexpr (kFp8) {
        StoreFp8Head(x, static_cast<__nv_fp8_storage_t*>(p.v_cache) + slot * kD + i0, p.v_scale + slot, lane);
      } else {
        *reinterpret_cast<Vec*>(static_cast<__nv_bfloat16*>(p.v_cache) + slot * kD + i0) = in;
      }
      return;
    }
    dst = static_cast<__nv_bfloat16*>(p.k_cache) + slot * kD;
    norm_w = p.k_norm;
  }

  if (norm_w != nullptr) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) ss += x[e] * x[e];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, offset);
    const float inv_rms = rsqrtf(ss / static_cast<float>(kD) + p.eps);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) x[e] = norm_w[i0 + e] * (x[e] * inv_rms);
  }
  if (half > 0) {
    // NeoX pairs element i with i + half, which may sit in another lane: swap through shared memory.
    float* buf = head_buf[warp];
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) buf[i0 + e] = x[e];
    __syncwarp();
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int i = i0 + e;
      if (i < half) {
        x[e] = buf[i] * cos_half[i] - buf[i + half] * sin_half[i];
      } else if (i < 2 * half) {
        x[e] = buf[i] * cos_half[i - half] + buf[i - half] * sin_half[i - half];
      }
    }
  }
  if constexpr (kFp8) {
    if (head >= p.num_heads) {
      StoreFp8Head(x, static_cast<__nv_fp8_storage_t*>(p.k_cache) + slot * kD + i0, p.k_scale + slot, lane);
      return;
    }
  }
  Vec out;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) out.v[e] = __float2bfloat16(x[e]);
  *reinterpret_cast<Vec*>(dst + i0) = out;
}

// ---- Attention ----

struct AttentionParams {
  const __nv_bfloat16* q;  // [T][H][kD]
  __nv_bfloat16* out;      // [T][H][kD]
  const void* k_cache;     // bf16, or fp8 with k_scale and v_scale
  const void* v_cache;
  const float* k_scale;
  const float* v_scale;
  const int32_t* positions;
  const int32_t* seq_start;
  const int32_t* block_table;
  int max_blocks;
  int block_size;
  int num_heads;
  int kv_heads;
  int group;         // num_heads / kv_heads
  float scale_log2;  // softmax scale * log2(e): scores are kept in the log2 domain for exp2f
  // Decode only: keys [split * split_keys, ...) per split; partials when num_splits > 1.
  int num_splits;
  int split_keys;
  float* partial_acc;  // [S][H][num_splits][kD]: unnormalized O of each split
  float* partial_ml;   // [S][H][num_splits][2]: its max (log2 domain) and sum of exponentials
};

__device__ __forceinline__ uint32_t LoadBf16Pair(const __nv_bfloat16* row, int col) {
  return row == nullptr ? 0u : *reinterpret_cast<const uint32_t*>(row + col);
}

// The A fragments (MMA operand layout, see attention_warp.cuh) of one warp's 16 query rows; a
// thread holds rows g and g + 8, `lo` and `hi`. A null row (padding) reads as zeros.
template <int kD, bool kInRegisters = (kD <= 128)>
struct QueryFragments;

template <int kD>
struct QueryFragments<kD, true> {
  uint32_t a[kD / 16][4];
  __device__ __forceinline__ void Load(const __nv_bfloat16* lo, const __nv_bfloat16* hi) {
    const int t2 = 2 * (threadIdx.x & 3);
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      a[kk][0] = LoadBf16Pair(lo, kk * 16 + t2);
      a[kk][1] = LoadBf16Pair(hi, kk * 16 + t2);
      a[kk][2] = LoadBf16Pair(lo, kk * 16 + t2 + 8);
      a[kk][3] = LoadBf16Pair(hi, kk * 16 + t2 + 8);
    }
  }
  __device__ __forceinline__ void Get(int kk, uint32_t (&frag)[4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) frag[i] = a[kk][i];
  }
};

// kD = 256: O alone takes 128 registers, so Q is re-read (from L1) at every tile instead.
template <int kD>
struct QueryFragments<kD, false> {
  const __nv_bfloat16* lo;
  const __nv_bfloat16* hi;
  __device__ __forceinline__ void Load(const __nv_bfloat16* lo_row, const __nv_bfloat16* hi_row) {
    lo = lo_row;
    hi = hi_row;
  }
  __device__ __forceinline__ void Get(int kk, uint32_t (&frag)[4]) const {
    const int t2 = 2 * (threadIdx.x & 3);
    frag[0] = LoadBf16Pair(lo, kk * 16 + t2);
    frag[1] = LoadBf16Pair(hi, kk * 16 + t2);
    frag[2] = LoadBf16Pair(lo, kk * 16 + t2 + 8);
    frag[3] = LoadBf16Pair(hi, kk * 16 + t2 + 8);
  }
};

// A CTA's KV tiles in shared memory (kKvSmemBytes at `base`), double-buffered: Load queues the
// copy of keys [first_key, first_key + kKeys) of one sequence (block_row: its block table) and kv
// head into stage `stage`; keys at or past key_end are zero-filled (never read: the block table need
// not cover them). All threads of the CTA take part, 16 bytes per copy; consecutive threads copy
// consecutive chunks of a key's row. Ready(stage) gives the stage's K tile as bf16, rows of
// kSmemStride<kD>, its V tile kKeys rows later: a bf16 cache's stage as copied; an fp8 cache's
// converted now (every thread takes part, a barrier follows) into the one bf16 stage, each row
// times its key's scale. The caller's barriers must keep a stage from being refilled, and the bf16
// stage from being converted into, while a warp still reads it.
template <int kD, int kKeys, bool kFp8>
struct KvTiles {
  static constexpr int kStride = kSmemStride<kD>;
  unsigned char* base;

  __device__ __forceinline__ __nv_bfloat16* Bf16Stage(int stage) const {
    return reinterpret_cast<__nv_bfloat16*>(base) + (kFp8 ? 0 : stage * kKvStageElems<kD, kKeys>);
  }
  __device__ __forceinline__ unsigned char* Fp8Stage(int stage) const {
    return base + kKvStageElems<kD, kKeys> * 2 + stage * kFp8StageBytes<kD, kKeys>;
  }

  __device__ __forceinline__ void Load(const AttentionParams& p, const int32_t* block_row, int kv_head, int first_key,
                                       int key_end, int stage) const {
    constexpr int kElemBytes = kFp8 ? 1 : 2;
    constexpr int kChunks = kD * kElemBytes / 16;
    constexpr int kRowStride = kFp8 ? kFp8Stride<kD> : kStride * 2;  // bytes
    static_assert((kKeys * kChunks) % kThreads == 0, "tile copies must split evenly over the CTA");
    unsigned char* tile_k = kFp8 ? Fp8Stage(stage) : reinterpret_cast<unsigned char*>(Bf16Stage(stage));
    unsigned char* tile_v = tile_k + kKeys * kRowStride;
    const auto* k_cache = static_cast<const unsigned char*>(p.k_cache);
    const auto* v_cache = static_cast<const unsigned char*>(p.v_cache);
#pragma unroll
    for (int i = 0; i < kKeys * kChunks / kThreads; ++i) {
      const int c = threadIdx.x + i * kThreads;
      const int row = c / kChunks;
      const int col = (c % kChunks) * 16;  // bytes
      const int key = first_key + row;
      const bool valid = key < key_end;
      int64_t offset = 0;
      if (valid) {
        const int64_t block = block_row[key / p.block_size];
        offset = ((block * p.kv_heads + kv_head) * p.block_size + key % p.block_size) * kD * kElemBytes + col;
      }
      CpAsync16(tile_k + row * kRowStride + col, k_cache + offset, valid);
      CpAsync16(tile_v + row * kRowStride + col, v_cache + offset, valid);
    }
    if constexpr (kFp8) {
      static_assert(2 * kKeys <= kThreads, "one thread per scale");
      float* scales = reinterpret_cast<float*>(tile_k + 2 * kKeys * kRowStride);  // K's, then V's
      if (threadIdx.x < 2 * kKeys) {
        const bool is_v = threadIdx.x >= kKeys;
        const int row = threadIdx.x - (is_v ? kKeys : 0);
        const int key = first_key + row;
        const bool valid = key < key_end;
        int64_t slot = 0;
        if (valid) slot = (block_row[key / p.block_size] * p.kv_heads + kv_head) * p.block_size + key % p.block_size;
        CpAsync4(scales + threadIdx.x, (is_v ? p.v_scale : p.k_scale) + slot, valid);
      }
    }
  }

  __device__ __forceinline__ const __nv_bfloat16* Ready(int stage) const {
    if constexpr (kFp8) {
      Convert(stage, 0, kKeys, threadIdx.x, kThreads);
      __syncthreads();
    }
    return kFp8 ? Bf16Stage(0) : Bf16Stage(stage);
  }

  // As Ready, for a warp that reads only keys [first, first + count) of the tile (the decode
  // kernel's): the warp converts those alone, so no barrier of the whole CTA is needed.
  __device__ __forceinline__ const __nv_bfloat16* ReadyForWarp(int stage, int first, int count) const {
    if constexpr (kFp8) {
      Convert(stage, first, count, threadIdx.x & 31, 32);
      __syncwarp();
    }
    return kFp8 ? Bf16Stage(0) : Bf16Stage(stage);
  }

 private:
  // Keys [first, first + count) of an fp8 stage, K and V, into the bf16 stage (times each key's
  // scale), by `threads` threads of which this is `thread`.
  __device__ __forceinline__ void Convert(int stage, int first, int count, int thread, int threads) const {
    const unsigned char* fp8 = Fp8Stage(stage);
    const float* scales = reinterpret_cast<const float*>(fp8 + 2 * kKeys * kFp8Stride<kD>);
    __nv_bfloat16* out = Bf16Stage(0);
    constexpr int kChunks = kD / 8;  // 8 values a chunk
    for (int c = thread; c < 2 * count * kChunks; c += threads) {
      const int i = c / kChunks;                                    // K rows, then V rows
      const int row = (i < count ? 0 : kKeys - count) + first + i;  // in the stage's K then V rows
      const int col = (c % kChunks) * 8;
      const float scale = scales[row];
      const uint2 raw = *reinterpret_cast<const uint2*>(fp8 + row * kFp8Stride<kD> + col);
      const __nv_fp8x2_storage_t pairs[4] = {
          static_cast<__nv_fp8x2_storage_t>(raw.x & 0xffffu), static_cast<__nv_fp8x2_storage_t>(raw.x >> 16),
          static_cast<__nv_fp8x2_storage_t>(raw.y & 0xffffu), static_cast<__nv_fp8x2_storage_t>(raw.y >> 16)};
      uint32_t packed[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[j], __NV_E4M3)));
        packed[j] = PackBf16(f.x * scale, f.y * scale);
      }
      *reinterpret_cast<uint4*>(out + row * kStride + col) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
};

// One warp: online-softmax attention of its 16 query rows over kKeys keys in shared memory (rows
// of kSmemStride<kD> bf16 starting at the warp's first key, sequence position key0). When
// `mask` is set, a key past the row's position (pos_lo for the thread's row g, pos_hi for g + 8)
// is dropped. o (fp32 C fragments of O [16 x kD]), m (running max, log2 domain) and l (this
// thread's part of the row sums) are updated in place. Compute: 4 * kKeys * kD MMA flops a row.
template <int kD, int kKeys, typename Q>
__device__ __forceinline__ void AttendTile(const Q& q, const __nv_bfloat16* keys_k, const __nv_bfloat16* keys_v,
                                           int key0, int pos_lo, int pos_hi, bool mask, float scale_log2,
                                           float (&o)[kD / 8][4], float (&m)[2], float (&l)[2]) {
  constexpr int kStride = kSmemStride<kD>;
  const int lane = threadIdx.x & 31;

  // S = Q K^T. K rows are B's columns: ldmatrix matrices 0..3 are (keys 0-7, dims 0-7),
  // (keys 0-7, dims 8-15), (keys 8-15, dims 0-7), (keys 8-15, dims 8-15) of a 16 x 16 block,
  // i.e. b0, b1 of key tile 2np and b0, b1 of key tile 2np + 1.
  float s[kKeys / 8][4];
#pragma unroll
  for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
  }
  const __nv_bfloat16* k_lane = keys_k + ((lane & 7) + ((lane >> 4) << 3)) * kStride + (((lane >> 3) & 1) << 3);
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t a[4];
    q.Get(kk, a);
#pragma unroll
    for (int np = 0; np < kKeys / 16; ++np) {
      uint32_t b[4];
      LdMatrixX4(k_lane + np * 16 * kStride + kk * 16, b);
      MmaBf16(s[2 * np], a, b[0], b[1]);
      MmaBf16(s[2 * np + 1], a, b[2], b[3]);
    }
  }

  // s[n][e] is row g + 8 * (e / 2), key key0 + 8n + 2t + e % 2.
  const int t2 = 2 * (lane & 3);
#pragma unroll
  for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[n][e] * scale_log2;
      if (mask && key0 + n * 8 + t2 + (e & 1) > (e < 2 ? pos_lo : pos_hi)) x = -INFINITY;
      s[n][e] = x;
    }
  }

  // Online softmax; the 4 lanes of a quad share a row.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) tile_max = fmaxf(tile_max, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m[h], tile_max);
    // A row with every key masked so far keeps m = -inf; it subtracts 0 so that no -inf - -inf
    // (NaN) appears, and its exponentials and correction are all 0.
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float correction = exp2f(m[h] - base);
    m[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
      s[n][2 * h] = exp2f(s[n][2 * h] - base);
      s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - base);
      sum += s[n][2 * h] + s[n][2 * h + 1];
    }
    l[h] = l[h] * correction + sum;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      o[n][2 * h] *= correction;
      o[n][2 * h + 1] *= correction;
    }
  }

  // O += P V. The C fragments of key tiles 2c and 2c + 1 are exactly P's A fragment for keys
  // 16c..16c+15. V rows are B's k dimension, hence the transposed ldmatrix: matrices 0..3 are
  // (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, dims 8-15),
  // i.e. b0, b1 of dim tile 2dp and b0, b1 of dim tile 2dp + 1.
  const __nv_bfloat16* v_lane = keys_v + ((lane & 7) + (((lane >> 3) & 1) << 3)) * kStride + ((lane >> 4) << 3);
#pragma unroll
  for (int c = 0; c < kKeys / 16; ++c) {
    const uint32_t pa[4] = {PackBf16(s[2 * c][0], s[2 * c][1]), PackBf16(s[2 * c][2], s[2 * c][3]),
                            PackBf16(s[2 * c + 1][0], s[2 * c + 1][1]), PackBf16(s[2 * c + 1][2], s[2 * c + 1][3])};
#pragma unroll
    for (int dp = 0; dp < kD / 16; ++dp) {
      uint32_t b[4];
      LdMatrixX4Trans(v_lane + c * 16 * kStride + dp * 16, b);
      MmaBf16(o[2 * dp], pa, b[0], b[1]);
      MmaBf16(o[2 * dp + 1], pa, b[2], b[3]);
    }
  }
}

// Sums a thread's partial row sums over its quad: afterwards each lane has its rows' full sums.
__device__ __forceinline__ void QuadSum(float (&l)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
}

// grid (num_splits, kv_heads, num_seqs), kThreads threads, kDecodeSmemBytes<kD, kFp8> of shared memory.
// A CTA attends its sequence's one query, all `group` heads of its kv head at once (the MMA rows,
// padded to 16), over the keys of its split: tiles of kDecodeTileKeys keys, double-buffered with
// cp.async, each warp taking 16 keys of a tile. The four warps' softmax states are merged in
// shared memory; a single split writes the output, several write partials for CombineSplitsKernel.
// The length comes from positions in device memory, so a graph replay with longer or shorter
// sequences works: a split past the end writes a neutral partial (max -inf, sum 0, O 0).
// Bound by HBM bandwidth: every K and V byte of the split is read once.
template <int kD, bool kFp8>
__global__ void __launch_bounds__(kThreads) DecodeAttentionKernel(const AttentionParams p) {
  constexpr int kKeys = kDecodeTileKeys;
  constexpr int kStride = kSmemStride<kD>;
  const int split = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.z;
  const int row = p.seq_start[seq];
  if (p.seq_start[seq + 1] == row) return;  // no query of this sequence in the step
  const int kv_len = p.positions[row] + 1;
  const int first = split * p.split_keys;
  // The last split also takes any keys past num_splits * split_keys (a length beyond max_kv_len).
  const int end = split == p.num_splits - 1 ? kv_len : min(kv_len, first + p.split_keys);
  const int num_tiles = end > first ? (end - first + kKeys - 1) / kKeys : 0;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t2 = 2 * (lane & 3);
  const int head0 = kv_head * p.group;
  const __nv_bfloat16* q_row = p.q + static_cast<int64_t>(row) * p.num_heads * kD;
  QueryFragments<kD> q;
  q.Load(g < p.group ? q_row + (head0 + g) * kD : nullptr, g + 8 < p.group ? q_row + (head0 + g + 8) * kD : nullptr);

  float o[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  }
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};

  const KvTiles<kD, kKeys, kFp8> tiles{DynamicSmem<unsigned char>()};
  const int32_t* block_row = p.block_table + static_cast<int64_t>(seq) * p.max_blocks;
  if (num_tiles > 0) tiles.Load(p, block_row, kv_head, first, end, 0);
  CpAsyncCommit();
  for (int t = 0; t < num_tiles; ++t) {
    if (t + 1 < num_tiles) {
      tiles.Load(p, block_row, kv_head, first + (t + 1) * kKeys, end, (t + 1) & 1);
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* tile = tiles.ReadyForWarp(t & 1, warp * kWarpKeys, kWarpKeys) + warp * kWarpKeys * kStride;
    const int key0 = first + t * kKeys + warp * kWarpKeys;
    if (key0 < end) {
      AttendTile<kD, kWarpKeys>(q, tile, tile + kKeys * kStride, key0, end - 1, end - 1, key0 + kWarpKeys > end,
                                p.scale_log2, o, m, l);
    }
    __syncthreads();  // the stage is refilled next iteration
  }
  QuadSum(l);

  // Merge the warps' states; the K/V stages are free (every copy waited for, every warp past the
  // last barrier).
  constexpr int kOStride = kD + 4;
  float* red_o = DynamicSmem<float>();                  // [kWarps][16][kOStride]
  float* red_m = red_o + kWarps * kMmaRows * kOStride;  // [kWarps][16]
  float* red_l = red_m + kWarps * kMmaRows;             // [kWarps][16]
  float* factor = red_l + kWarps * kMmaRows;            // [kWarps][16]
  float* row_m = factor + kWarps * kMmaRows;            // [16]
  float* row_l = row_m + kMmaRows;                      // [16]
  float* my_o = red_o + warp * kMmaRows * kOStride;
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<float2*>(my_o + (g + 8 * h) * kOStride + n * 8 + t2) =
          make_float2(o[n][2 * h], o[n][2 * h + 1]);
    }
  }
  if ((lane & 3) == 0) {
    red_m[warp * kMmaRows + g] = m[0];
    red_m[warp * kMmaRows + g + 8] = m[1];
    red_l[warp * kMmaRows + g] = l[0];
    red_l[warp * kMmaRows + g + 8] = l[1];
  }
  __syncthreads();
  if (threadIdx.x < kMmaRows) {
    const int r = threadIdx.x;
    float row_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) row_max = fmaxf(row_max, red_m[w * kMmaRows + r]);
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = red_m[w * kMmaRows + r];
      const float f = mw == -INFINITY ? 0.f : exp2f(mw - row_max);
      factor[w * kMmaRows + r] = f;
      sum += red_l[w * kMmaRows + r] * f;
    }
    row_m[r] = row_max;
    row_l[r] = sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < p.group * kD; i += kThreads) {
    const int r = i / kD;
    const int d = i % kD;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc += red_o[(w * kMmaRows + r) * kOStride + d] * factor[w * kMmaRows + r];
    if (p.num_splits == 1) {
      p.out[(static_cast<int64_t>(row) * p.num_heads + head0 + r) * kD + d] = __float2bfloat16(acc / row_l[r]);
    } else {
      const int64_t part = (static_cast<int64_t>(seq) * p.num_heads + head0 + r) * p.num_splits + split;
      p.partial_acc[part * kD + d] = acc;
      if (d == 0) {
        p.partial_ml[2 * part] = row_m[r];
        p.partial_ml[2 * part + 1] = row_l[r];
      }
    }
  }
}

// grid (num_heads, num_seqs), kD threads: merges the splits' partial softmax states of one
// sequence's query, one head.
template <int kD>
__global__ void __launch_bounds__(kD) CombineSplitsKernel(const AttentionParams p) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int d = threadIdx.x;
  const int row = p.seq_start[seq];
  if (p.seq_start[seq + 1] == row) return;
  const int64_t part0 = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_splits;
  float row_max = -INFINITY;
  for (int j = 0; j < p.num_splits; ++j) row_max = fmaxf(row_max, p.partial_ml[2 * (part0 + j)]);
  float acc = 0.f;
  float sum = 0.f;
  for (int j = 0; j < p.num_splits; ++j) {
    const float mj = p.partial_ml[2 * (part0 + j)];
    if (mj == -INFINITY) continue;  // an empty split
    const float f = exp2f(mj - row_max);
    sum += p.partial_ml[2 * (part0 + j) + 1] * f;
    acc += p.partial_acc[(part0 + j) * kD + d] * f;
  }
  p.out[(static_cast<int64_t>(row) * p.num_heads + head) * kD + d] = __float2bfloat16(acc / sum);
}

// grid (ceil(max_q_len * group / 64), kv_heads, num_seqs), kThreads threads,
// kPrefillSmemBytes<kD, kFp8> of shared memory. A CTA owns 64 (token, head) rows of one sequence and
// kv head, token-major (row f: token f / group, head f % group), 16 per warp, and loops over KV
// tiles up to its last row's position, double-buffered with cp.async. A warp skips the tiles past
// its own rows and masks only the tiles that cross its diagonal. Rows past the sequence's chunk
// are padding; CTAs wholly past it exit at once. Bound by tensor-core throughput for long chunks.
template <int kD, bool kFp8>
__global__ void __launch_bounds__(kThreads) PrefillAttentionKernel(const AttentionParams p) {
  constexpr int kKeys = kPrefillTileKeys<kD>;
  constexpr int kStride = kSmemStride<kD>;
  // Tiles further down a chunk see more keys: hand them out first.
  const int tile = gridDim.x - 1 - blockIdx.x;
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.z;
  const int row0 = p.seq_start[seq];
  const int flat_rows = (p.seq_start[seq + 1] - row0) * p.group;
  const int f0 = tile * kPrefillRows;
  if (f0 >= flat_rows) return;
  // Positions grow along a chunk, so a tile's last row sees the most keys.
  const int kv_end = p.positions[row0 + (min(f0 + kPrefillRows, flat_rows) - 1) / p.group] + 1;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t2 = 2 * (lane & 3);
  const int fw = f0 + warp * kMmaRows;
  const bool warp_active = fw < flat_rows;
  int warp_first_pos = 0;
  int warp_kv_end = 0;
  if (warp_active) {
    warp_first_pos = p.positions[row0 + fw / p.group];
    warp_kv_end = p.positions[row0 + (min(fw + kMmaRows, flat_rows) - 1) / p.group] + 1;
  }
  int pos[2];
  int64_t offset[2];  // of the row's head vector in q and out; -1: padding
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int f = fw + g + 8 * h;
    if (f < flat_rows) {
      const int token = row0 + f / p.group;
      pos[h] = p.positions[token];
      offset[h] = (static_cast<int64_t>(token) * p.num_heads + kv_head * p.group + f % p.group) * kD;
    } else {
      pos[h] = -1;
      offset[h] = -1;
    }
  }
  QueryFragments<kD> q;
  q.Load(offset[0] >= 0 ? p.q + offset[0] : nullptr, offset[1] >= 0 ? p.q + offset[1] : nullptr);

  float o[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  }
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};

  const KvTiles<kD, kKeys, kFp8> tiles{DynamicSmem<unsigned char>()};
  const int32_t* block_row = p.block_table + static_cast<int64_t>(seq) * p.max_blocks;
  const int num_tiles = (kv_end + kKeys - 1) / kKeys;
  tiles.Load(p, block_row, kv_head, 0, kv_end, 0);
  CpAsyncCommit();
  for (int t = 0; t < num_tiles; ++t) {
    if (t + 1 < num_tiles) {
      tiles.Load(p, block_row, kv_head, (t + 1) * kKeys, kv_end, (t + 1) & 1);
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* tile_k = tiles.Ready(t & 1);
    const int key0 = t * kKeys;
    if (warp_active && key0 < warp_kv_end) {
      AttendTile<kD, kKeys>(q, tile_k, tile_k + kKeys * kStride, key0, pos[0], pos[1],
                            key0 + kKeys - 1 > warp_first_pos, p.scale_log2, o, m, l);
    }
    __syncthreads();  // the stage is refilled next iteration
  }
  QuadSum(l);

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (offset[h] < 0) continue;
    const float inv = 1.f / l[h];
    __nv_bfloat16* dst = p.out + offset[h] + t2;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst + n * 8) = PackBf16(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
  }
}

// No Status comes back from a launcher: an argument no kernel supports is turned into a launch
// error (invalid configuration) for the caller's cudaGetLastError, instead of a silent no-op.
__global__ void UnsupportedShapeKernel() {}
void ReportUnsupported(cudaStream_t stream) { UnsupportedShapeKernel<<<0, 0, 0, stream>>>(); }

int SmCount() {
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return kDefaultSmCount;
  int n = cached[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) {
      n = kDefaultSmCount;
    }
    cached[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Kernels with more than 48 KiB of dynamic shared memory must say so, once per device.
template <auto kKernel>
void AllowDynamicSmem(int bytes) {
  if (bytes <= 48 * 1024) return;
  static std::atomic<uint64_t> devices_done{0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (devices_done.load(std::memory_order_acquire) & bit) != 0) return;
  if (cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) == cudaSuccess) {
    devices_done.fetch_or(bit, std::memory_order_release);
  }
}

struct DecodeSplit {
  int num_splits;
  int split_keys;  // a multiple of kDecodeTileKeys
};

// Enough splits that num_seqs * kv_heads * splits CTAs reach kCtasPerSm per SM, no split shorter
// than one tile. From host values only (a captured graph keeps it), so a replay's shorter
// sequences leave some splits empty. With more than one split, S * splits < 2 * kMaxTargetCtas
// (splits <= ceil(target / (S * KV)) and S * KV < target), which bounds the workspace.
DecodeSplit ChooseDecodeSplit(int num_seqs, int kv_heads, int max_kv_len, int sm_count) {
  const int tiles = std::max(1, (max_kv_len + kDecodeTileKeys - 1) / kDecodeTileKeys);
  const int base = std::max(1, num_seqs * kv_heads);
  const int target = std::min(kCtasPerSm * sm_count, kMaxTargetCtas);
  int splits = std::clamp((target + base - 1) / base, 1, tiles);
  const int tiles_per_split = (tiles + splits - 1) / splits;
  splits = (tiles + tiles_per_split - 1) / tiles_per_split;
  return {splits, tiles_per_split * kDecodeTileKeys};
}

template <int kD, bool kFp8>
void LaunchAttention(AttentionParams p, const StepMeta& meta, float* workspace, cudaStream_t stream) {
  if (meta.max_q_len == 1 && p.group <= kMaxDecodeGroup) {
    const DecodeSplit split = ChooseDecodeSplit(meta.num_seqs, p.kv_heads, meta.max_kv_len, SmCount());
    p.num_splits = split.num_splits;
    p.split_keys = split.split_keys;
    if (p.num_splits > 1) {
      p.partial_acc = workspace;
      p.partial_ml = workspace + static_cast<int64_t>(meta.num_seqs) * p.num_heads * p.num_splits * kD;
    }
    constexpr int kSmem = kDecodeSmemBytes<kD, kFp8>;
    AllowDynamicSmem<DecodeAttentionKernel<kD, kFp8>>(kSmem);
    const dim3 grid(p.num_splits, p.kv_heads, meta.num_seqs);
    DecodeAttentionKernel<kD, kFp8><<<grid, kThreads, kSmem, stream>>>(p);
    if (p.num_splits > 1) {
      const dim3 combine_grid(p.num_heads, meta.num_seqs);
      CombineSplitsKernel<kD><<<combine_grid, kD, 0, stream>>>(p);
    }
    return;
  }
  constexpr int kSmem = kPrefillSmemBytes<kD, kFp8>;
  AllowDynamicSmem<PrefillAttentionKernel<kD, kFp8>>(kSmem);
  const dim3 grid((meta.max_q_len * p.group + kPrefillRows - 1) / kPrefillRows, p.kv_heads, meta.num_seqs);
  PrefillAttentionKernel<kD, kFp8><<<grid, kThreads, kSmem, stream>>>(p);
}

}  // namespace

void QkNormRopeStoreKv(const uint16_t* qkv, const StepMeta& meta, int num_heads, const KvLayer& kv, const float* q_norm,
                       const float* k_norm, float eps, int rotary_dim, const float* inv_freq, uint16_t* q_out,
                       cudaStream_t stream) {
  if (meta.num_tokens <= 0) return;
  if (rotary_dim < 0 || rotary_dim > kv.head_dim || rotary_dim % 2 != 0 || (rotary_dim > 0 && inv_freq == nullptr) ||
      num_heads <= 0 || kv.kv_heads <= 0) {
    ReportUnsupported(stream);
    return;
  }
  QkvParams p;
  p.qkv = reinterpret_cast<const __nv_bfloat16*>(qkv);
  p.positions = meta.positions;
  p.row_seq = meta.row_seq;
  p.block_table = meta.block_table;
  p.max_blocks = meta.max_blocks;
  p.num_heads = num_heads;
  p.kv_heads = kv.kv_heads;
  p.block_size = kv.block_size;
  p.k_cache = kv.k;
  p.v_cache = kv.v;
  p.k_scale = kv.k_scale;
  p.v_scale = kv.v_scale;
  p.q_norm = q_norm;
  p.k_norm = k_norm;
  p.eps = eps;
  p.rotary_dim = rotary_dim;
  p.inv_freq = inv_freq;
  p.q_out = reinterpret_cast<__nv_bfloat16*>(q_out);
  if (kv.fp8 && (kv.k_scale == nullptr || kv.v_scale == nullptr)) {
    ReportUnsupported(stream);
    return;
  }
  const dim3 grid(meta.num_tokens, (num_heads + 2 * kv.kv_heads + kWarps - 1) / kWarps);
  auto launch = [&](auto kernel) { kernel<<<grid, kThreads, 0, stream>>>(p); };
  switch (kv.head_dim) {
    case 32:
      return kv.fp8 ? launch(QkNormRopeStoreKvKernel<32, true>) : launch(QkNormRopeStoreKvKernel<32, false>);
    case 64:
      return kv.fp8 ? launch(QkNormRopeStoreKvKernel<64, true>) : launch(QkNormRopeStoreKvKernel<64, false>);
    case 128:
      return kv.fp8 ? launch(QkNormRopeStoreKvKernel<128, true>) : launch(QkNormRopeStoreKvKernel<128, false>);
    case 256:
      return kv.fp8 ? launch(QkNormRopeStoreKvKernel<256, true>) : launch(QkNormRopeStoreKvKernel<256, false>);
    default:
      ReportUnsupported(stream);
  }
}

void PagedAttention(const uint16_t* q, const StepMeta& meta, int num_heads, const KvLayer& kv, float scale,
                    float* workspace, uint16_t* out, cudaStream_t stream) {
  if (meta.num_tokens <= 0 || meta.num_seqs <= 0) return;
  if (kv.kv_heads <= 0 || num_heads <= 0 || num_heads % kv.kv_heads != 0 || meta.max_q_len <= 0) {
    ReportUnsupported(stream);
    return;
  }
  AttentionParams p = {};
  p.q = reinterpret_cast<const __nv_bfloat16*>(q);
  p.out = reinterpret_cast<__nv_bfloat16*>(out);
  p.k_cache = kv.k;
  p.v_cache = kv.v;
  p.k_scale = kv.k_scale;
  p.v_scale = kv.v_scale;
  p.positions = meta.positions;
  p.seq_start = meta.seq_start;
  p.block_table = meta.block_table;
  p.max_blocks = meta.max_blocks;
  p.block_size = kv.block_size;
  p.num_heads = num_heads;
  p.kv_heads = kv.kv_heads;
  p.group = num_heads / kv.kv_heads;
  p.scale_log2 = scale * kLog2e;
  p.num_splits = 1;
  if (kv.fp8 && (kv.k_scale == nullptr || kv.v_scale == nullptr)) {
    ReportUnsupported(stream);
    return;
  }
  switch (kv.head_dim) {
    case 32:
      return kv.fp8 ? LaunchAttention<32, true>(p, meta, workspace, stream)
                    : LaunchAttention<32, false>(p, meta, workspace, stream);
    case 64:
      return kv.fp8 ? LaunchAttention<64, true>(p, meta, workspace, stream)
                    : LaunchAttention<64, false>(p, meta, workspace, stream);
    case 128:
      return kv.fp8 ? LaunchAttention<128, true>(p, meta, workspace, stream)
                    : LaunchAttention<128, false>(p, meta, workspace, stream);
    case 256:
      return kv.fp8 ? LaunchAttention<256, true>(p, meta, workspace, stream)
                    : LaunchAttention<256, false>(p, meta, workspace, stream);
    default:
      ReportUnsupported(stream);
  }
}

int64_t AttentionWorkspaceFloats(int max_tokens, int max_kv_len, int num_heads, int head_dim) {
  // Only decode with more than one split uses it: S * H * splits partials of head_dim + 2 floats,
  // with S * splits bounded as ChooseDecodeSplit says (and S <= max_tokens).
  const int64_t tiles = std::max(1, (max_kv_len + kDecodeTileKeys - 1) / kDecodeTileKeys);
  const int64_t partials = std::min<int64_t>(static_cast<int64_t>(std::max(max_tokens, 0)) * tiles, 2 * kMaxTargetCtas);
  return partials * num_heads * (head_dim + 2);
}

}  // namespace moe::runtime::cuda

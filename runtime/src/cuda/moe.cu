// Routed experts of one MoE layer on the GPU (the MoeExperts contract of ops.h).
//
// Every call enqueues the same kernels for the same (T, k, E, H, I), whatever the routing, so a
// captured graph replays correctly with new ids. A single token (decode at batch 1) takes two:
// SingleTokenGateUpKernel reads each slot's expert from the ids directly (its k experts are
// distinct, nothing to group), and SingleTokenDownKernel adds the weighted slots as it goes.
// Otherwise four:
//   1. GroupByExpertKernel (one CTA): a stable counting sort of the T*k (token, slot) pairs by
//      expert into the workspace: per-expert offsets, the sorted pair list, each pair's sorted
//      position, the list of experts that have tokens and the list of 64-row tiles over them.
//   2. gate+up: act[s] = bf16(silu(gate_e . x) * (up_e . x)) for every sorted pair s, either by
//      DecodeExpertKernel<kGateUp> (few pairs: each selected expert's weight rows streamed once
//      through the tensor cores for up to 8 of its tokens at a time) or GroupedGemmKernel<kGateUp>
//      (many pairs: a grouped GEMM over tiles of each expert's tokens).
//   3. down: y[s] = down_e . act[s] in fp32, by the same kind of kernel.
//   4. CombineSlotsKernel: out[t] = sum_j weights[t][j] * y[pos(t, j)], slots in order j = 0..k-1,
//      so the result does not depend on how CTAs were scheduled.
// Preconditions: H and I multiples of 8 (16-byte rows of bf16) and at most 65536, 1 <= E <= 2048,
// 1 <= T * k <= 2^24, all pointers 16-byte aligned. A call outside them fills out with NaN, so
// that it cannot pass for a result. Ids outside [0, E) are skipped: their slot adds nothing.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/moe.h"
#include "cuda/ops.h"

namespace moe::runtime::cuda {
namespace {

using bf16 = __nv_bfloat16;

// Bounded by the grouping kernel's shared memory (three [E+1] arrays and a per-warp table).
constexpr int kMaxExperts = 2048;

// The decode path while the pairs are this few: below it most experts have at most a few tokens,
// so streaming the weights once is the whole cost and a 64-row tile would be mostly padding.
constexpr int kDecodeMaxPairs = 256;

// ---- Grouped GEMM tiling (prefill) ----
constexpr int kTileM = 64;         // rows (sorted pairs) per tile
constexpr int kTileN = 128;        // output columns per tile; gate+up: 64 gate columns and the matching 64 up columns
constexpr int kTileK = 32;         // bf16 elements: 64-byte smem rows, 4 chunks of 16 bytes
constexpr int kStages = 4;         // cp.async pipeline depth
constexpr int kGemmThreads = 128;  // 4 warps as 2 (M) x 2 (N), each 32 x 64
constexpr int kTileABytes = kTileM * kTileK * 2;
constexpr int kStageBytes = (kTileM + kTileN) * kTileK * 2;
constexpr int kGemmSmemBytes = kStages * kStageBytes;  // 48 KiB: no opt-in attribute needed
static_assert(kGemmSmemBytes <= 48 * 1024, "the grouped GEMM must fit the default dynamic smem limit");

// ---- Decode tiling ----
constexpr int kDecodeWarps = 4;  // split the reduction dimension, summed through smem
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeTokens = 8;      // the mma's n: tokens of one expert per pass over its rows
constexpr int kDecodeRowsGateUp = 8;  // gate rows per CTA (with their 8 up rows: the mma's m = 16)
constexpr int kDecodeRowsDown = 16;   // down rows per CTA

// ---- Workspace ----

// Device pointers into the workspace that the grouping kernel fills and the others read.
struct Grouping {
  int32_t* offsets;      // [E+1] first sorted position of each expert; offsets[E] = valid pairs
  int32_t* active;       // [min(E, P)] experts with tokens, ascending; totals[0] of them
  int32_t* totals;       // [2] experts with tokens, tiles
  int32_t* tile_expert;  // [max tiles] expert of each kTileM-row tile
  int32_t* tile_row;     // [max tiles] first row of the tile within its expert
  int32_t* sorted_pair;  // [P] pair index t*k + j at each sorted position, grouped by expert
  int32_t* pair_pos;     // [P] sorted position of each pair, -1 for an id outside [0, E)
};

constexpr int64_t AlignUp(int64_t v) { return (v + 255) & ~int64_t{255}; }

// Tiles of kTileM rows over experts whose counts sum to at most `pairs`, at most min(E, pairs)
// of them non-empty: sum ceil(c_e / M) <= (pairs + nonempty * (M - 1)) / M.
int64_t MaxTiles(int64_t pairs, int num_experts) {
  return (pairs + std::min<int64_t>(num_experts, pairs) * (kTileM - 1)) / kTileM;
}

struct Layout {
  int64_t offsets, active, totals, tile_expert, tile_row, sorted_pair, pair_pos, act, y, total;
};

// Byte offsets of each array for a call of `pairs` pairs; every size grows with `pairs`, so a
// workspace sized for the largest call holds every smaller one.
Layout MakeLayout(int64_t pairs, int num_experts, int hidden, int intermediate) {
  Layout l;
  int64_t at = 0;
  auto take = [&at](int64_t bytes) {
    const int64_t here = at;
    at += AlignUp(bytes);
    return here;
  };
  const int64_t tiles = MaxTiles(pairs, num_experts);
  l.offsets = take(4 * (int64_t{num_experts} + 1));
  l.active = take(4 * int64_t{num_experts});
  l.totals = take(4 * 2);
  l.tile_expert = take(4 * tiles);
  l.tile_row = take(4 * tiles);
  l.sorted_pair = take(4 * pairs);
  l.pair_pos = take(4 * pairs);
  l.act = take(2 * pairs * intermediate);
  l.y = take(4 * pairs * hidden);
  l.total = at;
  return l;
}

// ---- Small device helpers ----

__device__ __forceinline__ float Silu(float g) { return g / (1.0f + __expf(-g)); }

// c += a . b on the tensor cores: m16n8k16, bf16 inputs, fp32 accumulators. Fragment layout (g =
// lane / 4, t = lane % 4): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 =
// A[g+8][2t+8..]; b0 = B[2t..2t+1][g], b1 = B[2t+8..][g]; c = C[g][2t], C[g][2t+1], C[g+8][2t],
// C[g+8][2t+1].
__device__ __forceinline__ void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 LoadOrZero(const bf16* p, bool ok) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (ok) v = __ldg(reinterpret_cast<const uint4*>(p));
  return v;
}

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; zero-filled when !ok (src is then not read).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool ok) {
  const int src_bytes = ok ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Exclusive prefix sum of v[0, n) in shared memory, in place, by the whole block; returns the
// total. `scratch` holds 32 ints. Each thread scans a contiguous run, then the runs' sums are
// scanned across warps.
__device__ int BlockExclusiveScan(int* v, int n, int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int per = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, static_cast<int>(threadIdx.x) * per), end = min(n, begin + per);
  int sum = 0;
  for (int i = begin; i < end; ++i) sum += v[i];
  int inclusive = sum;
  for (int d = 1; d < 32; d <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? scratch[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += other;
    }
    scratch[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  int run = (warp > 0 ? scratch[warp - 1] : 0) + inclusive - sum;
  for (int i = begin; i < end; ++i) {
    const int c = v[i];
    v[i] = run;
    run += c;
  }
  const int total = scratch[warps - 1];
  __syncthreads();  // scratch is reused by the next scan
  return total;
}

// ---- 1. Grouping ----

// Warps of the grouping CTA: each owns a contiguous range of pairs and a row of per-expert counts
// in shared memory, so that ranks within an expert follow pair order (a stable sort) with no
// atomics. At least 256 pairs per warp: a decode step's few pairs take one warp, whose barriers
// cost next to nothing, and the table stays within 16 KiB.
int GroupingWarps(int64_t pairs, int num_experts) {
  return static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(4096 / num_experts, (pairs + 255) / 256), 1, 32));
}
int64_t GroupingSmemBytes(int warps, int num_experts) {
  return 4 * (int64_t{warps} * num_experts + 3 * (int64_t{num_experts} + 1) + 32);
}

// One CTA: the stable counting sort of the pairs by expert (see Grouping). Bound by latency (a
// few block barriers); the pairs are read twice.
__global__ void GroupByExpertKernel(const int32_t* __restrict__ ids, int num_pairs, int num_experts, Grouping g) {
  extern __shared__ int grouping_smem[];
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int* table = grouping_smem;                    // [warps][E]: counts, then running positions
  int* offsets = table + warps * num_experts;    // [E+1]
  int* tiles = offsets + num_experts + 1;        // [E+1] tiles per expert, then first tile
  int* active_slot = tiles + num_experts + 1;    // [E+1] has tokens, then slot in the active list
  int* scratch = active_slot + num_experts + 1;  // [32]
  for (int i = threadIdx.x; i < warps * num_experts; i += blockDim.x) table[i] = 0;
  __syncthreads();

  const int per_warp = (num_pairs + warps - 1) / warps;
  const int begin = min(num_pairs, warp * per_warp), end = min(num_pairs, begin + per_warp);
  int* counts = table + warp * num_experts;
  const uint32_t lanes_below = (1u << lane) - 1u;
  // Pass 1: this warp's count of each expert. Lanes with the same expert elect one leader.
  for (int base = begin; base < end; base += 32) {
    const int p = base + lane;
    const int e = p < end ? ids[p] : -1;
    const bool valid = p < end && static_cast<unsigned>(e) < static_cast<unsigned>(num_experts);
    const uint32_t same = __match_any_sync(0xffffffffu, valid ? e : -1);
    if (valid && (same & lanes_below) == 0) counts[e] += __popc(same);
    __syncwarp();
  }
  __syncthreads();

  // Each expert's total, and each warp's first rank within the expert.
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < warps; ++w) {
      const int c = table[w * num_experts + e];
      table[w * num_experts + e] = run;
      run += c;
    }
    offsets[e] = run;
    tiles[e] = (run + kTileM - 1) / kTileM;
    active_slot[e] = run > 0 ? 1 : 0;
  }
  __syncthreads();
  const int valid_pairs = BlockExclusiveScan(offsets, num_experts, scratch);
  const int num_tiles = BlockExclusiveScan(tiles, num_experts, scratch);
  const int num_active = BlockExclusiveScan(active_slot, num_experts, scratch);
  if (threadIdx.x == 0) {
    offsets[num_experts] = valid_pairs;
    g.totals[0] = num_active;
    g.totals[1] = num_tiles;
  }
  __syncthreads();

  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) g.offsets[e] = offsets[e];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const int c = offsets[e + 1] - offsets[e];
    if (c == 0) continue;
    g.active[active_slot[e]] = e;
    for (int i = 0; i * kTileM < c; ++i) {
      g.tile_expert[tiles[e] + i] = e;
      g.tile_row[tiles[e] + i] = i * kTileM;
    }
  }

  // Pass 2: positions, in pair order within each expert.
  for (int base = begin; base < end; base += 32) {
    const int p = base + lane;
    const int e = p < end ? ids[p] : -1;
    const bool valid = p < end && static_cast<unsigned>(e) < static_cast<unsigned>(num_experts);
    const uint32_t same = __match_any_sync(0xffffffffu, valid ? e : -1);
    if (valid) {
      const int pos = offsets[e] + counts[e] + __popc(same & lanes_below);
      g.sorted_pair[pos] = p;
      g.pair_pos[p] = pos;
    } else if (p < end) {
      g.pair_pos[p] = -1;
    }
    __syncwarp();  // every lane has read counts[e] before its leader moves it on
    if (valid && (same & lanes_below) == 0) counts[e] += __popc(same);
    __syncwarp();
  }
}

// ---- 2, 3 (decode). Tensor-core GEMV over each selected expert's rows ----

// One warp's share of C[16 rows x 8 tokens] += A . B^T over the reduction steps [s_begin, s_end)
// of 32 elements each. Thread (g, t) loads 16 bytes of rows g (a_lo) and g + 8 (a_hi) and of token
// g (b) at element 32 s + 8 t, and feeds them to two mmas as their k = 2t..2t+1, 2t+8..2t+9: the
// same permutation of the reduction index on both sides, so the dot products are unchanged and
// every load is a full 16 bytes straight from global memory. Four steps of loads are issued
// before their mmas to keep 192 bytes per thread in flight: the loop is bound by HBM bandwidth.
__device__ __forceinline__ void WarpRowsTimesTokens(const bf16* a_lo, bool a_lo_ok, const bf16* a_hi, bool a_hi_ok,
                                                    const bf16* b, bool b_ok, int length, int s_begin, int s_end, int t,
                                                    float (&acc)[4]) {
  for (int s = s_begin; s < s_end; s += 4) {
    uint4 lo[4], hi[4], bv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int k = (s + u) * 32 + t * 8;
      const bool ok = s + u < s_end && k < length;
      lo[u] = LoadOrZero(a_lo + k, ok && a_lo_ok);
      hi[u] = LoadOrZero(a_hi + k, ok && a_hi_ok);
      bv[u] = LoadOrZero(b + k, ok && b_ok);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      MmaBf16(acc, lo[u].x, hi[u].x, lo[u].y, hi[u].y, bv[u].x, bv[u].y);
      MmaBf16(acc, lo[u].z, hi[u].z, lo[u].w, hi[u].w, bv[u].z, bv[u].w);
    }
  }
}

// kGateUp: CTA (active expert, block of 8 gate rows); the mma's 16 rows are those 8 gate rows and
// their 8 up rows, so each thread ends with gate and up of the same (row, token) and writes act.
// Otherwise: CTA (active expert, block of 16 down rows), writing y. Either way the 4 warps split
// the reduction, are summed in a fixed order through smem, and the expert's tokens go 8 at a time
// (a second pass over the rows reads them from L2). CTAs past the active experts exit at once.
template <bool kGateUp>
__global__ void __launch_bounds__(kDecodeThreads)
    DecodeExpertKernel(const bf16* __restrict__ src, const bf16* __restrict__ weights, int top_k, int hidden,
                       int intermediate, int row_blocks, Grouping g, bf16* __restrict__ act, float* __restrict__ y) {
  const int slot = blockIdx.x / row_blocks, row_block = blockIdx.x % row_blocks;
  if (slot >= g.totals[0]) return;
  const int e = g.active[slot];
  const int first = g.offsets[e], count = g.offsets[e + 1] - first;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
  const int length = kGateUp ? hidden : intermediate;  // the reduction dimension

  const bf16* a_lo;
  const bf16* a_hi;
  bool a_lo_ok = true, a_hi_ok = true;
  int row = 0;
  if (kGateUp) {
    row = row_block * kDecodeRowsGateUp + gid;  // < I: I is a multiple of 8
    const bf16* expert = weights + static_cast<int64_t>(e) * 2 * intermediate * hidden;
    a_lo = expert + static_cast<int64_t>(row) * hidden;
    a_hi = expert + static_cast<int64_t>(intermediate + row) * hidden;
  } else {
    row = row_block * kDecodeRowsDown + gid;
    a_lo_ok = row < hidden;
    a_hi_ok = row + 8 < hidden;
    const bf16* expert = weights + static_cast<int64_t>(e) * hidden * intermediate;
    a_lo = expert + static_cast<int64_t>(a_lo_ok ? row : 0) * intermediate;
    a_hi = expert + static_cast<int64_t>(a_hi_ok ? row + 8 : 0) * intermediate;
  }
  const int steps = (length + 31) / 32;
  const int per_warp = (steps + kDecodeWarps - 1) / kDecodeWarps;
  const int s_begin = min(steps, warp * per_warp), s_end = min(steps, s_begin + per_warp);

  __shared__ float partial[kDecodeWarps - 1][32][4];
  for (int chunk = 0; chunk < count; chunk += kDecodeTokens) {
    const int n = min(kDecodeTokens, count - chunk);
    const bool b_ok = gid < n;
    const int s = first + chunk + (b_ok ? gid : 0);
    const bf16* b = kGateUp ? src + static_cast<int64_t>(g.sorted_pair[s] / top_k) * hidden
                            : src + static_cast<int64_t>(s) * intermediate;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    WarpRowsTimesTokens(a_lo, a_lo_ok, a_hi, a_hi_ok, b, b_ok, length, s_begin, s_end, t, acc);
    if (warp > 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp - 1][lane][i] = acc[i];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps - 1; ++w) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += partial[w][lane][i];
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {  // tokens 2t and 2t + 1
        const int token = 2 * t + j;
        if (token >= n) continue;
        const int64_t pos = first + chunk + token;
        if (kGateUp) {
          act[pos * intermediate + row] = __float2bfloat16(Silu(acc[j]) * acc[2 + j]);
        } else {
          if (a_lo_ok) y[pos * hidden + row] = acc[j];
          if (a_hi_ok) y[pos * hidden + row + 8] = acc[2 + j];
        }
      }
    }
    __syncthreads();  // partial is rewritten by the next chunk
  }
}

// ---- One token (decode at batch 1): no grouping, the combine fused into down ----

// CTA (slot j, block of 8 gate rows) of expert ids[j]: act[j][rows] = silu(gate . x) * (up . x),
// as DecodeExpertKernel<true> computes it for a token alone. A slot whose id is outside [0, E)
// writes nothing; SingleTokenDownKernel skips it too.
__global__ void __launch_bounds__(kDecodeThreads)
    SingleTokenGateUpKernel(const bf16* __restrict__ x, const bf16* __restrict__ weights,
                            const int32_t* __restrict__ ids, int num_experts, int hidden, int intermediate,
                            int row_blocks, bf16* __restrict__ act) {
  const int slot = blockIdx.x / row_blocks, row_block = blockIdx.x % row_blocks;
  const int e = ids[slot];
  if (e < 0 || e >= num_experts) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
  const int row = row_block * kDecodeRowsGateUp + gid;  // < I: I is a multiple of 8
  const bf16* expert = weights + static_cast<int64_t>(e) * 2 * intermediate * hidden;
  const int steps = (hidden + 31) / 32;
  const int per_warp = (steps + kDecodeWarps - 1) / kDecodeWarps;
  const int s_begin = min(steps, warp * per_warp), s_end = min(steps, s_begin + per_warp);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // The mma's 8 tokens: only token 0 (lanes with gid 0 load it) is real.
  WarpRowsTimesTokens(expert + static_cast<int64_t>(row) * hidden, true,
                      expert + static_cast<int64_t>(intermediate + row) * hidden, true, x, gid == 0, hidden, s_begin,
                      s_end, t, acc);
  __shared__ float partial[kDecodeWarps - 1][32][2];
  if (warp > 0) {
    partial[warp - 1][lane][0] = acc[0];
    partial[warp - 1][lane][1] = acc[2];
  }
  __syncthreads();
  if (warp == 0 && t == 0) {
    float gate = acc[0], up = acc[2];  // C[row][token 0] and C[row + 8][token 0]: gate and up
    for (int w = 0; w < kDecodeWarps - 1; ++w) {
      gate += partial[w][lane][0];
      up += partial[w][lane][1];
    }
    act[static_cast<int64_t>(slot) * intermediate + row] = __float2bfloat16(Silu(gate) * up);
  }
}

constexpr int kSingleDownWarps = 8;

// CTA (block of 16 output rows): out[rows] = sum_j weights[j] * (down_{ids[j]} . act[j]) over the
// token's slots. The warps take the slots (and, when there are fewer slots than warps, parts of
// the reduction), each summing its share in slot order; the warps' sums are added in warp order,
// so the result does not depend on scheduling.
__global__ void __launch_bounds__(kSingleDownWarps * 32)
    SingleTokenDownKernel(const bf16* __restrict__ act, const bf16* __restrict__ weights,
                          const int32_t* __restrict__ ids, const float* __restrict__ route_weights, int top_k,
                          int num_experts, int hidden, int intermediate, float* __restrict__ out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
  const int row = blockIdx.x * kDecodeRowsDown + gid;
  const bool lo_ok = row < hidden, hi_ok = row + 8 < hidden;
  const int parts = max(1, kSingleDownWarps / top_k);  // warps per slot, splitting the reduction
  const int groups = kSingleDownWarps / parts;         // slots in flight at once
  const int part = warp % parts;
  const int steps = (intermediate + 31) / 32;
  const int per_part = (steps + parts - 1) / parts;
  const int s_begin = min(steps, part * per_part), s_end = min(steps, s_begin + per_part);
  float sum_lo = 0.f, sum_hi = 0.f;
  if (warp < groups * parts) {
    for (int j = warp / parts; j < top_k; j += groups) {
      const int e = ids[j];
      if (e < 0 || e >= num_experts) continue;
      const bf16* expert = weights + static_cast<int64_t>(e) * hidden * intermediate;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      WarpRowsTimesTokens(expert + static_cast<int64_t>(lo_ok ? row : 0) * intermediate, lo_ok,
                          expert + static_cast<int64_t>(hi_ok ? row + 8 : 0) * intermediate, hi_ok,
                          act + static_cast<int64_t>(j) * intermediate, gid == 0, intermediate, s_begin, s_end, t, acc);
      const float w = route_weights[j];
      sum_lo += w * acc[0];
      sum_hi += w * acc[2];
    }
  }
  __shared__ float partial[kSingleDownWarps][16];
  if (t == 0) {
    partial[warp][gid] = sum_lo;
    partial[warp][gid + 8] = sum_hi;
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    const int r = blockIdx.x * kDecodeRowsDown + threadIdx.x;
    float total = 0.f;
    for (int w = 0; w < kSingleDownWarps; ++w) total += partial[w][threadIdx.x];
    if (r < hidden) out[r] = total;
  }
}

// ---- 2, 3 (prefill). Grouped GEMM over tiles of each expert's sorted pairs ----

// Byte offset of 16-byte chunk `chunk` (0..3) of row `row` in a [rows][kTileK] bf16 tile. The XOR
// spreads the 8 rows that one ldmatrix phase reads over all 8 16-byte bank groups.
__device__ __forceinline__ uint32_t Swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * (kTileK * 2) + ((chunk ^ ((row >> 1) & 3)) << 4));
}

// First smem B row of the 16-row pair of n8 blocks q (0..3) of warp column wn. gate+up: the tile's
// rows 0..63 are gate rows and 64..127 the matching up rows; a warp takes 32 of each so that it
// holds gate and up of the same output column (blocks 0..3 gate, 4..7 up).
template <bool kGateUp>
__device__ __forceinline__ int WarpBRow(int wn, int q) {
  if (kGateUp) return (q < 2 ? 0 : 64) + wn * 32 + (q & 1) * 16;
  return wn * 64 + q * 16;
}

// CTA (tile of <= 64 sorted pairs of one expert, tile of output columns), 4 warps of 32 x 64.
// kGateUp: A = the pairs' rows of x (gathered through sorted_pair), B = 64 gate rows and the 64
// matching up rows of the expert, K = H; the epilogue writes act = bf16(silu(gate) * up).
// Otherwise: A = act rows (contiguous in sorted order), B = 128 down rows, K = I; writes y in
// fp32. A kStages-deep cp.async pipeline of kTileK-wide slices; rows past the tile's pairs, columns
// past N and K past the end are zero-filled and never stored. Consecutive CTAs share an A tile and
// the few tiles of one expert sit n_tiles CTAs apart, so both operands come mostly from L2.
template <bool kGateUp>
__global__ void __launch_bounds__(kGemmThreads, 4)
    GroupedGemmKernel(const bf16* __restrict__ a_src, const bf16* __restrict__ weights, int top_k, int hidden,
                      int intermediate, int n_tiles, Grouping g, bf16* __restrict__ act, float* __restrict__ y) {
  extern __shared__ __align__(128) uint8_t gemm_smem[];
  const int tile = blockIdx.x / n_tiles, n_tile = blockIdx.x % n_tiles;
  if (tile >= g.totals[1]) return;
  const int e = g.tile_expert[tile];
  const int row0 = g.offsets[e] + g.tile_row[tile];  // sorted position of the tile's row 0
  const int rows = min(kTileM, g.offsets[e + 1] - row0);
  const int k_len = kGateUp ? hidden : intermediate;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;

  // Each thread copies chunk (tid % 4) of rows tid / 4 + 32 i: 2 rows of A, 4 of B.
  const int ld_chunk = tid & 3, ld_row = tid >> 2;
  const bf16* a_ptr[2];
  bool a_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = ld_row + 32 * i;
    a_ok[i] = r < rows;
    const int s = row0 + (a_ok[i] ? r : 0);
    a_ptr[i] = kGateUp ? a_src + static_cast<int64_t>(g.sorted_pair[s] / top_k) * hidden
                       : a_src + static_cast<int64_t>(s) * intermediate;
  }
  const bf16* b_ptr[4];
  bool b_ok[4];
  const bf16* expert = weights + static_cast<int64_t>(e) * (kGateUp ? 2 * intermediate : hidden) * k_len;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = ld_row + 32 * i;
    int w_row;
    if (kGateUp) {
      const int col = n_tile * (kTileN / 2) + (n & 63);
      b_ok[i] = col < intermediate;
      w_row = (n < 64 ? 0 : intermediate) + col;
    } else {
      w_row = n_tile * kTileN + n;
      b_ok[i] = w_row < hidden;
    }
    b_ptr[i] = expert + static_cast<int64_t>(b_ok[i] ? w_row : 0) * k_len;
  }

  const uint32_t smem_base = SmemAddress(gemm_smem);
  auto load_stage = [&](int stage, int k_tile) {
    const int k = k_tile * kTileK + ld_chunk * 8;
    const bool k_ok = k < k_len;  // k_len is a multiple of 8: a chunk is all in or all out
    const int k_at = k_ok ? k : 0;
    const uint32_t a_base = smem_base + stage * kStageBytes, b_base = a_base + kTileABytes;
#pragma unroll
    for (int i = 0; i < 2; ++i)
      CpAsync16(a_base + Swizzle(ld_row + 32 * i, ld_chunk), a_ptr[i] + k_at, a_ok[i] && k_ok);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      CpAsync16(b_base + Swizzle(ld_row + 32 * i, ld_chunk), b_ptr[i] + k_at, b_ok[i] && k_ok);
  };

  float acc[2][8][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int nj = 0; nj < 8; ++nj)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mi][nj][i] = 0.f;

  const int k_tiles = (k_len + kTileK - 1) / kTileK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    CpAsyncCommit();  // an empty group keeps the wait count below uniform
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();  // slice kt has landed (for this thread)
    __syncthreads();             // ... for all threads, and all are done with slice kt - 1
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);  // into the stage slice kt - 1 used
    CpAsyncCommit();

    const uint32_t a_base = smem_base + (kt % kStages) * kStageBytes, b_base = a_base + kTileABytes;
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      uint32_t af[2][4], bfr[8][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wm * 32 + mi * 16 + (lane & 15);
        LdMatrixX4(a_base + Swizzle(r, kk * 2 + (lane >> 4)), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = WarpBRow<kGateUp>(wn, q) + (lane & 7) + ((lane >> 4) << 3);
        LdMatrixX4(b_base + Swizzle(r, kk * 2 + ((lane >> 3) & 1)), bfr[2 * q][0], bfr[2 * q][1], bfr[2 * q + 1][0],
                   bfr[2 * q + 1][1]);
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nj = 0; nj < 8; ++nj)
          MmaBf16(acc[mi][nj], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bfr[nj][0], bfr[nj][1]);
    }
  }
  CpAsyncWait<0>();

  const int gid = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wm * 32 + mi * 16 + half * 8 + gid;
      if (r >= rows) continue;
      const int64_t s = row0 + r;
      if (kGateUp) {
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
          const int col = n_tile * (kTileN / 2) + wn * 32 + nj * 8 + 2 * t;
          if (col >= intermediate) continue;  // col is even and I is a multiple of 8: col + 1 < I too
          const float v0 = Silu(acc[mi][nj][2 * half]) * acc[mi][nj + 4][2 * half];
          const float v1 = Silu(acc[mi][nj][2 * half + 1]) * acc[mi][nj + 4][2 * half + 1];
          *reinterpret_cast<__nv_bfloat162*>(act + s * intermediate + col) = __floats2bfloat162_rn(v0, v1);
        }
      } else {
#pragma unroll
        for (int nj = 0; nj < 8; ++nj) {
          const int col = n_tile * kTileN + wn * 64 + nj * 8 + 2 * t;
          if (col >= hidden) continue;
          *reinterpret_cast<float2*>(y + s * hidden + col) =
              make_float2(acc[mi][nj][2 * half], acc[mi][nj][2 * half + 1]);
        }
      }
    }
  }
}

// ---- 4. Sum of each token's slots ----

constexpr int kCombineThreads = 128;  // 4 columns each

// out[t][c..c+3] = sum_j w[t][j] * y[pos(t, j)][c..c+3], j ascending; slots with an id outside
// [0, E) add nothing. Bound by reading y.
__global__ void __launch_bounds__(kCombineThreads)
    CombineSlotsKernel(const float* __restrict__ y, const int32_t* __restrict__ pair_pos,
                       const float* __restrict__ weights, int top_k, int hidden, float* __restrict__ out) {
  const int token = blockIdx.x;
  const int col = (blockIdx.y * kCombineThreads + threadIdx.x) * 4;
  if (col >= hidden) return;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = 0; j < top_k; ++j) {
    const int64_t pair = static_cast<int64_t>(token) * top_k + j;
    const int pos = pair_pos[pair];
    if (pos < 0) continue;
    const float w = weights[pair];
    const float4 v = *reinterpret_cast<const float4*>(y + static_cast<int64_t>(pos) * hidden + col);
    sum.x += w * v.x;
    sum.y += w * v.y;
    sum.z += w * v.z;
    sum.w += w * v.w;
  }
  *reinterpret_cast<float4*>(out + static_cast<int64_t>(token) * hidden + col) = sum;
}

// Sorted positions are int32 and the grids one-dimensional: these bounds keep both far from
// overflow, and no MoE model comes near them.
constexpr int64_t kMaxPairs = int64_t{1} << 24;
constexpr int kMaxDim = 1 << 16;

bool SupportedCall(int64_t pairs, const ExpertWeights& w) {
  return pairs >= 1 && pairs <= kMaxPairs && w.num_experts >= 1 && w.num_experts <= kMaxExperts && w.hidden >= 8 &&
         w.hidden <= kMaxDim && w.hidden % 8 == 0 && w.intermediate >= 8 && w.intermediate <= kMaxDim &&
         w.intermediate % 8 == 0;
}

}  // namespace

MoePath MoeAutoPath(int num_tokens, int top_k) {
  return static_cast<int64_t>(num_tokens) * top_k <= kDecodeMaxPairs ? MoePath::kDecode : MoePath::kGrouped;
}

int64_t MoeWorkspaceBytes(int max_tokens, int top_k, int num_experts, int hidden, int intermediate) {
  const int64_t pairs = static_cast<int64_t>(std::max(max_tokens, 0)) * std::max(top_k, 0);
  return MakeLayout(pairs, std::max(num_experts, 1), std::max(hidden, 0), std::max(intermediate, 0)).total;
}

void MoeExpertsOnPath(MoePath path, const uint16_t* x, int num_tokens, const int32_t* ids, const float* weights,
                      int top_k, const ExpertWeights& w, void* workspace, float* out, cudaStream_t stream) {
  if (num_tokens <= 0) return;
  const int64_t pairs = static_cast<int64_t>(num_tokens) * top_k;
  if (!SupportedCall(pairs, w)) {
    const int64_t out_bytes = static_cast<int64_t>(num_tokens) * std::max(w.hidden, 0) * sizeof(float);
    (void)cudaMemsetAsync(out, 0xff, out_bytes, stream);  // all-ones words are NaN: never mistaken for a result
    return;
  }
  const int E = w.num_experts, H = w.hidden, I = w.intermediate;
  if (path == MoePath::kAuto) path = MoeAutoPath(num_tokens, top_k);

  const Layout l = MakeLayout(pairs, E, H, I);
  char* base = static_cast<char*>(workspace);
  Grouping g;
  g.offsets = reinterpret_cast<int32_t*>(base + l.offsets);
  g.active = reinterpret_cast<int32_t*>(base + l.active);
  g.totals = reinterpret_cast<int32_t*>(base + l.totals);
  g.tile_expert = reinterpret_cast<int32_t*>(base + l.tile_expert);
  g.tile_row = reinterpret_cast<int32_t*>(base + l.tile_row);
  g.sorted_pair = reinterpret_cast<int32_t*>(base + l.sorted_pair);
  g.pair_pos = reinterpret_cast<int32_t*>(base + l.pair_pos);
  bf16* act = reinterpret_cast<bf16*>(base + l.act);
  float* y = reinterpret_cast<float*>(base + l.y);
  const bf16* xb = reinterpret_cast<const bf16*>(x);
  const bf16* gate_up = reinterpret_cast<const bf16*>(w.gate_up);
  const bf16* down = reinterpret_cast<const bf16*>(w.down);

  if (path == MoePath::kDecode && num_tokens == 1) {
    const int gate_up_blocks = I / kDecodeRowsGateUp;
    SingleTokenGateUpKernel<<<static_cast<unsigned>(top_k * gate_up_blocks), kDecodeThreads, 0, stream>>>(
        xb, gate_up, ids, E, H, I, gate_up_blocks, act);
    SingleTokenDownKernel<<<static_cast<unsigned>((H + kDecodeRowsDown - 1) / kDecodeRowsDown), kSingleDownWarps * 32,
                            0, stream>>>(act, down, ids, weights, top_k, E, H, I, out);
    return;
  }

  const int grouping_warps = GroupingWarps(pairs, E);
  GroupByExpertKernel<<<1, grouping_warps * 32, GroupingSmemBytes(grouping_warps, E), stream>>>(
      ids, static_cast<int>(pairs), E, g);

  if (path == MoePath::kDecode) {
    // Grid over every slot that could hold an active expert; the slots past the real count exit.
    const int64_t slots = std::min<int64_t>(E, pairs);
    const int gate_up_blocks = I / kDecodeRowsGateUp;
    const int down_blocks = (H + kDecodeRowsDown - 1) / kDecodeRowsDown;
    DecodeExpertKernel<true><<<static_cast<unsigned>(slots * gate_up_blocks), kDecodeThreads, 0, stream>>>(
        xb, gate_up, top_k, H, I, gate_up_blocks, g, act, nullptr);
    DecodeExpertKernel<false><<<static_cast<unsigned>(slots * down_blocks), kDecodeThreads, 0, stream>>>(
        act, down, top_k, H, I, down_blocks, g, nullptr, y);
  } else {
    const int64_t tiles = MaxTiles(pairs, E);
    const int gate_up_tiles = (I + kTileN / 2 - 1) / (kTileN / 2);
    const int down_tiles = (H + kTileN - 1) / kTileN;
    GroupedGemmKernel<true><<<static_cast<unsigned>(tiles * gate_up_tiles), kGemmThreads, kGemmSmemBytes, stream>>>(
        xb, gate_up, top_k, H, I, gate_up_tiles, g, act, nullptr);
    GroupedGemmKernel<false><<<static_cast<unsigned>(tiles * down_tiles), kGemmThreads, kGemmSmemBytes, stream>>>(
        act, down, top_k, H, I, down_tiles, g, nullptr, y);
  }

  const dim3 combine_grid(static_cast<unsigned>(num_tokens), (H / 4 + kCombineThreads - 1) / kCombineThreads);
  CombineSlotsKernel<<<combine_grid, kCombineThreads, 0, stream>>>(y, g.pair_pos, weights, top_k, H, out);
}

void MoeExperts(const uint16_t* x, int num_tokens, const int32_t* ids, const float* weights, int top_k,
                const ExpertWeights& w, void* workspace, float* out, cudaStream_t stream) {
  MoeExpertsOnPath(MoePath::kAuto, x, num_tokens, ids, weights, top_k, w, workspace, out, stream);
}

}  // namespace moe::runtime::cuda

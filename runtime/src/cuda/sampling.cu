// SampleRows: the sampling algorithm of runtime/include/moe/runtime/sampler.h on the GPU, one CTA
// per row, everything on the device (no host sync, so it can be captured into a CUDA graph).
//
// A row is read from global memory once per pass; the passes are, in order:
//   logprobs (rows that ask): max and sum of exp of the raw logits, a radix select of the top
//     `logprobs` (value desc, id asc), a gather;
//   penalties (rows that have them): the row's history counted into its slice of the workspace,
//     the penalised logits written in place;
//   greedy: one argmax; otherwise: the argmax of z, a radix select of the top_k (when on), the
//     sum S and a radix select of the top-p prefix by mass (when top_p < 1), and the Gumbel draw.
// Each pass is bound by the SM's load bandwidth (a CTA per row); the Gumbel pass by the Philox
// rounds of the entries it cannot rule out.
//
// Exact selection: every entry has a unique 50-bit key, the order-preserving bits of its value
// above 18 bits of (2^18 - 1 - id), so "value desc, id asc" is "key desc" and the top-k and the
// top-p prefix are sets {key >= threshold}. A radix select finds the threshold 11 bits at a time,
// stopping as soon as the chosen bucket is wholly in or is a single entry; ties in value are
// resolved by the id bits exactly as the CPU does. Masses are added in 2^-45 fixed point
// (uint64), so their sums do not depend on the order the atomics land in: the same row gives the
// same token on every run.
//
// Limits: vocab <= 2^18 = 262144 (a larger vocab writes token -1); a row's output tokens fewer
// than 2^22 (the penalty counts). Rows with logprobs == 0 leave their logprob slots untouched.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "cuda/ops.h"
#include "moe/core/philox.h"

namespace moe::runtime::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kIdBits = 18;
constexpr int kMaxVocab = 1 << kIdBits;
constexpr uint64_t kIdMask = kMaxVocab - 1;
constexpr int kKeyBits = 32 + kIdBits;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kBins / kThreads;
static_assert(kBins % kThreads == 0, "each thread owns whole bins");
constexpr uint32_t kNoDigit = 0xffffffffu;
// Masses e in [0, 1] as integers of 2^-45: 2^18 entries of at most 2^45 fit a uint64.
constexpr float kFixedOne = 0x1p45f;
// As in sampler.cc: SamplingUniform can return exactly 1.0f; capped, the noise is at most 16.64.
constexpr float kMaxUniform = 0x1.fffffep-1f;
constexpr float kMaxGumbelNoise = 17.0f;
// Penalty counts in the workspace: a history token's slot holds kHistoryTag (exponent bits all
// ones, which no finite logit has), the prompt bit and its output count, until its penalty is
// applied; then it holds the raw logit's bits (for the logprob of a penalised token).
constexpr uint32_t kHistoryTag = 0x7f800000u;
constexpr uint32_t kPromptBit = 1u << 22;
constexpr uint32_t kCountMask = kPromptBit - 1;

struct ScoreId {
  float score;
  int32_t id;
};

struct Shared {
  uint32_t count[kBins];
  unsigned long long mass[kBins];
  float reduce_f[kWarps];
  int32_t reduce_i[kWarps];
  unsigned long long reduce_u64[kWarps];
  uint32_t scan_u32[kWarps];
  unsigned long long scan_u64[kWarps];
  // The bucket a select level picks, written by the thread that owns it.
  int32_t pick_order;
  uint32_t pick_count;
  uint32_t pick_before;
  unsigned long long pick_mass_before;
  unsigned long long pick_mass;
  int32_t found;
  int32_t top_found;
  uint64_t top_key[kMaxLogprobs];
};

// ---- Keys ----

// Order-preserving bits: a < b as floats iff OrderedBits(a) < OrderedBits(b); -0 goes with +0,
// as == has it (the CPU's comparisons).
__device__ __forceinline__ uint32_t OrderedBits(float f) {
  const uint32_t bits = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ uint64_t EntryKey(float value, int id) {
  return (static_cast<uint64_t>(OrderedBits(value)) << kIdBits) | (kIdMask - static_cast<uint64_t>(id));
}

__device__ __forceinline__ int KeyId(uint64_t key) { return static_cast<int>(kIdMask - (key & kIdMask)); }

__device__ __forceinline__ unsigned long long FixedMass(float e) { return __float2ull_rn(e * kFixedOne); }

__device__ __forceinline__ float ScaledLogit(float logit, float temperature) {
  return fminf(fmaxf(__fdiv_rn(logit, temperature), -FLT_MAX), FLT_MAX);
}

__device__ __forceinline__ float GumbelNoise(uint64_t seed, uint32_t sequence, uint32_t position, int id) {
  const float u = fminf(core::SamplingUniform(seed, sequence, position, static_cast<uint32_t>(id)), kMaxUniform);
  return -logf(-logf(u));
}

__device__ __forceinline__ bool Better(float a, int a_id, float b, int b_id) {
  return a > b || (a == b && a_id < b_id);
}

// ---- Block primitives (every thread of the CTA calls them) ----

// Calls f(i, row[i], valid) for this thread's entries, four loads in flight. Every thread makes
// the same number of calls (valid false past the end), so f may use warp collectives.
template <typename F>
__device__ __forceinline__ void ForEachEntry(const float* row, int n, F&& f) {
  constexpr int kBatch = 4;
  for (int base = 0; base < n; base += kBatch * kThreads) {
    float v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = base + k * kThreads + static_cast<int>(threadIdx.x);
      v[k] = i < n ? row[i] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = base + k * kThreads + static_cast<int>(threadIdx.x);
      f(i, v[k], i < n);
    }
  }
}

// Adds one to count[digit] for each lane with a digit, one atomic per distinct digit in the warp.
__device__ __forceinline__ void WarpCount(uint32_t* count, uint32_t digit) {
  const unsigned peers = __match_any_sync(0xffffffffu, digit);
  if (digit != kNoDigit && static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1) {
    atomicAdd(&count[digit], static_cast<uint32_t>(__popc(peers)));
  }
}

// The leading barrier lets the scratch be reused by consecutive calls.
__device__ __forceinline__ float BlockMax(float v, Shared& sh) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh.reduce_f[threadIdx.x / 32] = v;
  __syncthreads();
  float r = sh.reduce_f[0];
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, sh.reduce_f[w]);
  return r;
}

__device__ __forceinline__ unsigned long long BlockSum(unsigned long long v, Shared& sh) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh.reduce_u64[threadIdx.x / 32] = v;
  __syncthreads();
  unsigned long long r = 0;
  for (int w = 0; w < kWarps; ++w) r += sh.reduce_u64[w];
  return r;
}

__device__ __forceinline__ int BlockMinInt(int v, Shared& sh) {
  for (int offset = 16; offset > 0; offset /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh.reduce_i[threadIdx.x / 32] = v;
  __syncthreads();
  int r = sh.reduce_i[0];
  for (int w = 1; w < kWarps; ++w) r = min(r, sh.reduce_i[w]);
  return r;
}

// The best (score desc, id asc) over the CTA.
__device__ __forceinline__ ScoreId BlockBest(ScoreId v, Shared& sh) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float score = __shfl_xor_sync(0xffffffffu, v.score, offset);
    const int32_t id = __shfl_xor_sync(0xffffffffu, v.id, offset);
    if (Better(score, id, v.score, v.id)) v = ScoreId{score, id};
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    sh.reduce_f[threadIdx.x / 32] = v.score;
    sh.reduce_i[threadIdx.x / 32] = v.id;
  }
  __syncthreads();
  ScoreId r{sh.reduce_f[0], sh.reduce_i[0]};
  for (int w = 1; w < kWarps; ++w) {
    if (Better(sh.reduce_f[w], sh.reduce_i[w], r.score, r.id)) r = ScoreId{sh.reduce_f[w], sh.reduce_i[w]};
  }
  return r;
}

// Exclusive prefix sum of v in thread order.
template <typename T>
__device__ __forceinline__ T BlockExclusiveSum(T v, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inclusive = v;
  for (int d = 1; d < 32; d *= 2) {
    const T other = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  T before = 0;
  for (int w = 0; w < warp; ++w) before += scratch[w];
  return before + inclusive - v;
}

// The bins of one select level: thread t owns kBinsPerThread consecutive bins in descending digit
// order (thread 0 the highest digits), so prefix sums in thread order are "mass above".
__device__ __forceinline__ int BinOfOrder(int order) { return kBins - 1 - order; }

// Zeroes the histograms; the leading barrier waits for the readers of the previous level.
__device__ __forceinline__ void ClearBins(Shared& sh, bool with_mass) {
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    sh.count[b] = 0;
    if (with_mass) sh.mass[b] = 0;
  }
  if (threadIdx.x == 0) sh.pick_order = -1;
  __syncthreads();
}

// The threshold T such that exactly k of the entries for which key_of(i, value, &key) is true
// have key >= T (keys unique, 1 <= k <= their number).
template <typename KeyOf>
__device__ uint64_t SelectTopK(const float* row, int n, int k, KeyOf key_of, Shared& sh) {
  uint64_t prefix = 0;
  uint32_t remaining = static_cast<uint32_t>(k);
  for (int hi = kKeyBits; hi > 0; hi -= kDigitBits) {
    const int lo = hi > kDigitBits ? hi - kDigitBits : 0;
    const uint64_t digit_mask = (1ull << (hi - lo)) - 1;
    ClearBins(sh, false);
    ForEachEntry(row, n, [&](int i, float value, bool valid) {
      uint64_t key = 0;
      const bool in = valid && key_of(i, value, &key) && (key >> hi) == (prefix >> hi);
      WarpCount(sh.count, in ? static_cast<uint32_t>((key >> lo) & digit_mask) : kNoDigit);
    });
    __syncthreads();
    uint32_t c[kBinsPerThread], total = 0;
    for (int j = 0; j < kBinsPerThread; ++j) total += c[j] = sh.count[BinOfOrder(threadIdx.x * kBinsPerThread + j)];
    uint32_t before = BlockExclusiveSum(total, sh.scan_u32);
    for (int j = 0; j < kBinsPerThread; ++j) {
      // Exactly one bin holds the k-th key: fewer than `remaining` keys above it, enough with it.
      if (before < remaining && remaining <= before + c[j]) {
        sh.pick_order = threadIdx.x * kBinsPerThread + j;
        sh.pick_before = before;
        sh.pick_count = c[j];
      }
      before += c[j];
    }
    __syncthreads();
    prefix |= static_cast<uint64_t>(BinOfOrder(sh.pick_order)) << lo;
    remaining -= sh.pick_before;
    if (sh.pick_count == remaining) break;  // the whole bucket is in: its lowest key bounds it
  }
  return prefix;
}

// The threshold T of the top-p prefix: the entries for which entry_of(i, value, &key, &mass) is
// true, in key desc order, are kept while the mass of the entries before them is < limit
// (limit > 0, so the first is always kept); they are those with key >= T.
template <typename EntryOf>
__device__ uint64_t SelectMassPrefix(const float* row, int n, double limit, EntryOf entry_of, Shared& sh) {
  uint64_t prefix = 0;
  unsigned long long above = 0;  // mass of the entries above the current prefix
  for (int hi = kKeyBits; hi > 0; hi -= kDigitBits) {
    const int lo = hi > kDigitBits ? hi - kDigitBits : 0;
    const uint64_t digit_mask = (1ull << (hi - lo)) - 1;
    ClearBins(sh, true);
    ForEachEntry(row, n, [&](int i, float value, bool valid) {
      uint64_t key = 0;
      unsigned long long mass = 0;
      const bool in = valid && entry_of(i, value, &key, &mass) && (key >> hi) == (prefix >> hi);
      const uint32_t digit = in ? static_cast<uint32_t>((key >> lo) & digit_mask) : kNoDigit;
      WarpCount(sh.count, digit);
      if (in) atomicAdd(&sh.mass[digit], mass);
    });
    __syncthreads();
    uint32_t c[kBinsPerThread];
    unsigned long long m[kBinsPerThread], total = 0;
    for (int j = 0; j < kBinsPerThread; ++j) {
      const int bin = BinOfOrder(threadIdx.x * kBinsPerThread + j);
      c[j] = sh.count[bin];
      total += m[j] = sh.mass[bin];
    }
    unsigned long long before = BlockExclusiveSum(total, sh.scan_u64);
    unsigned long long bin_before[kBinsPerThread];
    for (int j = 0; j < kBinsPerThread; ++j) {
      bin_before[j] = before;
      // A bucket's first entry is kept iff the mass before it is < limit; the last entry kept
      // lies in the lowest such bucket.
      if (c[j] > 0 && static_cast<double>(above + before) < limit) {
        atomicMax(&sh.pick_order, static_cast<int32_t>(threadIdx.x * kBinsPerThread + j));
      }
      before += m[j];
    }
    __syncthreads();
    const int order = sh.pick_order;
    if (order < 0) return ~0ull;  // no entry at all (only with min_p > 1, which Validate() refuses)
    if (order / kBinsPerThread == static_cast<int>(threadIdx.x)) {
      const int j = order % kBinsPerThread;
      sh.pick_count = c[j];
      sh.pick_mass_before = bin_before[j];
      sh.pick_mass = m[j];
    }
    __syncthreads();
    prefix |= static_cast<uint64_t>(BinOfOrder(order)) << lo;
    above += sh.pick_mass_before;
    // Done when the bucket is one entry, or all of it is kept (its whole mass fits under limit,
    // so no lower bucket was kept).
    if (sh.pick_count == 1 || static_cast<double>(above + sh.pick_mass) < limit) break;
  }
  return prefix;
}

// ---- The steps of a row ----

// log Z of the raw logits, and the top n of them (value desc, id asc) into the row's logprob
// slots; the slots past n get id -1.
__device__ float RawLogprobs(const float* row, int vocab, int n, Shared& sh, int32_t* top_ids, float* top_logprobs) {
  float row_max = -FLT_MAX;
  ForEachEntry(row, vocab, [&](int, float v, bool valid) {
    if (valid) row_max = fmaxf(row_max, v);
  });
  row_max = BlockMax(row_max, sh);
  unsigned long long sum = 0;
  ForEachEntry(row, vocab, [&](int, float v, bool valid) {
    if (valid) sum += FixedMass(expf(v - row_max));
  });
  sum = BlockSum(sum, sh);
  const float log_z = row_max + static_cast<float>(log(static_cast<double>(sum) / static_cast<double>(kFixedOne)));

  const uint64_t threshold = SelectTopK(
      row, vocab, n,
      [](int i, float v, uint64_t* key) {
        *key = EntryKey(v, i);
        return true;
      },
      sh);
  if (threadIdx.x == 0) sh.top_found = 0;
  __syncthreads();
  ForEachEntry(row, vocab, [&](int i, float v, bool valid) {
    const uint64_t key = EntryKey(v, i);
    if (valid && key >= threshold) {
      const int slot = atomicAdd(&sh.top_found, 1);
      if (slot < kMaxLogprobs) sh.top_key[slot] = key;
    }
  });
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int a = 1; a < n; ++a) {  // at most 20 keys, unique
      const uint64_t key = sh.top_key[a];
      int b = a;
      for (; b > 0 && sh.top_key[b - 1] < key; --b) sh.top_key[b] = sh.top_key[b - 1];
      sh.top_key[b] = key;
    }
    for (int j = 0; j < kMaxLogprobs; ++j) {
      const int id = j < n ? KeyId(sh.top_key[j]) : -1;
      top_ids[j] = id;
      top_logprobs[j] = j < n ? row[id] - log_z : -INFINITY;
    }
  }
  __syncthreads();  // thread 0 read the raw row; the penalties come next
  return log_z;
}

__device__ __forceinline__ float Penalized(float logit, uint32_t slot, const SampleParamsGpu& p) {
  // The operations of ApplyPenalties one by one, rounded as the CPU rounds them (no FMA).
  if (p.repetition_penalty != 1.0f) {
    logit = logit > 0 ? __fdiv_rn(logit, p.repetition_penalty) : __fmul_rn(logit, p.repetition_penalty);
  }
  const uint32_t outputs = slot & kCountMask;
  if ((p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) && outputs > 0) {
    logit = __fsub_rn(logit, __fadd_rn(p.presence_penalty, __fmul_rn(p.frequency_penalty, __uint2float_rn(outputs))));
  }
  return logit;
}

// ApplyPenalties in place over the row's history (prompt, then output). `slots` is this row's
// vocab-sized slice of the workspace; only the history's entries are touched, so it needs no
// clearing between steps.
__device__ void ApplyHistoryPenalties(float* row, int vocab, const SampleParamsGpu& p, const int32_t* history,
                                      uint32_t* slots) {
  const int n = p.prompt_len + p.output_len;
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const int t = history[j];
    if (t >= 0 && t < vocab) __stcg(&slots[t], kHistoryTag);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const int t = history[j];
    if (t < 0 || t >= vocab) continue;
    if (j < p.prompt_len) {
      atomicOr(&slots[t], kPromptBit);
    } else {
      atomicAdd(&slots[t], 1u);
    }
  }
  __syncthreads();
  // A token may appear many times. Per chunk of the history every thread reads first and writes
  // after a barrier, so the copies of a token in one chunk read the same raw logit and write the
  // same result; a later chunk finds the slot no longer tagged and skips it.
  for (int base = 0; base < n; base += kThreads) {
    const int j = base + static_cast<int>(threadIdx.x);
    int t = -1;
    float raw = 0.0f, penalized = 0.0f;
    if (j < n) {
      t = history[j];
      if (t >= 0 && t < vocab) {
        const uint32_t slot = __ldcg(&slots[t]);
        if ((slot & kHistoryTag) == kHistoryTag) {
          raw = row[t];
          penalized = Penalized(raw, slot, p);
        } else {
          t = -1;
        }
      } else {
        t = -1;
      }
    }
    __syncthreads();
    if (t >= 0) {
      row[t] = penalized;
      __stcg(&slots[t], __float_as_uint(raw));
    }
    __syncthreads();
  }
}

// The raw logit of `token` after the penalties changed the row: kept in its slot if the token is
// in the history.
__device__ float RawLogit(const float* row, int token, const SampleParamsGpu& p, const int32_t* history,
                          const uint32_t* slots, Shared& sh) {
  if (threadIdx.x == 0) sh.found = 0;
  __syncthreads();
  const int n = p.prompt_len + p.output_len;
  for (int j = threadIdx.x; j < n; j += kThreads) {
    if (history[j] == token) sh.found = 1;
  }
  __syncthreads();
  return sh.found ? __uint_as_float(__ldcg(&slots[token])) : row[token];
}

__device__ int32_t GreedyToken(const float* row, int vocab, Shared& sh) {
  ScoreId best{-INFINITY, INT32_MAX};
  ForEachEntry(row, vocab, [&](int i, float v, bool valid) {
    if (valid && Better(v, i, best.score, best.id)) best = ScoreId{v, i};
  });
  return BlockBest(best, sh).id;
}

__device__ int32_t SampledToken(const float* row, int vocab, const SampleParamsGpu& p, Shared& sh) {
  const float temperature = p.temperature;
  // The largest z, then the lowest id that has it: in K1 and in K2 (e = 1) always. Two plain
  // reductions (a max of floats, a min of ints) rather than one of (score, id) pairs.
  float local_max = -INFINITY;
  ForEachEntry(row, vocab, [&](int, float v, bool valid) {
    if (valid) local_max = fmaxf(local_max, ScaledLogit(v, temperature));
  });
  const float z_max = BlockMax(local_max, sh);
  int local_id = INT32_MAX;
  ForEachEntry(row, vocab, [&](int i, float v, bool valid) {
    if (valid && ScaledLogit(v, temperature) == z_max) local_id = min(local_id, i);
  });
  const ScoreId top{z_max, BlockMinInt(local_id, sh)};

  // K1 = {key(z, i) >= k1}; 0 (everything) when top_k is off.
  uint64_t k1 = 0;
  if (p.top_k > 0 && p.top_k < vocab) {
    k1 = SelectTopK(
        row, vocab, p.top_k,
        [temperature](int i, float v, uint64_t* key) {
          *key = EntryKey(ScaledLogit(v, temperature), i);
          return true;
        },
        sh);
  }
  const float min_p = p.min_p;
  // The top-p prefix = {key(e, i) >= kp} within K2; 0 (all of K2) when top_p is off.
  uint64_t kp = 0;
  if (p.top_p < 1.0f) {
    unsigned long long sum = 0;
    ForEachEntry(row, vocab, [&](int i, float v, bool valid) {
      const float z = ScaledLogit(v, temperature);
      if (valid && EntryKey(z, i) >= k1) sum += FixedMass(expf(z - z_max));
    });
    sum = BlockSum(sum, sh);
    // At least half a unit, so that the first entry (mass before it 0) is kept whatever top_p.
    const double limit = fmax(static_cast<double>(p.top_p) * static_cast<double>(sum), 0.5);
    kp = SelectMassPrefix(
        row, vocab, limit,
        [&](int i, float v, uint64_t* key, unsigned long long* mass) {
          const float z = ScaledLogit(v, temperature);
          if (EntryKey(z, i) < k1) return false;
          const float e = expf(z - z_max);
          if (!(e >= min_p)) return false;
          *key = EntryKey(e, i);
          *mass = FixedMass(e);
          return true;
        },
        sh);
  }

  // The kept set of sampler.h: in K1, e >= min_p, in the top-p prefix (e is not needed when
  // neither min_p nor top_p is on: e >= 0 and every key >= 0).
  const bool needs_e = min_p > 0.0f || kp != 0;
  auto kept = [&](int i, float z) {
    if (EntryKey(z, i) < k1) return false;
    if (!needs_e) return true;
    const float e = expf(z - z_max);
    return e >= min_p && EntryKey(e, i) >= kp;
  };
  const uint64_t seed = (static_cast<uint64_t>(p.seed_hi) << 32) | p.seed_lo;
  const uint32_t sequence = static_cast<uint32_t>(p.sequence), position = static_cast<uint32_t>(p.position);
  // Every thread starts from the score of the top entry when it is kept (it is unless a lower id
  // ties it at e == 1 and top_p keeps only that one): an entry whose z is more than
  // kMaxGumbelNoise below the best score so far cannot win, and its Philox rounds are skipped.
  ScoreId best{-INFINITY, INT32_MAX};
  if (kept(top.id, z_max)) best = ScoreId{z_max + GumbelNoise(seed, sequence, position, top.id), top.id};
  ForEachEntry(row, vocab, [&](int i, float v, bool valid) {
    const float z = ScaledLogit(v, temperature);
    if (!valid || z + kMaxGumbelNoise < best.score || !kept(i, z)) return;
    const float score = z + GumbelNoise(seed, sequence, position, i);
    if (Better(score, i, best.score, best.id)) best = ScoreId{score, i};
  });
  best = BlockBest(best, sh);
  // Nothing kept only with min_p > 1 (not Validate()d): the CPU then takes the top entry too.
  return best.id == INT32_MAX ? top.id : best.id;
}

__global__ void __launch_bounds__(kThreads)
    SampleRowsKernel(float* logits, int vocab, const SampleParamsGpu* params, const int32_t* history,
                     uint32_t* workspace, int32_t* tokens, float* logprob, int32_t* top_ids, float* top_logprobs) {
  __shared__ Shared sh;
  const int r = blockIdx.x;
  if (vocab > kMaxVocab) {
    if (threadIdx.x == 0) tokens[r] = -1;
    return;
  }
  const SampleParamsGpu p = params[r];
  float* row = logits + static_cast<int64_t>(r) * vocab;
  uint32_t* slots = workspace + static_cast<int64_t>(r) * vocab;
  const int32_t* row_history = history != nullptr ? history + p.history_start : nullptr;

  const bool has_logprob_slots = logprob != nullptr && top_ids != nullptr && top_logprobs != nullptr;
  const int n_top = has_logprob_slots ? min(max(p.logprobs, 0), min(kMaxLogprobs, vocab)) : 0;
  float log_z = 0.0f;
  if (n_top > 0) {
    log_z = RawLogprobs(row, vocab, n_top, sh, top_ids + static_cast<int64_t>(r) * kMaxLogprobs,
                        top_logprobs + static_cast<int64_t>(r) * kMaxLogprobs);
  }
  const bool penalized = row_history != nullptr && p.prompt_len + p.output_len > 0 &&
                         (p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f);
  if (penalized) {
    ApplyHistoryPenalties(row, vocab, p, row_history, slots);
    __syncthreads();
  }
  const int32_t token = p.temperature == 0.0f ? GreedyToken(row, vocab, sh) : SampledToken(row, vocab, p, sh);
  if (threadIdx.x == 0) tokens[r] = token;
  if (n_top > 0) {
    const float raw = penalized ? RawLogit(row, token, p, row_history, slots, sh) : row[token];
    if (threadIdx.x == 0) logprob[r] = raw - log_z;
  }
}

}  // namespace

void SampleRows(float* logits, int rows, int vocab, const SampleParamsGpu* params, const int32_t* history,
                void* workspace, int32_t* tokens, float* logprob, int32_t* top_ids, float* top_logprobs,
                cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return;
  SampleRowsKernel<<<rows, kThreads, 0, stream>>>(logits, vocab, params, history, static_cast<uint32_t*>(workspace),
                                                  tokens, logprob, top_ids, top_logprobs);
}

// A uint32 slot per vocabulary entry per row, for the penalty counts: 39 MB for 64 rows of 151936.
int64_t SamplingWorkspaceBytes(int rows, int vocab) {
  return static_cast<int64_t>(rows) * vocab * static_cast<int64_t>(sizeof(uint32_t));
}

}  // namespace moe::runtime::cuda

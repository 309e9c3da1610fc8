#include "cpu/attention.h"

// The kernel's 16-lane vectors never cross a call (every function that takes or returns one is
// inlined), so GCC's warning that passing one changes the ABI does not apply: not here, nor in
// core::Exp2Fraction.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/kernels.h"
#include "moe/core/cpu_features.h"
#include "moe/core/fast_exp.h"

namespace moe::runtime::internal {

void PagedAttentionReference(const PagedKv& kv, const AttentionQueries& a, ParallelLoop parallel) {
  const int d = kv.head_dim, bs = kv.block_size;
  const int group = a.num_heads / kv.num_kv_heads;
  const int64_t q_width = static_cast<int64_t>(a.num_heads) * d;
  const int64_t per_block = static_cast<int64_t>(bs) * kv.num_kv_heads * d;
  const int64_t rows = a.seq_start[a.num_seqs];
  parallel(rows * a.num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / a.num_heads;
      const int h = static_cast<int>(i % a.num_heads);
      const int64_t seq = std::upper_bound(a.seq_start, a.seq_start + a.num_seqs + 1, r) - a.seq_start - 1;
      const int32_t* table = a.block_table + seq * a.max_blocks;
      const int64_t len = a.positions[r] + 1;  // causal: positions 0..p
      const int kvh = h / group;
      auto at = [&](const float* base, int64_t p) {
        return base + table[p / bs] * per_block + (static_cast<int64_t>(kvh) * bs + p % bs) * d;
      };
      const float* q = a.q + r * q_width + static_cast<int64_t>(h) * d;
      scores.resize(len);
      float max_score = -INFINITY;
      for (int64_t p = 0; p < len; ++p) {
        scores[p] = DotF32(q, at(kv.k, p), d) * a.scale;
        max_score = std::max(max_score, scores[p]);
      }
      float sum = 0;
      for (int64_t p = 0; p < len; ++p) {
        scores[p] = std::exp(scores[p] - max_score);
        sum += scores[p];
      }
      float* o = a.out + r * q_width + static_cast<int64_t>(h) * d;
      std::fill(o, o + d, 0.0f);
      const float inv = 1.0f / sum;
      for (int64_t p = 0; p < len; ++p) Axpy(scores[p] * inv, at(kv.v, p), d, o);
    }
  });
}

namespace {

// A block's queries are the lanes of one vector: 16 of them (the heads of a GQA group, and for a
// prefill chunk as many of its tokens as fit), so that each key's scores, the softmax and each
// value's weights are one vector operation for the whole block.
constexpr int kLanes = 16;
// Keys per tile: their 16 vectors of scores stay in registers (AVX-512 has 32) between the score
// pass and the value pass.
constexpr int kTile = 16;
// A one-token chunk (decode) with more keys than this splits them, in at most kMaxSplits parts of
// at least kSplitKeys keys, combined afterwards: at batch 1 a sequence has only num_kv_heads
// blocks, too few for the threads. (A prefill chunk has blocks enough; splitting it would only
// add partial results.)
constexpr int kSplitKeys = 128;
constexpr int kMaxSplits = 16;
static_assert(kSplitKeys % kTile == 0, "splits start at a tile");

using V = float __attribute__((vector_size(64), __may_alias__));
using VI = int32_t __attribute__((vector_size(64), __may_alias__));

}  // namespace

struct AttentionScratch::Item {
  int32_t seq;        // its row of the block table
  int32_t first_row;  // consecutive rows of the sequence: the block's tokens
  int32_t rows;
  int32_t kv_head;
  int32_t first_head;  // heads [first_head, first_head + heads) of the kv head's group
  int32_t heads;
  int32_t key_begin;  // keys [key_begin, key_end)
  int32_t key_end;
  int32_t partial;  // the split's slot among the partial results, or -1: the outputs
};

// A one-token block whose keys were split: its splits' partial results, in key order.
struct AttentionScratch::Merge {
  Item block;
  int32_t first_partial;
  int32_t splits;
};

struct alignas(64) AttentionScratch::Lanes {
  float v[kLanes];
};

AttentionScratch::AttentionScratch() = default;
AttentionScratch::~AttentionScratch() = default;

namespace {

using Item = AttentionScratch::Item;
using Merge = AttentionScratch::Merge;
using Lanes = AttentionScratch::Lanes;

// One thread's tiles: the block's queries by dimension (qt, scaled), its running output by
// dimension (o), and zero-padded copies of the keys and values of a tile that is short or lies
// across blocks (16 rows each).
struct ThreadTiles {
  Lanes* qt;
  Lanes* o;
  float* k_pad;
  float* v_pad;
};
ThreadTiles TilesFor(int d) {
  thread_local std::vector<Lanes> buffer;
  if (buffer.size() < 4 * static_cast<size_t>(d)) buffer.resize(4 * static_cast<size_t>(d));
  Lanes* b = buffer.data();
  return ThreadTiles{b, b + d, b[2 * d].v, b[3 * d].v};
}

// Everything below is inlined into the entry points of each instruction set, which compile it for
// theirs: the 16-lane vectors are one AVX-512 register, two AVX2 ones, or four SSE ones.
#define MOE_INLINE [[gnu::always_inline]] inline

MOE_INLINE V Splat(float x) { return V{} + x; }
MOE_INLINE V Load(const Lanes* p) { return *reinterpret_cast<const V*>(p); }
MOE_INLINE void Store(Lanes* p, const V& x) { *reinterpret_cast<V*>(p) = x; }
MOE_INLINE V Max(const V& a, const V& b) { return a > b ? a : b; }

// e^x lane by lane: 2^t for t = x log2(e), split into round(t) and a degree-6 polynomial of the
// rest (core::Exp2Fraction, as the experts' SiLU), t clamped to [-126, 126]. A NaN stays NaN.
MOE_INLINE V Exp(const V& x) {
  V t = x * 1.44269504088896341f;
  t = t < -126.0f ? Splat(-126.0f) : t;
  t = t > 126.0f ? Splat(126.0f) : t;
  const V magic = Splat(12582912.0f);  // 1.5 * 2^23: adding and removing it rounds to an integer
  const V r = (t + magic) - magic;
  const V p = core::Exp2Fraction(t - r);
  const VI scale = (__builtin_convertvector(r, VI) + 127) << 23;
  return p * reinterpret_cast<const V&>(scale);
}

// One tile of n <= 16 keys (rows of head_dim floats at kt and vt, 16 rows readable) for every
// lane: the scores, masked where a key lies past the lane's position, then the online softmax
// (running max m and sum l) and the weighted values added into o. A lane whose keys are all masked
// so far keeps m = -inf and adds exact zeros. Bound by the FMA units: each key element is one
// broadcast multiply-add for 16 queries.
template <int kD>
MOE_INLINE void AttendTile(const float* kt, const float* vt, int head_dim, int n, int first_key, const VI& pos,
                           const Lanes* qt, Lanes* o, V& m, V& l) {
  const int d = kD > 0 ? kD : head_dim;
  V s[kTile];
#pragma GCC unroll 16
  for (int j = 0; j < kTile; ++j) s[j] = V{};
  for (int c = 0; c < d; ++c) {
    const V q = Load(qt + c);
#pragma GCC unroll 16
    for (int j = 0; j < kTile; ++j) s[j] += kt[j * d + c] * q;
  }
  const V neg_inf = Splat(-std::numeric_limits<float>::infinity());
  V m_new = m;
#pragma GCC unroll 16
  for (int j = 0; j < kTile; ++j) {
    const VI key = VI{} + (j < n ? first_key + j : std::numeric_limits<int32_t>::max());
    s[j] = key <= pos ? s[j] : neg_inf;
    m_new = Max(m_new, s[j]);
  }
  const V m_use = m_new == neg_inf ? V{} : m_new;  // lanes with no key yet: any finite value
  const V alpha = Exp(m - m_use);
  V sum = V{};
#pragma GCC unroll 16
  for (int j = 0; j < kTile; ++j) {
    s[j] = s[j] == neg_inf ? V{} : Exp(s[j] - m_use);
    sum += s[j];
  }
  l = l * alpha + sum;
  for (int c = 0; c < d; ++c) {
    V acc = Load(o + c) * alpha;
#pragma GCC unroll 16
    for (int j = 0; j < kTile; ++j) acc += vt[j * d + c] * s[j];
    Store(o + c, acc);
  }
  m = m_new;
}

struct KernelArgs {
  const PagedKv* kv;
  const AttentionQueries* q;
  Lanes* partials;
};

// Lane i of a block: token i / heads, head i % heads.
MOE_INLINE float* OutputRow(const AttentionQueries& a, int d, const Item& it, int lane) {
  const int64_t row = it.first_row + lane / it.heads;
  return a.out + row * a.num_heads * d + static_cast<int64_t>(it.first_head + lane % it.heads) * d;
}

// out = o / l for the block's lanes.
MOE_INLINE void WriteOutputs(const AttentionQueries& a, int d, const Item& it, const Lanes* o, const V& l) {
  const V inv = Splat(1.0f) / l;
  const int lanes = it.rows * it.heads;
  for (int lane = 0; lane < lanes; ++lane) {
    float* out = OutputRow(a, d, it, lane);
    for (int c = 0; c < d; ++c) out[c] = o[c].v[lane] * inv[lane];
  }
}

template <int kD>
MOE_INLINE void AttendItem(const KernelArgs& k, const Item& it, const ThreadTiles& t) {
  const PagedKv& kv = *k.kv;
  const AttentionQueries& a = *k.q;
  const int d = kD > 0 ? kD : kv.head_dim;
  const int bs = kv.block_size;
  const int lanes = it.rows * it.heads;
  // Lanes past the block's queries see every real key (and compute what nobody reads).
  VI pos = VI{} + (std::numeric_limits<int32_t>::max() - 1);
  for (int c = 0; c < d; ++c) Store(t.qt + c, V{});
  for (int lane = 0; lane < lanes; ++lane) {
    const int64_t row = it.first_row + lane / it.heads;
    const float* q = a.q + row * a.num_heads * d + static_cast<int64_t>(it.first_head + lane % it.heads) * d;
    for (int c = 0; c < d; ++c) t.qt[c].v[lane] = q[c] * a.scale;
    pos[lane] = a.positions[row];
  }
  for (int c = 0; c < d; ++c) Store(t.o + c, V{});
  V m = Splat(-std::numeric_limits<float>::infinity()), l = V{};
  const int32_t* table = a.block_table + static_cast<int64_t>(it.seq) * a.max_blocks;
  const int64_t per_block = static_cast<int64_t>(bs) * kv.num_kv_heads * d;
  const int64_t head_offset = static_cast<int64_t>(it.kv_head) * bs * d;
  // Tiles are the keys [16 i, 16 i + 16) whatever the cache's block size, so that a query's sums
  // run in the same order in any step: a decode row gets the bits its prefill row got (without a
  // split), and neither depends on where its blocks lie.
  auto at = [&](int key) { return table[key / bs] * per_block + head_offset + static_cast<int64_t>(key % bs) * d; };
  for (int key = it.key_begin; key < it.key_end; key += kTile) {
    const int n = std::min(kTile, it.key_end - key);
    const float* kt = kv.k + at(key);
    const float* vt = kv.v + at(key);
    if (n < kTile || bs % kTile != 0) {  // a short tile, or one across blocks: copied, zero-padded
      for (int j = 0; j < n; ++j) {
        std::memcpy(t.k_pad + j * d, kv.k + at(key + j), sizeof(float) * d);
        std::memcpy(t.v_pad + j * d, kv.v + at(key + j), sizeof(float) * d);
      }
      std::fill(t.k_pad + n * d, t.k_pad + kTile * d, 0.0f);
      std::fill(t.v_pad + n * d, t.v_pad + kTile * d, 0.0f);
      kt = t.k_pad;
      vt = t.v_pad;
    }
    AttendTile<kD>(kt, vt, d, n, key, pos, t.qt, t.o, m, l);
  }
  if (it.partial < 0) {
    WriteOutputs(a, d, it, t.o, l);
    return;
  }
  Lanes* p = k.partials + static_cast<int64_t>(it.partial) * (d + 2);
  std::memcpy(p, t.o, sizeof(Lanes) * d);
  Store(p + d, m);
  Store(p + d + 1, l);
}

MOE_INLINE void AttendItems(const KernelArgs& k, const Item* items, int64_t begin, int64_t end) {
  const int d = k.kv->head_dim;
  const ThreadTiles t = TilesFor(d);
  for (int64_t i = begin; i < end; ++i) {
    // The common head sizes with constant offsets between a tile's rows.
    switch (d) {
      case 64:
        AttendItem<64>(k, items[i], t);
        break;
      case 128:
        AttendItem<128>(k, items[i], t);
        break;
      default:
        AttendItem<0>(k, items[i], t);
    }
  }
}

// A split block's output: its splits' sums, each scaled by e^(its max - the overall max).
MOE_INLINE void MergeItems(const KernelArgs& k, const Merge* merges, int64_t begin, int64_t end) {
  const int d = k.kv->head_dim;
  const ThreadTiles t = TilesFor(d);
  for (int64_t i = begin; i < end; ++i) {
    const Merge& mg = merges[i];
    const Lanes* first = k.partials + static_cast<int64_t>(mg.first_partial) * (d + 2);
    V m = Splat(-std::numeric_limits<float>::infinity());
    for (int s = 0; s < mg.splits; ++s) m = Max(m, Load(first + static_cast<int64_t>(s) * (d + 2) + d));
    for (int c = 0; c < d; ++c) Store(t.o + c, V{});
    V l = V{};
    for (int s = 0; s < mg.splits; ++s) {
      const Lanes* p = first + static_cast<int64_t>(s) * (d + 2);
      const V l_s = Load(p + d + 1);
      const V w = l_s > 0.0f ? Exp(Load(p + d) - m) : V{};
      l += w * l_s;
      for (int c = 0; c < d; ++c) Store(t.o + c, Load(t.o + c) + w * Load(p + c));
    }
    WriteOutputs(*k.q, d, mg.block, t.o, l);
  }
}

// The entry points: the items' attention, or the split blocks' merges, built for each set.
MOE_INLINE void Run(const KernelArgs& k, const Item* items, int64_t begin, int64_t end) {
  AttendItems(k, items, begin, end);
}
MOE_INLINE void Run(const KernelArgs& k, const Merge* merges, int64_t begin, int64_t end) {
  MergeItems(k, merges, begin, end);
}
template <typename Work>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void RunAvx512(const KernelArgs& k,
                                                                                      const Work* work, int64_t begin,
                                                                                      int64_t end) {
  Run(k, work, begin, end);
}
template <typename Work>
__attribute__((target("avx2,fma"))) void RunAvx2(const KernelArgs& k, const Work* work, int64_t begin, int64_t end) {
  Run(k, work, begin, end);
}
template <typename Work>
void RunPortable(const KernelArgs& k, const Work* work, int64_t begin, int64_t end) {
  Run(k, work, begin, end);
}
template <typename Work>
void RunOn(AttentionIsa isa, const KernelArgs& k, const std::vector<Work>& work, ParallelLoop parallel) {
  auto run = isa == AttentionIsa::kAvx512 ? RunAvx512<Work>
             : isa == AttentionIsa::kAvx2 ? RunAvx2<Work>
                                          : RunPortable<Work>;
  parallel(static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) { run(k, work.data(), begin, end); });
}

// The blocks of every sequence, kv head and group of up to 16 of its heads, as many tokens each as
// fill 16 lanes; the blocks of one kv head are listed together (they read the same keys), the
// latest tokens first (they have the most keys: the long items start early). A one-token chunk's
// block with many keys is listed once per split, and merged.
void PlanItems(const PagedKv& kv, const AttentionQueries& a, std::vector<Item>* items, std::vector<Merge>* merges,
               int64_t* partials) {
  items->clear();
  merges->clear();
  *partials = 0;
  const int group = a.num_heads / kv.num_kv_heads;
  const int heads = std::min(group, kLanes);
  const int tokens = std::max(1, kLanes / heads);
  for (int s = 0; s < a.num_seqs; ++s) {
    const int32_t r0 = a.seq_start[s], r1 = a.seq_start[s + 1];
    for (int kvh = 0; kvh < kv.num_kv_heads; ++kvh) {
      for (int h0 = 0; h0 < group; h0 += heads) {
        for (int32_t end = r1; end > r0; end -= tokens) {
          const int32_t first = std::max(r0, end - tokens);
          int32_t key_end = 0;
          for (int32_t r = first; r < end; ++r) key_end = std::max(key_end, a.positions[r] + 1);
          const Item block{s, first, end - first, kvh, kvh * group + h0, std::min(heads, group - h0), 0, key_end, -1};
          if (r1 - r0 > 1 || key_end <= kSplitKeys) {
            items->push_back(block);
            continue;
          }
          const int per_split = (key_end + kMaxSplits - 1) / kMaxSplits;
          const int split = std::max(kSplitKeys, (per_split + kTile - 1) / kTile * kTile);
          const int splits = (key_end + split - 1) / split;
          merges->push_back(Merge{block, static_cast<int32_t>(*partials), splits});
          for (int i = 0; i < splits; ++i) {
            Item part = block;
            part.key_begin = i * split;
            part.key_end = std::min(key_end, (i + 1) * split);
            part.partial = static_cast<int32_t>((*partials)++);
            items->push_back(part);
          }
        }
      }
    }
  }
}

}  // namespace

const char* AttentionIsaName(AttentionIsa isa) {
  switch (isa) {
    case AttentionIsa::kPortable:
      return "portable";
    case AttentionIsa::kAvx2:
      return "avx2";
    case AttentionIsa::kAvx512:
      return "avx512";
  }
  return "?";
}

bool AttentionIsaSupported(AttentionIsa isa) {
  const core::CpuFeatures& cpu = core::GetCpuFeatures();
  switch (isa) {
    case AttentionIsa::kPortable:
      return true;
    case AttentionIsa::kAvx2:
      return cpu.avx2 && cpu.fma;
    case AttentionIsa::kAvx512:
      return cpu.avx2 && cpu.fma && cpu.avx512f && cpu.avx512bw && cpu.avx512vl;
  }
  return false;
}

AttentionIsa BestAttentionIsa() {
  for (AttentionIsa isa : {AttentionIsa::kAvx512, AttentionIsa::kAvx2}) {
    if (AttentionIsaSupported(isa)) return isa;
  }
  return AttentionIsa::kPortable;
}

void PagedAttention(const PagedKv& kv, const AttentionQueries& a, AttentionIsa isa, ParallelLoop parallel,
                    AttentionScratch& scratch) {
  int64_t partials = 0;
  PlanItems(kv, a, &scratch.items_, &scratch.merges_, &partials);
  const size_t partial_lanes = static_cast<size_t>(partials) * (kv.head_dim + 2);
  if (scratch.partials_.size() < partial_lanes) scratch.partials_.resize(partial_lanes);
  const KernelArgs k{&kv, &a, scratch.partials_.data()};
  RunOn(isa, k, scratch.items_, parallel);
  if (!scratch.merges_.empty()) RunOn(isa, k, scratch.merges_, parallel);
}

}  // namespace moe::runtime::internal

#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moe::runtime::internal {
namespace {

// One sequence of a step: `cached` positions already in the cache, then a chunk of `tokens` new
// ones (1 for a decode row). Its keys, values and queries come from `seed` alone.
struct Chunk {
  int cached = 0;
  int tokens = 1;
  uint32_t seed = 0;  // 0: the sequence's index
};

struct Shape {
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;
  std::vector<Chunk> chunks;
};

std::string Name(const Shape& s) {
  std::string chunks;
  for (const Chunk& c : s.chunks) absl::StrAppend(&chunks, chunks.empty() ? "" : ",", c.cached, "+", c.tokens);
  return absl::StrCat(s.num_heads, " heads, ", s.num_kv_heads, " kv heads, head_dim ", s.head_dim, ", block ",
                      s.block_size, ", chunks ", chunks);
}
void PrintTo(const Shape& s, std::ostream* os) { *os << Name(s); }

// A step over a paged cache whose blocks are scattered (shuffled by `layout`): each sequence's
// random keys and values at every position its rows may see, and its rows' random queries.
struct Step {
  std::vector<float> k, v, q;
  std::vector<int32_t> positions, seq_start, block_table;
  int max_blocks = 0;
  PagedKv kv;

  Step(const Shape& s, uint32_t layout) {
    const int d = s.head_dim, bs = s.block_size, seqs = static_cast<int>(s.chunks.size());
    for (const Chunk& c : s.chunks) max_blocks = std::max(max_blocks, (c.cached + c.tokens + bs - 1) / bs);
    block_table.resize(static_cast<size_t>(seqs) * max_blocks);
    std::iota(block_table.begin(), block_table.end(), 0);
    std::shuffle(block_table.begin(), block_table.end(), std::mt19937(layout));
    const int64_t per_block = static_cast<int64_t>(bs) * s.num_kv_heads * d;
    k.resize(block_table.size() * per_block, NAN);  // positions no row sees stay NaN
    v.resize(k.size(), NAN);
    seq_start.push_back(0);
    for (int i = 0; i < seqs; ++i) {
      const Chunk& c = s.chunks[i];
      std::mt19937 rng(c.seed != 0 ? c.seed : i + 1);
      std::normal_distribution<float> normal;
      for (int p = 0; p < c.cached + c.tokens; ++p) {
        for (int h = 0; h < s.num_kv_heads; ++h) {
          const int64_t at = block_table[i * max_blocks + p / bs] * per_block + (int64_t{h} * bs + p % bs) * d;
          for (int e = 0; e < d; ++e) k[at + e] = normal(rng);
          for (int e = 0; e < d; ++e) v[at + e] = normal(rng);
        }
      }
      // Queries large enough for peaked softmaxes, so that the running max moves between tiles.
      for (int t = 0; t < c.tokens; ++t) {
        positions.push_back(c.cached + t);
        for (int e = 0; e < s.num_heads * d; ++e) q.push_back(2.0f * normal(rng));
      }
      seq_start.push_back(static_cast<int32_t>(positions.size()));
    }
    kv = PagedKv{k.data(), v.data(), bs, s.num_kv_heads, d};
  }

  AttentionQueries Queries(const Shape& s, float* out) const {
    return AttentionQueries{q.data(),
                            out,
                            s.num_heads,
                            1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                            positions.data(),
                            seq_start.data(),
                            static_cast<int>(s.chunks.size()),
                            block_table.data(),
                            max_blocks};
  }
  // Sequence i's rows of `out`.
  std::vector<float> Rows(const Shape& s, const std::vector<float>& out, int i) const {
    const int64_t width = int64_t{s.num_heads} * s.head_dim;
    return std::vector<float>(out.begin() + seq_start[i] * width, out.begin() + seq_start[i + 1] * width);
  }
};

void Serial(int64_t n, int64_t, absl::FunctionRef<void(int64_t, int64_t)> body) { body(0, n); }

// One item at a time, last first: results must not depend on how the loop is cut or ordered.
void Backwards(int64_t n, int64_t, absl::FunctionRef<void(int64_t, int64_t)> body) {
  for (int64_t i = n - 1; i >= 0; --i) body(i, i + 1);
}

std::vector<AttentionIsa> Isas() {
  std::vector<AttentionIsa> isas;
  for (AttentionIsa isa : {AttentionIsa::kPortable, AttentionIsa::kAvx2, AttentionIsa::kAvx512}) {
    if (AttentionIsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

class PagedAttentionTest : public ::testing::TestWithParam<Shape> {};

TEST_P(PagedAttentionTest, BlockedKernelMatchesTheReference) {
  const Shape& s = GetParam();
  const Step step(s, 1);
  const size_t n = step.q.size();
  std::vector<float> want(n, NAN);
  PagedAttentionReference(step.kv, step.Queries(s, want.data()), Serial);
  for (AttentionIsa isa : Isas()) {
    AttentionScratch scratch;
    std::vector<float> got(n, NAN), again(n, NAN);
    PagedAttention(step.kv, step.Queries(s, got.data()), isa, Serial, scratch);
    float worst = 0;
    for (size_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
    // Outputs are averages of N(0, 1) values; fp32 sums in another order and the vector exp
    // (relative error about 2e-7) stay far below this.
    EXPECT_LT(worst, 2e-5f) << AttentionIsaName(isa) << ": " << Name(s);
    // The same bits however the loop is cut, with the scratch reused.
    PagedAttention(step.kv, step.Queries(s, again.data()), isa, Backwards, scratch);
    EXPECT_EQ(got, again) << AttentionIsaName(isa) << ": " << Name(s);
  }
}

std::vector<Shape> Shapes() {
  const std::vector<Chunk> mixed = {{0, 1},  {0, 7},   {5, 1},  {16, 1},  {0, 33},
                                    {40, 9}, {127, 1}, {13, 2}, {200, 1}, {0, 300}};
  std::vector<Shape> shapes;
  // head_dim 64 and 128 (the constant-offset builds) and odd ones; GQA groups of 1, 4, 8 and one
  // wider than a block of lanes (20 heads on one kv head); odd head counts; block sizes that cut
  // tiles short (5) or hold several tiles (32).
  for (int head_dim : {64, 128, 40, 17}) {
    shapes.push_back(Shape{7, 7, head_dim, 16, mixed});
    shapes.push_back(Shape{12, 3, head_dim, 16, mixed});
    shapes.push_back(Shape{40, 5, head_dim, 16, mixed});
  }
  shapes.push_back(Shape{20, 1, 64, 16, mixed});
  shapes.push_back(Shape{12, 3, 128, 5, mixed});
  shapes.push_back(Shape{8, 1, 128, 32, mixed});
  shapes.push_back(Shape{8, 2, 64, 4, mixed});
  // Decode rows with keys split: three splits, and the most (a split longer than kSplitKeys).
  shapes.push_back(Shape{32, 4, 128, 16, {{300, 1}, {2500, 1}, {129, 1}, {128, 1}}});
  // A chunked prefill continuing a cached sequence, in chunks of every size up to a block of lanes.
  std::vector<Chunk> continued;
  for (int tokens = 1; tokens <= 17; ++tokens) continued.push_back(Chunk{tokens * 11, tokens});
  shapes.push_back(Shape{16, 2, 64, 16, continued});
  return shapes;
}

INSTANTIATE_TEST_SUITE_P(Shapes, PagedAttentionTest, ::testing::ValuesIn(Shapes()),
                         [](const auto& info) { return absl::StrCat("shape", info.index); });

// A sequence's outputs do not depend on what it is batched with, nor on the cache's block size or
// where its blocks lie, to the bit: alone, and as the second of three sequences, prefill and decode
// alike, in blocks of 16, 4, 5 and 32 positions.
TEST(PagedAttentionBitsTest, ARowsOutputDependsOnItsSequenceAlone) {
  for (const Chunk& own : {Chunk{0, 37, 99}, Chunk{60, 5, 99}, Chunk{700, 1, 99}, Chunk{9, 1, 99}}) {
    const Shape alone{12, 3, 64, 16, {own}};
    const Step a(alone, 7);
    for (AttentionIsa isa : Isas()) {
      AttentionScratch scratch;
      std::vector<float> want(a.q.size());
      PagedAttention(a.kv, a.Queries(alone, want.data()), isa, Serial, scratch);
      for (int block_size : {16, 4, 5, 32}) {
        const Shape batched{12, 3, 64, block_size, {{3, 12}, own, {500, 1}}};
        const Step b(batched, 8);
        std::vector<float> got(b.q.size());
        PagedAttention(b.kv, b.Queries(batched, got.data()), isa, Serial, scratch);
        EXPECT_EQ(b.Rows(batched, got, 1), want)
            << AttentionIsaName(isa) << ", chunk " << own.cached << "+" << own.tokens << ", block " << block_size;
      }
    }
  }
}

// A decode row gets the bits its row got in the prefill (up to kSplitKeys keys; more are split).
TEST(PagedAttentionBitsTest, DecodeRowsGetThePrefillsBits) {
  const Shape prefill{8, 2, 128, 16, {{0, 100, 5}}};
  const Step p(prefill, 3);
  for (AttentionIsa isa : Isas()) {
    AttentionScratch scratch;
    std::vector<float> all(p.q.size());
    PagedAttention(p.kv, p.Queries(prefill, all.data()), isa, Serial, scratch);
    const Shape decode{8, 2, 128, 4, {{99, 1, 5}}};
    Step d(decode, 4);
    std::copy(p.q.end() - 8 * 128, p.q.end(), d.q.begin());  // the last row's queries
    std::vector<float> last(d.q.size());
    PagedAttention(d.kv, d.Queries(decode, last.data()), isa, Serial, scratch);
    EXPECT_TRUE(std::equal(last.begin(), last.end(), all.end() - 8 * 128)) << AttentionIsaName(isa);
  }
}

}  // namespace
}  // namespace moe::runtime::internal

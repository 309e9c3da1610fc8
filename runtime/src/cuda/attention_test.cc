// The attention kernels (attention.cu) against plain double-precision references written here:
// the fused q/k norm + RoPE + KV store; decode (split over the KV length) and prefill attention
// over a paged cache with shuffled block tables; mixed steps; and a CUDA graph replayed after the
// lengths in device memory changed. Outputs and workspaces are poisoned with NaN before each run
// and guarded past their ends; cache slots no sequence owns hold NaN, so any read past a length
// shows up in the output.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/attention_test_util.h"
#include "cuda/cuda_status.h"
#include "cuda/ops.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"

namespace moe::runtime::cuda {
namespace {

using attention_test_util::DecodeRows;
using attention_test_util::DeviceArray;
using attention_test_util::DeviceStep;
using attention_test_util::ExpectNoCudaError;
using attention_test_util::HostStep;
using attention_test_util::kBf16NaN;
using attention_test_util::MakeStep;
using attention_test_util::RandomBf16;
using attention_test_util::SeqChunk;
using attention_test_util::Shape;
using core::Bf16ToFloat;
using core::FloatToBf16;

// Element offset of (position, kv head) in one layer's K or V cache.
int64_t SlotOffset(const HostStep& h, const Shape& shape, int seq, int position, int kv_head) {
  const int64_t block = h.Block(seq, position, shape.block_size);
  return ((block * shape.kv_heads + kv_head) * shape.block_size + position % shape.block_size) * shape.head_dim;
}

size_t CacheElems(const HostStep& h, const Shape& shape) {
  return static_cast<size_t>(h.num_blocks) * shape.kv_heads * shape.block_size * shape.head_dim;
}

// A cache where every slot of positions [0, first_position + cached_extra) of each sequence holds
// random values and every other slot NaN. cached_extra = num_tokens: the step's own rows too.
void FillCache(const HostStep& h, const Shape& shape, bool include_step_rows, std::mt19937& rng,
               std::vector<uint16_t>* k, std::vector<uint16_t>* v) {
  k->assign(CacheElems(h, shape), kBf16NaN);
  v->assign(CacheElems(h, shape), kBf16NaN);
  for (size_t s = 0; s < h.seqs.size(); ++s) {
    const int end = h.seqs[s].first_position + (include_step_rows ? h.seqs[s].num_tokens : 0);
    for (int pos = 0; pos < end; ++pos) {
      for (int kvh = 0; kvh < shape.kv_heads; ++kvh) {
        const int64_t at = SlotOffset(h, shape, static_cast<int>(s), pos, kvh);
        const std::vector<uint16_t> kr = RandomBf16(shape.head_dim, 1.0f, rng);
        const std::vector<uint16_t> vr = RandomBf16(shape.head_dim, 1.0f, rng);
        std::copy(kr.begin(), kr.end(), k->begin() + at);
        std::copy(vr.begin(), vr.end(), v->begin() + at);
      }
    }
  }
}

// Causal attention in double: out [T][H][D].
std::vector<double> ReferenceAttention(const std::vector<uint16_t>& q, const HostStep& h, const Shape& shape,
                                       const std::vector<uint16_t>& k, const std::vector<uint16_t>& v, double scale) {
  const int d = shape.head_dim;
  std::vector<double> out(static_cast<size_t>(h.num_tokens) * shape.num_heads * d, 0.0);
  std::vector<double> scores;
  for (int r = 0; r < h.num_tokens; ++r) {
    const int seq = h.row_seq[r];
    const int pos = h.positions[r];
    scores.resize(pos + 1);
    for (int head = 0; head < shape.num_heads; ++head) {
      const int kvh = head / shape.group();
      const uint16_t* qv = q.data() + (static_cast<size_t>(r) * shape.num_heads + head) * d;
      double max_score = -INFINITY;
      for (int j = 0; j <= pos; ++j) {
        const uint16_t* kv = k.data() + SlotOffset(h, shape, seq, j, kvh);
        double dot = 0.0;
        for (int i = 0; i < d; ++i) dot += static_cast<double>(Bf16ToFloat(qv[i])) * Bf16ToFloat(kv[i]);
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double sum = 0.0;
      for (int j = 0; j <= pos; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        sum += scores[j];
      }
      double* o = out.data() + (static_cast<size_t>(r) * shape.num_heads + head) * d;
      for (int j = 0; j <= pos; ++j) {
        const uint16_t* vv = v.data() + SlotOffset(h, shape, seq, j, kvh);
        const double p = scores[j] / sum;
        for (int i = 0; i < d; ++i) o[i] += p * Bf16ToFloat(vv[i]);
      }
    }
  }
  return out;
}

// bf16 results against a double reference, as vectors of head_dim (one per row and head): every
// element finite, relative L2 error of the whole below tol_all and of each vector below tol_vec.
void ExpectClose(const std::vector<uint16_t>& got, const std::vector<double>& want, int head_dim, int num_heads,
                 double tol_all, double tol_vec, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t non_finite = 0;
  size_t first_bad = 0;
  double err_all = 0.0, ref_all = 0.0, worst_vec = 0.0;
  size_t worst_at = 0;
  for (size_t base = 0; base < got.size(); base += head_dim) {
    double err = 0.0, ref = 0.0;
    for (int i = 0; i < head_dim; ++i) {
      const double g = Bf16ToFloat(got[base + i]);
      if (!std::isfinite(g)) {
        if (non_finite++ == 0) first_bad = base + i;
        continue;
      }
      err += (g - want[base + i]) * (g - want[base + i]);
      ref += want[base + i] * want[base + i];
    }
    err_all += err;
    ref_all += ref;
    const double rel = std::sqrt(err / std::max(ref, 1e-30));
    if (rel > worst_vec) {
      worst_vec = rel;
      worst_at = base / head_dim;
    }
  }
  EXPECT_EQ(non_finite, 0u) << what << ": first at row " << first_bad / head_dim / num_heads << " head "
                            << first_bad / head_dim % num_heads << " element " << first_bad % head_dim;
  EXPECT_LT(std::sqrt(err_all / ref_all), tol_all) << what;
  EXPECT_LT(worst_vec, tol_vec) << what << ": worst at row " << worst_at / num_heads << " head "
                                << worst_at % num_heads;
}

// ---- QkNormRopeStoreKv ----

struct QkvReference {
  std::vector<double> q;  // [T][H][D]
  std::vector<double> k;  // [T][KV][D]
};

// Per-head RMSNorm (x * rsqrt(mean(x^2) + eps) * w), then NeoX RoPE on the first rotary_dim
// dims with the angle float(position) * inv_freq[i] rounded to fp32, as the model computes it.
QkvReference ReferenceQkNormRope(const std::vector<uint16_t>& qkv, const HostStep& h, const Shape& shape,
                                 const std::vector<float>* q_norm, const std::vector<float>* k_norm, double eps,
                                 int rotary_dim, const std::vector<float>& inv_freq) {
  const int d = shape.head_dim;
  const int total = shape.num_heads + 2 * shape.kv_heads;
  QkvReference ref;
  ref.q.resize(static_cast<size_t>(h.num_tokens) * shape.num_heads * d);
  ref.k.resize(static_cast<size_t>(h.num_tokens) * shape.kv_heads * d);
  std::vector<double> x(d), y(d);
  const int half = rotary_dim / 2;
  for (int r = 0; r < h.num_tokens; ++r) {
    for (int head = 0; head < shape.num_heads + shape.kv_heads; ++head) {
      const bool is_q = head < shape.num_heads;
      const std::vector<float>* w = is_q ? q_norm : k_norm;
      for (int i = 0; i < d; ++i) x[i] = Bf16ToFloat(qkv[(static_cast<size_t>(r) * total + head) * d + i]);
      if (w != nullptr) {
        double ss = 0.0;
        for (int i = 0; i < d; ++i) ss += x[i] * x[i];
        const double inv = 1.0 / std::sqrt(ss / d + eps);
        for (int i = 0; i < d; ++i) x[i] = x[i] * inv * (*w)[i];
      }
      y = x;
      for (int i = 0; i < half; ++i) {
        const float angle = static_cast<float>(h.positions[r]) * inv_freq[i];
        const double c = std::cos(static_cast<double>(angle));
        const double s = std::sin(static_cast<double>(angle));
        y[i] = x[i] * c - x[i + half] * s;
        y[i + half] = x[i + half] * c + x[i] * s;
      }
      double* dst = is_q ? &ref.q[(static_cast<size_t>(r) * shape.num_heads + head) * d]
                         : &ref.k[(static_cast<size_t>(r) * shape.kv_heads + head - shape.num_heads) * d];
      std::copy(y.begin(), y.end(), dst);
    }
  }
  return ref;
}

// Per element: within bf16 rounding (one unit in the last place: 2^-7 relative at worst) of the
// reference, plus a little of the vector's RMS for fp32 arithmetic.
void ExpectElementsClose(const uint16_t* got, const double* want, int n, const std::string& what, int* failures) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += want[i] * want[i];
  const double rms = std::sqrt(ss / n);
  for (int i = 0; i < n; ++i) {
    const double g = Bf16ToFloat(got[i]);
    const double tol = 1e-2 * std::abs(want[i]) + 1e-3 * rms;
    if (!(std::abs(g - want[i]) <= tol)) {
      if ((*failures)++ < 5) ADD_FAILURE() << what << " element " << i << ": got " << g << ", want " << want[i];
    }
  }
}

std::vector<float> InverseFrequencies(int rotary_dim, double theta) {
  std::vector<float> inv_freq(rotary_dim / 2);
  for (int i = 0; i < rotary_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(1.0 / std::pow(theta, 2.0 * i / rotary_dim));
  }
  return inv_freq;
}

std::vector<float> RandomNormWeights(int n, std::mt19937& rng) {
  std::normal_distribution<float> dist(1.0f, 0.2f);
  std::vector<float> w(n);
  for (float& x : w) x = dist(rng);
  return w;
}

struct StoreCase {
  std::string name;
  Shape shape;
  int rotary_dim;
  bool qk_norm;
};

void PrintTo(const StoreCase& c, std::ostream* os) { *os << c.name; }

std::vector<StoreCase> StoreCases() {
  std::vector<StoreCase> cases;
  for (int d : {32, 128}) {
    for (int group : {1, 2, 8}) {
      for (bool partial : {false, true}) {
        for (bool norm : {false, true}) {
          const int kv_heads = group == 8 ? 2 : 3;
          const int block_size = (group + (norm ? 1 : 0)) % 2 == 0 ? 16 : 4;
          const int rotary = partial ? d / 2 : d;
          std::ostringstream name;
          name << "D" << d << "G" << group << "Rotary" << rotary << (norm ? "QkNorm" : "NoNorm") << "Bs" << block_size;
          cases.push_back({name.str(), {group * kv_heads, kv_heads, d, block_size}, rotary, norm});
        }
      }
    }
  }
  cases.push_back({"D64G4Rotary64QkNormBs8", {8, 2, 64, 8}, 64, true});
  cases.push_back({"D256G2Rotary64QkNormBs16", {4, 2, 256, 16}, 64, true});
  cases.push_back({"D128G4NoRotaryBs64", {8, 2, 128, 64}, 0, true});
  return cases;
}

class QkNormRopeStoreKvTest : public testing::TestWithParam<StoreCase> {};

TEST_P(QkNormRopeStoreKvTest, MatchesThePlainReference) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const StoreCase& c = GetParam();
  const Shape& shape = c.shape;
  const int d = shape.head_dim;
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(c.name)));
  // Prefill rows from 0, a chunk ending at position 100000 (RoPE far out), a decode row, and a
  // chunk crossing a block boundary.
  const HostStep h = MakeStep({{0, 5}, {99995, 6}, {7, 1}, {4093, 4}}, shape.block_size, /*sparse=*/true, rng);
  const int total = shape.num_heads + 2 * shape.kv_heads;
  const std::vector<uint16_t> qkv = RandomBf16(static_cast<size_t>(h.num_tokens) * total * d, 1.0f, rng);
  const std::vector<float> q_norm = RandomNormWeights(d, rng), k_norm = RandomNormWeights(d, rng);
  const std::vector<float> inv_freq = InverseFrequencies(c.rotary_dim, 10000.0);
  const float eps = 1e-6f;

  // Random old contents everywhere; the slots this step writes start as NaN.
  std::vector<uint16_t> k_init = RandomBf16(CacheElems(h, shape), 1.0f, rng);
  std::vector<uint16_t> v_init = RandomBf16(CacheElems(h, shape), 1.0f, rng);
  std::vector<bool> written(CacheElems(h, shape), false);
  for (int r = 0; r < h.num_tokens; ++r) {
    for (int kvh = 0; kvh < shape.kv_heads; ++kvh) {
      const int64_t at = SlotOffset(h, shape, h.row_seq[r], h.positions[r], kvh);
      for (int i = 0; i < d; ++i) {
        k_init[at + i] = v_init[at + i] = kBf16NaN;
        written[at + i] = true;
      }
    }
  }

  DeviceStep step(h);
  DeviceArray<uint16_t> qkv_d(qkv.size()), k_d(k_init.size()), v_d(v_init.size());
  DeviceArray<uint16_t> q_out(static_cast<size_t>(h.num_tokens) * shape.num_heads * d);
  DeviceArray<float> q_norm_d(d), k_norm_d(d), inv_freq_d(std::max<size_t>(inv_freq.size(), 1));
  qkv_d.Upload(qkv);
  k_d.Upload(k_init);
  v_d.Upload(v_init);
  q_norm_d.Upload(q_norm);
  k_norm_d.Upload(k_norm);
  if (!inv_freq.empty()) inv_freq_d.Upload(inv_freq);
  q_out.Poison();
  KvLayer kv{k_d.get(), v_d.get(), shape.block_size, shape.kv_heads, d};
  QkNormRopeStoreKv(qkv_d.get(), step.meta, shape.num_heads, kv, c.qk_norm ? q_norm_d.get() : nullptr,
                    c.qk_norm ? k_norm_d.get() : nullptr, eps, c.rotary_dim, inv_freq_d.get(), q_out.get(), nullptr);
  ExpectNoCudaError(c.name);

  const QkvReference ref = ReferenceQkNormRope(qkv, h, shape, c.qk_norm ? &q_norm : nullptr,
                                               c.qk_norm ? &k_norm : nullptr, eps, c.rotary_dim, inv_freq);
  const std::vector<uint16_t> q_got = q_out.Download(), k_got = k_d.Download(), v_got = v_d.Download();
  int failures = 0;
  for (int r = 0; r < h.num_tokens; ++r) {
    for (int head = 0; head < shape.num_heads; ++head) {
      const size_t at = (static_cast<size_t>(r) * shape.num_heads + head) * d;
      ExpectElementsClose(&q_got[at], &ref.q[at], d, "q row " + std::to_string(r) + " head " + std::to_string(head),
                          &failures);
    }
    for (int kvh = 0; kvh < shape.kv_heads; ++kvh) {
      const int64_t slot = SlotOffset(h, shape, h.row_seq[r], h.positions[r], kvh);
      ExpectElementsClose(&k_got[slot], &ref.k[(static_cast<size_t>(r) * shape.kv_heads + kvh) * d], d,
                          "k row " + std::to_string(r) + " kv head " + std::to_string(kvh), &failures);
      const uint16_t* v_src = &qkv[(static_cast<size_t>(r) * total + shape.num_heads + shape.kv_heads + kvh) * d];
      for (int i = 0; i < d; ++i) {
        if (v_got[slot + i] != v_src[i] && failures++ < 5) {
          ADD_FAILURE() << "v row " << r << " kv head " << kvh << " element " << i << " not copied exactly";
        }
      }
    }
  }
  size_t clobbered = 0;
  for (size_t i = 0; i < written.size(); ++i) {
    if (!written[i] && (k_got[i] != k_init[i] || v_got[i] != v_init[i])) ++clobbered;
  }
  EXPECT_EQ(clobbered, 0u) << "cache elements outside this step's slots changed";
  EXPECT_TRUE(q_out.GuardIntact());
  EXPECT_TRUE(k_d.GuardIntact());
  EXPECT_TRUE(v_d.GuardIntact());
}

INSTANTIATE_TEST_SUITE_P(Sweep, QkNormRopeStoreKvTest, testing::ValuesIn(StoreCases()),
                         [](const testing::TestParamInfo<StoreCase>& info) { return info.param.name; });

// ---- PagedAttention ----

struct AttentionCase {
  std::string name;
  Shape shape;
  std::vector<SeqChunk> seqs;
  int max_kv_len = 0;  // 0: the longest sequence
};

void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }

// n lengths spread over [1, max_len], fixed by n.
std::vector<int> ManyLengths(int n, int max_len) {
  std::mt19937 rng(n);
  std::uniform_int_distribution<int> dist(1, max_len);
  std::vector<int> lengths(n);
  for (int& len : lengths) len = dist(rng);
  return lengths;
}

std::vector<AttentionCase> AttentionCases() {
  return {
      // Decode: one query per sequence, lengths from 1 to across many blocks and splits.
      {"DecodeG1D32Bs4", {4, 4, 32, 4}, DecodeRows({1, 5, 17, 64, 65, 300})},
      {"DecodeG2D128Bs16", {8, 4, 128, 16}, DecodeRows({1, 33, 640, 1000, 2049})},
      {"DecodeG8D128Bs16", {32, 4, 128, 16}, DecodeRows({1, 2, 129, 700, 2048})},
      {"DecodeG8D32Bs4", {16, 2, 32, 4}, DecodeRows({3, 256, 1500})},
      {"DecodeG16D64Bs16", {32, 2, 64, 16}, DecodeRows({7, 900})},
      {"DecodeG4D256Bs16", {8, 2, 256, 16}, DecodeRows({1, 100, 333})},
      {"DecodeG8D128Bs64", {16, 2, 128, 64}, DecodeRows({64, 65, 1000})},
      {"DecodeBatch1Long", {32, 4, 128, 16}, DecodeRows({4000})},
      // One split (the kernel writes the output itself): every sequence within one tile, or
      // enough sequences times kv heads to fill the device without splitting.
      {"DecodeOneSplitShort", {8, 4, 32, 4}, DecodeRows({1, 2, 30, 64})},
      {"DecodeOneSplitLargeBatch", {8, 4, 64, 16}, DecodeRows(ManyLengths(70, 400))},
      // A graph-sized bound far above the lengths: most splits are empty.
      {"DecodeMostSplitsEmpty", {8, 2, 128, 16}, DecodeRows({1, 70, 200}), 4096},
      // Lengths past max_kv_len (a graph bucket outgrown): the last split takes the rest.
      {"DecodeLengthsPastMaxKvLen", {8, 2, 64, 16}, DecodeRows({100, 900, 20}), 256},
      // A group above 16 takes the prefill kernel even at decode.
      {"DecodeG32UsesPrefillKernel", {32, 1, 32, 16}, DecodeRows({5, 300})},
      // Prefill chunks from position 0 and after cached positions.
      {"PrefillFromZeroG1D32Bs4", {2, 2, 32, 4}, {{0, 77}}},
      {"PrefillFromZeroG8D128Bs16", {16, 2, 128, 16}, {{0, 150}}},
      {"PrefillCachedG2D128Bs16", {4, 2, 128, 16}, {{200, 77}}},
      {"PrefillCachedG8D32Bs4", {16, 2, 32, 4}, {{61, 45}, {0, 3}}},
      {"PrefillG3D32Bs4", {6, 2, 32, 4}, {{0, 50}, {13, 21}}},
      {"PrefillG16D128Bs16", {32, 2, 128, 16}, {{0, 40}, {90, 9}}},
      {"PrefillG2D64Bs8", {6, 3, 64, 8}, {{0, 90}, {31, 40}}},
      {"PrefillG4D256Bs16", {4, 1, 256, 16}, {{0, 70}, {100, 35}}},
      {"PrefillG1D128Bs64", {2, 2, 128, 64}, {{0, 130}, {64, 64}}},
      // Mixed steps: decode rows and prefill chunks together.
      {"MixedG8D128Bs16", {8, 1, 128, 16}, {{500, 1}, {0, 70}, {37, 1}, {130, 66}, {1, 1}}},
      {"MixedG2D32Bs4", {4, 2, 32, 4}, {{9, 1}, {64, 64}, {0, 1}, {250, 19}}},
      {"MixedG1D32Bs16", {3, 3, 32, 16}, {{0, 2}, {15, 1}, {16, 17}}},
  };
}

class PagedAttentionTest : public testing::TestWithParam<AttentionCase> {};

TEST_P(PagedAttentionTest, MatchesThePlainReference) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const AttentionCase& c = GetParam();
  const Shape& shape = c.shape;
  const int d = shape.head_dim;
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(c.name)));
  const HostStep h = MakeStep(c.seqs, shape.block_size, /*sparse=*/false, rng, c.max_kv_len);
  // q with a larger spread than k: scores of a few units, so the softmax is neither flat nor one-hot.
  const std::vector<uint16_t> q = RandomBf16(static_cast<size_t>(h.num_tokens) * shape.num_heads * d, 1.5f, rng);
  std::vector<uint16_t> k, v;
  FillCache(h, shape, /*include_step_rows=*/true, rng, &k, &v);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  DeviceStep step(h);
  DeviceArray<uint16_t> q_d(q.size()), k_d(k.size()), v_d(v.size()), out(q.size());
  DeviceArray<float> workspace(AttentionWorkspaceFloats(h.num_tokens, h.max_kv_len, shape.num_heads, d));
  q_d.Upload(q);
  k_d.Upload(k);
  v_d.Upload(v);
  out.Poison();
  workspace.Poison();
  KvLayer kv{k_d.get(), v_d.get(), shape.block_size, shape.kv_heads, d};
  PagedAttention(q_d.get(), step.meta, shape.num_heads, kv, scale, workspace.get(), out.get(), nullptr);
  ExpectNoCudaError(c.name);

  const std::vector<double> want = ReferenceAttention(q, h, shape, k, v, scale);
  ExpectClose(out.Download(), want, d, shape.num_heads, 1e-2, 2e-2, c.name);
  EXPECT_TRUE(out.GuardIntact());
  EXPECT_TRUE(workspace.GuardIntact()) << "workspace overrun: AttentionWorkspaceFloats is too small";
}

INSTANTIATE_TEST_SUITE_P(Cases, PagedAttentionTest, testing::ValuesIn(AttentionCases()),
                         [](const testing::TestParamInfo<AttentionCase>& info) { return info.param.name; });

// ---- fp8 KV cache ----

// One head's values quantized as the store kernel does: scale = max |x| / 448 (1 for zeros), codes
// x / scale rounded to nearest even and saturated.
float QuantizeHead(const float* x, int n, uint8_t* codes) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax > 0.f ? amax / core::kF8E4M3Max : 1.f;
  for (int i = 0; i < n; ++i) codes[i] = core::FloatToF8E4M3(x[i] / scale);
  return scale;
}

// An fp8 cache as FillCache makes a bf16 one (random heads where a sequence owns the slot, NaN codes
// and scales elsewhere), with what the attention kernels read it as: each code times its head's
// scale, rounded to bf16 (they convert every tile to bf16 in shared memory).
struct Fp8Cache {
  std::vector<uint8_t> k, v;
  std::vector<float> k_scale, v_scale;
  std::vector<uint16_t> k_seen, v_seen;
};
Fp8Cache FillFp8Cache(const HostStep& h, const Shape& shape, std::mt19937& rng) {
  const int d = shape.head_dim;
  Fp8Cache c;
  c.k.assign(CacheElems(h, shape), 0x7f);
  c.v.assign(CacheElems(h, shape), 0x7f);
  c.k_scale.assign(CacheElems(h, shape) / d, std::nanf(""));
  c.v_scale.assign(CacheElems(h, shape) / d, std::nanf(""));
  c.k_seen.assign(CacheElems(h, shape), kBf16NaN);
  c.v_seen.assign(CacheElems(h, shape), kBf16NaN);
  std::normal_distribution<float> dist;
  std::vector<float> x(d);
  for (size_t s = 0; s < h.seqs.size(); ++s) {
    for (int pos = 0; pos < h.seqs[s].first_position + h.seqs[s].num_tokens; ++pos) {
      for (int kvh = 0; kvh < shape.kv_heads; ++kvh) {
        const int64_t at = SlotOffset(h, shape, static_cast<int>(s), pos, kvh);
        for (auto [codes, scales, seen] : {std::tuple{&c.k, &c.k_scale, &c.k_seen}, {&c.v, &c.v_scale, &c.v_seen}}) {
          // Heads of different magnitudes, so that the scales matter.
          const float spread = std::exp(dist(rng));
          for (float& e : x) e = dist(rng) * spread;
          const float scale = QuantizeHead(x.data(), d, codes->data() + at);
          (*scales)[at / d] = scale;
          for (int i = 0; i < d; ++i) (*seen)[at + i] = FloatToBf16(core::F8E4M3ToFloat((*codes)[at + i]) * scale);
        }
      }
    }
  }
  return c;
}

class Fp8PagedAttentionTest : public testing::TestWithParam<AttentionCase> {};

// Decode, prefill and mixed steps over an fp8 cache: the kernels read every code times its scale,
// as the bf16 reference over those values does, with no read past a sequence's length (NaN there).
TEST_P(Fp8PagedAttentionTest, MatchesThePlainReferenceOverTheDequantizedCache) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const AttentionCase& c = GetParam();
  const Shape& shape = c.shape;
  const int d = shape.head_dim;
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(c.name)) + 8);
  const HostStep h = MakeStep(c.seqs, shape.block_size, /*sparse=*/false, rng, c.max_kv_len);
  const std::vector<uint16_t> q = RandomBf16(static_cast<size_t>(h.num_tokens) * shape.num_heads * d, 1.0f, rng);
  const Fp8Cache cache = FillFp8Cache(h, shape, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  DeviceStep step(h);
  DeviceArray<uint16_t> q_d(q.size()), out(q.size());
  DeviceArray<uint8_t> k_d(cache.k.size()), v_d(cache.v.size());
  DeviceArray<float> ks_d(cache.k_scale.size()), vs_d(cache.v_scale.size());
  DeviceArray<float> workspace(AttentionWorkspaceFloats(h.num_tokens, h.max_kv_len, shape.num_heads, d));
  q_d.Upload(q);
  k_d.Upload(cache.k);
  v_d.Upload(cache.v);
  ks_d.Upload(cache.k_scale);
  vs_d.Upload(cache.v_scale);
  out.Poison();
  workspace.Poison();
  KvLayer kv{k_d.get(), v_d.get(), shape.block_size, shape.kv_heads, d, /*fp8=*/true, ks_d.get(), vs_d.get()};
  PagedAttention(q_d.get(), step.meta, shape.num_heads, kv, scale, workspace.get(), out.get(), nullptr);
  ExpectNoCudaError(c.name);

  const std::vector<double> want = ReferenceAttention(q, h, shape, cache.k_seen, cache.v_seen, scale);
  ExpectClose(out.Download(), want, d, shape.num_heads, 1e-2, 2e-2, c.name);
  EXPECT_TRUE(out.GuardIntact());
  EXPECT_TRUE(workspace.GuardIntact());
}

std::vector<AttentionCase> Fp8AttentionCases() {
  std::vector<AttentionCase> cases;
  for (const AttentionCase& c : AttentionCases()) {
    for (const char* name :
         {"DecodeG1D32Bs4", "DecodeG8D128Bs16", "DecodeG16D64Bs16", "DecodeG4D256Bs16", "DecodeBatch1Long",
          "DecodeMostSplitsEmpty", "DecodeG32UsesPrefillKernel", "PrefillFromZeroG8D128Bs16", "PrefillCachedG8D32Bs4",
          "PrefillG2D64Bs8", "PrefillG4D256Bs16", "MixedG8D128Bs16", "MixedG2D32Bs4"}) {
      if (c.name == name) cases.push_back(c);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, Fp8PagedAttentionTest, testing::ValuesIn(Fp8AttentionCases()),
                         [](const testing::TestParamInfo<AttentionCase>& info) { return info.param.name; });

// The store kernel into an fp8 cache: v exactly as the host quantizes the bf16 inputs; k (normed
// and rotated in fp32 on the device) within one fp8 step of the double reference; scales of the
// heads' largest magnitudes; no other slot touched.
TEST(Fp8KvCacheTest, StoreQuantizesEachHeadWithItsOwnScale) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  for (const Shape shape : {Shape{8, 2, 128, 16}, Shape{4, 4, 32, 4}, Shape{4, 2, 256, 16}, Shape{6, 3, 64, 8}}) {
    const int d = shape.head_dim, rotary_dim = d / 2;
    const std::string what = "D" + std::to_string(d) + " KV" + std::to_string(shape.kv_heads);
    std::mt19937 rng(d);
    const HostStep h = MakeStep({{0, 9}, {70, 1}, {33, 4}}, shape.block_size, /*sparse=*/true, rng);
    const int total = shape.num_heads + 2 * shape.kv_heads;
    const std::vector<uint16_t> qkv = RandomBf16(static_cast<size_t>(h.num_tokens) * total * d, 3.0f, rng);
    const std::vector<float> q_norm = RandomNormWeights(d, rng), k_norm = RandomNormWeights(d, rng);
    const std::vector<float> inv_freq = InverseFrequencies(rotary_dim, 1e6);
    DeviceStep step(h);
    DeviceArray<uint16_t> qkv_d(qkv.size()), q_out(static_cast<size_t>(h.num_tokens) * shape.num_heads * d);
    DeviceArray<uint8_t> k_d(CacheElems(h, shape)), v_d(CacheElems(h, shape));
    DeviceArray<float> ks_d(CacheElems(h, shape) / d), vs_d(CacheElems(h, shape) / d);
    DeviceArray<float> q_norm_d(d), k_norm_d(d), inv_freq_d(inv_freq.size());
    qkv_d.Upload(qkv);
    q_norm_d.Upload(q_norm);
    k_norm_d.Upload(k_norm);
    inv_freq_d.Upload(inv_freq);
    for (auto* a : {&k_d, &v_d}) a->Poison();
    for (auto* a : {&ks_d, &vs_d}) a->Poison();
    const std::vector<uint8_t> poisoned_codes = k_d.Download();
    KvLayer kv{k_d.get(), v_d.get(), shape.block_size, shape.kv_heads, d, /*fp8=*/true, ks_d.get(), vs_d.get()};
    QkNormRopeStoreKv(qkv_d.get(), step.meta, shape.num_heads, kv, q_norm_d.get(), k_norm_d.get(), 1e-6f, rotary_dim,
                      inv_freq_d.get(), q_out.get(), nullptr);
    ExpectNoCudaError(what);
    const QkvReference ref = ReferenceQkNormRope(qkv, h, shape, &q_norm, &k_norm, 1e-6, rotary_dim, inv_freq);
    const std::vector<uint8_t> k_got = k_d.Download(), v_got = v_d.Download();
    const std::vector<float> ks_got = ks_d.Download(), vs_got = vs_d.Download();
    std::vector<bool> written(CacheElems(h, shape), false);
    int failures = 0;
    for (int r = 0; r < h.num_tokens; ++r) {
      for (int kvh = 0; kvh < shape.kv_heads; ++kvh) {
        const int64_t at = SlotOffset(h, shape, h.row_seq[r], h.positions[r], kvh);
        std::fill(written.begin() + at, written.begin() + at + d, true);
        std::vector<float> v_in(d);
        for (int i = 0; i < d; ++i) {
          v_in[i] = Bf16ToFloat(qkv[(static_cast<size_t>(r) * total + shape.num_heads + shape.kv_heads + kvh) * d + i]);
        }
        std::vector<uint8_t> v_want(d);
        const float v_scale = QuantizeHead(v_in.data(), d, v_want.data());
        if (vs_got[at / d] != v_scale && failures++ < 5) ADD_FAILURE() << what << " v scale row " << r;
        for (int i = 0; i < d; ++i) {
          if (v_got[at + i] != v_want[i] && failures++ < 5) ADD_FAILURE() << what << " v row " << r << " element " << i;
        }
        const double* k_ref = &ref.k[(static_cast<size_t>(r) * shape.kv_heads + kvh) * d];
        double amax = 0;
        for (int i = 0; i < d; ++i) amax = std::max(amax, std::abs(k_ref[i]));
        const float k_scale = ks_got[at / d];
        if (!(std::abs(k_scale - amax / 448.0) <= 1e-4 * amax) && failures++ < 5) {
          ADD_FAILURE() << what << " k scale row " << r << ": " << k_scale << ", want " << amax / 448.0;
        }
        for (int i = 0; i < d; ++i) {
          // e4m3 steps are 2^-3 of the value's binade: half a step is at most 1/16 of |x|; codes
          // below the normal range step by 2^-9 of the scale.
          const double got = core::F8E4M3ToFloat(k_got[at + i]) * k_scale;
          const double tol = std::abs(k_ref[i]) / 16 * 1.01 + k_scale * std::ldexp(1.0, -10) + 1e-4 * amax;
          if (!(std::abs(got - k_ref[i]) <= tol) && failures++ < 5) {
            ADD_FAILURE() << what << " k row " << r << " element " << i << ": " << got << ", want " << k_ref[i];
          }
        }
      }
    }
    size_t clobbered = 0;
    for (size_t i = 0; i < written.size(); ++i) {
      if (!written[i] && (k_got[i] != poisoned_codes[i] || v_got[i] != poisoned_codes[i])) ++clobbered;
    }
    EXPECT_EQ(clobbered, 0u) << what << ": cache bytes outside this step's slots changed";
    EXPECT_TRUE(k_d.GuardIntact() && v_d.GuardIntact() && ks_d.GuardIntact() && vs_d.GuardIntact()) << what;
  }
}

// The two launchers in sequence, as a layer runs them: the attention reads the k and v the
// store kernel just wrote, beside what earlier steps cached.
TEST(AttentionTest, StoreThenAttendMixedStep) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const Shape shape{8, 2, 128, 16};
  const int d = shape.head_dim;
  const int rotary_dim = 64;
  std::mt19937 rng(7);
  const HostStep h = MakeStep({{300, 1}, {0, 40}, {75, 20}, {2, 1}}, shape.block_size, false, rng);
  const int total = shape.num_heads + 2 * shape.kv_heads;
  const std::vector<uint16_t> qkv = RandomBf16(static_cast<size_t>(h.num_tokens) * total * d, 1.0f, rng);
  const std::vector<float> q_norm = RandomNormWeights(d, rng), k_norm = RandomNormWeights(d, rng);
  const std::vector<float> inv_freq = InverseFrequencies(rotary_dim, 1e6);
  const float eps = 1e-6f;
  std::vector<uint16_t> k, v;
  FillCache(h, shape, /*include_step_rows=*/false, rng, &k, &v);

  DeviceStep step(h);
  DeviceArray<uint16_t> qkv_d(qkv.size()), k_d(k.size()), v_d(v.size());
  DeviceArray<uint16_t> q_out(static_cast<size_t>(h.num_tokens) * shape.num_heads * d),
      out(static_cast<size_t>(h.num_tokens) * shape.num_heads * d);
  DeviceArray<float> q_norm_d(d), k_norm_d(d), inv_freq_d(inv_freq.size());
  DeviceArray<float> workspace(AttentionWorkspaceFloats(h.num_tokens, h.max_kv_len, shape.num_heads, d));
  qkv_d.Upload(qkv);
  k_d.Upload(k);
  v_d.Upload(v);
  q_norm_d.Upload(q_norm);
  k_norm_d.Upload(k_norm);
  inv_freq_d.Upload(inv_freq);
  q_out.Poison();
  out.Poison();
  workspace.Poison();
  KvLayer kv{k_d.get(), v_d.get(), shape.block_size, shape.kv_heads, d};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  QkNormRopeStoreKv(qkv_d.get(), step.meta, shape.num_heads, kv, q_norm_d.get(), k_norm_d.get(), eps, rotary_dim,
                    inv_freq_d.get(), q_out.get(), nullptr);
  PagedAttention(q_out.get(), step.meta, shape.num_heads, kv, scale, workspace.get(), out.get(), nullptr);
  ExpectNoCudaError("store then attend");

  // The reference rounds q and k to bf16 where the kernels store them.
  const QkvReference ref = ReferenceQkNormRope(qkv, h, shape, &q_norm, &k_norm, eps, rotary_dim, inv_freq);
  std::vector<uint16_t> q_bf16(ref.q.size());
  for (size_t i = 0; i < ref.q.size(); ++i) q_bf16[i] = FloatToBf16(static_cast<float>(ref.q[i]));
  for (int r = 0; r < h.num_tokens; ++r) {
    for (int kvh = 0; kvh < shape.kv_heads; ++kvh) {
      const int64_t slot = SlotOffset(h, shape, h.row_seq[r], h.positions[r], kvh);
      for (int i = 0; i < d; ++i) {
        k[slot + i] = FloatToBf16(static_cast<float>(ref.k[(static_cast<size_t>(r) * shape.kv_heads + kvh) * d + i]));
        v[slot + i] = qkv[(static_cast<size_t>(r) * total + shape.num_heads + shape.kv_heads + kvh) * d + i];
      }
    }
  }
  const std::vector<double> want = ReferenceAttention(q_bf16, h, shape, k, v, scale);
  ExpectClose(out.Download(), want, d, shape.num_heads, 1e-2, 2e-2, "store then attend");
}

// A decode launch captured once (as the backend captures a graph per batch size and KV bucket)
// and replayed after new lengths were written into the same device buffers computes the new
// step: the same bits as an eager launch with those lengths, and close to the reference.
TEST(AttentionTest, GraphReplayWithNewLengthsMatchesEagerLaunch) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  const Shape shape{32, 4, 128, 16};
  const int d = shape.head_dim;
  const int bucket = 2048;  // max_kv_len of the captured graph
  std::mt19937 rng(11);
  // Block tables sized for the bucket: each sequence owns blocks for 2048 positions.
  HostStep h = MakeStep(DecodeRows({bucket, bucket, bucket}), shape.block_size, false, rng);
  std::vector<uint16_t> k, v;
  FillCache(h, shape, true, rng, &k, &v);
  const std::vector<uint16_t> q = RandomBf16(static_cast<size_t>(h.num_tokens) * shape.num_heads * d, 1.5f, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  DeviceStep step(h);
  DeviceArray<uint16_t> q_d(q.size()), k_d(k.size()), v_d(v.size()), graph_out(q.size()), eager_out(q.size());
  DeviceArray<float> workspace(AttentionWorkspaceFloats(h.num_tokens, bucket, shape.num_heads, d));
  q_d.Upload(q);
  k_d.Upload(k);
  v_d.Upload(v);
  KvLayer kv{k_d.get(), v_d.get(), shape.block_size, shape.kv_heads, d};

  // Sets the lengths of the three sequences in the host step and in device memory.
  auto set_lengths = [&](const std::vector<int>& lengths) {
    for (size_t s = 0; s < lengths.size(); ++s) {
      h.positions[s] = lengths[s] - 1;
      h.seq_len[s] = lengths[s];
      h.seqs[s].first_position = lengths[s] - 1;
    }
    step.positions.Upload(h.positions);
    step.seq_len.Upload(h.seq_len);
  };

  set_lengths({10, 600, 1});
  // An eager launch first (what the backend runs before capturing), then the capture.
  PagedAttention(q_d.get(), step.meta, shape.num_heads, kv, scale, workspace.get(), eager_out.get(), stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  PagedAttention(q_d.get(), step.meta, shape.num_heads, kv, scale, workspace.get(), graph_out.get(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (const std::vector<int>& lengths :
       std::vector<std::vector<int>>{{10, 600, 1}, {1500, 33, 2048}, {1, 1, 1}, {2047, 64, 65}}) {
    std::ostringstream what;
    what << "lengths " << lengths[0] << "," << lengths[1] << "," << lengths[2];
    set_lengths(lengths);
    graph_out.Poison();
    workspace.Poison();
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<uint16_t> from_graph = graph_out.Download();
    eager_out.Poison();
    workspace.Poison();
    PagedAttention(q_d.get(), step.meta, shape.num_heads, kv, scale, workspace.get(), eager_out.get(), stream);
    ExpectNoCudaError(what.str());
    EXPECT_TRUE(from_graph == eager_out.Download()) << what.str() << ": graph replay differs from an eager launch";
    ExpectClose(from_graph, ReferenceAttention(q, h, shape, k, v, scale), d, shape.num_heads, 1e-2, 2e-2, what.str());
  }
  EXPECT_TRUE(workspace.GuardIntact());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// No Status comes back from a launcher: a head size without a kernel must still be an error the
// caller's cudaGetLastError sees.
TEST(AttentionTest, UnsupportedHeadDimIsALaunchError) {
  if (VisibleDeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::mt19937 rng(3);
  const HostStep h = MakeStep(DecodeRows({5}), 16, false, rng);
  DeviceStep step(h);
  DeviceArray<uint16_t> buf(4096);
  DeviceArray<float> workspace(4096);
  KvLayer kv{buf.get(), buf.get(), 16, 1, 48};
  PagedAttention(buf.get(), step.meta, 1, kv, 1.0f, workspace.get(), buf.get(), nullptr);
  EXPECT_NE(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace moe::runtime::cuda

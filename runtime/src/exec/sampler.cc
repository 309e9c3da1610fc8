#include "moe/runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "moe/core/philox.h"

namespace moe::runtime {

absl::Status SamplingParams::Validate() const {
  if (std::isnan(temperature) || temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be >= 0, got ", temperature));
  }
  if (std::isnan(top_p) || top_p <= 0 || top_p > 1) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  if (top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", top_k));
  if (std::isnan(min_p) || min_p < 0 || min_p > 1) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", min_p));
  }
  if (std::isnan(repetition_penalty) || repetition_penalty <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("repetition_penalty must be > 0, got ", repetition_penalty));
  }
  for (auto [name, v] : {std::pair<const char*, float>{"presence_penalty", presence_penalty},
                         {"frequency_penalty", frequency_penalty}}) {
    if (std::isnan(v) || v < -2 || v > 2) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be in [-2, 2], got ", v));
    }
  }
  return absl::OkStatus();
}

void ApplyPenalties(const SamplingParams& p, const int32_t* prompt, int prompt_len, const int32_t* output,
                    int output_len, float* logits, int vocab) {
  if (p.repetition_penalty != 1.0f) {
    std::vector<bool> seen(vocab, false);
    auto mark = [&](const int32_t* ids, int n) {
      for (int i = 0; i < n; ++i) {
        if (ids[i] >= 0 && ids[i] < vocab) seen[ids[i]] = true;
      }
    };
    mark(prompt, prompt_len);
    mark(output, output_len);
    for (int t = 0; t < vocab; ++t) {
      if (seen[t]) logits[t] = logits[t] > 0 ? logits[t] / p.repetition_penalty : logits[t] * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::vector<int> count(vocab, 0);
    for (int i = 0; i < output_len; ++i) {
      if (output[i] >= 0 && output[i] < vocab) ++count[output[i]];
    }
    for (int t = 0; t < vocab; ++t) {
      if (count[t] > 0) logits[t] -= p.presence_penalty + p.frequency_penalty * count[t];
    }
  }
}

TokenLogprobs ComputeLogprobs(const float* logits, int vocab, int32_t token, int top) {
  const float max_logit = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - max_logit);
  const float log_z = max_logit + static_cast<float>(std::log(sum));
  TokenLogprobs out;
  out.logprob = logits[token] - log_z;
  top = std::min(top, vocab);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + top, order.end(),
                    [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  for (int i = 0; i < top; ++i) out.top.emplace_back(order[i], logits[order[i]] - log_z);
  return out;
}

int32_t ArgMax(const float* values, int n) {
  return static_cast<int32_t>(std::max_element(values, values + n) - values);
}

namespace {

// The largest float below 1. SamplingUniform rounds its top draw to exactly 1.0f (about once in
// 2^24 draws), whose Gumbel noise -log(-log(1)) would be infinite and win for any logit.
constexpr float kMaxUniform = 0x1.fffffep-1f;
// An upper bound of GumbelNoise over every draw: -log(-log(kMaxUniform)) = 16.64.
constexpr float kMaxGumbelNoise = 17.0f;

float ScaledLogit(float logit, float temperature) {
  constexpr float kMax = std::numeric_limits<float>::max();
  return std::clamp(logit / temperature, -kMax, kMax);
}

float GumbelNoise(const SampleKey& key, int32_t token) {
  const float u =
      std::min(core::SamplingUniform(key.seed, key.sequence, key.position, static_cast<uint32_t>(token)), kMaxUniform);
  return -std::log(-std::log(u));
}

// The entries still in the running, in ascending id order until the top-p step, with their
// e = exp(z - max z).
struct Candidates {
  std::vector<int32_t> ids;
  std::vector<float> e;
};

// K1: the top_k entries by (z desc, id asc), in ascending id order, in time linear in the
// vocabulary: a heap of the best k seen so far when k is small (most entries fail one compare
// with its worst), nth_element otherwise; only the k survivors are sorted.
std::vector<int32_t> TopKByScaledLogit(const std::vector<float>& z, int top_k) {
  const int vocab = static_cast<int>(z.size());
  std::vector<int32_t> ids;
  if (top_k <= 0 || top_k >= vocab) {
    ids.resize(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    return ids;
  }
  auto better = [&](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); };
  if (top_k <= 4096) {
    // A heap whose front is the worst of the best k so far.
    ids.reserve(top_k);
    for (int32_t i = 0; i < vocab; ++i) {
      if (static_cast<int>(ids.size()) < top_k) {
        ids.push_back(i);
        std::push_heap(ids.begin(), ids.end(), better);
      } else if (better(i, ids.front())) {
        std::pop_heap(ids.begin(), ids.end(), better);
        ids.back() = i;
        std::push_heap(ids.begin(), ids.end(), better);
      }
    }
  } else {
    ids.resize(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::nth_element(ids.begin(), ids.begin() + (top_k - 1), ids.end(), better);
    ids.resize(top_k);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Keeps the entries of `c` whose mass before them, in (e desc, id asc) order, is below `limit`
// (in units of e), and always the first. With M the mass of `c` and n its size, an entry with
// e < (M - limit) / n is never kept: the entries above it outweigh M - n * e > limit. That cut
// (with a margin for rounding) leaves few entries for a real model, so sorting a head that grows
// until it holds the prefix stays cheap. The best entry (e == 1 >= M / n) always passes it.
void KeepTopPPrefix(double limit, Candidates* c) {
  double mass = 0;
  for (float e : c->e) mass += e;
  const double cut = mass - limit > 1e-6 * mass ? 0.999 * (mass - limit) / static_cast<double>(c->ids.size()) : 0.0;
  std::vector<int32_t> order;
  for (size_t j = 0; j < c->ids.size(); ++j) {
    if (c->e[j] >= cut) order.push_back(static_cast<int32_t>(j));
  }
  const size_t n = order.size();
  auto before = [&](int32_t a, int32_t b) {
    return c->e[a] > c->e[b] || (c->e[a] == c->e[b] && c->ids[a] < c->ids[b]);
  };
  size_t head = std::min<size_t>(n, 256);
  size_t keep = n;
  while (true) {
    if (head < n) std::nth_element(order.begin(), order.begin() + head, order.end(), before);
    std::sort(order.begin(), order.begin() + head, before);
    double mass_before = 0;
    size_t j = 0;
    for (; j < head; ++j) {
      if (j > 0 && !(mass_before < limit)) break;
      mass_before += c->e[order[j]];
    }
    if (j < head || head == n) {
      keep = j;
      break;
    }
    head = std::min(n, head * 8);
  }
  Candidates kept;
  kept.ids.reserve(keep);
  kept.e.reserve(keep);
  for (size_t j = 0; j < keep; ++j) {
    kept.ids.push_back(c->ids[order[j]]);
    kept.e.push_back(c->e[order[j]]);
  }
  *c = std::move(kept);
}

// argmax of z_i + g_i over `ids`, ties to the lowest id. The kept entry of largest z bounds the
// winner's score from below, so the noise of an entry more than kMaxGumbelNoise below that bound
// is never computed: it cannot win, and most of a real model's vocabulary is that far down.
int32_t GumbelMax(const std::vector<float>& z, const std::vector<int32_t>& ids, const SampleKey& key) {
  int32_t best_id = ids[0];
  for (int32_t id : ids) {
    if (z[id] > z[best_id] || (z[id] == z[best_id] && id < best_id)) best_id = id;
  }
  float best = z[best_id] + GumbelNoise(key, best_id);
  for (int32_t id : ids) {
    if (z[id] + kMaxGumbelNoise < best) continue;
    const float score = z[id] + GumbelNoise(key, id);
    if (score > best || (score == best && id < best_id)) {
      best = score;
      best_id = id;
    }
  }
  return best_id;
}

}  // namespace

int32_t SampleToken(const float* logits, int vocab, const SamplingParams& params, const SampleKey& key) {
  if (params.greedy()) return ArgMax(logits, vocab);
  std::vector<float> z(vocab);
  for (int i = 0; i < vocab; ++i) z[i] = ScaledLogit(logits[i], params.temperature);
  Candidates c;
  c.ids = TopKByScaledLogit(z, params.top_k);
  if (params.min_p > 0 || params.top_p < 1) {
    const float z_max = *std::max_element(z.begin(), z.end());
    c.e.resize(c.ids.size());
    double sum = 0;  // S over K1, in ascending id order
    for (size_t j = 0; j < c.ids.size(); ++j) {
      c.e[j] = std::exp(z[c.ids[j]] - z_max);
      sum += c.e[j];
    }
    if (params.min_p > 0) {
      size_t n = 0;
      for (size_t j = 0; j < c.ids.size(); ++j) {
        if (c.e[j] >= params.min_p) {
          c.ids[n] = c.ids[j];
          c.e[n++] = c.e[j];
        }
      }
      // The best entry has e == 1 >= min_p; only a min_p above 1 (not Validate()d) empties it.
      if (n == 0) return ArgMax(z.data(), vocab);
      c.ids.resize(n);
      c.e.resize(n);
    }
    if (params.top_p < 1) KeepTopPPrefix(static_cast<double>(params.top_p) * sum, &c);
  }
  return GumbelMax(z, c.ids, key);
}

absl::Status CheckLogitsFinite(const float* logits, int64_t rows, int vocab) {
  // Exponent bits all ones is NaN or infinity. On the bits, the loop vectorizes (std::isfinite
  // does not): a few microseconds for a row of 150k logits, against the forward's milliseconds.
  const int64_t count = rows * vocab;
  uint32_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, logits + i, sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  if (bad == 0) return absl::OkStatus();
  int64_t at = 0;
  while (std::isfinite(logits[at])) ++at;
  const std::string where = rows > 1 ? absl::StrCat("row ", at / vocab, ", vocabulary index ", at % vocab)
                                     : absl::StrCat("vocabulary index ", at % vocab);
  return absl::InternalError(absl::StrCat(
      "the model computed a non-finite logit (", std::isnan(logits[at]) ? "NaN" : "infinity", " at ", where,
      "); its weights or config.json values (rope_theta, rms_norm_eps, ...) are broken, so no token is served"));
}

}  // namespace moe::runtime

#include "moe/runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

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

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  rng_.seed(params.seed.has_value() ? *params.seed : std::random_device{}());
}

int32_t Sampler::Sample(const float* logits, int vocab) {
  if (params_.greedy()) return ArgMax(logits, vocab);
  // Candidates sorted by logit, best first; filters only ever cut the tail.
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  int keep = vocab;
  if (params_.top_k > 0 && params_.top_k < vocab) {
    keep = params_.top_k;
    std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  } else {
    std::sort(order.begin(), order.end(),
              [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  }
  std::vector<double> probs(keep);
  const double inv_t = 1.0 / params_.temperature;
  const double top = logits[order[0]];
  double sum = 0;
  for (int i = 0; i < keep; ++i) sum += probs[i] = std::exp((logits[order[i]] - top) * inv_t);
  for (double& p : probs) p /= sum;
  if (params_.min_p > 0) {
    const double floor = params_.min_p * probs[0];
    while (keep > 1 && probs[keep - 1] < floor) --keep;
  }
  if (params_.top_p < 1) {
    double cum = 0;
    int n = 0;
    while (n < keep) {
      cum += probs[n++];
      if (cum >= params_.top_p) break;
    }
    keep = std::max(n, 1);
  }
  double total = std::accumulate(probs.begin(), probs.begin() + keep, 0.0);
  double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (int i = 0; i < keep; ++i) {
    u -= probs[i];
    if (u < 0) return order[i];
  }
  return order[keep - 1];
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

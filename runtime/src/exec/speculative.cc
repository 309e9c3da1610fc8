#include "moe/runtime/speculative.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace moe::runtime {

absl::StatusOr<SpecType> ParseSpecType(std::string_view name) {
  if (name == "off") return SpecType::kOff;
  if (name == "ngram") return SpecType::kNgram;
  if (name == "mtp") return SpecType::kMtp;
  if (name == "draft") return SpecType::kDraft;
  return absl::InvalidArgumentError(absl::StrCat("'", std::string(name), "' is not a speculative method (mtp, draft, ngram or off)"));
}

const char* SpecTypeName(SpecType type) {
  switch (type) {
    case SpecType::kOff:
      return "off";
    case SpecType::kNgram:
      return "ngram";
    case SpecType::kMtp:
      return "mtp";
    case SpecType::kDraft:
      return "draft";
  }
  return "?";
}

absl::Status SpeculativeConfig::Validate() const {
  if (n_max < 1 || n_max > kMaxDraftTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_max: ", n_max, " is not in [1, ", kMaxDraftTokens, "] (drafts a sequence carries per step)"));
  }
  if (type != SpecType::kDraft && (!draft_model.empty() || !draft_device.empty())) {
    return absl::InvalidArgumentError(absl::StrCat("a draft model (", draft_model.empty() ? draft_device : draft_model,
                                                   ") is only read with type draft, not ", SpecTypeName(type)));
  }
  switch (type) {
    case SpecType::kOff:
    case SpecType::kNgram:
    case SpecType::kMtp:  // the checkpoint's head is checked where it is loaded
      return absl::OkStatus();
    case SpecType::kDraft:
      if (draft_model.empty()) return absl::InvalidArgumentError("type draft needs a draft model (--draft-model DIR)");
      if (!draft_device.empty() && draft_device != "cpu") {
        return absl::FailedPreconditionError(absl::StrCat(
            "type draft: the draft model runs on the CPU backend for now (device cpu), not '", draft_device, "'"));
      }
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

void NgramDraft(std::span<const int32_t> tokens, int max_draft, std::vector<int32_t>* draft,
                const NgramOptions& options) {
  const int64_t size = static_cast<int64_t>(tokens.size());
  if (max_draft <= 0) return;
  for (int64_t n = std::min<int64_t>(options.max_match, size - 1); n >= std::max(options.min_match, 1); --n) {
    const std::span<const int32_t> suffix = tokens.subspan(size - n);
    // The latest earlier occurrence: recent text predicts best.
    for (int64_t j = size - n - 1; j >= 0; --j) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + j)) continue;
      const int64_t from = j + n;
      const int64_t take = std::min<int64_t>(max_draft, size - from);
      draft->insert(draft->end(), tokens.begin() + from, tokens.begin() + from + take);
      return;
    }
  }
}

AcceptanceHistory::AcceptanceHistory() { std::fill(std::begin(keep), std::end(keep), 0.6f); }

DraftController::DraftController(const Options& options) : options_(options) {}

void DraftController::ObserveStep(int rows, double seconds) {
  if (rows <= 0 || !(seconds > 0)) return;
  auto [it, fresh] = step_seconds_.try_emplace(rows, seconds);
  if (!fresh) it->second += options_.step_ema * (seconds - it->second);
}

void DraftController::ObserveVerify(AcceptanceHistory* history, int drafted, int accepted) const {
  for (int i = 0; i < std::min(drafted, kMaxDraftTokens) && i <= accepted; ++i) {
    const float kept = i < accepted ? 1.0f : 0.0f;
    history->keep[i] += options_.ema * (kept - history->keep[i]);
  }
}

double DraftController::EstimateSeconds(int rows) const {
  if (step_seconds_.empty()) return -1;
  const auto hi = step_seconds_.lower_bound(rows);
  if (hi != step_seconds_.end() && hi->first == rows) return hi->second;
  // The two measured row counts nearest `rows`: around it when it lies between them, else the two
  // at the end it lies beyond.
  std::map<int, double>::const_iterator a, b;
  if (hi == step_seconds_.end()) {
    if (step_seconds_.size() < 2) return -1;
    b = std::prev(hi);
    a = std::prev(b);
  } else if (hi == step_seconds_.begin()) {
    if (step_seconds_.size() < 2) return -1;
    a = hi;
    b = std::next(hi);
  } else {
    a = std::prev(hi);
    b = hi;
  }
  // Time never falls as rows grow: a noisy pair gives a flat line, not a falling one.
  const double slope = std::max(0.0, (b->second - a->second) / (b->first - a->first));
  return std::max(1e-9, a->second + slope * (rows - a->first));
}

double DraftController::ExpectedTokens(const AcceptanceHistory& history, int k) {
  double tokens = 1, reach = 1;
  for (int i = 0; i < std::min(k, kMaxDraftTokens); ++i) {
    reach *= history.keep[i];
    tokens += reach;
  }
  return tokens;
}

int DraftController::Choose(AcceptanceHistory* history, int rows, int tokens, int most) const {
  const int limit = std::min(most, options_.n_max);
  if (limit <= 0) return 0;
  if (!options_.adaptive) return limit;
  const double base_seconds = EstimateSeconds(rows);
  // Nothing measured around this step yet: one draft, which measures a longer step.
  if (base_seconds <= 0 || EstimateSeconds(rows + 1) <= 0) return 1;
  const double others = std::max(0, tokens - 1);
  int best = 0;
  double best_rate = tokens / base_seconds;
  for (int k = 1; k <= limit; ++k) {
    const double rate = (others + ExpectedTokens(*history, k)) / EstimateSeconds(rows + k);
    if (rate > best_rate) {
      best_rate = rate;
      best = k;
    }
  }
  if (best > 0) {
    history->steps_without_drafts = 0;
    history->probes = 0;
    return best;
  }
  // Off for now; a probe now and then learns whether the text turned predictable.
  const int wait = options_.probe_interval << std::min(history->probes, 4);
  if (++history->steps_without_drafts < wait) return 0;
  history->steps_without_drafts = 0;
  ++history->probes;
  return 1;
}

}  // namespace moe::runtime

// Speculative decoding's parts that need no model: the method and its settings, the n-gram
// drafter (prompt lookup over a sequence's prompt and output), and the controller that picks each
// sequence's draft length for the next step from measured step times and the sequence's
// acceptance so far.
//
// Verification lives in executor.h (SequenceChunk::num_draft, AcceptDrafts): the target is sampled
// at every draft row with its own counter-based sampler, so whatever a drafter proposes, and
// whatever length the controller picks, the tokens served are those of decoding without drafts.
// Drafters and the controller only decide how many tokens a step serves.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::runtime {

// Drafts one sequence may carry in one step, at most (a verify of 17 rows).
constexpr int kMaxDraftTokens = 16;

// How drafts are made. kMtp: the target checkpoint's nextn (MTP) layers; kDraft: a second, smaller
// model with the same tokenizer; kNgram: the sequence's own earlier tokens.
enum class SpecType { kOff, kNgram, kMtp, kDraft };

// "off", "ngram", "mtp", "draft" <-> SpecType; kInvalidArgument naming the accepted values.
absl::StatusOr<SpecType> ParseSpecType(std::string_view name);
const char* SpecTypeName(SpecType type);

struct SpeculativeConfig {
  SpecType type = SpecType::kOff;
  int n_max = 3;          // drafts a sequence may carry in one step (1..kMaxDraftTokens)
  bool adaptive = true;   // pick fewer (down to none) when they do not pay; else always n_max
  std::string draft_model;   // kDraft: the draft checkpoint
  std::string draft_device;  // kDraft: "cpu" or "cuda:N"
  // Drafts a sequence carries at most: n_max with a method, 0 when off.
  int max_draft() const { return type == SpecType::kOff ? 0 : n_max; }
  // kInvalidArgument naming the field for an n_max out of range or draft settings that do not
  // belong to the method; kFailedPrecondition for what this build cannot run (a draft model on a
  // GPU). Whether a checkpoint has an MTP head is checked where the head is loaded.
  absl::Status Validate() const;
};

// Prompt lookup: finds the latest earlier occurrence of the longest suffix of `tokens` of
// [min_match, max_match] tokens, and appends to `draft` up to `max_draft` of the tokens that
// followed it. Appends nothing when the suffix never occurred before. O(size * max_match).
struct NgramOptions {
  int min_match = 2;
  int max_match = 4;
};
void NgramDraft(std::span<const int32_t> tokens, int max_draft, std::vector<int32_t>* draft,
                const NgramOptions& options = {});

// What one sequence accepted so far, for DraftController: the probability that draft i is kept
// once drafts 0..i-1 were (an exponential moving average per position), and how long it has gone
// without drafts.
struct AcceptanceHistory {
  float keep[kMaxDraftTokens];  // 0.6 for a new sequence
  int steps_without_drafts = 0;
  int probes = 0;  // probes in a row that did not turn drafting back on (longer waits after each)
  AcceptanceHistory();
};

// Picks each sequence's draft length for the next step so that the step serves the most tokens per
// second: a step of `rows` rows takes T(rows) seconds (measured: an average per row count, and
// between and beyond measured counts a line through the nearest two), and a sequence that carries
// k drafts serves 1 + keep[0] + keep[0]·keep[1] + ... tokens on average. So with T(rows) nearly
// linear in rows (routed experts read from host memory by every row) drafts pay only with high
// acceptance, and at high concurrency (many rows already) or for prose (low acceptance) the best
// length is 0. A sequence at 0 drafts for `probe_interval` steps gets one draft once, to learn
// whether its text changed; a probe that does not turn drafting back on doubles the wait.
//
// Thread-safety: none; the scheduler's loop owns it.
class DraftController {
 public:
  struct Options {
    int n_max = 3;
    bool adaptive = true;
    float ema = 0.3f;          // weight of the newest outcome in keep[i]
    float step_ema = 0.2f;     // weight of the newest measurement in T(rows)
    int probe_interval = 16;   // steps without drafts before a probe (doubling to 256)
  };
  explicit DraftController(const Options& options);

  // A step of `rows` rows (every token fed, drafts included) took `seconds`.
  void ObserveStep(int rows, double seconds);
  // A sequence carried `drafted` drafts and `accepted` of them were kept.
  void ObserveVerify(AcceptanceHistory* history, int drafted, int accepted) const;
  // The drafts a sequence should carry in a step that already has `rows` rows (this sequence's
  // one token among them) and serves `tokens` tokens without this sequence's drafts; at most
  // `most`. Counts a step without drafts toward the next probe.
  int Choose(AcceptanceHistory* history, int rows, int tokens, int most) const;
  // T(rows) as measured so far; negative when nothing is.
  double EstimateSeconds(int rows) const;
  // Mean tokens a sequence with `history` serves carrying k drafts.
  static double ExpectedTokens(const AcceptanceHistory& history, int k);

 private:
  Options options_;
  std::map<int, double> step_seconds_;  // rows -> average seconds
};

}  // namespace moe::runtime

// Structured outputs at the token level: a grammar (grammar.h, json_schema.h) over the model's
// vocabulary. Each step, a constrained sequence's sampling row carries the mask of the token ids
// whose bytes the grammar allows next (runtime/token_mask.h), computed by walking a trie of the
// vocabulary's token bytes beside the matcher: a subtree is left as soon as its prefix cannot
// follow, so the walk visits only the tokens that may come next and their first failing byte.
// The matcher states the walk meets are few (inside a JSON string, after any ordinary character
// it is the same state again), so the walk numbers them and keeps each one's transitions by byte:
// most trie nodes cost a table lookup, not a matcher's copy and advance.
// That walk is done once per stack top (a stack's top entries, over a floor standing for whatever
// is below): the tokens the top takes whatever is below it are kept as bits, and the few that may
// finish the top's rule and go on below it (their next byte in its FOLLOW) as a list. A state's
// mask is the OR of its tops' bits, with the listed tokens tried against the whole state, so a new
// state whose tops were met before, in any context, costs a pass over the vocabulary's bits.
// Masks are cached by matcher state, shared by every request with the same grammar (inside a JSON
// string most steps are the same state). The end-of-sequence ids are allowed exactly when the
// bytes so far are a whole sentence; special tokens never are.
//
// Thread-safety: VocabularyTrie and TokenGrammar are immutable but for TokenGrammar's mask cache
// and timing, which are guarded, so masks may be computed on any threads at once.
// StructuredOutputs may be used from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "moe/runtime/token_mask.h"
#include "moe/scheduler/grammar.h"
#include "nlohmann/json.hpp"

namespace moe::scheduler {

class VocabularyTrie {
 public:
  // token_bytes[id]: what token `id` writes; "" for a token structured output never uses (special
  // tokens, ids the tokenizer does not know).
  explicit VocabularyTrie(std::vector<std::string> token_bytes);
  int size() const { return static_cast<int>(bytes_.size()); }
  const std::string& bytes(int32_t id) const { return bytes_[id]; }

 private:
  friend class TokenGrammar;
  // The trie in flat arrays, its nodes numbered in depth-first order (0: the root, the empty
  // prefix), so that a walk reads memory mostly in order: node n's children are
  // child_byte_/child_node_[child_begin_[n], child_begin_[n + 1]), by byte, and the ids whose bytes
  // end at n are token_ids_[token_begin_[n], token_begin_[n + 1]).
  std::vector<std::string> bytes_;
  std::vector<uint32_t> child_begin_;
  std::vector<uint8_t> child_byte_;
  std::vector<int32_t> child_node_;
  std::vector<uint32_t> token_begin_;
  std::vector<int32_t> token_ids_;
  std::vector<int32_t> subtree_end_;  // node n's subtree is nodes [n, subtree_end_[n])
};

class TokenGrammar {
 public:
  // The entries of a stack's top whose tokens are computed whatever lies below them (PositionTokens):
  // enough that inside a JSON string the top reaches the closing quote (a byte's rule, the
  // string's rest, the quote), so that only tokens that close the string depend on the stack below.
  static constexpr size_t kDefaultTopEntries = 4;

  TokenGrammar(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const VocabularyTrie> vocabulary,
               int vocab_size, std::vector<int> eos_token_ids, size_t top_entries = kDefaultTopEntries);

  GrammarMatcher NewMatcher() const { return GrammarMatcher(grammar_); }
  // The tokens that may follow `matcher`'s bytes (cached by state).
  std::shared_ptr<const runtime::TokenMask> Mask(const GrammarMatcher& matcher) const;
  // The cached mask of this state, or null.
  std::shared_ptr<const runtime::TokenMask> CachedMask(const GrammarMatcher& matcher) const;
  // The mask computed again, the cache neither read nor written (for tests and benchmarks).
  std::shared_ptr<const runtime::TokenMask> MaskUncached(const GrammarMatcher& matcher) const {
    return ComputeMask(matcher);
  }
  // The same mask by trying every token of the vocabulary in turn (for tests).
  std::shared_ptr<const runtime::TokenMask> MaskByEveryToken(const GrammarMatcher& matcher) const;
  // Advances `matcher` by the bytes of `token`; false (unchanged) when they cannot follow.
  bool Accept(GrammarMatcher* matcher, int32_t token) const;
  bool IsEos(int32_t token) const;

  // Stack tops whose tokens were computed (each the first time a state had it).
  int64_t tops_computed() const { return tops_computed_.load(); }
  // Of those, the ones with tokens that may go below them (tried against the whole state).
  int64_t tops_with_uncertain_tokens() const { return tops_uncertain_.load(); }

  // Masks computed (not found in the cache) and the seconds they took, over the grammar's life.
  int64_t masks_computed() const { return computed_.load(); }
  double mask_seconds() const { return static_cast<double>(mask_ns_.load()) * 1e-9; }

 private:
  class WalkStates;
  // What a stack's top entries (top_entries_ of them) allow whatever the stack below them:
  // `accepted`, the tokens all of whose bytes they take before their bottom entry's rule is
  // finished (or exactly as it is); `uncertain`, those that may finish it and go on into the stack
  // below (their next byte in that rule's FOLLOW), to be tried against the whole state. The rest
  // never follow that stack.
  struct PositionTokens {
    std::vector<uint32_t> accepted;  // a bit per token id
    std::vector<int32_t> uncertain;
    size_t max_depth = 0;  // the deepest stack the walk met, above the floor
  };
  std::shared_ptr<const PositionTokens> TokensAt(const std::vector<int32_t>& top) const;
  std::shared_ptr<const PositionTokens> ComputeTokensAt(const std::vector<int32_t>& top) const;
  void WalkPosition(int32_t node, int32_t state, bool uncertain_below, const ByteSet& follow, WalkStates& states,
                    PositionTokens* out) const;
  void Walk(int32_t node, int32_t state, WalkStates& states, std::vector<uint32_t>* words) const;
  std::shared_ptr<const runtime::TokenMask> ComputeMask(const GrammarMatcher& matcher) const;
  void AllowEos(const GrammarMatcher& matcher, std::vector<uint32_t>* words) const;

  const std::shared_ptr<const Grammar> grammar_;
  const std::shared_ptr<const VocabularyTrie> vocabulary_;
  const int vocab_size_;
  const std::vector<int> eos_token_ids_;
  const size_t top_entries_;
  mutable absl::Mutex mu_;
  mutable std::unordered_map<std::string, std::shared_ptr<const runtime::TokenMask>> cache_ ABSL_GUARDED_BY(mu_);
  mutable std::map<std::vector<int32_t>, std::shared_ptr<const PositionTokens>> tops_ ABSL_GUARDED_BY(mu_);
  mutable std::atomic<int64_t> tops_computed_{0};
  mutable std::atomic<int64_t> tops_uncertain_{0};
  mutable std::atomic<int64_t> computed_{0};
  mutable std::atomic<int64_t> mask_ns_{0};
};

// Compiles the grammars of requests, keeping each (and its masks) for the next request that asks
// for the same: an agent sends the same schema or tools every turn.
class StructuredOutputs {
 public:
  StructuredOutputs(std::shared_ptr<const VocabularyTrie> vocabulary, int vocab_size, std::vector<int> eos_token_ids);

  // response_format json_schema (its `schema`); `field` names it in errors (kInvalidArgument
  // naming the keyword a schema uses that cannot be enforced).
  absl::StatusOr<std::shared_ptr<const TokenGrammar>> ForJsonSchema(const nlohmann::json& schema,
                                                                    const std::string& field);
  // response_format json_object.
  absl::StatusOr<std::shared_ptr<const TokenGrammar>> ForJsonObject();
  // tool_choice "required": ToolCallsGrammar(tools).
  absl::StatusOr<std::shared_ptr<const TokenGrammar>> ForToolCalls(const nlohmann::json& tools);
  // OpenAI's response_format object, as both APIs take it: {"type": "text"} (null: no grammar),
  // {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ..., "strict":
  // ...}}. kInvalidArgument for another shape, or a schema keyword that cannot be enforced.
  absl::StatusOr<std::shared_ptr<const TokenGrammar>> ForResponseFormat(const nlohmann::json& format);

 private:
  absl::StatusOr<std::shared_ptr<const TokenGrammar>> Cached(
      const std::string& key, const std::function<absl::StatusOr<std::shared_ptr<const Grammar>>()>& compile);

  const std::shared_ptr<const VocabularyTrie> vocabulary_;
  const int vocab_size_;
  const std::vector<int> eos_token_ids_;
  absl::Mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const TokenGrammar>> grammars_ ABSL_GUARDED_BY(mu_);
};

// ForResponseFormat of `structured`, where null means the model has no tokenizer: {"type": "text"}
// is still taken, the others are refused (kInvalidArgument saying so).
absl::StatusOr<std::shared_ptr<const TokenGrammar>> GrammarForResponseFormat(const nlohmann::json& format,
                                                                             StructuredOutputs* structured);

}  // namespace moe::scheduler

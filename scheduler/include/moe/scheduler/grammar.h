// Grammar: a context-free grammar over bytes (what the JSON Schema compiler, json_schema.h,
// produces), and GrammarMatcher, which follows it one byte at a time as a pushdown automaton.
//
// A grammar is a list of rules; a rule is a list of alternatives; an alternative is a sequence of
// items, each a set of bytes (one byte from it) or another rule. A matcher's state is the set of
// parse stacks alive after the bytes so far: each stack lists grammar positions, its top at a byte
// set (or empty once the whole grammar is matched). Rules must not be left-recursive and no rule
// may reach itself without consuming a byte (GrammarBuilder's users write right recursion, and a
// right-recursive tail call does not grow the stack).
//
// Thread-safety: a built Grammar is immutable and may be shared by any number of threads; a
// GrammarMatcher belongs to one thread at a time (copies are independent).
#pragma once

#include <bitset>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::scheduler {

using ByteSet = std::bitset<256>;

class Grammar {
 public:
  struct Symbol {
    enum class Kind : uint8_t { kBytes, kRule, kEnd };
    Kind kind = Kind::kEnd;
    int32_t arg = 0;  // kBytes: index into sets_; kRule: the rule
  };
  int num_rules() const { return static_cast<int>(alternatives_.size()); }
  int num_symbols() const { return static_cast<int>(symbols_.size()); }
  // A position past the grammar's own, a byte set that takes no byte: the bottom of the stacks of
  // GrammarMatcher::AtStackTop, where they arrive when what is above it is finished.
  int32_t floor() const { return floor_; }
  // The bytes that may come right after the rule that holds position `pos` is finished, in any
  // context (a superset: LL(1)'s FOLLOW of that rule). A stack whose entry at `pos` is popped has
  // finished that rule.
  const ByteSet& FollowOfRuleAt(int32_t pos) const { return follow_[rule_of_[pos]]; }

 private:
  friend class GrammarBuilder;
  friend class GrammarMatcher;
  std::vector<Symbol> symbols_;                    // every alternative, each ended by kEnd; 0: the start
  std::vector<std::vector<int32_t>> alternatives_;  // per rule: where each alternative starts
  std::vector<ByteSet> sets_;
  int32_t floor_ = 0;
  std::vector<int32_t> rule_of_;  // per position: its rule (the start's and the floor's: an extra one)
  std::vector<ByteSet> follow_;   // per rule, and last the extra one's (empty)
};

class GrammarBuilder {
 public:
  struct Item {
    bool is_rule = false;
    int32_t id = 0;  // a rule, or a byte set's index
  };
  using Seq = std::vector<Item>;

  int NewRule();
  void AddAlternative(int rule, Seq seq);
  Item RuleItem(int rule) const { return Item{true, rule}; }
  Item Bytes(const ByteSet& set);
  Item Byte(uint8_t b);
  Seq Literal(std::string_view bytes);
  // Rules for repetitions of `seq`: zero or one, zero or more, and min..max times (max < 0:
  // unbounded), right-recursive.
  int Optional(const Seq& seq);
  int Star(const Seq& seq);
  int Repeat(const Seq& seq, int min, int max);
  // A rule with one alternative per sequence.
  int Choice(const std::vector<Seq>& seqs);

  // The grammar whose sentences are `root`'s. kInvalidArgument when a rule has no alternative.
  absl::StatusOr<std::shared_ptr<const Grammar>> Build(int root) const;

 private:
  std::vector<std::vector<Seq>> rules_;
  std::vector<ByteSet> sets_;
};

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar);
  // A matcher whose one stack is the floor and `top` (the top of some matcher's stack, a byte set's
  // position last): it follows what may come from there without knowing the stack below;
  // left_floor() tells when a parse has finished `top` and needs that stack.
  static GrammarMatcher AtStackTop(std::shared_ptr<const Grammar> grammar, const std::vector<int32_t>& top);

  // Takes one more byte; false (and the state unchanged) when it cannot follow.
  bool Advance(uint8_t byte);
  // Takes all of `bytes` or, when one cannot follow, none of them.
  bool AdvanceBytes(std::string_view bytes);
  // The bytes so far are a whole sentence of the grammar.
  bool accepting() const;
  // Some byte may still follow.
  bool can_continue() const;
  // The bytes that may follow.
  ByteSet NextBytes() const;
  // The state as a value: equal for two matchers of one grammar exactly when the same bytes may
  // follow them to the same ends (a cache key).
  std::string StateKey() const;
  const std::shared_ptr<const Grammar>& grammar() const { return grammar_; }
  // Some stack has come down to the grammar's floor (AtStackTop).
  bool left_floor() const;
  // The top `n` entries (fewer where a stack is shorter) of each stack, distinct, and the depth of
  // the deepest stack.
  std::vector<std::vector<int32_t>> StackTops(size_t n) const;
  size_t max_depth() const;
  // A stack deeper than this is dropped: only a grammar nested this deep (JSON of this depth)
  // needs it, and it bounds the matcher's memory whatever the grammar.
  static constexpr size_t kMaxStackDepth = 2048;

 private:
  using Stack = std::vector<int32_t>;
  // Pops finished alternatives and expands rules at the top of `stack` until its top is a byte
  // set (or it is empty), adding every resulting stack to `out`.
  void Expand(Stack stack, std::vector<Stack>* out) const;
  static void Normalize(std::vector<Stack>* stacks);

  std::shared_ptr<const Grammar> grammar_;
  std::vector<Stack> stacks_;  // sorted, no duplicates
};

}  // namespace moe::scheduler

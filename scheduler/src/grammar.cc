#include "moe/scheduler/grammar.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe::scheduler {

int GrammarBuilder::NewRule() {
  rules_.emplace_back();
  return static_cast<int>(rules_.size()) - 1;
}

void GrammarBuilder::AddAlternative(int rule, Seq seq) { rules_[rule].push_back(std::move(seq)); }

GrammarBuilder::Item GrammarBuilder::Bytes(const ByteSet& set) {
  for (size_t i = 0; i < sets_.size(); ++i) {
    if (sets_[i] == set) return Item{false, static_cast<int32_t>(i)};
  }
  sets_.push_back(set);
  return Item{false, static_cast<int32_t>(sets_.size()) - 1};
}

GrammarBuilder::Item GrammarBuilder::Byte(uint8_t b) {
  ByteSet set;
  set.set(b);
  return Bytes(set);
}

GrammarBuilder::Seq GrammarBuilder::Literal(std::string_view bytes) {
  Seq seq;
  for (const char c : bytes) seq.push_back(Byte(static_cast<uint8_t>(c)));
  return seq;
}

int GrammarBuilder::Optional(const Seq& seq) {
  const int r = NewRule();
  AddAlternative(r, seq);
  AddAlternative(r, {});
  return r;
}

int GrammarBuilder::Star(const Seq& seq) {
  const int r = NewRule();
  Seq more = seq;
  more.push_back(RuleItem(r));
  AddAlternative(r, std::move(more));
  AddAlternative(r, {});
  return r;
}

int GrammarBuilder::Repeat(const Seq& seq, int min, int max) {
  // The optional tail first: max - min more, nested (a b? )? ..., or a star when unbounded.
  int tail = -1;
  if (max < 0) {
    tail = Star(seq);
  } else {
    for (int i = 0; i < max - min; ++i) {
      const int r = NewRule();
      Seq more = seq;
      if (tail >= 0) more.push_back(RuleItem(tail));
      AddAlternative(r, std::move(more));
      AddAlternative(r, {});
      tail = r;
    }
  }
  const int r = NewRule();
  Seq all;
  for (int i = 0; i < min; ++i) all.insert(all.end(), seq.begin(), seq.end());
  if (tail >= 0) all.push_back(RuleItem(tail));
  AddAlternative(r, std::move(all));
  return r;
}

int GrammarBuilder::Choice(const std::vector<Seq>& seqs) {
  const int r = NewRule();
  for (const Seq& s : seqs) AddAlternative(r, s);
  return r;
}

absl::StatusOr<std::shared_ptr<const Grammar>> GrammarBuilder::Build(int root) const {
  auto g = std::make_shared<Grammar>();
  using Kind = Grammar::Symbol::Kind;
  // Position 0: the start, [root, end].
  g->symbols_.push_back({Kind::kRule, root});
  g->symbols_.push_back({Kind::kEnd, 0});
  g->alternatives_.resize(rules_.size());
  for (size_t r = 0; r < rules_.size(); ++r) {
    if (rules_[r].empty()) return absl::InvalidArgumentError(absl::StrCat("grammar rule ", r, " has no alternative"));
    for (const Seq& seq : rules_[r]) {
      g->alternatives_[r].push_back(static_cast<int32_t>(g->symbols_.size()));
      for (const Item& item : seq) g->symbols_.push_back({item.is_rule ? Kind::kRule : Kind::kBytes, item.id});
      g->symbols_.push_back({Kind::kEnd, 0});
    }
  }
  g->sets_ = sets_;
  g->sets_.emplace_back();  // the floor's: no byte
  g->floor_ = static_cast<int32_t>(g->symbols_.size());
  g->symbols_.push_back({Kind::kBytes, static_cast<int32_t>(g->sets_.size()) - 1});
  g->symbols_.push_back({Kind::kEnd, 0});
  // The rule of each position, and each rule's FOLLOW (LL(1)'s: FIRST and nullable first).
  const int32_t rules = static_cast<int32_t>(rules_.size());
  g->rule_of_.assign(g->symbols_.size(), rules);
  for (int32_t r = 0; r < rules; ++r) {
    for (int32_t a : g->alternatives_[r]) {
      for (int32_t p = a; g->symbols_[p].kind != Kind::kEnd; ++p) g->rule_of_[p] = r;
    }
  }
  std::vector<bool> nullable(rules, false);
  std::vector<ByteSet> first(rules);
  // FIRST of the sequence from position p to its alternative's end; whether all of it is nullable.
  auto first_from = [&](int32_t p, ByteSet* out) {
    for (; g->symbols_[p].kind != Kind::kEnd; ++p) {
      const Grammar::Symbol& sym = g->symbols_[p];
      if (sym.kind == Kind::kBytes) {
        *out |= g->sets_[sym.arg];
        return false;
      }
      *out |= first[sym.arg];
      if (!nullable[sym.arg]) return false;
    }
    return true;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (int32_t r = 0; r < rules; ++r) {
      for (int32_t a : g->alternatives_[r]) {
        ByteSet f = first[r];
        const bool n = first_from(a, &f);
        if (f != first[r] || (n && !nullable[r])) {
          first[r] = f;
          nullable[r] = nullable[r] || n;
          changed = true;
        }
      }
    }
  }
  g->follow_.assign(rules + 1, ByteSet());
  for (bool changed = true; changed;) {
    changed = false;
    for (int32_t r = 0; r < rules; ++r) {
      for (int32_t a : g->alternatives_[r]) {
        for (int32_t p = a; g->symbols_[p].kind != Kind::kEnd; ++p) {
          if (g->symbols_[p].kind != Kind::kRule) continue;
          ByteSet f = g->follow_[g->symbols_[p].arg];
          if (first_from(p + 1, &f)) f |= g->follow_[r];
          if (f != g->follow_[g->symbols_[p].arg]) {
            g->follow_[g->symbols_[p].arg] = f;
            changed = true;
          }
        }
      }
    }
  }
  return std::shared_ptr<const Grammar>(std::move(g));
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {
  Expand(Stack{0}, &stacks_);
  Normalize(&stacks_);
}

GrammarMatcher GrammarMatcher::AtStackTop(std::shared_ptr<const Grammar> grammar, const std::vector<int32_t>& top) {
  GrammarMatcher m(std::move(grammar));
  Stack stack = {m.grammar_->floor_};
  stack.insert(stack.end(), top.begin(), top.end());
  m.stacks_.assign(1, std::move(stack));
  return m;
}

bool GrammarMatcher::left_floor() const {
  for (const Stack& s : stacks_) {
    if (!s.empty() && s.back() == grammar_->floor_) return true;
  }
  return false;
}

std::vector<std::vector<int32_t>> GrammarMatcher::StackTops(size_t n) const {
  std::vector<std::vector<int32_t>> tops;
  for (const Stack& s : stacks_) {
    if (!s.empty()) tops.emplace_back(s.end() - std::min(n, s.size()), s.end());
  }
  std::sort(tops.begin(), tops.end());
  tops.erase(std::unique(tops.begin(), tops.end()), tops.end());
  return tops;
}

size_t GrammarMatcher::max_depth() const {
  size_t depth = 0;
  for (const Stack& s : stacks_) depth = std::max(depth, s.size());
  return depth;
}

void GrammarMatcher::Normalize(std::vector<Stack>* stacks) {
  std::sort(stacks->begin(), stacks->end());
  stacks->erase(std::unique(stacks->begin(), stacks->end()), stacks->end());
}

void GrammarMatcher::Expand(Stack stack, std::vector<Stack>* out) const {
  using Kind = Grammar::Symbol::Kind;
  const std::vector<Grammar::Symbol>& symbols = grammar_->symbols_;
  while (true) {
    if (stack.size() > kMaxStackDepth) return;
    if (stack.empty()) {
      out->push_back(std::move(stack));
      return;
    }
    const int32_t pos = stack.back();
    const Grammar::Symbol& sym = symbols[pos];
    if (sym.kind == Kind::kEnd) {
      stack.pop_back();
      continue;
    }
    if (sym.kind == Kind::kBytes) {
      out->push_back(std::move(stack));
      return;
    }
    // A rule: return to the next item after it, unless that ends the alternative (a tail call,
    // which keeps right recursion from growing the stack); then each alternative in turn.
    stack.pop_back();
    if (symbols[pos + 1].kind != Kind::kEnd) stack.push_back(pos + 1);
    const std::vector<int32_t>& alts = grammar_->alternatives_[sym.arg];
    for (size_t i = 0; i + 1 < alts.size(); ++i) {
      Stack other = stack;
      other.push_back(alts[i]);
      Expand(std::move(other), out);
    }
    stack.push_back(alts.back());
  }
}

bool GrammarMatcher::Advance(uint8_t byte) {
  std::vector<Stack> next;
  for (const Stack& s : stacks_) {
    if (s.empty()) continue;
    const Grammar::Symbol& sym = grammar_->symbols_[s.back()];
    if (!grammar_->sets_[sym.arg].test(byte)) continue;
    Stack moved = s;
    ++moved.back();
    Expand(std::move(moved), &next);
  }
  if (next.empty()) return false;
  Normalize(&next);
  stacks_ = std::move(next);
  return true;
}

bool GrammarMatcher::AdvanceBytes(std::string_view bytes) {
  GrammarMatcher copy = *this;
  for (const char c : bytes) {
    if (!copy.Advance(static_cast<uint8_t>(c))) return false;
  }
  *this = std::move(copy);
  return true;
}

bool GrammarMatcher::accepting() const {
  return !stacks_.empty() && stacks_.front().empty();  // sorted: the empty stack comes first
}

bool GrammarMatcher::can_continue() const {
  return !stacks_.empty() && !stacks_.back().empty();
}

ByteSet GrammarMatcher::NextBytes() const {
  ByteSet bytes;
  for (const Stack& s : stacks_) {
    if (!s.empty()) bytes |= grammar_->sets_[grammar_->symbols_[s.back()].arg];
  }
  return bytes;
}

std::string GrammarMatcher::StateKey() const {
  std::string key;
  for (const Stack& s : stacks_) {
    key.append(reinterpret_cast<const char*>(s.data()), s.size() * sizeof(int32_t));
    key.append(4, '\xff');  // no position is -1
  }
  return key;
}

}  // namespace moe::scheduler

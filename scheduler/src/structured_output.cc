#include "moe/scheduler/structured_output.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "moe/scheduler/json_schema.h"

namespace moe::scheduler {
namespace {

// Masks kept per grammar; past it the cache starts again (a mask is vocab/8 bytes).
constexpr size_t kMaxCachedMasks = 1024;
// Stack tops whose tokens are kept per grammar (each a bit per token id, and a list).
constexpr size_t kMaxCachedTops = 512;
// Grammars kept per StructuredOutputs.
constexpr size_t kMaxGrammars = 256;

void Allow(int32_t id, std::vector<uint32_t>* words) { (*words)[id / 32] |= 1u << (id % 32); }

}  // namespace

VocabularyTrie::VocabularyTrie(std::vector<std::string> token_bytes) : bytes_(std::move(token_bytes)) {
  // Built as nodes first, then laid flat in depth-first order.
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;  // by byte
    std::vector<int32_t> tokens;                        // ids whose bytes end here
  };
  std::vector<Node> nodes(1);
  for (int32_t id = 0; id < static_cast<int32_t>(bytes_.size()); ++id) {
    int32_t node = 0;
    for (const char c : bytes_[id]) {
      const uint8_t b = static_cast<uint8_t>(c);
      auto& children = nodes[node].children;
      auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(b, int32_t{-1}));
      if (it == children.end() || it->first != b) {
        const int32_t added = static_cast<int32_t>(nodes.size());
        it = children.insert(it, {b, added});
        nodes.emplace_back();  // invalidates `children`, not `it`'s copy below
        node = added;
      } else {
        node = it->second;
      }
    }
    if (node != 0) nodes[node].tokens.push_back(id);
  }
  // Depth-first numbering: a node's number is given when it is reached.
  std::vector<int32_t> order;  // new number -> old
  std::vector<int32_t> number(nodes.size(), -1);
  order.reserve(nodes.size());
  std::vector<int32_t> pending = {0};
  while (!pending.empty()) {
    const int32_t old = pending.back();
    pending.pop_back();
    number[old] = static_cast<int32_t>(order.size());
    order.push_back(old);
    const auto& children = nodes[old].children;
    for (auto it = children.rbegin(); it != children.rend(); ++it) pending.push_back(it->second);
  }
  child_begin_.reserve(order.size() + 1);
  token_begin_.reserve(order.size() + 1);
  child_byte_.reserve(nodes.size());
  child_node_.reserve(nodes.size());
  for (const int32_t old : order) {
    child_begin_.push_back(static_cast<uint32_t>(child_node_.size()));
    token_begin_.push_back(static_cast<uint32_t>(token_ids_.size()));
    for (const auto& [byte, child] : nodes[old].children) {
      child_byte_.push_back(byte);
      child_node_.push_back(number[child]);
    }
    token_ids_.insert(token_ids_.end(), nodes[old].tokens.begin(), nodes[old].tokens.end());
  }
  child_begin_.push_back(static_cast<uint32_t>(child_node_.size()));
  token_begin_.push_back(static_cast<uint32_t>(token_ids_.size()));
  // Depth-first: a subtree ends where its last child's does, or right after the node.
  subtree_end_.resize(order.size());
  for (int32_t n = static_cast<int32_t>(order.size()) - 1; n >= 0; --n) {
    subtree_end_[n] = child_begin_[n] < child_begin_[n + 1] ? subtree_end_[child_node_[child_begin_[n + 1] - 1]] : n + 1;
  }
}

TokenGrammar::TokenGrammar(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const VocabularyTrie> vocabulary,
                           int vocab_size, std::vector<int> eos_token_ids, size_t top_entries)
    : grammar_(std::move(grammar)),
      vocabulary_(std::move(vocabulary)),
      vocab_size_(vocab_size),
      eos_token_ids_(std::move(eos_token_ids)),
      top_entries_(std::max<size_t>(1, top_entries)) {}

bool TokenGrammar::IsEos(int32_t token) const {
  return std::find(eos_token_ids_.begin(), eos_token_ids_.end(), token) != eos_token_ids_.end();
}

void TokenGrammar::AllowEos(const GrammarMatcher& matcher, std::vector<uint32_t>* words) const {
  if (!matcher.accepting()) return;
  for (int id : eos_token_ids_) {
    if (id >= 0 && id < vocab_size_) Allow(id, words);
  }
}

// The matcher states one walk meets, numbered, with their transitions by byte as they are found:
// a lazily built DFA over the states reached from the walk's start. Owned by one Mask call.
class TokenGrammar::WalkStates {
 public:
  static constexpr int32_t kDead = -1;

  explicit WalkStates(const GrammarMatcher& start) { Intern(start); }

  bool left_floor(int32_t state) const { return left_floor_[state]; }
  size_t max_depth() const { return max_depth_; }

  // The state after `byte` from `state`, or kDead.
  int32_t Next(int32_t state, uint8_t byte) {
    if (state < kTabled) {
      if (const int32_t known = table_[static_cast<size_t>(state) * 256 + byte]; known != kUnknown) return known;
    } else if (auto it = spill_.find(Key(state, byte)); it != spill_.end()) {
      return it->second;
    }
    GrammarMatcher advanced = states_[state];
    const int32_t next = advanced.Advance(byte) ? Intern(std::move(advanced)) : kDead;
    if (state < kTabled) {
      table_[static_cast<size_t>(state) * 256 + byte] = next;  // after Intern, which may grow table_
    } else {
      spill_.emplace(Key(state, byte), next);
    }
    return next;
  }

 private:
  static constexpr int32_t kUnknown = -2;
  // States below this keep a 256-entry table (1 KiB each); the rest, rare, a hash map.
  static constexpr int32_t kTabled = 1024;

  static uint64_t Key(int32_t state, uint8_t byte) { return (static_cast<uint64_t>(state) << 8) | byte; }

  int32_t Intern(GrammarMatcher matcher) {
    auto [it, added] = ids_.emplace(matcher.StateKey(), static_cast<int32_t>(states_.size()));
    if (!added) return it->second;
    left_floor_.push_back(matcher.left_floor());
    max_depth_ = std::max(max_depth_, matcher.max_depth());
    states_.push_back(std::move(matcher));
    if (it->second < kTabled) table_.resize(table_.size() + 256, kUnknown);
    return it->second;
  }

  std::vector<GrammarMatcher> states_;
  std::vector<bool> left_floor_;
  size_t max_depth_ = 0;
  absl::flat_hash_map<std::string, int32_t> ids_;
  std::vector<int32_t> table_;  // [state * 256 + byte]: the next state, kDead or kUnknown
  absl::flat_hash_map<uint64_t, int32_t> spill_;
};

void TokenGrammar::Walk(int32_t node, int32_t state, WalkStates& states, std::vector<uint32_t>* words) const {
  const VocabularyTrie& trie = *vocabulary_;
  for (uint32_t c = trie.child_begin_[node]; c < trie.child_begin_[node + 1]; ++c) {
    const int32_t next = states.Next(state, trie.child_byte_[c]);
    if (next == WalkStates::kDead) continue;
    const int32_t child = trie.child_node_[c];
    for (uint32_t t = trie.token_begin_[child]; t < trie.token_begin_[child + 1]; ++t) {
      if (trie.token_ids_[t] < vocab_size_) Allow(trie.token_ids_[t], words);
    }
    if (trie.child_begin_[child] < trie.child_begin_[child + 1]) Walk(child, next, states, words);
  }
}

std::shared_ptr<const runtime::TokenMask> TokenGrammar::CachedMask(const GrammarMatcher& matcher) const {
  const std::string key = matcher.StateKey();
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(key);
  return it == cache_.end() ? nullptr : it->second;
}

void TokenGrammar::WalkPosition(int32_t node, int32_t state, bool uncertain_below, const ByteSet& follow,
                                WalkStates& states, PositionTokens* out) const {
  const VocabularyTrie& trie = *vocabulary_;
  // A parse that has finished the position's rule here may go on below it with a byte of FOLLOW.
  const bool may_leave = !uncertain_below && states.left_floor(state);
  for (uint32_t c = trie.child_begin_[node]; c < trie.child_begin_[node + 1]; ++c) {
    const int32_t child = trie.child_node_[c];
    if (may_leave && follow.test(trie.child_byte_[c])) {
      // Every token of the child's subtree goes to the whole state (those also accepted here are
      // left out when the mask is made).
      for (uint32_t t = trie.token_begin_[child]; t < trie.token_begin_[trie.subtree_end_[child]]; ++t) {
        if (trie.token_ids_[t] < vocab_size_) out->uncertain.push_back(trie.token_ids_[t]);
      }
      const int32_t next = states.Next(state, trie.child_byte_[c]);
      if (next == WalkStates::kDead) continue;
      for (uint32_t t = trie.token_begin_[child]; t < trie.token_begin_[child + 1]; ++t) {
        if (trie.token_ids_[t] < vocab_size_) Allow(trie.token_ids_[t], &out->accepted);
      }
      if (trie.child_begin_[child] < trie.child_begin_[child + 1]) {
        WalkPosition(child, next, /*uncertain_below=*/true, follow, states, out);
      }
      continue;
    }
    const int32_t next = states.Next(state, trie.child_byte_[c]);
    if (next == WalkStates::kDead) continue;
    for (uint32_t t = trie.token_begin_[child]; t < trie.token_begin_[child + 1]; ++t) {
      if (trie.token_ids_[t] < vocab_size_) Allow(trie.token_ids_[t], &out->accepted);
    }
    if (trie.child_begin_[child] < trie.child_begin_[child + 1]) {
      WalkPosition(child, next, uncertain_below, follow, states, out);
    }
  }
}

std::shared_ptr<const TokenGrammar::PositionTokens> TokenGrammar::ComputeTokensAt(
    const std::vector<int32_t>& top) const {
  auto tokens = std::make_shared<PositionTokens>();
  tokens->accepted.assign((static_cast<size_t>(vocab_size_) + 31) / 32, 0);
  WalkStates states(GrammarMatcher::AtStackTop(grammar_, top));
  WalkPosition(0, 0, /*uncertain_below=*/false, grammar_->FollowOfRuleAt(top.front()), states, tokens.get());
  tokens->max_depth = states.max_depth();
  ++tops_computed_;
  if (!tokens->uncertain.empty()) ++tops_uncertain_;
  return tokens;
}

std::shared_ptr<const TokenGrammar::PositionTokens> TokenGrammar::TokensAt(const std::vector<int32_t>& top) const {
  {
    absl::MutexLock lock(&mu_);
    if (auto it = tops_.find(top); it != tops_.end()) return it->second;
  }
  auto tokens = ComputeTokensAt(top);
  absl::MutexLock lock(&mu_);
  if (tops_.size() >= kMaxCachedTops) tops_.clear();
  return tops_.emplace(top, std::move(tokens)).first->second;
}

std::shared_ptr<const runtime::TokenMask> TokenGrammar::ComputeMask(const GrammarMatcher& matcher) const {
  std::vector<uint32_t> words((static_cast<size_t>(vocab_size_) + 31) / 32, 0);
  std::vector<std::shared_ptr<const PositionTokens>> tops;
  size_t above = 0;
  for (const std::vector<int32_t>& top : matcher.StackTops(top_entries_)) {
    tops.push_back(TokensAt(top));
    above = std::max(above, tops.back()->max_depth);
  }
  WalkStates states(matcher);
  if (matcher.max_depth() + above > GrammarMatcher::kMaxStackDepth) {
    // Deep enough that the matcher's depth limit may drop a parse: the whole walk.
    Walk(0, 0, states, &words);
  } else {
    // What the tops accept whatever is below them, then the few tokens that go below, each
    // against the whole state.
    for (const auto& top : tops) {
      for (size_t i = 0; i < words.size(); ++i) words[i] |= top->accepted[i];
    }
    for (const auto& top : tops) {
      for (const int32_t id : top->uncertain) {
        if ((words[id / 32] >> (id % 32)) & 1u) continue;
        int32_t state = 0;
        for (const char c : vocabulary_->bytes(id)) {
          state = states.Next(state, static_cast<uint8_t>(c));
          if (state == WalkStates::kDead) break;
        }
        if (state != WalkStates::kDead) Allow(id, &words);
      }
    }
  }
  AllowEos(matcher, &words);
  return std::make_shared<const runtime::TokenMask>(std::move(words));
}

std::shared_ptr<const runtime::TokenMask> TokenGrammar::Mask(const GrammarMatcher& matcher) const {
  if (auto cached = CachedMask(matcher)) return cached;
  const auto start = std::chrono::steady_clock::now();
  auto mask = ComputeMask(matcher);
  mask_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  ++computed_;
  absl::MutexLock lock(&mu_);
  if (cache_.size() >= kMaxCachedMasks) cache_.clear();
  cache_.emplace(matcher.StateKey(), mask);
  return mask;
}

std::shared_ptr<const runtime::TokenMask> TokenGrammar::MaskByEveryToken(const GrammarMatcher& matcher) const {
  std::vector<uint32_t> words((static_cast<size_t>(vocab_size_) + 31) / 32, 0);
  for (int32_t id = 0; id < std::min(vocab_size_, vocabulary_->size()); ++id) {
    const std::string& bytes = vocabulary_->bytes(id);
    GrammarMatcher copy = matcher;
    if (!bytes.empty() && copy.AdvanceBytes(bytes)) Allow(id, &words);
  }
  AllowEos(matcher, &words);
  return std::make_shared<const runtime::TokenMask>(std::move(words));
}

bool TokenGrammar::Accept(GrammarMatcher* matcher, int32_t token) const {
  if (token < 0 || token >= vocabulary_->size()) return false;
  const std::string& bytes = vocabulary_->bytes(token);
  return !bytes.empty() && matcher->AdvanceBytes(bytes);
}

StructuredOutputs::StructuredOutputs(std::shared_ptr<const VocabularyTrie> vocabulary, int vocab_size,
                                     std::vector<int> eos_token_ids)
    : vocabulary_(std::move(vocabulary)), vocab_size_(vocab_size), eos_token_ids_(std::move(eos_token_ids)) {}

absl::StatusOr<std::shared_ptr<const TokenGrammar>> StructuredOutputs::Cached(
    const std::string& key, const std::function<absl::StatusOr<std::shared_ptr<const Grammar>>()>& compile) {
  {
    absl::MutexLock lock(&mu_);
    if (auto it = grammars_.find(key); it != grammars_.end()) return it->second;
  }
  absl::StatusOr<std::shared_ptr<const Grammar>> grammar = compile();
  if (!grammar.ok()) return grammar.status();
  auto token_grammar = std::make_shared<const TokenGrammar>(*std::move(grammar), vocabulary_, vocab_size_, eos_token_ids_);
  absl::MutexLock lock(&mu_);
  if (grammars_.size() >= kMaxGrammars) grammars_.clear();
  grammars_.emplace(key, token_grammar);
  return token_grammar;
}

absl::StatusOr<std::shared_ptr<const TokenGrammar>> StructuredOutputs::ForJsonSchema(const nlohmann::json& schema,
                                                                                    const std::string& field) {
  return Cached("schema:" + field + ":" + schema.dump(), [&] { return CompileJsonSchema(schema, field); });
}

absl::StatusOr<std::shared_ptr<const TokenGrammar>> StructuredOutputs::ForJsonObject() {
  return Cached("json_object", [] { return JsonObjectGrammar(); });
}

absl::StatusOr<std::shared_ptr<const TokenGrammar>> StructuredOutputs::ForToolCalls(const nlohmann::json& tools) {
  return Cached("tools:" + tools.dump(), [&] { return ToolCallsGrammar(tools); });
}

absl::StatusOr<std::shared_ptr<const TokenGrammar>> StructuredOutputs::ForResponseFormat(const nlohmann::json& format) {
  return GrammarForResponseFormat(format, this);
}

absl::StatusOr<std::shared_ptr<const TokenGrammar>> GrammarForResponseFormat(const nlohmann::json& format,
                                                                             StructuredOutputs* structured) {
  const std::string type = format.is_object() && format.contains("type") && format["type"].is_string()
                               ? format["type"].get<std::string>()
                               : "";
  if (type == "text") return nullptr;
  if (type != "json_object" && type != "json_schema") {
    return absl::InvalidArgumentError(
        "response_format: expected {\"type\": \"text\"}, \"json_object\" or \"json_schema\"");
  }
  if (structured == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("response_format: ", type, " needs the model's tokenizer (tokenizer.json), which it has not"));
  }
  if (type == "json_object") return structured->ForJsonObject();
  const auto spec = format.find("json_schema");
  if (spec == format.end() || !spec->is_object()) {
    return absl::InvalidArgumentError("response_format.json_schema: expected an object with a schema");
  }
  const auto schema = spec->find("schema");
  if (schema == spec->end() || schema->is_null()) {
    return absl::InvalidArgumentError("response_format.json_schema.schema: required");
  }
  if (const auto strict = spec->find("strict"); strict != spec->end() && !strict->is_null() && !strict->is_boolean()) {
    return absl::InvalidArgumentError("response_format.json_schema.strict: expected true or false");
  }
  // strict or not, the schema is enforced: what cannot be is refused.
  return structured->ForJsonSchema(*schema, "response_format.json_schema.schema");
}

}  // namespace moe::scheduler

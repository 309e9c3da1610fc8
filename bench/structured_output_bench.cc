// The grammar mask of structured outputs on a vocabulary of a real model's size (151,936 ids, as
// Qwen3's), for a state seen for the first time: what a step waits for when the forward pass is
// shorter than the mask. No real tokenizer of that size ships with the tree, so the vocabulary is
// synthetic and byte-level, shaped like a BPE one: the 256 bytes, words with and without a leading
// space, capitalised, punctuation and JSON pieces (`{"`, `":"`, `",`), digit runs, whitespace runs
// and CJK characters. Each state is timed on a fresh TokenGrammar (an empty mask cache).
//
// The bound: a mask is at least one pass over the vocabulary's bits (151,936 / 8 bytes), far below
// a microsecond; what is above it is the walk of the tokens the state may allow (inside a JSON
// string, almost all of them), which BM_TrieBytes prints: one pass over every token's bytes.
#include <benchmark/benchmark.h>

#include <random>
#include <set>
#include <string>
#include <vector>

#include "moe/scheduler/json_schema.h"
#include "moe/scheduler/structured_output.h"

namespace moe::scheduler {
namespace {

constexpr int kVocab = 151936;
constexpr int kSpecial = 293;  // Qwen's: ids past the last BPE token

std::string Utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xc0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    s += static_cast<char>(0xe0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return s;
}

// The synthetic vocabulary: token id -> bytes, "" for the special tokens at the end.
std::vector<std::string> SyntheticVocabulary() {
  std::mt19937 rng(151936);
  std::set<std::string> seen;
  std::vector<std::string> tokens;
  auto add = [&](std::string t) {
    if (!t.empty() && static_cast<int>(tokens.size()) < kVocab - kSpecial && seen.insert(t).second) {
      tokens.push_back(std::move(t));
    }
  };
  for (int b = 0; b < 256; ++b) add(std::string(1, static_cast<char>(b)));
  const std::string onsets[] = {"b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v",
                                "w", "z", "st", "tr", "pr", "ch", "sh", "th", "str", "bl", "cl", "gr", ""};
  const std::string vowels[] = {"a", "e", "i", "o", "u", "y", "ai", "ea", "ou", "io", "ee"};
  const std::string codas[] = {"", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "x", "rt", "ed", "er"};
  auto word = [&] {
    std::string w;
    const int syllables = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < syllables; ++i) {
      w += onsets[rng() % std::size(onsets)];
      w += vowels[rng() % std::size(vowels)];
      w += codas[rng() % std::size(codas)];
    }
    return w;
  };
  const std::string punct = "{}[]():;,.\"'=<>/\\-_+*&%$#@!?|`~^";
  for (int i = 0; i < 16000; ++i) {  // punctuation and JSON pieces, some with a word
    std::string t;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n; ++k) t += punct[rng() % punct.size()];
    if (rng() % 3 == 0) t = rng() % 2 ? t + word() : word() + t;
    add(t);
  }
  for (const char* t : {"{\"", "\":\"", "\",", "\",\"", "\"}", "\":", "},{\"", "\"]", "[\"", "\":{\"", "\":[",
                        "null", "true", "false", "\\n", "\\\"", "\\u"}) {
    add(t);
  }
  for (int i = 0; i < 1000; ++i) add(std::to_string(i));
  for (int n = 1; n <= 64; ++n) {
    add(std::string(n, ' '));
    add(std::string(1 + n % 4, '\n') + std::string(n - 1, ' '));
    add(std::string(1 + n % 8, '\t'));
  }
  for (int i = 0; i < 24000; ++i) {  // CJK, one to three characters
    std::string t;
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < n; ++k) t += Utf8(0x4e00 + rng() % 0x5200);
    add(t);
  }
  while (static_cast<int>(tokens.size()) < kVocab - kSpecial) {  // words: " word", "word", " Word", "Word"
    std::string w = word();
    const uint32_t shape = rng() % 4;
    if (shape >= 2) w[0] = static_cast<char>(w[0] - 'a' + 'A');
    add(shape % 2 == 0 ? " " + w : w);
  }
  tokens.resize(kVocab);  // the special tokens: no bytes
  return tokens;
}

const std::shared_ptr<const VocabularyTrie>& Trie() {
  static const auto* kTrie = new std::shared_ptr<const VocabularyTrie>(
      std::make_shared<const VocabularyTrie>(SyntheticVocabulary()));
  return *kTrie;
}

const std::shared_ptr<const Grammar>& SchemaGrammar() {
  static const auto* kGrammar = new std::shared_ptr<const Grammar>([] {
    const nlohmann::json schema = nlohmann::json::parse(R"({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array",
        "items": {"type": "string", "maxLength": 12}}, "city": {"enum": ["Oslo", "Lima", "Pune"]},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "required": ["name", "age"]})");
    return *CompileJsonSchema(schema, "schema");
  }());
  return *kGrammar;
}

// The states: after these bytes of an output of SchemaGrammar() (properties come in the order
// nlohmann::json keeps them, by name).
const char* const kStates[] = {
    "",                                               // the start: `{` only
    "{\"age\":42,\"name\":\"Ada Lov",                  // inside a free string: almost every token
    "{\"age\":4",                                     // inside an integer
    "{\"age\":42,\"name\":\"Ada\"",                   // after a value: `,` or `}`
    "{\"age\":42,\"name\":\"Ada\",\"tags\":[\"ab",     // inside a string of at most 12 characters
    "{\"age\":42,\"",                                  // a key: city or name
};
const char* const kStateNames[] = {"start", "free_string", "integer", "after_value", "bounded_string", "key"};

void BM_MaskNewState(benchmark::State& state) {
  const std::shared_ptr<const VocabularyTrie>& trie = Trie();
  GrammarMatcher matcher(SchemaGrammar());
  if (!matcher.AdvanceBytes(kStates[state.range(0)])) {
    state.SkipWithError("the state's bytes do not follow the grammar");
    return;
  }
  int allowed = 0;
  for (auto _ : state) {
    TokenGrammar grammar(SchemaGrammar(), trie, kVocab, {kVocab - 1});
    auto mask = grammar.Mask(matcher);
    allowed = mask->Count(kVocab);
    benchmark::DoNotOptimize(mask);
  }
  state.SetLabel(kStateNames[state.range(0)]);
  state.counters["allowed_tokens"] = allowed;
}
BENCHMARK(BM_MaskNewState)->DenseRange(0, std::size(kStates) - 1)->Unit(benchmark::kMillisecond);

// A new state whose stack tops were met before (by this state here; as well by any other whose
// stacks end the same, e.g. the same string in another object): the tokens the tops take whatever
// is below them are known, and only the few that go below are tried against the whole state.
void BM_MaskNewStateKnownTops(benchmark::State& state) {
  TokenGrammar grammar(SchemaGrammar(), Trie(), kVocab, {kVocab - 1});
  GrammarMatcher matcher(SchemaGrammar());
  if (!matcher.AdvanceBytes(kStates[state.range(0)])) {
    state.SkipWithError("the state's bytes do not follow the grammar");
    return;
  }
  grammar.Mask(matcher);
  int allowed = 0;
  for (auto _ : state) {
    auto mask = grammar.MaskUncached(matcher);
    allowed = mask->Count(kVocab);
    benchmark::DoNotOptimize(mask);
  }
  state.SetLabel(kStateNames[state.range(0)]);
  state.counters["allowed_tokens"] = allowed;
  state.counters["tops"] = static_cast<double>(grammar.tops_computed());
}
BENCHMARK(BM_MaskNewStateKnownTops)->DenseRange(0, std::size(kStates) - 1)->Unit(benchmark::kMillisecond);

// A state seen before: the cache's lookup.
void BM_MaskCachedState(benchmark::State& state) {
  TokenGrammar grammar(SchemaGrammar(), Trie(), kVocab, {kVocab - 1});
  GrammarMatcher matcher(SchemaGrammar());
  matcher.AdvanceBytes(kStates[1]);
  grammar.Mask(matcher);
  for (auto _ : state) benchmark::DoNotOptimize(grammar.Mask(matcher));
}
BENCHMARK(BM_MaskCachedState)->Unit(benchmark::kMicrosecond);

// The bound of a walk that allows almost everything: one pass over every token's bytes.
void BM_TrieBytes(benchmark::State& state) {
  const std::shared_ptr<const VocabularyTrie>& trie = Trie();
  for (auto _ : state) {
    uint64_t sum = 0;
    for (int id = 0; id < trie->size(); ++id) {
      for (char c : trie->bytes(id)) sum += static_cast<uint8_t>(c);
    }
    benchmark::DoNotOptimize(sum);
  }
}
BENCHMARK(BM_TrieBytes)->Unit(benchmark::kMillisecond);

void BM_BuildTrie(benchmark::State& state) {
  const std::vector<std::string> vocabulary = SyntheticVocabulary();
  for (auto _ : state) benchmark::DoNotOptimize(std::make_shared<const VocabularyTrie>(vocabulary));
}
BENCHMARK(BM_BuildTrie)->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace
}  // namespace moe::scheduler

BENCHMARK_MAIN();

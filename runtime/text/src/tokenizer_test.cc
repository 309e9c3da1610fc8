#include "moe/text/tokenizer.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "components.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::text {
namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TestdataDir() {
  const char* env = std::getenv("MOE_TESTDATA_DIR");
  return env != nullptr && *env != '\0' ? env : MOE_TESTDATA_DIR;
}

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);
}

std::unique_ptr<Tokenizer> Load(const json& config) {
  auto tokenizer = Tokenizer::FromJson(config.dump(), "test tokenizer.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? *std::move(tokenizer) : nullptr;
}

TEST(TokenizerTest, MatchesTheTransformersGoldens) {
  const std::string dir = TestdataDir() + "/tokenizer";
  auto tokenizer = Tokenizer::FromFile(dir + "/tokenizer.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const json golden = ReadJson(dir + "/golden_tokenize.json");
  ASSERT_FALSE(golden["cases"].empty());
  for (const json& c : golden["cases"]) {
    const std::string text = c["text"];
    const std::vector<int32_t> want = c["ids"];
    const std::vector<int32_t> ids = (*tokenizer)->Encode(text);
    EXPECT_EQ(ids, want) << text;
    // The goldens decode with the special tokens kept.
    EXPECT_EQ((*tokenizer)->Decode(want, /*skip_special_tokens=*/false), c["decoded"].get<std::string>()) << text;
  }
}

// A BPE model whose vocabulary is `tokens` (id = position) with `merges` as ["a", "b"] pairs.
json Bpe(const std::vector<std::string>& tokens, const std::vector<std::pair<std::string, std::string>>& merges) {
  json vocab = json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = i;
  json pairs = json::array();
  for (const auto& [a, b] : merges) pairs.push_back({a, b});
  return {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"vocab", vocab}, {"merges", pairs}};
}

// The SentencePiece layout of Llama and Mixtral: <unk> <s> </s>, the 256 byte tokens, then
// pieces with U+2581 for a space.
std::vector<std::string> SentencePieceVocab() {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    tokens.push_back(name);
  }
  // 259 .. 272
  for (const char* t :
       {"\u2581", "h", "e", "l", "o", "\u2581h", "ll", "\u2581he", "llo", "\u2581hello", "w", "r", "d", "\u2581w"}) {
    tokens.push_back(json::parse(absl::StrCat("\"", t, "\"")).get<std::string>());
  }
  return tokens;
}

json SentencePieceTokenizer(const json& decoder) {
  const std::string space = "\u2581";
  json model = Bpe(SentencePieceVocab(),
                   {{space, "h"}, {"l", "l"}, {space + "h", "e"}, {"ll", "o"}, {space + "he", "llo"}, {space, "w"}});
  model["byte_fallback"] = true;
  model["unk_token"] = "<unk>";
  model["fuse_unk"] = true;
  json added = json::array();
  for (int id = 0; id < 3; ++id) {
    added.push_back({{"id", id},
                     {"content", std::vector<std::string>{"<unk>", "<s>", "</s>"}[id]},
                     {"special", true},
                     {"normalized", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"single_word", false}});
  }
  return {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", space}, {"prepend_scheme", "first"}, {"split", false}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair", nullptr},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder", decoder},
      {"model", model}};
}

json MetaspaceDecoderSequence() {
  return {{"type", "Sequence"},
          {"decoders",
           {{{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", false}},
            {{"type", "ByteFallback"}},
            {{"type", "Fuse"}},
            {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
}

// Mixtral's older decoder: Replace instead of Metaspace.
json ReplaceDecoderSequence() {
  return {{"type", "Sequence"},
          {"decoders",
           {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
            {{"type", "ByteFallback"}},
            {{"type", "Fuse"}},
            {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
}

TEST(TokenizerTest, SentencePieceStyleMetaspaceWithByteFallback) {
  for (const json& decoder : {MetaspaceDecoderSequence(), ReplaceDecoderSequence()}) {
    auto tokenizer = Load(SentencePieceTokenizer(decoder));
    ASSERT_NE(tokenizer, nullptr);
    // "hello world" -> "\u2581hello\u2581world" (prepended: the text starts here), one word
    // since split is false; merges give \u2581hello \u2581w and the rest stays characters.
    EXPECT_THAT(tokenizer->Encode("hello world"), ElementsAre(1, 268, 272, 263, 270, 262, 271));
    EXPECT_THAT(tokenizer->Encode("hello world", false), ElementsAre(268, 272, 263, 270, 262, 271));
    EXPECT_EQ(tokenizer->Decode({1, 268, 272, 263, 270, 262, 271}), "hello world");
    EXPECT_EQ(tokenizer->Decode({1, 268, 272, 263, 270, 262, 271}, false),
              "<s> hello world");  // the space of the first word stays after a special token, as in HF
    // 'i' and the emoji are not in the vocabulary: their bytes' <0xNN> tokens stand in.
    const std::vector<int32_t> ids = tokenizer->Encode("hi \xF0\x9F\x98\x80", false);
    EXPECT_THAT(ids, ElementsAre(264, 3 + 'i', 259, 3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80));
    EXPECT_EQ(tokenizer->Decode(ids), "hi \xF0\x9F\x98\x80");
    // Bytes that are not UTF-8 decode to one U+FFFD each, as HF's ByteFallback does.
    EXPECT_EQ(tokenizer->Decode({3 + 0xF0, 3 + 'A'}), "\xEF\xBF\xBD\xEF\xBF\xBD");
    EXPECT_EQ(tokenizer->Decode({3 + 0xC3, 3 + 0xA9, 260}), "\xC3\xA9h");
    // prepend_scheme first: text after an added token is not at the start, so no U+2581.
    EXPECT_THAT(tokenizer->Encode("<s>hello", false), ElementsAre(1, 260, 261, 267));
    // Ids outside the vocabulary are skipped.
    EXPECT_EQ(tokenizer->Decode({268, 99999, -1}), "hello");
  }
  auto tokenizer = Load(SentencePieceTokenizer(MetaspaceDecoderSequence()));
  EXPECT_EQ(tokenizer->vocab_size(), 273);
  EXPECT_EQ(tokenizer->TokenToId("<s>"), 1);
  EXPECT_EQ(tokenizer->TokenToId("\xE2\x96\x81hello"), 268);
  EXPECT_EQ(tokenizer->TokenToId("nope"), std::nullopt);
  EXPECT_EQ(tokenizer->IdToToken(264), "\xE2\x96\x81h");
  EXPECT_EQ(tokenizer->IdToToken(5000), "");
  EXPECT_TRUE(tokenizer->IsSpecial(1));
  EXPECT_FALSE(tokenizer->IsSpecial(268));
}

TEST(TokenizerTest, MetaspacePrependSchemeAlwaysAndNever) {
  json config = SentencePieceTokenizer(MetaspaceDecoderSequence());
  config["pre_tokenizer"]["prepend_scheme"] = "always";
  auto always = Load(config);
  EXPECT_THAT(always->Encode("<s>hello", false), ElementsAre(1, 268));
  config["pre_tokenizer"]["prepend_scheme"] = "never";
  auto never = Load(config);
  EXPECT_THAT(never->Encode("hello", false), ElementsAre(260, 261, 267));
}

// An unk token, fused runs of unknown characters, and WordPiece-style "##" continuations.
TEST(TokenizerTest, BpeUnknownsAndContinuingSubwordPrefix) {
  json model = Bpe({"<unk>", "a", "##b", "ab", "##c"}, {{"a", "##b"}});
  model["unk_token"] = "<unk>";
  model["continuing_subword_prefix"] = "##";
  json config = {{"model", model}, {"pre_tokenizer", {{"type", "WhitespaceSplit"}}}};
  auto plain = Load(config);
  EXPECT_THAT(plain->Encode("abc axxb"), ElementsAre(3, 4, 1, 0, 0, 2));
  config["model"]["fuse_unk"] = true;
  auto fused = Load(config);
  EXPECT_THAT(fused->Encode("abc axxb"), ElementsAre(3, 4, 1, 0, 2));
  // "a b" string merges mean the same as pairs.
  config["model"]["merges"] = {"a ##b"};
  EXPECT_THAT(Load(config)->Encode("abc"), ElementsAre(3, 4));
  // ignore_merges: a word that is itself in the vocabulary is taken whole.
  json whole = Bpe({"a", "b", "c", "bc", "abc"}, {{"b", "c"}});
  json tk = {{"model", whole}};
  EXPECT_THAT(Load(tk)->Encode("abc"), ElementsAre(0, 3));
  tk["model"]["ignore_merges"] = true;
  EXPECT_THAT(Load(tk)->Encode("abc"), ElementsAre(4));
}

// One id per printable ASCII character (id = the byte), so ids spell the text back.
json AsciiModel() {
  std::vector<std::string> tokens(127);
  for (int c = 0; c < 127; ++c)
    tokens[c] = c >= 0x20 ? std::string(1, static_cast<char>(c)) : "<ctrl" + std::to_string(c) + ">";
  return Bpe(tokens, {});
}

TEST(TokenizerTest, AddedTokensMatchBeforeTheModelWithStripAndSingleWord) {
  auto token = [](int id, const char* content, bool special, bool normalized) {
    return json{{"id", id},        {"content", content}, {"special", special},  {"normalized", normalized},
                {"lstrip", false}, {"rstrip", false},    {"single_word", false}};
  };
  json added = json::array();
  added.push_back(token(500, "<mask>", true, false));
  added.back()["lstrip"] = true;
  added.push_back(token(501, "[X]", false, false));
  added.back()["single_word"] = true;
  added.push_back(token(502, "hi", false, true));
  added.push_back(token(503, "<m", false, false));
  added.push_back(token(504, "<end>", true, false));
  added.back()["rstrip"] = true;
  auto tokenizer = Load({{"model", AsciiModel()}, {"added_tokens", added}, {"normalizer", {{"type", "Lowercase"}}}});
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_THAT(tokenizer->Encode("a <mask>b"), ElementsAre('a', 500, 'b'));        // lstrip took the space
  EXPECT_THAT(tokenizer->Encode("<ma"), ElementsAre(503, 'a'));                   // longest match first
  EXPECT_THAT(tokenizer->Encode("a[X]b"), ElementsAre('a', '[', 'x', ']', 'b'));  // not a single word
  EXPECT_THAT(tokenizer->Encode("a [X] b"), ElementsAre('a', ' ', 501, ' ', 'b'));
  EXPECT_THAT(tokenizer->Encode("OH HI"), ElementsAre('o', 'h', ' ', 502));  // matched after lowercasing
  EXPECT_THAT(tokenizer->Encode("x<end>  y"), ElementsAre('x', 504, 'y'));   // rstrip took the spaces
  // No decoder: tokens joined with spaces; special ones dropped unless asked for.
  EXPECT_EQ(tokenizer->Decode({'a', 500, 'b'}), "a b");
  EXPECT_EQ(tokenizer->Decode({'a', 500, 'b'}, false), "a <mask> b");
  EXPECT_EQ(tokenizer->Decode({501}), "[X]");  // not special: kept
  EXPECT_TRUE(tokenizer->IsSpecial(500));
  EXPECT_FALSE(tokenizer->IsSpecial(501));
  EXPECT_EQ(tokenizer->vocab_size(), 505);
}

std::string Normalized(const json& config, const std::string& text) {
  auto normalizer = internal::BuildNormalizer(config);
  EXPECT_TRUE(normalizer.ok()) << normalizer.status();
  if (!normalizer.ok()) return "";
  std::string out = text;
  (*normalizer)->Normalize(&out);
  return out;
}

TEST(TokenizerTest, Normalizers) {
  EXPECT_EQ(Normalized({{"type", "NFC"}}, "e\xCC\x81"), "\xC3\xA9");
  // Only non-ASCII runs go through utf8proc; a combining mark still joins the ASCII letter before it.
  EXPECT_EQ(Normalized({{"type", "NFC"}}, "abe\xCC\x81 \xE6\xB7\xB7 A\xCC\x8A!"), "ab\xC3\xA9 \xE6\xB7\xB7 \xC3\x85!");
  EXPECT_EQ(Normalized({{"type", "NFC"}}, "\xE6\xB7\xB7\xEF\xA4\x80"), "\xE6\xB7\xB7\xE8\xB1\x88");  // U+F900
  EXPECT_EQ(Normalized({{"type", "NFD"}}, "\xC3\xA9"), "e\xCC\x81");
  EXPECT_EQ(Normalized({{"type", "NFKC"}}, "\xEF\xAC\x81 \xE2\x91\xA0"), "fi 1");  // U+FB01, U+2460
  EXPECT_EQ(Normalized({{"type", "NFKD"}}, "\xEF\xAC\x81\xC3\xA9"), "fie\xCC\x81");
  EXPECT_EQ(Normalized({{"type", "Lowercase"}}, "HeLLo \xC3\x80\xC3\x89"), "hello \xC3\xA0\xC3\xA9");
  EXPECT_EQ(Normalized({{"type", "Strip"}, {"strip_left", true}, {"strip_right", false}}, "  \t hi \n"), "hi \n");
  EXPECT_EQ(Normalized({{"type", "Strip"}, {"strip_left", false}, {"strip_right", true}}, "  \t hi \n"), "  \t hi");
  EXPECT_EQ(Normalized({{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}}, " \xE3\x80\x80hi \n"), "hi");
  EXPECT_EQ(Normalized({{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}}, "   "), "");
  EXPECT_EQ(Normalized({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "_"}}, "a b  c"), "a_b__c");
  EXPECT_EQ(Normalized({{"type", "Replace"}, {"pattern", {{"Regex", "\\s+"}}}, {"content", " "}}, "a \t\nb"), "a b");
  EXPECT_EQ(Normalized({{"type", "Prepend"}, {"prepend", "_"}}, "hi"), "_hi");
  EXPECT_EQ(Normalized({{"type", "Prepend"}, {"prepend", "_"}}, ""), "");
  EXPECT_EQ(Normalized({{"type", "Sequence"},
                        {"normalizers",
                         {{{"type", "Prepend"}, {"prepend", "_"}},
                          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "_"}}}}},
                       "hi there"),
            "_hi_there");
}

std::vector<std::string> PreTokenized(const json& config, const std::string& text, bool at_start = true) {
  auto pre_tokenizer = internal::BuildPreTokenizer(config);
  EXPECT_TRUE(pre_tokenizer.ok()) << pre_tokenizer.status();
  if (!pre_tokenizer.ok()) return {};
  std::vector<internal::Piece> pieces = {{text, at_start}};
  (*pre_tokenizer)->PreTokenize(&pieces);
  std::vector<std::string> out;
  for (const auto& p : pieces) out.push_back(p.text);
  return out;
}

json SplitOn(const char* behavior, bool invert = false) {
  return {{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", invert}};
}

TEST(TokenizerTest, SplitBehaviors) {
  const std::string text = "the-final--countdown";
  EXPECT_THAT(PreTokenized(SplitOn("Removed"), text), ElementsAre("the", "final", "countdown"));
  EXPECT_THAT(PreTokenized(SplitOn("Isolated"), text), ElementsAre("the", "-", "final", "-", "-", "countdown"));
  EXPECT_THAT(PreTokenized(SplitOn("MergedWithPrevious"), text), ElementsAre("the-", "final-", "-", "countdown"));
  EXPECT_THAT(PreTokenized(SplitOn("MergedWithNext"), text), ElementsAre("the", "-final", "-", "-countdown"));
  EXPECT_THAT(PreTokenized(SplitOn("Contiguous"), text), ElementsAre("the", "-", "final", "--", "countdown"));
  EXPECT_THAT(PreTokenized(SplitOn("Removed", true), text), ElementsAre("-", "-", "-"));
  const json regex = {
      {"type", "Split"}, {"pattern", {{"Regex", "\\p{N}+"}}}, {"behavior", "Isolated"}, {"invert", false}};
  EXPECT_THAT(PreTokenized(regex, "ab12cd345"), ElementsAre("ab", "12", "cd", "345"));
}

TEST(TokenizerTest, PreTokenizers) {
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  EXPECT_THAT(PreTokenized(byte_level, "Hello world!"), ElementsAre("\xC4\xA0Hello", "\xC4\xA0world", "!"));
  EXPECT_THAT(PreTokenized(byte_level, "  hi"), ElementsAre("\xC4\xA0", "\xC4\xA0hi"));  // \s+(?!\S)
  const json no_regex = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  EXPECT_THAT(PreTokenized(no_regex, "a b\n\xC3\xA9"), ElementsAre("a\xC4\xA0"
                                                                   "b\xC4\x8A\xC3\x83\xC2\xA9"));

  const std::string m = "\xE2\x96\x81";
  const json metaspace = {{"type", "Metaspace"}, {"replacement", m}, {"prepend_scheme", "always"}, {"split", true}};
  EXPECT_THAT(PreTokenized(metaspace, "Hey   friend!"), ElementsAre(m + "Hey", m, m, m + "friend!"));
  json first = metaspace;
  first["prepend_scheme"] = "first";
  EXPECT_THAT(PreTokenized(first, "hey you", /*at_start=*/false), ElementsAre("hey", m + "you"));
  EXPECT_THAT(PreTokenized(first, "hey you"), ElementsAre(m + "hey", m + "you"));
  json legacy = {{"type", "Metaspace"}, {"replacement", m}, {"add_prefix_space", false}};
  EXPECT_THAT(PreTokenized(legacy, "hey you"), ElementsAre("hey", m + "you"));

  EXPECT_THAT(PreTokenized({{"type", "Digits"}, {"individual_digits", true}}, "a123b45"),
              ElementsAre("a", "1", "2", "3", "b", "4", "5"));
  EXPECT_THAT(PreTokenized({{"type", "Digits"}, {"individual_digits", false}}, "a123b45"),
              ElementsAre("a", "123", "b", "45"));
  EXPECT_THAT(PreTokenized({{"type", "Punctuation"}, {"behavior", "Isolated"}}, "Hey, you!!"),
              ElementsAre("Hey", ",", " you", "!", "!"));
  EXPECT_THAT(PreTokenized({{"type", "Whitespace"}}, "Hey friend!  How's it?"),
              ElementsAre("Hey", "friend", "!", "How", "'", "s", "it", "?"));
  EXPECT_THAT(PreTokenized({{"type", "WhitespaceSplit"}}, "Hey friend!\tyo "), ElementsAre("Hey", "friend!", "yo"));
  EXPECT_THAT(PreTokenized({{"type", "BertPreTokenizer"}}, "Hey friend!"), ElementsAre("Hey", "friend", "!"));
  EXPECT_THAT(PreTokenized({{"type", "Sequence"},
                            {"pretokenizers",
                             {{{"type", "WhitespaceSplit"}}, {{"type", "Digits"}, {"individual_digits", true}}}}},
                           "ab12 c3"),
              ElementsAre("ab", "1", "2", "c", "3"));
}

TEST(TokenizerTest, UnsupportedAndMalformedFilesAreClearErrors) {
  json config = SentencePieceTokenizer(MetaspaceDecoderSequence());
  config["pre_tokenizer"] = {{"type", "Foo"}};
  auto r = Tokenizer::FromJson(config.dump(), "x/tokenizer.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("x/tokenizer.json: pre_tokenizer type 'Foo' is not supported"));

  config = SentencePieceTokenizer(MetaspaceDecoderSequence());
  config["decoder"]["decoders"][1] = {{"type", "CTC"}};
  r = Tokenizer::FromJson(config.dump(), "t.json");
  EXPECT_THAT(r.status().message(), HasSubstr("decoder type 'CTC' is not supported"));

  config = SentencePieceTokenizer(MetaspaceDecoderSequence());
  config["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", "AAAA"}};
  EXPECT_THAT(Tokenizer::FromJson(config.dump(), "t.json").status().message(),
              HasSubstr("normalizer type 'Precompiled' is not supported"));

  config = SentencePieceTokenizer(MetaspaceDecoderSequence());
  config["model"]["type"] = "Unigram";
  EXPECT_THAT(Tokenizer::FromJson(config.dump(), "t.json").status().message(),
              HasSubstr("model type 'Unigram' is not supported"));

  config = SentencePieceTokenizer(MetaspaceDecoderSequence());
  config["model"]["dropout"] = 0.1;
  EXPECT_THAT(Tokenizer::FromJson(config.dump(), "t.json").status().message(),
              HasSubstr("dropout 0.1 is not supported"));

  config = SentencePieceTokenizer(MetaspaceDecoderSequence());
  config["model"]["merges"].push_back({"h", "zzz"});
  EXPECT_THAT(Tokenizer::FromJson(config.dump(), "t.json").status().message(),
              HasSubstr("names 'zzz', which is not in the vocabulary"));

  r = Tokenizer::FromJson("{\n  \"model\": [1,\n}", "bad.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("bad.json:3:"));

  r = Tokenizer::FromModelDir("/nonexistent-model-dir");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("has no tokenizer.json"));
}

TEST(TokenizerTest, InvalidUtf8IsReplacedBeforeEncoding) {
  auto tokenizer = Tokenizer::FromFile(TestdataDir() + "/tokenizer/tokenizer.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)
                ->Encode("a\xFF\xC3"
                         "b"),
            (*tokenizer)
                ->Encode("a\xEF\xBF\xBD\xEF\xBF\xBD"
                         "b"));
  EXPECT_EQ((*tokenizer)->Encode("\xE6\xB7"), (*tokenizer)->Encode("\xEF\xBF\xBD"));  // one maximal subpart
}

TEST(TokenizerTest, FixtureModelsLoadAndRoundTrip) {
  for (const char* arch : {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"}) {
    auto tokenizer = Tokenizer::FromModelDir(TestdataDir() + "/fixtures/" + arch);
    ASSERT_TRUE(tokenizer.ok()) << arch << ": " << tokenizer.status();
    for (const std::string text : {"Hello world", "  two  spaces\n\ttab", "\xE6\xB7\xB7\xE5\x90\x88 MoE 2026",
                                   "<|im_start|>user\nhi<|im_end|>", "emoji \xF0\x9F\x9A\x80"}) {
      const std::vector<int32_t> ids = (*tokenizer)->Encode(text);
      EXPECT_FALSE(ids.empty()) << arch;
      for (int32_t id : ids) EXPECT_LT(id, (*tokenizer)->vocab_size());
      EXPECT_EQ((*tokenizer)->Decode(ids, /*skip_special_tokens=*/false), text) << arch;
    }
    EXPECT_EQ((*tokenizer)->Decode((*tokenizer)->Encode("<|im_start|>hi<|im_end|>")), "hi") << arch;
  }
}

// Prints the single-threaded encode speed on a few MB of mixed prose, code, numbers and CJK;
// never fails on time.
TEST(TokenizerTest, EncodeThroughput) {
  auto tokenizer = Tokenizer::FromFile(TestdataDir() + "/tokenizer/tokenizer.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::vector<std::string> words = {"the",
                                          "expert",
                                          "router",
                                          "picks",
                                          "two",
                                          "of",
                                          "sixty-four",
                                          "experts",
                                          "per",
                                          "token,",
                                          "and",
                                          "then",
                                          "def forward(self, x):\n",
                                          "    return x @ w.T\n",
                                          "2026-11-29",
                                          "3.14159",
                                          "\xE6\xB7\xB7\xE5\x90\x88",
                                          "\xE4\xB8\x93\xE5\xAE\xB6",
                                          "caf\xC3\xA9",
                                          "don't",
                                          "\n\n",
                                          "  ",
                                          "GPU",
                                          "KV-cache",
                                          "\xF0\x9F\x9A\x80"};
  std::string text;
  uint64_t state = 12345;
  std::vector<std::string> chunks;
  while (text.size() < (4u << 20)) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    text += words[(state >> 33) % words.size()];
    // Numbers make new words, so the cache does not see only repeats.
    if ((state >> 20) % 7 == 0) text += std::to_string((state >> 40) % 100000);
    text += ' ';
  }
  size_t tokens = 0;
  const auto start = std::chrono::steady_clock::now();
  // Prompt-sized pieces, as a server sees them.
  for (size_t at = 0; at < text.size(); at += 4096)
    tokens += (*tokenizer)->Encode(std::string_view(text).substr(at, 4096)).size();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("encode: %.2f MB in %.3f s = %.1f MB/s, %zu tokens\n", text.size() / 1e6, seconds,
              text.size() / 1e6 / seconds, tokens);
  EXPECT_GT(tokens, 0u);
}

}  // namespace
}  // namespace moe::text

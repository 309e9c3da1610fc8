// Structured outputs: JSON Schema compiled to a byte grammar, token masks from the vocabulary trie
// against a brute-force check of every token on the fixtures' tokenizers, and sampled generations
// of a real model (temperature 1) that must parse and validate against their schemas.
#include <map>
#include <random>
#include <regex>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/runtime/model_executor.h"
#include "moe/scheduler/json_schema.h"
#include "moe/scheduler/scheduler.h"
#include "moe/scheduler/structured_output.h"
#include "moe/text/tokenizer.h"

namespace moe::scheduler {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

std::string FixtureDir(const std::string& arch) {
  const char* env = std::getenv("MOE_TESTDATA_DIR");
  return std::string(env != nullptr ? env : MOE_TESTDATA_DIR) + "/fixtures/" + arch;
}

bool Matches(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  GrammarMatcher m(g);
  return m.AdvanceBytes(text) && m.accepting();
}

// A validator of the same subset, written apart from the compiler, as the test's oracle.
size_t Utf8Length(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xc0) != 0x80;
  return n;
}

bool Valid(const json& v, const json& schema, const json& root) {
  if (schema.is_boolean()) return schema.get<bool>();
  if (schema.contains("$ref")) {
    const std::string ref = schema["$ref"];
    const std::string name = ref.substr(ref.rfind('/') + 1);
    const json& defs = root.contains("$defs") ? root["$defs"] : root["definitions"];
    return Valid(v, defs[name], root);
  }
  if (schema.contains("const") && v != schema["const"]) return false;
  if (schema.contains("enum")) {
    bool found = false;
    for (const json& e : schema["enum"]) found = found || e == v;
    if (!found) return false;
  }
  if (schema.contains("anyOf")) {
    bool any = false;
    for (const json& s : schema["anyOf"]) any = any || Valid(v, s, root);
    if (!any) return false;
  }
  if (schema.contains("type")) {
    const json types = schema["type"].is_array() ? schema["type"] : json::array({schema["type"]});
    bool ok = false;
    for (const json& t : types) {
      const std::string type = t;
      ok = ok || (type == "string" && v.is_string()) || (type == "integer" && v.is_number_integer()) ||
           (type == "number" && v.is_number()) || (type == "boolean" && v.is_boolean()) ||
           (type == "null" && v.is_null()) || (type == "array" && v.is_array()) || (type == "object" && v.is_object());
    }
    if (!ok) return false;
  }
  if (v.is_string()) {
    const std::string s = v;
    if (schema.contains("minLength") && Utf8Length(s) < schema["minLength"].get<size_t>()) return false;
    if (schema.contains("maxLength") && Utf8Length(s) > schema["maxLength"].get<size_t>()) return false;
    if (schema.contains("pattern") && !std::regex_search(s, std::regex(schema["pattern"].get<std::string>()))) {
      return false;
    }
  }
  if (v.is_array()) {
    if (schema.contains("minItems") && v.size() < schema["minItems"].get<size_t>()) return false;
    if (schema.contains("maxItems") && v.size() > schema["maxItems"].get<size_t>()) return false;
    if (schema.contains("items")) {
      for (const json& item : v) {
        if (!Valid(item, schema["items"], root)) return false;
      }
    }
  }
  if (v.is_object()) {
    if (schema.contains("required")) {
      for (const json& name : schema["required"]) {
        if (!v.contains(name.get<std::string>())) return false;
      }
    }
    for (const auto& [key, value] : v.items()) {
      if (schema.contains("properties") && schema["properties"].contains(key)) {
        if (!Valid(value, schema["properties"][key], root)) return false;
      } else if (schema.contains("additionalProperties")) {
        if (!Valid(value, schema["additionalProperties"], root)) return false;
      }
    }
  }
  return true;
}

// The schemas structured outputs are tested with: every keyword the compiler enforces.
const std::vector<json>& SchemaTable() {
  static const auto* kTable = new std::vector<json>{
      json::parse(R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                      "age": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["name", "age"],
                      "additionalProperties": false})"),
      json::parse(R"({"type": "array", "items": {"enum": ["red", "green", 3, null]}, "minItems": 1, "maxItems": 3})"),
      json::parse(R"({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}-\\d{2}$"},
                      "score": {"type": "number"}, "tag": {"const": "x\"y"}}, "required": ["id", "tag"]})"),
      json::parse(R"({"anyOf": [{"type": "string", "minLength": 2, "maxLength": 5}, {"type": "null"},
                      {"type": "array", "items": {"type": "integer"}, "maxItems": 2}]})"),
      json::parse(R"({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                      "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}},
                      "$ref": "#/$defs/node", "title": "list"})"),
      json::parse(R"({"type": "object", "properties": {"kind": {"type": ["string", "null"], "maxLength": 3},
                      "words": {"type": "array", "items": {"type": "string", "pattern": "(ab|c)+"}, "maxItems": 2}},
                      "required": ["kind", "words"]})"),
  };
  return *kTable;
}

TEST(JsonSchemaTest, CompiledSchemasAcceptValidJsonAndRejectTheRest) {
  auto g = CompileJsonSchema(SchemaTable()[0], "schema");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(Matches(*g, R"({"age":12,"name":"bo"})"));
  EXPECT_TRUE(Matches(*g, R"({"age":-3,"name":"","ok":true})"));
  EXPECT_FALSE(Matches(*g, R"({"name":"bo"})"));           // age is required
  EXPECT_FALSE(Matches(*g, R"({"age":1,"name":"toolongname"})"));
  EXPECT_FALSE(Matches(*g, R"({"age":1.5,"name":"a"})"));
  EXPECT_FALSE(Matches(*g, R"({"age":01,"name":"a"})"));
  auto p = CompileJsonSchema(SchemaTable()[2], "schema");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(Matches(*p, R"({"id":"0a9f-12","tag":"x\"y"})"));
  EXPECT_TRUE(Matches(*p, R"({"id":"0a9f-12","score":-1.5e+3,"tag":"x\"y"})"));
  EXPECT_FALSE(Matches(*p, R"({"id":"0a9g-12","tag":"x\"y"})"));
  auto list = CompileJsonSchema(SchemaTable()[4], "schema");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(Matches(*list, R"({"next":{"next":null,"v":2},"v":1})"));
  EXPECT_FALSE(Matches(*list, R"({"next":{"v":2},"v":1})"));
  auto any = JsonObjectGrammar();
  ASSERT_TRUE(any.ok());
  EXPECT_TRUE(Matches(*any, R"({"a":[1,{"b":null}],"c":"\u00e9\n"})"));
  EXPECT_TRUE(Matches(*any, "{\"k\":\"caf\xc3\xa9\"}"));
  EXPECT_FALSE(Matches(*any, "{\"k\":\"\xc3\"}"));  // a cut UTF-8 character
  EXPECT_FALSE(Matches(*any, "[1]"));
}

TEST(JsonSchemaTest, KeywordsThatCannotBeEnforcedAreRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {R"({"type": "integer", "minimum": 3})", "the keyword 'minimum'"},
      {R"({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}})",
       "schema at /properties/d: the keyword 'format'"},
      {R"({"oneOf": [{"type": "string"}, {"type": "integer"}]})", "the keyword 'oneOf'"},
      {R"({"not": {"type": "string"}})", "the keyword 'not'"},
      {R"({"type": "array", "uniqueItems": true})", "the keyword 'uniqueItems'"},
      {R"({"type": "object", "patternProperties": {"^a": {}}})", "the keyword 'patternProperties'"},
      {R"({"$ref": "https://example.com/schema.json"})", "the reference 'https://example.com/schema.json'"},
      {R"j({"type": "string", "pattern": "a(?=b)"})j", "lookarounds and named groups are not supported"},
      {R"({"type": "string", "pattern": "(a)\\1"})", "the escape \\1 is not supported"},
      {R"({"type": "string", "pattern": "a", "maxLength": 3})", "pattern together with minLength or maxLength"},
      {R"({"allOf": [{"type": "string"}, {"maxLength": 2}]})", "allOf of more than one schema"},
      {R"({"type": "object", "required": ["a"]})", "required properties that properties does not declare"},
  };
  for (const auto& [schema, message] : refused) {
    auto g = CompileJsonSchema(json::parse(schema), "schema");
    ASSERT_FALSE(g.ok()) << schema;
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(g.status().message(), HasSubstr(message)) << schema;
  }
}

std::shared_ptr<const VocabularyTrie> TrieOf(const text::Tokenizer& tokenizer) {
  std::vector<std::string> bytes(tokenizer.vocab_size());
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (!tokenizer.IsSpecial(id)) bytes[id] = tokenizer.TokenBytes(id);
  }
  return std::make_shared<const VocabularyTrie>(std::move(bytes));
}

class MaskTest : public ::testing::TestWithParam<std::string> {};

// Along random walks through each schema's outputs, the trie's mask is the brute-force one: a token
// is allowed exactly when all its bytes can follow.
TEST_P(MaskTest, TheTrieMaskIsEveryTokenThatCanFollow) {
  auto tokenizer = text::Tokenizer::FromModelDir(FixtureDir(GetParam()));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto trie = TrieOf(**tokenizer);
  const int vocab = (*tokenizer)->vocab_size();
  std::mt19937 rng(7);
  int checked = 0;
  for (size_t s = 0; s < SchemaTable().size(); ++s) {
    auto g = CompileJsonSchema(SchemaTable()[s], "schema");
    ASSERT_TRUE(g.ok()) << g.status();
    TokenGrammar grammar(*g, trie, vocab, {vocab - 1});
    for (int walk = 0; walk < 3; ++walk) {
      GrammarMatcher m = grammar.NewMatcher();
      for (int step = 0; step < 40 && m.can_continue(); ++step) {
        const auto mask = grammar.Mask(m);
        const auto brute = grammar.MaskByEveryToken(m);
        ASSERT_EQ(mask->words(), brute->words()) << "schema " << s << " step " << step;
        ++checked;
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < vocab; ++id) {
          if (mask->allows(id) && !grammar.IsEos(id)) allowed.push_back(id);
        }
        if (allowed.empty()) break;
        ASSERT_TRUE(grammar.Accept(&m, allowed[rng() % allowed.size()]));
      }
    }
  }
  EXPECT_GT(checked, 50);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MaskTest, ::testing::Values("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// A vocabulary made to cross the grammar's rules inside one token (`"},{"`, `a",`, `1]}`, ...):
// the masks made from the stack tops' tokens, whatever lies below them, and the few tokens that go
// below, are the brute-force ones, in every context the walks meet (the tops' tokens computed in
// one context serve the next).
TEST(MaskTest, TokensAcrossRulesInAnyContextAreTheBruteForceOnes) {
  std::mt19937 rng(38);
  std::vector<std::string> vocabulary;
  std::set<std::string> seen;
  auto add = [&](const std::string& t) {
    if (!t.empty() && seen.insert(t).second) vocabulary.push_back(t);
  };
  for (int b = 1; b < 128; ++b) add(std::string(1, static_cast<char>(b)));
  for (const char* t : {"{\"", "\":\"", "\",", "\",\"", "\"}", "\":", "},{\"", "\"]", "[\"", "\":{\"", "\":[", "null",
                        "true", "false", "\\n", "\\\"", "\\u", "\"},\"", "]}", "}]", "\"}}", "1,", "0]", "2}"}) {
    add(t);
  }
  const std::string pool = "{}[]\",:0123456789abcdefnrstuxyz -.\\eE+";
  for (int i = 0; i < 4000; ++i) {
    std::string t;
    const int n = 2 + static_cast<int>(rng() % 6);
    for (int k = 0; k < n; ++k) t += pool[rng() % pool.size()];
    add(t);
  }
  const int vocab = static_cast<int>(vocabulary.size()) + 1;  // the last id: the end of sequence
  vocabulary.emplace_back();
  auto trie = std::make_shared<const VocabularyTrie>(vocabulary);
  std::vector<nlohmann::json> schemas = SchemaTable();
  schemas.push_back(nlohmann::json::parse(R"({"type": "object", "properties": {"a": {"type": "array", "items":
      {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "object", "properties":
      {"c": {"type": "string"}, "d": {"type": "integer"}, "e": {"type": "array", "items": {"type": "string"}}}}}},
      "required": ["b"]}}}, "required": ["a"]})"));
  schemas.push_back(nlohmann::json::parse(R"({"type": "object"})"));  // any JSON object, nested
  int checked = 0;
  int uncertain_tops = 0;
  for (size_t s = 0; s < schemas.size(); ++s) {
    auto g = CompileJsonSchema(schemas[s], "schema");
    ASSERT_TRUE(g.ok()) << g.status();
    // One entry of each stack's top (most tokens leave it), two, and the default.
    for (size_t entries : {size_t{1}, size_t{2}, TokenGrammar::kDefaultTopEntries}) {
      TokenGrammar grammar(*g, trie, vocab, {vocab - 1}, entries);
      for (int walk = 0; walk < 3; ++walk) {
      GrammarMatcher m = grammar.NewMatcher();
      for (int step = 0; step < 40 && m.can_continue(); ++step) {
        const auto mask = grammar.MaskUncached(m);
        const auto brute = grammar.MaskByEveryToken(m);
        ASSERT_EQ(mask->words(), brute->words()) << "schema " << s << " entries " << entries << " step " << step;
        ++checked;
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < vocab; ++id) {
          if (mask->allows(id) && !grammar.IsEos(id)) allowed.push_back(id);
        }
        if (allowed.empty()) break;
        // Long tokens first half the time: they cross the most rules.
        int32_t pick = allowed[rng() % allowed.size()];
        if (rng() % 2 == 0) {
          for (int k = 0; k < 8; ++k) {
            const int32_t other = allowed[rng() % allowed.size()];
            if (trie->bytes(other).size() > trie->bytes(pick).size()) pick = other;
          }
        }
        ASSERT_TRUE(grammar.Accept(&m, pick));
      }
      }
      uncertain_tops += grammar.tops_with_uncertain_tokens();
    }
  }
  EXPECT_GT(checked, 1000);
  EXPECT_GT(uncertain_tops, 50);  // the tokens that go below the top were tried, not only the rest
}

// What a request's tokens write.
std::string BytesOf(const VocabularyTrie& trie, const std::vector<int32_t>& tokens) {
  std::string out;
  for (int32_t t : tokens) out += t < trie.size() ? trie.bytes(t) : "";
  return out;
}

// Sampled generations (temperature 1, several seeds) of a real model under each schema of the
// table: every output is whole, parses and validates; with the constraint off, the same model
// writes no JSON at all.
TEST(StructuredGenerationTest, SampledOutputsParseAndValidate) {
  runtime::ModelOptions options;
  options.pool.progress = false;
  options.threads = 2;
  options.pool.threads = 2;
  auto model = runtime::Model::Load(FixtureDir("qwen3_moe"), options);
  ASSERT_TRUE(model.ok()) << model.status();
  auto tokenizer = text::Tokenizer::FromModelDir(FixtureDir("qwen3_moe"));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const int vocab = (*model)->spec().vocab_size;
  const std::shared_ptr<const VocabularyTrie> trie = TrieOf(**tokenizer);
  StructuredOutputs outputs(trie, vocab, {});
  auto executor = runtime::ModelExecutor::Create(**model, 256, 16);
  ASSERT_TRUE(executor.ok()) << executor.status();
  SchedulerConfig config;
  config.num_blocks = 256;
  config.block_size = 16;
  config.vocab_size = vocab;
  config.context = 1024;
  Scheduler scheduler(config);
  std::map<std::string, size_t> schema_of;
  for (size_t s = 0; s < SchemaTable().size(); ++s) {
    auto grammar = outputs.ForJsonSchema(SchemaTable()[s], "schema");
    ASSERT_TRUE(grammar.ok()) << grammar.status();
    for (int seed = 0; seed < 4; ++seed) {
      Request r;
      r.id = absl::StrCat("s", s, "-", seed);
      r.prompt = {1, 2, 3, 4, 5};
      r.sampling.temperature = 1.0f;
      r.sampling.seed = seed;
      r.stopping.max_new_tokens = 400;
      r.grammar = *grammar;
      ASSERT_TRUE(scheduler.Add(r).ok());
      schema_of[r.id] = s;
    }
  }
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, FinishReason> reasons;
  for (int step = 0; step < 5000 && !scheduler.idle(); ++step) {
    for (const Output& o : scheduler.Step(**executor)) {
      tokens[o.id].insert(tokens[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished) {
        reasons[o.id] = *o.finished;
        EXPECT_TRUE(o.error.ok()) << o.id << ": " << o.error;
      }
    }
  }
  ASSERT_TRUE(scheduler.idle());
  EXPECT_EQ(scheduler.stats().blocks_used, 0);
  for (const auto& [id, s] : schema_of) {
    const std::string text = BytesOf(*trie, tokens[id]);
    EXPECT_EQ(reasons[id], FinishReason::kEos) << id << ": " << text << " (" << tokens[id].size() << " tokens)";
    const json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(parsed.is_discarded()) << id << ": " << text;
    EXPECT_TRUE(Valid(parsed, SchemaTable()[s], SchemaTable()[s])) << id << ": " << text;
  }
}

}  // namespace
}  // namespace moe::scheduler

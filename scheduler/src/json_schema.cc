#include "moe/scheduler/json_schema.h"

#include <array>
#include <map>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"

namespace moe::scheduler {
namespace {

using json = nlohmann::json;
using Seq = GrammarBuilder::Seq;

// Longest run a bound may ask for (maxLength, maxItems, a regex's {n,m}): each count is a rule.
constexpr int kMaxRepeat = 4096;

ByteSet Range(int lo, int hi) {
  ByteSet s;
  for (int b = lo; b <= hi; ++b) s.set(b);
  return s;
}

absl::Status Unsupported(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what, " cannot be enforced while decoding"));
}

// The pieces of JSON every compiled schema shares, each made once per grammar.
class JsonPieces {
 public:
  explicit JsonPieces(GrammarBuilder& b) : b_(b) {}

  // One character of a JSON string's contents: unescaped ASCII, an escape, or a whole UTF-8
  // character (no overlong forms, no surrogates).
  int Char() {
    if (char_ >= 0) return char_;
    ByteSet plain = Range(0x20, 0x7f);
    plain.reset('"');
    plain.reset('\\');
    ByteSet hex = Range('0', '9') | Range('a', 'f') | Range('A', 'F');
    ByteSet simple;
    for (char c : std::string_view("\"\\/bfnrt")) simple.set(static_cast<uint8_t>(c));
    const auto cont = b_.Bytes(Range(0x80, 0xbf));
    std::vector<Seq> alts = {
        {b_.Bytes(plain)},
        {b_.Byte('\\'), b_.Bytes(simple)},
        {b_.Byte('\\'), b_.Byte('u'), b_.Bytes(hex), b_.Bytes(hex), b_.Bytes(hex), b_.Bytes(hex)},
        {b_.Bytes(Range(0xc2, 0xdf)), cont},
        {b_.Byte(0xe0), b_.Bytes(Range(0xa0, 0xbf)), cont},
        {b_.Bytes(Range(0xe1, 0xec)), cont, cont},
        {b_.Byte(0xed), b_.Bytes(Range(0x80, 0x9f)), cont},
        {b_.Bytes(Range(0xee, 0xef)), cont, cont},
        {b_.Byte(0xf0), b_.Bytes(Range(0x90, 0xbf)), cont, cont},
        {b_.Bytes(Range(0xf1, 0xf3)), cont, cont, cont},
        {b_.Byte(0xf4), b_.Bytes(Range(0x80, 0x8f)), cont, cont},
    };
    char_ = b_.Choice(alts);
    return char_;
  }
  // Any multi-byte UTF-8 character (for negated classes and '.').
  int NonAscii() {
    if (non_ascii_ >= 0) return non_ascii_;
    const auto cont = b_.Bytes(Range(0x80, 0xbf));
    non_ascii_ = b_.Choice({{b_.Bytes(Range(0xc2, 0xdf)), cont},
                            {b_.Byte(0xe0), b_.Bytes(Range(0xa0, 0xbf)), cont},
                            {b_.Bytes(Range(0xe1, 0xec)), cont, cont},
                            {b_.Byte(0xed), b_.Bytes(Range(0x80, 0x9f)), cont},
                            {b_.Bytes(Range(0xee, 0xef)), cont, cont},
                            {b_.Byte(0xf0), b_.Bytes(Range(0x90, 0xbf)), cont, cont},
                            {b_.Bytes(Range(0xf1, 0xf3)), cont, cont, cont},
                            {b_.Byte(0xf4), b_.Bytes(Range(0x80, 0x8f)), cont, cont}});
    return non_ascii_;
  }
  int String(int min_chars, int max_chars) {
    const int body = b_.Repeat({b_.RuleItem(Char())}, min_chars, max_chars);
    return b_.Choice({{b_.Byte('"'), b_.RuleItem(body), b_.Byte('"')}});
  }
  int AnyString() {
    if (string_ < 0) string_ = String(0, -1);
    return string_;
  }
  int Integer() {
    if (integer_ >= 0) return integer_;
    const int sign = b_.Optional({b_.Byte('-')});
    const int digits = b_.Repeat({b_.Bytes(Range('0', '9'))}, 0, 15);
    const int magnitude = b_.Choice({{b_.Byte('0')}, {b_.Bytes(Range('1', '9')), b_.RuleItem(digits)}});
    integer_ = b_.Choice({{b_.RuleItem(sign), b_.RuleItem(magnitude)}});
    return integer_;
  }
  int Number() {
    if (number_ >= 0) return number_;
    const int frac = b_.Optional({b_.Byte('.'), b_.RuleItem(b_.Repeat({b_.Bytes(Range('0', '9'))}, 1, 16))});
    ByteSet e, sign;
    e.set('e');
    e.set('E');
    sign.set('+');
    sign.set('-');
    const int exp = b_.Optional({b_.Bytes(e), b_.RuleItem(b_.Optional({b_.Bytes(sign)})),
                                 b_.RuleItem(b_.Repeat({b_.Bytes(Range('0', '9'))}, 1, 2))});
    number_ = b_.Choice({{b_.RuleItem(Integer()), b_.RuleItem(frac), b_.RuleItem(exp)}});
    return number_;
  }
  // Any JSON value, and any object.
  int Value() {
    if (value_ >= 0) return value_;
    value_ = b_.NewRule();
    object_ = b_.NewRule();
    const int array = b_.NewRule();
    const int member = b_.Choice({{b_.RuleItem(AnyString()), b_.Byte(':'), b_.RuleItem(value_)}});
    const int more_members = b_.Star({b_.Byte(','), b_.RuleItem(member)});
    b_.AddAlternative(object_, {b_.Byte('{'), b_.Byte('}')});
    b_.AddAlternative(object_, {b_.Byte('{'), b_.RuleItem(member), b_.RuleItem(more_members), b_.Byte('}')});
    const int more_values = b_.Star({b_.Byte(','), b_.RuleItem(value_)});
    b_.AddAlternative(array, {b_.Byte('['), b_.Byte(']')});
    b_.AddAlternative(array, {b_.Byte('['), b_.RuleItem(value_), b_.RuleItem(more_values), b_.Byte(']')});
    for (const Seq& alt : std::vector<Seq>{{b_.RuleItem(object_)},
                                           {b_.RuleItem(array)},
                                           {b_.RuleItem(AnyString())},
                                           {b_.RuleItem(Number())},
                                           b_.Literal("true"),
                                           b_.Literal("false"),
                                           b_.Literal("null")}) {
      b_.AddAlternative(value_, alt);
    }
    return value_;
  }
  int Object() {
    Value();
    return object_;
  }

 private:
  GrammarBuilder& b_;
  int char_ = -1, non_ascii_ = -1, string_ = -1, integer_ = -1, number_ = -1, value_ = -1, object_ = -1;
};

// A regular expression (JSON Schema's `pattern`) over a JSON string's characters, as grammar items
// that write each character as JSON does (escaping " and \ and control characters).
class RegexCompiler {
 public:
  RegexCompiler(GrammarBuilder& b, JsonPieces& pieces, std::string_view pattern, std::string where)
      : b_(b), pieces_(pieces), p_(pattern), where_(std::move(where)) {}

  absl::StatusOr<int> Compile() {
    if (!p_.empty() && p_.front() == '^') p_.remove_prefix(1);
    if (!p_.empty() && p_.back() == '$' && (p_.size() < 2 || p_[p_.size() - 2] != '\\')) p_.remove_suffix(1);
    MOE_ASSIGN_OR_RETURN(const int rule, Alternation());
    if (i_ != p_.size()) return Error(absl::StrCat("unexpected '", std::string(1, p_[i_]), "'"));
    return rule;
  }

 private:
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(where_, ": pattern '", std::string(p_), "' at offset ", i_, ": ", what,
                     " (supported: literals, [classes], ., \\d \\w \\s and their negations, groups, |, * + ? {n,m})"));
  }
  bool More() const { return i_ < p_.size(); }

  absl::StatusOr<int> Alternation() {
    std::vector<Seq> alts;
    while (true) {
      MOE_ASSIGN_OR_RETURN(Seq seq, Concat());
      alts.push_back(std::move(seq));
      if (More() && p_[i_] == '|') {
        ++i_;
        continue;
      }
      break;
    }
    return b_.Choice(alts);
  }

  absl::StatusOr<Seq> Concat() {
    Seq seq;
    while (More() && p_[i_] != '|' && p_[i_] != ')') {
      MOE_ASSIGN_OR_RETURN(Seq atom, Atom());
      int min = 1, max = 1;
      MOE_RETURN_IF_ERROR(Quantifier(&min, &max));
      if (min == 1 && max == 1) {
        seq.insert(seq.end(), atom.begin(), atom.end());
      } else {
        seq.push_back(b_.RuleItem(b_.Repeat(atom, min, max)));
      }
    }
    return seq;
  }

  absl::Status Quantifier(int* min, int* max) {
    if (!More()) return absl::OkStatus();
    const char c = p_[i_];
    if (c == '*' || c == '+' || c == '?') {
      *min = c == '+' ? 1 : 0;
      *max = c == '?' ? 1 : -1;
      ++i_;
    } else if (c == '{') {
      const size_t close = p_.find('}', i_);
      if (close == std::string_view::npos) return Error("'{' without '}'");
      const std::string body(p_.substr(i_ + 1, close - i_ - 1));
      const size_t comma = body.find(',');
      try {
        *min = std::stoi(body.substr(0, comma));
        *max = comma == std::string::npos ? *min : (comma + 1 == body.size() ? -1 : std::stoi(body.substr(comma + 1)));
      } catch (...) {
        return Error("a bad {n,m}");
      }
      if (*min < 0 || (*max >= 0 && *max < *min) || *min > kMaxRepeat || *max > kMaxRepeat) {
        return Error(absl::StrCat("a bad {n,m} (counts up to ", kMaxRepeat, ")"));
      }
      i_ = close + 1;
    } else {
      return absl::OkStatus();
    }
    if (More() && p_[i_] == '?') ++i_;  // lazy: the same strings
    if (More() && (p_[i_] == '*' || p_[i_] == '+' || p_[i_] == '{')) return Error("a quantifier after a quantifier");
    return absl::OkStatus();
  }

  // One character as JSON writes it inside a string.
  Seq JsonChar(uint8_t c) {
    if (c == '"') return b_.Literal("\\\"");
    if (c == '\\') return b_.Literal("\\\\");
    if (c < 0x20) {
      static const char* kHex = "0123456789abcdef";
      switch (c) {
        case '\n':
          return b_.Literal("\\n");
        case '\t':
          return b_.Literal("\\t");
        case '\r':
          return b_.Literal("\\r");
        case '\b':
          return b_.Literal("\\b");
        case '\f':
          return b_.Literal("\\f");
        default:
          return b_.Literal(std::string("\\u00") + kHex[c >> 4] + kHex[c & 15]);
      }
    }
    return {b_.Byte(c)};
  }

  // An ASCII set (and, when `non_ascii`, every multi-byte character) as one item.
  Seq Class(const std::bitset<128>& ascii, bool non_ascii) {
    ByteSet plain;
    std::vector<Seq> alts;
    for (int c = 0; c < 128; ++c) {
      if (!ascii.test(c)) continue;
      if (c >= 0x20 && c != '"' && c != '\\') {
        plain.set(c);
      } else {
        alts.push_back(JsonChar(static_cast<uint8_t>(c)));
      }
    }
    if (plain.any()) alts.push_back({b_.Bytes(plain)});
    if (non_ascii) alts.push_back({b_.RuleItem(pieces_.NonAscii())});
    if (alts.size() == 1) return alts[0];
    return {b_.RuleItem(b_.Choice(alts))};
  }

  static std::bitset<128> Ascii(int lo, int hi) {
    std::bitset<128> s;
    for (int c = lo; c <= hi; ++c) s.set(c);
    return s;
  }
  static std::bitset<128> ShorthandSet(char c) {
    switch (c) {
      case 'd':
      case 'D':
        return Ascii('0', '9');
      case 'w':
      case 'W':
        return Ascii('0', '9') | Ascii('a', 'z') | Ascii('A', 'Z') | Ascii('_', '_');
      default: {  // s, S
        std::bitset<128> s;
        for (char w : std::string_view(" \t\n\r\f\v")) s.set(static_cast<uint8_t>(w));
        return s;
      }
    }
  }

  // An escaped character (after the backslash) as a literal byte; false for shorthands.
  absl::StatusOr<int> EscapedByte(char c) {
    switch (c) {
      case 'n':
        return '\n';
      case 't':
        return '\t';
      case 'r':
        return '\r';
      case 'f':
        return '\f';
      case 'v':
        return '\v';
      default:
        break;
    }
    if ((c >= '0' && c <= '9') || c == 'b' || c == 'B' || c == 'k' || c == 'p' || c == 'P' || c == 'u' || c == 'x') {
      return Error(absl::StrCat("the escape \\", std::string(1, c), " is not supported"));
    }
    if (static_cast<uint8_t>(c) >= 0x80) return Error("an escaped non-ASCII character");
    return static_cast<int>(static_cast<uint8_t>(c));
  }

  absl::StatusOr<Seq> Atom() {
    const char c = p_[i_];
    if (c == '(') {
      ++i_;
      if (More() && p_[i_] == '?') {
        if (i_ + 1 < p_.size() && p_[i_ + 1] == ':') {
          i_ += 2;
        } else {
          return Error("lookarounds and named groups are not supported");
        }
      }
      MOE_ASSIGN_OR_RETURN(const int inner, Alternation());
      if (!More() || p_[i_] != ')') return Error("'(' without ')'");
      ++i_;
      return Seq{b_.RuleItem(inner)};
    }
    if (c == '[') return BracketClass();
    if (c == '.') {
      ++i_;
      std::bitset<128> all = Ascii(0, 127);
      all.reset('\n');
      all.reset('\r');
      return Class(all, true);
    }
    if (c == '\\') {
      if (i_ + 1 >= p_.size()) return Error("a trailing backslash");
      const char e = p_[i_ + 1];
      i_ += 2;
      if (std::string_view("dDwWsS").find(e) != std::string_view::npos) {
        const std::bitset<128> set = ShorthandSet(e);
        const bool negated = e == 'D' || e == 'W' || e == 'S';
        return Class(negated ? ~set : set, negated);
      }
      MOE_ASSIGN_OR_RETURN(const int byte, EscapedByte(e));
      return JsonChar(static_cast<uint8_t>(byte));
    }
    if (c == '*' || c == '+' || c == '?' || c == '{') return Error("a quantifier with nothing before it");
    if (c == '^' || c == '$') return Error("anchors are supported only at the pattern's ends");
    // A literal character: its UTF-8 bytes as they are.
    const uint8_t lead = static_cast<uint8_t>(c);
    const size_t len = lead < 0x80 ? 1 : lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : 2;
    if (i_ + len > p_.size()) return Error("a cut UTF-8 character");
    Seq seq = lead < 0x80 ? JsonChar(lead) : b_.Literal(p_.substr(i_, len));
    i_ += len;
    return seq;
  }

  absl::StatusOr<Seq> BracketClass() {
    ++i_;
    bool negated = false;
    if (More() && p_[i_] == '^') {
      negated = true;
      ++i_;
    }
    std::bitset<128> set;
    bool first = true;
    while (More() && (p_[i_] != ']' || first)) {
      first = false;
      int lo;
      if (p_[i_] == '\\') {
        if (i_ + 1 >= p_.size()) return Error("a trailing backslash");
        const char e = p_[i_ + 1];
        i_ += 2;
        if (std::string_view("dws").find(e) != std::string_view::npos) {
          set |= ShorthandSet(e);
          continue;
        }
        if (std::string_view("DWS").find(e) != std::string_view::npos) {
          return Error("a negated shorthand inside a class");
        }
        MOE_ASSIGN_OR_RETURN(lo, EscapedByte(e));
      } else {
        lo = static_cast<uint8_t>(p_[i_++]);
      }
      if (lo >= 0x80) return Error("non-ASCII characters inside a class");
      int hi = lo;
      if (i_ + 1 < p_.size() && p_[i_] == '-' && p_[i_ + 1] != ']') {
        ++i_;
        if (p_[i_] == '\\') {
          if (i_ + 1 >= p_.size()) return Error("a trailing backslash");
          MOE_ASSIGN_OR_RETURN(hi, EscapedByte(p_[i_ + 1]));
          i_ += 2;
        } else {
          hi = static_cast<uint8_t>(p_[i_++]);
        }
        if (hi >= 0x80) return Error("non-ASCII characters inside a class");
        if (hi < lo) return Error("a range whose end is below its start");
      }
      set |= Ascii(lo, hi);
    }
    if (!More()) return Error("'[' without ']'");
    ++i_;
    if (negated) {
      std::bitset<128> all = ~set;
      return Class(all, true);
    }
    if (set.none()) return Error("an empty class");
    return Class(set, false);
  }

  GrammarBuilder& b_;
  JsonPieces& pieces_;
  std::string_view p_;
  const std::string where_;
  size_t i_ = 0;
};

const std::set<std::string>& Annotations() {
  static const auto* kAnnotations = new std::set<std::string>{
      "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
      "writeOnly", "$defs", "definitions"};
  return *kAnnotations;
}

const std::set<std::string>& Enforced() {
  static const auto* kEnforced = new std::set<std::string>{
      "type",     "properties", "required", "additionalProperties", "items",     "minItems",  "maxItems", "enum",
      "const",    "anyOf",      "allOf",    "$ref",                 "minLength", "maxLength", "pattern"};
  return *kEnforced;
}

// JSON Pointer escaping of one path segment, for messages.
std::string Segment(const std::string& key) {
  std::string out;
  for (char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

class SchemaCompiler {
 public:
  SchemaCompiler(GrammarBuilder& b, JsonPieces& pieces, std::string field)
      : b_(b), pieces_(pieces), field_(std::move(field)) {}

  // The rule of `schema`, whose $refs point into `root`.
  absl::StatusOr<int> CompileRoot(const json& root) {
    root_ = &root;
    return Compile(root, "");
  }

 private:
  std::string Where(const std::string& path) const { return path.empty() ? field_ : absl::StrCat(field_, " at ", path); }

  absl::StatusOr<int> Compile(const json& schema, const std::string& path) {
    if (++depth_ > 256) return absl::InvalidArgumentError(absl::StrCat(Where(path), ": nested too deeply"));
    absl::StatusOr<int> rule = CompileInner(schema, path);
    --depth_;
    return rule;
  }

  absl::StatusOr<int> CompileInner(const json& schema, const std::string& path) {
    if (schema.is_boolean()) {
      if (schema.get<bool>()) return pieces_.Value();
      return absl::InvalidArgumentError(absl::StrCat(Where(path), ": the schema false accepts nothing"));
    }
    if (!schema.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(Where(path), ": a schema must be an object or a boolean"));
    }
    for (const auto& [key, value] : schema.items()) {
      if (Annotations().count(key) == 0 && Enforced().count(key) == 0) {
        return Unsupported(Where(path), absl::StrCat("the keyword '", key, "'"));
      }
    }
    if (const auto it = schema.find("$ref"); it != schema.end()) return Ref(*it, path);
    if (const auto it = schema.find("const"); it != schema.end()) return Literal(*it);
    if (const auto it = schema.find("enum"); it != schema.end()) {
      if (!it->is_array() || it->empty()) {
        return absl::InvalidArgumentError(absl::StrCat(Where(path + "/enum"), ": expected a non-empty list"));
      }
      std::vector<Seq> alts;
      for (const json& v : *it) alts.push_back(b_.Literal(v.dump()));
      return b_.Choice(alts);
    }
    if (const auto it = schema.find("anyOf"); it != schema.end()) return AnyOf(*it, path + "/anyOf");
    if (const auto it = schema.find("allOf"); it != schema.end()) {
      if (!it->is_array() || it->size() != 1) {
        return Unsupported(Where(path + "/allOf"), "allOf of more than one schema");
      }
      return Compile((*it)[0], path + "/allOf/0");
    }
    std::vector<std::string> types;
    if (const auto it = schema.find("type"); it != schema.end()) {
      if (it->is_string()) {
        types.push_back(*it);
      } else if (it->is_array()) {
        for (const json& t : *it) {
          if (!t.is_string()) return absl::InvalidArgumentError(absl::StrCat(Where(path + "/type"), ": expected strings"));
          types.push_back(t);
        }
      } else {
        return absl::InvalidArgumentError(absl::StrCat(Where(path + "/type"), ": expected a string or a list"));
      }
    } else if (schema.contains("properties") || schema.contains("additionalProperties")) {
      types.push_back("object");
    } else if (schema.contains("items") || schema.contains("minItems") || schema.contains("maxItems")) {
      types.push_back("array");
    } else if (schema.contains("pattern") || schema.contains("minLength") || schema.contains("maxLength")) {
      types.push_back("string");
    } else {
      return pieces_.Value();
    }
    std::vector<Seq> alts;
    for (const std::string& type : types) {
      MOE_ASSIGN_OR_RETURN(const int rule, Typed(type, schema, path));
      alts.push_back({b_.RuleItem(rule)});
    }
    return b_.Choice(alts);
  }

  absl::StatusOr<int> Literal(const json& value) { return b_.Choice({b_.Literal(value.dump())}); }

  absl::StatusOr<int> AnyOf(const json& list, const std::string& path) {
    if (!list.is_array() || list.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(Where(path), ": expected a non-empty list"));
    }
    std::vector<Seq> alts;
    for (size_t i = 0; i < list.size(); ++i) {
      MOE_ASSIGN_OR_RETURN(const int rule, Compile(list[i], absl::StrCat(path, "/", i)));
      alts.push_back({b_.RuleItem(rule)});
    }
    return b_.Choice(alts);
  }

  absl::StatusOr<int> Ref(const json& ref, const std::string& path) {
    if (!ref.is_string()) return absl::InvalidArgumentError(absl::StrCat(Where(path + "/$ref"), ": expected a string"));
    const std::string target = ref;
    if (const auto it = refs_.find(target); it != refs_.end()) return it->second;
    std::string_view rest;
    std::string container;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      if (target.rfind(prefix, 0) == 0) {
        container = std::string(prefix).substr(2, std::string(prefix).size() - 3);
        rest = std::string_view(target).substr(std::string(prefix).size());
      }
    }
    if (container.empty() || rest.empty() || rest.find('/') != std::string_view::npos) {
      return Unsupported(Where(path + "/$ref"),
                         absl::StrCat("the reference '", target, "' (only #/$defs/NAME and #/definitions/NAME)"));
    }
    const auto defs = root_->find(container);
    if (defs == root_->end() || !defs->is_object() || !defs->contains(std::string(rest))) {
      return absl::InvalidArgumentError(absl::StrCat(Where(path + "/$ref"), ": '", target, "' is not defined"));
    }
    // The rule exists before its body, so a recursive reference finds it.
    const int rule = b_.NewRule();
    refs_[target] = rule;
    MOE_ASSIGN_OR_RETURN(const int body, Compile((*defs)[std::string(rest)], target.substr(1)));
    b_.AddAlternative(rule, {b_.RuleItem(body)});
    return rule;
  }

  absl::StatusOr<int> Count(const json& schema, const char* key, const std::string& path, int fallback) {
    const auto it = schema.find(key);
    if (it == schema.end()) return fallback;
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(Where(path + "/" + key), ": expected a non-negative integer"));
    }
    if (it->get<int64_t>() > kMaxRepeat) {
      return Unsupported(Where(path + "/" + key), absl::StrCat(key, " above ", kMaxRepeat));
    }
    return static_cast<int>(it->get<int64_t>());
  }

  absl::StatusOr<int> Typed(const std::string& type, const json& schema, const std::string& path) {
    if (type == "string") return StringRule(schema, path);
    if (type == "integer") return pieces_.Integer();
    if (type == "number") return pieces_.Number();
    if (type == "boolean") return b_.Choice({b_.Literal("true"), b_.Literal("false")});
    if (type == "null") return b_.Choice({b_.Literal("null")});
    if (type == "array") return ArrayRule(schema, path);
    if (type == "object") return ObjectRule(schema, path);
    return absl::InvalidArgumentError(absl::StrCat(Where(path + "/type"), ": unknown type '", type, "'"));
  }

  absl::StatusOr<int> StringRule(const json& schema, const std::string& path) {
    MOE_ASSIGN_OR_RETURN(const int min, Count(schema, "minLength", path, 0));
    MOE_ASSIGN_OR_RETURN(const int max, Count(schema, "maxLength", path, -1));
    if (max >= 0 && max < min) {
      return absl::InvalidArgumentError(absl::StrCat(Where(path), ": maxLength is below minLength"));
    }
    if (const auto it = schema.find("pattern"); it != schema.end()) {
      if (!it->is_string()) return absl::InvalidArgumentError(absl::StrCat(Where(path + "/pattern"), ": expected a string"));
      if (schema.contains("minLength") || schema.contains("maxLength")) {
        return Unsupported(Where(path), "pattern together with minLength or maxLength");
      }
      RegexCompiler regex(b_, pieces_, it->get_ref<const std::string&>(), Where(path + "/pattern"));
      MOE_ASSIGN_OR_RETURN(const int body, regex.Compile());
      return b_.Choice({{b_.Byte('"'), b_.RuleItem(body), b_.Byte('"')}});
    }
    if (min == 0 && max < 0) return pieces_.AnyString();
    return pieces_.String(min, max);
  }

  absl::StatusOr<int> ArrayRule(const json& schema, const std::string& path) {
    MOE_ASSIGN_OR_RETURN(const int min, Count(schema, "minItems", path, 0));
    MOE_ASSIGN_OR_RETURN(const int max, Count(schema, "maxItems", path, -1));
    if (max >= 0 && max < min) return absl::InvalidArgumentError(absl::StrCat(Where(path), ": maxItems is below minItems"));
    int item = -1;
    if (const auto it = schema.find("items"); it != schema.end()) {
      if (it->is_array()) return Unsupported(Where(path + "/items"), "items as a list of schemas");
      MOE_ASSIGN_OR_RETURN(item, Compile(*it, path + "/items"));
    } else {
      item = pieces_.Value();
    }
    const int rule = b_.NewRule();
    if (min == 0) b_.AddAlternative(rule, b_.Literal("[]"));
    if (max != 0) {
      const int more = b_.Repeat({b_.Byte(','), b_.RuleItem(item)}, std::max(min, 1) - 1, max < 0 ? -1 : max - 1);
      b_.AddAlternative(rule, {b_.Byte('['), b_.RuleItem(item), b_.RuleItem(more), b_.Byte(']')});
    }
    return rule;
  }

  absl::StatusOr<int> ObjectRule(const json& schema, const std::string& path) {
    const auto props = schema.find("properties");
    const auto additional = schema.find("additionalProperties");
    if (props == schema.end() || !props->is_object() || props->empty()) {
      if (schema.contains("required") && !schema["required"].empty()) {
        return Unsupported(Where(path + "/required"), "required properties that properties does not declare");
      }
      if (additional != schema.end() && additional->is_object()) {  // a map
        MOE_ASSIGN_OR_RETURN(const int value, Compile(*additional, path + "/additionalProperties"));
        const int member = b_.Choice({{b_.RuleItem(pieces_.AnyString()), b_.Byte(':'), b_.RuleItem(value)}});
        const int more = b_.Star({b_.Byte(','), b_.RuleItem(member)});
        return b_.Choice({b_.Literal("{}"), {b_.Byte('{'), b_.RuleItem(member), b_.RuleItem(more), b_.Byte('}')}});
      }
      if (additional != schema.end() && *additional == false) return b_.Choice({b_.Literal("{}")});
      return pieces_.Object();
    }
    std::set<std::string> required;
    if (const auto it = schema.find("required"); it != schema.end()) {
      if (!it->is_array()) return absl::InvalidArgumentError(absl::StrCat(Where(path + "/required"), ": expected a list"));
      for (const json& name : *it) {
        if (!name.is_string() || !props->contains(name.get<std::string>())) {
          return Unsupported(Where(path + "/required"),
                             absl::StrCat("the required property ", name.dump(), " that properties does not declare"));
        }
        required.insert(name.get<std::string>());
      }
    }
    // Properties in order, each required one always, each optional one or not; `after[i][f]`:
    // properties i.. with f = whether one was written before (so a comma goes first).
    std::vector<std::pair<std::string, int>> members;
    for (const auto& [name, sub] : props->items()) {
      MOE_ASSIGN_OR_RETURN(const int value, Compile(sub, absl::StrCat(path, "/properties/", Segment(name))));
      members.emplace_back(name, value);
    }
    const size_t n = members.size();
    std::vector<std::array<int, 2>> after(n + 1);
    after[n] = {b_.Choice({{}}), b_.Choice({{}})};
    for (size_t i = n; i-- > 0;) {
      for (int written = 0; written < 2; ++written) {
        Seq take = written ? Seq{b_.Byte(',')} : Seq{};
        const Seq key = b_.Literal(json(members[i].first).dump() + ":");
        take.insert(take.end(), key.begin(), key.end());
        take.push_back(b_.RuleItem(members[i].second));
        take.push_back(b_.RuleItem(after[i + 1][1]));
        std::vector<Seq> alts = {take};
        if (required.count(members[i].first) == 0) alts.push_back({b_.RuleItem(after[i + 1][written])});
        after[i][written] = b_.Choice(alts);
      }
    }
    return b_.Choice({{b_.Byte('{'), b_.RuleItem(after[0][0]), b_.Byte('}')}});
  }

  GrammarBuilder& b_;
  JsonPieces& pieces_;
  const std::string field_;
  const json* root_ = nullptr;
  std::map<std::string, int> refs_;
  int depth_ = 0;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(const json& schema, const std::string& field) {
  GrammarBuilder b;
  JsonPieces pieces(b);
  SchemaCompiler compiler(b, pieces, field);
  MOE_ASSIGN_OR_RETURN(const int root, compiler.CompileRoot(schema));
  return b.Build(root);
}

absl::StatusOr<std::shared_ptr<const Grammar>> JsonObjectGrammar() {
  GrammarBuilder b;
  JsonPieces pieces(b);
  return b.Build(pieces.Object());
}

absl::StatusOr<std::shared_ptr<const Grammar>> ToolCallsGrammar(const json& tools) {
  GrammarBuilder b;
  JsonPieces pieces(b);
  std::vector<Seq> calls;
  for (size_t i = 0; i < tools.size(); ++i) {
    const json& function = tools[i]["function"];
    const json parameters = function.value("parameters", json::object());
    SchemaCompiler compiler(b, pieces, absl::StrCat("tools[", i, "].function.parameters"));
    MOE_ASSIGN_OR_RETURN(const int args, compiler.CompileRoot(parameters));
    Seq call = b.Literal("{\"name\":" + json(function["name"].get<std::string>()).dump() + ",\"parameters\":");
    call.push_back(b.RuleItem(args));
    call.push_back(b.Byte('}'));
    calls.push_back(std::move(call));
  }
  const int call = b.Choice(calls);
  const int more = b.Star({b.Byte(','), b.RuleItem(call)});
  return b.Build(b.Choice({{b.Byte('['), b.RuleItem(call), b.RuleItem(more), b.Byte(']')}}));
}

}  // namespace moe::scheduler

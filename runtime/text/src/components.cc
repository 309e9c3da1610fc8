// The HF components, each following the behaviour of its counterpart in the `tokenizers` crate
// (the reference implementation): what it splits, what it keeps, and how it treats the edges.
#include "components.h"

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moe/core/json.h"
#include "moe/core/status.h"
#include "pcre_regex.h"
#include "unicode.h"

namespace moe::text::internal {

using nlohmann::json;

std::string TypeOf(const json& object) {
  if (!object.is_object()) return "";
  auto it = object.find("type");
  return it != object.end() && it->is_string() ? it->get<std::string>() : "";
}

absl::StatusOr<std::string> GetString(const json& object, const char* key, const std::string& where) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_string())
    return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be a string, found ",
                                                   it == object.end() ? "nothing" : core::DescribeJson(*it)));
  return it->get<std::string>();
}

absl::StatusOr<bool> GetBool(const json& object, const char* key, bool fallback, const std::string& where) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" must be true or false, found ", core::DescribeJson(*it)));
  return it->get<bool>();
}

namespace {

absl::StatusOr<int64_t> GetInt(const json& object, const char* key, int64_t fallback, const std::string& where) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_number_integer())
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" must be an integer, found ", core::DescribeJson(*it)));
  return it->get<int64_t>();
}

// A single character option (Metaspace's replacement, Strip's content), as UTF-8.
absl::StatusOr<std::string> GetChar(const json& object, const char* key, const std::string& where) {
  MOE_ASSIGN_OR_RETURN(std::string value, GetString(object, key, where));
  size_t pos = 0;
  if (value.empty() || !IsValidUtf8(value) || (NextCodePoint(value, &pos), pos != value.size()))
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" must be one character, found \"", value, "\""));
  return value;
}

// {"String": "..."} (literal) or {"Regex": "..."}.
absl::StatusOr<std::unique_ptr<Regex>> GetPattern(const json& object, const std::string& where) {
  auto it = object.find("pattern");
  if (it != object.end() && it->is_object()) {
    if (auto s = it->find("String"); s != it->end() && s->is_string()) return Regex::Literal(s->get<std::string>());
    if (auto r = it->find("Regex"); r != it->end() && r->is_string()) {
      auto regex = Regex::Compile(r->get<std::string>());
      if (!regex.ok()) return core::Annotate(regex.status(), where);
      return regex;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(where,
                                                 ": \"pattern\" must be {\"String\": ...} or {\"Regex\": ...}, found ",
                                                 it == object.end() ? "nothing" : core::DescribeJson(*it)));
}

std::string Unsupported(const char* component, const std::string& type, const std::vector<std::string>& supported) {
  return absl::StrCat(component, " type '", type, "' is not supported (supported: ", absl::StrJoin(supported, ", "),
                      ")");
}

// ---------------------------------------------------------------------------------------------
// Splitting with HF's SplitDelimiterBehavior.

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

absl::StatusOr<SplitBehavior> GetBehavior(const json& object, SplitBehavior fallback, const std::string& where) {
  auto it = object.find("behavior");
  if (it == object.end() || it->is_null()) return fallback;
  const std::string name = it->is_string() ? it->get<std::string>() : core::DescribeJson(*it);
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return absl::InvalidArgumentError(absl::StrCat(where, ": split behavior '", name,
                                                 "' is not supported (supported: Removed, Isolated, "
                                                 "MergedWithPrevious, MergedWithNext, Contiguous)"));
}

// A piece of text cut by a pattern: either a match or the text between two matches.
struct Segment {
  size_t begin;
  size_t end;
  bool is_match;
};

std::vector<Segment> SegmentsOf(size_t length, const std::vector<ByteSpan>& matches, bool invert) {
  std::vector<Segment> segments;
  segments.reserve(matches.size() * 2 + 1);
  size_t at = 0;
  for (const ByteSpan& m : matches) {
    if (m.begin > at) segments.push_back({at, m.begin, invert});
    segments.push_back({m.begin, m.end, !invert});
    at = m.end;
  }
  if (at < length) segments.push_back({at, length, invert});
  return segments;
}

// Each character for which `predicate` holds is a match of its own (HF's `Fn(char) -> bool`
// pattern), so Contiguous is what joins runs of them.
std::vector<ByteSpan> CharMatches(std::string_view text, const std::function<bool(char32_t)>& predicate) {
  std::vector<ByteSpan> matches;
  for (size_t pos = 0; pos < text.size();) {
    const size_t begin = pos;
    const char32_t cp = NextCodePoint(text, &pos);
    if (predicate(cp)) matches.push_back({begin, pos});
  }
  return matches;
}

// The spans to keep, following tokenizers' NormalizedString::split.
std::vector<ByteSpan> ApplyBehavior(const std::vector<Segment>& segments, SplitBehavior behavior) {
  std::vector<ByteSpan> kept;
  kept.reserve(segments.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Segment& s : segments) kept.push_back({s.begin, s.end});
      break;
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments)
        if (!s.is_match) kept.push_back({s.begin, s.end});
      break;
    case SplitBehavior::kContiguous:
      for (const Segment& s : segments) {
        if (!kept.empty() && s.is_match == previous_match) {
          kept.back().end = s.end;
        } else {
          kept.push_back({s.begin, s.end});
        }
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Segment& s : segments) {
        if (!kept.empty() && s.is_match && !previous_match) {
          kept.back().end = s.end;
        } else {
          kept.push_back({s.begin, s.end});
        }
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto s = segments.rbegin(); s != segments.rend(); ++s) {
        if (!kept.empty() && s->is_match && !previous_match) {
          kept.back().begin = s->begin;
        } else {
          kept.push_back({s->begin, s->end});
        }
        previous_match = s->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  return kept;
}

using MatchFinder = std::function<std::vector<ByteSpan>(std::string_view)>;

void SplitPieces(std::vector<Piece>* pieces, const MatchFinder& find, SplitBehavior behavior, bool invert) {
  std::vector<Piece> out;
  out.reserve(pieces->size());
  for (Piece& piece : *pieces) {
    const std::vector<ByteSpan> kept = ApplyBehavior(SegmentsOf(piece.text.size(), find(piece.text), invert), behavior);
    if (kept.size() == 1 && kept[0].begin == 0 && kept[0].end == piece.text.size()) {
      out.push_back(std::move(piece));
      continue;
    }
    for (const ByteSpan& span : kept) {
      if (span.end == span.begin) continue;
      out.push_back({piece.text.substr(span.begin, span.end - span.begin), piece.at_start && span.begin == 0});
    }
  }
  *pieces = std::move(out);
}

// ---------------------------------------------------------------------------------------------
// Normalizers.

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  void Normalize(std::string* text) const override { *text = internal::Normalize(*text, form_); }

 private:
  NormalForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  void Normalize(std::string* text) const override { *text = Lowercase(*text); }
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void Normalize(std::string* text) const override {
    size_t begin = 0, end = text->size();
    if (left_) {
      begin = end;
      for (size_t pos = 0; pos < end;) {
        const size_t at = pos;
        if (!IsWhitespace(NextCodePoint(*text, &pos))) {
          begin = at;
          break;
        }
      }
    }
    if (right_) {
      size_t last = begin;  // end of the last non-whitespace character
      for (size_t pos = begin; pos < end;) {
        if (!IsWhitespace(NextCodePoint(*text, &pos))) last = pos;
      }
      end = last;
    }
    *text = text->substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::unique_ptr<Regex> pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void Normalize(std::string* text) const override { *text = pattern_->ReplaceAll(*text, content_); }

 private:
  std::unique_ptr<Regex> pattern_;
  std::string content_;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void Normalize(std::string* text) const override {
    if (!text->empty()) text->insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class NormalizerSequence final : public Normalizer {
 public:
  explicit NormalizerSequence(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void Normalize(std::string* text) const override {
    for (const auto& step : steps_) step->Normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers.

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::unique_ptr<Regex> pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    SplitPieces(
        pieces, [this](std::string_view t) { return pattern_->FindAll(t); }, behavior_, invert_);
  }

 private:
  std::unique_ptr<Regex> pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

// GPT-2's pattern, which ByteLevel uses when use_regex is set.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::unique_ptr<Regex> pattern)
      : add_prefix_space_(add_prefix_space), pattern_(std::move(pattern)) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    if (add_prefix_space_) {
      for (Piece& piece : *pieces)
        if (piece.text.empty() || piece.text[0] != ' ') piece.text.insert(0, " ");
    }
    if (pattern_ != nullptr) {
      SplitPieces(
          pieces, [this](std::string_view t) { return pattern_->FindAll(t); }, SplitBehavior::kIsolated, false);
    }
    for (Piece& piece : *pieces) {
      std::string mapped;
      mapped.reserve(piece.text.size() * 2);
      for (unsigned char c : piece.text) mapped += ByteToUnicode(c);
      piece.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> pattern_;  // null: use_regex false
};

enum class PrependScheme { kAlways, kFirst, kNever };

absl::StatusOr<PrependScheme> GetPrependScheme(const json& config, const std::string& where) {
  // Older files have only add_prefix_space; HF reads false as "never" and true as "always".
  MOE_ASSIGN_OR_RETURN(const bool add_prefix_space, GetBool(config, "add_prefix_space", true, where));
  auto it = config.find("prepend_scheme");
  PrependScheme scheme = PrependScheme::kAlways;
  if (it != config.end() && !it->is_null()) {
    const std::string name = it->is_string() ? it->get<std::string>() : core::DescribeJson(*it);
    if (name == "always") {
      scheme = PrependScheme::kAlways;
    } else if (name == "first") {
      scheme = PrependScheme::kFirst;
    } else if (name == "never") {
      scheme = PrependScheme::kNever;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": prepend_scheme '", name, "' is not supported (supported: always, first, never)"));
    }
  }
  if (!add_prefix_space) {
    if (scheme != PrependScheme::kNever && it != config.end() && !it->is_null())
      return absl::InvalidArgumentError(absl::StrCat(where, ": add_prefix_space false contradicts prepend_scheme"));
    scheme = PrependScheme::kNever;
  }
  return scheme;
}

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    for (Piece& piece : *pieces) {
      std::string replaced;
      replaced.reserve(piece.text.size() + replacement_.size());
      for (char c : piece.text) {
        if (c == ' ') {
          replaced += replacement_;
        } else {
          replaced.push_back(c);
        }
      }
      const bool starts_with_replacement = replaced.compare(0, replacement_.size(), replacement_) == 0;
      if (!starts_with_replacement &&
          (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && piece.at_start))) {
        replaced.insert(0, replacement_);
      }
      piece.text = std::move(replaced);
    }
    if (split_) {
      SplitPieces(
          pieces,
          [this](std::string_view t) {
            std::vector<ByteSpan> matches;
            for (size_t at = t.find(replacement_); at != std::string_view::npos;
                 at = t.find(replacement_, at + replacement_.size()))
              matches.push_back({at, at + replacement_.size()});
            return matches;
          },
          SplitBehavior::kMergedWithNext, false);
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

class CharClassPreTokenizer final : public PreTokenizer {
 public:
  CharClassPreTokenizer(std::function<bool(char32_t)> predicate, SplitBehavior behavior)
      : predicate_(std::move(predicate)), behavior_(behavior) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    SplitPieces(
        pieces, [this](std::string_view t) { return CharMatches(t, predicate_); }, behavior_, false);
  }

 private:
  std::function<bool(char32_t)> predicate_;
  SplitBehavior behavior_;
};

class PreTokenizerSequence final : public PreTokenizer {
 public:
  explicit PreTokenizerSequence(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void PreTokenize(std::vector<Piece>* pieces) const override {
    for (const auto& step : steps_) step->PreTokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

// ---------------------------------------------------------------------------------------------
// Decoders.

class ByteLevelDecoder final : public Decoder {
 public:
  // A token whose characters are all in the byte map becomes those bytes; any other token (an
  // added token such as "<|im_start|>" written in plain text) is kept as its UTF-8.
  void DecodeChain(std::vector<std::string>* tokens) const override {
    DecodeBytes(tokens);
    (*tokens)[0] = RepairUtf8((*tokens)[0]);
  }
  void DecodeBytes(std::vector<std::string>* tokens) const override {
    std::string bytes;
    for (const std::string& token : *tokens) {
      const size_t mark = bytes.size();
      bool all_mapped = true;
      for (size_t pos = 0; pos < token.size();) {
        const int b = UnicodeToByte(NextCodePoint(token, &pos));
        if (b < 0) {
          all_mapped = false;
          break;
        }
        bytes.push_back(static_cast<char>(b));
      }
      if (!all_mapped) {
        bytes.resize(mark);
        bytes += token;
      }
    }
    tokens->assign(1, std::move(bytes));
  }
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, PrependScheme scheme)
      : replacement_(std::move(replacement)), scheme_(scheme) {}
  // As HF does, every replacement in the first token is dropped (not only a leading one) unless
  // the scheme is "never"; elsewhere each becomes a space.
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) {
      std::string& token = (*tokens)[i];
      std::string out;
      out.reserve(token.size());
      const bool drop = i == 0 && scheme_ != PrependScheme::kNever;
      for (size_t at = 0; at < token.size();) {
        if (token.compare(at, replacement_.size(), replacement_) == 0) {
          if (!drop) out.push_back(' ');
          at += replacement_.size();
        } else {
          out.push_back(token[at++]);
        }
      }
      token = std::move(out);
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
};

// "<0xNN>" tokens become bytes; a run of them that is not UTF-8 gives one U+FFFD per byte.
class ByteFallbackDecoder final : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override { Decode(tokens, /*repair=*/true); }
  void DecodeBytes(std::vector<std::string>* tokens) const override { Decode(tokens, /*repair=*/false); }

 private:
  void Decode(std::vector<std::string>* tokens, bool repair) const {
    std::vector<std::string> out;
    out.reserve(tokens->size());
    std::string pending;
    int pending_count = 0;
    auto flush = [&] {
      if (pending_count == 0) return;
      if (!repair || IsValidUtf8(pending)) {
        out.push_back(pending);
      } else {
        for (int i = 0; i < pending_count; ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
      pending_count = 0;
    };
    for (std::string& token : *tokens) {
      const int byte = ByteToken(token);
      if (byte >= 0) {
        pending.push_back(static_cast<char>(byte));
        ++pending_count;
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    *tokens = std::move(out);
  }

 private:
  static int Hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  static int ByteToken(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    const int hi = Hex(t[3]), lo = Hex(t[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
  }
};

class FuseDecoder final : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override { tokens->assign(1, absl::StrJoin(*tokens, "")); }
};

// Removes up to `start` leading and `stop` trailing copies of `content` from every token.
class StripDecoder final : public Decoder {
 public:
  StripDecoder(std::string content, int64_t start, int64_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    const size_t n = content_.size();
    for (std::string& token : *tokens) {
      size_t begin = 0, end = token.size();
      for (int64_t i = 0; i < start_ && end - begin >= n && token.compare(begin, n, content_) == 0; ++i) begin += n;
      for (int64_t i = 0; i < stop_ && end - begin >= n && token.compare(end - n, n, content_) == 0; ++i) end -= n;
      token = token.substr(begin, end - begin);
    }
  }

 private:
  std::string content_;
  int64_t start_, stop_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(std::unique_ptr<Regex> pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& token : *tokens) token = pattern_->ReplaceAll(token, content_);
  }

 private:
  std::unique_ptr<Regex> pattern_;
  std::string content_;
};

class DecoderSequence final : public Decoder {
 public:
  explicit DecoderSequence(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (const auto& step : steps_) step->DecodeChain(tokens);
  }
  void DecodeBytes(std::vector<std::string>* tokens) const override {
    for (const auto& step : steps_) step->DecodeBytes(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

// ---------------------------------------------------------------------------------------------
// Post-processors.

class TemplatePostProcessor final : public PostProcessor {
 public:
  // Each item is either a run of fixed ids (a special token) or, as an empty optional, the
  // sequence itself.
  explicit TemplatePostProcessor(std::vector<std::optional<std::vector<int32_t>>> items) : items_(std::move(items)) {}
  void ProcessSingle(std::vector<int32_t>* ids) const override {
    std::vector<int32_t> out;
    out.reserve(ids->size() + items_.size());
    for (const auto& item : items_) {
      if (item.has_value()) {
        out.insert(out.end(), item->begin(), item->end());
      } else {
        out.insert(out.end(), ids->begin(), ids->end());
      }
    }
    *ids = std::move(out);
  }

 private:
  std::vector<std::optional<std::vector<int32_t>>> items_;
};

class NoOpPostProcessor final : public PostProcessor {
 public:
  void ProcessSingle(std::vector<int32_t>*) const override {}
};

class PostProcessorSequence final : public PostProcessor {
 public:
  explicit PostProcessorSequence(std::vector<std::unique_ptr<PostProcessor>> steps) : steps_(std::move(steps)) {}
  void ProcessSingle(std::vector<int32_t>* ids) const override {
    for (const auto& step : steps_) step->ProcessSingle(ids);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

absl::StatusOr<std::vector<int32_t>> TemplateSpecialIds(const json& config, const std::string& name,
                                                        const std::string& where) {
  auto specials = config.find("special_tokens");
  if (specials == config.end() || !specials->is_object() || !specials->contains(name))
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the template names special token '", name, "', which special_tokens does not define"));
  const json& entry = (*specials)[name];
  auto ids = entry.find("ids");
  if (ids == entry.end() || !ids->is_array())
    return absl::InvalidArgumentError(absl::StrCat(where, ": special_tokens['", name, "'] has no \"ids\" list"));
  std::vector<int32_t> out;
  for (const json& id : *ids) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": special_tokens['", name, "'] has id ", core::DescribeJson(id)));
    out.push_back(id.get<int32_t>());
  }
  return out;
}

// RobertaProcessing / BertProcessing give `cls` and `sep` as ["<s>", 0].
absl::StatusOr<int32_t> PairId(const json& config, const char* key, const std::string& where) {
  auto it = config.find(key);
  if (it == config.end() || !it->is_array() || it->size() != 2 || !(*it)[1].is_number_integer())
    return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be [token, id]"));
  return (*it)[1].get<int32_t>();
}

template <typename T, typename Build>
absl::StatusOr<std::vector<std::unique_ptr<T>>> BuildAll(const json& config, const char* key, const std::string& where,
                                                         Build build) {
  auto it = config.find(key);
  if (it == config.end() || !it->is_array())
    return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be a list"));
  std::vector<std::unique_ptr<T>> steps;
  for (const json& step : *it) {
    MOE_ASSIGN_OR_RETURN(auto built, build(step));
    steps.push_back(std::move(built));
  }
  return steps;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> BuildNormalizer(const json& config) {
  const std::string type = TypeOf(config);
  const std::string where = absl::StrCat("normalizer ", type);
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfc);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfd);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfkc);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfkd);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Strip") {
    MOE_ASSIGN_OR_RETURN(const bool left, GetBool(config, "strip_left", true, where));
    MOE_ASSIGN_OR_RETURN(const bool right, GetBool(config, "strip_right", true, where));
    return std::make_unique<StripNormalizer>(left, right);
  }
  if (type == "Replace") {
    MOE_ASSIGN_OR_RETURN(auto pattern, GetPattern(config, where));
    MOE_ASSIGN_OR_RETURN(std::string content, GetString(config, "content", where));
    return std::make_unique<ReplaceNormalizer>(std::move(pattern), std::move(content));
  }
  if (type == "Prepend") {
    MOE_ASSIGN_OR_RETURN(std::string prepend, GetString(config, "prepend", where));
    return std::make_unique<PrependNormalizer>(std::move(prepend));
  }
  if (type == "Sequence") {
    MOE_ASSIGN_OR_RETURN(auto steps, BuildAll<Normalizer>(config, "normalizers", where, BuildNormalizer));
    return std::make_unique<NormalizerSequence>(std::move(steps));
  }
  return absl::InvalidArgumentError(Unsupported(
      "normalizer", type, {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "Replace", "Prepend", "Sequence"}));
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> BuildPreTokenizer(const json& config) {
  const std::string type = TypeOf(config);
  const std::string where = absl::StrCat("pre_tokenizer ", type);
  if (type == "Split") {
    MOE_ASSIGN_OR_RETURN(auto pattern, GetPattern(config, where));
    MOE_ASSIGN_OR_RETURN(const SplitBehavior behavior, GetBehavior(config, SplitBehavior::kRemoved, where));
    MOE_ASSIGN_OR_RETURN(const bool invert, GetBool(config, "invert", false, where));
    return std::make_unique<SplitPreTokenizer>(std::move(pattern), behavior, invert);
  }
  if (type == "ByteLevel") {
    MOE_ASSIGN_OR_RETURN(const bool add_prefix_space, GetBool(config, "add_prefix_space", true, where));
    MOE_ASSIGN_OR_RETURN(const bool use_regex, GetBool(config, "use_regex", true, where));
    std::unique_ptr<Regex> pattern;
    if (use_regex) {
      MOE_ASSIGN_OR_RETURN(pattern, Regex::Compile(kGpt2Pattern));
    }
    return std::make_unique<ByteLevelPreTokenizer>(add_prefix_space, std::move(pattern));
  }
  if (type == "Metaspace") {
    MOE_ASSIGN_OR_RETURN(std::string replacement, GetChar(config, "replacement", where));
    MOE_ASSIGN_OR_RETURN(const PrependScheme scheme, GetPrependScheme(config, where));
    MOE_ASSIGN_OR_RETURN(const bool split, GetBool(config, "split", true, where));
    return std::make_unique<MetaspacePreTokenizer>(std::move(replacement), scheme, split);
  }
  if (type == "Digits") {
    MOE_ASSIGN_OR_RETURN(const bool individual, GetBool(config, "individual_digits", false, where));
    return std::make_unique<CharClassPreTokenizer>(IsNumeric,
                                                   individual ? SplitBehavior::kIsolated : SplitBehavior::kContiguous);
  }
  if (type == "Punctuation") {
    MOE_ASSIGN_OR_RETURN(const SplitBehavior behavior, GetBehavior(config, SplitBehavior::kIsolated, where));
    return std::make_unique<CharClassPreTokenizer>(IsPunctuation, behavior);
  }
  if (type == "Whitespace") {
    // Words and runs of other non-space characters are kept; whitespace goes.
    MOE_ASSIGN_OR_RETURN(auto pattern, Regex::Compile(R"(\w+|[^\w\s]+)"));
    return std::make_unique<SplitPreTokenizer>(std::move(pattern), SplitBehavior::kRemoved, /*invert=*/true);
  }
  if (type == "WhitespaceSplit") return std::make_unique<CharClassPreTokenizer>(IsWhitespace, SplitBehavior::kRemoved);
  if (type == "BertPreTokenizer") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    steps.push_back(std::make_unique<CharClassPreTokenizer>(IsWhitespace, SplitBehavior::kRemoved));
    steps.push_back(std::make_unique<CharClassPreTokenizer>(IsPunctuation, SplitBehavior::kIsolated));
    return std::make_unique<PreTokenizerSequence>(std::move(steps));
  }
  if (type == "Sequence") {
    MOE_ASSIGN_OR_RETURN(auto steps, BuildAll<PreTokenizer>(config, "pretokenizers", where, BuildPreTokenizer));
    return std::make_unique<PreTokenizerSequence>(std::move(steps));
  }
  return absl::InvalidArgumentError(Unsupported("pre_tokenizer", type,
                                                {"Split", "ByteLevel", "Metaspace", "Digits", "Punctuation",
                                                 "Whitespace", "WhitespaceSplit", "BertPreTokenizer", "Sequence"}));
}

absl::StatusOr<std::unique_ptr<Decoder>> BuildDecoder(const json& config) {
  const std::string type = TypeOf(config);
  const std::string where = absl::StrCat("decoder ", type);
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    MOE_ASSIGN_OR_RETURN(std::string replacement, GetChar(config, "replacement", where));
    MOE_ASSIGN_OR_RETURN(const PrependScheme scheme, GetPrependScheme(config, where));
    return std::make_unique<MetaspaceDecoder>(std::move(replacement), scheme);
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    MOE_ASSIGN_OR_RETURN(std::string content, GetChar(config, "content", where));
    MOE_ASSIGN_OR_RETURN(const int64_t start, GetInt(config, "start", 0, where));
    MOE_ASSIGN_OR_RETURN(const int64_t stop, GetInt(config, "stop", 0, where));
    return std::make_unique<StripDecoder>(std::move(content), start, stop);
  }
  if (type == "Replace") {
    MOE_ASSIGN_OR_RETURN(auto pattern, GetPattern(config, where));
    MOE_ASSIGN_OR_RETURN(std::string content, GetString(config, "content", where));
    return std::make_unique<ReplaceDecoder>(std::move(pattern), std::move(content));
  }
  if (type == "Sequence") {
    MOE_ASSIGN_OR_RETURN(auto steps, BuildAll<Decoder>(config, "decoders", where, BuildDecoder));
    return std::make_unique<DecoderSequence>(std::move(steps));
  }
  return absl::InvalidArgumentError(
      Unsupported("decoder", type, {"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Strip", "Replace", "Sequence"}));
}

absl::StatusOr<std::unique_ptr<PostProcessor>> BuildPostProcessor(const json& config) {
  const std::string type = TypeOf(config);
  const std::string where = absl::StrCat("post_processor ", type);
  if (type == "ByteLevel") return std::make_unique<NoOpPostProcessor>();
  if (type == "TemplateProcessing") {
    auto single = config.find("single");
    if (single == config.end() || !single->is_array())
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"single\" must be a list of template items"));
    std::vector<std::optional<std::vector<int32_t>>> items;
    for (const json& item : *single) {
      if (item.is_object() && item.contains("Sequence")) {
        items.emplace_back(std::nullopt);
      } else if (item.is_object() && item.contains("SpecialToken") && item["SpecialToken"].is_object()) {
        MOE_ASSIGN_OR_RETURN(std::string name, GetString(item["SpecialToken"], "id", where));
        MOE_ASSIGN_OR_RETURN(std::vector<int32_t> ids, TemplateSpecialIds(config, name, where));
        items.emplace_back(std::move(ids));
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": template item ", core::DescribeJson(item), " is neither Sequence nor SpecialToken"));
      }
    }
    return std::make_unique<TemplatePostProcessor>(std::move(items));
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    MOE_ASSIGN_OR_RETURN(const int32_t cls, PairId(config, "cls", where));
    MOE_ASSIGN_OR_RETURN(const int32_t sep, PairId(config, "sep", where));
    std::vector<std::optional<std::vector<int32_t>>> items;
    items.emplace_back(std::vector<int32_t>{cls});
    items.emplace_back(std::nullopt);
    items.emplace_back(std::vector<int32_t>{sep});
    return std::make_unique<TemplatePostProcessor>(std::move(items));
  }
  if (type == "Sequence") {
    MOE_ASSIGN_OR_RETURN(auto steps, BuildAll<PostProcessor>(config, "processors", where, BuildPostProcessor));
    return std::make_unique<PostProcessorSequence>(std::move(steps));
  }
  return absl::InvalidArgumentError(Unsupported(
      "post_processor", type, {"TemplateProcessing", "ByteLevel", "RobertaProcessing", "BertProcessing", "Sequence"}));
}

}  // namespace moe::text::internal

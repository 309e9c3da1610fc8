#include "bpe_model.h"

#include <queue>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moe/core/json.h"
#include "moe/core/status.h"
#include "unicode.h"

namespace moe::text::internal {

using nlohmann::json;

namespace {

absl::StatusOr<std::string> OptionalString(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::string();
  if (!it->is_string())
    return absl::InvalidArgumentError(
        absl::StrCat("model BPE: \"", key, "\" must be a string or null, found ", core::DescribeJson(*it)));
  return it->get<std::string>();
}

absl::StatusOr<bool> OptionalBool(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return false;
  if (!it->is_boolean())
    return absl::InvalidArgumentError(
        absl::StrCat("model BPE: \"", key, "\" must be true or false, found ", core::DescribeJson(*it)));
  return it->get<bool>();
}

// Merges come as "a b" strings (older files) or ["a", "b"] pairs (newer ones, which allow
// spaces inside tokens).
absl::StatusOr<std::pair<std::string, std::string>> ParseMerge(const json& merge, size_t index) {
  if (merge.is_string()) {
    const std::string line = merge.get<std::string>();
    const size_t space = line.find(' ');
    if (space != std::string::npos && line.find(' ', space + 1) == std::string::npos)
      return std::make_pair(line.substr(0, space), line.substr(space + 1));
  } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
    return std::make_pair(merge[0].get<std::string>(), merge[1].get<std::string>());
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "model BPE: merges[", index, "] must be \"a b\" or [\"a\", \"b\"], found ", core::DescribeJson(merge)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::Build(const json& config) {
  if (!config.is_object()) return absl::InvalidArgumentError("\"model\" must be an object");
  // Files written by older versions of the library leave out the type of a BPE model.
  std::string type = "BPE";
  if (auto it = config.find("type"); it != config.end()) type = it->is_string() ? it->get<std::string>() : "?";
  if (type != "BPE")
    return absl::InvalidArgumentError(absl::StrCat("model type '", type, "' is not supported (supported: BPE)"));
  if (auto it = config.find("dropout"); it != config.end() && !it->is_null()) {
    // HF itself treats 0 as no dropout; anything else samples merges and so changes ids per run.
    if (!it->is_number() || it->get<double>() != 0.0)
      return absl::InvalidArgumentError(absl::StrCat("model BPE: dropout ", core::DescribeJson(*it),
                                                     " is not supported (only null: ids must not vary run to run)"));
  }
  auto model = std::unique_ptr<BpeModel>(new BpeModel());
  auto vocab = config.find("vocab");
  if (vocab == config.end() || !vocab->is_object())
    return absl::InvalidArgumentError("model BPE: \"vocab\" must be an object of token: id");
  model->vocab_.reserve(vocab->size());
  int64_t max_id = -1;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= INT32_MAX)
      return absl::InvalidArgumentError(absl::StrCat("model BPE: vocab[\"", it.key(), "\"] must be an id >= 0, found ",
                                                     core::DescribeJson(it.value())));
    const int32_t id = it.value().get<int32_t>();
    model->vocab_[it.key()] = id;
    max_id = std::max<int64_t>(max_id, id);
  }
  if (max_id >= (int64_t{1} << 26))
    return absl::InvalidArgumentError(absl::StrCat("model BPE: vocabulary id ", max_id, " is implausibly large"));
  model->id_to_token_.resize(static_cast<size_t>(max_id + 1));
  model->has_id_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [token, id] : model->vocab_) {
    model->id_to_token_[id] = token;
    model->has_id_[id] = true;
  }

  MOE_ASSIGN_OR_RETURN(const std::string unk, OptionalString(config, "unk_token"));
  if (!unk.empty()) {
    auto it = model->vocab_.find(unk);
    if (it == model->vocab_.end())
      return absl::InvalidArgumentError(absl::StrCat("model BPE: unk_token '", unk, "' is not in the vocabulary"));
    model->unk_id_ = it->second;
  }
  MOE_ASSIGN_OR_RETURN(model->continuing_subword_prefix_, OptionalString(config, "continuing_subword_prefix"));
  MOE_ASSIGN_OR_RETURN(model->end_of_word_suffix_, OptionalString(config, "end_of_word_suffix"));
  MOE_ASSIGN_OR_RETURN(model->fuse_unk_, OptionalBool(config, "fuse_unk"));
  MOE_ASSIGN_OR_RETURN(model->byte_fallback_, OptionalBool(config, "byte_fallback"));
  MOE_ASSIGN_OR_RETURN(model->ignore_merges_, OptionalBool(config, "ignore_merges"));

  model->all_bytes_present_ = true;
  for (int b = 0; b < 256; ++b) {
    auto it = model->vocab_.find(absl::StrFormat("<0x%02X>", b));
    model->byte_ids_[b] = it == model->vocab_.end() ? -1 : it->second;
    model->all_bytes_present_ &= it != model->vocab_.end();
  }

  auto merges = config.find("merges");
  if (merges != config.end() && !merges->is_null()) {
    if (!merges->is_array()) return absl::InvalidArgumentError("model BPE: \"merges\" must be a list");
    model->merges_.reserve(merges->size());
    const size_t prefix_len = model->continuing_subword_prefix_.size();
    for (size_t i = 0; i < merges->size(); ++i) {
      MOE_ASSIGN_OR_RETURN(auto pair, ParseMerge((*merges)[i], i));
      const auto& [a, b] = pair;
      auto a_id = model->vocab_.find(a), b_id = model->vocab_.find(b);
      // The merged token drops the right part's continuing-subword prefix ("##").
      const std::string merged =
          a + (b.size() >= prefix_len && b.compare(0, prefix_len, model->continuing_subword_prefix_) == 0
                   ? b.substr(prefix_len)
                   : b);
      auto new_id = model->vocab_.find(merged);
      if (a_id == model->vocab_.end() || b_id == model->vocab_.end() || new_id == model->vocab_.end()) {
        const std::string& missing = a_id == model->vocab_.end() ? a : b_id == model->vocab_.end() ? b : merged;
        return absl::InvalidArgumentError(
            absl::StrCat("model BPE: merges[", i, "] names '", missing, "', which is not in the vocabulary"));
      }
      // A later duplicate overrides an earlier one, as in HF (its map is built in order).
      model->merges_[PairKey(a_id->second, b_id->second)] = Merge{static_cast<int32_t>(i), new_id->second};
    }
  }
  return model;
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = vocab_.find(absl::string_view(token.data(), token.size()));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || !has_id_[id]) return nullptr;
  return &id_to_token_[id];
}

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(absl::string_view(word.data(), word.size())); it != vocab_.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  const absl::string_view key(word.data(), word.size());
  CacheShard& shard = cache_[absl::Hash<absl::string_view>()(key) % kCacheShards];
  if (cacheable) {
    std::lock_guard<std::mutex> lock(shard.mu);
    if (auto it = shard.words.find(key); it != shard.words.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids->size();
  MergeWord(word, ids);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(shard.mu);
    if (shard.words.size() < kCacheCapacityPerShard)
      shard.words.try_emplace(std::string(word), ids->begin() + first, ids->end());
  }
}

// One character of the word as a symbol: its id with the prefix/suffix the model wants, else
// its bytes' "<0xNN>" ids, else unk (fused with a preceding unk when fuse_unk is set), else
// nothing (HF drops such a character silently).
void BpeModel::AppendSymbol(std::string_view piece, bool first, bool last, std::vector<int32_t>* symbols,
                            std::optional<int32_t>* pending_unk) const {
  const bool decorated = (!first && !continuing_subword_prefix_.empty()) || (last && !end_of_word_suffix_.empty());
  std::string decorated_text;
  std::string_view text = piece;
  if (decorated) {
    decorated_text = first ? std::string() : continuing_subword_prefix_;
    decorated_text.append(piece);
    if (last) decorated_text += end_of_word_suffix_;
    text = decorated_text;
  }
  if (auto it = vocab_.find(absl::string_view(text.data(), text.size())); it != vocab_.end()) {
    if (pending_unk->has_value()) symbols->push_back(**pending_unk);
    pending_unk->reset();
    symbols->push_back(it->second);
    return;
  }
  if (byte_fallback_) {
    bool all = true;
    for (unsigned char c : text) all &= byte_ids_[c] >= 0;
    if (all) {
      // HF does not flush a pending unk here; it is added later, after these bytes.
      for (unsigned char c : text) symbols->push_back(byte_ids_[c]);
      return;
    }
  }
  if (!unk_id_.has_value()) return;
  if (pending_unk->has_value() && !fuse_unk_) symbols->push_back(**pending_unk);
  *pending_unk = *unk_id_;
}

void BpeModel::MergeWord(std::string_view word, std::vector<int32_t>* ids) const {
  // Symbols as a doubly linked list over a vector, so that a merge is O(1) and the queue holds
  // positions; entries made stale by an earlier merge are recognised and skipped when popped.
  std::vector<int32_t> symbol_ids;
  symbol_ids.reserve(word.size());
  std::optional<int32_t> pending_unk;
  for (size_t pos = 0; pos < word.size();) {
    const size_t begin = pos;
    pos = std::min(word.size(), pos + CodePointLength(static_cast<unsigned char>(word[pos])));
    AppendSymbol(word.substr(begin, pos - begin), begin == 0, pos == word.size(), &symbol_ids, &pending_unk);
  }
  if (pending_unk.has_value()) symbol_ids.push_back(*pending_unk);
  const int n = static_cast<int>(symbol_ids.size());
  if (n <= 1 || merges_.empty()) {
    ids->insert(ids->end(), symbol_ids.begin(), symbol_ids.end());
    return;
  }
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t new_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push_pair = [&](int left) {
    const int right = next[left];
    if (right < 0) return;
    auto it = merges_.find(PairKey(symbol_ids[left], symbol_ids[right]));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.new_id});
  };
  for (int i = 0; i + 1 < n; ++i) push_pair(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    if (!alive[top.pos] || next[top.pos] < 0) continue;
    const int right = next[top.pos];
    auto it = merges_.find(PairKey(symbol_ids[top.pos], symbol_ids[right]));
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;  // stale entry
    symbol_ids[top.pos] = top.new_id;
    alive[right] = false;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    if (prev[top.pos] >= 0) push_pair(prev[top.pos]);
    push_pair(top.pos);
  }
  for (int i = 0; i >= 0; i = next[i]) ids->push_back(symbol_ids[i]);
}

}  // namespace moe::text::internal

// The BPE model of tokenizer.json: a vocabulary, ranked merges, and the rules for characters
// the vocabulary lacks (byte fallback, unk). Splits one pre-tokenized word into ids.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace moe::text::internal {

// Thread-safe: everything but the word cache is immutable after Build; the cache is split into
// shards, each with its own mutex.
class BpeModel {
 public:
  // From the "model" object. kInvalidArgument for a model type other than BPE, a non-zero
  // dropout (sampling would make ids differ run to run), or a merge naming a token that is not
  // in the vocabulary.
  static absl::StatusOr<std::unique_ptr<BpeModel>> Build(const nlohmann::json& config);

  // Appends the ids of `word` (one pre-tokenized piece) to `ids`.
  void Tokenize(std::string_view word, std::vector<int32_t>* ids) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  // Null when `id` is not in the vocabulary.
  const std::string* IdToToken(int32_t id) const;
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }

 private:
  BpeModel() = default;
  // The merge loop: lowest rank first, leftmost first among equal ranks, as HF's merge_word.
  void MergeWord(std::string_view word, std::vector<int32_t>* ids) const;
  void AppendSymbol(std::string_view piece, bool first, bool last, std::vector<int32_t>* symbols,
                    std::optional<int32_t>* pending_unk) const;

  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_id_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  int32_t byte_ids_[256];  // "<0xNN>" ids for byte fallback, -1 where the vocabulary lacks one
  bool all_bytes_present_ = false;

  // Words seen before, to their ids: prompts repeat words, and merging is the costly step.
  // Bounded: once a shard is full, new words are merged without being cached. Sharded with
  // std::mutex rather than one absl::Mutex: a lookup is a few tens of nanoseconds, and the
  // distribution's absl::Mutex (built with deadlock detection) costs more than that per lock.
  static constexpr size_t kCacheShards = 16;
  static constexpr size_t kCacheCapacityPerShard = 1 << 13;
  static constexpr size_t kMaxCachedWordBytes = 256;
  struct CacheShard {
    std::mutex mu;
    absl::flat_hash_map<std::string, std::vector<int32_t>> words;  // guarded by mu
  };
  std::unique_ptr<CacheShard[]> cache_ = std::make_unique<CacheShard[]>(kCacheShards);
};

}  // namespace moe::text::internal

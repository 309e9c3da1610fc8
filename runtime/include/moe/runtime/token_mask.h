// TokenMask: the token ids one sampling row may draw (structured outputs), one bit per id. The
// sampler sets every other logit to -infinity before it draws, greedy or sampled, so the draw is
// the one the unconstrained sampler would make over the allowed tokens alone.
//
// Thread-safety: immutable once made; shared by plans, their copies and the threads that sample.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <vector>

namespace moe::runtime {

class TokenMask {
 public:
  // `words`: bit (id % 32) of words[id / 32] is set when token `id` is allowed.
  explicit TokenMask(std::vector<uint32_t> words) : words_(std::move(words)) {}
  bool allows(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id / 32) < words_.size() && ((words_[id / 32] >> (id % 32)) & 1u) != 0;
  }
  const std::vector<uint32_t>& words() const { return words_; }
  // How many ids below `vocab` it allows.
  int Count(int vocab) const;
  // Sets logits[i] to -infinity for every i < vocab the mask does not allow.
  void Apply(float* logits, int vocab) const;

 private:
  std::vector<uint32_t> words_;
};

// A mask that may still be being computed (beside the step's forward pass); get() waits for it.
using PendingTokenMask = std::shared_future<std::shared_ptr<const TokenMask>>;

// A mask that is ready now.
inline PendingTokenMask ReadyTokenMask(std::shared_ptr<const TokenMask> mask) {
  std::promise<std::shared_ptr<const TokenMask>> p;
  p.set_value(std::move(mask));
  return p.get_future().share();
}

}  // namespace moe::runtime

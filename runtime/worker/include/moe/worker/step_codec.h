// Step plans on the control stream (proto/moeserve/v1/worker.proto), sent as what changed since the
// last step: the frontend's PlanEncoder and every worker's PlanDecoder keep the same mirror of the
// live sequences (their block tables, and on the worker the tokens fed so far, which are the
// penalties' history: a row that draws position p reads the first p), so a plan carries new
// sequences whole, and for the others only their new tokens and appended blocks, and the ids of
// the sequences that ended.
//
// Thread-safety: none; each is used by one thread (the engine's, or the worker's stream).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/runtime/executor.h"
#include "moeserve/v1/worker.pb.h"

namespace moe::worker {

class PlanEncoder {
 public:
  // The request for `plan`, and the mirror updated as the decoder will update its own.
  // kInvalidArgument for a chunk without a sequence id (SequenceChunk::seq_id).
  absl::StatusOr<moeserve::v1::StepRequest> Encode(const runtime::StepPlan& plan);
  // Forgets every sequence (the workers were restarted with empty mirrors).
  void Reset() { sequences_.clear(); }
  size_t live_sequences() const { return sequences_.size(); }

 private:
  std::map<uint64_t, std::vector<int32_t>> sequences_;  // seq_id -> block table
  uint64_t step_ = 0;
};

class PlanDecoder {
 public:
  // The plan `request` describes. A sequence may start below the mirror's length (a rollback:
  // the mirror forgets the tokens from there on, rejected drafts), and one not seen before may
  // start later when its prefix comes with it. kInvalidArgument naming the field for a request
  // that does not fit the mirror (an unknown sequence continued without its prefix, tokens that
  // start beyond where the sequence left off, sampling rows that do not match the logit rows);
  // the mirror is then unchanged.
  absl::StatusOr<runtime::StepPlan> Decode(const moeserve::v1::StepRequest& request);
  size_t live_sequences() const { return sequences_.size(); }

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    std::vector<int32_t> tokens;  // every token fed so far, in position order
  };
  std::map<uint64_t, Sequence> sequences_;
};

// SequenceResult <-> its message, for the rank that samples and the frontend.
moeserve::v1::SequenceResult ToProto(const runtime::SequenceResult& result);
runtime::SequenceResult FromProto(const moeserve::v1::SequenceResult& result);

}  // namespace moe::worker

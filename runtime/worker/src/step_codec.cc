#include "moe/worker/step_codec.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe::worker {

namespace pb = ::moeserve::v1;

namespace {

// A sampling row as the plan had it, its history aside.
runtime::SampleRow RowFromSpec(const pb::SamplingSpec& s) {
  runtime::SampleRow r;
  r.sampling.temperature = s.temperature();
  r.sampling.top_k = s.top_k();
  r.sampling.top_p = s.top_p();
  r.sampling.min_p = s.min_p();
  r.sampling.repetition_penalty = s.repetition_penalty();
  r.sampling.presence_penalty = s.presence_penalty();
  r.sampling.frequency_penalty = s.frequency_penalty();
  r.seed = s.seed();
  r.sequence = s.sequence();
  r.position = s.position();
  r.prompt_len = s.prompt_len();
  r.logprobs = s.logprobs();
  if (s.has_allowed_tokens()) {
    std::vector<uint32_t> words((s.allowed_tokens().size() + 3) / 4, 0);
    std::memcpy(words.data(), s.allowed_tokens().data(), s.allowed_tokens().size());
    r.allowed = runtime::ReadyTokenMask(std::make_shared<const runtime::TokenMask>(std::move(words)));
  }
  return r;
}

}  // namespace

absl::StatusOr<pb::StepRequest> PlanEncoder::Encode(const runtime::StepPlan& plan) {
  pb::StepRequest req;
  req.set_step(++step_);
  for (uint64_t seq_id : plan.released) {
    sequences_.erase(seq_id);
    req.add_released(seq_id);
  }
  size_t row = 0;
  for (size_t i = 0; i < plan.batch.sequences.size(); ++i) {
    const runtime::SequenceChunk& c = plan.batch.sequences[i];
    if (c.seq_id == 0) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: sequence ", i, " has no id (seq_id)"));
    }
    pb::SequenceStep* s = req.add_sequences();
    s->set_id(c.seq_id);  // the wire's name for seq_id
    s->set_first_position(c.first_position);
    s->mutable_token_ids()->Add(plan.batch.token_ids.begin() + row, plan.batch.token_ids.begin() + row + c.num_tokens);
    row += c.num_tokens;
    auto [it, added] = sequences_.try_emplace(c.seq_id);
    std::vector<int32_t>& mirror = it->second;
    const bool appended = !added && c.first_position != 0 && mirror.size() <= c.block_table.size() &&
                          std::equal(mirror.begin(), mirror.end(), c.block_table.begin());
    if (appended) {
      s->mutable_blocks()->Add(c.block_table.begin() + mirror.size(), c.block_table.end());
      mirror.insert(mirror.end(), c.block_table.begin() + mirror.size(), c.block_table.end());
    } else {
      s->set_replace_blocks(true);
      s->mutable_blocks()->Add(c.block_table.begin(), c.block_table.end());
      mirror = c.block_table;
    }
    for (const std::vector<int32_t>& table : c.more_block_tables) {
      s->add_more_block_tables()->mutable_blocks()->Add(table.begin(), table.end());
    }
    s->set_num_draft(c.num_draft);
    s->mutable_prefix()->Add(c.prefix.begin(), c.prefix.end());
    if (c.state_slot >= 0) s->set_state_slot(c.state_slot);
    s->set_want_drafts(c.want_drafts);
  }
  req.mutable_logit_rows()->Add(plan.batch.logit_rows.begin(), plan.batch.logit_rows.end());
  for (const runtime::SampleRow& r : plan.samples) {
    pb::SamplingSpec* s = req.add_samples();
    s->set_temperature(r.sampling.temperature);
    s->set_top_k(r.sampling.top_k);
    s->set_top_p(r.sampling.top_p);
    s->set_min_p(r.sampling.min_p);
    s->set_repetition_penalty(r.sampling.repetition_penalty);
    s->set_presence_penalty(r.sampling.presence_penalty);
    s->set_frequency_penalty(r.sampling.frequency_penalty);
    s->set_seed(r.seed);
    s->set_sequence(r.sequence);
    s->set_position(r.position);
    s->set_prompt_len(r.prompt_len);
    s->set_logprobs(r.logprobs);
    if (r.allowed.valid()) {  // a mask still being computed is waited for here
      const std::shared_ptr<const runtime::TokenMask> mask = r.allowed.get();
      if (mask != nullptr) {
        s->set_allowed_tokens(reinterpret_cast<const char*>(mask->words().data()), mask->words().size() * 4);
      }
    }
  }
  return req;
}

absl::StatusOr<runtime::StepPlan> PlanDecoder::Decode(const pb::StepRequest& req) {
  // Everything is checked against the mirror first, so that a bad request changes nothing; then the
  // mirror's sequences grow in place.
  std::set<uint64_t> seen;
  int64_t rows = 0;
  for (const pb::SequenceStep& s : req.sequences()) {
    const uint64_t seq_id = s.id();  // the wire's `id` is the plan's seq_id
    if (!seen.insert(seq_id).second) {
      return absl::InvalidArgumentError(absl::StrCat("step ", req.step(), ": sequence ", seq_id, " twice"));
    }
    rows += s.token_ids_size();
    if (s.first_position() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", req.step(), ": sequence ", seq_id, " starts at position ", s.first_position()));
    }
    if (s.first_position() == 0) continue;  // a new sequence (or one started again)
    if (s.prefix_size() > 0) {              // a sequence that starts on a cached prefix
      if (s.prefix_size() != s.first_position()) {
        return absl::InvalidArgumentError(absl::StrCat("step ", req.step(), ": sequence ", seq_id,
                                                       " starts at position ", s.first_position(), " with a prefix of ",
                                                       s.prefix_size(), " tokens"));
      }
      continue;
    }
    auto it = sequences_.find(seq_id);
    if (it == sequences_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("step ", req.step(), ": sequence ", seq_id,
                                                     " continues at position ", s.first_position(),
                                                     " but this worker has not seen it (and no prefix came)"));
    }
    // Below the mirror's length is a rollback (rejected drafts); beyond it, tokens went missing.
    if (static_cast<int64_t>(it->second.tokens.size()) < s.first_position()) {
      return absl::InvalidArgumentError(absl::StrCat("step ", req.step(), ": sequence ", seq_id,
                                                     " continues at position ", s.first_position(), " but has ",
                                                     it->second.tokens.size(), " tokens"));
    }
  }
  if (req.samples_size() != req.logit_rows_size()) {
    return absl::InvalidArgumentError(absl::StrCat("step ", req.step(), ": ", req.samples_size(), " sampling rows for ",
                                                   req.logit_rows_size(), " logit rows"));
  }
  // For a penalized row, the history is the sequence's tokens before the position it draws, so that
  // position can be at most the row's own position plus one.
  std::vector<int64_t> row_end;  // per row of the batch: its position + 1
  row_end.reserve(static_cast<size_t>(rows));
  for (const pb::SequenceStep& s : req.sequences()) {
    for (int i = 0; i < s.token_ids_size(); ++i) row_end.push_back(s.first_position() + i + 1);
  }
  for (int i = 0; i < req.logit_rows_size(); ++i) {
    const int32_t row = req.logit_rows(i);
    if (row < 0 || row >= rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", req.step(), ": logit row ", row, " outside [0, ", rows, ")"));
    }
    const runtime::SampleRow sample = RowFromSpec(req.samples(i));
    if (sample.sampling.penalized() && sample.position > row_end[row]) {
      return absl::InvalidArgumentError(absl::StrCat("step ", req.step(), ": penalized sampling row ", i,
                                                     " draws position ", sample.position, " from logit row ", row,
                                                     ", which holds position ", row_end[row] - 1));
    }
  }

  runtime::StepPlan plan;
  std::vector<const Sequence*> row_sequence;  // the sequence of each row of the batch
  row_sequence.reserve(static_cast<size_t>(rows));
  for (const pb::SequenceStep& s : req.sequences()) {
    const uint64_t seq_id = s.id();
    Sequence& seq = sequences_[seq_id];
    if (s.prefix_size() > 0) {
      seq.tokens.assign(s.prefix().begin(), s.prefix().end());
    } else {
      seq.tokens.resize(static_cast<size_t>(s.first_position()));  // from 0, anew; below, a rollback
    }
    if (s.replace_blocks() || s.first_position() == 0) seq.blocks.clear();
    seq.blocks.insert(seq.blocks.end(), s.blocks().begin(), s.blocks().end());
    seq.tokens.insert(seq.tokens.end(), s.token_ids().begin(), s.token_ids().end());
    plan.batch.token_ids.insert(plan.batch.token_ids.end(), s.token_ids().begin(), s.token_ids().end());
    runtime::SequenceChunk& chunk = plan.batch.sequences.emplace_back();
    chunk.first_position = s.first_position();
    chunk.num_tokens = s.token_ids_size();
    chunk.block_table = seq.blocks;
    chunk.seq_id = seq_id;
    for (const pb::BlockTable& table : s.more_block_tables()) {
      chunk.more_block_tables.emplace_back(table.blocks().begin(), table.blocks().end());
    }
    chunk.num_draft = s.num_draft();
    chunk.prefix.assign(s.prefix().begin(), s.prefix().end());
    chunk.state_slot = s.has_state_slot() ? s.state_slot() : -1;
    chunk.want_drafts = s.want_drafts();
    row_sequence.insert(row_sequence.end(), s.token_ids_size(), &seq);
  }
  plan.batch.logit_rows.assign(req.logit_rows().begin(), req.logit_rows().end());
  for (int i = 0; i < req.samples_size(); ++i) {
    runtime::SampleRow r = RowFromSpec(req.samples(i));
    // The penalties read the sequence's tokens before the position this row draws: in a step
    // with several rows of one sequence, each row sees only the tokens before it.
    if (r.sampling.penalized()) {
      const std::vector<int32_t>& tokens = row_sequence[req.logit_rows(i)]->tokens;
      r.history.assign(tokens.begin(), tokens.begin() + r.position);
    }
    plan.samples.push_back(std::move(r));
  }
  for (uint64_t seq_id : req.released()) {
    sequences_.erase(seq_id);
    plan.released.push_back(seq_id);
  }
  return plan;
}

pb::SequenceResult ToProto(const runtime::SequenceResult& result) {
  pb::SequenceResult r;
  for (size_t i = 0; i < result.tokens.size(); ++i) {
    pb::SampledTokenResult* t = r.add_tokens();
    t->set_token(result.tokens[i]);
    if (i < result.logprobs.size() && result.logprobs[i]) {
      const runtime::TokenLogprobs& lp = *result.logprobs[i];
      t->set_has_logprobs(true);
      t->set_logprob(lp.logprob);
      for (const auto& [id, logprob] : lp.top) {
        pb::AlternativeLogprob* alt = t->add_top();
        alt->set_token(id);
        alt->set_logprob(logprob);
      }
    }
  }
  r.set_drafted(result.drafted);
  r.set_accepted(result.accepted);
  r.mutable_drafts()->Add(result.drafts.begin(), result.drafts.end());
  if (!result.error.ok()) {
    r.set_error_code(static_cast<int32_t>(result.error.code()));
    r.set_error(std::string(result.error.message()));
  }
  return r;
}

runtime::SequenceResult FromProto(const pb::SequenceResult& r) {
  runtime::SequenceResult result;
  for (const pb::SampledTokenResult& t : r.tokens()) {
    result.tokens.push_back(t.token());
    std::optional<runtime::TokenLogprobs>& lp = result.logprobs.emplace_back();
    if (t.has_logprobs()) {
      lp.emplace();
      lp->logprob = t.logprob();
      for (const pb::AlternativeLogprob& alt : t.top()) lp->top.emplace_back(alt.token(), alt.logprob());
    }
  }
  result.drafted = r.drafted();
  result.accepted = r.accepted();
  result.drafts.assign(r.drafts().begin(), r.drafts().end());
  if (r.error_code() != 0) result.error = absl::Status(static_cast<absl::StatusCode>(r.error_code()), r.error());
  return result;
}

}  // namespace moe::worker

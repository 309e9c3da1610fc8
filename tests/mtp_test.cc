// The MTP (nextn) head of glm4_moe as a drafter: the head's math on its weights, and drafts from it
// that change nothing (greedy and seeded, alone and in a batch with a plain sequence and a cancel,
// every KV block back at the end). The fixture's config declares one nextn layer that transformers
// did not save; the tests write it into a copy: the last decoder layer's tensors under the nextn
// layer's id, and random norms, eh_proj and shared_head.
#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"
#include "moe/runtime/checkpoint.h"
#include "moe/runtime/model_executor.h"
#include "moe/runtime/mtp_executor.h"
#include "moe/runtime/weight_source.h"
#include "moe/scheduler/frontend.h"
#include "moe/scheduler/http_server.h"
#include "moe/scheduler/scheduler.h"
#include "nlohmann/json.hpp"
#include "test_util.h"

namespace moe {
namespace {

using ::nlohmann::json;

// Values of `n` elements of `dtype` drawn from N(mean, stddev).
std::string RandomValues(core::DType dtype, int64_t n, float mean, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> dist(mean, stddev);
  std::string bytes(static_cast<size_t>(n * core::DTypeSize(dtype)), '\0');
  for (int64_t i = 0; i < n; ++i) {
    const float v = dist(rng);
    if (dtype == core::DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    } else {
      const uint16_t b = core::FloatToBf16(v);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    }
  }
  return bytes;
}

// A copy of the glm4_moe fixture at `dir` with its nextn layer: the last decoder layer's tensors
// under the layer's id, and random enorm, hnorm, eh_proj, shared_head.norm (and shared_head.head
// when `own_head`; else the model's LM head serves).
void WriteGlmWithMtpHead(const std::string& dir, bool own_head, uint32_t seed = 7) {
  testing::CopyFixture("glm4_moe", dir);
  auto checkpoint = runtime::OpenCheckpoint(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const runtime::ModelSpec spec = (*checkpoint)->spec();
  checkpoint->reset();
  ASSERT_EQ(spec.num_nextn_layers, 1);
  const std::string last = absl::StrCat("model.layers.", spec.num_layers - 1, ".");
  const std::string nextn = absl::StrCat("model.layers.", spec.num_layers, ".");
  auto source = runtime::OpenSafetensorsFile(dir + "/model.safetensors");
  ASSERT_TRUE(source.ok()) << source.status();
  std::vector<runtime::TensorEntry> entries;
  std::vector<std::string> bytes;
  std::mt19937 rng(seed);
  core::DType dtype = core::DType::kBF16;
  for (const std::string& name : (*source)->Names()) {
    auto view = (*source)->Get(name);
    entries.push_back(runtime::TensorEntry{name, view->dtype, view->shape});
    bytes.emplace_back(static_cast<const char*>(view->data), view->bytes());
    if (name.rfind(last, 0) == 0) {
      entries.push_back(runtime::TensorEntry{nextn + name.substr(last.size()), view->dtype, view->shape});
      bytes.push_back(bytes.back());
    }
    if (name == "model.norm.weight") dtype = view->dtype;
  }
  const int64_t h = spec.hidden_size;
  auto add = [&](const std::string& name, core::Shape shape, float mean, float stddev) {
    entries.push_back(runtime::TensorEntry{nextn + name, dtype, shape});
    bytes.push_back(RandomValues(dtype, core::NumElements(shape), mean, stddev, rng));
  };
  add("enorm.weight", core::Shape({h}), 1.0f, 0.1f);
  add("hnorm.weight", core::Shape({h}), 1.0f, 0.1f);
  add("eh_proj.weight", core::Shape({h, 2 * h}), 0.0f, 0.05f);
  add("shared_head.norm.weight", core::Shape({h}), 1.0f, 0.1f);
  if (own_head) add("shared_head.head.weight", core::Shape({spec.vocab_size, h}), 0.0f, 0.05f);
  source->reset();
  auto writer = runtime::SafetensorsWriter::Create(dir + "/model.safetensors", entries);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (size_t i = 0; i < entries.size(); ++i) std::memcpy(writer->data(i), bytes[i].data(), bytes[i].size());
  ASSERT_TRUE(writer->Finish().ok());
}

runtime::ModelOptions Options(bool head) {
  runtime::ModelOptions options;
  options.pool.progress = false;
  options.threads = 2;
  options.pool.threads = 2;
  options.nextn_head = head;
  return options;
}

// A tensor of the checkpoint as floats.
std::vector<float> Floats(const runtime::Checkpoint& c, runtime::TensorKey key) {
  auto view = c.Get(key);
  EXPECT_TRUE(view.ok()) << view.status();
  const core::TensorView t = view->AsTensor();
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    out[i] = t.dtype == core::DType::kF32 ? static_cast<const float*>(t.data)[i]
                                          : core::Bf16ToFloat(static_cast<const uint16_t*>(t.data)[i]);
  }
  return out;
}

std::vector<float> RmsNorm(const float* x, const std::vector<float>& w, float eps) {
  const size_t n = w.size();
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += double{x[i]} * x[i];
  const float scale = 1.0f / std::sqrt(static_cast<float>(sum / n) + eps);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
  return out;
}

// out[r] = sum_c w[r][c] * x[c], w [rows x x.size()].
std::vector<float> MatVec(const std::vector<float>& w, const std::vector<float>& x) {
  const size_t cols = x.size(), rows = w.size() / cols;
  std::vector<float> out(rows);
  for (size_t r = 0; r < rows; ++r) {
    double acc = 0;
    for (size_t c = 0; c < cols; ++c) acc += double{w[r * cols + c]} * x[c];
    out[r] = static_cast<float>(acc);
  }
  return out;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float scale = 0;
  for (float v : want) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-4f * std::max(scale, 1.0f)) << what << " [" << i << "]";
  }
}

// The head's input (eh_proj of the normed embedding and hidden state) and its logits (shared_head
// of its output) equal a plain computation from the checkpoint's tensors; the decoder layer between
// is the forward every layer runs (goldens_test).
TEST(MtpHeadTest, TheHeadsInputAndLogitsAreItsWeightsMath) {
  for (const bool own_head : {true, false}) {
    testing::ScratchDir dir;
    const std::string path = dir / "glm";
    WriteGlmWithMtpHead(path, own_head);
    auto target = runtime::Model::Load(path, Options(false));
    ASSERT_TRUE(target.ok()) << target.status();
    auto head = runtime::Model::Load(path, Options(true));
    ASSERT_TRUE(head.ok()) << head.status();
    const runtime::ModelSpec& s = (*target)->spec();
    const int64_t h = s.hidden_size;
    const std::vector<int32_t> prompt = {3, 17, 250, 9, 41, 5};
    const int n = static_cast<int>(prompt.size());
    // The target's hidden states of every position.
    auto target_cache = (*target)->NewKvCache(8, 4);
    ASSERT_TRUE(target_cache.ok());
    runtime::ForwardBatch batch;
    batch.token_ids = prompt;
    batch.sequences.push_back(runtime::SequenceChunk{0, n, {0, 1}});
    batch.logit_rows = {n - 1};
    batch.want_all_hidden = true;
    auto out = (*target)->ForwardOnDevice(batch, **target_cache);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->hidden.rows, n);
    std::vector<float> hidden(out->hidden.as<float>(), out->hidden.as<float>() + n * h);
    // The head over positions 0..n-2: hidden state i with token i+1.
    std::vector<float> z;
    (*head)->SetStepTap([&](std::string_view what, int layer, const runtime::Tensor& t) {
      if (what == "residual" && layer == s.num_layers) z.assign(t.as<float>(), t.as<float>() + t.numel());
    });
    auto head_cache = (*head)->NewKvCache(8, 4);
    ASSERT_TRUE(head_cache.ok());
    runtime::ForwardBatch step;
    step.token_ids.assign(prompt.begin() + 1, prompt.end());
    step.sequences.push_back(runtime::SequenceChunk{0, n - 1, {0, 1}});
    step.logit_rows = {n - 2};
    step.head_hidden = hidden.data();
    step.want_hidden = true;
    auto head_out = (*head)->ForwardOnDevice(step, **head_cache);
    ASSERT_TRUE(head_out.ok()) << head_out.status();
    std::vector<float> logits(head_out->logits.as<float>(), head_out->logits.as<float>() + s.vocab_size);
    std::vector<float> head_hidden(head_out->hidden.as<float>(), head_out->hidden.as<float>() + h);

    auto checkpoint = runtime::OpenCheckpoint(path);
    ASSERT_TRUE(checkpoint.ok());
    using I = runtime::TensorId;
    const int L = s.num_layers;
    const std::vector<float> embed = Floats(**checkpoint, {I::kEmbedding});
    const std::vector<float> enorm = Floats(**checkpoint, {I::kNextnEmbedNorm, L});
    const std::vector<float> hnorm = Floats(**checkpoint, {I::kNextnHiddenNorm, L});
    const std::vector<float> proj = Floats(**checkpoint, {I::kNextnProj, L});
    const std::vector<float> head_norm = Floats(**checkpoint, {I::kNextnHeadNorm, L});
    const std::vector<float> lm_head =
        own_head ? Floats(**checkpoint, {I::kNextnHead, L})
                 : Floats(**checkpoint, {s.tie_word_embeddings ? I::kEmbedding : I::kLmHead});
    ASSERT_EQ(z.size(), static_cast<size_t>((n - 1) * h));
    for (int i = 0; i < n - 1; ++i) {
      std::vector<float> both = RmsNorm(embed.data() + prompt[i + 1] * h, enorm, s.rms_norm_eps);
      const std::vector<float> g = RmsNorm(hidden.data() + i * h, hnorm, s.rms_norm_eps);
      both.insert(both.end(), g.begin(), g.end());
      ExpectNear(std::vector<float>(z.begin() + i * h, z.begin() + (i + 1) * h), MatVec(proj, both),
                 absl::StrCat("eh_proj input, row ", i));
    }
    ExpectNear(logits, MatVec(lm_head, RmsNorm(head_hidden.data(), head_norm, s.rms_norm_eps)),
               own_head ? "logits (shared_head.head)" : "logits (the model's LM head)");
  }
}

TEST(MtpHeadTest, ACheckpointWithoutTheLayerIsRefused) {
  auto head = runtime::Model::Load(testing::FixtureDir("qwen3_moe"), Options(true));
  ASSERT_FALSE(head.ok());
  EXPECT_THAT(std::string(head.status().message()), ::testing::HasSubstr("has no MTP (nextn) layer"));
  auto glm = runtime::Model::Load(testing::FixtureDir("glm4_moe"), Options(true));
  ASSERT_FALSE(glm.ok());  // declared, not saved
  EXPECT_THAT(std::string(glm.status().message()), ::testing::HasSubstr("enorm"));
}

struct Served {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, scheduler::DraftCounts> drafts;
};

Served RunToEnd(scheduler::Scheduler& s, runtime::Executor& e, const std::string& cancel, int cancel_after) {
  Served served;
  for (int step = 0; step < 4000 && !s.idle(); ++step) {
    for (const scheduler::Output& o : s.Step(e)) {
      std::vector<int32_t>& t = served.tokens[o.id];
      t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished) served.drafts[o.id] = o.drafts;
      if (o.id == cancel && static_cast<int>(t.size()) >= cancel_after && !o.finished) s.Abort(cancel);
    }
  }
  EXPECT_TRUE(s.idle());
  return served;
}

runtime::SamplingParams Sampling(bool seeded, uint64_t seed) {
  runtime::SamplingParams s;
  s.seed = seeded ? seed : 1;
  if (!seeded) return s;
  s.temperature = 0.7f;
  s.top_p = 0.9f;
  s.repetition_penalty = 1.1f;
  s.presence_penalty = 0.2f;
  s.frequency_penalty = 0.1f;
  return s;
}

// Drafts from the head, in a batch of speculating sequences, a plain one and a cancelled one, give
// each request the tokens it gets without drafts, greedy and seeded, alone and together, and leave
// no block held; a long prompt is prefilled in chunks.
TEST(MtpDecodeTest, DraftsFromTheHeadChangeNothing) {
  testing::ScratchDir dir;
  const std::string path = dir / "glm";
  WriteGlmWithMtpHead(path, true);
  auto target = runtime::Model::Load(path, Options(false));
  ASSERT_TRUE(target.ok()) << target.status();
  auto head = runtime::Model::Load(path, Options(true));
  ASSERT_TRUE(head.ok()) << head.status();
  const json golden = testing::LoadGolden("glm4_moe");
  std::vector<std::vector<int32_t>> prompts;
  for (const json& c : golden["cases"]) prompts.push_back(c["prompt_ids"].get<std::vector<int32_t>>());
  std::vector<int32_t> repeated;
  for (int i = 0; i < 6; ++i) repeated.insert(repeated.end(), prompts[0].begin(), prompts[0].end());
  prompts.push_back(repeated);
  auto run = [&](bool mtp, bool seeded, const std::vector<size_t>& which, const std::string& cancel) {
    scheduler::SchedulerConfig c;
    c.num_blocks = 256;
    c.block_size = 4;
    c.max_batch_tokens = 24;  // the long prompt takes several chunks
    c.max_seqs = 4;
    c.vocab_size = (*target)->spec().vocab_size;
    c.context = 512;
    c.max_draft = mtp ? 3 : 0;
    c.draft_type = mtp ? runtime::SpecType::kMtp : runtime::SpecType::kOff;
    c.draft_adaptive = false;
    auto executor = runtime::ModelExecutor::Create(**target, c.num_blocks, c.block_size);
    EXPECT_TRUE(executor.ok());
    std::unique_ptr<runtime::Executor> serving = *std::move(executor);
    if (mtp) {
      auto drafting = runtime::MtpExecutor::Create(
          std::unique_ptr<runtime::ModelExecutor>(static_cast<runtime::ModelExecutor*>(serving.release())), **head,
          c.max_seqs);
      EXPECT_TRUE(drafting.ok()) << drafting.status();
      serving = *std::move(drafting);
    }
    scheduler::Scheduler s(c);
    for (size_t i : which) {
      scheduler::Request q;
      q.id = absl::StrCat("r", i);
      q.prompt = prompts[i];
      q.sampling = Sampling(seeded, 40 + i);
      q.stopping.max_new_tokens = 20;
      q.stopping.ignore_eos = true;
      if (i == 1) q.max_draft = 0;
      EXPECT_TRUE(s.Add(q).ok());
    }
    Served served = RunToEnd(s, *serving, cancel, 4);
    EXPECT_EQ(s.stats().blocks_used, 0) << (mtp ? "mtp" : "off");
    return served;
  };
  std::vector<size_t> all(prompts.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  for (const bool seeded : {false, true}) {
    const std::string how = seeded ? "seeded" : "greedy";
    // Alone: the long prompt's request by itself.
    const Served alone_off = run(false, seeded, {prompts.size() - 1}, "");
    const Served alone_on = run(true, seeded, {prompts.size() - 1}, "");
    EXPECT_EQ(alone_on.tokens, alone_off.tokens) << how << " alone";
    // In a batch.
    const Served want = run(false, seeded, all, "");
    const Served got = run(true, seeded, all, "r2");
    int drafted = 0;
    for (const auto& [id, tokens] : want.tokens) {
      const std::vector<int32_t>& mine = got.tokens.at(id);
      if (id == "r2") {
        EXPECT_TRUE(std::equal(mine.begin(), mine.end(), tokens.begin())) << how << " cancelled";
        continue;
      }
      EXPECT_EQ(mine, tokens) << how << " " << id;
      drafted += got.drafts.at(id).draft_tokens;
      if (id == "r1") EXPECT_EQ(got.drafts.at(id).draft_tokens, 0);
    }
    EXPECT_GT(drafted, 0) << how;
  }
}

// The OpenAI API of a server drafting with the head: each completion (greedy and seeded, several at
// once) has the tokens of the same request with speculation off, and its usage counts the drafts.
TEST(MtpDecodeTest, TheOpenAiApiServesTheSameTokensWithTheHead) {
  testing::ScratchDir dir;
  const std::string path = dir / "glm";
  WriteGlmWithMtpHead(path, true);
  auto target = runtime::Model::Load(path, Options(false));
  ASSERT_TRUE(target.ok()) << target.status();
  auto head = runtime::Model::Load(path, Options(true));
  ASSERT_TRUE(head.ok()) << head.status();
  scheduler::FrontendOptions options;
  options.listen = "127.0.0.1:0";
  options.http_listen = "127.0.0.1:0";
  options.scheduler.max_seqs = 8;
  options.scheduler.max_batch_tokens = 128;
  options.scheduler.context = 1024;
  options.scheduler.max_draft = 3;
  options.scheduler.draft_type = runtime::SpecType::kMtp;
  options.scheduler.draft_adaptive = false;
  options.placement = "test";
  options.model_dir = path;
  auto executor = runtime::ModelExecutor::Create(**target, /*num_blocks=*/512);
  ASSERT_TRUE(executor.ok()) << executor.status();
  auto drafting = runtime::MtpExecutor::Create(*std::move(executor), **head, options.scheduler.max_seqs);
  ASSERT_TRUE(drafting.ok()) << drafting.status();
  auto frontend = scheduler::Frontend::Start(*std::move(drafting), options);
  ASSERT_TRUE(frontend.ok()) << frontend.status();
  httplib::Client http("127.0.0.1", (*frontend)->http_port());
  http.set_read_timeout(std::chrono::seconds(60));
  auto post = [&](const json& body) {
    auto response = http.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(response) << "no response";
    if (!response) return json();
    EXPECT_EQ(response->status, 200) << response->body;
    return json::parse(response->body, nullptr, false);
  };
  const json golden = testing::LoadGolden("glm4_moe");
  int drafted = 0;
  for (const bool seeded : {false, true}) {
    for (const json& c : golden["cases"]) {
      json body = {{"prompt", c["prompt_ids"]}, {"max_tokens", 24}, {"ignore_eos", true}, {"return_token_ids", true}};
      if (seeded) {
        body.update({{"temperature", 0.7}, {"top_p", 0.9}, {"repetition_penalty", 1.1}, {"presence_penalty", 0.2},
                     {"frequency_penalty", 0.1}, {"seed", 21}});
      } else {
        body["temperature"] = 0;
      }
      const json on = post(body);
      body["speculative"] = "off";
      const json off = post(body);
      ASSERT_TRUE(on.contains("choices") && off.contains("choices")) << on << off;
      EXPECT_EQ(on["choices"][0]["token_ids"], off["choices"][0]["token_ids"]) << (seeded ? "seeded" : "greedy");
      const json& details = on["usage"]["completion_tokens_details"];
      drafted += details["accepted_prediction_tokens"].get<int>() + details["rejected_prediction_tokens"].get<int>();
      EXPECT_EQ(off["usage"]["completion_tokens_details"]["rejected_prediction_tokens"], 0);
    }
  }
  EXPECT_GT(drafted, 0);
  (*frontend)->Shutdown();
}

// Runs the plans on `inner`, keeping each step's plan and result.
class RecordingExecutor final : public runtime::Executor {
 public:
  explicit RecordingExecutor(std::unique_ptr<runtime::Executor> inner) : inner_(std::move(inner)) {}
  absl::StatusOr<runtime::StepResult> Execute(const runtime::StepPlan& plan) override {
    auto result = inner_->Execute(plan);
    if (result.ok()) steps.emplace_back(plan, *result);
    return result;
  }
  runtime::KvCapacity kv_capacity() const override { return inner_->kv_capacity(); }
  const runtime::ModelInfo& model_info() const override { return inner_->model_info(); }
  std::string Describe() const override { return inner_->Describe(); }
  std::vector<std::pair<runtime::StepPlan, runtime::StepResult>> steps;

 private:
  std::unique_ptr<runtime::Executor> inner_;
};

// The head's KV cache follows the target's sequence across steps (a prompt prefilled in chunks,
// then verify steps with drafts kept and rejected): every step's first two drafts are what the
// head gives when it is run from scratch over the whole sequence, the target's hidden states from
// one full forward.
TEST(MtpDecodeTest, TheHeadsCacheFollowsTheSequenceAcrossSteps) {
  testing::ScratchDir dir;
  const std::string path = dir / "glm";
  WriteGlmWithMtpHead(path, true);
  auto target = runtime::Model::Load(path, Options(false));
  ASSERT_TRUE(target.ok()) << target.status();
  auto head = runtime::Model::Load(path, Options(true));
  ASSERT_TRUE(head.ok()) << head.status();
  const int64_t h = (*target)->spec().hidden_size;
  const int vocab = (*target)->spec().vocab_size;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 30; ++i) prompt.push_back((i * 37 + 11) % 200 + 3);
  scheduler::SchedulerConfig c;
  c.num_blocks = 64;
  c.block_size = 4;
  c.max_batch_tokens = 8;  // the prompt takes four chunks
  c.max_seqs = 2;
  c.vocab_size = vocab;
  c.context = 256;
  c.max_draft = 3;
  c.draft_type = runtime::SpecType::kMtp;
  c.draft_adaptive = false;
  auto executor = runtime::ModelExecutor::Create(**target, c.num_blocks, c.block_size);
  ASSERT_TRUE(executor.ok());
  auto drafting = runtime::MtpExecutor::Create(*std::move(executor), **head, c.max_seqs);
  ASSERT_TRUE(drafting.ok()) << drafting.status();
  RecordingExecutor recording(*std::move(drafting));
  scheduler::Scheduler s(c);
  scheduler::Request q;
  q.id = "r";
  q.prompt = prompt;
  q.sampling = Sampling(true, 5);
  q.stopping.max_new_tokens = 16;
  q.stopping.ignore_eos = true;
  ASSERT_TRUE(s.Add(q).ok());
  RunToEnd(s, recording, "", 0);
  // The head from scratch over `seq`: its greedy token after the last position, and after that
  // token fed back with the head's own hidden state. Each is checked by its logit being the
  // largest within fp32 rounding of a different summation order.
  std::vector<int32_t> seq = prompt;
  int checked = 0;
  for (const auto& [plan, result] : recording.steps) {
    if (result.sequences.empty()) continue;
    const runtime::SequenceResult& r = result.sequences[0];
    seq.insert(seq.end(), r.tokens.begin(), r.tokens.end());
    if (r.drafts.size() < 2) continue;
    const int n = static_cast<int>(seq.size());
    std::vector<int32_t> table;
    for (int b = 0; b < 32; ++b) table.push_back(b);
    auto target_cache = (*target)->NewKvCache(32, 4);
    auto head_cache = (*head)->NewKvCache(32, 4);
    ASSERT_TRUE(target_cache.ok() && head_cache.ok());
    runtime::ForwardBatch full;
    full.token_ids.assign(seq.begin(), seq.end() - 1);
    full.sequences.push_back(runtime::SequenceChunk{0, n - 1, table});
    full.want_all_hidden = true;
    auto out = (*target)->ForwardOnDevice(full, **target_cache);
    ASSERT_TRUE(out.ok()) << out.status();
    const std::vector<float> hidden(out->hidden.as<float>(), out->hidden.as<float>() + (n - 1) * h);
    runtime::ForwardBatch step;
    step.token_ids.assign(seq.begin() + 1, seq.end());
    step.sequences.push_back(runtime::SequenceChunk{0, n - 1, table});
    step.logit_rows = {n - 2};
    step.head_hidden = hidden.data();
    step.want_hidden = true;
    auto first = (*head)->ForwardOnDevice(step, **head_cache);
    ASSERT_TRUE(first.ok()) << first.status();
    auto expect_greedy = [&](const runtime::Tensor& logits, int32_t draft, const std::string& what) {
      const float* l = logits.as<float>();
      const float best = *std::max_element(l, l + vocab);
      EXPECT_NEAR(l[draft], best, 1e-3f * std::max(1.0f, std::abs(best))) << what << " at length " << n;
    };
    expect_greedy(first->logits, r.drafts[0], "first draft");
    const std::vector<float> own(first->hidden.as<float>(), first->hidden.as<float>() + h);
    runtime::ForwardBatch chained;
    chained.token_ids = {r.drafts[0]};
    chained.sequences.push_back(runtime::SequenceChunk{n - 1, 1, table});
    chained.logit_rows = {0};
    chained.head_hidden = own.data();
    auto second = (*head)->ForwardOnDevice(chained, **head_cache);
    ASSERT_TRUE(second.ok()) << second.status();
    expect_greedy(second->logits, r.drafts[1], "second draft");
    ++checked;
  }
  EXPECT_GT(checked, 5);
}

}  // namespace
}  // namespace moe

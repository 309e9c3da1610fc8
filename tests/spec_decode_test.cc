// Speculative decoding changes nothing but the steps: n-gram drafts verified by the target's own
// sampler give the tokens of decoding without drafts, greedy and seeded (temperature, top-p,
// penalties), on every fixture architecture, alone and in batches of speculating and plain
// sequences, through Generate, the scheduler, gRPC, the OpenAI API, `moeserve generate` and
// `serve --config` with a tensor split over Gloo workers. The prompts repeat themselves, so drafts
// are both kept and rejected, and every test checks that both happened. Rejected drafts and
// cancelled requests leave no KV block held.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/experts/arena.h"
#include "moe/runtime/draft_model_executor.h"
#include "moe/runtime/generate.h"
#include "moe/runtime/model_executor.h"
#include "moe/runtime/weight_source.h"
#include "moe/scheduler/frontend.h"
#include "moe/scheduler/http_server.h"
#include "moe/scheduler/scheduler.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "test_util.h"

namespace moe {
namespace {

namespace pb = ::moeserve::v1;
using ::nlohmann::json;
using ::testing::HasSubstr;

const char* const kArchitectures[] = {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"};

std::unique_ptr<runtime::Model> LoadFixture(const std::string& arch) {
  runtime::ModelOptions options;
  options.pool.progress = false;
  options.threads = 2;
  options.pool.threads = 2;
  auto model = runtime::Model::Load(testing::FixtureDir(arch), options);
  EXPECT_TRUE(model.ok()) << arch << ": " << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

// The goldens' prompts, and one that repeats itself (the first prompt three times), where n-grams
// find matches from the first step.
std::vector<std::vector<int32_t>> Prompts(const std::string& arch) {
  const json golden = testing::LoadGolden(arch);
  std::vector<std::vector<int32_t>> prompts;
  for (const json& c : golden["cases"]) prompts.push_back(c["prompt_ids"].get<std::vector<int32_t>>());
  std::vector<int32_t> repeated;
  for (int i = 0; i < 3; ++i) repeated.insert(repeated.end(), prompts[0].begin(), prompts[0].end());
  prompts.push_back(repeated);
  return prompts;
}

// Seeded sampling with every filter and penalty the sampler has.
runtime::SamplingParams Seeded(uint64_t seed) {
  runtime::SamplingParams s;
  s.temperature = 0.7f;
  s.top_p = 0.9f;
  s.repetition_penalty = 1.1f;
  s.presence_penalty = 0.2f;
  s.frequency_penalty = 0.1f;
  s.seed = seed;
  return s;
}

runtime::SamplingParams Greedy() {
  runtime::SamplingParams s;
  s.seed = 1;
  return s;
}

TEST(SpecDecodeTest, GenerateWithNgramDraftsChangesNothingOnEveryArchitecture) {
  for (const std::string arch : kArchitectures) {
    auto model = LoadFixture(arch);
    ASSERT_NE(model, nullptr);
    int drafted = 0, accepted = 0;
    for (const std::vector<int32_t>& prompt : Prompts(arch)) {
      for (const runtime::SamplingParams& sampling : {Greedy(), Seeded(11)}) {
        runtime::GenerateOptions plain;
        plain.max_new_tokens = 40;
        plain.stop_at_eos = false;
        plain.sampling = sampling;
        auto want = runtime::Generate(*model, prompt, plain);
        ASSERT_TRUE(want.ok()) << want.status();
        for (const bool adaptive : {false, true}) {
          runtime::GenerateOptions spec = plain;
          spec.speculative.type = runtime::SpecType::kNgram;
          spec.speculative.n_max = adaptive ? 4 : 3;
          spec.speculative.adaptive = adaptive;
          auto got = runtime::Generate(*model, prompt, spec);
          ASSERT_TRUE(got.ok()) << got.status();
          EXPECT_EQ(got->generated_ids, want->generated_ids)
              << arch << " temperature " << sampling.temperature << (adaptive ? " adaptive" : "");
          // The adaptive length depends on this machine's step times: only the fixed one is counted.
          if (!adaptive) {
            drafted += got->draft_tokens;
            accepted += got->accepted_draft_tokens;
          }
          EXPECT_EQ(got->decode_steps + got->accepted_draft_tokens, 39) << arch;
        }
      }
    }
    EXPECT_GT(accepted, 0) << arch << ": no draft was ever kept";
    EXPECT_GT(drafted, accepted) << arch << ": no draft was ever rejected";
  }
}

struct Served {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, scheduler::FinishReason> reasons;
  std::map<std::string, scheduler::DraftCounts> drafts;
  int max_blocks_used = 0;
};

// Steps `s` until idle; aborts `cancel` once it has `cancel_after` tokens.
Served RunToEnd(scheduler::Scheduler& s, runtime::Executor& e, const std::string& cancel = "", int cancel_after = 0) {
  Served served;
  for (int step = 0; step < 4000 && !s.idle(); ++step) {
    for (const scheduler::Output& o : s.Step(e)) {
      std::vector<int32_t>& t = served.tokens[o.id];
      t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished) {
        served.reasons[o.id] = *o.finished;
        served.drafts[o.id] = o.drafts;
      }
      if (o.id == cancel && static_cast<int>(t.size()) >= cancel_after && !o.finished) s.Abort(cancel);
    }
    served.max_blocks_used = std::max(served.max_blocks_used, s.stats().blocks_used);
  }
  EXPECT_TRUE(s.idle());
  return served;
}

// A batch of speculating and plain sequences (greedy and seeded, one cancelled on the way) through
// the scheduler gives each request the tokens it gets with speculation off, and leaves no block held.
TEST(SpecDecodeTest, MixedBatchesThroughTheSchedulerChangeNothingAndFreeEveryBlock) {
  for (const std::string arch : kArchitectures) {
    auto model = LoadFixture(arch);
    ASSERT_NE(model, nullptr);
    const std::vector<std::vector<int32_t>> prompts = Prompts(arch);
    auto requests = [&] {
      std::vector<scheduler::Request> r;
      for (size_t i = 0; i < prompts.size(); ++i) {
        for (const bool seeded : {false, true}) {
          scheduler::Request q;
          q.id = absl::StrCat(seeded ? "s" : "g", i);
          q.prompt = prompts[i];
          q.sampling = seeded ? Seeded(100 + i) : Greedy();
          q.stopping.max_new_tokens = 24;
          q.stopping.ignore_eos = true;
          if (i == 1) q.max_draft = 0;  // plain, beside the speculating ones
          if (i == 2) q.max_draft = 1;
          r.push_back(q);
        }
      }
      return r;
    };
    for (const bool prefix_cache : {true, false}) {
      auto run = [&](int max_draft, bool adaptive, const std::string& cancel) {
        scheduler::SchedulerConfig c;
        c.num_blocks = 256;
        c.block_size = 4;
        c.max_batch_tokens = 96;
        c.max_seqs = 6;  // some wait, and start while others speculate
        c.vocab_size = model->spec().vocab_size;
        c.context = 512;
        c.prefix_cache = prefix_cache;
        c.max_draft = max_draft;
        c.draft_type = max_draft > 0 ? runtime::SpecType::kNgram : runtime::SpecType::kOff;
        c.draft_adaptive = adaptive;
        auto executor = runtime::ModelExecutor::Create(*model, c.num_blocks, c.block_size);
        EXPECT_TRUE(executor.ok()) << executor.status();
        scheduler::Scheduler s(c);
        for (scheduler::Request& r : requests()) EXPECT_TRUE(s.Add(std::move(r)).ok());
        Served served = RunToEnd(s, **executor, cancel, 5);
        EXPECT_EQ(s.stats().blocks_used, 0) << arch;
        return served;
      };
      const Served want = run(0, false, "");
      for (const bool adaptive : {false, true}) {
        const Served got = run(3, adaptive, "g0");
        int drafted = 0, accepted = 0;
        for (const auto& [id, tokens] : want.tokens) {
          if (id == "g0") {
            // Cancelled once it had 5 tokens: what it got is where the whole run starts.
            EXPECT_EQ(got.reasons.at(id), scheduler::FinishReason::kAborted);
            ASSERT_GE(got.tokens.at(id).size(), 5u);
            EXPECT_TRUE(std::equal(got.tokens.at(id).begin(), got.tokens.at(id).end(), tokens.begin())) << arch;
            continue;
          }
          EXPECT_EQ(got.tokens.at(id), tokens) << arch << " " << id << (adaptive ? " adaptive" : "");
          EXPECT_EQ(got.reasons.at(id), scheduler::FinishReason::kLength) << arch << " " << id;
          const scheduler::DraftCounts& d = got.drafts.at(id);
          if (id == "g1" || id == "s1") {
            EXPECT_EQ(d.draft_tokens, 0) << id << " asked for no drafts";
          }
          if (id == "g2" || id == "s2") {
            EXPECT_LE(d.draft_tokens, d.drafts) << id << " asked for 1 draft a step";
          }
          drafted += d.draft_tokens;
          accepted += d.accepted;
        }
        // The adaptive length depends on this machine's step times: it may draft little or nothing.
        if (!adaptive) {
          EXPECT_GT(accepted, 0) << arch << ": no draft was ever kept";
          EXPECT_GT(drafted, accepted) << arch << ": no draft was ever rejected";
        }
      }
    }
  }
}

// The scheduler gives back the blocks it took for rejected drafts in the step that rejects them.
TEST(SpecDecodeTest, RejectedDraftsBlocksGoBackTheSameStep) {
  auto model = LoadFixture("qwen3_moe");
  ASSERT_NE(model, nullptr);
  // Drafts always wrong and long enough to need blocks of their own.
  class Wrong : public scheduler::DraftProposer {
   public:
    void Propose(const std::string&, std::span<const int32_t> tokens, int max_draft,
                 std::vector<int32_t>* draft) override {
      for (int i = 0; i < max_draft; ++i) draft->push_back((tokens.back() + 1 + i) % 512);
    }
  } wrong;
  scheduler::SchedulerConfig c;
  c.num_blocks = 64;
  c.block_size = 4;
  c.vocab_size = model->spec().vocab_size;
  c.context = 256;
  c.prefix_cache = false;
  c.max_draft = 8;
  auto executor = runtime::ModelExecutor::Create(*model, c.num_blocks, c.block_size);
  ASSERT_TRUE(executor.ok());
  scheduler::Scheduler s(c);
  s.set_proposer(&wrong);
  scheduler::Request r;
  r.id = "a";
  r.prompt = {1, 2, 3};
  r.stopping.max_new_tokens = 30;
  r.stopping.ignore_eos = true;
  r.sampling = Greedy();
  ASSERT_TRUE(s.Add(r).ok());
  int tokens = 3;
  while (!s.idle()) {
    for (const scheduler::Output& o : s.Step(**executor)) tokens += static_cast<int>(o.new_tokens.size());
    if (s.idle()) break;
    // Blocks for the tokens so far, and none for the 8 rejected drafts of the step.
    EXPECT_EQ(s.stats().blocks_used, (tokens + 3) / 4) << "after " << tokens << " tokens";
  }
  EXPECT_EQ(s.stats().blocks_used, 0);
}

// A draft model beside the target: the fixture itself (greedy: every draft kept; seeded: the
// draft's greedy tokens against the target's samples, some kept and some not) and another
// architecture with the same tokenizer (random weights: nearly all rejected) give the tokens of
// plain decoding,
// in batches of speculating and plain sequences with a cancel, and hold no block at the end.
TEST(SpecDecodeTest, DraftModelsChangeNothing) {
  std::map<std::string, std::unique_ptr<runtime::Model>> models;
  for (const std::string arch : kArchitectures) {
    models[arch] = LoadFixture(arch);
    ASSERT_NE(models[arch], nullptr);
  }
  for (size_t a = 0; a < std::size(kArchitectures); ++a) {
    const std::string arch = kArchitectures[a];
    const std::string other = kArchitectures[(a + 1) % std::size(kArchitectures)];
    runtime::Model& target = *models[arch];
    const std::vector<std::vector<int32_t>> prompts = Prompts(arch);
    auto run = [&](runtime::Model* draft, bool seeded, const std::string& cancel) {
      scheduler::SchedulerConfig c;
      c.num_blocks = 256;
      c.block_size = 4;
      c.max_batch_tokens = 96;
      c.max_seqs = 4;
      c.vocab_size = target.spec().vocab_size;
      c.context = 512;
      c.max_draft = draft != nullptr ? 3 : 0;
      c.draft_type = draft != nullptr ? runtime::SpecType::kDraft : runtime::SpecType::kOff;
      auto executor = runtime::ModelExecutor::Create(target, c.num_blocks, c.block_size);
      EXPECT_TRUE(executor.ok());
      std::unique_ptr<runtime::Executor> serving = *std::move(executor);
      if (draft != nullptr) {
        auto drafting = runtime::DraftModelExecutor::Create(std::move(serving), *draft, c.max_seqs);
        EXPECT_TRUE(drafting.ok()) << drafting.status();
        serving = *std::move(drafting);
      }
      scheduler::Scheduler s(c);
      for (size_t i = 0; i < prompts.size(); ++i) {
        scheduler::Request q;
        q.id = absl::StrCat("r", i);
        q.prompt = prompts[i];
        q.sampling = seeded ? Seeded(40 + i) : Greedy();
        q.stopping.max_new_tokens = 20;
        q.stopping.ignore_eos = true;
        if (i == 1) q.max_draft = 0;
        EXPECT_TRUE(s.Add(q).ok());
      }
      Served served = RunToEnd(s, *serving, cancel, 4);
      EXPECT_EQ(s.stats().blocks_used, 0) << arch;
      return served;
    };
    for (const bool seeded : {false, true}) {
      const Served want = run(nullptr, seeded, "");
      for (runtime::Model* draft : {models[arch].get(), models[other].get()}) {
        const bool self = draft == models[arch].get();
        const Served got = run(draft, seeded, "r2");
        int drafted = 0, accepted = 0;
        for (const auto& [id, tokens] : want.tokens) {
          const std::vector<int32_t>& mine = got.tokens.at(id);
          if (id == "r2") {
            EXPECT_TRUE(std::equal(mine.begin(), mine.end(), tokens.begin())) << arch << " cancelled";
            continue;
          }
          EXPECT_EQ(mine, tokens) << arch << " drafted by " << (self ? arch : other) << (seeded ? " seeded" : "");
          drafted += got.drafts.at(id).draft_tokens;
          accepted += got.drafts.at(id).accepted;
          if (id == "r1") EXPECT_EQ(got.drafts.at(id).draft_tokens, 0);
        }
        EXPECT_GT(drafted, 0) << arch << " drafted by " << (self ? arch : other);
        if (self && !seeded) {
          EXPECT_EQ(accepted, drafted) << arch << ": its own greedy drafts are all kept";
        } else if (self) {
          // Greedy drafts against a sampled target: some agree, some do not.
          EXPECT_GT(accepted, 0) << arch << " seeded";
          EXPECT_GT(drafted, accepted) << arch << " seeded";
        }
      }
    }
  }
}

// With the KV cache nearly full, drafts never cost a preemption: a sequence that always carries 16
// (wrong) drafts beside one that ends early gets its drafts only from blocks the other does not
// need, and both decode as they would without drafts.
TEST(SpecDecodeTest, DraftsNeverPreemptASequence) {
  auto model = LoadFixture("qwen3_moe");
  ASSERT_NE(model, nullptr);
  class Longest : public scheduler::DraftProposer {
   public:
    void Propose(const std::string&, std::span<const int32_t> tokens, int max_draft,
                 std::vector<int32_t>* draft) override {
      for (int i = 0; i < max_draft; ++i) draft->push_back((tokens.back() + 7 * i + 1) % 512);
    }
  } longest;
  auto run = [&](int max_draft) {
    scheduler::SchedulerConfig c;
    // r0 needs 10 blocks at the end and r1 5; r1 ends first, so without drafts they fit in 10.
    c.num_blocks = 10;
    c.block_size = 4;
    c.vocab_size = model->spec().vocab_size;
    c.context = 64;
    c.prefix_cache = false;
    c.max_draft = max_draft;
    auto executor = runtime::ModelExecutor::Create(*model, c.num_blocks, c.block_size);
    EXPECT_TRUE(executor.ok());
    scheduler::Scheduler s(c);
    s.set_proposer(&longest);
    for (int i = 0; i < 2; ++i) {
      scheduler::Request q;
      q.id = absl::StrCat("r", i);
      q.prompt = {1, 2, 3};
      q.sampling = Greedy();
      q.stopping.max_new_tokens = i == 0 ? 36 : 14;
      q.stopping.ignore_eos = true;
      EXPECT_TRUE(s.Add(q).ok());
    }
    Served served = RunToEnd(s, **executor);
    EXPECT_EQ(s.stats().preemptions, 0) << "max_draft " << max_draft;
    EXPECT_EQ(s.stats().blocks_used, 0);
    return served;
  };
  const Served want = run(0);
  const Served got = run(16);
  EXPECT_EQ(got.tokens, want.tokens);
  int drafted = 0;
  for (const auto& [id, d] : got.drafts) drafted += d.draft_tokens;
  EXPECT_GT(drafted, 0);
}

// gRPC and the OpenAI API of one server with n-gram speculation: the same tokens with the
// request's speculation on and off, the counts in the final message, the usage, the request log and
// the metrics.
class SpecServerTest : public ::testing::Test {
 protected:
  void Start(const std::string& arch) {
    model_ = LoadFixture(arch);
    ASSERT_NE(model_, nullptr);
    scheduler::FrontendOptions options;
    options.listen = "127.0.0.1:0";
    options.http_listen = "127.0.0.1:0";
    options.scheduler.max_seqs = 8;
    options.scheduler.max_batch_tokens = 128;
    options.scheduler.context = 1024;
    options.scheduler.max_draft = 3;
    options.scheduler.draft_type = runtime::SpecType::kNgram;
    options.scheduler.draft_adaptive = false;
    options.placement = "test";
    options.model_dir = testing::FixtureDir(arch);
    options.request_log = true;
    auto executor = runtime::ModelExecutor::Create(*model_, /*num_blocks=*/512);
    ASSERT_TRUE(executor.ok()) << executor.status();
    auto frontend = scheduler::Frontend::Start(*std::move(executor), options);
    ASSERT_TRUE(frontend.ok()) << frontend.status();
    frontend_ = std::move(*frontend);
    stub_ = pb::Generation::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", frontend_->port()),
                                                        grpc::InsecureChannelCredentials()));
    http_ = std::make_unique<httplib::Client>("127.0.0.1", frontend_->http_port());
    http_->set_read_timeout(std::chrono::seconds(60));
  }
  void TearDown() override {
    http_.reset();
    if (frontend_) frontend_->Shutdown();
  }

  struct Stream {
    std::vector<int32_t> tokens;
    pb::Usage usage;
    grpc::Status status;
  };
  Stream Generate(const std::vector<int32_t>& prompt, bool seeded, std::optional<int> n_max) {
    pb::GenerateRequest r;
    r.mutable_token_ids()->Add(prompt.begin(), prompt.end());
    r.mutable_stopping()->set_max_new_tokens(32);
    r.mutable_stopping()->set_ignore_eos(true);
    if (seeded) {
      pb::SamplingParams* s = r.mutable_sampling();
      s->set_temperature(0.7f);
      s->set_top_p(0.9f);
      s->set_repetition_penalty(1.1f);
      s->set_presence_penalty(0.2f);
      s->set_frequency_penalty(0.1f);
      s->set_seed(21);
    }
    if (n_max) {
      if (*n_max == 0) {
        r.mutable_speculative()->set_off(true);
      } else {
        r.mutable_speculative()->set_n_max(*n_max);
      }
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub_->Generate(&ctx, r);
    Stream s;
    pb::GenerateResponse msg;
    while (reader->Read(&msg)) {
      s.tokens.insert(s.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
      if (msg.has_usage()) s.usage = msg.usage();
    }
    s.status = reader->Finish();
    return s;
  }

  std::pair<int, json> Post(const std::string& path, const json& body) {
    auto response = http_->Post(path.c_str(), body.dump(), "application/json");
    if (!response) return {-1, json()};
    return {response->status, json::parse(response->body, nullptr, false)};
  }

  std::unique_ptr<runtime::Model> model_;
  std::unique_ptr<scheduler::Frontend> frontend_;
  std::unique_ptr<pb::Generation::Stub> stub_;
  std::unique_ptr<httplib::Client> http_;
};

TEST_F(SpecServerTest, GrpcAndOpenAiServeTheSameTokensAndReportTheDrafts) {
  Start("qwen3_moe");
  ::testing::internal::CaptureStderr();
  int drafted = 0, accepted = 0;
  for (const std::vector<int32_t>& prompt : Prompts("qwen3_moe")) {
    for (const bool seeded : {false, true}) {
      const Stream off = Generate(prompt, seeded, 0);
      ASSERT_TRUE(off.status.ok()) << off.status.error_message();
      EXPECT_EQ(off.usage.draft_tokens(), 0);
      // Concurrent requests, each speculating, so the verify rows share steps.
      std::vector<std::thread> threads;
      std::vector<Stream> on(3);
      for (int i = 0; i < 3; ++i) {
        threads.emplace_back([&, i] { on[i] = Generate(prompt, seeded, i == 0 ? std::nullopt : std::optional(i)); });
      }
      for (std::thread& t : threads) t.join();
      for (int i = 0; i < 3; ++i) {
        ASSERT_TRUE(on[i].status.ok()) << on[i].status.error_message();
        EXPECT_EQ(on[i].tokens, off.tokens) << (seeded ? "seeded" : "greedy") << " n_max " << i;
        EXPECT_LE(on[i].usage.accepted_draft_tokens(), on[i].usage.draft_tokens());
        if (i > 0) {
          EXPECT_LE(on[i].usage.draft_tokens(), i * on[i].usage.spec_drafts());
        }
        drafted += on[i].usage.draft_tokens();
        accepted += on[i].usage.accepted_draft_tokens();
      }
      // The OpenAI API, with the request's speculation on and off.
      json body = {{"prompt", prompt}, {"max_tokens", 32}, {"ignore_eos", true},
                   {"return_token_ids", true}};
      if (seeded) {
        body.update({{"temperature", 0.7}, {"top_p", 0.9}, {"repetition_penalty", 1.1}, {"presence_penalty", 0.2},
                     {"frequency_penalty", 0.1}, {"seed", 21}});
      } else {
        body["temperature"] = 0;
      }
      const auto [status, plain] = Post("/v1/completions", body);
      ASSERT_EQ(status, 200) << plain;
      body["speculative"] = "off";
      const auto [status_off, none] = Post("/v1/completions", body);
      ASSERT_EQ(status_off, 200) << none;
      EXPECT_EQ(plain["choices"][0]["token_ids"].get<std::vector<int32_t>>(), off.tokens);
      EXPECT_EQ(none["choices"][0]["token_ids"].get<std::vector<int32_t>>(), off.tokens);
      const json& details = plain["usage"]["completion_tokens_details"];
      EXPECT_EQ(none["usage"]["completion_tokens_details"]["accepted_prediction_tokens"], 0);
      EXPECT_EQ(none["usage"]["completion_tokens_details"]["rejected_prediction_tokens"], 0);
      drafted += details["accepted_prediction_tokens"].get<int>() + details["rejected_prediction_tokens"].get<int>();
      accepted += details["accepted_prediction_tokens"].get<int>();
    }
  }
  EXPECT_GT(accepted, 0) << "no draft was ever kept";
  EXPECT_GT(drafted, accepted) << "no draft was ever rejected";

  // Bad overrides name the field.
  const auto [bad_status, bad] = Post("/v1/completions", json{{"prompt", {1, 2}}, {"speculative", {{"n_max", 17}}}});
  EXPECT_EQ(bad_status, 400);
  EXPECT_EQ(bad["error"]["param"], "speculative");
  EXPECT_THAT(bad["error"]["message"].get<std::string>(), HasSubstr("speculative.n_max: 17 is not an integer in 0..16"));
  const auto [shape_status, shape] = Post("/v1/completions", json{{"prompt", {1, 2}}, {"speculative", "on"}});
  EXPECT_EQ(shape_status, 400);
  EXPECT_THAT(shape["error"]["message"].get<std::string>(), HasSubstr("expected \"off\" or {\"n_max\": N}"));
  const Stream too_many = Generate({1, 2, 3}, false, 17);
  EXPECT_EQ(too_many.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(too_many.status.error_message(), HasSubstr("speculative.n_max: must be between 0 and 16, got 17"));

  // The request log and the metrics count what the responses reported.
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, HasSubstr("\"accepted_draft_tokens\":"));
  EXPECT_THAT(log, HasSubstr("\"draft_tokens\":"));
  auto metrics = http_->Get("/metrics");
  ASSERT_TRUE(metrics);
  auto counter = [&](const std::string& name) -> int64_t {
    std::smatch m;
    const std::regex line("\n" + std::regex_replace(name, std::regex(R"([{}"])"), R"(\$&)") + " ([0-9]+)\n");
    return std::regex_search(metrics->body, m, line) ? std::stoll(m[1]) : -1;
  };
  EXPECT_EQ(counter("moeserve_spec_decode_num_draft_tokens"), drafted) << metrics->body;
  EXPECT_EQ(counter("moeserve_spec_decode_num_accepted_tokens"), accepted);
  EXPECT_GT(counter("moeserve_spec_decode_num_drafts"), 0);
  const int64_t first = counter("moeserve_spec_decode_num_accepted_tokens_per_pos{position=\"0\"}");
  const int64_t second = counter("moeserve_spec_decode_num_accepted_tokens_per_pos{position=\"1\"}");
  const int64_t third = counter("moeserve_spec_decode_num_accepted_tokens_per_pos{position=\"2\"}");
  EXPECT_GT(first, 0);
  EXPECT_GE(first, second);
  EXPECT_GE(second, third);
  EXPECT_EQ(first + second + third, accepted);
  EXPECT_EQ(counter("moeserve_spec_decode_num_accepted_tokens_per_pos{position=\"3\"}"), -1);
}

// `moeserve generate --spec-type ngram` prints the tokens of --spec-type off, with its counts.
TEST(SpecDecodeCliTest, GenerateWithNgramDraftsPrintsTheSameTokens) {
  // A prompt whose greedy continuation repeats itself (245 nine times).
  const std::vector<int32_t> prompt = Prompts("qwen2_moe")[1];
  int drafted = 0, accepted = 0;
  for (const std::vector<std::string>& sampling :
       {std::vector<std::string>{}, std::vector<std::string>{"--temperature", "0.7", "--top-p", "0.9", "--seed", "5"}}) {
    std::vector<std::string> args = {"generate", "--model", testing::FixtureDir("qwen2_moe"), "--prompt-ids",
                                     absl::StrJoin(prompt, ","), "--max-new-tokens", "40", "--ignore-eos", "--json",
                                     "--threads", "2"};
    args.insert(args.end(), sampling.begin(), sampling.end());
    const testing::CommandResult off = testing::RunMoeserve(args);
    ASSERT_EQ(off.exit_code, 0) << off.err;
    args.insert(args.end(), {"--spec-type", "ngram", "--spec-n-max", "4", "--spec-adaptive", "off"});
    const testing::CommandResult on = testing::RunMoeserve(args);
    ASSERT_EQ(on.exit_code, 0) << on.err;
    const json a = json::parse(off.out), b = json::parse(on.out);
    EXPECT_EQ(a["generated_ids"], b["generated_ids"]);
    EXPECT_EQ(a["draft_tokens"], 0);
    EXPECT_EQ(b["decode_steps"].get<int>() + b["accepted_draft_tokens"].get<int>(), a["decode_steps"].get<int>());
    drafted += b["draft_tokens"].get<int>();
    accepted += b["accepted_draft_tokens"].get<int>();
  }
  EXPECT_GT(accepted, 0) << "no draft was ever kept";
  EXPECT_GT(drafted, accepted) << "no draft was ever rejected";
}

// `bench serve --model DIR --spec-type ngram` starts its server with speculation and reports what
// the drafts were worth, from the final messages.
TEST(SpecDecodeCliTest, BenchServeReportsTheDrafts) {
  const testing::CommandResult r = testing::RunMoeserve(
      {"bench", "serve", "--model", testing::FixtureDir("qwen3_moe"), "--spec-type", "ngram", "--spec-adaptive", "off",
       "--concurrency", "2", "--requests", "4", "--prompt-len", "24", "--prompt-period", "6", "--output-len", "24",
       "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json rows = json::parse(r.out.substr(r.out.find('[')));
  ASSERT_EQ(rows.size(), 1u) << r.out;
  EXPECT_EQ(rows[0]["failed"], 0);
  EXPECT_GT(rows[0]["draft_tokens"].get<int>(), 0) << r.out;
  EXPECT_GT(rows[0]["spec_drafts"].get<int>(), 0);
  EXPECT_LE(rows[0]["accepted_draft_tokens"].get<int>(), rows[0]["draft_tokens"].get<int>());
}

TEST(SpecDecodeCliTest, MethodsNotBuiltAndBadValuesAreRefusedNamingTheFlag) {
  const std::string model = testing::FixtureDir("glm4_moe");
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           // glm4_moe's config declares a nextn layer that transformers left out of the file it saved.
           {{"generate", "--model", model, "--prompt-ids", "1,2", "--spec-type", "mtp"},
            "--spec-type mtp: " + model + " declares 1 MTP (nextn) layer(s) (num_nextn_predict_layers) but its "
            "weights lack layer 4's model.layers.4.enorm.weight, model.layers.4.hnorm.weight, "
            "model.layers.4.eh_proj.weight"},
           {{"serve", "--model", testing::FixtureDir("qwen3_moe"), "--spec-type", "mtp"},
            "has no MTP (nextn) layer: its config.json's num_nextn_predict_layers is 0 (qwen3_moe)"},
           {{"generate", "--model", model, "--prompt-ids", "1,2", "--spec-type", "draft"},
            "type draft needs a draft model (--draft-model DIR)"},
           {{"serve", "--model", model, "--spec-type", "draft", "--draft-model", model, "--draft-device", "cuda:0"},
            "the draft model runs on the CPU backend for now (device cpu), not 'cuda:0'"},
           {{"generate", "--model", model, "--prompt-ids", "1,2", "--draft-model", model},
            "--draft-model needs --spec-type draft (got --spec-type off)"},
           {{"generate", "--model", model, "--prompt-ids", "1,2", "--spec-type", "eagle"}, "--spec-type"},
           {{"serve", "--model", model, "--spec-type", "ngram", "--spec-n-max", "17"}, "--spec-n-max"},
           {{"bench", "serve", "--target", "127.0.0.1:1", "--spec-type", "ngram"},
            "--spec-type sets the speculative decoding of the server --model starts"},
       }) {
    const testing::CommandResult r = testing::RunMoeserve(c.args);
    EXPECT_EQ(r.exit_code, 2) << absl::StrJoin(c.args, " ") << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << absl::StrJoin(c.args, " ");
  }
}

// `serve --config` with a tensor split (and a layer split) over two Gloo workers and the file's
// speculative key: the frontend drafts, both workers verify the rows the plan carries.
class SpecDecodeClusterSplitTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SpecDecodeClusterSplitTest, ServesTheSameTokensWithNgramDrafts) {
  testing::ScratchDir dir;
  const std::string shm = "moeserve-spec-test-" + std::to_string(::getpid()) + "-" + GetParam();
  const std::string path = dir / "cluster.yaml";
  std::ofstream(path) << "model: " << testing::FixtureDir("qwen3_moe") << "\n"
                      << "nodes:\n  - {host: 127.0.0.1, workers: 2}\n"
                      << "parallel: "
                      << (GetParam() == "tensor" ? "{mode: tensor, size: 2}" : "{mode: layer, stages: 2}") << "\n"
                      << "experts:\n  cpu_pool: {dtype: bf16, shm: " << shm << "}\n"
                      << "scheduler: {max_seqs: 8, kv_cache_mb: 64, drain_seconds: 2}\n"
                      << "speculative: {type: ngram, n_max: 3, adaptive: false}\n"
                      << "server: {listen: 127.0.0.1:0, http: 'off'}\n";
  testing::ServeProcess serve({"--config", path});
  ASSERT_GT(serve.port(), 0) << serve.err();
  auto stub = pb::Generation::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", serve.port()), grpc::InsecureChannelCredentials()));
  int drafted = 0, accepted = 0;
  const std::vector<std::vector<int32_t>> prompts = Prompts("qwen3_moe");
  for (const std::vector<int32_t>& prompt : {prompts[0], prompts[1], prompts.back()}) {
    for (const bool seeded : {false, true}) {
      std::vector<int32_t> tokens[2];
      for (const bool off : {true, false}) {
        pb::GenerateRequest r;
        r.mutable_token_ids()->Add(prompt.begin(), prompt.end());
        r.mutable_stopping()->set_max_new_tokens(32);
        r.mutable_stopping()->set_ignore_eos(true);
        if (seeded) {
          r.mutable_sampling()->set_temperature(0.7f);
          r.mutable_sampling()->set_top_p(0.9f);
          r.mutable_sampling()->set_repetition_penalty(1.1f);
          r.mutable_sampling()->set_frequency_penalty(0.1f);
          r.mutable_sampling()->set_seed(3);
        }
        if (off) r.mutable_speculative()->set_off(true);
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
        auto reader = stub->Generate(&ctx, r);
        pb::GenerateResponse msg;
        while (reader->Read(&msg)) {
          tokens[off].insert(tokens[off].end(), msg.token_ids().begin(), msg.token_ids().end());
          if (msg.has_usage() && !off) {
            drafted += msg.usage().draft_tokens();
            accepted += msg.usage().accepted_draft_tokens();
          }
        }
        const grpc::Status status = reader->Finish();
        ASSERT_TRUE(status.ok()) << status.error_message() << "\n" << serve.err();
      }
      EXPECT_EQ(tokens[0], tokens[1]) << (seeded ? "seeded" : "greedy");
      EXPECT_EQ(tokens[1].size(), 32u);
    }
  }
  EXPECT_GT(accepted, 0) << "no draft was ever kept";
  EXPECT_GT(drafted, accepted) << "no draft was ever rejected";
  EXPECT_EQ(serve.Stop(SIGTERM), 0) << serve.err();
  for (const std::string& name : {shm, shm + "-s0", shm + "-s1"}) (void)experts::HostArena::Unlink(name);
}

INSTANTIATE_TEST_SUITE_P(Splits, SpecDecodeClusterSplitTest, ::testing::Values("tensor", "layer"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// A draft model with a shorter context than the sequences reach stops proposing there; the target's
// tokens are served all the same.
TEST(SpecDecodeTest, ADraftModelPastItsContextProposesNothingAndFailsNothing) {
  testing::ScratchDir dir;
  const std::string short_dir = dir / "short";
  testing::CopyFixture("qwen3_moe", short_dir);
  testing::EditConfig(short_dir, [](json& c) { c["max_position_embeddings"] = 24; });
  auto target = LoadFixture("qwen3_moe");
  runtime::ModelOptions options;
  options.pool.progress = false;
  options.threads = 2;
  options.pool.threads = 2;
  auto draft = runtime::Model::Load(short_dir, options);
  ASSERT_TRUE(draft.ok()) << draft.status();
  auto run = [&](bool drafting) {
    scheduler::SchedulerConfig c;
    c.num_blocks = 64;
    c.block_size = 4;
    c.vocab_size = target->spec().vocab_size;
    c.context = 128;
    c.max_draft = drafting ? 3 : 0;
    c.draft_type = drafting ? runtime::SpecType::kDraft : runtime::SpecType::kOff;
    auto executor = runtime::ModelExecutor::Create(*target, c.num_blocks, c.block_size);
    EXPECT_TRUE(executor.ok());
    std::unique_ptr<runtime::Executor> serving = *std::move(executor);
    if (drafting) serving = *runtime::DraftModelExecutor::Create(std::move(serving), **draft, 4);
    scheduler::Scheduler s(c);
    scheduler::Request q;
    q.id = "r";
    q.prompt = Prompts("qwen3_moe")[0];  // 8 tokens, then 40 more: past the draft's 24 positions
    q.sampling = Greedy();
    q.stopping.max_new_tokens = 40;
    q.stopping.ignore_eos = true;
    EXPECT_TRUE(s.Add(q).ok());
    Served served = RunToEnd(s, *serving);
    EXPECT_EQ(served.reasons.at("r"), scheduler::FinishReason::kLength);
    return served;
  };
  const Served want = run(false), got = run(true);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_GT(got.drafts.at("r").accepted, 0);  // it drafted while it could
}

// `inspect --draft-model` plans the draft beside the target: its weights and KV cache in host
// memory, after its vocabulary is checked.
TEST(SpecDecodeCliTest, InspectPlansTheDraftModel) {
  const testing::CommandResult r =
      testing::RunMoeserve({"inspect", "--model", testing::FixtureDir("qwen3_moe"), "--draft-model",
                            testing::FixtureDir("mixtral"), "--gpu-memory-gb", "8", "--read-gbps", "10", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_TRUE(j.contains("draft_model")) << r.out;
  EXPECT_GT(j["draft_model"]["host_weight_bytes"].get<int64_t>(), 0);
  EXPECT_GT(j["draft_model"]["kv_bytes_per_token"].get<int64_t>(), 0);
  EXPECT_EQ(j["draft_model"]["kv_bytes"].get<int64_t>(), j["draft_model"]["kv_bytes_per_token"].get<int64_t>() * 2048);
}

// A draft model whose tokenizer differs from the target's is refused at start, naming the first id
// that differs; `serve --spec-type draft` with the fixture as its own draft serves the same tokens.
TEST(SpecDecodeCliTest, ADraftModelWithAnotherVocabularyIsRefused) {
  testing::ScratchDir dir;
  const std::string draft = dir / "draft";
  testing::CopyFixture("mixtral", draft);
  {
    std::ifstream in(draft + "/tokenizer.json");
    json tokenizer = json::parse(in);
    json& vocab = tokenizer["model"]["vocab"];
    std::string at300, at301;
    for (const auto& [text, id] : vocab.items()) {
      if (id == 300) at300 = text;
      if (id == 301) at301 = text;
    }
    ASSERT_FALSE(at300.empty());
    vocab[at300] = 301;  // two ids swap their texts
    vocab[at301] = 300;
    std::ofstream(draft + "/tokenizer.json") << tokenizer.dump();
  }
  const testing::CommandResult r = testing::RunMoeserve(
      {"serve", "--model", testing::FixtureDir("qwen3_moe"), "--spec-type", "draft", "--draft-model", draft});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--draft-model " + draft + ": token 300 is "));
  EXPECT_THAT(r.err, HasSubstr("a draft model must have the target's vocabulary, token for token"));
  // A draft folder without tokenizer.json cannot be compared.
  std::filesystem::remove(draft + "/tokenizer.json");
  const testing::CommandResult none = testing::RunMoeserve(
      {"serve", "--model", testing::FixtureDir("qwen3_moe"), "--spec-type", "draft", "--draft-model", draft});
  EXPECT_EQ(none.exit_code, 2) << none.err;
  EXPECT_THAT(none.err, HasSubstr("--draft-model: the vocabularies cannot be compared"));
}

// A copy of the glm4_moe fixture with the nextn layer its config declares (layer 4: the last
// decoder layer's tensors under its id, and the head's norms and projection, zero): `bench serve`
// starts its server drafting with the head, and every request completes with drafts verified;
// `generate` prints the tokens it prints without drafts, greedy and seeded. (mtp_test checks the
// tokens through the scheduler and the OpenAI API, and the head's math.)
TEST(SpecDecodeCliTest, AnMtpHeadThatIsPresentDraftsInGenerateAndServe) {
  testing::ScratchDir dir;
  const std::string model = dir / "glm";
  testing::CopyFixture("glm4_moe", model);
  std::vector<runtime::TensorEntry> added;
  testing::RewriteWeights(model, [&](runtime::TensorEntry& e) {
    const std::string layer3 = "model.layers.3.";
    if (e.name.rfind(layer3, 0) == 0) {
      runtime::TensorEntry copy = e;
      copy.name = "model.layers.4." + e.name.substr(layer3.size());
      added.push_back(copy);
    }
    if (e.name == "model.norm.weight") {
      for (const char* name : {"enorm", "hnorm", "shared_head.norm"}) {
        runtime::TensorEntry norm = e;
        norm.name = std::string("model.layers.4.") + name + ".weight";
        added.push_back(norm);
      }
      runtime::TensorEntry proj = e;
      proj.name = "model.layers.4.eh_proj.weight";
      proj.shape = core::Shape({e.shape[0], 2 * e.shape[0]});
      added.push_back(proj);
    }
    return true;
  });
  ASSERT_FALSE(added.empty());
  // Write the fixture's tensors again with the new ones (zero) beside them.
  {
    auto source = runtime::OpenSafetensorsFile(model + "/model.safetensors");
    ASSERT_TRUE(source.ok()) << source.status();
    std::vector<runtime::TensorEntry> entries;
    std::vector<std::string> bytes;
    for (const std::string& name : (*source)->Names()) {
      auto view = (*source)->Get(name);
      entries.push_back(runtime::TensorEntry{name, view->dtype, view->shape});
      bytes.emplace_back(static_cast<const char*>(view->data), view->bytes());
    }
    for (const runtime::TensorEntry& e : added) {
      entries.push_back(e);
      bytes.emplace_back(e.bytes(), '\0');
    }
    source->reset();
    auto writer = runtime::SafetensorsWriter::Create(model + "/model.safetensors", entries);
    ASSERT_TRUE(writer.ok()) << writer.status();
    for (size_t i = 0; i < entries.size(); ++i) std::memcpy(writer->data(i), bytes[i].data(), bytes[i].size());
    ASSERT_TRUE(writer->Finish().ok());
  }
  int drafted = 0;
  for (const std::vector<std::string>& sampling :
       {std::vector<std::string>{}, std::vector<std::string>{"--temperature", "0.7", "--top-p", "0.9", "--seed", "5"}}) {
    std::vector<std::string> args = {"generate", "--model", model, "--prompt-ids", "3,17,250,9,41,5,3,17",
                                     "--max-new-tokens", "24", "--ignore-eos", "--json", "--threads", "2"};
    args.insert(args.end(), sampling.begin(), sampling.end());
    const testing::CommandResult off = testing::RunMoeserve(args);
    ASSERT_EQ(off.exit_code, 0) << off.err;
    args.insert(args.end(), {"--spec-type", "mtp", "--spec-n-max", "3", "--spec-adaptive", "off"});
    const testing::CommandResult on = testing::RunMoeserve(args);
    ASSERT_EQ(on.exit_code, 0) << on.err;
    const json a = json::parse(off.out), b = json::parse(on.out);
    EXPECT_EQ(a["generated_ids"], b["generated_ids"]);
    EXPECT_EQ(b["decode_steps"].get<int>() + b["accepted_draft_tokens"].get<int>(), a["decode_steps"].get<int>());
    drafted += b["draft_tokens"].get<int>();
  }
  EXPECT_GT(drafted, 0);
  const testing::CommandResult bench = testing::RunMoeserve(
      {"bench", "serve", "--model", model, "--spec-type", "mtp", "--spec-adaptive", "off", "--concurrency", "2",
       "--requests", "4", "--prompt-len", "24", "--output-len", "16", "--json"});
  ASSERT_EQ(bench.exit_code, 0) << bench.err;
  const json rows = json::parse(bench.out.substr(bench.out.find('[')));
  ASSERT_EQ(rows.size(), 1u) << bench.out;
  EXPECT_EQ(rows[0]["failed"], 0);
  EXPECT_GT(rows[0]["draft_tokens"].get<int>(), 0) << bench.out;
}

TEST(SpecDecodeClusterTest, BadSpeculativeKeysNameTheLineAndKey) {
  testing::ScratchDir dir;
  const std::string head = "model: " + testing::FixtureDir("qwen3_moe") + "\nnodes:\n  - {host: 127.0.0.1, workers: 1}\n";
  for (const auto& [body, message] : std::vector<std::pair<std::string, std::string>>{
           {"speculative: {type: eagle}\n", "speculative.type: 'eagle' is not a speculative method"},
           {"speculative: {type: ngram, n_max: 40}\n", "speculative.n_max: 40 is outside [1, 16]"},
           {"speculative: {type: ngram, depth: 2}\n", "speculative.depth: unknown key; speculative takes"},
           {"speculative: {type: mtp}\n", "speculative.type: type mtp: " + testing::FixtureDir("qwen3_moe") +
                                                " has no MTP (nextn) layer"},
           {"speculative: {type: ngram, model: /m}\n", "only read with type draft"},
           {"speculative: {type: draft, model: /m}\n", "a draft model is served by one process"},
       }) {
    const std::string path = dir / "c.yaml";
    std::ofstream(path) << head << body;
    const testing::CommandResult r = testing::RunMoeserve({"serve", "--config", path});
    EXPECT_EQ(r.exit_code, 2) << body << r.err;
    EXPECT_THAT(r.err, HasSubstr(message)) << body;
  }
}

}  // namespace
}  // namespace moe

#include "serving_bench.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_format.h"
#include "moeserve/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace moe::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

LatencyStats Summarize(std::vector<double> v) {
  LatencyStats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / v.size();
  s.p50 = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, static_cast<size_t>(v.size() * 0.99))];
  return s;
}

struct RequestRecord {
  int output_tokens = 0;
  double ttft_ms = 0, tpot_ms = 0, e2e_ms = 0;
  std::vector<double> itl_ms;
  int spec_drafts = 0, draft_tokens = 0, accepted_draft_tokens = 0;
  bool ok = false;
};

}  // namespace

absl::StatusOr<ServingBenchResult> RunServingBench(const ServingBenchOptions& o) {
  if (o.concurrency <= 0 || o.requests <= 0 || o.prompt_len <= 0 || o.output_len <= 0) {
    return absl::InvalidArgumentError("concurrency, requests, prompt and output lengths must be positive");
  }
  auto channel = grpc::CreateChannel(o.target, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(3))) {
    return absl::UnavailableError(absl::StrCat("no server answers at ", o.target));
  }
  auto stub = moeserve::v1::Generation::NewStub(channel);
  std::vector<RequestRecord> records(o.requests);
  std::atomic<int> next{0};
  absl::Mutex error_mu;
  std::string first_error;  // guarded by error_mu while the clients run
  const auto start = Clock::now();
  std::vector<std::thread> clients;
  for (int c = 0; c < o.concurrency; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(1000 + c);
      for (int i; (i = next++) < o.requests;) {
        moeserve::v1::GenerateRequest request;
        for (int t = 0; t < o.prompt_len; ++t) {
          const bool repeat = o.prompt_period > 0 && t >= o.prompt_period;
          request.add_token_ids(repeat ? request.token_ids(t - o.prompt_period) : static_cast<int32_t>(rng() % o.vocab));
        }
        request.mutable_stopping()->set_max_new_tokens(o.output_len);
        request.mutable_stopping()->set_ignore_eos(true);
        request.set_response_format(o.response_format);
        grpc::ClientContext ctx;
        RequestRecord& r = records[i];
        const auto t0 = Clock::now();
        auto reader = stub->Generate(&ctx, request);
        moeserve::v1::GenerateResponse msg;
        std::optional<Clock::time_point> first, last;
        while (reader->Read(&msg)) {
          if (msg.token_ids_size() == 0) continue;
          const auto now = Clock::now();
          if (!first) first = now;
          if (last) r.itl_ms.push_back(Ms(now - *last));
          last = now;
          r.output_tokens += msg.token_ids_size();
        }
        if (msg.has_usage()) {
          r.spec_drafts = msg.usage().spec_drafts();
          r.draft_tokens = msg.usage().draft_tokens();
          r.accepted_draft_tokens = msg.usage().accepted_draft_tokens();
        }
        const grpc::Status status = reader->Finish();
        const auto t1 = Clock::now();
        r.ok = status.ok() && first.has_value();
        if (!r.ok) {
          absl::MutexLock lock(&error_mu);
          if (first_error.empty()) first_error = status.error_message();
          continue;
        }
        r.ttft_ms = Ms(*first - t0);
        r.e2e_ms = Ms(t1 - t0);
        r.tpot_ms = r.output_tokens > 1 ? Ms(*last - *first) / (r.output_tokens - 1) : 0;
      }
    });
  }
  for (auto& t : clients) t.join();
  ServingBenchResult result;
  result.concurrency = o.concurrency;
  result.requests = o.requests;
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<double> ttft, tpot, itl, e2e;
  int64_t tokens = 0;
  for (const RequestRecord& r : records) {
    if (!r.ok) {
      ++result.failed;
      continue;
    }
    tokens += r.output_tokens;
    result.spec_drafts += r.spec_drafts;
    result.draft_tokens += r.draft_tokens;
    result.accepted_draft_tokens += r.accepted_draft_tokens;
    ttft.push_back(r.ttft_ms);
    tpot.push_back(r.tpot_ms);
    e2e.push_back(r.e2e_ms);
    itl.insert(itl.end(), r.itl_ms.begin(), r.itl_ms.end());
  }
  if (result.failed == o.requests) return absl::UnavailableError(absl::StrCat("every request failed: ", first_error));
  result.output_tokens_per_second = tokens / result.seconds;
  result.ttft_ms = Summarize(ttft);
  result.tpot_ms = Summarize(tpot);
  result.itl_ms = Summarize(itl);
  result.e2e_ms = Summarize(e2e);
  if (!o.csv.empty()) {
    std::ofstream csv(o.csv, std::ios::app);
    if (csv.tellp() == 0) csv << "concurrency,request,prompt_tokens,output_tokens,ttft_ms,tpot_ms,e2e_ms,ok\n";
    for (int i = 0; i < o.requests; ++i) {
      const RequestRecord& r = records[i];
      csv << absl::StrFormat("%d,%d,%d,%d,%.3f,%.3f,%.3f,%d\n", o.concurrency, i, o.prompt_len, r.output_tokens,
                             r.ttft_ms, r.tpot_ms, r.e2e_ms, r.ok ? 1 : 0);
    }
    if (!csv) return absl::InvalidArgumentError(absl::StrCat(o.csv, ": cannot write"));
  }
  return result;
}

absl::StatusOr<std::vector<MultiTurnRow>> RunMultiTurnBench(const ServingBenchOptions& o, int turns, int turn_len) {
  if (o.concurrency <= 0 || turns <= 0 || turn_len <= 0 || o.prompt_len <= 0 || o.output_len <= 0) {
    return absl::InvalidArgumentError("concurrency, turns and lengths must be positive");
  }
  auto channel = grpc::CreateChannel(o.target, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(3))) {
    return absl::UnavailableError(absl::StrCat("no server answers at ", o.target));
  }
  auto stub = moeserve::v1::Generation::NewStub(channel);
  std::mt19937 system_rng(7);
  std::vector<int32_t> system(o.prompt_len);
  for (int32_t& t : system) t = static_cast<int32_t>(system_rng() % o.vocab);
  std::vector<std::vector<double>> ttft(turns), cached(turns);
  std::vector<int> history(turns, 0);
  absl::Mutex mu;
  std::string first_error;
  std::vector<std::thread> clients;
  for (int c = 0; c < o.concurrency; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(2000 + c);
      std::vector<int32_t> conversation = system;
      for (int turn = 0; turn < turns; ++turn) {
        for (int t = 0; t < turn_len; ++t) conversation.push_back(static_cast<int32_t>(rng() % o.vocab));
        moeserve::v1::GenerateRequest request;
        request.mutable_token_ids()->Add(conversation.begin(), conversation.end());
        request.mutable_stopping()->set_max_new_tokens(o.output_len);
        request.mutable_stopping()->set_ignore_eos(true);
        grpc::ClientContext ctx;
        const auto t0 = Clock::now();
        auto reader = stub->Generate(&ctx, request);
        moeserve::v1::GenerateResponse msg;
        std::optional<Clock::time_point> first;
        int cached_tokens = 0;
        const size_t prompt = conversation.size();
        while (reader->Read(&msg)) {
          if (msg.token_ids_size() > 0 && !first) first = Clock::now();
          conversation.insert(conversation.end(), msg.token_ids().begin(), msg.token_ids().end());
          if (msg.has_usage()) cached_tokens = msg.usage().cached_tokens();
        }
        const grpc::Status status = reader->Finish();
        absl::MutexLock lock(&mu);
        if (!status.ok() || !first) {
          if (first_error.empty()) first_error = status.error_message();
          return;
        }
        ttft[turn].push_back(Ms(*first - t0));
        cached[turn].push_back(cached_tokens);
        history[turn] = static_cast<int>(prompt);
      }
    });
  }
  for (auto& t : clients) t.join();
  if (!first_error.empty()) return absl::UnavailableError(absl::StrCat("a conversation failed: ", first_error));
  std::vector<MultiTurnRow> rows;
  for (int turn = 0; turn < turns; ++turn) {
    MultiTurnRow row;
    row.turn = turn + 1;
    row.history_tokens = history[turn];
    row.ttft_ms = Summarize(ttft[turn]).mean;
    row.cached_tokens = Summarize(cached[turn]).mean;
    rows.push_back(row);
  }
  return rows;
}

void PrintMultiTurn(const std::vector<MultiTurnRow>& on, const std::vector<MultiTurnRow>* off, bool json,
                    std::ostream& out) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (size_t i = 0; i < on.size(); ++i) {
    const MultiTurnRow& r = on[i];
    nlohmann::ordered_json row = {{"turn", r.turn},
                                  {"prompt_tokens", r.history_tokens},
                                  {"cached_tokens", r.cached_tokens},
                                  {"ttft_ms", r.ttft_ms}};
    std::string line = absl::StrFormat("turn %2d: prompt %6d tokens, %8.1f cached | TTFT %9.2f ms", r.turn,
                                       r.history_tokens, r.cached_tokens, r.ttft_ms);
    if (off != nullptr && i < off->size()) {
      const double ratio = r.ttft_ms > 0 ? (*off)[i].ttft_ms / r.ttft_ms : 0;
      row["ttft_ms_cache_off"] = (*off)[i].ttft_ms;
      row["cache_off_over_on"] = ratio;
      absl::StrAppend(&line, absl::StrFormat(" | cache off %9.2f ms | %5.2fx", (*off)[i].ttft_ms, ratio));
    }
    rows.push_back(std::move(row));
    if (!json) out << line << "\n";
  }
  if (json) out << rows.dump() << std::endl;
}

absl::Status RunServingSweep(ServingBenchOptions o, const std::vector<int>& concurrency, int requests, bool json,
                             std::ostream& out) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (int c : concurrency) {
    o.concurrency = c;
    o.requests = requests > 0 ? requests : std::max(8, 4 * c);
    auto r = RunServingBench(o);
    if (!r.ok()) return r.status();
    if (json) {
      auto stats = [](const LatencyStats& s) {
        return nlohmann::ordered_json{{"mean", s.mean}, {"p50", s.p50}, {"p99", s.p99}};
      };
      rows.push_back({{"concurrency", c},
                      {"requests", r->requests},
                      {"failed", r->failed},
                      {"output_tokens_per_s", r->output_tokens_per_second},
                      {"ttft_ms", stats(r->ttft_ms)},
                      {"tpot_ms", stats(r->tpot_ms)},
                      {"itl_ms", stats(r->itl_ms)},
                      {"e2e_ms", stats(r->e2e_ms)},
                      {"spec_drafts", r->spec_drafts},
                      {"draft_tokens", r->draft_tokens},
                      {"accepted_draft_tokens", r->accepted_draft_tokens}});
    } else {
      out << absl::StrFormat(
          "concurrency %3d: %8.1f output tokens/s | TTFT ms mean %.1f p50 %.1f p99 %.1f | TPOT ms mean %.2f p50 %.2f "
          "p99 %.2f | ITL ms mean %.2f p50 %.2f p99 %.2f | %d requests, %d failed\n",
          c, r->output_tokens_per_second, r->ttft_ms.mean, r->ttft_ms.p50, r->ttft_ms.p99, r->tpot_ms.mean,
          r->tpot_ms.p50, r->tpot_ms.p99, r->itl_ms.mean, r->itl_ms.p50, r->itl_ms.p99, r->requests, r->failed);
      if (r->draft_tokens > 0) {
        // Acceptance rate, and tokens per verify step (vLLM's mean acceptance length).
        out << absl::StrFormat(
            "                 drafts: %d of %d kept (%.2f), mean acceptance length %.2f over %d verify steps "
            "(per position: the server's /metrics)\n",
            r->accepted_draft_tokens, r->draft_tokens,
            static_cast<double>(r->accepted_draft_tokens) / static_cast<double>(r->draft_tokens),
            1.0 + static_cast<double>(r->accepted_draft_tokens) / static_cast<double>(std::max<int64_t>(r->spec_drafts, 1)),
            r->spec_drafts);
      }
    }
  }
  if (json) out << rows.dump() << std::endl;
  return absl::OkStatus();
}

absl::Status RunStructuredSweep(ServingBenchOptions o, const std::vector<int>& concurrency, int requests,
                                const std::function<MaskCounters()>& mask_counters, bool json, std::ostream& out) {
  if (o.response_format.empty()) return absl::InvalidArgumentError("RunStructuredSweep: no response_format");
  const std::string format = o.response_format;
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (int c : concurrency) {
    o.concurrency = c;
    o.requests = requests > 0 ? requests : std::max(8, 4 * c);
    o.response_format.clear();
    auto free = RunServingBench(o);
    if (!free.ok()) return free.status();
    o.response_format = format;
    const MaskCounters before = mask_counters ? mask_counters() : MaskCounters{};
    auto constrained = RunServingBench(o);
    if (!constrained.ok()) return constrained.status();
    const MaskCounters after = mask_counters ? mask_counters() : MaskCounters{};
    const double ratio = free->output_tokens_per_second > 0
                             ? constrained->output_tokens_per_second / free->output_tokens_per_second
                             : 0;
    const int64_t masks = after.computed - before.computed;
    const double mask_ms = (after.seconds - before.seconds) * 1e3;
    const double output_tokens = constrained->output_tokens_per_second * constrained->seconds;
    nlohmann::ordered_json row = {{"concurrency", c},
                                  {"requests", o.requests},
                                  {"failed", free->failed + constrained->failed},
                                  {"output_tokens_per_s", free->output_tokens_per_second},
                                  {"constrained_output_tokens_per_s", constrained->output_tokens_per_second},
                                  {"constrained_over_unconstrained", ratio},
                                  {"tpot_ms", free->tpot_ms.mean},
                                  {"constrained_tpot_ms", constrained->tpot_ms.mean},
                                  {"constrained_output_tokens", output_tokens}};
    std::string line = absl::StrFormat(
        "concurrency %3d: unconstrained %8.1f output tokens/s (TPOT %.2f ms) | constrained %8.1f output tokens/s "
        "(TPOT %.2f ms, %.0f tokens) | constrained/unconstrained %.3f",
        c, free->output_tokens_per_second, free->tpot_ms.mean, constrained->output_tokens_per_second,
        constrained->tpot_ms.mean, output_tokens, ratio);
    if (mask_counters) {
      const double per_mask = masks > 0 ? mask_ms / masks : 0;
      const double per_token = output_tokens > 0 ? mask_ms / output_tokens : 0;
      row["masks_computed"] = masks;
      row["mask_ms"] = mask_ms;
      row["mask_ms_per_computed_mask"] = per_mask;
      row["mask_ms_per_output_token"] = per_token;
      absl::StrAppend(&line, absl::StrFormat(" | masks: %d new states, %.3f ms each, %.4f ms per output token",
                                             masks, per_mask, per_token));
    }
    rows.push_back(std::move(row));
    if (!json) out << line << std::endl;
  }
  if (json) out << rows.dump() << std::endl;
  return absl::OkStatus();
}

}  // namespace moe::bench

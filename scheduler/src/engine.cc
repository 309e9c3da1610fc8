#include "moe/scheduler/engine.h"

#include <future>

namespace moe::scheduler {

void Stream::Push(Output out, Clock::time_point now, Metrics* metrics) {
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (out.admitted && !admitted_) {
      admitted_ = now;
      if (metrics != nullptr) metrics->queue_seconds.Observe(seconds(now - arrival_));
    }
    if (!out.new_tokens.empty()) {
      if (metrics != nullptr) {
        metrics->generated_tokens += out.new_tokens.size();
        if (last_token_) metrics->inter_token_seconds.Observe(seconds(now - *last_token_));
        if (!first_token_) metrics->first_token_seconds.Observe(seconds(now - arrival_));
      }
      if (!first_token_) first_token_ = now;
      last_token_ = now;
    }
    if (out.finished && metrics != nullptr) {
      metrics->request_seconds.Observe(seconds(now - arrival_));
      metrics->prompt_tokens += out.prompt_tokens;
      switch (*out.finished) {
        case FinishReason::kAborted:
        case FinishReason::kDeadline:
          ++metrics->requests_aborted;
          break;
        case FinishReason::kError:
          ++metrics->requests_failed;
          break;
        default:
          ++metrics->requests_finished;
          break;
      }
    }
    outputs_.push_back(std::move(out));
  }
  cv_.notify_all();
}

bool Stream::Next(Output* out, std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, wait, [&] { return !outputs_.empty(); })) return false;
  *out = std::move(outputs_.front());
  outputs_.pop_front();
  return true;
}

std::optional<Clock::time_point> Stream::admitted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return admitted_;
}

std::optional<Clock::time_point> Stream::first_token() const {
  std::lock_guard<std::mutex> lock(mu_);
  return first_token_;
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Start(runtime::Model& model, SchedulerConfig config) {
  config.vocab_size = model.spec().vocab_size;
  if (config.eos_token_ids.empty()) config.eos_token_ids = model.spec().eos_token_ids;
  auto cache = model.NewKvCache(config.num_blocks, config.block_size);
  if (!cache.ok()) return cache.status();
  return std::unique_ptr<Engine>(new Engine(model, std::move(config), std::move(*cache)));
}

struct Engine::PendingAdd {
  Request request;
  std::shared_ptr<Stream> stream;
  std::promise<absl::Status> done;
};

Engine::Engine(runtime::Model& model, SchedulerConfig config, std::unique_ptr<runtime::KvCache> cache)
    : model_(model),
      config_(std::move(config)),
      cache_(std::move(cache)),
      executor_(std::make_unique<ModelExecutor>(model_, *cache_)),
      scheduler_(config_),
      stats_(scheduler_.stats()),
      thread_([this] { Loop(); }) {}

Engine::~Engine() { Stop(); }

void Engine::StopAccepting() {
  std::lock_guard<std::mutex> lock(mu_);
  accepting_ = false;
}

int Engine::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  if (!thread_.joinable()) return 0;
  thread_.join();
  // Whatever was still live ends as aborted; queued submissions are refused.
  const absl::Status reason = absl::UnavailableError("server shutting down");
  int cut = static_cast<int>(streams_.size());
  for (auto& [id, stream] : streams_) {
    Output out = OutputFor(id);
    out.finished = FinishReason::kAborted;
    out.error = reason;
    stream->Push(std::move(out), Clock::now(), &metrics_);
  }
  streams_.clear();
  std::lock_guard<std::mutex> lock(mu_);
  live_.clear();
  cut += static_cast<int>(adds_.size());
  for (PendingAdd* add : adds_) add->done.set_value(reason);
  adds_.clear();
  idle_.notify_all();
  return cut;
}

bool Engine::WaitIdle(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_.wait_until(lock, deadline, [&] { return adds_.empty() && !inbox_in_hand_ && live_.empty(); });
}

absl::StatusOr<std::shared_ptr<Stream>> Engine::Submit(Request request) {
  PendingAdd add;
  add.request = std::move(request);
  add.stream = std::make_shared<Stream>();
  std::future<absl::Status> done = add.done.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || !accepting_) return absl::UnavailableError("server shutting down: not accepting new requests");
    adds_.push_back(&add);
  }
  work_.notify_all();
  if (absl::Status s = done.get(); !s.ok()) return s;
  return add.stream;
}

bool Engine::Abort(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_.count(id) == 0) return false;
    aborts_.push_back(id);
  }
  work_.notify_all();
  return true;
}

SchedulerStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Engine::DrainInbox() {
  std::deque<PendingAdd*> adds;
  std::vector<std::string> aborts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    adds.swap(adds_);
    aborts.swap(aborts_);
    inbox_in_hand_ = !adds.empty();
  }
  for (PendingAdd* add : adds) {
    const std::string id = add->request.id;
    absl::Status s = scheduler_.Add(std::move(add->request));
    if (s.ok()) {
      streams_[id] = add->stream;
      std::lock_guard<std::mutex> lock(mu_);
      live_.insert(id);
    }
    add->done.set_value(s);
  }
  if (!adds.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    inbox_in_hand_ = false;
  }
  idle_.notify_all();
  for (const std::string& id : aborts) scheduler_.Abort(id);
}

void Engine::Loop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [&] { return stop_ || busy_ || !adds_.empty() || !aborts_.empty(); });
      if (stop_) return;
    }
    DrainInbox();
    std::vector<Output> outputs;
    const Clock::time_point start = Clock::now();
    if (!scheduler_.idle()) outputs = scheduler_.Step(*executor_);
    const Clock::time_point now = Clock::now();
    if (!outputs.empty()) metrics_.step_seconds.Observe(std::chrono::duration<double>(now - start).count());
    std::vector<std::string> finished;
    for (Output& out : outputs) {
      auto it = streams_.find(out.id);
      if (it == streams_.end()) continue;
      std::shared_ptr<Stream> stream = it->second;
      if (out.finished) {
        finished.push_back(out.id);
        streams_.erase(it);
      }
      stream->Push(std::move(out), now, &metrics_);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const std::string& id : finished) live_.erase(id);
      busy_ = !scheduler_.idle();
      stats_ = scheduler_.stats();
    }
    if (!finished.empty()) idle_.notify_all();
  }
}

}  // namespace moe::scheduler

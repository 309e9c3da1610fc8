#include "moe/scheduler/engine.h"

#include <future>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace moe::scheduler {

void Stream::Push(Output out, Clock::time_point step_start, Clock::time_point now, Metrics* metrics) {
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  absl::MutexLock lock(&mu_);
  if (out.admitted && !admitted_) {
    // Queue time ends when the first step that works on the request starts, not when it ends.
    admitted_ = step_start;
    if (metrics != nullptr) metrics->queue_seconds.Observe(seconds(step_start - arrival_));
  }
  if (metrics != nullptr) metrics->CountDrafts(out.step_drafts);
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

bool Stream::Next(Output* out, std::chrono::milliseconds wait) {
  absl::MutexLock lock(&mu_);
  auto has_output = [](std::deque<Output>* outputs) { return !outputs->empty(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(+has_output, &outputs_), absl::FromChrono(wait))) return false;
  *out = std::move(outputs_.front());
  outputs_.pop_front();
  return true;
}

std::optional<Clock::time_point> Stream::admitted() const {
  absl::MutexLock lock(&mu_);
  return admitted_;
}

std::optional<Clock::time_point> Stream::first_token() const {
  absl::MutexLock lock(&mu_);
  return first_token_;
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Start(std::unique_ptr<runtime::Executor> executor,
                                                      SchedulerConfig config) {
  if (executor == nullptr) return absl::InvalidArgumentError("the engine needs an executor, got none");
  const runtime::KvCapacity kv = executor->kv_capacity();
  if (kv.num_blocks <= 0 || kv.block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("executor '", executor->Describe(), "' has no KV cache (",
                                                   kv.num_blocks, " blocks of ", kv.block_size, " positions)"));
  }
  // The blocks the scheduler hands out are the executor's; it alone knows how many there are.
  config.num_blocks = kv.num_blocks;
  config.block_size = kv.block_size;
  const runtime::ModelInfo& model = executor->model_info();
  config.vocab_size = model.vocab_size;
  if (config.eos_token_ids.empty()) config.eos_token_ids = model.eos_token_ids;
  return std::unique_ptr<Engine>(new Engine(std::move(executor), std::move(config)));
}

struct Engine::PendingAdd {
  Request request;
  std::shared_ptr<Stream> stream;
  std::promise<absl::Status> done;
};

Engine::Engine(std::unique_ptr<runtime::Executor> executor, SchedulerConfig config)
    : executor_(std::move(executor)),
      config_(std::move(config)),
      scheduler_(config_),
      stats_(scheduler_.stats()),
      thread_([this] { Loop(); }) {}

Engine::~Engine() { Stop(); }

bool Engine::HasWork() const { return stop_ || busy_ || !adds_.empty() || !aborts_.empty(); }

bool Engine::Idle() const { return adds_.empty() && !inbox_in_hand_ && live_.empty(); }

void Engine::StopAccepting() {
  absl::MutexLock lock(&mu_);
  accepting_ = false;
}

int Engine::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (!thread_.joinable()) return 0;
  thread_.join();
  // Whatever was still live ends as aborted; queued submissions are refused.
  const absl::Status reason = absl::UnavailableError("server shutting down");
  int cut = static_cast<int>(streams_.size());
  for (auto& [id, stream] : streams_) {
    Output out = OutputFor(id);
    out.finished = FinishReason::kAborted;
    out.error = reason;
    const Clock::time_point now = Clock::now();
    stream->Push(std::move(out), now, now, &metrics_);
  }
  streams_.clear();
  absl::MutexLock lock(&mu_);
  live_.clear();
  cut += static_cast<int>(adds_.size());
  for (PendingAdd* add : adds_) add->done.set_value(reason);
  adds_.clear();
  return cut;
}

bool Engine::WaitIdle(Clock::time_point deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(this, &Engine::Idle), absl::FromChrono(deadline - Clock::now()));
}

absl::StatusOr<std::shared_ptr<Stream>> Engine::Submit(Request request) {
  PendingAdd add;
  add.request = std::move(request);
  add.stream = std::make_shared<Stream>();
  std::future<absl::Status> done = add.done.get_future();
  {
    absl::MutexLock lock(&mu_);
    if (stop_ || !accepting_) return absl::UnavailableError("server shutting down: not accepting new requests");
    adds_.push_back(&add);
  }
  if (absl::Status s = done.get(); !s.ok()) return s;
  return add.stream;
}

bool Engine::Abort(const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (live_.count(id) == 0) return false;
  aborts_.push_back({id, FinishReason::kAborted});
  return true;
}

bool Engine::FinishByStopString(const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (live_.count(id) == 0) return false;
  aborts_.push_back({id, FinishReason::kStopString});
  return true;
}

SchedulerStats Engine::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void Engine::DrainInbox() {
  std::deque<PendingAdd*> adds;
  std::vector<std::pair<std::string, FinishReason>> aborts;
  {
    absl::MutexLock lock(&mu_);
    adds.swap(adds_);
    aborts.swap(aborts_);
    inbox_in_hand_ = !adds.empty();
  }
  for (PendingAdd* add : adds) {
    const std::string id = add->request.id;
    absl::Status s = scheduler_.Add(std::move(add->request));
    if (s.ok()) {
      streams_[id] = add->stream;
      absl::MutexLock lock(&mu_);
      live_.insert(id);
    }
    add->done.set_value(s);
  }
  if (!adds.empty()) {
    absl::MutexLock lock(&mu_);
    inbox_in_hand_ = false;
  }
  for (const auto& [id, reason] : aborts) scheduler_.Abort(id, reason);
}

void Engine::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Engine::HasWork));
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
      stream->Push(std::move(out), start, now, &metrics_);
    }
    absl::MutexLock lock(&mu_);
    for (const std::string& id : finished) live_.erase(id);
    busy_ = !scheduler_.idle();
    stats_ = scheduler_.stats();
  }
}

}  // namespace moe::scheduler

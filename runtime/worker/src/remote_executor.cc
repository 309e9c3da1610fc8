#include "moe/worker/remote_executor.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "moe/core/status.h"
#include "moeserve/v1/worker.grpc.pb.h"

namespace moe::worker {

namespace pb = ::moeserve::v1;

// One generation of the workers' Execute streams.
class RemoteExecutor::Group {
 public:
  struct Stream {
    std::string address;
    std::unique_ptr<pb::Worker::Stub> stub;
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientReaderWriter<pb::StepRequest, pb::StepResult>> stream;
  };

  static absl::StatusOr<std::shared_ptr<Group>> Open(const std::vector<std::string>& workers, uint64_t generation,
                                                     const Options& options) {
    auto group = std::make_shared<Group>();
    group->generation = generation;
    for (size_t rank = 0; rank < workers.size(); ++rank) {
      Stream s;
      s.address = workers[rank];
      auto channel = grpc::CreateChannel(
          s.address, options.credentials != nullptr ? options.credentials : grpc::InsecureChannelCredentials());
      if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
        return absl::UnavailableError(absl::StrCat("worker ", rank, " at ", s.address, " cannot be reached"));
      }
      s.stub = pb::Worker::NewStub(channel);
      s.context = std::make_unique<grpc::ClientContext>();
      for (const auto& [key, value] : options.call_metadata) s.context->AddMetadata(key, value);
      s.stream = s.stub->Execute(s.context.get());
      group->streams.push_back(std::move(s));
    }
    return group;
  }

  ~Group() {
    Cancel();
    for (Stream& s : streams) {
      if (s.stream != nullptr) (void)s.stream->Finish();
    }
  }

  // Fails every Read and Write in flight or to come (thread-safe).
  void Cancel() {
    for (Stream& s : streams) s.context->TryCancel();
  }

  uint64_t generation = 0;
  std::vector<Stream> streams;
};

absl::StatusOr<std::unique_ptr<RemoteExecutor>> RemoteExecutor::Connect(const Options& options) {
  if (options.workers.empty() || options.logits_rank < 0 ||
      options.logits_rank >= static_cast<int>(options.workers.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("remote executor: ", options.workers.size(), " workers, logits on rank ", options.logits_rank));
  }
  std::unique_ptr<RemoteExecutor> executor(new RemoteExecutor(options));
  MOE_ASSIGN_OR_RETURN(auto group, Group::Open(options.workers, 1, options));
  {
    absl::MutexLock lock(&executor->mu_);
    executor->group_ = std::move(group);
  }
  if (options.step_timeout > absl::ZeroDuration()) {
    RemoteExecutor* raw = executor.get();
    executor->watchdog_ = std::thread([raw] { raw->WatchSteps(); });
  }
  return executor;
}

RemoteExecutor::~RemoteExecutor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
  absl::MutexLock lock(&mu_);
  group_.reset();
}

void RemoteExecutor::WatchSteps() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(100));
    if (stopping_ || awaited_rank_ < 0 || !broken_.empty()) continue;
    if (absl::Now() - step_started_ < options_.step_timeout) continue;
    const std::string address = group_ != nullptr && awaited_rank_ < static_cast<int>(group_->streams.size())
                                    ? group_->streams[awaited_rank_].address
                                    : "?";
    broken_ = absl::StrCat("step deadline: worker ", awaited_rank_, " at ", address, " sent no result within ",
                           absl::FormatDuration(options_.step_timeout), " (stopped, or stuck in a collective)");
    awaited_rank_ = -1;
    if (group_ != nullptr) group_->Cancel();
  }
}

void RemoteExecutor::MarkBroken(const std::string& why) {
  std::shared_ptr<Group> group;
  {
    absl::MutexLock lock(&mu_);
    if (broken_.empty()) broken_ = why;
    group = group_;
  }
  if (group != nullptr) group->Cancel();
}

absl::Status RemoteExecutor::Reattach(const std::vector<std::string>& workers) {
  uint64_t generation;
  {
    absl::MutexLock lock(&mu_);
    generation = (group_ != nullptr ? group_->generation : 0) + 1;
  }
  auto group = Group::Open(workers, generation, options_);
  if (!group.ok()) return group.status();
  std::shared_ptr<Group> old;
  {
    absl::MutexLock lock(&mu_);
    old = std::move(group_);
    group_ = std::move(*group);
    broken_.clear();
  }
  if (old != nullptr) old->Cancel();
  return absl::OkStatus();
}

bool RemoteExecutor::healthy() const {
  absl::MutexLock lock(&mu_);
  return broken_.empty();
}

uint64_t RemoteExecutor::cache_generation() const {
  absl::MutexLock lock(&mu_);
  return group_ != nullptr ? group_->generation : 0;
}

std::string RemoteExecutor::broken_reason() const {
  absl::MutexLock lock(&mu_);
  return broken_;
}

absl::StatusOr<runtime::StepResult> RemoteExecutor::Execute(const runtime::StepPlan& plan) {
  std::shared_ptr<Group> group;
  {
    absl::MutexLock lock(&mu_);
    auto healed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return broken_.empty(); };
    if (!mu_.AwaitWithTimeout(absl::Condition(&healed), options_.heal_timeout)) {
      return absl::UnavailableError(absl::StrCat("the workers are being restarted (", broken_, ")"));
    }
    group = group_;
  }
  if (group->generation != generation_seen_) {
    encoder_.Reset();  // the new workers mirror nothing yet
    const bool restarted = generation_seen_ != 0;
    generation_seen_ = group->generation;
    for (const runtime::SequenceChunk& c : plan.batch.sequences) {
      if (restarted && c.first_position > 0) {
        return absl::UnavailableError(
            "the workers were restarted: the KV cache this step continues from is gone, recompute");
      }
    }
  }
  MOE_ASSIGN_OR_RETURN(const pb::StepRequest request, encoder_.Encode(plan));
  auto lost = [&](size_t rank, const char* what) {
    const std::string why = absl::StrCat("worker ", rank, " at ", group->streams[rank].address, " lost (", what,
                                         " failed on its control stream)");
    MarkBroken(why);
    return absl::UnavailableError(why);
  };
  const auto awaiting = [&](int rank) {
    absl::MutexLock lock(&mu_);
    if (rank == 0) step_started_ = absl::Now();
    awaited_rank_ = rank;
  };
  awaiting(0);
  for (size_t rank = 0; rank < group->streams.size(); ++rank) {
    if (!group->streams[rank].stream->Write(request)) {
      awaiting(-1);
      return lost(rank, "sending the step");
    }
  }
  runtime::StepResult answer;
  absl::Status failed;
  for (size_t rank = 0; rank < group->streams.size(); ++rank) {
    pb::StepResult result;
    if (rank > 0) awaiting(static_cast<int>(rank));
    if (!group->streams[rank].stream->Read(&result)) {
      awaiting(-1);
      std::string deadline;
      {
        absl::MutexLock lock(&mu_);
        if (absl::StartsWith(broken_, "step deadline")) deadline = broken_;
      }
      if (!deadline.empty()) {
        // Say what the others reported (a Gloo or NCCL timeout, as such) beside the deadline.
        return absl::UnavailableError(failed.ok() ? deadline : absl::StrCat(deadline, "; ", failed.message()));
      }
      return lost(rank, "reading the step's result");
    }
    if (result.error_code() != 0 && failed.ok()) {
      failed = absl::Status(static_cast<absl::StatusCode>(result.error_code()),
                            absl::StrCat("worker ", rank, ": ", result.error()));
    }
    if (static_cast<int>(rank) == options_.logits_rank) {
      for (const pb::SequenceResult& r : result.sequences()) answer.sequences.push_back(FromProto(r));
    }
  }
  awaiting(-1);
  if (!failed.ok()) {
    // The workers dropped nothing from their mirrors for a failed step; ours starts over.
    encoder_.Reset();
    return failed;
  }
  size_t sampling = 0;  // sequences with logit rows: each has a result
  for (const std::vector<int>& rows : runtime::LogitRowsBySequence(plan.batch)) sampling += rows.empty() ? 0 : 1;
  if (answer.sequences.size() != sampling) {
    return absl::InternalError(absl::StrCat("worker ", options_.logits_rank, " returned ", answer.sequences.size(),
                                            " sequences' results for ", sampling, " sequences with logit rows"));
  }
  return answer;
}

}  // namespace moe::worker

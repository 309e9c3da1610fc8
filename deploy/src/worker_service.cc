#include "worker_service.h"

#include <sched.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "control_secret.h"
#include "model_loading.h"
#include "moe/comm/gloo_communicator.h"
#include "moe/core/progress.h"
#include "moe/core/status.h"
#if MOE_COMM_HAS_NCCL
#include "moe/comm/nccl_communicator.h"
#endif

namespace moe::deploy {

namespace pb = ::moeserve::v1;

namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

runtime::ParallelMode ModeOf(const pb::ParallelPlan& p) {
  switch (p.mode()) {
    case pb::ParallelPlan::TENSOR:
      return runtime::ParallelMode::kTensor;
    case pb::ParallelPlan::LAYER:
      return runtime::ParallelMode::kLayer;
    default:
      return runtime::ParallelMode::kNone;
  }
}

// Pins this thread, and so the threads it starts (the backend's and the expert pool's), to `cpus`.
absl::Status PinTo(const google::protobuf::RepeatedField<int32_t>& cpus) {
  if (cpus.empty()) return absl::OkStatus();
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) return absl::InvalidArgumentError(absl::StrCat("placement.cpus: ", c));
    CPU_SET(c, &set);
  }
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("placement.cpus: cannot run on the ", cpus.size(), " cores given"));
  }
  return absl::OkStatus();
}

}  // namespace

WorkerService::~WorkerService() {
  executor_.reset();
  model_.reset();
  comm_.reset();
}

void WorkerService::SetState(State state, std::string detail) {
  absl::MutexLock lock(&mu_);
  state_ = state;
  detail_ = std::move(detail);
}

grpc::Status WorkerService::Authorize(const grpc::ServerContext& context) const {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find(kControlSecretMetadata);
  if (it != metadata.end() && SecretsMatch(secret_, std::string_view(it->second.data(), it->second.size()))) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      absl::StrCat(it == metadata.end() ? "no" : "a wrong", " control-plane secret from ",
                                   context.peer(), ": only this deployment's launcher may call its workers"));
}

grpc::Status WorkerService::Init(grpc::ServerContext* context, const pb::InitRequest* request,
                                 pb::InitResponse* response) {
  if (grpc::Status auth = Authorize(*context); !auth.ok()) return auth;
  absl::MutexLock lock(&mu_);
  const pb::ParallelPlan& p = request->parallel();
  if (initialized_) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("this worker is rank ", init_.parallel().rank(), " of ",
                                     init_.parallel().world_size(), " already; a restarted group starts new workers"));
  }
  const int size = std::max(p.world_size(), 1);
  if (p.rank() < 0 || p.rank() >= size) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("parallel.rank ", p.rank(), " outside [0, ", size, ")"));
  }
  const pb::CommBootstrap& c = request->comm();
  std::string how = "alone";
  if (size > 1) {
    if (ModeOf(p) == runtime::ParallelMode::kNone) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "parallel.mode: a group of several ranks needs one");
    }
    switch (c.backend()) {
      case pb::CommBootstrap::GLOO: {
        comm::GlooOptions o;
        o.rank = p.rank();
        o.size = size;
        o.store_address = c.rendezvous();
        o.store_secret = secret_;
        if (!c.host().empty()) o.host = c.host();
        o.prefix = c.prefix().empty() ? "moe" : c.prefix();
        if (c.timeout_ms() > 0) o.timeout = absl::Milliseconds(c.timeout_ms());
        auto gloo = comm::GlooCommunicator::Create(o);
        if (!gloo.ok()) return ToGrpc(gloo.status());
        how = (*gloo)->Describe();
        comm_ = std::move(*gloo);
        break;
      }
      case pb::CommBootstrap::NCCL:
        if (c.nccl_unique_id().empty()) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "comm.nccl_unique_id: empty");
        }
        how = "nccl (joins at Load, on the GPU's stream)";
        break;
      default:
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "comm.backend: GLOO or NCCL for several ranks");
    }
  }
  init_ = *request;
  initialized_ = true;
  response->set_description(
      absl::StrCat("rank ", p.rank(), " of ", size, " (", runtime::ParallelModeName(ModeOf(p)), " split), ", how));
  std::cerr << "moeserve worker: " << response->description() << "\n";
  return grpc::Status::OK;
}

grpc::Status WorkerService::Load(grpc::ServerContext* context, const pb::LoadRequest*,
                                 grpc::ServerWriter<pb::LoadProgress>* writer) {
  if (grpc::Status auth = Authorize(*context); !auth.ok()) return auth;
  pb::InitRequest init;
  {
    absl::MutexLock lock(&mu_);
    if (!initialized_) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "Init first");
    if (model_ != nullptr || state_ == pb::WorkerHealthResponse::LOADING) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "already loaded (or loading)");
    }
    state_ = pb::WorkerHealthResponse::LOADING;
    init = init_;
  }
  const pb::ModelPlacement& pl = init.placement();
  const pb::ParallelPlan& p = init.parallel();
  if (absl::Status s = PinTo(pl.cpus()); !s.ok()) return ToGrpc(s);

  DeviceFlags device;
  device.device = pl.device().empty() ? "cpu" : pl.device();
  device.eager = !pl.graphs();
  device.kv_cache_dtype = pl.kv_cache_dtype().empty() ? "auto" : pl.kv_cache_dtype();
  ExpertFlags experts;
  if (!pl.expert_format().empty()) experts.format = pl.expert_format();
  if (pl.expert_group() > 0) experts.group = pl.expert_group();
  experts.threads = pl.expert_threads();
  experts.shm = pl.expert_shm();
  experts.cpu_moe = pl.cpu_moe();
  experts.n_cpu_moe = pl.n_cpu_moe();
  experts.override_tensor.assign(pl.override_tensor().begin(), pl.override_tensor().end());
  if (!pl.weight_format().empty()) experts.weight_format = pl.weight_format();
  experts.defer_experts = pl.defer_experts();
  experts.gpu_experts_per_layer = pl.gpu_experts_per_layer();
  if (pl.gpu_experts_refresh_steps() > 0) experts.gpu_experts_refresh_steps = pl.gpu_experts_refresh_steps();
  experts.expert_profile = pl.expert_profile();
  if (absl::Status s = CheckModelFlags(device, experts, "worker"); !s.ok()) {
    SetState(pb::WorkerHealthResponse::STARTING, std::string(s.message()));
    return ToGrpc(s);
  }
  runtime::ModelOptions options;
  options.threads = pl.threads();
  if (pl.max_step_tokens() > 0) options.max_step_tokens = pl.max_step_tokens();
  if (pl.max_logit_rows() > 0) options.max_logit_rows = pl.max_logit_rows();
  options.max_context = pl.max_context();
  options.parallel.mode = ModeOf(p);
  options.parallel.rank = p.rank();
  options.parallel.size = std::max(p.world_size(), 1);
  options.parallel.comm = comm_.get();

  // Loading progress goes to the frontend as well as to this process's stderr.
  absl::Mutex writer_mu;
  core::SetProgressSink([&](const std::string& line, double fraction) {
    pb::LoadProgress progress;
    progress.set_message(line);
    progress.set_fraction(fraction);
    absl::MutexLock lock(&writer_mu);
    writer->Write(progress);
  });
  auto before_load = [&](runtime::Backend& backend, runtime::ModelOptions& o) -> absl::Status {
    o.progress = true;
    if (init.comm().backend() != pb::CommBootstrap::NCCL || options.parallel.size == 1) return absl::OkStatus();
#if MOE_COMM_HAS_NCCL
    auto parsed = runtime::ParseDevice(device.device);
    if (!parsed.ok()) return parsed.status();
    const absl::Duration timeout =
        init.comm().timeout_ms() > 0 ? absl::Milliseconds(init.comm().timeout_ms()) : absl::Minutes(5);
    MOE_ASSIGN_OR_RETURN(comm_,
                         comm::NcclCommunicator::Create(init.comm().nccl_unique_id(), p.rank(), options.parallel.size,
                                                        parsed->index, backend.stream_handle(), timeout));
    o.parallel.comm = comm_.get();
    return absl::OkStatus();
#else
    return absl::FailedPreconditionError("this moeserve was built without NCCL: GPU workers need it");
#endif
  };
  auto model =
      LoadModelForCommand(pl.model_dir(), device, experts, options, pl.kv_cache_bytes(), "worker", before_load);
  core::SetProgressSink(nullptr);
  if (!model.ok()) {
    SetState(pb::WorkerHealthResponse::STARTING, std::string(model.status().message()));
    return ToGrpc(model.status());
  }
  const int block_size = pl.kv_block_size() > 0 ? pl.kv_block_size() : 16;
  const int64_t block_bytes = (*model)->KvBlockBytes(block_size);
  const int64_t blocks = pl.kv_cache_bytes() > 0 ? pl.kv_cache_bytes() / block_bytes : 1024;
  if (blocks < 1) {
    const absl::Status s = absl::InvalidArgumentError(absl::StrCat("placement.kv_cache_bytes ", pl.kv_cache_bytes(),
                                                                   " holds no KV block of ", block_bytes, " bytes"));
    SetState(pb::WorkerHealthResponse::STARTING, std::string(s.message()));
    return ToGrpc(s);
  }
  auto executor =
      runtime::ModelExecutor::Create(**model, static_cast<int>(std::min<int64_t>(blocks, 1 << 22)), block_size);
  if (!executor.ok()) {
    SetState(pb::WorkerHealthResponse::STARTING, std::string(executor.status().message()));
    return ToGrpc(executor.status());
  }
  pb::LoadProgress done;
  done.set_done(true);
  done.set_fraction(1.0);
  const runtime::ModelInfo& info = (*executor)->model_info();
  done.set_kv_blocks((*executor)->kv_capacity().num_blocks);
  done.set_kv_block_size((*executor)->kv_capacity().block_size);
  done.set_model_type(info.architecture);
  done.set_vocab_size(info.vocab_size);
  done.set_max_position_embeddings(info.max_position_embeddings);
  done.mutable_eos_token_ids()->Add(info.eos_token_ids.begin(), info.eos_token_ids.end());
  done.set_num_experts(info.num_experts);
  done.set_experts_per_token(info.experts_per_token);
  done.set_description((*executor)->Describe());
  done.set_attached_experts((*model)->expert_pool() != nullptr && (*model)->expert_pool()->loaded_bytes() == 0);
  done.set_message(absl::StrCat("loaded: ", (*executor)->Describe(),
                                done.attached_experts() ? "; routed experts attached from the shared arena" : ""));
  model_ = std::move(*model);
  executor_ = std::move(*executor);
  SetState(pb::WorkerHealthResponse::SERVING, "");
  std::cerr << "moeserve worker: " << done.message() << "\n";
  writer->Write(done);
  return grpc::Status::OK;
}

bool WorkerService::RunStep(const pb::StepRequest& request, pb::StepResult* result) {
  result->set_step(request.step());
  const auto start = std::chrono::steady_clock::now();
  auto plan = decoder_.Decode(request);
  if (!plan.ok()) {
    result->set_error_code(static_cast<int32_t>(plan.status().code()));
    result->set_error(std::string(plan.status().message()));
    failed_steps_.fetch_add(1);
    return true;
  }
  live_sequences_.store(static_cast<int32_t>(decoder_.live_sequences()));
  auto answer = executor_->Execute(*plan);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  steps_.fetch_add(1);
  step_seconds_.store(step_seconds_.load() + seconds);
  result->set_seconds(seconds);
  if (!answer.ok()) {
    failed_steps_.fetch_add(1);
    result->set_error_code(static_cast<int32_t>(answer.status().code()));
    result->set_error(std::string(answer.status().message()));
    if (comm_ != nullptr && !comm_->AsyncError().ok()) {
      SetState(pb::WorkerHealthResponse::BROKEN, std::string(comm_->AsyncError().message()));
      return false;
    }
    return true;
  }
  // Only the answering rank samples (ParallelConfig::answers); the others return no sequences.
  for (const runtime::SequenceResult& r : answer->sequences) *result->add_sequences() = worker::ToProto(r);
  return true;
}

grpc::Status WorkerService::Execute(grpc::ServerContext* context,
                                    grpc::ServerReaderWriter<pb::StepResult, pb::StepRequest>* stream) {
  if (grpc::Status auth = Authorize(*context); !auth.ok()) return auth;
  if (executor_ == nullptr) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "Load first");
  if (executing_.exchange(true)) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "another Execute stream is open");
  }
  pb::StepRequest request;
  grpc::Status status = grpc::Status::OK;
  while (stream->Read(&request)) {
    pb::StepResult result;
    const bool healthy = RunStep(request, &result);
    if (!stream->Write(result)) break;
    if (!healthy) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE, result.error());
      break;
    }
  }
  executing_.store(false);
  return status;
}

grpc::Status WorkerService::Health(grpc::ServerContext* context, const pb::WorkerHealthRequest*,
                                   pb::WorkerHealthResponse* response) {
  if (grpc::Status auth = Authorize(*context); !auth.ok()) return auth;
  absl::MutexLock lock(&mu_);
  response->set_state(state_);
  response->set_detail(detail_);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Stats(grpc::ServerContext* context, const pb::WorkerStatsRequest*,
                                  pb::WorkerStatsResponse* response) {
  if (grpc::Status auth = Authorize(*context); !auth.ok()) return auth;
  response->set_steps(steps_.load());
  response->set_failed_steps(failed_steps_.load());
  response->set_step_seconds(step_seconds_.load());
  response->set_live_sequences(live_sequences_.load());
  return grpc::Status::OK;
}

grpc::Status WorkerService::Shutdown(grpc::ServerContext* context, const pb::ShutdownRequest*, pb::ShutdownResponse*) {
  if (grpc::Status auth = Authorize(*context); !auth.ok()) return auth;
  // After this reply has gone out.
  std::thread([shutdown = shutdown_] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    shutdown();
  }).detach();
  return grpc::Status::OK;
}

}  // namespace moe::deploy

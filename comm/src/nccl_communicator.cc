#include "moe/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "checks.h"
#include "cuda_status.h"
#include "moe/core/logging.h"
#include "moe/core/status.h"

namespace moe::comm {
namespace {

constexpr absl::Duration kWatchdogPeriod = absl::Milliseconds(50);
constexpr absl::Duration kPollPeriod = absl::Microseconds(20);  // while a call or a barrier is in progress
constexpr absl::Duration kMaxFinalizeWait = absl::Seconds(30);

// One NCCL call's result and where it was made, so that an error names the call, file and line.
struct NcclCall {
  ncclResult_t result = ncclSuccess;
  const char* call = "";
  const char* file = "";
  int line = 0;
};
#define MOE_NCCL_CALL(expr) \
  NcclCall { (expr), #expr, __FILE__, __LINE__ }

ncclDataType_t NcclType(core::DType dtype) {
  switch (dtype) {
    case core::DType::kBF16:
      return ncclBfloat16;
    case core::DType::kF16:
      return ncclFloat16;
    case core::DType::kF32:
      return ncclFloat32;
    case core::DType::kI8:
      return ncclInt8;
    case core::DType::kI32:
      return ncclInt32;
    case core::DType::kI64:
      return ncclInt64;
    case core::DType::kF8E4M3:
      break;  // refused by CheckSummable
  }
  return ncclFloat32;
}

// Makes `device` the calling thread's GPU for the scope, then restores the one before.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != device) {
      const cudaError_t err = cudaSetDevice(device);
      if (err != cudaSuccess) status_ = internal::CudaStatus(err, "cudaSetDevice(device)", __FILE__, __LINE__);
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && status_.ok()) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  bool ok() const { return status_.ok(); }
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

// Polls a non-blocking communicator until the call in progress (init, finalize) is done or fails:
// OK, the call's error, or kDeadlineExceeded at the deadline.
absl::Status PollUntilDone(ncclComm_t comm, const char* call, absl::Time deadline) {
  for (;;) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess)
      return internal::NcclStatus(r, comm, "ncclCommGetAsyncError(comm, &state)", __FILE__, __LINE__);
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return internal::NcclStatus(state, comm, call, __FILE__, __LINE__);
    if (absl::Now() >= deadline) return absl::DeadlineExceededError(absl::StrCat(call, " still in progress"));
    absl::SleepFor(absl::Milliseconds(1));
  }
}

}  // namespace

absl::StatusOr<std::string> NcclUniqueId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    return core::Annotate(internal::NcclStatus(r, nullptr, "ncclGetUniqueId(&id)", __FILE__, __LINE__),
                          "making an NCCL unique id (NCCL_SOCKET_IFNAME picks the interface of its bootstrap)");
  }
  return std::string(id.internal, sizeof(id.internal));
}

// The NCCL communicator, its stream, the events that track its queued operations, and the
// watchdog thread. Thread-safety: op_mu_ orders the operations; mu_ guards the communicator
// handle, which the watchdog and Abort() may free (ncclCommAbort) at any time between NCCL calls.
class NcclCommunicator::Impl {
 public:
  Impl(int rank, int size, int device, cudaStream_t stream, absl::Duration timeout, ncclComm_t comm, float* scratch)
      : rank_(rank), size_(size), device_(device), stream_(stream), timeout_(timeout), scratch_(scratch), comm_(comm) {
    int version = 0;
    if (ncclGetVersion(&version) == ncclSuccess) {
      version_ = absl::StrCat(version / 10000, ".", version / 100 % 100, ".", version % 100);
    }
    watchdog_ = std::thread([this] { WatchdogLoop(); });
  }
  ~Impl();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  float* scratch() const { return scratch_; }

  std::string Where(const char* op) const {
    return absl::StrCat(op, " on NCCL rank ", rank_, " of ", size_, " (GPU ", device_, ")");
  }
  std::string Describe() const {
    return absl::StrCat("nccl: rank ", rank_, " of ", size_, " on GPU ", device_, " (NCCL ", version_, ")");
  }

  // Queues one operation: `issue` makes its NCCL calls on the communicator. With `wait`, also
  // waits until the stream has done it (Barrier).
  absl::Status Enqueue(const char* op, absl::FunctionRef<NcclCall(ncclComm_t)> issue, bool wait = false);
  void Abort(const absl::Status& why);
  absl::Status AsyncError() const {
    absl::MutexLock lock(&mu_);
    return error_;
  }

 private:
  struct Pending {
    cudaEvent_t event;
    absl::Time queued;
    const char* op;
  };

  absl::Status Issue(const char* op, absl::FunctionRef<NcclCall(ncclComm_t)> issue) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WaitWhileInProgress(const char* op, const NcclCall& call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records an event after the operation on the stream; the watchdog watches it.
  absl::StatusOr<cudaEvent_t> Track(const char* op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WaitForEvent(const char* op, cudaEvent_t event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Unavailable(const char* op) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WatchdogLoop();
  void WatchOnce() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int rank_, size_, device_;
  const cudaStream_t stream_;
  const absl::Duration timeout_;
  float* const scratch_;  // one float on the GPU, for Barrier
  std::string version_ = "?";

  absl::Mutex op_mu_;
  mutable absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);  // null once aborted
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> spare_events_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

absl::Status NcclCommunicator::Impl::Enqueue(const char* op, absl::FunctionRef<NcclCall(ncclComm_t)> issue, bool wait) {
  absl::MutexLock op_lock(&op_mu_);
  DeviceGuard guard(device_);
  if (!guard.ok()) return core::Annotate(guard.status(), Where(op));
  absl::MutexLock lock(&mu_);
  MOE_RETURN_IF_ERROR(Issue(op, issue));
  auto event = Track(op);
  if (!event.ok()) return core::Annotate(event.status(), Where(op));
  if (!wait) return absl::OkStatus();
  if (*event == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(Where(op), ": cannot wait for a stream that a CUDA graph capture holds"));
  }
  return WaitForEvent(op, *event);
}

absl::Status NcclCommunicator::Impl::Issue(const char* op, absl::FunctionRef<NcclCall(ncclComm_t)> issue) {
  if (aborted_) return Unavailable(op);
  const NcclCall call = issue(comm_);
  if (call.result == ncclInProgress) return WaitWhileInProgress(op, call);
  if (call.result == ncclSuccess) return absl::OkStatus();
  const absl::Status status =
      core::Annotate(internal::NcclStatus(call.result, comm_, call.call, call.file, call.line), Where(op));
  // A refused argument leaves the communicator as it was; anything else breaks it.
  if (status.code() != absl::StatusCode::kInvalidArgument) AbortLocked(status);
  return status;
}

absl::Status NcclCommunicator::Impl::WaitWhileInProgress(const char* op, const NcclCall& call) {
  const absl::Time deadline = absl::Now() + timeout_;
  for (;;) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      const absl::Status status =
          core::Annotate(internal::NcclStatus(state, comm_, call.call, call.file, call.line), Where(op));
      AbortLocked(status);
      return status;
    }
    if (absl::Now() >= deadline) {
      const absl::Status status =
          absl::DeadlineExceededError(absl::StrCat(Where(op), ": ", call.call, " was still in progress after ",
                                                   absl::FormatDuration(timeout_), "; the communicator is aborted"));
      AbortLocked(status);
      return status;
    }
    // mu_ is released while waiting: Abort() from another thread ends the wait at once.
    if (mu_.AwaitWithTimeout(absl::Condition(&aborted_), kPollPeriod)) return Unavailable(op);
  }
}

absl::StatusOr<cudaEvent_t> NcclCommunicator::Impl::Track(const char* op) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOE_COMM_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) return nullptr;  // the graph's launches run it, later
  cudaEvent_t event = nullptr;
  if (spare_events_.empty()) {
    MOE_COMM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  } else {
    event = spare_events_.back();
    spare_events_.pop_back();
  }
  if (const cudaError_t err = cudaEventRecord(event, stream_); err != cudaSuccess) {
    spare_events_.push_back(event);
    return internal::CudaStatus(err, "cudaEventRecord(event, stream_)", __FILE__, __LINE__);
  }
  pending_.push_back({event, absl::Now(), op});
  return event;
}

absl::Status NcclCommunicator::Impl::WaitForEvent(const char* op, cudaEvent_t event) {
  // The watchdog aborts the communicator if the event is late, which ends this wait too.
  for (;;) {
    if (aborted_) return Unavailable(op);
    const cudaError_t err = cudaEventQuery(event);
    if (err == cudaSuccess) return absl::OkStatus();
    if (err != cudaErrorNotReady) {
      const absl::Status status =
          core::Annotate(internal::CudaStatus(err, "cudaEventQuery(event)", __FILE__, __LINE__), Where(op));
      AbortLocked(status);
      return status;
    }
    (void)mu_.AwaitWithTimeout(absl::Condition(&aborted_), kPollPeriod);
  }
}

absl::Status NcclCommunicator::Impl::Unavailable(const char* op) const {
  return absl::UnavailableError(absl::StrCat(Where(op), ": the communicator was aborted (", error_.message(),
                                             "); create a new one with a new unique id"));
}

void NcclCommunicator::Impl::AbortLocked(const absl::Status& why) {
  if (aborted_) return;
  aborted_ = true;
  if (error_.ok()) error_ = why;
  MOE_LOG(kWarning) << Describe() << ": aborting the communicator: " << why.message();
  if (comm_ != nullptr) {
    const ncclResult_t r = ncclCommAbort(comm_);
    if (r != ncclSuccess) {
      MOE_LOG(kWarning) << Describe() << ": "
                        << internal::NcclStatus(r, nullptr, "ncclCommAbort(comm_)", __FILE__, __LINE__).message();
    }
    comm_ = nullptr;
  }
}

void NcclCommunicator::Impl::Abort(const absl::Status& why) {
  DeviceGuard guard(device_);
  absl::MutexLock lock(&mu_);
  AbortLocked(why);
}

void NcclCommunicator::Impl::WatchdogLoop() {
  (void)cudaSetDevice(device_);  // the events are this GPU's
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), kWatchdogPeriod)) {
    if (!aborted_) WatchOnce();
  }
}

void NcclCommunicator::Impl::WatchOnce() {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) {
    return AbortLocked(internal::NcclStatus(r, comm_, "ncclCommGetAsyncError(comm_, &state)", __FILE__, __LINE__));
  }
  if (state != ncclSuccess && state != ncclInProgress) {
    return AbortLocked(
        core::Annotate(internal::NcclStatus(state, comm_, "an operation queued on the stream", __FILE__, __LINE__),
                       absl::StrCat(Describe(), ": asynchronous NCCL error")));
  }
  while (!pending_.empty()) {
    const Pending& head = pending_.front();
    const cudaError_t err = cudaEventQuery(head.event);
    if (err == cudaSuccess) {
      spare_events_.push_back(head.event);
      pending_.pop_front();
      continue;
    }
    if (err != cudaErrorNotReady) {
      return AbortLocked(core::Annotate(internal::CudaStatus(err, "cudaEventQuery(head.event)", __FILE__, __LINE__),
                                        absl::StrCat(Where(head.op), ": the stream failed")));
    }
    if (absl::Now() - head.queued > timeout_) {
      return AbortLocked(absl::DeadlineExceededError(absl::StrCat(
          Where(head.op), ": queued ", absl::FormatDuration(absl::Now() - head.queued), " ago and not done (timeout ",
          absl::FormatDuration(timeout_), "): a peer is lost or stuck, or the stream's earlier work is that slow")));
    }
    return;
  }
}

NcclCommunicator::Impl::~Impl() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  watchdog_.join();
  DeviceGuard guard(device_);
  absl::MutexLock lock(&mu_);
  if (comm_ != nullptr) {
    // Finalize flushes the queued work; then destroy frees the rest. A communicator that does not
    // get there in time (a peer that never finalizes) is aborted instead.
    absl::Status finalized =
        internal::NcclStatus(ncclCommFinalize(comm_), comm_, "ncclCommFinalize(comm_)", __FILE__, __LINE__);
    if (finalized.ok()) {
      finalized = PollUntilDone(comm_, "ncclCommFinalize(comm_)", absl::Now() + std::min(timeout_, kMaxFinalizeWait));
    }
    if (finalized.ok()) {
      (void)ncclCommDestroy(comm_);
    } else {
      MOE_LOG(kWarning) << Describe() << ": aborting at destruction: " << finalized.message();
      (void)ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }
  for (const Pending& p : pending_) (void)cudaEventDestroy(p.event);
  for (cudaEvent_t e : spare_events_) (void)cudaEventDestroy(e);
  if (scratch_ != nullptr) (void)cudaFree(scratch_);
  (void)cudaGetLastError();
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(std::string_view unique_id, int rank,
                                                                           int size, int cuda_device, void* stream,
                                                                           absl::Duration timeout) {
  const std::string where = absl::StrCat("NCCL rank ", rank, " of ", size, " on GPU ", cuda_device);
  if (unique_id.size() != sizeof(ncclUniqueId)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the unique id has ", unique_id.size(),
                                                   " bytes; NcclUniqueId() makes ", sizeof(ncclUniqueId)));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the rank must be in [0, size) and size at least 1"));
  }
  if (timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError(absl::StrCat(where, ": timeout <= 0"));
  const int gpus = internal::VisibleGpuCount();
  if (cuda_device < 0 || cuda_device >= gpus) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": GPU ", cuda_device, " is not visible (this process sees ",
                                                   gpus, " GPUs; check CUDA_VISIBLE_DEVICES)"));
  }
  DeviceGuard guard(cuda_device);
  if (!guard.ok()) return core::Annotate(guard.status(), where);

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns; a lost peer cannot hang this thread
  ncclComm_t comm = nullptr;
  const ncclResult_t init = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  absl::Status status =
      internal::NcclStatus(init, comm, "ncclCommInitRankConfig(&comm, size, id, rank, &config)", __FILE__, __LINE__);
  if (status.ok()) status = PollUntilDone(comm, "ncclCommInitRankConfig", absl::Now() + timeout);
  if (status.code() == absl::StatusCode::kDeadlineExceeded) {
    status = absl::DeadlineExceededError(absl::StrCat("not every rank joined within ", absl::FormatDuration(timeout),
                                                      " (did all ", size, " ranks start, with the same unique id?)"));
  }
  float* scratch = nullptr;
  if (status.ok()) {
    if (const cudaError_t err = cudaMalloc(&scratch, sizeof(float)); err != cudaSuccess) {
      status = internal::CudaStatus(err, "cudaMalloc(&scratch, sizeof(float))", __FILE__, __LINE__);
    } else if (const cudaError_t set = cudaMemset(scratch, 0, sizeof(float)); set != cudaSuccess) {
      status = internal::CudaStatus(set, "cudaMemset(scratch, 0, sizeof(float))", __FILE__, __LINE__);
    }
  }
  if (!status.ok()) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    if (scratch != nullptr) (void)cudaFree(scratch);
    return core::Annotate(status, where);
  }
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(
      std::make_unique<Impl>(rank, size, cuda_device, static_cast<cudaStream_t>(stream), timeout, comm, scratch)));
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclCommunicator::~NcclCommunicator() = default;

int NcclCommunicator::rank() const { return impl_->rank(); }
int NcclCommunicator::size() const { return impl_->size(); }
int NcclCommunicator::cuda_device() const { return impl_->device(); }

absl::Status NcclCommunicator::AllReduceSum(void* data, int64_t count, core::DType dtype) {
  MOE_RETURN_IF_ERROR(internal::CheckSummable(impl_->Where("all-reduce"), dtype));
  MOE_RETURN_IF_ERROR(internal::CheckBuffer(impl_->Where("all-reduce"), data, count, core::DTypeSize(dtype)));
  const ncclDataType_t type = NcclType(dtype);
  cudaStream_t stream = impl_->stream();
  return impl_->Enqueue("all-reduce", [&](ncclComm_t comm) {
    if (count == 0) return NcclCall{};
    return MOE_NCCL_CALL(ncclAllReduce(data, data, static_cast<size_t>(count), type, ncclSum, comm, stream));
  });
}

absl::Status NcclCommunicator::AllGather(const void* send, void* recv, int64_t bytes_per_rank) {
  MOE_RETURN_IF_ERROR(
      internal::CheckAllGather(impl_->Where("all-gather"), send, recv, bytes_per_rank, rank(), size()).status());
  cudaStream_t stream = impl_->stream();
  return impl_->Enqueue("all-gather", [&](ncclComm_t comm) {
    if (bytes_per_rank == 0) return NcclCall{};
    return MOE_NCCL_CALL(ncclAllGather(send, recv, static_cast<size_t>(bytes_per_rank), ncclInt8, comm, stream));
  });
}

absl::Status NcclCommunicator::Broadcast(void* data, int64_t bytes, int root) {
  MOE_RETURN_IF_ERROR(internal::CheckRank(impl_->Where("broadcast"), "root", root, size()));
  MOE_RETURN_IF_ERROR(internal::CheckBuffer(impl_->Where("broadcast"), data, bytes, 1));
  cudaStream_t stream = impl_->stream();
  return impl_->Enqueue("broadcast", [&](ncclComm_t comm) {
    if (bytes == 0) return NcclCall{};
    return MOE_NCCL_CALL(ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclInt8, root, comm, stream));
  });
}

absl::Status NcclCommunicator::Send(const void* data, int64_t bytes, int peer) {
  MOE_RETURN_IF_ERROR(internal::CheckPeer(impl_->Where("send"), peer, rank(), size()));
  MOE_RETURN_IF_ERROR(internal::CheckBuffer(impl_->Where("send"), data, bytes, 1));
  cudaStream_t stream = impl_->stream();
  return impl_->Enqueue("send", [&](ncclComm_t comm) {
    return MOE_NCCL_CALL(ncclSend(data, static_cast<size_t>(bytes), ncclInt8, peer, comm, stream));
  });
}

absl::Status NcclCommunicator::Recv(void* data, int64_t bytes, int peer) {
  MOE_RETURN_IF_ERROR(internal::CheckPeer(impl_->Where("recv"), peer, rank(), size()));
  MOE_RETURN_IF_ERROR(internal::CheckBuffer(impl_->Where("recv"), data, bytes, 1));
  cudaStream_t stream = impl_->stream();
  return impl_->Enqueue("recv", [&](ncclComm_t comm) {
    return MOE_NCCL_CALL(ncclRecv(data, static_cast<size_t>(bytes), ncclInt8, peer, comm, stream));
  });
}

absl::Status NcclCommunicator::SendRecv(const void* send, int send_peer, void* recv, int recv_peer, int64_t bytes) {
  MOE_RETURN_IF_ERROR(
      internal::CheckSendRecv(impl_->Where("send-recv"), send, send_peer, recv, recv_peer, bytes, rank(), size()));
  cudaStream_t stream = impl_->stream();
  const size_t n = static_cast<size_t>(bytes);
  return impl_->Enqueue("send-recv", [&](ncclComm_t comm) {
    // One group: both are in flight together, so a rank may exchange with itself or its ring.
    const NcclCall start = MOE_NCCL_CALL(ncclGroupStart());
    if (start.result != ncclSuccess) return start;
    const NcclCall out = MOE_NCCL_CALL(ncclSend(send, n, ncclInt8, send_peer, comm, stream));
    const NcclCall in = MOE_NCCL_CALL(ncclRecv(recv, n, ncclInt8, recv_peer, comm, stream));
    const NcclCall end = MOE_NCCL_CALL(ncclGroupEnd());
    if (out.result != ncclSuccess) return out;
    if (in.result != ncclSuccess) return in;
    return end;
  });
}

absl::Status NcclCommunicator::Barrier() {
  float* scratch = impl_->scratch();
  cudaStream_t stream = impl_->stream();
  return impl_->Enqueue(
      "barrier",
      [&](ncclComm_t comm) {
        return MOE_NCCL_CALL(ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclSum, comm, stream));
      },
      /*wait=*/true);
}

void NcclCommunicator::Abort() { impl_->Abort(absl::UnavailableError(absl::StrCat("Abort() on NCCL rank ", rank()))); }

absl::Status NcclCommunicator::AsyncError() const { return impl_->AsyncError(); }

std::string NcclCommunicator::Describe() const { return impl_->Describe(); }

}  // namespace moe::comm
